//! Gap notices: the relay's announcement, in the message stream, of every sequence number the
//! device removed before publishing it (see `store::gaps` for how removals are recorded).
//!
//! Gap rows are read from a cursor on `gap_id` (recording order), so a removal recorded behind
//! the outbox cursor (a row evicted while in flight) is still announced on this connection.
//! Consecutive removals of one read with the same topic, cause, reason and epoch become one
//! notice; coalesced ones whatever their topics, since a device whose sensors all coalesce
//! replaces runs of readings of many topics at once, and one notice per topic change would cost
//! the link nearly what the readings did. A notice's id is derived from its range and cause, so a notice published again after
//! a reconnect is the same message to a deduplicating consumer.
//!
//! In the in-flight tracker a notice stands under a token above every outbox sequence number
//! ([`TOKEN_BASE`] plus its first row's `seq`): rows sort before notices, so a row stays the
//! suspect when a connection dies with both on the wire.

use std::collections::{HashMap, VecDeque};

use rusqlite::{Connection, TransactionBehavior};

use super::rows::{Encoding, Ready};
use crate::envelope::{GapCause, GapFields, GapNotice, write_gap_notice};
use crate::error::Result;
use crate::routing_fields::Routing;
use crate::store::Options;

/// Tokens of gap notices start here: far above any outbox `seq` (SQLite counts to 2^63 - 1, a
/// device writing a million messages a second would need 146,000 years to reach 2^62).
pub(crate) const TOKEN_BASE: i64 = 1 << 62;

/// A notice's reason text is cut to this many bytes: it names a dead letter's cause, and must
/// not make the notice too large to publish.
const WHY_MAX: usize = 256;

/// The cause the `outbox_coalesce` trigger records.
const COALESCED: &str = "coalesced";

/// Whether a tracker entry is a gap notice rather than an outbox row.
pub(crate) fn is_notice(seq: i64) -> bool {
    seq >= TOKEN_BASE
}

/// How much one read of gap rows got.
pub(crate) struct GapRead {
    pub rows: usize,
    pub last_gap_id: Option<i64>,
    /// Gap rows not announced because they name a settling number: (gap id, first, last).
    pub set_aside: Vec<(i64, i64, i64)>,
}

/// Which gap rows to read: those recorded after `cursor` (at most `limit`), and the ones named in
/// `again` (set aside by an earlier read).
pub(crate) struct GapQuery<'a> {
    pub cursor: i64,
    pub limit: usize,
    pub again: &'a [i64],
    /// Whether a range names a number that may be delivered and is not settled yet.
    pub settling: &'a dyn Fn(i64, i64) -> bool,
}

struct GapRow {
    seq: i64,
    last: i64,
    topic: String,
    cause: String,
    why: Option<String>,
    removed_at: i64,
}

/// Reads the gap rows `q` names, and queues their notices on `ready` (before any row read after
/// them); `ranges` gets each notice's token and outbox `seq` range.
///
/// A gap row that names a number that may be delivered and is not settled (on the wire, or
/// acknowledged and not yet marked: a row removed while it was being published) is set aside, not
/// announced: announcing it would tell the cloud that a message it may hold was removed. Once the
/// number is acknowledged its gap row is deleted with the mark; if it is not, the row is read
/// again by its id.
pub(crate) fn read_after(
    conn: &Connection,
    cfg: &Encoding<'_>,
    q: &GapQuery<'_>,
    ready: &mut VecDeque<Ready>,
    ranges: &mut HashMap<i64, (i64, i64)>,
) -> Result<GapRead> {
    const COLUMNS: &str = "gap_id, seq, coalesce(last_seq, seq), topic, cause, why, removed_at";
    let mut read = GapRead {
        rows: 0,
        last_gap_id: None,
        set_aside: Vec::new(),
    };
    let mut found = Vec::new();
    let mut take = |row: &rusqlite::Row<'_>, read: &mut GapRead, counted: bool| -> Result<()> {
        let gap_id: i64 = row.get(0)?;
        let seq: i64 = row.get(1)?;
        let last = row.get::<_, i64>(2)?.max(seq);
        if counted {
            read.rows += 1;
            read.last_gap_id = Some(gap_id);
        }
        if (q.settling)(seq, last) && !crate::mutant::active("announce-unsettled") {
            read.set_aside.push((gap_id, seq, last));
            return Ok(());
        }
        found.push(GapRow {
            seq,
            last,
            topic: row.get(3)?,
            cause: row.get(4)?,
            why: row.get(5)?,
            removed_at: row.get(6)?,
        });
        Ok(())
    };
    if !q.again.is_empty() {
        let mut stmt =
            conn.prepare_cached(&format!("SELECT {COLUMNS} FROM outbox_gaps WHERE gap_id = ?1"))?;
        for &id in q.again {
            let mut rows = stmt.query([id])?;
            if let Some(row) = rows.next()? {
                take(row, &mut read, false)?;
            }
        }
    }
    // The limit is written in, not bound: a bound LIMIT makes SQLite prepare the statement anew
    // at every step (see `super::rows::lane_query`).
    let mut stmt = conn.prepare_cached(&format!(
        "SELECT {COLUMNS} FROM outbox_gaps WHERE gap_id > ?1 ORDER BY gap_id LIMIT {}",
        q.limit
    ))?;
    let mut rows = stmt.query([q.cursor])?;
    while let Some(row) = rows.next()? {
        take(row, &mut read, true)?;
    }
    found.sort_by_key(|g| g.seq);
    let mut i = 0;
    while let Some(first) = found.get(i) {
        let epoch = cfg.epochs.locate(first.seq).0;
        let mut last = i;
        while let Some(next) = found.get(last + 1) {
            let prev = &found[last];
            if next.seq != prev.last + 1
                || (next.topic != first.topic && first.cause != COALESCED)
                || next.cause != first.cause
                || next.why != first.why
                || cfg.epochs.locate(next.last).0 != epoch
            {
                break;
            }
            last += 1;
        }
        let (first_seq, last_seq) = (first.seq, found[last].last);
        let token = TOKEN_BASE.saturating_add(first_seq);
        ready.push_back(encode(cfg, first, last_seq, token));
        ranges.insert(token, (first_seq, last_seq));
        i = last + 1;
    }
    Ok(read)
}

fn encode(cfg: &Encoding<'_>, first: &GapRow, last_seq: i64, token: i64) -> Ready {
    let (epoch, wire_first) = cfg.epochs.locate(first.seq);
    let (_, wire_last) = cfg.epochs.locate(last_seq);
    let cause = GapCause::parse(&first.cause);
    let id = GapNotice::id_for(epoch, wire_first, wire_last, &cause);
    let why = first.why.as_deref().map(|w| cut(w, WHY_MAX));
    let mut envelope = Vec::with_capacity(96);
    let fields = GapFields {
        id: &id,
        source: cfg.source,
        epoch,
        first: wire_first,
        last: wire_last,
        cause: cause.as_str(),
        why,
        created_ms: u64::try_from(first.removed_at).unwrap_or(0),
    };
    match cfg.format {
        crate::envelope::EnvelopeFormat::Json => {
            crate::envelope::json::write_gap_notice(&mut envelope, &fields)
        }
        _ => write_gap_notice(&mut envelope, &fields),
    }
    let cloud_ok = cfg.cloud.is_none_or(|rules| rules.check(&first.topic).is_ok());
    let topic = match crate::topic::check(&first.topic, cfg.allow_dollar) {
        Ok(()) if cloud_ok => first.topic.clone(),
        // A topic the cloud takes: its events topic (Azure IoT Hub), else the usual one.
        _ => cfg
            .cloud
            .and_then(|rules| rules.fallback_topic())
            .unwrap_or(crate::store::gaps::FALLBACK_TOPIC)
            .to_owned(),
    };
    // A notice's fields are short; a topic too long for them gets the notice without them.
    let (topic, routing) = super::rows::place(cfg.routing, topic.clone(), || {
        Routing::notice(&fields, cfg.format)
    })
    .unwrap_or((topic, None));
    Ready {
        expires_at: None,
        seq: token,
        topic,
        envelope,
        routing,
    }
}

/// `text` cut to at most `max` bytes, at a character boundary.
fn cut(text: &str, max: usize) -> &str {
    let mut end = text.len().min(max);
    while !text.is_char_boundary(end) {
        end -= 1;
    }
    &text[..end]
}

/// Deletes the gap rows whose notices the broker acknowledged (or refused for good), in one
/// transaction.
pub(crate) fn mark_announced(conn: &mut Connection, options: &Options, ranges: &[(i64, i64)]) -> Result<()> {
    let _turn = crate::store::gate::enter(conn, options.busy_timeout)?;
    let tx = conn.transaction_with_behavior(TransactionBehavior::Immediate)?;
    {
        let mut delete = tx.prepare_cached("DELETE FROM outbox_gaps WHERE seq BETWEEN ?1 AND ?2")?;
        for &(first, last) in ranges {
            delete.execute([first, last])?;
        }
    }
    tx.commit()?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::cut;

    #[test]
    fn reasons_are_cut_at_a_character_boundary() {
        assert_eq!(cut("abc", 10), "abc");
        assert_eq!(cut("aé", 2), "a");
        assert_eq!(cut("aé", 3), "aé");
    }
}
