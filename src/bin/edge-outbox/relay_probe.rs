//! Is a relay running on this database? Any relay (the CLI's or one an application started
//! in-process) holds an exclusive OS lock on `<db>.relay-lock` for its lifetime.
//!
//! On Linux the answer comes from `/proc/locks`, without touching the lock: taking it even for a
//! moment could make a relay starting at that instant fail with "already running". Elsewhere (or
//! without /proc) a shared lock is tried and released at once, which has that small window.

use std::fs::{File, TryLockError};
use std::path::Path;

use crate::db::sibling;

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Probe {
    /// No relay holds the lock (or none ever ran: there is no lock file).
    NotRunning,
    /// A relay holds the lock; the process id when the OS says which.
    Running { pid: Option<u32> },
    /// The lock could not be checked; the reason.
    Unknown(String),
}

pub fn probe(db: &Path) -> Probe {
    let lock = sibling(db, ".relay-lock");
    let file = match File::open(&lock) {
        Ok(f) => f,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Probe::NotRunning,
        Err(e) => return Probe::Unknown(format!("cannot open {}: {e}", lock.display())),
    };
    #[cfg(target_os = "linux")]
    if let Some(found) = from_proc_locks(&file) {
        return found;
    }
    try_shared(&file)
}

/// Looks for a lock on the file's inode in `/proc/locks`; `None` if that cannot be read.
#[cfg(target_os = "linux")]
fn from_proc_locks(file: &File) -> Option<Probe> {
    use std::os::unix::fs::MetadataExt as _;
    let inode = file.metadata().ok()?.ino();
    let table = std::fs::read_to_string("/proc/locks").ok()?;
    Some(parse_proc_locks(&table, inode))
}

/// Lines look like `3: FLOCK  ADVISORY  WRITE 29047 fe:00:5373962 0 EOF`; a waiter's line has
/// `->` after the number and is skipped. Matched on the inode alone: the device numbers printed
/// there are not always those `stat` reports (overlay file systems), and a second locked file
/// with the same inode number on another device is not a case worth a false "not running".
#[cfg(any(target_os = "linux", test))]
fn parse_proc_locks(table: &str, inode: u64) -> Probe {
    for line in table.lines() {
        let fields: Vec<&str> = line.split_whitespace().collect();
        if fields.get(1) == Some(&"->") || fields.len() < 6 {
            continue;
        }
        let ino = fields[5].rsplit(':').next().and_then(|s| s.parse::<u64>().ok());
        if ino == Some(inode) {
            let pid = fields[4].parse::<u32>().ok().filter(|&p| p > 0);
            return Probe::Running { pid };
        }
    }
    Probe::NotRunning
}

fn try_shared(file: &File) -> Probe {
    match file.try_lock_shared() {
        Ok(()) => {
            let _ = file.unlock();
            Probe::NotRunning
        }
        Err(TryLockError::WouldBlock) => Probe::Running { pid: None },
        Err(TryLockError::Error(e)) => Probe::Unknown(format!("cannot check the relay lock: {e}")),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn proc_locks_lines_are_matched_by_inode() {
        let table = "1: FLOCK  ADVISORY  WRITE 21329 fe:00:5644323 0 EOF\n\
                     2: -> FLOCK  ADVISORY  WRITE 400 fe:00:77 0 EOF\n\
                     3: FLOCK  ADVISORY  WRITE 29047 fe:00:77 0 EOF\n";
        assert_eq!(parse_proc_locks(table, 77), Probe::Running { pid: Some(29047) });
        assert_eq!(parse_proc_locks(table, 78), Probe::NotRunning);
    }

    #[test]
    fn a_held_lock_is_seen_and_left_alone() {
        let dir = std::env::temp_dir().join(format!("edge-outbox-probe-{}", std::process::id()));
        let _ = std::fs::create_dir_all(&dir);
        let db = dir.join("x.db");
        assert_eq!(probe(&db), Probe::NotRunning);
        let lock = File::create(sibling(&db, ".relay-lock")).unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(probe(&db), Probe::NotRunning);
        assert!(lock.try_lock().is_ok());
        assert!(matches!(probe(&db), Probe::Running { .. }));
        // Probing did not take the lock from its holder.
        assert!(File::open(sibling(&db, ".relay-lock")).is_ok_and(|f| f.try_lock().is_err()));
        let _ = std::fs::remove_dir_all(&dir);
    }
}
