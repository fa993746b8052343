//! The inbox: receive a command (store it, deduplicated by id), then apply it exactly once.

use std::borrow::Cow;
use std::time::Duration;

use rusqlite::{Connection, params};
use serde::de::DeserializeOwned;

use super::dead_letters::{self, NewDeadLetter, Origin};
use super::options::Options;
use super::trust;
use crate::envelope::{Envelope, MessageId, encode_headers_into, from_cbor};
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
    /// Attempts made before this one (failed, or started and never finished).
    pub attempts: u32,
}

impl Command {
    /// Decodes the payload into any `Deserialize` type.
    ///
    /// A payload that does not match `T` fails with [`Error::CommandRejected`]: the same bytes
    /// can never decode differently, so a handler that returns this error with `?` has the command
    /// rejected at once instead of retried, and the commands behind it run.
    ///
    /// ```
    /// # let dir = tempfile::tempdir().expect("temp dir");
    /// # let outbox = edge_outbox::Outbox::open(dir.path().join("device.db"))?;
    /// # let id = edge_outbox::MessageId::new_v7();
    /// # outbox.receive("cmd", &edge_outbox::Envelope::command(id, "pump-1", &("fast",))?.encode())?;
    /// #[derive(serde::Deserialize)]
    /// struct SetRate { litres_per_min: f64 }
    ///
    /// let outcome = outbox.apply_next(|_tx, cmd| {
    ///     let rate: SetRate = cmd.payload_as()?; // a ("fast",) payload: rejected for good
    ///     let _ = rate.litres_per_min;
    ///     Ok::<_, edge_outbox::Error>(())
    /// })?;
    /// assert!(matches!(outcome, edge_outbox::ApplyOutcome::Rejected { .. }));
    /// # Ok::<(), edge_outbox::Error>(())
    /// ```
    pub fn payload_as<T: DeserializeOwned>(&self) -> Result<T> {
        from_cbor(&self.payload).map_err(|e| {
            Error::reject(match e {
                Error::Decode(why) => why,
                other => other.to_string(),
            })
        })
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
    /// The handler rejected the command for good ([`Error::CommandRejected`]): it is marked
    /// rejected at once (counted in [`Stats::inbox_rejected`](crate::Stats::inbox_rejected), not
    /// a dead letter), and no longer blocks the commands behind it.
    Rejected {
        /// The command.
        id: MessageId,
        /// Attempts made, this one included.
        attempts: u32,
        /// The handler's reason (and, if its reply could not be published, why).
        error: String,
        /// The reply published with the rejection ([`Error::with_reply`]), if any.
        reply: Option<MessageId>,
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
            || matches!(self, ApplyOutcome::Rejected { reply: Some(_), .. })
    }
}

/// A command delivery as the command session hands it over.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Delivery<'a> {
    pub topic: &'a str,
    pub bytes: &'a [u8],
    /// Delivered with the MQTT retain flag: the broker sends it again at every subscription.
    pub retained: bool,
}

pub(crate) fn receive(conn: &Connection, options: &Options, topic: &str, bytes: &[u8]) -> Result<Received> {
    receive_delivery(
        conn,
        options,
        Delivery {
            topic,
            bytes,
            retained: false,
        },
    )
}

pub(crate) fn receive_delivery(conn: &Connection, options: &Options, d: Delivery<'_>) -> Result<Received> {
    // The file's policy, not this handle's options: a handle opened without keys (the CLI, a
    // second open) is held to what the device requires.
    let policy = if crate::mutant::active("handle-keys-only") {
        handle_policy(options)
    } else {
        trust::load(conn)?
    };
    let (opened, signed_by) = match policy {
        None => (Cow::Borrowed(d.bytes), None),
        // Verified before anything is stored as applicable; refused with the raw bytes kept.
        Some(policy) => match verify(&policy, d.topic, d.bytes)? {
            Ok((envelope, key_id)) => (envelope, Some(key_id)),
            Err(reason) => return refuse(conn, options, d.topic, Some(d.bytes), &reason),
        },
    };
    let env = match Envelope::decode(&opened) {
        Ok(env) => env,
        Err(e) => return refuse(conn, options, d.topic, Some(d.bytes), &e.to_string()),
    };
    let max = options.limits.payload_limit();
    if env.payload.len() > max {
        // Its id is readable: kept with the dead letter, so that a resend applied meanwhile is
        // recognised when the dead letter is retried, and its id kept while the dead letter is.
        return refuse_with_id(
            conn,
            options,
            d.topic,
            Some(d.bytes),
            &Error::PayloadTooLarge {
                size: env.payload.len(),
                max,
            }
            .to_string(),
            Some(env.id),
        );
    }
    let headers = (!env.headers.is_empty()).then(|| {
        let mut out = Vec::new();
        encode_headers_into(&mut out, &env.headers);
        out
    });
    let inserted = conn
        .prepare_cached(
            "INSERT INTO inbox (id, topic, key, payload, event_type, headers, source, received_at, retained, signed_by)
             VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8, ?9, ?10) ON CONFLICT (id) DO NOTHING",
        )?
        .execute(params![
            env.id.as_bytes(),
            d.topic,
            env.key,
            env.payload,
            env.event_type,
            headers,
            env.source,
            now_ms(),
            d.retained,
            signed_by
        ])?;
    Ok(if inserted == 1 {
        Received::Stored(env.id)
    } else {
        Received::Duplicate(env.id)
    })
}

/// A delivery checked against the file's signature policy: the envelope inside and the key that
/// signed it, or why it is refused.
type Verified<'a> = std::result::Result<(Cow<'a, [u8]>, String), String>;

#[cfg(feature = "signed-commands")]
fn verify<'a>(policy: &trust::Policy, topic: &str, bytes: &'a [u8]) -> Result<Verified<'a>> {
    Ok(trust::keys_of(policy).open(topic, bytes))
}

/// The `handle-keys-only` mutant: the handle's own keys, as before the policy was in the file.
#[cfg(feature = "signed-commands")]
fn handle_policy(options: &Options) -> Option<trust::Policy> {
    options.trusted_keys.as_ref().map(trust::policy_of)
}

#[cfg(not(feature = "signed-commands"))]
fn handle_policy(_options: &Options) -> Option<trust::Policy> {
    None
}

/// Without the feature nothing can be verified: the inbox is not touched at all.
#[cfg(not(feature = "signed-commands"))]
fn verify<'a>(policy: &trust::Policy, _topic: &str, _bytes: &'a [u8]) -> Result<Verified<'a>> {
    Err(Error::InvalidConfig(format!(
        "this device requires commands signed by one of the keys [{}], and this build of \
         edge-outbox has no feature signed-commands to verify them: nothing was stored; use a \
         build with the feature",
        policy.key_ids()
    )))
}

/// Sets a delivery aside in the dead letters with `reason`: its raw bytes, or none when they are
/// not worth the disk (an oversized delivery, or one above the refusals' whole byte budget).
///
/// Refused dead letters are bounded ([`Options::max_refusals`], [`Options::max_refusal_bytes`]):
/// anyone who can publish on the command topic can make them, so the oldest are evicted (and
/// counted) rather than let a flood take the application's storage. Logged at a bounded rate.
pub(crate) fn refuse(
    conn: &Connection,
    options: &Options,
    topic: &str,
    bytes: Option<&[u8]>,
    reason: &str,
) -> Result<Received> {
    refuse_with_id(conn, options, topic, bytes, reason, None)
}

/// [`refuse`], for a delivery whose envelope could be read: its id is kept with the dead letter.
fn refuse_with_id(
    conn: &Connection,
    options: &Options,
    topic: &str,
    bytes: Option<&[u8]>,
    reason: &str,
    id: Option<MessageId>,
) -> Result<Received> {
    let budget = options.max_refusal_bytes;
    let kept = bytes.filter(|b| u64::try_from(b.len()).unwrap_or(u64::MAX) <= budget);
    let reason = match (bytes, kept) {
        (Some(b), None) => format!(
            "{reason} (its {} bytes were not kept: above Options::max_refusal_bytes, {budget})",
            b.len()
        ),
        _ => reason.to_owned(),
    };
    // One commit for the dead letter and the evictions it causes, in or out of a transaction.
    conn.execute_batch("SAVEPOINT edge_outbox_refuse")?;
    let stored = (|| -> Result<(i64, u64)> {
        let dead_letter_id = dead_letters::insert(
            conn,
            &NewDeadLetter {
                origin: Origin::Inbox,
                message_id: id.as_ref().map(|id| id.as_bytes().as_slice()),
                topic,
                key: "",
                payload: kept,
                event_type: None,
                headers: None,
                reason: &reason,
                attempts: 0,
                created_at: Some(now_ms()),
                refused: true,
            },
        )?;
        let evicted = if crate::mutant::active("unbounded-refusals") {
            0
        } else {
            dead_letters::evict_refusals(conn, options.max_refusals, budget)?
        };
        Ok((dead_letter_id, evicted))
    })();
    let (dead_letter_id, evicted) = match stored {
        Ok(done) => {
            conn.execute_batch("RELEASE edge_outbox_refuse")?;
            done
        }
        Err(e) => {
            let _ = conn.execute_batch("ROLLBACK TO edge_outbox_refuse; RELEASE edge_outbox_refuse");
            return Err(e);
        }
    };
    if let Some(unlogged) = super::refusal_log::admit() {
        tracing::warn!(topic, dead_letter_id, %reason, evicted, unlogged, "command refused and dead-lettered");
    }
    Ok(Received::DeadLettered {
        dead_letter_id,
        reason,
    })
}

/// Deletes the ids of commands applied, or dead and no longer in the dead letters, longer ago than
/// the retention. A command whose id a dead letter names keeps its row: retrying the dead letter
/// puts a dead row back in line, and recognises an applied one.
///
/// A command stored as retained (with retained commands kept, every one the relay's session
/// stores) keeps its id past the retention while it is the newest retained command on its topic:
/// the broker holds one retained message per topic and sends it again at every subscription, so
/// only a newer one can replace it there.
pub(crate) fn prune(conn: &Connection, options: &Options, batch: usize) -> Result<u64> {
    // Never shorter than the file's replay window, whatever this handle's retention: a replay of
    // a signed command must find its id, or be too old to verify.
    let retention = match trust::load(conn)? {
        Some(policy) if !crate::mutant::active("own-retention") => {
            options.inbox_retention.max(policy.replay_window())
        }
        _ => options.inbox_retention,
    };
    let cutoff = now_ms().saturating_sub(ms(retention));
    // Old on the uptime clock too (see super::uptime): a wall clock that jumps ahead must not
    // forget an applied id a broker may still redeliver.
    let uptime_cutoff = super::uptime::cutoff(conn, options, retention)?;
    let batch = i64::try_from(batch).unwrap_or(i64::MAX);
    // A command id a dead letter still names is kept: retrying the dead letter must recognise
    // the command, applied or not, instead of storing it anew.
    const NAMED: &str =
        "EXISTS (SELECT 1 FROM dead_letters d WHERE d.origin = 'inbox' AND d.message_id = inbox.id)";
    // A retained command's id is kept while it is the newest retained one on its topic: the
    // broker sends it again at every subscription, and it must be recognised, never applied twice.
    const REPLACED: &str = "(retained = 0 OR EXISTS (SELECT 1 FROM inbox AS n
                                WHERE n.retained = 1 AND n.topic = inbox.topic AND n.seq > inbox.seq))";
    let applied = conn.execute(
        &format!(
            "DELETE FROM inbox WHERE seq IN (SELECT seq FROM inbox WHERE applied_at < ?1 AND {REPLACED}
             AND (done_uptime IS NULL OR done_uptime <= ?3) AND NOT {NAMED} LIMIT ?2)"
        ),
        params![cutoff, batch, uptime_cutoff],
    )?;
    let dropped = conn.execute(
        &format!(
            "DELETE FROM inbox WHERE seq IN (SELECT seq FROM inbox WHERE dead_at < ?1 AND {REPLACED}
             AND (done_uptime IS NULL OR done_uptime <= ?3) AND NOT {NAMED} LIMIT ?2)"
        ),
        params![cutoff, batch, uptime_cutoff],
    )?;
    Ok((applied + dropped) as u64)
}
