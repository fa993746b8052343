//! Calls back into the store from inside a command handler's write transaction.
//!
//! While a handler's record step runs, its connection holds the file's write lock. Another write
//! on the same file from the same thread (through the application's `Outbox`) could only wait for
//! that lock until the busy timeout, and then fail: the transaction it waits for is its own
//! caller's. So the record step notes the file here, and writes check it first and fail at once
//! with [`Error::InsideCommandHandler`]. Reads need no lock in WAL mode and keep working.

use std::cell::RefCell;
use std::path::{Path, PathBuf};

use crate::error::{Error, Result};

thread_local! {
    /// Files whose write lock a handler on this thread holds (nested handlers push more).
    static HELD: RefCell<Vec<PathBuf>> = const { RefCell::new(Vec::new()) };
}

/// Marks `path`'s write lock as held by this thread until dropped.
pub(crate) struct WriteLockHeld(());

pub(crate) fn hold_write_lock(path: &Path) -> WriteLockHeld {
    HELD.with(|held| held.borrow_mut().push(path.to_path_buf()));
    WriteLockHeld(())
}

impl Drop for WriteLockHeld {
    fn drop(&mut self) {
        HELD.with(|held| held.borrow_mut().pop());
    }
}

/// Fails with [`Error::InsideCommandHandler`] if this thread is inside a handler holding the
/// write lock of `path`.
pub(crate) fn check_can_write(path: &Path, operation: &'static str) -> Result<()> {
    if HELD.with(|held| held.borrow().iter().any(|p| p == path)) {
        return Err(Error::InsideCommandHandler { operation });
    }
    Ok(())
}

/// The path the guard compares: the file's canonical path when it can be resolved, so two
/// spellings of one file match.
pub(crate) fn canonical(path: &Path) -> PathBuf {
    std::fs::canonicalize(path).unwrap_or_else(|_| path.to_path_buf())
}
