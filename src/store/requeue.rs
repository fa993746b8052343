//! Putting a dead letter back in line: a command back into the inbox, a message back into the
//! outbox. It stands above both and the dead letters, so that neither of them imports the other's
//! caller (the inbox sets commands aside as dead letters; this module takes them back).

use rusqlite::{Connection, OptionalExtension, TransactionBehavior};

use super::inbox::{self, Received};
use super::options::Options;
use crate::error::{Error, Result};

/// Retries dead letter `dl_id` in one transaction: requeued, and the dead letter deleted.
pub(crate) fn retry(conn: &mut Connection, options: &Options, dl_id: i64) -> Result<()> {
    let tx = conn.transaction_with_behavior(TransactionBehavior::Immediate)?;
    type Row = (String, Option<Vec<u8>>, String, Option<Vec<u8>>, bool);
    let row: Option<Row> = tx
        .query_row(
            "SELECT origin, message_id, topic, CAST(payload AS BLOB), refused FROM dead_letters WHERE dl_id = ?1",
            [dl_id],
            |r| Ok((r.get(0)?, r.get(1)?, r.get(2)?, r.get(3)?, r.get(4)?)),
        )
        .optional()?;
    let Some((origin, message_id, topic, raw, refused)) = row else {
        return Err(Error::NotFound(format!("dead letter {dl_id}")));
    };
    match (origin.as_str(), message_id) {
        // A stored command: give it a fresh set of attempts; its inbox row still holds its id
        // (pruning keeps it while this dead letter names it).
        ("inbox", Some(id)) => {
            let changed = tx.execute(
                "UPDATE inbox SET dead_at = NULL, done_uptime = NULL, attempts = 0, next_attempt_at = 0, last_error = NULL, rejected = 0
                 WHERE id = ?1 AND dead_at IS NOT NULL AND applied_at IS NULL",
                [&id],
            )?;
            if changed != 1 {
                let stored: bool =
                    tx.query_row("SELECT EXISTS (SELECT 1 FROM inbox WHERE id = ?1)", [&id], |r| {
                        r.get(0)
                    })?;
                if stored {
                    // Applied since, or waiting: putting it back could only apply it twice.
                    return Err(Error::RetryRefused {
                        dead_letter_id: dl_id,
                        reason: "its command is already in the inbox (applied or waiting); drop the \
                                 dead letter"
                            .into(),
                    });
                }
                if !refused {
                    // A stored command's dead letter holds its payload, not the delivery: there
                    // is nothing to receive again.
                    return Err(Error::NotFound(format!(
                        "the command of dead letter {dl_id} in the inbox (deleted by hand?); drop the \
                         dead letter"
                    )));
                }
                // Refused with a readable id, and never stored: receive it again.
                receive_again(&tx, options, dl_id, &topic, raw.as_deref())?;
            }
        }
        // Input that never made it into the inbox: receive it again (limits may have changed).
        ("inbox", None) => receive_again(&tx, options, dl_id, &topic, raw.as_deref())?,
        // An outgoing message: queue it again with its id, behind what is pending now, in its
        // lane, with its lifetime (counted from when it was written) and evictability.
        _ => {
            // A latest-value reading put back behind a newer one of its topic and key would be
            // published last, and the cloud would keep the stale value.
            let newer: bool = tx.query_row(
                "SELECT EXISTS (SELECT 1 FROM dead_letters d JOIN outbox o ON o.topic = d.topic AND o.key = d.key
                                WHERE d.dl_id = ?1 AND d.coalescing = 1 AND o.coalescing = 1)",
                [dl_id],
                |r| r.get(0),
            )?;
            if newer {
                return Err(Error::RetryRefused {
                    dead_letter_id: dl_id,
                    reason: "a newer value of its topic and key is pending (it is a coalescing \
                             message): drop the dead letter"
                        .into(),
                });
            }
            // Its lifetime counts from when it was written: put back after it ended, it would
            // only be removed again at once, announced as expired.
            let expired: bool = tx.query_row(
                "SELECT EXISTS (SELECT 1 FROM dead_letters WHERE dl_id = ?1 AND expires_at <= ?2)",
                rusqlite::params![dl_id, crate::time::now_ms()],
                |r| r.get(0),
            )?;
            if expired {
                return Err(Error::RetryRefused {
                    dead_letter_id: dl_id,
                    reason: "its lifetime (Message::expires_after) has ended since it was written: \
                             drop the dead letter"
                        .into(),
                });
            }
            // Inserted as not coalescing, then marked: the insert trigger would otherwise replace
            // the values of its key pending now, all newer than it.
            tx.execute(
                if crate::mutant::active("retry-loses-settings") {
                    "INSERT INTO outbox (id, topic, key, payload, event_type, headers, created_at)
                     SELECT message_id, topic, key, payload, event_type, headers, coalesce(created_at, dead_at)
                     FROM dead_letters WHERE dl_id = ?1"
                } else {
                    "INSERT INTO outbox (id, topic, key, payload, event_type, headers, created_at,
                                         priority, expires_at, evictable)
                     SELECT message_id, topic, key, payload, event_type, headers, coalesce(created_at, dead_at),
                            priority, expires_at, evictable
                     FROM dead_letters WHERE dl_id = ?1"
                },
                [dl_id],
            )?;
            let seq = tx.last_insert_rowid();
            tx.execute(
                "UPDATE outbox SET coalescing = 1
                 WHERE seq = ?1 AND (SELECT coalescing FROM dead_letters WHERE dl_id = ?2) = 1",
                [seq, dl_id],
            )?;
        }
    }
    tx.execute("DELETE FROM dead_letters WHERE dl_id = ?1", [dl_id])?;
    tx.commit()?;
    Ok(())
}

/// Receives a refused delivery again, as if it had just arrived: verified against the file's
/// signature policy and limits. Refused again, it fails with [`Error::RetryRefused`] and the
/// caller's transaction rolls back, so the dead letter stays as it was.
fn receive_again(
    conn: &Connection,
    options: &Options,
    dl_id: i64,
    topic: &str,
    raw: Option<&[u8]>,
) -> Result<()> {
    let Some(raw) = raw else {
        return Err(Error::NotFound(format!(
            "the bytes of dead letter {dl_id} (an oversized delivery is kept without them; \
             have the sender send it again, or drop it)"
        )));
    };
    match inbox::receive(conn, options, topic, raw)? {
        Received::DeadLettered { reason, .. } => Err(Error::RetryRefused {
            dead_letter_id: dl_id,
            reason,
        }),
        Received::Stored(_) | Received::Duplicate(_) => Ok(()),
    }
}
