//! Probing: after a connection ended with a window of rows on the wire, which gives no evidence
//! against any one of them, the next connections publish one row at a time until each of those
//! rows was answered or has left the outbox, so that the row a broker closes the connection over
//! is alone on the wire when it does.
//!
//! What is probed is the cut's own rows, by lane, not a bound on row numbers: an alarm is newer
//! than the cut's rows of lane 0, and a gap notice's token is numbered above every row. A bound
//! made either end probing before the cut's rows went out (at the answer to an alarm served
//! first), or last until the whole backlog below it had gone one at a time. While probing, the
//! cut's rows and the higher lanes take turns (see `steer`).

use std::collections::HashSet;

use super::Core;
use crate::mqtt::tracker::Seq;
use crate::publish::gaps;
use crate::publish::lanes::LANES;

impl Core {
    /// Whether rows of an earlier cut are still being published one at a time.
    pub(super) fn probing(&self) -> bool {
        !self.probe.is_empty()
    }

    /// The connection ended with the publishes handed over and not acknowledged, and no telling
    /// which one the broker choked on: probe the rows of those that may have been written (a
    /// batch's, each), but not gap notices. Those still queued in rumqttc never reached it.
    pub(super) fn probe_in_flight(&mut self) {
        let publishes: Vec<Seq> = self.tracker.maybe_written().collect();
        for seq in publishes {
            self.probe_publish(seq);
        }
    }

    /// Probe the rows of the publish whose first row is `seq` (one row, or a batch).
    pub(super) fn probe_publish(&mut self, seq: Seq) {
        if gaps::is_notice(seq) {
            return;
        }
        let lane = self.upper_lanes.get(&seq).copied().unwrap_or(0);
        match self.batches.get(&seq) {
            Some(rows) => self.probe.extend(rows.iter().map(|&row| (row, lane))),
            None => {
                self.probe.insert(seq, lane);
            }
        }
        self.steer();
    }

    /// `rows`, a publish from `lane`, were answered. Probing ends once none of the cut's rows is
    /// left to publish, and the window opens again.
    pub(super) fn probed(&mut self, rows: &[Seq], lane: usize) {
        let Some(&cut_lane) = self.probe.values().next() else {
            return;
        };
        if crate::mutant::active("probe-ends-at-any-answer") {
            self.probe.clear();
        }
        for row in rows {
            self.probe.remove(row);
        }
        // Turns, by the lane the answered publish was served from: after the cut's lane (a row
        // of the cut, or a gap notice or row queued before it), the lanes' own order, so a
        // waiting alarm goes next; after a higher lane, the cut's lane.
        self.cut_turn = lane > cut_lane || crate::mutant::active("probe-without-turns");
        if self.probing() {
            self.end_probe_if_done();
        } else {
            self.open_window();
        }
    }

    /// Ends probing if every row of the cut has been answered or has left the outbox: none is in
    /// flight, waits in its lane, is held back by the pace, or lies beyond what its lane has read
    /// so far on this connection (a lane read to its end holds no more).
    pub(super) fn end_probe_if_done(&mut self) {
        if !self.probing() {
            return;
        }
        let (cursor, lane_end) = (&self.cursor, &self.lane_end);
        let mut waiting: HashSet<Seq> = self
            .tracker
            .unacknowledged()
            .flat_map(|seq| self.batches.get(&seq).cloned().unwrap_or_else(|| vec![seq]))
            .chain(self.held_back.as_ref().map(|p| p.row.seq))
            .collect();
        let mut lanes = [false; LANES];
        for &lane in self.probe.values() {
            lanes[lane] = true;
        }
        for lane in (0..LANES).filter(|&lane| lanes[lane]) {
            waiting.extend(self.ready.queue(lane).iter().map(|r| r.seq));
        }
        self.probe
            .retain(|&row, &mut lane| (!lane_end[lane] && cursor[lane] < row) || waiting.contains(&row));
        if self.probing() {
            self.steer();
        } else {
            self.open_window();
        }
    }

    /// The row the cut's drops were over is found (isolated): the rest of the cut need not go
    /// out one at a time. Another poison row among them would show as the next cut with a
    /// window on the wire. A row isolated that was not of the cut says nothing about it.
    pub(super) fn probe_explained(&mut self, isolated: Seq) {
        if self.probe.contains_key(&isolated) && !crate::mutant::active("probe-kept-after-isolation") {
            self.probe.clear();
            self.open_window();
        }
    }

    /// The cut's lane and the higher lanes take turns: at the cut's turn the lane of its oldest
    /// row is served first. Served by priority alone, alarms written steadily would keep the
    /// cut's rows, and the window of one, waiting for good; served first outright, a cut of many
    /// batched rows would keep an alarm waiting for minutes.
    fn steer(&mut self) {
        let lane = self.probe.values().next().copied().filter(|_| self.cut_turn);
        if !crate::mutant::active("probe-served-by-priority") {
            self.ready.serve_first(lane);
        }
    }

    fn open_window(&mut self) {
        self.ready.serve_first(None);
        if let Some(live) = &mut self.live {
            live.window = live.full_window;
        }
    }
}
