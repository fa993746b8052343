//! Monitoring counters.

use std::time::Duration;

use rusqlite::{Connection, OptionalExtension};

use crate::error::Result;
use crate::time::age;

/// A snapshot of the store, for dashboards and alerts.
///
/// [`oldest_pending_age`](Stats::oldest_pending_age) grows when the relay has stopped or something
/// blocks the queue; for an outage, alert on the relay's
/// [`Status::disconnected_since`](crate::Status::disconnected_since) and
/// [`Status::last_ack_at`](crate::Status::last_ack_at) too: a coalescing stream keeps the oldest
/// pending message young however long the broker is away.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
#[non_exhaustive]
pub struct Stats {
    /// Messages committed and not yet acknowledged by the broker.
    pub pending_messages: u64,
    /// Their payload bytes.
    pub pending_bytes: u64,
    /// Age of the oldest pending message, by its commit time.
    pub oldest_pending_age: Option<Duration>,
    /// Messages evicted unsent to make room, since the file was created.
    pub evicted: u64,
    /// Their payload bytes.
    pub evicted_bytes: u64,
    /// Messages replaced unsent by a newer coalescing message of their topic and key
    /// ([`Message::coalescing`](crate::Message::coalescing)), since the file was created.
    pub coalesced: u64,
    /// Dead letters waiting for an operator.
    pub dead_letters: u64,
    /// Of those, deliveries refused before they were stored (malformed, not signed, too large):
    /// bounded by [`Options::max_refusals`](crate::Options::max_refusals) and
    /// [`Options::max_refusal_bytes`](crate::Options::max_refusal_bytes).
    pub refusals_kept: u64,
    /// Their raw bytes.
    pub refusals_kept_bytes: u64,
    /// Refused deliveries evicted from the dead letters to stay within those bounds, since the
    /// file was created (schema version 7): a steady rise means someone floods the command topic.
    pub refusals_evicted: u64,
    /// Commands received and not yet applied (nor dead-lettered).
    pub inbox_unapplied: u64,
    /// Applied command ids retained to recognise redeliveries.
    pub inbox_applied: u64,
    /// Commands their handler rejected ([`Error::reject`](crate::Error::reject)), kept for the
    /// retention like applied ones (schema version 8). Not dead letters: the sender is answered
    /// by the handler's reply, and an operator has nothing to do. A steady rise means the cloud
    /// sends commands this device's handler refuses.
    pub inbox_rejected: u64,
    /// The epoch new messages are numbered in (the envelope's `ep`; see [`Outbox::epoch`](crate::Outbox::epoch)).
    pub epoch: u64,
    /// Messages removed unpublished (evicted, expired, dead-lettered, purged) whose gap notice the
    /// relay has not yet had acknowledged.
    pub gaps_unannounced: u64,
    /// How many times this device's store was found damaged and salvaged into a fresh file
    /// (see [`Options::salvage_on_corruption`](crate::Options::salvage_on_corruption)).
    pub salvaged: u64,
}

impl Stats {
    /// Reads the stats over any connection to a store, a read-only one included, as one
    /// snapshot (a read transaction when none is open). [`Outbox::stats`](crate::Outbox::stats)
    /// is this on the handle's connection; the CLI uses it on a read-only one.
    pub fn read(conn: &Connection) -> Result<Stats> {
        let snapshot = conn
            .is_autocommit()
            .then(|| conn.unchecked_transaction())
            .transpose()?;
        let stats = read_now(conn)?;
        if let Some(tx) = snapshot {
            tx.finish()?;
        }
        Ok(stats)
    }
}

fn read_now(conn: &Connection) -> Result<Stats> {
    let c = super::counters::read(conn)?;
    let (pending_messages, pending_bytes, evicted, evicted_bytes) =
        (c.pending, c.pending_bytes, c.evicted, c.evicted_bytes);
    let oldest: Option<i64> = conn
        .prepare_cached("SELECT created_at FROM outbox ORDER BY seq LIMIT 1")?
        .query_row([], |r| r.get(0))
        .optional()?;
    let count = |sql: &str| -> Result<u64> { Ok(conn.prepare_cached(sql)?.query_row([], |r| r.get(0))?) };
    let version = super::schema_version(conn)?;
    let v5 = version >= 5;
    let refusals = if version >= 7 {
        super::dead_letters::refusals(conn)?
    } else {
        super::dead_letters::Refusals::default()
    };
    Ok(Stats {
        pending_messages,
        pending_bytes,
        oldest_pending_age: oldest.map(age),
        evicted,
        evicted_bytes,
        coalesced: if version >= 6 {
            count("SELECT coalesced FROM outbox_counters")?
        } else {
            0
        },
        dead_letters: count("SELECT count(*) FROM dead_letters")?,
        refusals_kept: refusals.kept,
        refusals_kept_bytes: refusals.kept_bytes,
        refusals_evicted: refusals.evicted,
        inbox_unapplied: count("SELECT count(*) FROM inbox WHERE applied_at IS NULL AND dead_at IS NULL")?,
        inbox_applied: count("SELECT count(*) FROM inbox WHERE applied_at IS NOT NULL")?,
        inbox_rejected: if version >= 8 {
            count("SELECT count(*) FROM inbox WHERE rejected = 1")?
        } else {
            0
        },
        // A file not yet migrated (read by the CLI, read-only) has neither.
        epoch: if v5 { super::epoch::current(conn)? } else { 0 },
        gaps_unannounced: if v5 {
            count("SELECT count(*) FROM outbox_gaps")?
        } else {
            0
        },
        salvaged: count(
            "SELECT coalesce((SELECT value FROM edge_outbox_meta WHERE name = 'corruptions_salvaged'), 0)",
        )?,
    })
}

/// One line for a log or a terminal:
/// `12 pending (3456 B, oldest 5.2s), 0 evicted, 0 dead letters, inbox 0 unapplied / 1 applied`,
/// then ` / 2 rejected` (commands), `, 7 coalesced`, `, 40 refusals evicted`, `, 2 gaps to announce` and `, salvaged 1 times`
/// when there are any.
///
/// ```
/// let mut stats = edge_outbox::Stats::default();
/// assert_eq!(
///     stats.to_string(),
///     "0 pending (0 B), 0 evicted, 0 dead letters, inbox 0 unapplied / 0 applied"
/// );
/// stats.gaps_unannounced = 2;
/// assert!(stats.to_string().ends_with("0 applied, 2 gaps to announce"));
/// ```
impl std::fmt::Display for Stats {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{} pending ({} B", self.pending_messages, self.pending_bytes)?;
        if let Some(age) = self.oldest_pending_age {
            write!(f, ", oldest {:.1}s", age.as_secs_f64())?;
        }
        write!(
            f,
            "), {} evicted, {} dead letters, inbox {} unapplied / {} applied",
            self.evicted, self.dead_letters, self.inbox_unapplied, self.inbox_applied
        )?;
        if self.inbox_rejected > 0 {
            write!(f, " / {} rejected", self.inbox_rejected)?;
        }
        // What the cloud has not been told yet, and a past salvage: only when there is any.
        if self.coalesced > 0 {
            write!(f, ", {} coalesced", self.coalesced)?;
        }
        if self.refusals_evicted > 0 {
            write!(f, ", {} refusals evicted", self.refusals_evicted)?;
        }
        if self.gaps_unannounced > 0 {
            write!(f, ", {} gaps to announce", self.gaps_unannounced)?;
        }
        if self.salvaged > 0 {
            write!(f, ", salvaged {} times", self.salvaged)?;
        }
        Ok(())
    }
}
