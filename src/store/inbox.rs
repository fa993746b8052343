//! The inbox: receive a command (store it, deduplicated by id), then apply it exactly once.

use std::fmt::Display;
use std::panic::{AssertUnwindSafe, catch_unwind};
use std::time::Duration;

use rusqlite::{Connection, OptionalExtension, TransactionBehavior, params};
use serde::de::DeserializeOwned;

use super::dead_letters::{self, NewDeadLetter, Origin};
use super::options::Options;
use super::outbox::Tx;
use crate::cbor::Reader;
use crate::envelope::{Envelope, MessageId, decode_headers, encode_headers_into, from_cbor};
use crate::error::{Error, Result};
use crate::time::{ms, now_ms};

/// What [`Outbox::receive`](crate::Outbox::receive) did with a delivery. In every case the
/// delivery is safely stored or recorded, so the broker may be acknowledged.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum Received {
    /// A new command, stored and waiting to be applied.
    Stored(MessageId),
    /// A command with this id was received before (and is still retained): nothing changed.
    Duplicate(MessageId),
    /// The bytes were not a valid envelope, or too large; they were kept in the dead letters.
    DeadLettered {
        /// The dead letter's id, for `retry`/`drop`.
        dead_letter_id: i64,
        /// Why it was refused.
        reason: String,
    },
}

/// A command being applied, as the handler sees it.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct Command {
    /// The sender's message id; the inbox deduplicates on it.
    pub id: MessageId,
    /// The topic it arrived on.
    pub topic: String,
    /// Its ordering key.
    pub key: String,
    /// The event type, if the sender set one.
    pub event_type: Option<String>,
    /// Text headers.
    pub headers: Vec<(String, String)>,
    /// The sender's `src` field.
    pub source: String,
    /// The payload: one CBOR item.
    pub payload: Vec<u8>,
    /// Failed attempts so far.
    pub attempts: u32,
}

impl Command {
    /// Decodes the payload into any `Deserialize` type.
    pub fn payload_as<T: DeserializeOwned>(&self) -> Result<T> {
        from_cbor(&self.payload)
    }
}

/// What [`Outbox::apply_next`](crate::Outbox::apply_next) did.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum ApplyOutcome {
    /// The handler succeeded; its effect and the applied mark committed together.
    Applied {
        /// The command applied.
        id: MessageId,
        /// How many messages the handler published.
        published: usize,
    },
    /// The handler failed (or panicked); its effect was rolled back and it will be retried.
    Failed {
        /// The command.
        id: MessageId,
        /// Failed attempts so far.
        attempts: u32,
        /// The handler's error.
        error: String,
        /// When it becomes due again.
        retry_in: Duration,
    },
    /// The handler failed for the last allowed time; the command is in the dead letters and no
    /// longer blocks the commands behind it.
    DeadLettered {
        /// The command.
        id: MessageId,
        /// Failed attempts.
        attempts: u32,
        /// The last error.
        error: String,
    },
    /// No command is due. `next_due` says when the earliest one backing off is due, if any.
    Idle {
        /// Time until a backing-off command is due again.
        next_due: Option<Duration>,
    },
}

impl ApplyOutcome {
    pub(crate) fn published(&self) -> bool {
        matches!(self, ApplyOutcome::Applied { published, .. } if *published > 0)
    }
}

pub(crate) fn receive(conn: &Connection, options: &Options, topic: &str, bytes: &[u8]) -> Result<Received> {
    let refuse = |reason: String| -> Result<Received> {
        let dead_letter_id = dead_letters::insert(
            conn,
            &NewDeadLetter {
                origin: Origin::Inbox,
                message_id: None,
                topic,
                key: "",
                payload: Some(bytes),
                event_type: None,
                headers: None,
                reason: &reason,
                attempts: 0,
                created_at: Some(now_ms()),
            },
        )?;
        tracing::warn!(topic, dead_letter_id, %reason, "command refused and dead-lettered");
        Ok(Received::DeadLettered {
            dead_letter_id,
            reason,
        })
    };
    let env = match Envelope::decode(bytes) {
        Ok(env) => env,
        Err(e) => return refuse(e.to_string()),
    };
    let max = options.limits.payload_limit();
    if env.payload.len() > max {
        return refuse(
            Error::PayloadTooLarge {
                size: env.payload.len(),
                max,
            }
            .to_string(),
        );
    }
    let headers = (!env.headers.is_empty()).then(|| {
        let mut out = Vec::new();
        encode_headers_into(&mut out, &env.headers);
        out
    });
    let inserted = conn
        .prepare_cached(
            "INSERT INTO inbox (id, topic, key, payload, event_type, headers, source, received_at)
             VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8) ON CONFLICT (id) DO NOTHING",
        )?
        .execute(params![
            env.id.as_bytes(),
            topic,
            env.key,
            env.payload,
            env.event_type,
            headers,
            env.source,
            now_ms()
        ])?;
    Ok(if inserted == 1 {
        Received::Stored(env.id)
    } else {
        Received::Duplicate(env.id)
    })
}

/// The oldest due command whose key has no older unapplied command.
const NEXT_DUE: &str = "
    SELECT seq, id, topic, key, payload, event_type, headers, source, attempts FROM inbox AS i
    WHERE applied_at IS NULL AND dead_at IS NULL AND next_attempt_at <= ?1
      AND NOT EXISTS (SELECT 1 FROM inbox AS o
                      WHERE o.key = i.key AND o.seq < i.seq AND o.applied_at IS NULL AND o.dead_at IS NULL)
    ORDER BY seq LIMIT 1";

/// `NEXT_DUE` without its `applied_at IS NULL` guard: the `double-apply` mutant.
const NEXT_DUE_UNGUARDED: &str = "
    SELECT seq, id, topic, key, payload, event_type, headers, source, attempts FROM inbox AS i
    WHERE dead_at IS NULL AND next_attempt_at <= ?1
    ORDER BY seq LIMIT 1";

/// When the earliest command that is first in its key becomes due.
const NEXT_DUE_AT: &str = "
    SELECT min(next_attempt_at) FROM inbox AS i
    WHERE applied_at IS NULL AND dead_at IS NULL
      AND NOT EXISTS (SELECT 1 FROM inbox AS o
                      WHERE o.key = i.key AND o.seq < i.seq AND o.applied_at IS NULL AND o.dead_at IS NULL)";

pub(crate) fn apply_next<E, F>(conn: &mut Connection, options: &Options, handler: F) -> Result<ApplyOutcome>
where
    F: FnOnce(&mut Tx<'_>, &Command) -> Result<(), E>,
    E: Display,
{
    let now = now_ms();
    let tx = conn.transaction_with_behavior(TransactionBehavior::Immediate)?;
    let double_apply = crate::mutant::active("double-apply");
    let next = tx
        .prepare_cached(if double_apply {
            NEXT_DUE_UNGUARDED
        } else {
            NEXT_DUE
        })?
        .query_row([now], |r| {
            Ok((
                r.get::<_, i64>(0)?,
                r.get::<_, Vec<u8>>(1)?,
                r.get::<_, String>(2)?,
                r.get::<_, String>(3)?,
                r.get::<_, Option<Vec<u8>>>(4)?,
                r.get::<_, Option<String>>(5)?,
                r.get::<_, Option<Vec<u8>>>(6)?,
                r.get::<_, String>(7)?,
                r.get::<_, u32>(8)?,
            ))
        })
        .optional()?;
    let Some((seq, id, topic, key, payload, event_type, headers, source, attempts)) = next else {
        // Only the oldest unapplied command of each key can become due: one waiting behind a
        // backing-off command of its key has next_attempt_at 0 and would read as "due now".
        let next_due: Option<i64> = tx.prepare_cached(NEXT_DUE_AT)?.query_row([], |r| r.get(0))?;
        return Ok(ApplyOutcome::Idle {
            next_due: next_due.map(|at| Duration::from_millis(u64::try_from(at - now).unwrap_or(0))),
        });
    };
    let id = MessageId::from_slice(&id)?;
    let headers = match headers {
        Some(h) => decode_headers(&mut Reader::new(&h))?
            .into_iter()
            .map(|(k, v)| (k.into_owned(), v.into_owned()))
            .collect(),
        None => Vec::new(),
    };
    let command = Command {
        id,
        topic,
        key,
        event_type,
        headers,
        source,
        payload: payload.unwrap_or_default(),
        attempts,
    };

    let mut t = Tx::new(tx, &options.limits);
    // A panicking handler is a failing handler: roll back, count it, and keep the worker alive,
    // so a poison command ends in the dead letters instead of killing the thread every retry.
    let result = catch_unwind(AssertUnwindSafe(|| handler(&mut t, &command)));
    let error = match result {
        Ok(Ok(())) => {
            let published = t.ids().len();
            let marked = t
                .prepare_cached(
                    "UPDATE inbox SET applied_at = ?2, attempts = attempts + 1,
                            payload = CASE WHEN ?3 OR ?4 THEN payload END
                     WHERE seq = ?1 AND (applied_at IS NULL OR ?4) AND dead_at IS NULL",
                )?
                .execute(params![
                    seq,
                    now_ms(),
                    options.keep_applied_payloads,
                    double_apply
                ])?;
            if marked != 1 {
                // Unreachable under the write lock, but never commit an effect for a command
                // another worker applied: dropping `t` rolls this one back.
                return Ok(ApplyOutcome::Idle { next_due: None });
            }
            t.commit()?;
            return Ok(ApplyOutcome::Applied { id, published });
        }
        Ok(Err(e)) => e.to_string(),
        Err(panic) => format!("handler panicked: {}", panic_message(&*panic)),
    };
    drop(t); // rolls the handler's effect back
    record_failure(conn, options, seq, id, attempts + 1, error)
}

fn record_failure(
    conn: &mut Connection,
    options: &Options,
    seq: i64,
    id: MessageId,
    attempts: u32,
    error: String,
) -> Result<ApplyOutcome> {
    let now = now_ms();
    let dead = attempts >= options.max_attempts;
    let retry_in = options.backoff_after(attempts);
    let tx = conn.transaction_with_behavior(TransactionBehavior::Immediate)?;
    let changed = tx.execute(
        "UPDATE inbox SET attempts = ?2, last_error = ?3, next_attempt_at = ?4,
                dead_at = CASE WHEN ?5 THEN ?6 END
         WHERE seq = ?1 AND applied_at IS NULL AND dead_at IS NULL",
        params![seq, attempts, error, now + ms(retry_in), dead, now],
    )?;
    if changed == 1 && dead {
        tx.execute(
            "INSERT INTO dead_letters (origin, message_id, topic, key, payload, event_type, headers,
                                       reason, attempts, created_at)
             SELECT 'inbox', id, topic, key, payload, event_type, headers, last_error, attempts, received_at
             FROM inbox WHERE seq = ?1",
            [seq],
        )?;
    }
    tx.commit()?;
    if dead {
        tracing::warn!(%id, attempts, %error, "command dead-lettered after its last attempt");
        Ok(ApplyOutcome::DeadLettered { id, attempts, error })
    } else {
        tracing::info!(%id, attempts, %error, ?retry_in, "command handler failed; will retry");
        Ok(ApplyOutcome::Failed {
            id,
            attempts,
            error,
            retry_in,
        })
    }
}

/// Takes the payload itself (`&*boxed`): a `&Box<dyn Any>` would coerce to `&dyn Any` of the box
/// and never downcast to the message.
fn panic_message(panic: &(dyn std::any::Any + Send)) -> &str {
    panic
        .downcast_ref::<&str>()
        .copied()
        .or_else(|| panic.downcast_ref::<String>().map(String::as_str))
        .unwrap_or("non-text panic payload")
}

/// Deletes the ids of commands applied, or dead and no longer in the dead letters, longer ago than
/// the retention, at most `batch` of each kind per call (short write transactions). A dead command
/// whose dead letter still exists keeps its row: retrying the dead letter puts that row back in
/// line.
pub(crate) fn prune(conn: &Connection, options: &Options, batch: usize) -> Result<u64> {
    let cutoff = now_ms().saturating_sub(ms(options.inbox_retention));
    let batch = i64::try_from(batch).unwrap_or(i64::MAX);
    let applied = conn.execute(
        "DELETE FROM inbox WHERE seq IN (SELECT seq FROM inbox WHERE applied_at < ?1 LIMIT ?2)",
        params![cutoff, batch],
    )?;
    let dropped = conn.execute(
        "DELETE FROM inbox WHERE seq IN (SELECT seq FROM inbox WHERE dead_at < ?1 AND NOT EXISTS (
             SELECT 1 FROM dead_letters d WHERE d.origin = 'inbox' AND d.message_id = inbox.id)
         LIMIT ?2)",
        params![cutoff, batch],
    )?;
    Ok((applied + dropped) as u64)
}
