//! Putting a dead letter back in line: a command back into the inbox, a message back into the
//! outbox. It stands above both and the dead letters, so that neither of them imports the other's
//! caller (the inbox sets commands aside as dead letters; this module takes them back).

use rusqlite::{Connection, OptionalExtension, TransactionBehavior};

use super::inbox;
use super::options::Options;
use crate::error::{Error, Result};

/// Retries dead letter `dl_id` in one transaction: requeued, and the dead letter deleted.
pub(crate) fn retry(conn: &mut Connection, options: &Options, dl_id: i64) -> Result<()> {
    let tx = conn.transaction_with_behavior(TransactionBehavior::Immediate)?;
    type Row = (String, Option<Vec<u8>>, String, Option<Vec<u8>>);
    let row: Option<Row> = tx
        .query_row(
            "SELECT origin, message_id, topic, CAST(payload AS BLOB) FROM dead_letters WHERE dl_id = ?1",
            [dl_id],
            |r| Ok((r.get(0)?, r.get(1)?, r.get(2)?, r.get(3)?)),
        )
        .optional()?;
    let Some((origin, message_id, topic, raw)) = row else {
        return Err(Error::NotFound(format!("dead letter {dl_id}")));
    };
    match (origin.as_str(), message_id) {
        // A stored command: give it a fresh set of attempts; its inbox row still holds its id.
        ("inbox", Some(id)) => {
            tx.execute(
                "UPDATE inbox SET dead_at = NULL, done_uptime = NULL, attempts = 0, next_attempt_at = 0, last_error = NULL
                 WHERE id = ?1",
                [id],
            )?;
        }
        // Input that never made it into the inbox: receive it again (limits may have changed).
        ("inbox", None) => {
            let Some(raw) = raw else {
                return Err(Error::NotFound(format!(
                    "the bytes of dead letter {dl_id} (an oversized delivery is kept without them; \
                     have the sender send it again, or drop it)"
                )));
            };
            inbox::receive(&tx, options, &topic, &raw)?;
        }
        // An outgoing message: queue it again with its id, behind what is pending now.
        _ => {
            tx.execute(
                "INSERT INTO outbox (id, topic, key, payload, event_type, headers, created_at)
                 SELECT message_id, topic, key, payload, event_type, headers, coalesce(created_at, dead_at)
                 FROM dead_letters WHERE dl_id = ?1",
                [dl_id],
            )?;
        }
    }
    tx.execute("DELETE FROM dead_letters WHERE dl_id = ?1", [dl_id])?;
    tx.commit()?;
    Ok(())
}
