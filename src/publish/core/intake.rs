//! Taking in what a read got: claims first, then the rows into their lanes, with the gap notices
//! placed among lane 0's rows in number order.

use std::collections::{BTreeMap, VecDeque};

use super::{Action, Awaiting, Core, LANES, ReadResult, Removal};
use crate::publish::gaps;
use crate::publish::rows::Ready;

impl Core {
    /// The answer to [`Action::Read`].
    pub(crate) fn on_read(&mut self, read: ReadResult) {
        if !matches!(self.awaiting, Some(Awaiting::Read)) {
            // Asked for on a connection that has ended since: read again on the next one.
            return;
        }
        self.awaiting = None;
        self.unclaimed.extend(read.claim.iter().copied());
        self.take_in(read);
        // A row of a cut that left the outbox while the relay was away shows here, as a lane
        // read past it.
        self.end_probe_if_done();
    }

    /// The answer to [`Action::Claim`] of `claimed`: the coalescing rows a newer value replaced
    /// since they were read are gone (their gap rows are recorded): publishing them would send a replaced
    /// value. The rest goes out; with rows gone, what is left is packed again.
    pub(crate) fn on_claimed(&mut self, claimed: &[i64], gone: &[i64]) {
        let Some(Awaiting::HandOver(publish, now_ms)) = self.awaiting.take() else {
            return;
        };
        for seq in claimed {
            self.unclaimed.remove(seq);
        }
        if gone.is_empty() {
            self.hand_over(*publish, now_ms);
            return;
        }
        // Rows claimed ahead that were replaced meanwhile are not published either.
        for lane in 0..LANES {
            self.ready.lane(lane).retain(|r| !gone.contains(&r.seq));
        }
        let lane = publish.lane;
        let queue = self.ready.lane(lane);
        for row in publish.into_rows().into_iter().rev() {
            if !gone.contains(&row.seq) {
                queue.push_front(row);
            }
        }
        // Their notices (coalesced) follow in number order.
        self.on_change();
    }

    /// A read or a claim failed (busy, I/O): nothing of a read is taken, the cursors stay, and
    /// the next read waits for the driver's next idle moment ([`Core::on_idle`]). A publish whose
    /// claim failed goes back to the head of its lane.
    pub(crate) fn on_read_failed(&mut self) {
        if let Some(Awaiting::HandOver(publish, _)) = self.awaiting.take() {
            let queue = self.ready.lane(publish.lane);
            for row in publish.into_rows().into_iter().rev() {
                queue.push_front(row);
            }
        }
        self.at_end = true;
        self.read_failed = true;
    }

    fn take_in(&mut self, read: ReadResult) {
        let ReadResult {
            notices,
            ranges,
            gap_rows,
            last_gap_id,
            gaps_set_aside,
            lanes,
            bad,
            mut expired,
            ..
        } = read;
        self.gap_cursor = last_gap_id.unwrap_or(self.gap_cursor);
        self.set_aside.extend(
            gaps_set_aside
                .into_iter()
                .map(|(id, first, last)| (id, (first, last))),
        );
        // Rows read ahead that a notice now says were removed (evicted, purged, expired) are
        // not published: the cloud is told they were removed.
        if !ranges.is_empty() {
            self.drop_removed(&ranges);
        }
        self.notices.extend(ranges);
        self.held.extend(notices.into_iter().map(|n| (n.seq, n)));
        let mut fresh: [VecDeque<Ready>; LANES] = Default::default();
        for (lane, got) in lanes.into_iter().enumerate() {
            match got {
                Some(got) => {
                    self.lane_end[lane] = got.visited < self.config.max_in_flight.max(super::READ_BATCH);
                    self.cursor[lane] = got.last_seq.unwrap_or(self.cursor[lane]);
                    fresh[lane] = got.ready;
                }
                // Rows are still queued in lane 0, so it is not at its end.
                None => self.lane_end[lane] = false,
            }
        }
        let [lane0_rows, higher @ ..] = &mut fresh;
        for (i, q) in higher.iter_mut().enumerate() {
            self.ready.lane(i + 1).append(q);
        }
        if crate::mutant::active("reorder") {
            lane0_rows.make_contiguous().reverse();
        }
        // Notices go out in number order among lane 0's rows, so the cloud sees one ordered
        // stream: before the first row above their range, and once the rows are read past them
        // (all of them at the end of the outbox). A removal behind the cursor goes out at once.
        for row in lane0_rows.drain(..) {
            release_notices(&mut self.held, self.ready.lane(0), row.seq);
            self.ready.lane(0).push_back(row);
        }
        let below = if self.lane_end[0] {
            i64::MAX
        } else {
            self.cursor[0].saturating_add(1)
        };
        release_notices(&mut self.held, self.ready.lane(0), below);
        self.at_end = self.lane_end.iter().all(|&end| end) && gap_rows < super::GAP_READ_BATCH;
        if !bad.is_empty() {
            self.out
                .push_back(Action::DeadLetter(bad, Removal::Unpublishable));
            // Their gap rows are new: read them.
            self.at_end = false;
        }
        expired.append(&mut self.expired);
        if !expired.is_empty() {
            self.out.push_back(Action::Expire(expired));
            self.at_end = false;
        }
    }
}

impl Core {
    /// Takes rows out of the read-ahead (and a publish held back by the pace) that `ranges`
    /// announce as removed.
    fn drop_removed(&mut self, ranges: &std::collections::HashMap<i64, (i64, i64)>) {
        if crate::mutant::active("publish-removed") {
            return;
        }
        let mut sorted: Vec<(i64, i64)> = ranges.values().copied().collect();
        sorted.sort_unstable();
        let removed = |seq: i64| super::ranges::overlaps(&sorted, seq, seq);
        if let Some(held) = self.held_back.take() {
            let lane = self.ready.lane(held.lane);
            for row in held.into_rows().into_iter().rev() {
                lane.push_front(row);
            }
        }
        for lane in 0..LANES {
            self.ready
                .lane(lane)
                .retain(|r| gaps::is_notice(r.seq) || !removed(r.seq));
        }
    }
}

/// Moves the held gap notices whose range starts below outbox row `below` to the end of `ready`.
fn release_notices(held: &mut BTreeMap<i64, Ready>, ready: &mut VecDeque<Ready>, below: i64) {
    let limit = gaps::TOKEN_BASE.saturating_add(below);
    while let Some(entry) = held.first_entry() {
        if *entry.key() >= limit {
            return;
        }
        ready.push_back(entry.remove());
    }
}
