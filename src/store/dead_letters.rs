//! Dead letters: messages and commands set aside with the reason, for an operator to retry or drop.

use rusqlite::{Connection, params};

use crate::envelope::MessageId;
use crate::error::{Error, Result};

/// Where a dead letter came from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum Origin {
    /// An outgoing message the relay could not publish (e.g. larger than the broker accepts).
    Outbox,
    /// An incoming command that was malformed or whose handler kept failing.
    Inbox,
}

impl Origin {
    fn as_sql(self) -> &'static str {
        match self {
            Origin::Outbox => "outbox",
            Origin::Inbox => "inbox",
        }
    }
}

/// A message or command set aside, with why.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct DeadLetter {
    /// Its id in the dead letters, for retry and drop.
    pub dead_letter_id: i64,
    /// Outgoing or incoming.
    pub origin: Origin,
    /// The message id, when the input carried a readable one.
    pub message_id: Option<MessageId>,
    /// Topic.
    pub topic: String,
    /// Ordering key.
    pub key: String,
    /// The stored payload, or the raw bytes received for malformed input.
    pub payload: Option<Vec<u8>>,
    /// Why it was set aside.
    pub reason: String,
    /// Handler attempts made.
    pub attempts: u32,
    /// When it was set aside, Unix milliseconds.
    pub dead_at_ms: i64,
}

pub(crate) struct NewDeadLetter<'a> {
    pub origin: Origin,
    pub message_id: Option<&'a [u8]>,
    pub topic: &'a str,
    pub key: &'a str,
    pub payload: Option<&'a [u8]>,
    pub event_type: Option<&'a str>,
    pub headers: Option<&'a [u8]>,
    pub reason: &'a str,
    pub attempts: u32,
    pub created_at: Option<i64>,
    /// A delivery refused before it was stored: bounded (see [`evict_refusals`]).
    pub refused: bool,
}

pub(crate) fn insert(conn: &Connection, d: &NewDeadLetter<'_>) -> Result<i64> {
    conn.prepare_cached(
        "INSERT INTO dead_letters (origin, message_id, topic, key, payload, event_type, headers,
                                   reason, attempts, created_at, refused)
         VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8, ?9, ?10, ?11)",
    )?
    .execute(params![
        d.origin.as_sql(),
        d.message_id,
        d.topic,
        d.key,
        d.payload,
        d.event_type,
        d.headers,
        d.reason,
        d.attempts,
        d.created_at,
        d.refused
    ])?;
    Ok(conn.last_insert_rowid())
}

pub(crate) fn list(conn: &Connection, limit: usize) -> Result<Vec<DeadLetter>> {
    let mut stmt = conn.prepare_cached(
        "SELECT dl_id, origin, message_id, topic, key, CAST(payload AS BLOB), reason, attempts, dead_at
         FROM dead_letters ORDER BY dl_id LIMIT ?1",
    )?;
    let rows = stmt.query_map([i64::try_from(limit).unwrap_or(i64::MAX)], |r| {
        Ok((
            r.get::<_, i64>(0)?,
            r.get::<_, String>(1)?,
            r.get::<_, Option<Vec<u8>>>(2)?,
            DeadLetter {
                dead_letter_id: 0,
                origin: Origin::Outbox,
                message_id: None,
                topic: r.get(3)?,
                key: r.get(4)?,
                payload: r.get(5)?,
                reason: r.get(6)?,
                attempts: r.get(7)?,
                dead_at_ms: r.get(8)?,
            },
        ))
    })?;
    rows.map(|row| {
        let (dl_id, origin, message_id, mut dl) = row?;
        dl.dead_letter_id = dl_id;
        dl.origin = if origin == "inbox" {
            Origin::Inbox
        } else {
            Origin::Outbox
        };
        dl.message_id = message_id.as_deref().map(MessageId::from_slice).transpose()?;
        Ok(dl)
    })
    .collect()
}

pub(crate) fn drop(conn: &Connection, dl_id: i64) -> Result<()> {
    match conn.execute("DELETE FROM dead_letters WHERE dl_id = ?1", [dl_id])? {
        0 => Err(Error::NotFound(format!("dead letter {dl_id}"))),
        _ => Ok(()),
    }
}

/// The refused dead letters kept and evicted (`edge_outbox_refusals`).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub(crate) struct Refusals {
    pub kept: u64,
    pub kept_bytes: u64,
    pub evicted: u64,
    pub evicted_bytes: u64,
}

pub(crate) fn refusals(conn: &Connection) -> Result<Refusals> {
    Ok(conn
        .prepare_cached(
            "SELECT kept, kept_bytes, evicted, evicted_bytes FROM edge_outbox_refusals WHERE only = 1",
        )?
        .query_row([], |r| {
            let n = |i| r.get::<_, i64>(i).map(|v| u64::try_from(v).unwrap_or(0));
            Ok(Refusals {
                kept: n(0)?,
                kept_bytes: n(1)?,
                evicted: n(2)?,
                evicted_bytes: n(3)?,
            })
        })?)
}

/// Deletes the oldest refused dead letters until at most `max_count` of them and `max_bytes` of
/// their bytes are kept, counting each as evicted. Returns how many it evicted. Costs one row
/// read while within both bounds.
pub(crate) fn evict_refusals(conn: &Connection, max_count: u64, max_bytes: u64) -> Result<u64> {
    let now = refusals(conn)?;
    if now.kept <= max_count && now.kept_bytes <= max_bytes {
        return Ok(0);
    }
    // Newest first: each row with the bytes of itself and every newer one; beyond either bound,
    // it goes.
    let victims: Vec<(i64, i64)> = conn
        .prepare_cached(
            "SELECT dl_id, bytes FROM (
                 SELECT dl_id, coalesce(length(CAST(payload AS BLOB)), 0) AS bytes,
                        row_number() OVER newest AS rank,
                        sum(coalesce(length(CAST(payload AS BLOB)), 0)) OVER newest AS upto
                 FROM dead_letters WHERE refused = 1
                 WINDOW newest AS (ORDER BY dl_id DESC ROWS UNBOUNDED PRECEDING))
             WHERE rank > ?1 OR upto > ?2",
        )?
        .query_map(
            params![
                i64::try_from(max_count).unwrap_or(i64::MAX),
                i64::try_from(max_bytes).unwrap_or(i64::MAX)
            ],
            |r| Ok((r.get(0)?, r.get(1)?)),
        )?
        .collect::<rusqlite::Result<_>>()?;
    let mut bytes = 0i64;
    let mut delete = conn.prepare_cached("DELETE FROM dead_letters WHERE dl_id = ?1")?;
    for (dl_id, size) in &victims {
        delete.execute([dl_id])?;
        bytes += size;
    }
    let evicted = victims.len() as u64;
    conn.prepare_cached(
        "UPDATE edge_outbox_refusals SET evicted = evicted + ?1, evicted_bytes = evicted_bytes + ?2 WHERE only = 1",
    )?
    .execute(params![i64::try_from(evicted).unwrap_or(i64::MAX), bytes])?;
    Ok(evicted)
}
