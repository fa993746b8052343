//! One relay per database file: an OS lock on a file beside it.

use std::fs::{File, OpenOptions, TryLockError};
use std::path::{Path, PathBuf};

use crate::error::{Error, Result};

/// Held for the relay's lifetime; the OS releases it when the process dies, so a crashed relay
/// never blocks its successor. Other processes may still read and write the database itself.
#[derive(Debug)]
pub(crate) struct RelayLock {
    _file: File,
    path: PathBuf,
}

impl RelayLock {
    pub(crate) fn acquire(db_path: &Path) -> Result<Self> {
        let mut name = db_path.as_os_str().to_owned();
        name.push(".relay-lock");
        let path = PathBuf::from(name);
        let file = OpenOptions::new()
            .create(true)
            .truncate(false)
            .write(true)
            .open(&path)
            .map_err(|e| Error::io(format!("opening relay lock {}", path.display()), e))?;
        match file.try_lock() {
            Ok(()) => Ok(RelayLock { _file: file, path }),
            Err(TryLockError::WouldBlock) => Err(Error::RelayAlreadyRunning { lock_path: path }),
            Err(TryLockError::Error(e)) => Err(Error::io(format!("locking {}", path.display()), e)),
        }
    }

    pub(crate) fn path(&self) -> &Path {
        &self.path
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn second_lock_is_refused_until_the_first_is_dropped() {
        let dir = tempfile::tempdir().expect("tempdir");
        let db = dir.path().join("x.db");
        let first = RelayLock::acquire(&db).expect("first");
        let err = RelayLock::acquire(&db).expect_err("second");
        assert!(matches!(err, Error::RelayAlreadyRunning { .. }), "{err}");
        assert!(first.path().ends_with("x.db.relay-lock"));
        drop(first);
        RelayLock::acquire(&db).expect("after release");
    }
}
