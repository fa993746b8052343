//! The publisher's batching decisions (see [`RelayConfig::batch`](crate::RelayConfig::batch)):
//! whether the rows at the front of the ready queue go out alone, as one batch, or wait.
//!
//! Order rule: a batch is a run of rows that are next to each other in the ready queue (sequence
//! order) and share one topic. Publishes therefore leave in sequence order exactly as without
//! batching, and per-key order holds whatever topics a key spans. A row of another topic, or a gap
//! notice, ends the run.

use std::collections::{HashMap, VecDeque};
use std::time::Instant;

use super::gaps;
use super::rows::Ready;
use crate::batch_wire::{self, BATCH_OVERHEAD};
use crate::batching::Batching;
use crate::mqtt::tracker::Seq;
use crate::routing_fields::Routing;

/// What to do with the front of the ready queue.
#[derive(Debug, PartialEq, Eq)]
pub(crate) enum Step {
    /// Publish the front row alone.
    Single,
    /// Publish this many rows from the front as one batch (at least two).
    Batch(usize, Batching),
    /// The run reaches the end of what was read: read more before deciding.
    ReadMore,
    /// A partial batch at the end of the outbox: wait for more rows until then.
    Linger(Instant),
}

/// Where the front stands.
pub(crate) struct Front<'a> {
    pub rules: &'a [(String, Batching)],
    /// Largest MQTT packet, and the bytes of a publish's properties.
    pub max_packet: usize,
    pub properties: usize,
    /// The last read found the end of the outbox.
    pub at_end: bool,
    /// Publishing one at a time to find a bad row (poison isolation): never batch then.
    pub probing: bool,
    pub now: Instant,
    /// JSON envelopes: a batch of them is JSON too (see [`take`]).
    pub json: bool,
}

/// Decides for the front of `ready`. `linger` remembers when the current front row's partial
/// batch stops waiting.
pub(crate) fn next(ready: &VecDeque<Ready>, f: &Front<'_>, linger: &mut Option<(Seq, Instant)>) -> Step {
    let Some(first) = ready.front() else {
        return Step::ReadMore;
    };
    if f.probing || gaps::is_notice(first.seq) {
        return Step::Single;
    }
    let Some(rule) = rule_for(f.rules, &first.topic) else {
        return Step::Single;
    };
    // Fixed header (1), remaining length (up to 4), topic length (2), topic, packet id (2).
    let overhead = if f.json {
        crate::envelope::json::BATCH_OVERHEAD
    } else {
        BATCH_OVERHEAD
    };
    let mqtt = 1 + 4 + 2 + first.topic.len() + 2 + f.properties + overhead;
    let budget = rule.max_bytes.min(f.max_packet.saturating_sub(mqtt));
    // A JSON batch puts a comma before each member but the first.
    let separator = usize::from(f.json);
    // A batch's routing fields name one epoch: a run ends where the epoch changes (after a
    // restore), as a gap notice's does.
    let first_epoch = epoch_of(first);
    let (mut n, mut bytes, mut closed) = (0, 0, false);
    for row in ready {
        let size = row.envelope.len() + separator;
        if gaps::is_notice(row.seq)
            || row.topic != first.topic
            || bytes + size > budget
            || epoch_of(row) != first_epoch
        {
            closed = true;
            break;
        }
        bytes += size;
        n += 1;
    }
    let send = |n: usize| {
        if n < 2 {
            Step::Single
        } else {
            Step::Batch(n, *rule)
        }
    };
    if closed {
        return send(n);
    }
    if !f.at_end {
        return Step::ReadMore;
    }
    let deadline = match *linger {
        Some((seq, until)) if seq == first.seq => until,
        _ => {
            let until = f.now + rule.linger;
            *linger = Some((first.seq, until));
            until
        }
    };
    if f.now >= deadline {
        send(n)
    } else {
        Step::Linger(deadline)
    }
}

/// Takes the first `n` rows of `ready` and packs them: the batch's publish, as a `Ready` whose
/// `seq` is its first row's, and the rows themselves, in order (kept until it is handed over: a
/// publish held back by the pace is unpacked again if one of them expires meanwhile).
/// The epoch a row's routing fields name (none without them).
fn epoch_of(r: &Ready) -> Option<&str> {
    r.routing.as_deref().and_then(|x| x.value("ep"))
}

pub(crate) fn take(
    ready: &mut VecDeque<Ready>,
    n: usize,
    rule: &Batching,
    json: bool,
) -> (Ready, Vec<Ready>) {
    let rows: Vec<Ready> = ready.drain(..n.min(ready.len())).collect();
    let bytes = rows.iter().map(|r| r.envelope.len()).sum();
    let members = rows.iter().map(|r| r.envelope.as_slice());
    let envelope = if json {
        crate::envelope::json::write_batch(members, bytes)
    } else {
        batch_wire::write_batch(members, bytes, rule.compression)
    };
    // The broker may drop the batch once its expiry passes: the latest of its rows', so that no
    // row goes before its own time (none if any row has no lifetime).
    let expires_at = rows
        .iter()
        .map(|r| r.expires_at)
        .try_fold(i64::MIN, |latest, e| e.map(|e| latest.max(e)));
    let (seq, topic) = rows.first().map(|r| (r.seq, r.topic.clone())).unwrap_or_default();
    let routing = Routing::batch(rows.iter().filter_map(|r| r.routing.as_deref())).map(Box::new);
    (
        Ready {
            seq,
            topic,
            envelope,
            expires_at,
            routing,
        },
        rows,
    )
}

/// The rows a publish stands for: a batch's (by its first row's number), else the one row.
pub(crate) fn members(batches: &mut HashMap<Seq, Vec<Seq>>, seq: Seq) -> Vec<Seq> {
    batches.remove(&seq).unwrap_or_else(|| vec![seq])
}

fn rule_for<'a>(rules: &'a [(String, Batching)], topic: &str) -> Option<&'a Batching> {
    rules
        .iter()
        .find(|(filter, _)| crate::topic::filter_matches(filter, topic))
        .map(|(_, b)| b)
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;

    fn row(seq: Seq, topic: &str) -> Ready {
        Ready {
            seq,
            topic: topic.into(),
            // A 100-byte CBOR byte string, standing in for an envelope.
            envelope: [0x58, 98].into_iter().chain([0; 98]).collect(),
            expires_at: None,
            routing: None,
        }
    }

    fn front(rules: &[(String, Batching)], at_end: bool, probing: bool, now: Instant) -> Front<'_> {
        Front {
            rules,
            max_packet: 1 << 20,
            properties: 0,
            at_end,
            probing,
            now,
            json: false,
        }
    }

    #[test]
    fn a_run_of_one_topic_is_one_batch_and_another_topic_ends_it() {
        let rules = vec![("t/#".to_owned(), Batching::new().max_bytes(350))];
        let now = Instant::now();
        let mut linger = None;
        let q: VecDeque<Ready> = [row(1, "t/a"), row(2, "t/a"), row(3, "u"), row(4, "t/a")].into();
        assert!(matches!(
            next(&q, &front(&rules, false, false, now), &mut linger),
            Step::Batch(2, _)
        ));
        // Bounded by bytes: three of 100 fit in 350, not four.
        let q: VecDeque<Ready> = (1..=5).map(|s| row(s, "t/a")).collect();
        assert!(matches!(
            next(&q, &front(&rules, false, false, now), &mut linger),
            Step::Batch(3, _)
        ));
        // Probing, or a topic without a rule: alone.
        assert_eq!(
            next(&q, &front(&rules, false, true, now), &mut linger),
            Step::Single
        );
        let q: VecDeque<Ready> = [row(1, "u"), row(2, "u")].into();
        assert_eq!(
            next(&q, &front(&rules, false, false, now), &mut linger),
            Step::Single
        );
    }

    #[test]
    fn a_partial_batch_reads_more_then_lingers_then_goes() {
        let rules = vec![("t".to_owned(), Batching::new().linger(Duration::from_millis(50)))];
        let now = Instant::now();
        let mut linger = None;
        let q: VecDeque<Ready> = [row(1, "t"), row(2, "t")].into();
        assert_eq!(
            next(&q, &front(&rules, false, false, now), &mut linger),
            Step::ReadMore
        );
        let until = now + Duration::from_millis(50);
        assert_eq!(
            next(&q, &front(&rules, true, false, now), &mut linger),
            Step::Linger(until)
        );
        // The deadline stays the one set when this front row was first seen.
        let later = now + Duration::from_millis(20);
        assert_eq!(
            next(&q, &front(&rules, true, false, later), &mut linger),
            Step::Linger(until)
        );
        assert!(matches!(
            next(&q, &front(&rules, true, false, until), &mut linger),
            Step::Batch(2, _)
        ));
    }

    #[test]
    fn take_packs_rows_in_order() {
        let mut q: VecDeque<Ready> = [row(4, "t"), row(7, "t"), row(9, "u")].into();
        let (publish, rows) = take(&mut q, 2, &Batching::new(), false);
        let seqs: Vec<Seq> = rows.iter().map(|r| r.seq).collect();
        assert_eq!((publish.seq, publish.topic.as_str(), seqs), (4, "t", vec![4, 7]));
        assert_eq!(q.len(), 1);
        let unpacked = batch_wire::unpack(&publish.envelope).expect("unpacks");
        assert_eq!(unpacked.map(|v| v.len()), Some(2));
    }
}
