//! The SQLite store: business tables, outbox, inbox and dead letters in one WAL file.

mod dead_letters;
mod inbox;
mod open;
mod options;
pub(crate) mod outbox;
mod schema;
mod stats;

use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::time::{Duration, Instant};

use crossbeam_channel::{Receiver, Sender};
use rusqlite::{Connection, TransactionBehavior};

pub use dead_letters::{DeadLetter, Origin};
pub use inbox::{ApplyOutcome, Command, Received};
pub(crate) use open::connect;
pub use open::default_path;
pub use options::{Limits, OnFull, Options, Synchronous};
pub use outbox::{Committed, Message, Tx, enqueue};
pub use schema::{SCHEMA_VERSION, schema_version};
pub use stats::Stats;

use crate::error::{Error, Result};

/// A handle on one store file. Cheap to clone; clones share one connection, so writes from
/// several threads through clones are serialised here (SQLite has one writer anyway). Threads that
/// only need their own connection can [`Outbox::open`] the same path again.
#[derive(Clone)]
pub struct Outbox {
    shared: Arc<Shared>,
}

struct Shared {
    conn: Mutex<Connection>,
    path: PathBuf,
    options: Options,
    /// Wakes a relay started from this handle the moment a publish commits. Capacity one: a
    /// pending wake-up already covers every later commit.
    wake_tx: Sender<()>,
    wake_rx: Receiver<()>,
}

impl Outbox {
    /// Opens (creating and migrating if needed) the store at `path` with default [`Options`].
    ///
    /// ```
    /// # let dir = tempfile::tempdir().expect("temp dir");
    /// let outbox = edge_outbox::Outbox::open(dir.path().join("device.db"))?;
    /// assert_eq!(outbox.stats()?.pending_messages, 0);
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub fn open(path: impl AsRef<Path>) -> Result<Self> {
        Self::open_with(path, Options::default())
    }

    /// Opens the store at `path` with `options`.
    pub fn open_with(path: impl AsRef<Path>, options: Options) -> Result<Self> {
        let path = path.as_ref().to_path_buf();
        let conn = open::connect(&path, &options)?;
        let (wake_tx, wake_rx) = crossbeam_channel::bounded(1);
        Ok(Outbox {
            shared: Arc::new(Shared {
                conn: Mutex::new(conn),
                path,
                options,
                wake_tx,
                wake_rx,
            }),
        })
    }

    /// Opens the store in the platform data directory for `app` (see [`default_path`]).
    pub fn open_app(app: &str) -> Result<Self> {
        Self::open(default_path(app)?)
    }

    /// The database file's path.
    pub fn path(&self) -> &Path {
        &self.shared.path
    }

    /// The options the store was opened with.
    pub fn options(&self) -> &Options {
        &self.shared.options
    }

    /// Runs `f` in one `BEGIN IMMEDIATE` transaction and commits it, then wakes the relay.
    ///
    /// The closure gets a [`Tx`] that derefs to [`rusqlite::Transaction`] for the application's
    /// own SQL and adds [`Tx::publish`]. Business rows and messages commit together or not at
    /// all: if `f` returns an error or panics, everything it did is rolled back. `IMMEDIATE`
    /// takes the write lock up front, so a transaction that reads before it writes cannot fail
    /// half-way with `SQLITE_BUSY_SNAPSHOT`.
    ///
    /// ```
    /// # let dir = tempfile::tempdir().expect("temp dir");
    /// # let outbox = edge_outbox::Outbox::open(dir.path().join("device.db"))?;
    /// outbox.transaction(|tx| {
    ///     tx.execute_batch("CREATE TABLE IF NOT EXISTS readings (celsius REAL)")?;
    ///     tx.execute("INSERT INTO readings VALUES (?1)", [21.5])?;
    ///     tx.publish("sensors/temp", "probe-1", &21.5)?;
    ///     Ok::<_, edge_outbox::Error>(())
    /// })?;
    /// assert_eq!(outbox.stats()?.pending_messages, 1);
    /// # Ok::<(), edge_outbox::Error>(())
    /// ```
    pub fn transaction<T, E, F>(&self, f: F) -> Result<Committed<T>, E>
    where
        F: FnOnce(&mut Tx<'_>) -> Result<T, E>,
        E: From<Error>,
    {
        let mut conn = self.lock();
        let tx = conn
            .transaction_with_behavior(TransactionBehavior::Immediate)
            .map_err(Error::from)?;
        let mut t = Tx::new(tx, &self.shared.options.limits);
        let value = f(&mut t)?;
        let ids = t.commit()?;
        crate::failpoint::hit("after-business-commit");
        drop(conn);
        if !ids.is_empty() {
            self.wake_relay();
        }
        Ok(Committed { value, ids })
    }

    /// Stores one delivery of a command in the inbox (the receive step). See [`Received`].
    ///
    /// The delivery is on disk when this returns, whatever the [`Synchronous`] mode: the caller
    /// acknowledges the broker next, and a command a power cut then erased would be lost for good.
    pub fn receive(&self, topic: &str, bytes: &[u8]) -> Result<Received> {
        let conn = self.lock();
        if self.shared.options.synchronous == Synchronous::Full {
            return inbox::receive(&conn, &self.shared.options, topic, bytes);
        }
        conn.pragma_update(None, "synchronous", "FULL")?;
        let received = inbox::receive(&conn, &self.shared.options, topic, bytes);
        conn.pragma_update(
            None,
            "synchronous",
            self.shared.options.synchronous.pragma_value(),
        )?;
        received
    }

    /// Applies the oldest due command (the apply step): runs `handler` in one transaction that
    /// also marks the command applied. See [`ApplyOutcome`].
    ///
    /// Commands are taken in arrival order per key: a command waits while an older one with the
    /// same key is unapplied (backing off after a failure), and stops waiting once that one is
    /// applied or dead-lettered. The handler may publish replies through its [`Tx`]; they commit
    /// with the effect. A handler error or panic rolls the effect back and counts an attempt;
    /// after [`Options::max_attempts`] the command moves to the dead letters.
    pub fn apply_next<E, F>(&self, handler: F) -> Result<ApplyOutcome>
    where
        F: FnOnce(&mut Tx<'_>, &Command) -> Result<(), E>,
        E: std::fmt::Display,
    {
        let outcome = inbox::apply_next(&mut self.lock(), &self.shared.options, handler)?;
        if outcome.published() {
            self.wake_relay();
        }
        Ok(outcome)
    }

    /// Counters and ages for monitoring. Cheap: a few indexed reads, whatever the backlog.
    pub fn stats(&self) -> Result<Stats> {
        Stats::read(&self.lock())
    }

    /// Dead letters, oldest first, at most `limit`.
    pub fn dead_letters(&self, limit: usize) -> Result<Vec<DeadLetter>> {
        dead_letters::list(&self.lock(), limit)
    }

    /// Puts a dead letter back: an outbox message is queued again (same id, new sequence number),
    /// a command gets a fresh set of attempts. Fails with [`Error::NotFound`] for an unknown id.
    pub fn retry_dead_letter(&self, dead_letter_id: i64) -> Result<()> {
        dead_letters::retry(&mut self.lock(), &self.shared.options, dead_letter_id)?;
        self.wake_relay();
        Ok(())
    }

    /// Deletes a dead letter for good. Fails with [`Error::NotFound`] for an unknown id.
    pub fn drop_dead_letter(&self, dead_letter_id: i64) -> Result<()> {
        dead_letters::drop(&self.lock(), dead_letter_id)
    }

    /// Deletes the ids of applied commands (and of dead commands whose dead letter was dropped)
    /// older than the inbox retention and sent rows older than the sent retention, then returns
    /// free pages to the file system. Returns the rows deleted.
    pub fn prune(&self) -> Result<u64> {
        let conn = self.lock();
        let mut deleted = 0;
        loop {
            let m = maintain_for(&conn, &self.shared.options, Duration::from_secs(60))?;
            deleted += m.deleted;
            if m.done {
                return Ok(deleted);
            }
        }
    }

    /// Runs `f` with this handle's connection, for reads and maintenance the crate does not wrap.
    /// Writes should go through [`Outbox::transaction`].
    pub fn with_connection<T>(&self, f: impl FnOnce(&Connection) -> T) -> T {
        f(&self.lock())
    }

    pub(crate) fn wake_relay(&self) {
        // Full means a wake-up is already pending; disconnected cannot happen (we hold the rx).
        let _ = self.shared.wake_tx.try_send(());
    }

    pub(crate) fn wake_receiver(&self) -> Receiver<()> {
        self.shared.wake_rx.clone()
    }

    fn lock(&self) -> MutexGuard<'_, Connection> {
        // A panic in a transaction closure poisons the mutex after rusqlite rolled the
        // transaction back, so the connection is consistent and safe to keep using.
        self.shared.conn.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

/// Stores one command delivery on `conn` (the command session's own connection).
pub(crate) fn inbox_receive(
    conn: &Connection,
    options: &Options,
    topic: &str,
    bytes: &[u8],
) -> Result<Received> {
    inbox::receive(conn, options, topic, bytes)
}

/// What one slice of housekeeping did.
pub(crate) struct Maintenance {
    /// Rows deleted past their retention.
    pub deleted: u64,
    /// Nothing is left to delete or vacuum.
    pub done: bool,
}

/// Rows deleted per statement, and pages returned per `incremental_vacuum`, in housekeeping: each
/// is a short write transaction, so writers are never held up for long.
const PRUNE_BATCH: usize = 500;
const VACUUM_PAGES: u32 = 128;

/// Housekeeping on `conn` for about `budget` at most: prune past retention in batches, then return
/// free pages to the file system a few at a time. Callers that run it periodically (the relay,
/// busy or not) call again soon while it is not `done`.
pub(crate) fn maintain_for(conn: &Connection, options: &Options, budget: Duration) -> Result<Maintenance> {
    let deadline = Instant::now().checked_add(budget);
    let out_of_time = || deadline.is_some_and(|d| Instant::now() >= d);
    let mut deleted = 0;
    loop {
        let n = inbox::prune(conn, options, PRUNE_BATCH)? + outbox::prune_sent(conn, options, PRUNE_BATCH)?;
        deleted += n;
        if n == 0 {
            break;
        }
        if out_of_time() {
            return Ok(Maintenance { deleted, done: false });
        }
    }
    // Files created before auto_vacuum was set have no incremental vacuum: nothing to do there.
    let incremental: i64 = conn.query_row("PRAGMA auto_vacuum", [], |r| r.get(0))?;
    if incremental != 2 {
        return Ok(Maintenance { deleted, done: true });
    }
    loop {
        let free: i64 = conn.query_row("PRAGMA freelist_count", [], |r| r.get(0))?;
        if free == 0 {
            break;
        }
        conn.execute_batch(&format!("PRAGMA incremental_vacuum({VACUUM_PAGES})"))?;
        if out_of_time() {
            return Ok(Maintenance { deleted, done: false });
        }
    }
    Ok(Maintenance { deleted, done: true })
}

impl std::fmt::Debug for Outbox {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Outbox")
            .field("path", &self.shared.path)
            .finish_non_exhaustive()
    }
}
