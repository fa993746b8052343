//! A consumer that survives restarts: its state in a SQLite file it owns, written in the same
//! transaction as the service's own effect (the inbox pattern, on the cloud side).

use std::path::Path;
use std::time::Duration;

use rusqlite::{Connection, Transaction};

use super::{Consumer, Report, Verdict, saved};
use crate::envelope::Published;
use crate::error::{Error, Result};

/// How long a write waits for another connection to the same file (a query run beside it).
const BUSY_TIMEOUT: Duration = Duration::from_secs(5);

/// A [`Consumer`] whose state (the dedupe window, the next number expected per source and epoch,
/// the open gaps, the keys' order, the counts) is kept in a SQLite file and committed with the
/// service's effect, in one transaction per MQTT payload.
///
/// A consumer that keeps its state in memory forgets, when it restarts, which messages it had
/// and which numbers were missing: it then takes the next message for a source's first (missing
/// whatever was lost while it was down) or, counting from the start, reports everything before it
/// as lost. A durable one starts where its last commit left it:
///
/// - a message whose effect committed is a [`Verdict::Duplicate`] when the broker delivers it
///   again (it was not acknowledged yet when the consumer stopped);
/// - a message whose transaction did not commit (the process was killed, the effect failed) is
///   [`Verdict::New`] when it comes again: the verdict and the effect go together;
/// - numbers lost while it was down (a broker that lost its queue) are unexplained gaps.
///
/// Acknowledge a payload to the broker only after [`observe_all`](Self::observe_all) returns:
/// then every payload acknowledged has its effect committed.
///
/// Writes are `synchronous = FULL`: a commit survives a power cut, as the acknowledgement that
/// follows it assumes. Several consumers each own a file (one shard of the fleet each, by topic);
/// two processes must not share one, as each would take the other's numbers for gaps.
///
/// ```
/// use edge_outbox::consumer::{Consumer, DurableConsumer, Verdict};
/// use edge_outbox::envelope::{Envelope, Published};
/// use edge_outbox::MessageId;
///
/// let message = |seq| Envelope {
///     id: MessageId::new_v7(),
///     source: "pump-17".into(),
///     epoch: 42,
///     seq,
///     key: "pump-17".into(),
///     created_ms: 0,
///     event_type: None,
///     headers: vec![],
///     payload: edge_outbox::envelope::to_cbor(&seq).expect("cbor").into(),
/// }
/// .encode();
/// # let dir = tempfile::tempdir().expect("temp dir");
/// let path = dir.path().join("consumer.db");
///
/// let mut consumer = DurableConsumer::open(&path, Consumer::new().from_start(true))?;
/// consumer
///     .connection()
///     .execute_batch("CREATE TABLE IF NOT EXISTS readings (seq INTEGER)")?;
/// let first = message(1);
/// consumer.observe_all(&first, |tx, item, verdict| {
///     // The effect, in the transaction that saves the verdict.
///     if let (Published::Message(env), Verdict::New { .. }) = (item, verdict) {
///         tx.execute("INSERT INTO readings (seq) VALUES (?1)", [env.seq as i64])?;
///     }
///     Ok::<_, edge_outbox::Error>(())
/// })?;
/// drop(consumer);
///
/// // Restarted: the broker delivers message 1 again (never acknowledged), then message 3.
/// let mut consumer = DurableConsumer::open(&path, Consumer::new().from_start(true))?;
/// let again = consumer.observe_all(&first, |_, _, _| Ok::<_, edge_outbox::Error>(()))?;
/// assert_eq!(again[0].1, Verdict::Duplicate);
/// consumer.observe_all(&message(3), |_, _, _| Ok::<_, edge_outbox::Error>(()))?;
/// assert_eq!(consumer.report().streams[0].unexplained, vec![(2, 2)]);
/// # Ok::<(), edge_outbox::Error>(())
/// ```
#[derive(Debug)]
pub struct DurableConsumer {
    conn: Connection,
    consumer: Consumer,
    /// Memory may be ahead of the file (a transaction that did not commit, a reload that failed,
    /// a panic in the effect): reload before observing anything more.
    stale: bool,
}

impl DurableConsumer {
    /// Opens (or creates, readable by its owner only, in WAL mode) the consumer's file at `path`
    /// and loads the state saved there. `settings` gives the dedupe window, the bounds,
    /// `from_start` and the schemas; anything it observed before is replaced by the saved state.
    ///
    /// Fails with [`Error::InvalidConfig`] for a file written by a build with another layout of
    /// the consumer's tables, and with the usual open errors ([`Error::NotADatabase`],
    /// [`Error::ReadOnly`], ...) otherwise.
    pub fn open(path: impl AsRef<Path>, settings: Consumer) -> Result<Self> {
        let conn = crate::store::open::open_in_wal(path.as_ref(), BUSY_TIMEOUT, |_| Ok(()))?;
        conn.pragma_update(None, "synchronous", "FULL")?;
        saved::create(&conn)?;
        let mut consumer = settings;
        saved::load(&conn, &mut consumer)?;
        Ok(DurableConsumer {
            conn,
            consumer,
            stale: false,
        })
    }

    /// Decodes `bytes` (a relay's MQTT payload: a message, a gap notice or a batch) and, in one
    /// transaction, observes each item, calls `effect` with the transaction, the item and its
    /// verdict, and saves the consumer's state. Returns the items and verdicts once committed.
    ///
    /// If `effect` fails (or panics), or the commit does, nothing of it is kept: the transaction
    /// rolls back, the consumer goes back to its last saved state (read again from the file,
    /// before this call returns or at the next one), and the error is returned (the items are new
    /// again when the broker delivers them again). A payload that is not an edge-outbox one is an
    /// [`Error::Decode`] and changes nothing.
    ///
    /// The schema findings' count ([`Totals::schema_violations`](super::Totals::schema_violations))
    /// is saved; the findings themselves, the newest examples, are kept in memory only.
    pub fn observe_all<E, F>(
        &mut self,
        bytes: &[u8],
        effect: F,
    ) -> std::result::Result<Vec<(Published, Verdict)>, E>
    where
        F: FnMut(&Transaction<'_>, &Published, Verdict) -> std::result::Result<(), E>,
        E: From<Error>,
    {
        let items = Published::decode_all(bytes)?;
        self.observe(items, effect)
    }

    /// [`observe_all`](Self::observe_all) for items already decoded (from a bridge, or a batch
    /// of payloads to commit together).
    pub fn observe<E, F>(
        &mut self,
        items: Vec<Published>,
        mut effect: F,
    ) -> std::result::Result<Vec<(Published, Verdict)>, E>
    where
        F: FnMut(&Transaction<'_>, &Published, Verdict) -> std::result::Result<(), E>,
        E: From<Error>,
    {
        if self.stale {
            saved::load(&self.conn, &mut self.consumer)?;
            self.stale = false;
        }
        // Until the commit: a panic in `effect` leaves it set, so the next call reloads.
        self.stale = true;
        let tx = self.conn.transaction().map_err(Error::from)?;
        let mut out = Vec::with_capacity(items.len());
        let mut failed = None;
        for item in items {
            let verdict = self.consumer.observe(&item);
            if let Err(e) = effect(&tx, &item, verdict) {
                failed = Some(e);
                break;
            }
            out.push((item, verdict));
        }
        let result = match failed {
            Some(e) => {
                drop(tx);
                Err(e)
            }
            None => saved::save(&tx, &mut self.consumer)
                .and_then(|()| Ok(tx.commit()?))
                .map_err(E::from),
        };
        if result.is_ok() || crate::mutant::active("consumer-kept-after-rollback") {
            self.stale = false;
        } else {
            // The transaction rolled back (dropped): so must the verdicts. If the file cannot be
            // read now, the next call tries again; the caller gets the error that rolled back.
            match saved::load(&self.conn, &mut self.consumer) {
                Ok(()) => self.stale = false,
                Err(e) => {
                    tracing::warn!(error = %e, "could not reload the consumer's saved state after a rollback; retrying at the next payload")
                }
            }
        }
        result.map(|()| out)
    }

    /// The counts so far (see [`Consumer::report`]).
    pub fn report(&self) -> Report {
        self.consumer.report()
    }

    /// The counts, with a grace period for open gaps (see [`Consumer::report_after`]).
    pub fn report_after(&self, grace: Duration) -> Report {
        self.consumer.report_after(grace)
    }

    /// The consumer, for its other queries ([`Consumer::check_schema`], ...).
    pub fn consumer(&self) -> &Consumer {
        &self.consumer
    }

    /// The connection to the consumer's file: create the service's own tables there, and read
    /// them. Its effects belong in [`observe_all`](Self::observe_all)'s transaction.
    pub fn connection(&self) -> &Connection {
        &self.conn
    }
}
