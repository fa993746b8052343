//! One relay per database file: an OS lock on a file beside it.

use std::fs::{File, OpenOptions, TryLockError};
use std::path::{Path, PathBuf};

use crate::error::{Error, Result};

/// Held for the relay's lifetime; the OS releases it when the process dies, so a crashed relay
/// never blocks its successor. Other processes may still read and write the database itself.
///
/// The lock file is named after the database's canonical path, so two spellings of one file (a
/// symlink, a relative path) take the same lock, and it is readable and writable by its owner
/// only, whatever the umask: another local user who could open it could lock it and keep the relay
/// from starting.
#[derive(Debug)]
pub(crate) struct RelayLock {
    _file: File,
    path: PathBuf,
}

impl RelayLock {
    pub(crate) fn acquire(db_path: &Path) -> Result<Self> {
        let db = std::fs::canonicalize(db_path)
            .map_err(|e| Error::io(format!("resolving {}", db_path.display()), e))?;
        let mut name = db.into_os_string();
        name.push(".relay-lock");
        let path = PathBuf::from(name);
        let mut open = OpenOptions::new();
        open.create(true).truncate(false).write(true);
        #[cfg(unix)]
        std::os::unix::fs::OpenOptionsExt::mode(&mut open, 0o600);
        let file = open
            .open(&path)
            .map_err(|e| Error::io(format!("opening relay lock {}", path.display()), e))?;
        // A lock file an older version created follows the umask of its day: tighten it.
        #[cfg(unix)]
        {
            use std::os::unix::fs::PermissionsExt as _;
            if file.metadata().is_ok_and(|m| m.permissions().mode() & 0o077 != 0) {
                let _ = file.set_permissions(std::fs::Permissions::from_mode(0o600));
            }
        }
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
        std::fs::write(&db, b"").expect("db");
        let first = RelayLock::acquire(&db).expect("first");
        let err = RelayLock::acquire(&db).expect_err("second");
        assert!(matches!(err, Error::RelayAlreadyRunning { .. }), "{err}");
        assert!(first.path().ends_with("x.db.relay-lock"));
        drop(first);
        RelayLock::acquire(&db).expect("after release");
    }

    #[test]
    #[cfg(unix)]
    fn two_spellings_of_one_path_are_one_lock_and_it_is_owner_only() {
        use std::os::unix::fs::PermissionsExt as _;
        let dir = tempfile::tempdir().expect("tempdir");
        let db = dir.path().join("x.db");
        std::fs::write(&db, b"").expect("db");
        let link = dir.path().join("link.db");
        std::os::unix::fs::symlink(&db, &link).expect("symlink");
        let dotted = dir.path().join(".").join("sub").join("..").join("x.db");
        std::fs::create_dir(dir.path().join("sub")).expect("sub");
        let first = RelayLock::acquire(&link).expect("via the link");
        for other in [&db, &dotted] {
            let err = RelayLock::acquire(other).expect_err("same file");
            assert!(matches!(err, Error::RelayAlreadyRunning { .. }), "{err}");
        }
        let mode = std::fs::metadata(first.path())
            .expect("lock")
            .permissions()
            .mode()
            & 0o777;
        assert_eq!(mode, 0o600);
    }
}
