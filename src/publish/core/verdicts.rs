//! What the broker's answers mean for the rows: a PUBACK's reason code, and a connection that
//! ends with rows on the wire (a strike against the oldest, poison isolation, a narrowed window).

use std::time::{Duration, Instant};

use super::{Action, Core, Removal, Report, Suspect};
use crate::mqtt::event::{Cause, CauseKind, PubAck, Verdict};
use crate::mqtt::tracker::{Seq, Wrote};
use crate::publish::batch;
use crate::publish::gaps;
use crate::publish::rows::Unpublishable;

/// A connection that ends this soon after the only message on the wire was written counts against
/// that message (a broker rejecting a packet closes at once; a flaky link drops at any time).
pub(super) const CHOKE_WINDOW: Duration = Duration::from_secs(2);
/// Connections in a row ended during their quiet start that clear a suspect: one could be the
/// next broker of a failover list, while the first still closes over the message.
const QUIET_DROPS_CLEAR: u32 = 2;

impl Core {
    /// A PUBACK, at `now`.
    pub(crate) fn on_puback(&mut self, ack: PubAck, now: Instant) {
        // rumqttc skips its collision check on a refusal, so a row parked on this packet id
        // would wait until the collision times out: renew the connection instead.
        let awaited = self.tracker.is_awaited(ack.pkid);
        let Some((seq, wrote)) = self.tracker.on_puback_at(ack.pkid) else {
            return;
        };
        let written = wrote.map(|w| w.at);
        if let Some(live) = &mut self.live {
            live.newest_answered = if crate::mutant::active("answered-at-any-ack") {
                // Any PUBACK read after a row was written counts as answering something later.
                Some(Wrote {
                    at: now,
                    nth: self.tracker.next_write(),
                })
            } else {
                [live.newest_answered, wrote]
                    .into_iter()
                    .flatten()
                    .max_by_key(|w| w.nth)
            };
        }
        // A batch is answered as a whole: every row in it shares the verdict.
        let members = batch::members(&mut self.batches, seq);
        if self.suspect.as_ref().is_some_and(|x| x.seq == seq) {
            self.suspect = None;
        }
        let lane = if self.upper_lanes.is_empty() {
            0
        } else {
            self.upper_lanes.remove(&seq).unwrap_or(0)
        };
        self.probed(&members, lane);
        self.settled();
        let in_flight = self.tracker.in_flight();
        let held_id = || Cause::new(CauseKind::Retry, "a refused message held a packet id");
        match ack.verdict {
            Verdict::Accepted if gaps::is_notice(seq) => {
                self.report(Report::Answered { in_flight });
                self.quota_cleared(written);
                self.announced(seq, None);
            }
            Verdict::Accepted => {
                let latency = written.map(|t| now.saturating_duration_since(t));
                let marked = if crate::mutant::active("batch-first-only") {
                    &members[..1]
                } else {
                    &members[..]
                };
                for &row in marked {
                    self.acked.push(row);
                    self.report(Report::Acked { in_flight, latency });
                }
                self.quota_cleared(written);
            }
            Verdict::Refused(reason) if gaps::is_notice(seq) => {
                self.report(Report::Answered { in_flight });
                self.announced(
                    seq,
                    Some(format!("the broker refused it: PUBACK reason {reason}")),
                );
                if awaited {
                    self.renew(held_id());
                }
            }
            Verdict::Refused(reason) => {
                tracing::warn!(seq, rows = members.len(), %reason, "the broker refused a message: moving it to the dead letters");
                let refused = members
                    .iter()
                    .map(|&seq| Unpublishable {
                        seq,
                        reason: format!("the broker refused it: PUBACK reason {reason}"),
                    })
                    .collect();
                self.out.push_back(Action::DeadLetter(refused, Removal::Refused));
                self.report(Report::Answered { in_flight });
                if awaited {
                    self.renew(held_id());
                }
            }
            Verdict::Later(reason) => {
                self.report(Report::Answered { in_flight });
                let wait = self.quota_backoff.next_delay();
                tracing::warn!(seq, %reason, ?wait, "the broker cannot take more now: publishing again after a wait");
                let why = format!("the broker refused a message for now: PUBACK reason {reason}");
                self.report(Report::Quota(why.clone()));
                self.quota_refused_at = Some(now);
                self.paused_until = Some((now + wait, why));
                if awaited {
                    self.renew(held_id());
                }
            }
        }
    }

    /// A message the broker accepted, written at `written`: if that was after the last quota
    /// refusal, the quota is over. The PUBACKs of messages that were on the wire before it keep
    /// coming during the pause, and would otherwise keep the pause's backoff at its shortest.
    fn quota_cleared(&mut self, written: Option<Instant>) {
        let after = match self.quota_refused_at {
            None => true,
            Some(at) => written.is_some_and(|w| w > at) || crate::mutant::active("quota-cleared-by-earlier"),
        };
        if !after {
            return;
        }
        self.quota_backoff.reset();
        if self.quota_refused_at.take().is_some() {
            self.report(Report::QuotaCleared);
        }
    }

    /// The connection ended, at `now`, for `cause`.
    pub(crate) fn on_disconnected(&mut self, cause: &Cause, now: Instant) {
        if cause.text.contains("0x94") || cause.text.contains("0x82") {
            if !self.aliases_off {
                tracing::warn!(%cause, "not using topic aliases with this broker any more");
            }
            self.aliases_off = true;
        }
        let quiet = self.quiet_until.take().is_some();
        // No strike can fall on a suspect out of flight: whether it was is all that is needed
        // (one still in rumqttc's queue never reached the broker).
        let out_of_flight = self
            .suspect
            .as_ref()
            .map(|x| x.seq)
            .filter(|&seq| !self.tracker.maybe_written().any(|s| s == seq));
        self.strike(cause, now);
        self.judge_suspect(quiet, out_of_flight, cause);
        self.live = None;
        self.awaiting = None;
        self.forget_in_flight();
        self.clear_ready();
        // Retried on the next connection, whatever the wait was for.
        self.paused_until = None;
        self.mark_all();
        self.settled();
    }

    /// After a connection ended (`quiet`: during its quiet start), what it says of the suspect
    /// (`out_of_flight`: its row, if it was not in flight when the connection ended).
    /// Ended twice in a row by the broker before anything was published: the broker is
    /// unsteady, and the strikes are as likely its doing. Held quiet, then ended without the row
    /// in flight: not in a row (and its row may have left the outbox). An end with the row in
    /// flight and no strike (a whole window on the wire, a late drop) keeps the strikes.
    fn judge_suspect(&mut self, quiet: bool, out_of_flight: Option<Seq>, cause: &Cause) {
        let Some(suspect) = &mut self.suspect else {
            return;
        };
        let clear = if quiet && matches!(cause.kind, CauseKind::Lost | CauseKind::Broker) {
            suspect.quiet_drops += 1;
            (suspect.quiet_drops >= QUIET_DROPS_CLEAR)
                .then_some("the broker ended connections before anything was published on them")
        } else if suspect.held && out_of_flight == Some(suspect.seq) {
            Some("a connection held, then ended without it in flight")
        } else {
            None
        };
        if let Some(why) = clear {
            tracing::info!(seq = suspect.seq, strikes = suspect.strikes, %cause, "{why}: the suspected message is cleared");
            self.suspect = None;
        }
    }

    /// A gap notice is done with: acknowledged, or (with `failed`) given up on, which loses the
    /// announcement (the cloud then sees those numbers as an unexplained gap) and is logged.
    fn announced(&mut self, token: i64, failed: Option<String>) {
        let Some(range) = self.notices.remove(&token) else {
            return;
        };
        match failed {
            None => self.report(Report::GapAnnounced(range.1 - range.0 + 1)),
            Some(why) => {
                tracing::error!(first = range.0, last = range.1, %why, "a gap notice could not be published: the cloud will see these messages as an unexplained gap");
                self.report(Report::NoticeLost(why));
            }
        }
        self.out.push_back(Action::Announced(vec![range]));
    }

    /// Counts the connection's end against its oldest unacknowledged row on the wire when that
    /// row is to blame, narrows the window for the next connection, and sets a row aside once it
    /// has had enough.
    fn strike(&mut self, cause: &Cause, now: Instant) {
        let threshold = self.config.poison_disconnects;
        let Some((seq, wrote)) = self.tracker.oldest_on_wire() else {
            return;
        };
        let written = wrote.at;
        if matches!(
            cause.kind,
            CauseKind::Connect | CauseKind::Broker | CauseKind::Retry | CauseKind::Renew
        ) {
            // Not the messages' doing: no strike, and no need to narrow the window.
            return;
        }
        if threshold == 0 {
            return;
        }
        // Only a later message answered is evidence against this one: a PUBACK for an older
        // one, read after this was written, is the window draining as usual. Later by the order
        // of writes, not their times: rows written in one burst can read the same clock.
        let acked_since = self
            .live
            .as_ref()
            .and_then(|l| l.newest_answered)
            .is_some_and(|answered| {
                if crate::mutant::active("answered-by-write-time") {
                    answered.at > wrote.at
                } else {
                    answered.nth > wrote.nth
                }
            });
        let strikes = match cause.kind {
            CauseKind::NamesPacket => threshold,
            // The broker acknowledged later messages and not this one: this one's doing. Once
            // that is established, later timeouts count too, even with nothing left to compare
            // with (the rest has drained).
            CauseKind::Requested if acked_since || self.suspect.as_ref().is_some_and(|x| x.seq == seq) => 1,
            // No PUBACK at all since it was written, and no earlier evidence: a broker (or link)
            // that acknowledges nothing says nothing about this message. Renewing is all.
            CauseKind::Requested => {
                tracing::debug!(seq, %cause, "no acknowledgement at all since it was written: no strike");
                return;
            }
            // The connection ended with only this message on the wire, and soon after it was
            // written, as a broker that rejects a packet by closing does. A link that drops at
            // some other moment is no evidence against it.
            CauseKind::Lost
                if self.tracker.on_wire() == 1 && now.saturating_duration_since(written) < CHOKE_WINDOW =>
            {
                1
            }
            CauseKind::Lost if self.tracker.on_wire() == 1 => return,
            // A whole window was on the wire: no telling which one. The next connection
            // publishes one at a time, which will.
            _ => {
                self.probe_in_flight();
                tracing::debug!(on_wire = self.tracker.on_wire(), %cause, "connection lost with a window in flight: narrowing it");
                return;
            }
        };
        if self.batches.contains_key(&seq) {
            // Evidence against a batch is none against any one row in it: publish its rows one
            // at a time on the next connection, where a bad one is found alone.
            self.probe_publish(seq);
            tracing::debug!(%cause, strikes, "the connection ended over a batch: publishing its rows one at a time");
            return;
        }
        let suspect = match &mut self.suspect {
            Some(x) if x.seq == seq => {
                x.strikes += strikes;
                x
            }
            other => other.insert(Suspect {
                seq,
                strikes,
                held: false,
                quiet_drops: 0,
            }),
        };
        if suspect.strikes < threshold {
            tracing::info!(seq, strikes = suspect.strikes, threshold, %cause, "the oldest unacknowledged message was on the wire when the connection ended");
            return;
        }
        let reason = if cause.kind == CauseKind::NamesPacket {
            format!("poison: the broker closed the connection over it: {cause}")
        } else {
            format!(
                "poison: it was the oldest unacknowledged message when {} connections in a row ended; last: {cause}",
                suspect.strikes
            )
        };
        self.suspect = None;
        // The row the cut's drops were over is found: the rest of the cut need not go out one
        // at a time. Another poison row among them would show as the next cut with a window.
        self.probe_explained(seq);
        if gaps::is_notice(seq) {
            self.announced(seq, Some(reason));
            return;
        }
        tracing::warn!(seq, %reason, "isolating a message the broker keeps choking on");
        self.out.push_back(Action::DeadLetter(
            vec![Unpublishable { seq, reason }],
            Removal::Poison,
        ));
    }
}
