//! Keeping the window full: the next publish, from the lane served next (the highest with rows
//! ready, or the cut's at its turn while probing), packed into a batch where a rule says so,
//! held back by the pace, never published once expired.

use std::time::Instant;

use super::{Action, Awaiting, Core, GAP_READ_BATCH, Outgoing, Publish, READ_BATCH, ReadRequest};
use crate::publish::batch::{self, Front, Step};
use crate::publish::gaps;

impl Core {
    /// Queues publishes until the window is full, the rows run out, or a read is needed (then it
    /// queues the read and waits for its answer).
    pub(super) fn fill_window(&mut self, now: Instant, now_ms: i64) {
        if let Some(until) = self.paced_until {
            if now < until {
                return;
            }
            self.paced_until = None;
        }
        loop {
            let Some(live) = &self.live else { return };
            if self.tracker.in_flight() >= live.hand_over_limit(self.probing()) {
                return;
            }
            if !self.at_end && (self.ready.is_empty() || std::mem::take(&mut self.check_lanes)) {
                self.read_more(now_ms, None);
                return;
            }
            // Rows that expired while they waited here (a pace, a full window) are never
            // published late: the next read removes them and records their gaps.
            // Only the head is checked for a row that goes alone: no scan per publish.
            let whole = !self.config.batching.is_empty();
            if self.ready.drop_expired(now_ms, whole, &mut self.expired) {
                self.at_end = false;
                self.check_lanes = true;
                continue;
            }
            let publish = match self.held_back.take() {
                // Packed before, held back by the pace, and a row of it expired while it waited:
                // its rows go back to the head of their lane, where the check above removes the
                // expired ones (and records their gaps) before the rest is taken again.
                Some(held) if held.has_expired(now_ms) && !crate::mutant::active("skip-expiry-held-back") => {
                    let lane = self.ready.lane(held.lane);
                    for row in held.into_rows().into_iter().rev() {
                        lane.push_front(row);
                    }
                    continue;
                }
                // Packed before, held back by the pace or for a slot on the wire.
                Some(held) => held,
                None => match self.take_next(now) {
                    Next::Publish(p) => p,
                    Next::Wait => return,
                    Next::Read(lane) => {
                        self.read_more(now_ms, Some(lane));
                        return;
                    }
                },
            };
            // Beyond the window it would wait in rumqttc's queue, unseen by the expiry checks:
            // it waits here instead, for a slot on the wire.
            if publish.has_lifetime()
                && self
                    .live
                    .as_ref()
                    .is_some_and(|l| self.tracker.in_flight() >= l.window)
                && !crate::mutant::active("queue-expiring")
            {
                self.held_back = Some(publish);
                return;
            }
            if let Err(until) = self
                .pacer
                .take(publish.row.topic.len() + publish.row.envelope.len(), now)
            {
                self.held_back = Some(publish);
                self.paced_until = Some(until);
                return;
            }
            // Claimed only now, as it goes: until here a newer value replaces a coalescing row
            // (its notice then takes it out of the read-ahead).
            let mut claim: Vec<i64> = publish.seqs().filter(|s| self.unclaimed.contains(s)).collect();
            if !claim.is_empty() && !crate::mutant::active("skip-claim") {
                if self.config.pace.is_off() && self.config.batching.is_empty() {
                    // Nothing holds rows back here: what follows in the lane goes out within a
                    // round trip, so it is claimed now too, in the same transaction (a claim
                    // per publish would cost a backlog of latest values a write each).
                    let lane = self.ready.lane(publish.lane);
                    let ahead: Vec<i64> = lane
                        .iter()
                        .map(|r| r.seq)
                        .filter(|s| self.unclaimed.contains(s))
                        .take(self.config.max_in_flight)
                        .collect();
                    claim.extend(ahead);
                }
                self.awaiting = Some(Awaiting::HandOver(Box::new(publish), now_ms));
                self.out.push_back(Action::Claim(claim));
                return;
            }
            self.hand_over(publish, now_ms);
        }
    }

    /// The next publish from the lane served next: one row, or a batch of them.
    fn take_next(&mut self, now: Instant) -> Next {
        let properties = self.properties() + self.batch_routing_bytes();
        let json = self.config.format().is_json();
        let probing = self.probing();
        let Some(live) = &self.live else {
            return Next::Wait;
        };
        let max_packet = live.max_packet;
        let Some((lane, queue)) = self.ready.front_lane() else {
            return Next::Wait;
        };
        let step = if self.config.batching.is_empty() {
            Step::Single
        } else {
            let front = Front {
                rules: &self.config.batching,
                max_packet,
                properties,
                at_end: self.lane_end[lane],
                probing,
                now,
                json,
            };
            batch::next(queue, &front, &mut self.linger)
        };
        let (row, members) = match step {
            Step::ReadMore if self.lane_end[lane] => return Next::Wait,
            Step::ReadMore => return Next::Read(lane),
            Step::Linger(_) => return Next::Wait,
            Step::Single => match queue.pop_front() {
                Some(row) => (row, None),
                None => return Next::Wait,
            },
            Step::Batch(n, rule) => {
                let (row, members) = batch::take(queue, n, &rule, json);
                (row, Some(members))
            }
        };
        self.linger = None;
        Next::Publish(Publish { row, members, lane })
    }

    /// Queues a publish for the driver and counts it in flight.
    pub(super) fn hand_over(&mut self, publish: Publish, now_ms: i64) {
        let Publish { row, members, lane } = publish;
        let Some(live) = &mut self.live else { return };
        let alias = live.aliases.for_topic(&row.topic);
        let expiry = row
            .expires_at
            .filter(|_| self.config.mqtt.sends_message_expiry())
            .map(|t| seconds_left(t, now_ms));
        self.tracker.submit(row.seq);
        let seq = row.seq;
        if lane > 0 {
            self.upper_lanes.insert(seq, lane);
        }
        let rows = match members {
            _ if gaps::is_notice(seq) => Vec::new(),
            Some(m) => m.iter().map(|r| r.seq).collect(),
            None => vec![seq],
        };
        let resent: Vec<i64> = rows
            .iter()
            .copied()
            .filter(|s| self.unacked_at_cut.remove(s))
            .collect();
        for &seq in &rows {
            self.highest_submitted = self.highest_submitted.max(seq);
            if crate::mutant::active("mark-before-puback") {
                self.acked.push(seq);
            }
        }
        let outgoing = Outgoing {
            seq,
            topic: row.topic,
            envelope: row.envelope,
            alias,
            expiry,
            routing: row.routing,
            rows: rows.len(),
            in_flight: self.tracker.in_flight(),
            resent,
        };
        if rows.len() > 1 {
            self.batches.insert(seq, rows);
        }
        self.out.push_back(Action::Publish(outgoing));
    }

    /// Asks to read ahead: the higher lanes, and lane 0 when its queue is used up or `extend`
    /// asks for it (a batch that runs to the end of what was read).
    fn read_more(&mut self, now_ms: i64, extend: Option<usize>) {
        let settling = self.settling();
        let gaps_again = self.gaps_again(&settling);
        let Some(live) = &self.live else { return };
        let mut lanes = [true; super::LANES];
        lanes[0] = self.ready.lane(0).is_empty() || extend == Some(0);
        // Each read is a transaction with its locks and a statement run: read a few windows'
        // worth at a time under load (an idle relay reads the one new row anyway).
        let request = ReadRequest {
            gap_cursor: self.gap_cursor,
            cursors: self.cursor,
            lanes,
            limit: self.config.max_in_flight.max(READ_BATCH),
            gap_limit: GAP_READ_BATCH,
            max_packet: live.max_packet,
            limit_owner: live.limit_owner,
            properties: self.properties(),
            now_ms,
            settling,
            gaps_again,
        };
        self.awaiting = Some(Awaiting::Read);
        self.out.push_back(Action::Read(request));
    }
}

/// What the lane served next offers.
enum Next {
    Publish(Publish),
    /// Nothing to publish now (a batch lingers, or the rows ran out).
    Wait,
    /// A batch runs to the end of what was read in this lane: read more of it.
    Read(usize),
}

/// What is left of a lifetime ending at `expires_at` (Unix ms) at `now_ms`, in whole seconds
/// rounded up, at least 1: MQTT 5's message expiry interval (0 would be sent as "no expiry" by
/// nobody, but expire at once on some brokers).
pub(super) fn seconds_left(expires_at: i64, now_ms: i64) -> u32 {
    let ms = expires_at.saturating_sub(now_ms).max(1);
    u32::try_from((ms + 999) / 1000).unwrap_or(u32::MAX)
}
