//! Child processes that cannot outlive their test: [`ChildGuard`] kills (SIGKILL, by pid) and
//! reaps its process when dropped, so a test that fails or panics leaves nothing running.

use std::ops::{Deref, DerefMut};
use std::process::Child;

/// A spawned process, killed and reaped on drop unless it already exited.
#[derive(Debug)]
pub struct ChildGuard(Option<Child>);

impl ChildGuard {
    pub fn new(child: Child) -> ChildGuard {
        ChildGuard(Some(child))
    }

    /// Gives the process back without killing it (the caller takes over).
    pub fn into_inner(mut self) -> Child {
        self.0
            .take()
            .expect("a guard always holds its child until dropped")
    }

    /// SIGKILL (if still running) and reap, now.
    pub fn kill_and_wait(&mut self) {
        if let Some(child) = self.0.as_mut() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

impl Deref for ChildGuard {
    type Target = Child;

    fn deref(&self) -> &Child {
        self.0
            .as_ref()
            .expect("a guard always holds its child until dropped")
    }
}

impl DerefMut for ChildGuard {
    fn deref_mut(&mut self) -> &mut Child {
        self.0
            .as_mut()
            .expect("a guard always holds its child until dropped")
    }
}

impl Drop for ChildGuard {
    fn drop(&mut self) {
        if let Some(child) = self.0.as_mut()
            && let Ok(None) = child.try_wait()
        {
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}
