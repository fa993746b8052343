//! The write path: messages inserted in the caller's transaction, checked against the limits.

use std::ops::Deref;

use std::sync::atomic::{AtomicI64, Ordering};

use rusqlite::{OptionalExtension, Transaction, params};
use serde::Serialize;

use super::counters::{self, FOLD_TAIL};
use super::gaps::{self, Removal};
use super::options::{Limits, OnFull, Options};
use crate::envelope::{MessageId, encode_headers_into, to_cbor};
use crate::error::{Error, Result};
use crate::time::{ms, now_ms};

/// What [`Outbox::transaction`](crate::Outbox::transaction) returns: the closure's value and the
/// ids of the messages it published, in publish order.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct Committed<T> {
    /// The closure's return value.
    pub value: T,
    /// The ids of the messages published in the transaction.
    pub ids: Vec<MessageId>,
}

/// An open write transaction: the application's SQL through [`Deref`] to
/// [`rusqlite::Transaction`][Transaction], messages through [`Tx::publish`] and [`Tx::send`].
///
/// [Transaction]: https://docs.rs/rusqlite/0.37/rusqlite/struct.Transaction.html
pub struct Tx<'c> {
    tx: Transaction<'c>,
    limits: &'c Limits,
    ids: Vec<MessageId>,
    /// Where [`Tx::publish`] serialises payloads: one buffer for the whole transaction.
    payload: Vec<u8>,
    /// The handle's idea of the counters' `counted_through` (at most the real one), to fold the
    /// tail in once it may be long (see `super::counters`); `None`: never fold here.
    folded: Option<&'c AtomicI64>,
    /// The highest sequence number inserted here.
    last_seq: Option<i64>,
}

impl std::fmt::Debug for Tx<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Tx")
            .field("published", &self.ids)
            .finish_non_exhaustive()
    }
}

impl<'c> Tx<'c> {
    pub(crate) fn new(tx: Transaction<'c>, limits: &'c Limits, folded: Option<&'c AtomicI64>) -> Self {
        Tx {
            tx,
            limits,
            ids: Vec::new(),
            payload: Vec::new(),
            folded,
            last_seq: None,
        }
    }

    /// Queues `value`, serialised to CBOR, for `topic`. Messages with the same `key` are
    /// published in commit order. Returns the message id, minted here and kept across resends.
    ///
    /// Fails with [`Error::PayloadTooLarge`], [`Error::StorageFull`] or [`Error::DiskFull`];
    /// propagate the error with `?` and the whole transaction rolls back.
    pub fn publish<V: Serialize + ?Sized>(&mut self, topic: &str, key: &str, value: &V) -> Result<MessageId> {
        self.payload.clear();
        // Room for a typical event at once, rather than growing through 8, 16, 32, ... bytes.
        self.payload.reserve(PAYLOAD_CAPACITY);
        to_cbor_into(value, &mut self.payload)?;
        let row = Row {
            topic,
            key,
            payload: &self.payload,
            event_type: None,
            headers: None,
            evictable: None,
            id: None,
            lifetime: None,
            priority: None,
            coalescing: None,
        };
        let inserted = insert(&self.tx, self.limits, &row)?;
        self.push(inserted)
    }

    /// Queues a [`Message`] built with an event type, headers or an eviction class.
    pub fn send(&mut self, message: &Message) -> Result<MessageId> {
        let inserted = insert(&self.tx, self.limits, &message.row(&mut Vec::new()))?;
        self.push(inserted)
    }

    fn push(&mut self, (id, seq): (MessageId, i64)) -> Result<MessageId> {
        self.ids.push(id);
        self.last_seq = Some(seq);
        Ok(id)
    }

    pub(crate) fn commit(self) -> Result<Vec<MessageId>> {
        let mut folded_to = None;
        if let (Some(folded), Some(last)) = (self.folded, self.last_seq)
            && last - folded.load(Ordering::Relaxed) > FOLD_TAIL
        {
            folded_to = Some(counters::fold(&self.tx)?);
        }
        self.tx.commit()?;
        if let (Some(folded), Some(to)) = (self.folded, folded_to) {
            folded.fetch_max(to, Ordering::Relaxed);
        }
        Ok(self.ids)
    }

    /// The highest sequence number inserted so far in this transaction.
    pub(crate) fn last_seq(&self) -> Option<i64> {
        self.last_seq
    }

    pub(crate) fn ids(&self) -> &[MessageId] {
        &self.ids
    }
}

impl<'c> Deref for Tx<'c> {
    type Target = Transaction<'c>;

    fn deref(&self) -> &Transaction<'c> {
        &self.tx
    }
}

/// A message with optional metadata, for [`Tx::send`] and [`enqueue`].
///
/// ```
/// use edge_outbox::Message;
/// let msg = Message::new("orders/placed", "order-42", &("o-42", 1250))?
///     .event_type("OrderPlaced.v1")
///     .header("trace-id", "4bf92f3577b34da6")
///     .evictable(true);
/// # Ok::<(), edge_outbox::Error>(())
/// ```
#[derive(Debug, Clone, PartialEq, Eq)]
#[must_use = "a message is only sent by `Tx::send`"]
pub struct Message {
    topic: String,
    key: String,
    payload: Vec<u8>,
    event_type: Option<String>,
    headers: Vec<(String, String)>,
    // Unset (None): the message's class decides (`Limits::class`), else the default.
    evictable: Option<bool>,
    id: Option<MessageId>,
    expires_after: Option<std::time::Duration>,
    priority: Option<u8>,
    coalescing: Option<bool>,
}

/// The highest message priority ([`Message::priority`]); the default, and lowest, is 0.
pub const MAX_PRIORITY: u8 = 3;

impl Message {
    /// A message carrying `value` serialised to CBOR.
    pub fn new<V: Serialize + ?Sized>(
        topic: impl Into<String>,
        key: impl Into<String>,
        value: &V,
    ) -> Result<Self> {
        Ok(Self::from_parts(topic.into(), key.into(), to_cbor(value)?))
    }

    /// A message carrying bytes that are already one CBOR item (checked).
    pub fn from_cbor(topic: impl Into<String>, key: impl Into<String>, cbor: Vec<u8>) -> Result<Self> {
        crate::cbor::check_one_item(&cbor)?;
        Ok(Self::from_parts(topic.into(), key.into(), cbor))
    }

    fn from_parts(topic: String, key: String, payload: Vec<u8>) -> Self {
        Message {
            topic,
            key,
            payload,
            event_type: None,
            headers: Vec::new(),
            evictable: None,
            id: None,
            expires_after: None,
            priority: None,
            coalescing: None,
        }
    }

    /// Sets the message's priority lane, 0 (the default) to [`MAX_PRIORITY`]: with a backlog, the
    /// relay publishes higher lanes first (an alarm does not wait behind a day of telemetry), each
    /// lane in commit order. After a connection ended with a window of messages on the wire, those
    /// go out one at a time, taking turns with the higher lanes: an alarm then goes after at most
    /// one of them. Messages of one key keep their order only within a lane: give a key's
    /// messages one priority. A priority above [`MAX_PRIORITY`] fails the send with
    /// [`Error::InvalidConfig`].
    ///
    /// ```
    /// let alarm = edge_outbox::Message::new("alarms/door", "door-1", "open")?.priority(3);
    /// # Ok::<(), edge_outbox::Error>(())
    /// ```
    pub fn priority(mut self, priority: u8) -> Self {
        self.priority = Some(priority);
        self
    }

    /// Makes the message a latest value: committing it replaces every older coalescing message of
    /// the same topic and key that the relay has not yet taken for publishing, so ten thousand
    /// readings of one sensor during an outage go out as one. Each replaced message is counted
    /// ([`Stats::coalesced`](crate::Stats)) and announced to the cloud in a gap notice (cause
    /// `coalesced`). A message the relay may already have published is never replaced: the relay
    /// claims it as it hands it to the MQTT client. Until then (read ahead, waiting in a batch or
    /// behind the pace, or left so by a stop or a crash) it is still replaced; once claimed it
    /// stays until the broker acknowledges it, through any outage.
    ///
    /// ```
    /// let reading = edge_outbox::Message::new("sensors/t1", "t1", &21.5)?.coalescing(true);
    /// # Ok::<(), edge_outbox::Error>(())
    /// ```
    pub fn coalescing(mut self, coalescing: bool) -> Self {
        self.coalescing = Some(coalescing);
        self
    }

    /// Gives the message a lifetime: if it is still unpublished this long after it was written
    /// (the device offline, the broker unreachable), the relay removes it instead of publishing it
    /// late, and announces the gap (cause `expired`) to the cloud. For readings that are worthless
    /// once stale. Default: no expiry.
    pub fn expires_after(mut self, lifetime: std::time::Duration) -> Self {
        self.expires_after = Some(lifetime);
        self
    }

    /// Sets the event type (e.g. `"OrderPlaced.v2"`): version events in the type or a header.
    pub fn event_type(mut self, event_type: impl Into<String>) -> Self {
        self.event_type = Some(event_type.into());
        self
    }

    /// Adds a text header, such as a trace id or schema version. A repeated name replaces the
    /// earlier value.
    pub fn header(mut self, name: impl Into<String>, value: impl Into<String>) -> Self {
        let name = name.into();
        self.headers.retain(|(n, _)| *n != name);
        self.headers.push((name, value.into()));
        self
    }

    /// Marks the message evictable: under [`OnFull::EvictOldest`] it may be deleted unsent to make
    /// room (counted in the stats). Use it for telemetry a gap in which costs little; leave it off
    /// for anything that drives state elsewhere (default off).
    pub fn evictable(mut self, evictable: bool) -> Self {
        self.evictable = Some(evictable);
        self
    }

    /// Uses `id` instead of minting a new one. For an operation the caller may retry as a new
    /// transaction (a client resubmitting a request), derive the id from the client's idempotency
    /// key: an id minted per attempt would make each retry a different message downstream.
    pub fn with_id(mut self, id: MessageId) -> Self {
        self.id = Some(id);
        self
    }

    /// The encoded payload.
    pub fn payload(&self) -> &[u8] {
        &self.payload
    }
}

/// Queues `message` in a transaction the caller owns, for applications that manage their own
/// `rusqlite` connection. The connection must be on a file opened once by
/// [`Outbox::open`](crate::Outbox::open) (which creates the tables). A running relay notices the
/// commit within its poll interval.
///
/// ```
/// # let dir = tempfile::tempdir().expect("temp dir");
/// # let path = dir.path().join("device.db");
/// edge_outbox::Outbox::open(&path)?; // creates the schema once
/// let mut conn = rusqlite::Connection::open(&path)?;
/// let tx = conn.transaction()?;
/// let msg = edge_outbox::Message::new("events", "k", "hello")?;
/// edge_outbox::enqueue(&tx, &edge_outbox::Limits::default(), &msg)?;
/// tx.commit()?;
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
pub fn enqueue(tx: &Transaction<'_>, limits: &Limits, message: &Message) -> Result<MessageId> {
    Ok(insert(tx, limits, &message.row(&mut Vec::new()))?.0)
}

impl Message {
    /// Its topic and key: what a newer value of it replaces.
    pub(crate) fn slot(&self) -> (&str, &str) {
        (&self.topic, &self.key)
    }

    /// What a send checks of the message itself, without a transaction: its topic, size,
    /// payload form and priority (not the pending limits, nor a payload schema, which need the
    /// file).
    pub(crate) fn check(&self, limits: &Limits) -> Result<()> {
        limits.check_topic(&self.topic)?;
        if self.payload.len() > limits.payload_limit() {
            return Err(Error::PayloadTooLarge {
                size: self.payload.len(),
                max: limits.payload_limit(),
            });
        }
        limits.check_json(&self.payload)?;
        match self.priority {
            Some(p) if p > MAX_PRIORITY => Err(Error::InvalidConfig(format!(
                "message priority {p} is above the highest, {MAX_PRIORITY}"
            ))),
            _ => Ok(()),
        }
    }

    /// The row to insert; `headers` holds the encoded headers it refers to.
    fn row<'a>(&'a self, headers: &'a mut Vec<u8>) -> Row<'a> {
        if !self.headers.is_empty() {
            encode_headers_into(headers, &self.headers);
        }
        Row {
            topic: &self.topic,
            key: &self.key,
            payload: &self.payload,
            event_type: self.event_type.as_deref(),
            headers: (!self.headers.is_empty()).then_some(headers.as_slice()),
            evictable: self.evictable,
            id: self.id,
            lifetime: self.expires_after,
            priority: self.priority,
            coalescing: self.coalescing,
        }
    }
}

/// Bytes reserved for a published payload up front: most events fit.
const PAYLOAD_CAPACITY: usize = 256;

/// Serialises `value` as CBOR at the end of `out`, as [`to_cbor`] does into a new vector.
fn to_cbor_into<V: Serialize + ?Sized>(value: &V, out: &mut Vec<u8>) -> Result<()> {
    ciborium::into_writer(value, out).map_err(|e| Error::Encode(e.to_string()))
}

#[derive(Clone, Copy)]
struct Row<'a> {
    topic: &'a str,
    key: &'a str,
    payload: &'a [u8],
    event_type: Option<&'a str>,
    headers: Option<&'a [u8]>,
    evictable: Option<bool>,
    id: Option<MessageId>,
    lifetime: Option<std::time::Duration>,
    priority: Option<u8>,
    coalescing: Option<bool>,
}

/// What a row gets for what its message left unset: its class's setting, else the default.
struct Settled {
    evictable: bool,
    expires_at: Option<i64>,
    priority: u8,
    coalescing: bool,
}

impl Row<'_> {
    fn settle(&self, limits: &Limits) -> Settled {
        let class = super::class::of(limits.classes(), self.topic);
        let lifetime = self.lifetime.or_else(|| class.and_then(|c| c.lifetime));
        Settled {
            evictable: self
                .evictable
                .or_else(|| class.and_then(|c| c.evictable))
                .unwrap_or(false),
            expires_at: lifetime.map(|d| now_ms().saturating_add(ms(d))),
            priority: self
                .priority
                .or_else(|| class.and_then(|c| c.priority))
                .unwrap_or(0),
            coalescing: self
                .coalescing
                .or_else(|| class.and_then(|c| c.coalescing))
                .unwrap_or(false),
        }
    }
}

/// Inserts `row`; returns its id and sequence number.
fn insert(tx: &Transaction<'_>, limits: &Limits, row: &Row<'_>) -> Result<(MessageId, i64)> {
    limits.check_topic(row.topic)?;
    if row.payload.len() > limits.payload_limit() {
        return Err(Error::PayloadTooLarge {
            size: row.payload.len(),
            max: limits.payload_limit(),
        });
    }
    limits.check_json(row.payload)?;
    #[cfg(feature = "schemas")]
    if !limits.schemas.is_empty() && !crate::mutant::active("schema-unchecked-at-write") {
        let stamp = crate::payload_schema::check_and_stamp(
            &limits.schemas,
            row.topic,
            row.event_type,
            row.headers,
            row.payload,
        )?;
        if let Some((event_type, headers)) = stamp {
            let stamped = Row {
                event_type: Some(&event_type),
                headers: Some(&headers),
                ..*row
            };
            return insert_checked(tx, limits, &stamped);
        }
    }
    insert_checked(tx, limits, row)
}

/// Inserts `row`, whose topic, size and schema are checked.
fn insert_checked(tx: &Transaction<'_>, limits: &Limits, row: &Row<'_>) -> Result<(MessageId, i64)> {
    let settled = row.settle(limits);
    if settled.priority > MAX_PRIORITY {
        return Err(Error::InvalidConfig(format!(
            "message priority {} is above the highest, {MAX_PRIORITY}",
            settled.priority
        )));
    }
    if limits.is_bounded() {
        make_room(
            tx,
            limits,
            row.payload.len() as u64,
            settled.coalescing.then_some(row),
        )?;
    }
    let id = row.id.unwrap_or_else(MessageId::new_v7);
    if row.event_type.is_none()
        && row.headers.is_none()
        && !settled.evictable
        && settled.expires_at.is_none()
        && settled.priority == 0
        && !settled.coalescing
    {
        // The plain publish binds five values, not eight: the other columns keep their
        // documented defaults (NULL, NULL, 0). Measured about 2% of a message's cost.
        tx.prepare_cached(
            "INSERT INTO outbox (id, topic, key, payload, created_at) VALUES (?1, ?2, ?3, ?4, ?5)",
        )?
        .execute(params![id.as_bytes(), row.topic, row.key, row.payload, now_ms()])?;
    } else {
        tx.prepare_cached(
            "INSERT INTO outbox (id, topic, key, payload, event_type, headers, evictable, created_at,
                                 expires_at, priority, coalescing)
             VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8, ?9, ?10, ?11)",
        )?
        .execute(params![
            id.as_bytes(),
            row.topic,
            row.key,
            row.payload,
            row.event_type,
            row.headers,
            settled.evictable,
            now_ms(),
            settled.expires_at,
            settled.priority,
            settled.coalescing
        ])?;
    }
    Ok((id, tx.last_insert_rowid()))
}

/// How many messages, and payload bytes, a coalescing insert of `row` will replace (the
/// `outbox_coalesce` trigger deletes them after the insert): room the limits must not evict for.
fn replaceable(tx: &Transaction<'_>, row: &Row<'_>) -> Result<(u64, u64)> {
    Ok(tx
        .prepare_cached(
            "SELECT count(*), coalesce(sum(length(CAST(payload AS BLOB))), 0) FROM outbox
             WHERE topic = ?1 AND key = ?2 AND coalescing = 1 AND claimed IS NULL",
        )?
        .query_row(params![row.topic, row.key], |r| Ok((r.get(0)?, r.get(1)?)))?)
}

/// Makes the outbox able to take one more message of `size` bytes, evicting if allowed. A
/// coalescing `row` gets the room its predecessors free (re-read after each eviction, which may
/// have taken one of them).
fn make_room(tx: &Transaction<'_>, limits: &Limits, size: u64, coalescing: Option<&Row<'_>>) -> Result<()> {
    if let Some(max) = limits.pending_bytes_limit().filter(|&max| size > max) {
        return Err(Error::StorageFull {
            limit: format!("a {size}-byte message is larger than the {max}-byte pending limit"),
        });
    }
    // Every row counted: the checks below read the counters alone, and an eviction (a counted
    // row deleted) updates them through the trigger.
    counters::fold(tx)?;
    loop {
        let (count, bytes): (u64, u64) = tx
            .prepare_cached("SELECT pending_count, pending_bytes FROM outbox_counters")?
            .query_row([], |r| Ok((r.get(0)?, r.get(1)?)))?;
        let freed = match coalescing {
            Some(row) => replaceable(tx, row)?,
            None => (0, 0),
        };
        let (count, bytes) = (count.saturating_sub(freed.0), bytes.saturating_sub(freed.1));
        let full = match (limits.pending_messages_limit(), limits.pending_bytes_limit()) {
            (Some(max), _) if count >= max => format!("{max} pending messages"),
            (_, Some(max)) if bytes + size > max => format!("{max} pending bytes"),
            _ => return Ok(()),
        };
        if limits.full_policy() != OnFull::EvictOldest || !evict_oldest(tx)? {
            return Err(Error::StorageFull { limit: full });
        }
    }
}

/// Deletes the oldest evictable pending message of the lowest priority that the relay has not
/// claimed, recording the gap; false if there is none.
fn evict_oldest(tx: &Transaction<'_>) -> Result<bool> {
    // Not a claimed row: the relay may have it on the wire, and the cloud would get it and a
    // notice that it was evicted.
    let sql = if crate::mutant::active("remove-claimed") {
        "SELECT seq FROM outbox WHERE evictable = 1 ORDER BY priority, seq LIMIT 1"
    } else {
        "SELECT seq FROM outbox WHERE evictable = 1 AND claimed IS NULL ORDER BY priority, seq LIMIT 1"
    };
    let oldest: Option<i64> = tx.prepare_cached(sql)?.query_row([], |r| r.get(0)).optional()?;
    let Some(seq) = oldest else {
        return Ok(false);
    };
    gaps::record(tx, seq, seq, Removal::Evicted, None)?;
    let (id, size): (Vec<u8>, i64) = tx
        .prepare_cached("DELETE FROM outbox WHERE seq = ?1 RETURNING id, length(CAST(payload AS BLOB))")?
        .query_row([seq], |r| Ok((r.get(0)?, r.get(1)?)))?;
    tx.prepare_cached(
        "UPDATE outbox_counters SET evicted = evicted + 1, evicted_bytes = evicted_bytes + ?1",
    )?
    .execute([size])?;
    tracing::warn!(id = %MessageId::from_slice(&id).map(|i| i.to_string()).unwrap_or_default(), size, "evicted an unsent message to make room");
    Ok(true)
}

/// Deletes retained sent rows older than the sent retention, at most `batch` per call.
pub(crate) fn prune_sent(conn: &rusqlite::Connection, options: &Options, batch: usize) -> Result<u64> {
    let Some(retention) = options.sent_retention else {
        return Ok(0);
    };
    let n = conn.execute(
        "DELETE FROM outbox_sent WHERE seq IN (SELECT seq FROM outbox_sent
             WHERE sent_at < ?1 AND (sent_uptime IS NULL OR sent_uptime <= ?3) LIMIT ?2)",
        params![
            now_ms().saturating_sub(ms(retention)),
            i64::try_from(batch).unwrap_or(i64::MAX),
            super::uptime::cutoff(conn, options, retention)?,
        ],
    )?;
    Ok(n as u64)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::Outbox;

    #[test]
    fn wildcard_topics_are_refused_before_anything_is_written() {
        let dir = tempfile::tempdir().expect("tempdir");
        let outbox = Outbox::open(dir.path().join("t.db")).expect("open");
        for topic in ["", "a/+/b", "a/#", "$SYS/x", "a\0b", &"t".repeat(65_536)] {
            let err = outbox
                .transaction(|tx| tx.publish(topic, "k", &1))
                .expect_err("refused");
            assert!(matches!(err, Error::InvalidTopic { .. }), "{err}");
        }
        assert_eq!(outbox.stats().expect("stats").pending_messages, 0);
    }
}
