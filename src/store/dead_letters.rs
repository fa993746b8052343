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
}

pub(crate) fn insert(conn: &Connection, d: &NewDeadLetter<'_>) -> Result<i64> {
    conn.prepare_cached(
        "INSERT INTO dead_letters (origin, message_id, topic, key, payload, event_type, headers,
                                   reason, attempts, created_at)
         VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8, ?9, ?10)",
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
        d.created_at
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
