//! Finding and opening the database.
//!
//! Reading commands open it read-only with plain SQLite against the documented schema
//! (docs/schema.md): they never create, migrate or lock it for writing, so they work while the
//! application holds the write lock and with read access only. Writing commands go through
//! [`edge_outbox::Outbox`], after the same checks, so they never create a file either.

use std::path::{Path, PathBuf};
use std::time::Duration;

use edge_outbox::{Options, Outbox, SCHEMA_VERSION};
use rusqlite::{Connection, ErrorCode, OpenFlags};

use crate::exit::{CliError, Code};
use crate::{Global, Result};

/// The database path: `--db`, or the default of `--app` computed without creating anything
/// (`edge_outbox::default_path` also creates the directory; the relay uses that).
pub fn path(global: &Global) -> Result<PathBuf> {
    if let Some(db) = &global.db {
        return Ok(db.clone());
    }
    if global.app.is_empty() {
        return Err(CliError::usage("--app must not be empty"));
    }
    let dirs = directories::ProjectDirs::from("", "", &global.app).ok_or_else(|| {
        CliError::database("no data directory found for this user (is HOME set?): pass --db PATH")
    })?;
    Ok(dirs.data_dir().join("outbox.db"))
}

/// The path a command that may create the file uses (the relay): `--db`, or
/// `edge_outbox::default_path(app)`, which creates the directory owner-only.
pub fn path_creating_dir(global: &Global) -> Result<PathBuf> {
    match &global.db {
        Some(db) => Ok(db.clone()),
        None => Ok(edge_outbox::default_path(&global.app)?),
    }
}

/// Fails unless `path` is an existing regular file (checked before SQLite could create it).
pub fn require_file(path: &Path) -> Result<()> {
    match std::fs::metadata(path) {
        Ok(m) if m.is_file() => Ok(()),
        Ok(_) => Err(CliError::database(format!(
            "{} is not a regular file: pass the database file with --db",
            path.display()
        ))),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Err(CliError::database(format!(
            "no database at {} (nothing was created): check --db, or start the application or \
             `edge-outbox relay` first",
            path.display()
        ))),
        Err(e) => Err(CliError::database(format!("cannot read {}: {e}", path.display()))),
    }
}

/// A read-only connection to an existing edge-outbox database whose schema this build reads.
pub fn open_read(global: &Global, path: &Path) -> Result<Connection> {
    require_file(path)?;
    let on_err = |e| sqlite_error(path, e);
    let flags = OpenFlags::SQLITE_OPEN_READ_ONLY | OpenFlags::SQLITE_OPEN_NO_MUTEX;
    let conn = Connection::open_with_flags(path, flags).map_err(on_err)?;
    conn.busy_timeout(Duration::from_millis(global.busy_timeout))
        .map_err(on_err)?;
    check_schema(&conn, path)?;
    Ok(conn)
}

/// The store opened for writing (dead-letter retry and drop), after the read-only checks, so a
/// missing file, another application's database or a newer schema is refused untouched.
pub fn open_write(global: &Global, path: &Path) -> Result<Outbox> {
    drop(open_read(global, path)?);
    open_outbox(global, path)
}

/// The store through the library, creating the file if needed (the relay).
pub fn open_outbox(global: &Global, path: &Path) -> Result<Outbox> {
    open_outbox_with(global, path, None)
}

/// The type of `--trusted-key`'s keys: `TrustedKeys`, or nothing without the feature.
#[cfg(feature = "signed-commands")]
pub type Keys = edge_outbox::TrustedKeys;
#[cfg(not(feature = "signed-commands"))]
pub type Keys = std::convert::Infallible;

/// [`open_outbox`], requiring commands signed by `keys` when given (the relay's `--trusted-key`).
/// Without keys the file's own policy still holds: every handle verifies with it.
pub fn open_outbox_with(global: &Global, path: &Path, keys: Option<Keys>) -> Result<Outbox> {
    let options = Options::new().busy_timeout(Duration::from_millis(global.busy_timeout));
    #[cfg(feature = "signed-commands")]
    let options = match keys {
        Some(keys) => options.trusted_command_keys(keys),
        None => options,
    };
    #[cfg(not(feature = "signed-commands"))]
    let _ = keys;
    Outbox::open_with(path, options).map_err(|e| {
        let busy = matches!(e, edge_outbox::Error::Busy);
        let e = CliError::from(e);
        if busy {
            CliError::new(e.code(), format!("{}: {e}", path.display()))
        } else {
            e
        }
    })
}

fn check_schema(conn: &Connection, path: &Path) -> Result<()> {
    let version = edge_outbox::schema_version(conn).map_err(|e| library_error(path, e))?;
    if version == 0 {
        return Err(CliError::database(format!(
            "{} has no edge-outbox tables: check --db (the application, or `edge-outbox relay`, \
             creates them on first open)",
            path.display()
        )));
    }
    if version > SCHEMA_VERSION {
        return Err(edge_outbox::Error::SchemaTooNew {
            found: version,
            supported: SCHEMA_VERSION,
        }
        .into());
    }
    Ok(())
}

/// A SQLite error while reading `path`, said in terms an operator can act on.
/// A library error on `path`: SQLite failures get the same path-specific messages as
/// [`sqlite_error`]; the rest their documented codes.
pub fn library_error(path: &Path, e: edge_outbox::Error) -> CliError {
    match e {
        edge_outbox::Error::Sqlite(e) => sqlite_error(path, e),
        edge_outbox::Error::Busy => locked(path),
        other => other.into(),
    }
}

fn locked(path: &Path) -> CliError {
    CliError::database(format!(
        "{}: database is locked by another connection for longer than the busy timeout: \
         retry, or raise --busy-timeout",
        path.display()
    ))
}

pub fn sqlite_error(path: &Path, e: rusqlite::Error) -> CliError {
    let p = path.display();
    match e.sqlite_error_code() {
        Some(ErrorCode::NotADatabase) => CliError::database(format!(
            "{p} is not an SQLite database (or is encrypted): check --db"
        )),
        Some(ErrorCode::DatabaseBusy | ErrorCode::DatabaseLocked) => locked(path),
        Some(ErrorCode::CannotOpen | ErrorCode::PermissionDenied) => CliError::database(format!(
            "cannot open {p}: {e} (check the permissions of the file and its directory)"
        )),
        Some(_) => CliError::database(format!("{p}: database error: {e}")),
        None => CliError::new(Code::Runtime, format!("{p}: {e}")),
    }
}

/// Size of a file in bytes; 0 when it does not exist.
pub fn file_size(path: &Path) -> u64 {
    std::fs::metadata(path).map_or(0, |m| m.len())
}

/// `<db><suffix>`: the WAL (`-wal`), the relay lock (`.relay-lock`), the relay status file.
pub fn sibling(db: &Path, suffix: &str) -> PathBuf {
    // Of the canonical path, as the relay's lock is: two spellings of one database (a symlink,
    // `./x.db` and `x.db`) name the same lock and status file.
    let db = std::fs::canonicalize(db).unwrap_or_else(|_| db.to_path_buf());
    let mut name = db.into_os_string();
    name.push(suffix);
    PathBuf::from(name)
}
