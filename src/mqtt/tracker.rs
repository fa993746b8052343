//! Matches rumqttc's packet ids back to outbox rows.
//!
//! rumqttc 0.25 returns no packet id from `publish`. The relay is the only publisher on its client,
//! so the n-th `Outgoing::Publish(pkid)` event belongs to the n-th row submitted, with two
//! exceptions this type absorbs: a packet-id collision first reports `Outgoing::AwaitAck(pkid)` and
//! sends the row later, after the PUBACK that frees the id, with an `Outgoing::Publish(pkid)`; and
//! a replayed publish reports an id that is already mapped (not expected with a fresh client per
//! connection, but harmless). QoS 0 publishes (the status message) report id 0 and are not rows.
//!
//! It also knows when each row went on the wire, for the ack timeout, in what order the rows went
//! (whether a PUBACK answered a row written after another, exact where two writes read the same
//! clock), and which is the oldest unacknowledged one, the suspect when a connection dies (poison
//! isolation).

use std::collections::{BTreeMap, HashMap, VecDeque};
use std::time::Instant;

/// A row handed to rumqttc, by its outbox sequence number.
pub(crate) type Seq = i64;

/// When a publish went on the wire (a row, or a batch of rows), and how many publishes had gone
/// before it since the tracker was made.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Wrote {
    pub(crate) at: Instant,
    pub(crate) nth: u64,
}

#[derive(Debug, Default)]
pub(crate) struct Tracker {
    /// Submitted, not yet reported by rumqttc, in submission order.
    submitted: VecDeque<Seq>,
    /// On the wire, waiting for their PUBACK.
    by_pkid: HashMap<u16, Seq>,
    /// Waiting for their packet id to be freed (collision).
    parked: HashMap<u16, Seq>,
    /// On the wire, by sequence number, with when they were written.
    on_wire: BTreeMap<Seq, Wrote>,
    /// Publishes written so far: the next one's `Wrote::nth`.
    writes: u64,
}

impl Tracker {
    pub(crate) fn submit(&mut self, seq: Seq) {
        self.submitted.push_back(seq);
    }

    /// Takes back `seq`, handed over last and not queued after all (the connection is ending).
    pub(crate) fn withdraw(&mut self, seq: Seq) {
        if let Some(at) = self.submitted.iter().rposition(|&s| s == seq) {
            self.submitted.remove(at);
        }
    }

    /// rumqttc wrote packet `pkid` at `now`.
    pub(crate) fn on_publish(&mut self, pkid: u16, now: Instant) {
        if pkid == 0 {
            return;
        }
        let seq = if let Some(seq) = self.parked.remove(&pkid) {
            seq
        } else if self.by_pkid.contains_key(&pkid) {
            tracing::debug!(pkid, "publish event for a mapped packet id (replay): ignored");
            return;
        } else if let Some(seq) = self.submitted.pop_front() {
            seq
        } else {
            tracing::warn!(pkid, "publish event with no submitted row: ignored");
            return;
        };
        self.by_pkid.insert(pkid, seq);
        self.on_wire.insert(
            seq,
            Wrote {
                at: now,
                nth: self.writes,
            },
        );
        self.writes += 1;
    }

    pub(crate) fn on_await_ack(&mut self, pkid: u16) {
        match self.submitted.pop_front() {
            Some(seq) => {
                self.parked.insert(pkid, seq);
            }
            None => tracing::warn!(pkid, "collision event with no submitted row: ignored"),
        }
    }

    /// The row a PUBACK acknowledges, if it is one of ours.
    #[cfg(test)]
    pub(crate) fn on_puback(&mut self, pkid: u16) -> Option<Seq> {
        self.on_puback_at(pkid).map(|(seq, _)| seq)
    }

    /// The row a PUBACK acknowledges, if it is one of ours, and when and in what order it went
    /// on the wire.
    pub(crate) fn on_puback_at(&mut self, pkid: u16) -> Option<(Seq, Option<Wrote>)> {
        match self.by_pkid.remove(&pkid) {
            Some(seq) => Some((seq, self.on_wire.remove(&seq))),
            None => {
                tracing::debug!(pkid, "PUBACK for an unknown packet id: ignored");
                None
            }
        }
    }

    /// Whether a row waits for `pkid` to be freed (a collision).
    pub(crate) fn is_awaited(&self, pkid: u16) -> bool {
        self.parked.contains_key(&pkid)
    }

    /// How many rows are on the wire and not yet acknowledged.
    pub(crate) fn on_wire(&self) -> usize {
        self.on_wire.len()
    }

    /// The oldest row on the wire and not yet acknowledged, with when and in what order it was
    /// written.
    pub(crate) fn oldest_on_wire(&self) -> Option<(Seq, Wrote)> {
        self.on_wire.first_key_value().map(|(&seq, &at)| (seq, at))
    }

    /// The `Wrote::nth` the next publish written will get: above every one so far.
    pub(crate) fn next_write(&self) -> u64 {
        self.writes
    }

    /// Rows handed to rumqttc and not yet acknowledged.
    pub(crate) fn in_flight(&self) -> usize {
        self.submitted.len() + self.by_pkid.len() + self.parked.len()
    }

    /// Every row handed to rumqttc and not yet acknowledged, in no particular order.
    pub(crate) fn unacknowledged(&self) -> impl Iterator<Item = Seq> + '_ {
        self.submitted
            .iter()
            .chain(self.by_pkid.values())
            .chain(self.parked.values())
            .copied()
    }

    /// Every row handed to rumqttc and not yet acknowledged that may have reached the broker: on
    /// the wire, parked on a collision, and, as a margin, the next one rumqttc takes from its
    /// queue. The driver delivers a failed connection's last reports before its end, so a row
    /// written is reported; but a report missed would let a poison row past probing, where the
    /// margin costs one row probed needlessly. The rest of the queue was never written.
    pub(crate) fn maybe_written(&self) -> impl Iterator<Item = Seq> + '_ {
        self.by_pkid
            .values()
            .chain(self.parked.values())
            .chain(self.submitted.front())
            .copied()
    }

    /// Forgets everything: after a disconnect nothing in flight will be acknowledged.
    pub(crate) fn reset(&mut self) {
        self.submitted.clear();
        self.by_pkid.clear();
        self.parked.clear();
        self.on_wire.clear();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn in_order_acks_map_rows() {
        let mut t = Tracker::default();
        for seq in 10..13 {
            t.submit(seq);
        }
        for pkid in 1..=3 {
            t.on_publish(pkid, Instant::now());
        }
        assert_eq!(t.in_flight(), 3);
        assert_eq!(t.on_puback(2), Some(11));
        assert_eq!(t.on_puback(1), Some(10));
        assert_eq!(t.on_puback(3), Some(12));
        assert_eq!(t.in_flight(), 0);
    }

    #[test]
    fn collision_parks_the_row_until_its_id_is_free() {
        let mut t = Tracker::default();
        t.submit(1);
        t.submit(2);
        t.on_publish(1, Instant::now());
        t.on_await_ack(1); // row 2 wants id 1, still held by row 1
        assert_eq!(t.in_flight(), 2);
        assert_eq!(t.on_puback(1), Some(1)); // frees id 1 ...
        t.on_publish(1, Instant::now()); // ... and rumqttc sends row 2 with it
        assert_eq!(t.on_puback(1), Some(2));
        assert_eq!(t.in_flight(), 0);
    }

    #[test]
    fn replays_status_publishes_and_strangers_do_not_shift_the_fifo() {
        let mut t = Tracker::default();
        t.submit(7);
        t.submit(8);
        t.on_publish(0, Instant::now()); // QoS 0 status message
        t.on_publish(4, Instant::now());
        t.on_publish(4, Instant::now()); // replay of id 4
        t.on_publish(5, Instant::now());
        assert_eq!(t.on_puback(9), None);
        assert_eq!(t.on_puback(4), Some(7));
        assert_eq!(t.on_puback(5), Some(8));
        assert_eq!(t.on_puback(4), None, "each PUBACK acknowledges once");
    }

    #[test]
    fn rows_still_queued_behind_the_next_one_were_never_written() {
        let mut t = Tracker::default();
        for seq in 1..=5 {
            t.submit(seq);
        }
        t.on_publish(1, Instant::now());
        t.on_publish(2, Instant::now());
        t.on_await_ack(1); // row 3 waits for id 1
        let mut maybe: Vec<Seq> = t.maybe_written().collect();
        maybe.sort_unstable();
        // On the wire (1, 2), parked (3), the next rumqttc takes (4); row 5 never left the queue.
        assert_eq!(maybe, vec![1, 2, 3, 4]);
        assert_eq!(t.unacknowledged().count(), 5);
    }

    #[test]
    fn writes_are_numbered_in_the_order_they_reach_the_wire_a_parked_row_when_it_goes() {
        let mut t = Tracker::default();
        for seq in [1, 2, 3] {
            t.submit(seq);
        }
        let now = Instant::now();
        t.on_publish(1, now);
        t.on_await_ack(1); // row 2 waits for id 1
        let nth = |w: Option<(Seq, Option<Wrote>)>| w.and_then(|(_, w)| w).map(|w| w.nth);
        assert_eq!(nth(t.on_puback_at(1)), Some(0), "row 1, the first write");
        t.on_publish(1, now); // row 2 goes with the freed id, at the same instant ...
        t.on_publish(2, now); // ... and row 3 after it
        assert_eq!(t.next_write(), 3);
        assert_eq!(t.on_puback_at(2), Some((3, Some(Wrote { at: now, nth: 2 }))));
        assert_eq!(t.oldest_on_wire(), Some((2, Wrote { at: now, nth: 1 })));
    }

    #[test]
    fn the_oldest_row_on_the_wire_is_known() {
        let mut t = Tracker::default();
        assert_eq!(t.oldest_on_wire(), None);
        for seq in [3, 4, 5] {
            t.submit(seq);
        }
        t.on_publish(1, Instant::now());
        t.on_await_ack(1); // row 4 waits: not on the wire
        assert!(t.is_awaited(1));
        assert_eq!(t.oldest_on_wire().map(|(s, _)| s), Some(3));
        assert_eq!(t.on_puback(1), Some(3));
        assert_eq!(
            t.oldest_on_wire(),
            None,
            "row 4 is parked, row 5 not yet reported"
        );
        t.on_publish(1, Instant::now());
        assert_eq!(t.oldest_on_wire().map(|(s, _)| s), Some(4));
    }

    #[test]
    fn reset_forgets_everything() {
        let mut t = Tracker::default();
        t.submit(1);
        t.on_publish(1, Instant::now());
        t.submit(2);
        t.reset();
        assert_eq!(t.in_flight(), 0);
        assert_eq!(t.on_puback(1), None);
    }
}
