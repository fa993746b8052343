//! The durability barrier: a row is published only once its commit is on stable storage, whoever
//! wrote it and with whatever `synchronous` setting.
//!
//! A writer in another process may commit with `synchronous = NORMAL`: its commit is in the WAL
//! file but not synced until the next checkpoint. If the relay published it and the power went,
//! the business change would be gone while the cloud has its event (and its sequence number
//! would be used again). So before publishing rows it has not seen synced, the relay syncs the WAL
//! file itself: one `fsync`, with no SQLite lock and no write, so neither a writer holding a long
//! transaction nor the relay's own pace is in the way. Everything committed before the sync is
//! covered (a commit's frames are written to the WAL before the commit returns); what a checkpoint
//! already moved into the database file was synced by that checkpoint (`NORMAL` and `FULL` both
//! sync it; `OFF` promises nothing and is not supported).

use std::fs::File;
use std::path::{Path, PathBuf};

use rusqlite::{Connection, OptionalExtension};

use crate::error::{Error, Result};

pub(crate) struct Barrier {
    wal: PathBuf,
    dir: PathBuf,
    /// The WAL file whose name is known to be durable (its inode), after a directory sync.
    named: Option<u64>,
}

impl Barrier {
    pub(crate) fn new(db: &Path) -> Self {
        let wal = wal_path(db);
        let dir = wal
            .parent()
            .filter(|d| !d.as_os_str().is_empty())
            .unwrap_or(Path::new("."))
            .to_path_buf();
        Barrier {
            wal,
            dir,
            named: None,
        }
    }

    /// Makes every commit so far durable. Returns the highest outbox sequence number committed
    /// before it: every row up to it is on stable storage now (one writer at a time, and a higher
    /// `seq` always commits later), so rows read later up to that number need no barrier of their
    /// own (a backlog needs one, not one per read).
    pub(crate) fn sync(&mut self, conn: &Connection) -> Result<i64> {
        // Read first: what it counts was committed, and so written to the WAL, before the sync.
        let high: i64 = conn
            .prepare_cached("SELECT seq FROM sqlite_sequence WHERE name = 'outbox'")?
            .query_row([], |r| r.get(0))
            .optional()?
            .unwrap_or(0);
        let wal = match File::open(&self.wal) {
            Ok(f) => f,
            // No WAL: everything was checkpointed into the database file, and synced then.
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(high),
            Err(e) => return Err(Error::io(format!("opening {} to sync it", self.wal.display()), e)),
        };
        // fsync on any descriptor syncs the file's data (Linux and the BSDs).
        wal.sync_data()
            .map_err(|e| Error::io(format!("syncing {}", self.wal.display()), e))?;
        // A new WAL file's name is durable only once its directory is synced (SQLite does that
        // at its first sync of the file, which a NORMAL writer may not have reached yet).
        let inode = inode(&wal);
        if inode.is_none() || inode != self.named {
            File::open(&self.dir)
                .and_then(|d| d.sync_all())
                .map_err(|e| Error::io(format!("syncing directory {}", self.dir.display()), e))?;
            self.named = inode;
        }
        Ok(high)
    }
}

/// The WAL file of the database at `db`. SQLite puts it beside the file a symlink points to.
pub(crate) fn wal_path(db: &Path) -> PathBuf {
    let db = std::fs::canonicalize(db).unwrap_or_else(|_| db.to_path_buf());
    let mut wal = db.into_os_string();
    wal.push("-wal");
    PathBuf::from(wal)
}

#[cfg(unix)]
fn inode(f: &File) -> Option<u64> {
    use std::os::unix::fs::MetadataExt as _;
    f.metadata().ok().map(|m| m.ino())
}

#[cfg(not(unix))]
fn inode(_: &File) -> Option<u64> {
    None
}
