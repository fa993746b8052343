//! Latest-value telemetry without a transaction per reading: the newest value of each (topic,
//! key) is kept in memory and committed with the others at a bounded interval, as coalescing
//! messages (see [`LatestValues`]).
//!
//! A sensor read ten times a second and sent as a coalescing message per reading costs a commit
//! per reading: WAL frames for the row, its index entries and the counters, and later the mark
//! and the checkpoint, whatever the relay then coalesces. Here a reading replaces the previous
//! one in memory, and one commit per interval carries the latest of every key.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, MutexGuard};
use std::thread::JoinHandle;
use std::time::Duration;

use crossbeam_channel::{Receiver, RecvTimeoutError, Sender};
use serde::Serialize;

use crate::error::{Error, Result};
use crate::store::{Message, Outbox};

/// The newest value of each (topic, key), committed together every `interval` by a thread of its
/// own, as coalescing messages ([`Message::coalescing`]): the relay publishes the latest value
/// of each key, and a value the relay has not claimed yet is replaced in the file too.
///
/// **Durability, plainly:** a value is durable once its interval's commit returns (with
/// `synchronous = FULL`, or once the WAL is synced under NORMAL), exactly as a message committed
/// by hand; a value set since the last successful commit is in memory only, and a power cut or a
/// crash loses it (one `interval` of readings while commits succeed, of which only the latest per
/// key mattered; longer while the file refuses commits). A committed one is never lost.
/// [`flush`](Self::flush) commits at once, and [`close`](Self::close) commits what is left and
/// stops the thread, returning the error if that last commit fails (the values, never committed,
/// go with the handle: call `flush` until it succeeds first where they must not); dropping the
/// handle does the same, logging a failure instead of returning it.
///
/// [`set`](Self::set) checks the message as a send would (topic, payload size, payload form,
/// priority) and returns the error at once: bad input never reaches the commit. A commit that
/// fails for the file's sake (busy, disk full, I/O) keeps every value pending, each replaced by
/// any newer one meanwhile, and is tried again at the next interval; the failure is logged
/// (WARN) and kept in [`LatestStats::last_error`].
///
/// ```
/// use std::time::Duration;
/// use edge_outbox::{LatestValues, Outbox};
/// # let dir = tempfile::tempdir()?;
/// let outbox = Outbox::open(dir.path().join("device.db"))?;
/// let latest = LatestValues::start(&outbox, Duration::from_secs(1))?;
/// for reading in [20.5, 20.6, 20.8] {
///     latest.set("plant/pump-17/pressure", "pump-17", &reading)?; // in memory
/// }
/// assert_eq!(latest.stats().replaced, 2);
/// latest.close()?; // the last value committed
/// assert_eq!(outbox.stats()?.pending_messages, 1);
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
#[derive(Debug)]
pub struct LatestValues {
    shared: Arc<Shared>,
    stop: Option<Sender<()>>,
    thread: Option<JoinHandle<()>>,
}

/// What a [`LatestValues`] has done.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct LatestStats {
    /// Values waiting for the next commit (one per key).
    pub pending: usize,
    /// Values committed.
    pub committed: u64,
    /// Values replaced in memory by a newer one of their key before a commit: never written.
    pub replaced: u64,
    /// Values a commit refused and dropped (a payload schema they break), each logged.
    pub refused: u64,
    /// Why the last commit failed, until one succeeds.
    pub last_error: Option<String>,
}

#[derive(Debug)]
struct Shared {
    outbox: Outbox,
    state: Mutex<State>,
    /// One commit at a time: the interval's and [`LatestValues::flush`]'s.
    committing: Mutex<()>,
}

#[derive(Debug, Default)]
struct State {
    /// In the order their keys were first set since the last commit.
    values: Vec<Message>,
    slots: HashMap<(String, String), usize>,
    stats: LatestStats,
}

impl State {
    /// Keeps `message` as its key's newest value; whether it replaced one.
    fn put(&mut self, message: Message) -> bool {
        let (topic, key) = message.slot();
        if let Some(&i) = self.slots.get(&(topic.to_owned(), key.to_owned())) {
            self.values[i] = message;
            return true;
        }
        self.slots
            .insert((topic.to_owned(), key.to_owned()), self.values.len());
        self.values.push(message);
        false
    }

    fn take(&mut self) -> Vec<Message> {
        self.slots.clear();
        std::mem::take(&mut self.values)
    }
}

impl LatestValues {
    /// Starts the committing thread: every `interval` (at least 10 ms) the values set since the
    /// last commit are committed in one transaction through `outbox` (a clone of the handle:
    /// writes are serialised with the application's own).
    pub fn start(outbox: &Outbox, interval: Duration) -> Result<LatestValues> {
        if interval < Duration::from_millis(10) {
            return Err(Error::InvalidConfig(format!(
                "a latest-values interval of {interval:?} is below 10 ms: that is a commit per \
                 reading, which this exists to avoid"
            )));
        }
        let shared = Arc::new(Shared {
            outbox: outbox.clone(),
            state: Mutex::new(State::default()),
            committing: Mutex::new(()),
        });
        let (stop, stopped) = crossbeam_channel::bounded(1);
        let thread = {
            let shared = Arc::clone(&shared);
            std::thread::Builder::new()
                .name("edge-outbox-latest".into())
                .spawn(move || run(&shared, &stopped, interval))
                .map_err(|e| Error::Io {
                    context: "starting the latest-values thread".into(),
                    source: e,
                })?
        };
        Ok(LatestValues {
            shared,
            stop: Some(stop),
            thread: Some(thread),
        })
    }

    /// Keeps `value` (serialised to CBOR) as the newest of (`topic`, `key`), for the next commit.
    /// Errors as a send would for the message itself; nothing is kept then.
    pub fn set<V: Serialize + ?Sized>(&self, topic: &str, key: &str, value: &V) -> Result<()> {
        self.send(Message::new(topic, key, value)?)
    }

    /// [`set`](Self::set) for a message built by hand (an event type, headers, a priority); it is
    /// made coalescing.
    pub fn send(&self, message: Message) -> Result<()> {
        message.check(&self.shared.outbox.options().limits)?;
        let mut state = lock(&self.shared.state);
        if state.put(message.coalescing(true)) {
            state.stats.replaced += 1;
        }
        Ok(())
    }

    /// Commits the pending values now; returns how many were committed.
    pub fn flush(&self) -> Result<usize> {
        commit(&self.shared)
    }

    /// What it has done so far.
    pub fn stats(&self) -> LatestStats {
        let state = lock(&self.shared.state);
        LatestStats {
            pending: state.values.len(),
            ..state.stats.clone()
        }
    }

    /// Stops the thread and commits what is pending; returns how many were committed then.
    pub fn close(mut self) -> Result<usize> {
        self.stop_thread();
        commit(&self.shared)
    }

    fn stop_thread(&mut self) {
        drop(self.stop.take());
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }
}

impl Drop for LatestValues {
    fn drop(&mut self) {
        if self.thread.is_some() {
            self.stop_thread();
            if let Err(e) = commit(&self.shared) {
                tracing::warn!(error = %e, "latest values not committed when their handle was dropped");
            }
        }
    }
}

fn run(shared: &Shared, stopped: &Receiver<()>, interval: Duration) {
    loop {
        match stopped.recv_timeout(interval) {
            Err(RecvTimeoutError::Timeout) => {
                if let Err(e) = commit(shared) {
                    tracing::warn!(error = %e, "could not commit the latest values; retrying at the next interval");
                }
            }
            // Closed: `close` or the drop commits what is left.
            Ok(()) | Err(RecvTimeoutError::Disconnected) => return,
        }
    }
}

/// Commits the pending values in one transaction. A value the file refuses for its own sake is
/// dropped (and counted); any other failure puts every value back, behind any newer one.
fn commit(shared: &Shared) -> Result<usize> {
    let _turn = lock(&shared.committing);
    let values = lock(&shared.state).take();
    if values.is_empty() {
        return Ok(0);
    }
    let mut refused = Vec::new();
    let result = shared.outbox.transaction(|tx| {
        refused.clear();
        for (i, m) in values.iter().enumerate() {
            match tx.send(m) {
                Ok(_) => {}
                Err(e) if refuses_the_message(&e) => refused.push((i, e.to_string())),
                Err(e) => return Err(e),
            }
        }
        Ok::<_, Error>(())
    });
    let mut state = lock(&shared.state);
    match result {
        Ok(_) => {
            for (i, why) in &refused {
                let (topic, key) = values[*i].slot();
                tracing::warn!(topic, key, reason = %why, "latest value refused and dropped");
            }
            let committed = values.len() - refused.len();
            state.stats.committed += committed as u64;
            state.stats.refused += refused.len() as u64;
            state.stats.last_error = None;
            Ok(committed)
        }
        Err(e) => {
            // Behind the values set meanwhile: a newer value of a key wins.
            let newer = state.take();
            let kept = if crate::mutant::active("latest-dropped-on-failure") {
                Vec::new()
            } else {
                values
            };
            for m in kept.into_iter().chain(newer) {
                state.put(m);
            }
            state.stats.last_error = Some(e.to_string());
            Err(e)
        }
    }
}

/// Whether `e` refuses the message itself (its schema, its form), not the moment (busy, full,
/// I/O): such a message would fail every later commit too.
fn refuses_the_message(e: &Error) -> bool {
    match e {
        Error::InvalidTopic { .. }
        | Error::PayloadTooLarge { .. }
        | Error::SchemaViolation(_)
        | Error::Encode(_)
        | Error::InvalidConfig(_) => true,
        // A message with its own id that is pending already (`Message::with_id`).
        Error::Sqlite(e) => e.sqlite_error_code() == Some(rusqlite::ErrorCode::ConstraintViolation),
        _ => false,
    }
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_newer_value_replaces_its_key_and_keeps_its_place() {
        let mut s = State::default();
        let m = |k: &str, v: u8| Message::new("t", k, &v).expect("message");
        assert!(!s.put(m("a", 1)));
        assert!(!s.put(m("b", 1)));
        assert!(s.put(m("a", 2)));
        let taken = s.take();
        assert_eq!(taken.len(), 2);
        assert_eq!(taken[0].slot(), ("t", "a"));
        assert_eq!(taken[0].payload(), &[2]);
        assert!(s.values.is_empty() && s.slots.is_empty());
    }
}
