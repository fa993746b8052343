//! The SQLite store: business tables, outbox, inbox and dead letters in one WAL file.

mod apply;
mod class;
pub(crate) mod counters;
mod dead_letters;
pub(crate) mod epoch;
pub(crate) mod gaps;
pub(crate) mod gate;
mod inbox;
mod integrity;
pub(crate) mod open;
mod options;
pub(crate) mod outbox;
pub(crate) mod published;
mod reentry;
mod refusal_log;
pub(crate) mod relay_lock;
mod requeue;
mod salvage;
mod schema;
#[cfg(feature = "signed-commands")]
mod signing;
mod stats;
pub(crate) mod trust;
#[cfg(not(feature = "schemas"))]
mod unchecked_schemas;
mod unrecoverable;
pub(crate) mod uptime;
pub(crate) mod watch;

use std::path::{Path, PathBuf};
use std::sync::atomic::AtomicI64;
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::time::{Duration, Instant};

use crossbeam_channel::{Receiver, Sender};
use rusqlite::{Connection, TransactionBehavior};

pub(crate) use apply::{Applier, RELAY_OWNER, recover_relay_attempts, run_next};
pub use class::MessageClass;
pub use dead_letters::{DeadLetter, Origin};
pub use inbox::{ApplyOutcome, Command, Received};
pub(crate) use inbox::{Delivery, receive_delivery, refuse};
pub(crate) use open::connect;
pub use open::default_path;
pub use options::{Limits, OnFull, Options, Synchronous};
pub use outbox::{Committed, MAX_PRIORITY, Message, Tx, enqueue};
pub use salvage::{Salvaged, SalvagedTable};
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
    /// `path` resolved, to recognise the file a command handler holds the write lock of.
    canonical: PathBuf,
    /// `claimed_by` of the attempts `apply_next` makes through this handle.
    owner: String,
    /// A second connection for `apply_next`, taken out while a command is applied, so applying
    /// never holds `conn`'s mutex: the handler may read through this handle meanwhile.
    apply_conn: Mutex<Option<Connection>>,
    /// Claims `apply_next` could not release yet (see `apply::Applier::stranded`).
    stranded: Mutex<Vec<apply::Held>>,
    /// The in-process writers' queue of this file (see `gate`): taken before `conn`'s mutex.
    gate: Arc<gate::WriteGate>,
    options: Options,
    /// Wakes a relay started from this handle the moment a publish commits. Capacity one: a
    /// pending wake-up already covers every later commit.
    wake_tx: Sender<()>,
    wake_rx: Receiver<()>,
    /// At most the counters' `counted_through`: when this handle's transactions fold the tail in.
    folded: AtomicI64,
    /// Every outbox row up to this sequence number is on stable storage: the highest one a
    /// `synchronous = FULL` commit through this handle inserted (its fsync of the WAL covers every
    /// commit before it). A relay started from this handle skips its own WAL sync for them.
    durable_seq: Arc<AtomicI64>,
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
        #[cfg(feature = "schemas")]
        let mut options = options;
        let mut conn = open_checked(&path, &options)?;
        epoch::check_file(&mut conn, &path)?;
        #[cfg(not(feature = "schemas"))]
        unchecked_schemas::warn_if_any(&conn);
        #[cfg(feature = "schemas")]
        {
            let registry =
                crate::payload_schema::adopt_on_open(&mut conn, &options.schemas, options.strict_schemas)?;
            options.limits.schemas = Arc::new(registry);
        }
        #[cfg(feature = "signed-commands")]
        if let Some(keys) = &options.trusted_keys {
            signing::adopt_on_open(&mut conn, keys)?;
        }
        let (wake_tx, wake_rx) = crossbeam_channel::bounded(1);
        Ok(Outbox {
            shared: Arc::new(Shared {
                gate: gate::of(&conn),
                conn: Mutex::new(conn),
                canonical: reentry::canonical(&path),
                owner: format!("worker:{}", crate::MessageId::new_v7()),
                apply_conn: Mutex::new(None),
                stranded: Mutex::new(Vec::new()),
                path,
                options,
                wake_tx,
                wake_rx,
                folded: AtomicI64::new(0),
                durable_seq: Arc::new(AtomicI64::new(0)),
            }),
        })
    }

    /// Salvages the store at `path` by hand, damaged or not: moves the file (and its WAL) aside
    /// as `<name>.corrupt-<unix ms>` and copies everything readable into a fresh file at `path`
    /// (see [`Options::salvage_on_corruption`], which does this on open when the integrity check
    /// fails). Pending messages keep their numbers; new ones are numbered in a new epoch; pending
    /// messages that could not be read are announced to the cloud as an `unrecoverable` gap.
    /// Fails with [`Error::RelayAlreadyRunning`] while a relay uses the file; other processes
    /// must not have it open either.
    pub fn salvage(path: impl AsRef<Path>, options: &Options) -> Result<Salvaged> {
        options.validate()?;
        let path = path.as_ref();
        if !path.exists() {
            return Err(Error::NotFound(format!("database {}", path.display())));
        }
        salvage::salvage(path, options, "salvage asked for")
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
    /// The closure gets a [`Tx`] that derefs to [`rusqlite::Transaction`][transaction] for the application's
    /// own SQL and adds [`Tx::publish`]. Business rows and messages commit together or not at
    /// all: if `f` returns an error or panics, everything it did is rolled back. `IMMEDIATE`
    /// takes the write lock up front, so a transaction that reads before it writes cannot fail
    /// half-way with `SQLITE_BUSY_SNAPSHOT`.
    ///
    /// Called from inside a command handler's database step on the same file, it fails at once
    /// with [`Error::InsideCommandHandler`] (that step holds the write lock): write through the
    /// handler's `Tx` instead.
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
    ///
    /// [transaction]: https://docs.rs/rusqlite/0.37/rusqlite/struct.Transaction.html
    pub fn transaction<T, E, F>(&self, f: F) -> Result<Committed<T>, E>
    where
        F: FnOnce(&mut Tx<'_>) -> Result<T, E>,
        E: From<Error>,
    {
        self.check_can_write("Outbox::transaction")?;
        let turn = self.enter_gate()?;
        let mut conn = self.lock();
        let tx = conn
            .transaction_with_behavior(TransactionBehavior::Immediate)
            .map_err(Error::from)?;
        let mut t = Tx::new(tx, &self.shared.options.limits, Some(&self.shared.folded));
        let value = f(&mut t)?;
        let last_seq = t.last_seq();
        let ids = t.commit()?;
        if let Some(seq) = last_seq.filter(|_| self.shared.options.synchronous == Synchronous::Full) {
            self.shared
                .durable_seq
                .fetch_max(seq, std::sync::atomic::Ordering::Release);
        }
        drop(conn);
        drop(turn);
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
        self.check_can_write("Outbox::receive")?;
        let _turn = self.enter_gate()?;
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
    /// with the effect. A handler error or panic rolls the effect back and counts an attempt (a
    /// panic is caught under Cargo's default `panic = "unwind"`; built with `panic = "abort"`, it
    /// ends the process, and the attempt, counted before the handler ran, is recovered after the
    /// restart like any crash);
    /// after [`Options::max_attempts`] the command moves to the dead letters. An
    /// [`Error::CommandRejected`] (see [`Error::reject`]) marks it rejected at once, with its
    /// reply if the handler gave one ([`Error::with_reply`]).
    ///
    /// The attempt is committed before the handler runs, so a handler that takes the process down
    /// is counted too (see [`Options::attempt_timeout`]). The handler runs on a connection of its
    /// own, in a transaction that lasts as long as the handler: keep it to database work, and do
    /// slow outside work (hardware, network) in [`apply_next_two_phase`](Self::apply_next_two_phase).
    /// Inside it, reads through this or any handle work; writes through an [`Outbox`] on the same
    /// file fail at once with [`Error::InsideCommandHandler`].
    pub fn apply_next<E, F>(&self, handler: F) -> Result<ApplyOutcome>
    where
        F: FnOnce(&mut Tx<'_>, &Command) -> Result<(), E>,
        E: std::fmt::Display + 'static,
    {
        self.apply_next_two_phase(
            |_| Ok::<_, std::convert::Infallible>(()),
            |tx, cmd, ()| handler(tx, cmd),
        )
    }

    /// Applies the oldest due command with a two-phase handler: `act` does the slow outside work
    /// (move a valve, call a service) with **no transaction open**, then `record` writes its
    /// database effect in the transaction that marks the command applied.
    ///
    /// The guarantee: `record`'s effect commits **exactly once**. `act` runs **at least once**:
    /// if the process dies between `act` and the commit, the command is attempted again after a
    /// restart and `act` runs again, so make it idempotent, keyed on [`Command::id`] (the same id
    /// on every attempt and every redelivery) wherever the outside world allows one. An error
    /// from either step fails the attempt like a one-phase handler's ([`Error::CommandRejected`]
    /// rejects at once); `record` does not run after `act` failed.
    ///
    /// ```
    /// use edge_outbox::{ApplyOutcome, Envelope, MessageId, Outbox};
    ///
    /// # let dir = tempfile::tempdir().expect("temp dir");
    /// let outbox = Outbox::open(dir.path().join("device.db"))?;
    /// outbox.with_connection(|c| c.execute_batch("CREATE TABLE valve (position INTEGER)"))?;
    /// let id = MessageId::new_v7();
    /// outbox.receive("valves/v1/set", &Envelope::command(id, "valve-1", &40)?.encode())?;
    ///
    /// let outcome = outbox.apply_next_two_phase(
    ///     // Outside any transaction: the application keeps committing meanwhile.
    ///     |cmd| -> edge_outbox::Result<i64> {
    ///         let target: i64 = cmd.payload_as()?;
    ///         // valve.move_to(target, cmd.id)?  (slow hardware I/O, idempotent on cmd.id)
    ///         Ok(target)
    ///     },
    ///     // In the write transaction that marks the command applied: once.
    ///     |tx, cmd, reached| {
    ///         tx.execute("INSERT INTO valve VALUES (?1)", [reached])?;
    ///         tx.publish("valves/v1/position", &cmd.key, &reached)?;
    ///         Ok::<_, edge_outbox::Error>(())
    ///     },
    /// )?;
    /// assert_eq!(outcome, ApplyOutcome::Applied { id, published: 1 });
    /// # Ok::<(), edge_outbox::Error>(())
    /// ```
    pub fn apply_next_two_phase<P, EA, ER, A, R>(&self, act: A, record: R) -> Result<ApplyOutcome>
    where
        A: FnOnce(&Command) -> Result<P, EA>,
        EA: std::fmt::Display + 'static,
        R: FnOnce(&mut Tx<'_>, &Command, P) -> Result<(), ER>,
        ER: std::fmt::Display + 'static,
    {
        self.check_can_write("Outbox::apply_next")?;
        let mut conn = self.take_apply_conn()?;
        let applier = Applier {
            options: &self.shared.options,
            owner: &self.shared.owner,
            stranded: &self.shared.stranded,
            path: &self.shared.canonical,
        };
        let result = apply::run_next(&mut conn, &applier, |_| {}, act, record);
        self.return_apply_conn(conn);
        let (outcome, _) = result?;
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
        self.check_can_write("Outbox::retry_dead_letter")?;
        let _turn = self.enter_gate()?;
        requeue::retry(&mut self.lock(), &self.shared.options, dead_letter_id)?;
        self.wake_relay();
        Ok(())
    }

    /// Deletes a dead letter for good. Fails with [`Error::NotFound`] for an unknown id.
    pub fn drop_dead_letter(&self, dead_letter_id: i64) -> Result<()> {
        self.check_can_write("Outbox::drop_dead_letter")?;
        let _turn = self.enter_gate()?;
        dead_letters::drop(&self.lock(), dead_letter_id)
    }

    /// Deletes the ids of applied commands (and of dead commands whose dead letter was dropped)
    /// older than the inbox retention and sent rows older than the sent retention, then returns
    /// free pages to the file system. Returns the rows deleted.
    pub fn prune(&self) -> Result<u64> {
        self.check_can_write("Outbox::prune")?;
        let _turn = self.enter_gate()?;
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

    /// Removes pending messages unpublished, for an operator: those on `topic`, or all of them
    /// with `None`. Each removal is recorded in the same transaction, and the relay announces it
    /// to the cloud as a gap (cause `purged`), so the loss is visible there rather than silent.
    /// Returns how many were removed.
    ///
    /// ```
    /// # let dir = tempfile::tempdir().expect("temp dir");
    /// let outbox = edge_outbox::Outbox::open(dir.path().join("device.db"))?;
    /// outbox.transaction(|tx| {
    ///     tx.publish("debug/trace", "t", &"verbose")?;
    ///     tx.publish("orders/placed", "o-1", &40)
    /// })?;
    /// assert_eq!(outbox.purge_pending(Some("debug/trace"))?, 1);
    /// assert_eq!(outbox.stats()?.pending_messages, 1);
    /// # Ok::<(), edge_outbox::Error>(())
    /// ```
    pub fn purge_pending(&self, topic: Option<&str>) -> Result<u64> {
        self.check_can_write("Outbox::purge_pending")?;
        let _turn = self.enter_gate()?;
        let mut conn = self.lock();
        let tx = conn.transaction_with_behavior(TransactionBehavior::Immediate)?;
        let seqs = {
            let mut stmt =
                tx.prepare("SELECT seq FROM outbox WHERE ?1 IS NULL OR topic = ?1 ORDER BY seq")?;
            stmt.query_map([topic], |r| r.get::<_, i64>(0))?
                .collect::<rusqlite::Result<Vec<i64>>>()?
        };
        let removed = gaps::remove(&tx, &seqs, gaps::Removal::Purged, None)?;
        tx.commit()?;
        drop(conn);
        if removed > 0 {
            tracing::warn!(
                messages = removed,
                topic,
                "purged pending messages unpublished (the relay announces the gap)"
            );
            self.wake_relay();
        }
        Ok(removed)
    }

    /// The epoch this store numbers new messages in (the envelope's `ep`). It changes when the
    /// file is recreated, restored from a copy, or salvaged after damage.
    pub fn epoch(&self) -> Result<u64> {
        epoch::current(&self.lock())
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

    /// See `Shared::durable_seq`.
    pub(crate) fn durable_seq(&self) -> Arc<AtomicI64> {
        self.shared.durable_seq.clone()
    }

    /// The file's canonical path (see `reentry`).
    pub(crate) fn canonical_path(&self) -> &Path {
        &self.shared.canonical
    }

    fn enter_gate(&self) -> Result<gate::Turn> {
        self.shared.gate.enter(self.shared.options.busy_timeout)
    }

    fn check_can_write(&self, operation: &'static str) -> Result<()> {
        reentry::check_can_write(&self.shared.canonical, operation)
    }

    /// The apply connection, or a new one if another thread has it (applying concurrently).
    fn take_apply_conn(&self) -> Result<Connection> {
        let pooled = self
            .shared
            .apply_conn
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .take();
        match pooled {
            Some(conn) => Ok(conn),
            None => open::connect(&self.shared.path, &self.shared.options),
        }
    }

    fn return_apply_conn(&self, conn: Connection) {
        let mut slot = self
            .shared
            .apply_conn
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        if slot.is_none() {
            *slot = Some(conn);
        }
    }

    fn lock(&self) -> MutexGuard<'_, Connection> {
        // A panic in a transaction closure poisons the mutex after rusqlite rolled the
        // transaction back, so the connection is consistent and safe to keep using.
        self.shared.conn.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

/// A connection to the store at `path`, after the integrity check: a damaged file is salvaged
/// (or refused, with [`Options::salvage_on_corruption`] off).
fn open_checked(path: &Path, options: &Options) -> Result<Connection> {
    salvage::finish_interrupted(path)?;
    let damage = match open::connect(path, options) {
        Ok(conn) => {
            let budget = options.integrity_budget;
            if budget.is_zero() {
                return Ok(conn);
            }
            match integrity::check(&conn, Some(budget), false)? {
                integrity::Health::Ok => return Ok(conn),
                integrity::Health::Unfinished => {
                    tracing::info!(path = %path.display(), ?budget, "the integrity check did not finish within its budget: not checked this time");
                    return Ok(conn);
                }
                integrity::Health::Damaged(why) => {
                    // Leave the damaged file and its WAL as they are, for the salvage and for
                    // whoever looks at the copy kept aside.
                    let _ = conn
                        .set_db_config(rusqlite::config::DbConfig::SQLITE_DBCONFIG_NO_CKPT_ON_CLOSE, true);
                    why
                }
            }
        }
        Err(e) if integrity::is_corruption(&e) => e.to_string(),
        Err(e) => return Err(e),
    };
    if !options.salvage {
        tracing::error!(path = %path.display(), damage, "the database file is damaged");
        return Err(Error::Corrupt {
            path: path.to_path_buf(),
            detail: damage,
        });
    }
    salvage::salvage(path, options, &damage)?;
    open::connect(path, options)
}

/// Runs SQLite's full `integrity_check` on `conn` (no time limit): `None` when the file is
/// sound, else what is wrong. Reads only: works on a read-only connection (`edge-outbox doctor`).
pub fn integrity_check(conn: &Connection) -> Result<Option<String>> {
    Ok(match integrity::check(conn, None, true)? {
        integrity::Health::Damaged(why) => Some(why),
        integrity::Health::Ok | integrity::Health::Unfinished => None,
    })
}

/// A quick check of `conn` within `budget`, for the relay's periodic look: the damage, if any.
pub(crate) fn quick_check(conn: &Connection, budget: Duration) -> Result<Option<String>> {
    Ok(match integrity::check(conn, Some(budget), false)? {
        integrity::Health::Damaged(why) => Some(why),
        integrity::Health::Ok | integrity::Health::Unfinished => None,
    })
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
    // Rows written by others (the SQL contract) are counted in; the tail stays short.
    {
        let tx = rusqlite::Transaction::new_unchecked(conn, TransactionBehavior::Immediate)?;
        counters::fold(&tx)?;
        tx.commit()?;
    }
    loop {
        let n = gaps::expire_due(conn, PRUNE_BATCH)?
            + inbox::prune(conn, options, PRUNE_BATCH)?
            + outbox::prune_sent(conn, options, PRUNE_BATCH)?;
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
