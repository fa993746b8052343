//! Child processes that cannot outlive their test.
//!
//! - [`ChildGuard`] kills (SIGKILL, by pid) and reaps its process when dropped, so a test that
//!   fails or panics leaves nothing running.
//! - [`Child`] runs this test binary again as a child process, to test what only a real process
//!   can show (an abort, a process that exits with a thread still stuck). The child is an ignored
//!   test that does nothing unless [`CHILD_ENV`] names what it should do:
//!
//! ```ignore
//! #[test]
//! #[ignore = "entry point of a child process"]
//! fn my_child() {
//!     let Some(mode) = support::child::mode() else { return };
//!     ...; support::child::say("ready");
//! }
//! ```
//!
//!   and the parent runs it with [`Child::start`], reads what it [`say`]s, and waits for it with a
//!   bound, killing it (by pid) if the bound passes.

use std::io::{BufRead, BufReader, Write as _};
use std::ops::{Deref, DerefMut};
use std::process::{Command, ExitStatus, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

/// A spawned process, killed and reaped on drop unless it already exited.
#[derive(Debug)]
pub struct ChildGuard(Option<std::process::Child>);

impl ChildGuard {
    pub fn new(child: std::process::Child) -> ChildGuard {
        ChildGuard(Some(child))
    }

    /// Gives the process back without killing it (the caller takes over).
    pub fn into_inner(mut self) -> std::process::Child {
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
    type Target = std::process::Child;

    fn deref(&self) -> &std::process::Child {
        self.0
            .as_ref()
            .expect("a guard always holds its child until dropped")
    }
}

impl DerefMut for ChildGuard {
    fn deref_mut(&mut self) -> &mut std::process::Child {
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

/// Set in the child: what to do.
pub const CHILD_ENV: &str = "EDGE_OUTBOX_TEST_CHILD";
/// Marks the child's protocol lines (libtest prints on the same stdout).
const MARK: &str = "@child ";

/// In the child: the mode the parent asked for, or `None` in a normal test run.
pub fn mode() -> Option<String> {
    std::env::var(CHILD_ENV).ok().filter(|m| !m.is_empty())
}

/// In the child: one protocol line for the parent, flushed at once (the process may die next).
pub fn say(line: &str) {
    let mut out = std::io::stdout().lock();
    let _ = writeln!(out, "{MARK}{line}");
    let _ = out.flush();
}

/// A running child and the lines it said.
pub struct Child {
    process: ChildGuard,
    lines: mpsc::Receiver<String>,
    said: Vec<String>,
}

impl Child {
    /// Runs the ignored test `entry` of this binary with [`CHILD_ENV`] = `mode` and `env`.
    pub fn start(entry: &str, mode: &str, env: &[(&str, String)]) -> std::io::Result<Child> {
        let mut cmd = Command::new(std::env::current_exe()?);
        cmd.args(["--ignored", "--exact", entry, "--nocapture", "--test-threads=1"])
            .env(CHILD_ENV, mode)
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit());
        for (k, v) in env {
            cmd.env(k, v);
        }
        let mut process = ChildGuard::new(cmd.spawn()?);
        let stdout = process
            .stdout
            .take()
            .ok_or_else(|| std::io::Error::other("no child stdout"))?;
        let (tx, lines) = mpsc::channel();
        std::thread::spawn(move || {
            for line in BufReader::new(stdout).lines() {
                let Ok(line) = line else { break };
                // libtest may have begun the line ("test my_child ... ") without ending it.
                if let Some(at) = line.find(MARK)
                    && tx.send(line[at + MARK.len()..].to_owned()).is_err()
                {
                    break;
                }
            }
        });
        Ok(Child {
            process,
            lines,
            said: Vec::new(),
        })
    }

    /// Kills the child (SIGKILL, by its pid) and reaps it.
    pub fn kill(&mut self) {
        self.process.kill_and_wait();
    }

    /// Waits up to `timeout` for a line starting with `prefix`; returns it.
    pub fn wait_for(&mut self, prefix: &str, timeout: Duration) -> Option<String> {
        if let Some(line) = self.said.iter().find(|l| l.starts_with(prefix)) {
            return Some(line.clone());
        }
        let deadline = Instant::now() + timeout;
        loop {
            let line = self
                .lines
                .recv_timeout(deadline.saturating_duration_since(Instant::now()))
                .ok()?;
            self.said.push(line.clone());
            if line.starts_with(prefix) {
                return Some(line);
            }
        }
    }

    /// Waits up to `timeout` for the child to exit and returns its status and every line it
    /// said; kills it (by its pid) and fails if it does not exit in time.
    pub fn wait(mut self, timeout: Duration) -> std::io::Result<(ExitStatus, Vec<String>)> {
        let deadline = Instant::now() + timeout;
        loop {
            if let Some(status) = self.process.try_wait()? {
                while let Ok(line) = self.lines.recv_timeout(Duration::from_secs(5)) {
                    self.said.push(line);
                }
                return Ok((status, std::mem::take(&mut self.said)));
            }
            if Instant::now() >= deadline {
                self.process.kill_and_wait();
                return Err(std::io::Error::new(
                    std::io::ErrorKind::TimedOut,
                    format!(
                        "the child did not exit within {timeout:?}; it said {:?}",
                        self.said
                    ),
                ));
            }
            // std has no wait with a timeout.
            std::thread::sleep(Duration::from_millis(10));
        }
    }
}
