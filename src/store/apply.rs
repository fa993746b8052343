//! Applying a command, in three steps that never hold the write lock longer than database work:
//!
//! 1. **Claim**: a small committed transaction picks the oldest due command of a free key and
//!    records the attempt (number, start time, who runs it) *before* any handler code runs. A
//!    handler that takes the process down (abort, out of memory, a watchdog's SIGKILL) has its
//!    attempt counted all the same, so a poison command cannot crash-loop a device for ever.
//! 2. **Act** (two-phase handlers only): the slow outside work (hardware, network) runs with no
//!    transaction open. It may run again for the same command after a crash: at least once.
//! 3. **Record**: `BEGIN IMMEDIATE`, the handler's database work, and the applied mark (an update
//!    guarded by `applied_at IS NULL`), committed together: the effect commits exactly once.
//!
//! An attempt still marked as started when nobody is running it never returned. The relay's own
//! handler (one per file, by the relay lock) recovers its abandoned attempts when it starts; any
//! worker recovers attempts older than [`Options::attempt_timeout`]. Recovering counts a failure
//! ("handler did not return"), or dead-letters the command once its attempts are used up.
//!
//! An attempt whose handler returned but whose record (or failure) step could not write, the
//! database locked by another connection past the busy timeout, is not abandoned: its claim is
//! released at once, or by the worker's next claim step if the lock is still held, and the
//! attempt is taken back (not counted). The command is claimed again; a two-phase `act` runs
//! again, which its at-least-once contract allows.

use std::any::Any;
use std::fmt::Display;
use std::panic::{AssertUnwindSafe, catch_unwind};
use std::path::Path;
use std::sync::{Mutex, PoisonError};
use std::time::Duration;

use rusqlite::{Connection, OptionalExtension, Transaction, TransactionBehavior, params};

use super::gate;
use super::inbox::{ApplyOutcome, Command};
use super::options::Options;
use super::outbox::{self, Message, Tx};
use super::reentry;
use crate::cbor::Reader;
use crate::envelope::{MessageId, decode_headers};
use crate::error::{Error, Result};
use crate::time::{ms, now_ms};

/// The `claimed_by` of the relay's handler thread. The relay lock makes it the only one per file,
/// so when it starts, any attempt still claimed under this name was abandoned.
pub(crate) const RELAY_OWNER: &str = "relay";

/// Who applies, and on which file.
pub(crate) struct Applier<'a> {
    pub options: &'a Options,
    /// `claimed_by` for this worker's attempts.
    pub owner: &'a str,
    /// Claims this worker could not release when their attempt failed to finish (the release
    /// itself found the database locked): released by its next claim step.
    pub stranded: &'a Mutex<Vec<Held>>,
    /// The file's canonical path: while the record step holds its write lock, writes through any
    /// `Outbox` on the same file from this thread fail at once instead of waiting for themselves.
    pub path: &'a Path,
}

/// How a handler failed.
#[derive(Debug)]
pub(crate) enum Failure {
    /// Try again after a backoff (until the attempts are used up).
    Retry(String),
    /// Never again: mark it rejected now ([`Error::CommandRejected`]), publishing its reply.
    Reject {
        reason: String,
        reply: Option<Box<Message>>,
    },
}

impl Failure {
    /// Reads a handler's error: an [`Error::CommandRejected`], as is or boxed, is a rejection;
    /// anything else is worth another attempt.
    pub(crate) fn from_error<E: Display + 'static>(e: &E) -> Failure {
        let any: &dyn Any = e;
        let ours = any
            .downcast_ref::<Error>()
            .or_else(|| {
                any.downcast_ref::<Box<dyn std::error::Error + Send + Sync>>()
                    .and_then(|b| b.downcast_ref::<Error>())
            })
            .or_else(|| {
                any.downcast_ref::<Box<dyn std::error::Error>>()
                    .and_then(|b| b.downcast_ref::<Error>())
            });
        match ours {
            Some(Error::CommandRejected { reason, reply }) => Failure::Reject {
                reason: reason.clone(),
                reply: reply.clone(),
            },
            _ => Failure::Retry(e.to_string()),
        }
    }

    /// A panicking handler is a failing one: the worker stays alive and the command is retried,
    /// then dead-lettered, instead of killing the thread on every attempt.
    fn from_panic(panic: &(dyn Any + Send)) -> Failure {
        Failure::Retry(format!("handler panicked: {}", panic_message(panic)))
    }
}

/// An attempt this worker has claimed and not finished.
pub(crate) struct Claim {
    seq: i64,
    started_at: i64,
    pub command: Command,
}

/// What identifies a claim in the inbox: its row and the start time it was claimed with.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Held {
    seq: i64,
    started_at: i64,
}

impl Claim {
    fn held(&self) -> Held {
        Held {
            seq: self.seq,
            started_at: self.started_at,
        }
    }
}

/// The outcome of the claim step.
pub(crate) enum Claimed {
    Command(Claim),
    Idle { next_due: Option<Duration> },
}

/// What the claim step did: its outcome, and how many abandoned attempts it dead-lettered.
pub(crate) struct ClaimStep {
    pub claimed: Claimed,
    pub recovered_dead: u64,
}

/// The oldest due command whose key has no older unapplied command, and that nobody is running.
const NEXT_DUE: &str = "
    SELECT seq, id, topic, key, payload, event_type, headers, source, attempts FROM inbox AS i
    WHERE applied_at IS NULL AND dead_at IS NULL AND (next_attempt_at <= ?1 OR next_attempt_at > ?2)
      AND attempt_started_at IS NULL
      AND NOT EXISTS (SELECT 1 FROM inbox AS o
                      WHERE o.key = i.key AND o.seq < i.seq AND o.applied_at IS NULL AND o.dead_at IS NULL)
    ORDER BY seq LIMIT 1";

/// `NEXT_DUE` without its `applied_at IS NULL` guard: the `double-apply` mutant.
const NEXT_DUE_UNGUARDED: &str = "
    SELECT seq, id, topic, key, payload, event_type, headers, source, attempts FROM inbox AS i
    WHERE dead_at IS NULL AND (next_attempt_at <= ?1 OR next_attempt_at > ?2) AND attempt_started_at IS NULL
    ORDER BY seq LIMIT 1";

/// When the earliest command that is first in its key and not running becomes due.
const NEXT_DUE_AT: &str = "
    SELECT min(next_attempt_at) FROM inbox AS i
    WHERE applied_at IS NULL AND dead_at IS NULL AND attempt_started_at IS NULL
      AND NOT EXISTS (SELECT 1 FROM inbox AS o
                      WHERE o.key = i.key AND o.seq < i.seq AND o.applied_at IS NULL AND o.dead_at IS NULL)";

/// Step 1: recovers attempts abandoned longer than the attempt timeout, then claims the next due
/// command, in one committed transaction.
pub(crate) fn claim(conn: &mut Connection, a: &Applier<'_>) -> Result<ClaimStep> {
    let _turn = gate::enter(conn, a.options.busy_timeout)?;
    release_stranded(conn, a)?;
    let now = now_ms();
    let tx = conn.transaction_with_behavior(TransactionBehavior::Immediate)?;
    let abandoned_before = now.saturating_sub(ms(a.options.attempt_timeout));
    let recovered_dead = recover(&tx, a.options, "attempt_started_at < ?1", abandoned_before)?;
    let double_apply = crate::mutant::active("double-apply");
    let next = tx
        .prepare_cached(if double_apply {
            NEXT_DUE_UNGUARDED
        } else {
            NEXT_DUE
        })?
        // A due time further ahead than the longest backoff means the wall clock went back since
        // it was set: due now, rather than after the hours the clock jumped.
        .query_row([now, now.saturating_add(ms(a.options.backoff_max))], |r| {
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
        tx.commit()?;
        return Ok(ClaimStep {
            claimed: Claimed::Idle {
                next_due: next_due.map(|at| {
                    Duration::from_millis(u64::try_from(at - now).unwrap_or(0)).min(a.options.backoff_max)
                }),
            },
            recovered_dead,
        });
    };
    tx.prepare_cached(
        "UPDATE inbox SET attempts = attempts + 1, attempt_started_at = ?2, claimed_by = ?3 WHERE seq = ?1",
    )?
    .execute(params![seq, now, a.owner])?;
    tx.commit()?;
    crate::failpoint::hit("attempt-claimed");
    let headers = match headers {
        Some(h) => decode_headers(&mut Reader::new(&h))?
            .into_iter()
            .map(|(k, v)| (k.into_owned(), v.into_owned()))
            .collect(),
        None => Vec::new(),
    };
    Ok(ClaimStep {
        claimed: Claimed::Command(Claim {
            seq,
            started_at: now,
            command: Command {
                id: MessageId::from_slice(&id)?,
                topic,
                key,
                event_type,
                headers,
                source,
                payload: payload.unwrap_or_default(),
                attempts,
            },
        }),
        recovered_dead,
    })
}

/// Step 2, for two-phase handlers: runs `act` outside any transaction; an error or a panic is a
/// failure of the attempt.
pub(crate) fn act<P, E, F>(claim: &Claim, act: F) -> std::result::Result<P, Failure>
where
    F: FnOnce(&Command) -> std::result::Result<P, E>,
    E: Display + 'static,
{
    match catch_unwind(AssertUnwindSafe(|| act(&claim.command))) {
        Ok(Ok(p)) => Ok(p),
        Ok(Err(e)) => Err(Failure::from_error(&e)),
        Err(panic) => Err(Failure::from_panic(&*panic)),
    }
}

/// Step 3: runs `record` in one write transaction with the applied mark; on failure rolls its
/// effect back and records the failure.
pub(crate) fn record<E, F>(
    conn: &mut Connection,
    a: &Applier<'_>,
    claim: Claim,
    record: F,
) -> Result<ApplyOutcome>
where
    F: FnOnce(&mut Tx<'_>, &Command) -> std::result::Result<(), E>,
    E: Display + 'static,
{
    let turn = gate::enter(conn, a.options.busy_timeout)?;
    let tx = conn.transaction_with_behavior(TransactionBehavior::Immediate)?;
    let mut t = Tx::new(tx, &a.options.limits, None);
    let result = {
        let _held = reentry::hold_write_lock(a.path);
        catch_unwind(AssertUnwindSafe(|| record(&mut t, &claim.command)))
    };
    let failure = match result {
        Ok(Ok(())) => {
            let published = t.ids().len();
            // Guarded: a command another worker applied, or that was recovered and dead-lettered
            // while this attempt ran late, is never marked twice, and this effect rolls back.
            let marked = t
                .prepare_cached(
                    "UPDATE inbox SET applied_at = ?2, attempt_started_at = NULL, claimed_by = NULL,
                            done_uptime = (SELECT value FROM edge_outbox_meta WHERE name = 'uptime_ms'),
                            payload = CASE WHEN ?3 OR ?4 THEN payload END
                     WHERE seq = ?1 AND (applied_at IS NULL OR ?4) AND dead_at IS NULL",
                )?
                .execute(params![
                    claim.seq,
                    now_ms(),
                    a.options.keep_applied_payloads,
                    crate::mutant::active("double-apply")
                ])?;
            if marked != 1 {
                tracing::warn!(id = %claim.command.id, "command was applied or dead-lettered meanwhile; effect rolled back");
                return Ok(ApplyOutcome::Idle { next_due: None });
            }
            t.commit()?;
            crate::failpoint::hit("effect-committed");
            return Ok(ApplyOutcome::Applied {
                id: claim.command.id,
                published,
            });
        }
        Ok(Err(e)) => Failure::from_error(&e),
        Err(panic) => Failure::from_panic(&*panic),
    };
    drop(t); // rolls the handler's effect back
    drop(turn);
    fail(conn, a, claim, failure)
}

/// Records a failed attempt: a backoff, the dead letters after the last attempt, or a rejection
/// (with its reply).
pub(crate) fn fail(
    conn: &mut Connection,
    a: &Applier<'_>,
    claim: Claim,
    failure: Failure,
) -> Result<ApplyOutcome> {
    let id = claim.command.id;
    let attempts = claim.command.attempts + 1;
    let (mut error, rejected, reply) = match failure {
        Failure::Retry(e) => (e, false, None),
        Failure::Reject { reason, reply } => (format!("rejected by the handler: {reason}"), true, reply),
    };
    let dead = rejected || attempts >= a.options.max_attempts;
    let retry_in = a.options.backoff_after(attempts);
    let now = now_ms();
    let _turn = gate::enter(conn, a.options.busy_timeout)?;
    let mut tx = conn.transaction_with_behavior(TransactionBehavior::Immediate)?;
    let apart = crate::mutant::active("rejection-reply-apart");
    let mut replied = None;
    if apart && let Some(message) = &reply {
        // The mutant: the reply in a transaction of its own, ahead of the guarded mark.
        replied = publish_reply(&tx, a, message, &mut error)?;
        tx.commit()?;
        tx = conn.transaction_with_behavior(TransactionBehavior::Immediate)?;
    }
    // Guarded by the claim: if this attempt was recovered as abandoned meanwhile, that recovery
    // already counted it.
    let changed = tx.execute(
        "UPDATE inbox SET last_error = ?2, next_attempt_at = ?3, dead_at = CASE WHEN ?4 THEN ?5 END,
                done_uptime = CASE WHEN ?4 THEN (SELECT value FROM edge_outbox_meta WHERE name = 'uptime_ms') END,
                rejected = ?8, attempt_started_at = NULL, claimed_by = NULL
         WHERE seq = ?1 AND applied_at IS NULL AND dead_at IS NULL
           AND attempt_started_at = ?6 AND claimed_by = ?7",
        params![
            claim.seq,
            error,
            now + ms(retry_in),
            dead,
            now,
            claim.started_at,
            a.owner,
            rejected
        ],
    )?;
    if changed == 1 && (dead && !rejected || rejected && crate::mutant::active("rejection-dead-lettered")) {
        dead_letter(&tx, claim.seq)?;
    }
    if changed == 1
        && !apart
        && let Some(message) = &reply
    {
        replied = publish_reply(&tx, a, message, &mut error)?;
        if replied.is_none() {
            tx.execute(
                "UPDATE inbox SET last_error = ?2 WHERE seq = ?1",
                params![claim.seq, error],
            )?;
        }
    }
    tx.commit()?;
    if changed != 1 {
        tracing::warn!(%id, %error, "a late attempt failed after it was recovered as abandoned");
        return Ok(ApplyOutcome::Idle { next_due: None });
    }
    Ok(if rejected {
        tracing::warn!(%id, attempts, %error, reply = ?replied, "command rejected");
        ApplyOutcome::Rejected {
            id,
            attempts,
            error,
            reply: replied,
        }
    } else if dead {
        tracing::warn!(%id, attempts, %error, "command dead-lettered after its last attempt");
        ApplyOutcome::DeadLettered { id, attempts, error }
    } else {
        tracing::info!(%id, attempts, %error, ?retry_in, "command handler failed; will retry");
        ApplyOutcome::Failed {
            id,
            attempts,
            error,
            retry_in,
        }
    })
}

/// Recovers every attempt the relay's handler left running: called when it starts, holding the
/// relay lock, so none of them is running any more. Returns how many it dead-lettered.
pub(crate) fn recover_relay_attempts(conn: &mut Connection, options: &Options) -> Result<u64> {
    let _turn = gate::enter(conn, options.busy_timeout)?;
    let tx = conn.transaction_with_behavior(TransactionBehavior::Immediate)?;
    let dead = recover(&tx, options, "claimed_by = ?1", RELAY_OWNER)?;
    tx.commit()?;
    Ok(dead)
}

/// Counts each abandoned attempt matching `filter` as a failure ("handler did not return"), and
/// dead-letters the commands whose attempts are used up. Returns how many it dead-lettered.
fn recover(tx: &Transaction<'_>, options: &Options, filter: &str, arg: impl rusqlite::ToSql) -> Result<u64> {
    let sql = format!(
        "SELECT seq, id, attempts, attempt_started_at, claimed_by FROM inbox
         WHERE attempt_started_at IS NOT NULL AND applied_at IS NULL AND dead_at IS NULL AND {filter}"
    );
    let abandoned = tx
        .prepare_cached(&sql)?
        .query_map([arg], |r| {
            Ok((
                r.get::<_, i64>(0)?,
                r.get::<_, Vec<u8>>(1)?,
                r.get::<_, u32>(2)?,
                r.get::<_, i64>(3)?,
                r.get::<_, Option<String>>(4)?,
            ))
        })?
        .collect::<rusqlite::Result<Vec<_>>>()?;
    let now = now_ms();
    let mut dead_count = 0;
    for (seq, id, attempts, started_at, owner) in abandoned {
        let id = MessageId::from_slice(&id)?;
        let dead = attempts >= options.max_attempts;
        let error = format!(
            "handler did not return: attempt {attempts} of {} started {:.1?} ago by {} and never \
             finished (the process ended or the handler hung)",
            options.max_attempts,
            Duration::from_millis(u64::try_from(now - started_at).unwrap_or(0)),
            owner.as_deref().unwrap_or("an unknown worker"),
        );
        let retry_in = options.backoff_after(attempts);
        tx.execute(
            "UPDATE inbox SET last_error = ?2, next_attempt_at = ?3, dead_at = CASE WHEN ?4 THEN ?5 END,
                done_uptime = CASE WHEN ?4 THEN (SELECT value FROM edge_outbox_meta WHERE name = 'uptime_ms') END,
                    attempt_started_at = NULL, claimed_by = NULL
             WHERE seq = ?1",
            params![seq, error, now + ms(retry_in), dead, now],
        )?;
        if dead {
            dead_letter(tx, seq)?;
            dead_count += 1;
            tracing::error!(%id, attempts, %error, "command dead-lettered: its handler never returned");
        } else {
            tracing::warn!(%id, attempts, %error, ?retry_in, "an attempt never returned; will retry");
        }
    }
    Ok(dead_count)
}

/// Publishes a rejection's reply in `tx`, the transaction that records the rejection. A reply the
/// message itself makes unpublishable (a bad topic, too large, a bad priority) leaves nothing
/// behind and says why in `error`: the rejection stands, and trying again could not help. Any
/// other failure (the disk, the database, the outbox at its limit) fails the whole step, which
/// rolls back: the attempt is released and retried later, and the reply goes out then.
fn publish_reply(
    tx: &Transaction<'_>,
    a: &Applier<'_>,
    reply: &Message,
    error: &mut String,
) -> Result<Option<MessageId>> {
    // A savepoint: a reply refused after making room (evicting) takes its evictions back too.
    tx.execute_batch("SAVEPOINT reply")?;
    match outbox::enqueue(tx, &a.options.limits, reply) {
        Ok(id) => {
            tx.execute_batch("RELEASE reply")?;
            Ok(Some(id))
        }
        Err(e) => {
            tx.execute_batch("ROLLBACK TO reply; RELEASE reply")?;
            if !matches!(
                e,
                Error::InvalidTopic { .. }
                    | Error::PayloadTooLarge { .. }
                    | Error::InvalidConfig(_)
                    | Error::SchemaViolation(_)
            ) {
                return Err(e);
            }
            tracing::warn!(error = %e, "a rejection's reply can never be published; the rejection stands without it");
            error.push_str(&format!(" (its reply was not published: {e})"));
            Ok(None)
        }
    }
}

/// Copies a command that just died into the dead letters, with its last error as the reason.
fn dead_letter(tx: &Transaction<'_>, seq: i64) -> Result<()> {
    tx.execute(
        "INSERT INTO dead_letters (origin, message_id, topic, key, payload, event_type, headers,
                                   reason, attempts, created_at)
         SELECT 'inbox', id, topic, key, payload, event_type, headers, last_error, attempts, received_at
         FROM inbox WHERE seq = ?1",
        [seq],
    )?;
    Ok(())
}

/// Takes the payload itself (`&*boxed`): a `&Box<dyn Any>` would coerce to `&dyn Any` of the box
/// and never downcast to the message.
fn panic_message(panic: &(dyn Any + Send)) -> &str {
    panic
        .downcast_ref::<&str>()
        .copied()
        .or_else(|| panic.downcast_ref::<String>().map(String::as_str))
        .unwrap_or("non-text panic payload")
}

/// One whole cycle on `conn`: claim the next due command, tell `on_claim`, act, record.
/// Returns the outcome and how many abandoned attempts the claim step dead-lettered.
pub(crate) fn run_next<P, EA, ER, A, R>(
    conn: &mut Connection,
    a: &Applier<'_>,
    on_claim: impl FnOnce(&Command),
    act_step: A,
    record_step: R,
) -> Result<(ApplyOutcome, u64)>
where
    A: FnOnce(&Command) -> std::result::Result<P, EA>,
    EA: Display + 'static,
    R: FnOnce(&mut Tx<'_>, &Command, P) -> std::result::Result<(), ER>,
    ER: Display + 'static,
{
    let step = claim(conn, a)?;
    let claim = match step.claimed {
        Claimed::Idle { next_due } => return Ok((ApplyOutcome::Idle { next_due }, step.recovered_dead)),
        Claimed::Command(claim) => claim,
    };
    on_claim(&claim.command);
    let held = claim.held();
    let finished = match act(&claim, act_step) {
        Ok(prepared) => record(conn, a, claim, |tx, cmd| record_step(tx, cmd, prepared)),
        Err(failure) => fail(conn, a, claim, failure),
    };
    match finished {
        Ok(outcome) => Ok((outcome, step.recovered_dead)),
        Err(e) => {
            if !crate::mutant::active("strand-claim") {
                release_or_keep(conn, a, held);
            }
            Err(e)
        }
    }
}

/// The attempt `held` could not be finished (its record or failure found the database locked
/// past the busy timeout, or full): releases its claim now, so its key is not blocked until
/// the attempt timeout, or, if the database is still locked, at this worker's next claim step.
fn release_or_keep(conn: &mut Connection, a: &Applier<'_>, held: Held) {
    let released = (|| -> Result<()> {
        let _turn = gate::enter(conn, a.options.busy_timeout)?;
        let tx = conn.transaction_with_behavior(TransactionBehavior::Immediate)?;
        release(&tx, a, held)?;
        tx.commit()?;
        Ok(())
    })();
    if let Err(e) = released {
        tracing::warn!(error = %e, "could not release an unfinished attempt's claim yet; the next claim step will");
        a.stranded
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .push(held);
    }
}

/// Releases the claims [`release_or_keep`] could not, in their own transaction; they stay listed
/// until it commits, so a claim step that fails (the database still locked) loses none.
fn release_stranded(conn: &mut Connection, a: &Applier<'_>) -> Result<()> {
    let stranded: Vec<Held> = a.stranded.lock().unwrap_or_else(PoisonError::into_inner).clone();
    if stranded.is_empty() {
        return Ok(());
    }
    let tx = conn.transaction_with_behavior(TransactionBehavior::Immediate)?;
    for held in &stranded {
        release(&tx, a, *held)?;
    }
    tx.commit()?;
    a.stranded
        .lock()
        .unwrap_or_else(PoisonError::into_inner)
        .retain(|held| !stranded.contains(held));
    Ok(())
}

/// Clears the claim `held` (if it is still this worker's and the command is still waiting) and
/// takes its attempt back: the handler did not fail, the database was not available to record it.
fn release(tx: &Transaction<'_>, a: &Applier<'_>, held: Held) -> Result<()> {
    let released = tx.execute(
        "UPDATE inbox SET attempts = max(attempts - 1, 0), attempt_started_at = NULL, claimed_by = NULL
         WHERE seq = ?1 AND attempt_started_at = ?2 AND claimed_by = ?3 AND applied_at IS NULL AND dead_at IS NULL",
        params![held.seq, held.started_at, a.owner],
    )?;
    if released == 1 {
        tracing::info!(
            seq = held.seq,
            "released the claim of an attempt that could not be recorded; not counted"
        );
    }
    Ok(())
}
