//! One queue for the writers of a file inside this process.
//!
//! SQLite lets one connection write at a time, and a connection that finds the lock taken polls:
//! it sleeps 1, 2, 5, 10 ... up to 100 ms between tries. Against a writer that commits again and
//! again (the command session storing a backlog, one transaction per command), a poller keeps
//! waking up just after the lock was taken again and starves: the application's transactions
//! took seconds during a command flood. So the crate's own connections to one file queue here,
//! first come first served, before they take SQLite's lock; a waiter is woken the moment the
//! writer before it is done. Other processes still meet SQLite's lock as before.
//!
//! Order, to stay free of deadlocks: the gate is taken before a handle's connection mutex, and
//! code holding the gate takes no other gate.

use std::collections::{HashMap, VecDeque};
use std::path::PathBuf;
use std::sync::{Arc, Condvar, Mutex, MutexGuard, OnceLock, PoisonError, Weak};
use std::time::{Duration, Instant};

use rusqlite::Connection;

use crate::error::{Error, Result};

#[derive(Default)]
struct Queue {
    held: bool,
    waiting: VecDeque<u64>,
    next_ticket: u64,
}

/// The writers' queue of one file.
#[derive(Default)]
pub(crate) struct WriteGate {
    queue: Mutex<Queue>,
    turn: Condvar,
}

/// This thread's turn to write; the next writer's turn comes when it is dropped.
pub(crate) struct Turn(Arc<WriteGate>);

impl Drop for Turn {
    fn drop(&mut self) {
        self.0.lock_queue().held = false;
        self.0.turn.notify_all();
    }
}

impl WriteGate {
    fn lock_queue(&self) -> MutexGuard<'_, Queue> {
        // Nothing panics while holding it; a poisoned queue is still consistent.
        self.queue.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Waits for this thread's turn, at most `timeout` ([`Error::Busy`] then, as SQLite's busy
    /// timeout would).
    pub(crate) fn enter(self: &Arc<Self>, timeout: Duration) -> Result<Turn> {
        let deadline = Instant::now() + timeout;
        let mut q = self.lock_queue();
        let ticket = q.next_ticket;
        q.next_ticket += 1;
        q.waiting.push_back(ticket);
        loop {
            if !q.held && q.waiting.front() == Some(&ticket) {
                q.waiting.pop_front();
                q.held = true;
                return Ok(Turn(Arc::clone(self)));
            }
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                q.waiting.retain(|t| *t != ticket);
                drop(q);
                // The next in line may be able to go now.
                self.turn.notify_all();
                return Err(Error::Busy);
            }
            q = self
                .turn
                .wait_timeout(q, left)
                .unwrap_or_else(PoisonError::into_inner)
                .0;
        }
    }
}

/// Every file's gate in this process: by canonical path (what makes two names of one file share
/// a queue), and by the name a connection holds, so that only a name's first lookup resolves it on
/// disk: writers that take the gate per transaction (the marker, the command intake) would
/// otherwise pay a path walk and its system calls on every commit.
#[derive(Default)]
struct Gates {
    by_file: HashMap<PathBuf, Weak<WriteGate>>,
    by_name: HashMap<String, Weak<WriteGate>>,
}

/// The gate of the file `conn` is open on: one per file per process.
pub(crate) fn of(conn: &Connection) -> Arc<WriteGate> {
    static GATES: OnceLock<Mutex<Gates>> = OnceLock::new();
    let lock = || {
        GATES
            .get_or_init(Mutex::default)
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
    };
    let name = conn.path().unwrap_or_default();
    if let Some(gate) = lock().by_name.get(name).and_then(Weak::upgrade) {
        return gate;
    }
    // Resolved outside the lock: it touches the disk.
    let key = std::fs::canonicalize(name).unwrap_or_else(|_| PathBuf::from(name));
    let mut gates = lock();
    let gate = match gates.by_file.get(&key).and_then(Weak::upgrade) {
        Some(gate) => gate,
        None => {
            gates.by_file.retain(|_, g| g.strong_count() > 0);
            gates.by_name.retain(|_, g| g.strong_count() > 0);
            let gate = Arc::new(WriteGate::default());
            gates.by_file.insert(key, Arc::downgrade(&gate));
            gate
        }
    };
    gates.by_name.insert(name.to_owned(), Arc::downgrade(&gate));
    gate
}

/// Waits for a turn to write on `conn`'s file.
pub(crate) fn enter(conn: &Connection, timeout: Duration) -> Result<Turn> {
    of(conn).enter(timeout)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn writers_go_in_arrival_order_and_a_timeout_leaves_the_queue() {
        let gate = Arc::new(WriteGate::default());
        let first = gate.enter(Duration::from_secs(5)).expect("first");
        assert!(matches!(gate.enter(Duration::from_millis(20)), Err(Error::Busy)));
        let order = Arc::new(Mutex::new(Vec::new()));
        let waiters: Vec<_> = (0..4)
            .map(|i| {
                let (waiter, order) = (gate.clone(), order.clone());
                let t = std::thread::spawn(move || {
                    let _turn = waiter.enter(Duration::from_secs(30)).expect("turn");
                    order.lock().expect("order").push(i);
                });
                // Queue them one after the other.
                while gate.lock_queue().waiting.len() < i + 1 {
                    std::thread::yield_now();
                }
                t
            })
            .collect();
        drop(first);
        for w in waiters {
            w.join().expect("waiter");
        }
        assert_eq!(*order.lock().expect("order"), vec![0, 1, 2, 3]);
    }

    #[cfg(unix)]
    #[test]
    fn two_names_of_one_file_share_a_gate_and_another_file_has_its_own() {
        let dir = tempfile::tempdir().expect("dir");
        let file = dir.path().join("a.db");
        let other = dir.path().join("b.db");
        let link = dir.path().join("link.db");
        let open = |p: &std::path::Path| Connection::open(p).expect("open");
        let (a, b) = (open(&file), open(&other));
        std::os::unix::fs::symlink(&file, &link).expect("symlink");
        let via_link = open(&link);
        let gate = of(&a);
        assert!(Arc::ptr_eq(&gate, &of(&a)), "the same name, looked up again");
        // SQLite may resolve the link itself (its Unix builds do): one gate either way.
        assert!(
            Arc::ptr_eq(&gate, &of(&via_link)),
            "another name of the same file"
        );
        assert!(!Arc::ptr_eq(&gate, &of(&b)), "another file");
        // A gate nobody holds is made anew, and the name then finds the new one.
        drop(gate);
        let fresh = of(&a);
        assert!(Arc::ptr_eq(&fresh, &of(&via_link)));
    }
}
