//! Opening the file: permissions, pragmas, schema.

use std::fs::OpenOptions;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use rusqlite::{Connection, ErrorCode};

use super::options::Options;
use super::schema;
use crate::error::{Error, Result};

/// Opens one connection to the store at `path`, creating and migrating it if needed. Every
/// thread that touches the file gets its own connection from here, with the same pragmas.
pub(crate) fn connect(path: &Path, options: &Options) -> Result<Connection> {
    options.validate()?;
    let mut conn = open_in_wal(path, options.busy_timeout, |conn| {
        // page_size and auto_vacuum only take effect before the first table exists, so set them
        // before WAL mode writes the header; on an existing file they are no-ops. page_size
        // first: once auto_vacuum is set, SQLite keeps the page size it has.
        conn.pragma_update(None, "page_size", options.page_size)?;
        conn.pragma_update(None, "auto_vacuum", "INCREMENTAL")
    })?;
    conn.pragma_update(None, "synchronous", options.synchronous.pragma_value())?;
    conn.pragma_update(None, "journal_size_limit", options.wal_size_limit)?;
    schema::migrate(&mut conn).map_err(|e| match e {
        Error::Sqlite(e) => classify_open_error(path, e),
        other => other,
    })?;
    Ok(conn)
}

/// Opens `path` (created readable by its owner only) in WAL mode, waiting up to `busy_timeout`
/// for other connections; `before_wal` runs once, on a file not yet in WAL mode.
pub(crate) fn open_in_wal(
    path: &Path,
    busy_timeout: Duration,
    before_wal: impl FnOnce(&Connection) -> rusqlite::Result<()>,
) -> Result<Connection> {
    create_owner_only(path)?;
    let on_open = |e: rusqlite::Error| classify_open_error(path, e);
    let conn = Connection::open(path).map_err(on_open)?;
    conn.busy_timeout(busy_timeout).map_err(on_open)?;
    // WAL mode is a property of the file: once set, reopening needs no lock at all, so a
    // connection opens while another one holds a long write transaction.
    let current: String = conn
        .query_row("PRAGMA journal_mode", [], |r| r.get(0))
        .map_err(on_open)?;
    if !current.eq_ignore_ascii_case("wal") {
        before_wal(&conn).map_err(on_open)?;
        let mode = switch_to_wal(&conn, busy_timeout).map_err(on_open)?;
        if !mode.eq_ignore_ascii_case("wal") {
            return Err(Error::InvalidConfig(format!(
                "{} cannot use WAL mode (got {mode}); put the database on a local file system",
                path.display()
            )));
        }
    }
    Ok(conn)
}

/// Sets WAL mode, waiting up to `timeout` for other connections. Switching a new file to WAL
/// needs an exclusive lock, and SQLite reports contention on it as SQLITE_BUSY at once, without
/// calling the busy handler: several processes opening a new file together would otherwise fail.
fn switch_to_wal(conn: &Connection, timeout: Duration) -> rusqlite::Result<String> {
    let deadline = Instant::now() + timeout;
    loop {
        match conn.pragma_update_and_check(None, "journal_mode", "WAL", |r| r.get(0)) {
            Err(e) if e.sqlite_error_code() == Some(ErrorCode::DatabaseBusy) && Instant::now() < deadline => {
                std::thread::sleep(Duration::from_millis(5));
            }
            result => return result,
        }
    }
}

/// Creates the file readable by its owner only, before SQLite does (SQLite gives its WAL and
/// shared-memory files the database file's permissions).
fn create_owner_only(path: &Path) -> Result<()> {
    if path.exists() {
        return Ok(());
    }
    if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
        create_dir_owner_only(dir)?;
    }
    let mut open = OpenOptions::new();
    open.write(true).create_new(true);
    #[cfg(unix)]
    std::os::unix::fs::OpenOptionsExt::mode(&mut open, 0o600);
    match open.open(path) {
        Ok(_) => Ok(()),
        // Another process created it between our check and our open: theirs is as good.
        Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => Ok(()),
        Err(e) => Err(Error::io(format!("creating {}", path.display()), e)),
    }
}

fn classify_open_error(path: &Path, e: rusqlite::Error) -> Error {
    match e.sqlite_error_code() {
        Some(ErrorCode::NotADatabase) => Error::NotADatabase {
            path: path.to_path_buf(),
        },
        Some(ErrorCode::DatabaseCorrupt) => Error::Corrupt {
            path: path.to_path_buf(),
            detail: e.to_string(),
        },
        Some(ErrorCode::ReadOnly | ErrorCode::CannotOpen | ErrorCode::PermissionDenied)
            if is_read_only(path) =>
        {
            Error::ReadOnly {
                path: path.to_path_buf(),
            }
        }
        _ => Error::from(e),
    }
}

/// The file cannot be written: a read-only mount (which stops root too), or permissions.
fn is_read_only(path: &Path) -> bool {
    let refused = |e: &std::io::Error| {
        matches!(
            e.kind(),
            std::io::ErrorKind::ReadOnlyFilesystem | std::io::ErrorKind::PermissionDenied
        )
    };
    // Opening for append changes nothing, and asks the kernel rather than guessing from modes.
    if OpenOptions::new()
        .append(true)
        .open(path)
        .is_err_and(|e| refused(&e))
    {
        return true;
    }
    let dir = path
        .parent()
        .filter(|d| !d.as_os_str().is_empty())
        .unwrap_or(Path::new("."));
    std::fs::metadata(dir).is_ok_and(|m| m.permissions().readonly())
}

/// Where an application's store lives by default: the platform data directory for `app`
/// (e.g. `~/.local/share/<app>/outbox.db` on Linux), created owner-only if missing.
pub fn default_path(app: &str) -> Result<PathBuf> {
    if app.is_empty() {
        return Err(Error::InvalidConfig("application name is empty".into()));
    }
    let dirs = directories::ProjectDirs::from("", "", app).ok_or(Error::NoDataDir)?;
    let dir = dirs.data_dir();
    create_dir_owner_only(dir)?;
    Ok(dir.join("outbox.db"))
}

/// Creates `dir` and any missing parents readable by their owner only (0700), whatever the
/// umask; directories that exist are left as they are.
fn create_dir_owner_only(dir: &Path) -> Result<()> {
    let mut builder = std::fs::DirBuilder::new();
    builder.recursive(true);
    #[cfg(unix)]
    std::os::unix::fs::DirBuilderExt::mode(&mut builder, 0o700);
    builder
        .create(dir)
        .map_err(|e| Error::io(format!("creating directory {}", dir.display()), e))
}
