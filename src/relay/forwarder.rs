//! The connection thread's side of the publisher channel. Signals reach the publisher in order,
//! gathered into as few messages as order allows: the publisher otherwise falls asleep and is
//! woken again for every rumqttc event. Once the publisher is gone, the session ends.
//!
//! - The events of one network read go together, once rumqttc has handed out the last of them
//!   (`Signal::ReadEnd`): under load a read brings several PUBACKs.
//! - rumqttc writes one queued publish per step and reports each (`Published`). While more of
//!   the publisher's publishes are queued, it writes the next without waiting for the network,
//!   so those reports are held until the queue is empty, anything else comes, they are found
//!   [`MAX_HOLD`] old at a step's end, or the driver's wait passes with nothing
//!   (`Signal::Idle`). With the broker's receive maximum on the wire the next one waits for a
//!   PUBACK instead, and that PUBACK takes what is held along with it. Reports and PUBACKs carry the time the connection thread handed them out,
//!   so holding them changes no timeout or latency; the publisher only learns a little later
//!   which row a packet id carries.
//! - A connection's start and end go at once.

use std::time::{Duration, Instant};

use crossbeam_channel::Sender;

use crate::error::Result;
use crate::mqtt::QueuedPublishes;
use crate::mqtt::driver::{Flow, Signal};
use crate::mqtt::event::Event;

/// Reports are held no longer than this, whatever is still queued (a slow uplink writes a window
/// of large publishes slowly; in a shared session, acks for commands queue among the publishes).
const MAX_HOLD: Duration = Duration::from_millis(20);

pub(super) struct Forwarder {
    events: Sender<Vec<Signal>>,
    held: Vec<Signal>,
    /// When the oldest report held was written.
    held_since: Option<Instant>,
    /// The current connection's publishes not yet taken by its event loop.
    queued: Option<QueuedPublishes>,
    /// A publish rumqttc parked on a packet id still in use: counted as taken when parked, so its
    /// `Published` when the id is freed is not counted again.
    parked: Option<u16>,
    /// What is held includes more than reports of publishes written: it goes at the read's end.
    urgent: bool,
    max_hold: Duration,
}

impl Forwarder {
    pub(super) fn new(events: Sender<Vec<Signal>>) -> Self {
        Forwarder {
            events,
            held: Vec::new(),
            held_since: None,
            queued: None,
            parked: None,
            urgent: false,
            max_hold: MAX_HOLD,
        }
    }

    pub(super) fn forward(&mut self, signal: Signal) -> Result<Flow> {
        match signal {
            Signal::ReadEnd => {
                let hold = reports_wait_for_news()
                    || (self.queued.as_ref().is_some_and(QueuedPublishes::any)
                        && self.held_since.is_none_or(|t| t.elapsed() < self.max_hold));
                if self.urgent || !hold {
                    self.flush()
                } else {
                    Ok(Flow::Continue)
                }
            }
            Signal::Idle if reports_wait_for_news() && !self.urgent => Ok(Flow::Continue),
            Signal::Idle => self.flush(),
            // The end of a burst of commands is the command intake's alone.
            Signal::Quiet => Ok(Flow::Continue),
            Signal::Event(event) => {
                match &event {
                    Event::Published(pkid, written) => {
                        if self.parked == Some(*pkid) {
                            self.parked = None;
                        } else {
                            self.taken();
                        }
                        self.held_since.get_or_insert(*written);
                    }
                    // Its packet id is still in use: rumqttc takes no request until an ack
                    // frees it, so nothing more follows without the network.
                    Event::AwaitAck(pkid) => {
                        self.taken();
                        self.parked = Some(*pkid);
                        self.urgent = true;
                    }
                    _ => self.urgent = true,
                }
                self.held.push(Signal::Event(event));
                Ok(Flow::Continue)
            }
            Signal::Connected(link) => {
                self.queued = Some(link.client.queued_publishes());
                self.parked = None;
                self.held.push(Signal::Connected(link));
                self.flush()
            }
            Signal::Disconnected(cause) => {
                self.queued = None;
                self.held.push(Signal::Disconnected(cause));
                self.flush()
            }
        }
    }

    /// Sends what is held if it is more than reports of publishes written: before the command
    /// intake commits on this thread, so that the publisher's PUBACKs never wait on that commit.
    pub(super) fn flush_urgent(&mut self) -> Result<Flow> {
        if self.urgent {
            self.flush()
        } else {
            Ok(Flow::Continue)
        }
    }

    /// Sends what is held, if anything: also once the session is over.
    pub(super) fn flush(&mut self) -> Result<Flow> {
        self.urgent = false;
        self.held_since = None;
        if self.held.is_empty() {
            return Ok(Flow::Continue);
        }
        let batch = std::mem::take(&mut self.held);
        Ok(if self.events.send(batch).is_ok() {
            Flow::Continue
        } else {
            Flow::Stop
        })
    }

    fn taken(&self) {
        if let Some(queued) = &self.queued {
            queued.taken();
        }
    }
}

/// Mutant `reports-wait-for-news`: reports of publishes written are held until the broker sends
/// something, however long: a publish it never answers is never known to be on the wire, so
/// its ack timeout never starts.
fn reports_wait_for_news() -> bool {
    crate::mutant::active("reports-wait-for-news")
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::mqtt::event::{Cause, CauseKind};
    use crossbeam_channel::{Receiver, unbounded};

    /// A forwarder on a connection with `queued` publishes waiting, holding at most `max_hold`.
    fn forwarder(queued: usize, max_hold: Duration) -> (Forwarder, Receiver<Vec<Signal>>, QueuedPublishes) {
        let (tx, rx) = unbounded();
        let count = QueuedPublishes::default();
        for _ in 0..queued {
            count.queued();
        }
        let mut f = Forwarder::new(tx);
        f.queued = Some(count.clone());
        f.max_hold = max_hold;
        (f, rx, count)
    }

    const LONG: Duration = Duration::from_secs(3600);

    fn published(f: &mut Forwarder, pkid: u16) {
        let flow = f.forward(Signal::Event(Event::Published(pkid, Instant::now())));
        assert!(matches!(flow, Ok(Flow::Continue)));
        assert!(matches!(f.forward(Signal::ReadEnd), Ok(Flow::Continue)));
    }

    /// The packet ids of the `Published` reports in each batch sent.
    fn batches(rx: &Receiver<Vec<Signal>>) -> Vec<Vec<u16>> {
        rx.try_iter()
            .map(|batch| {
                batch
                    .iter()
                    .map(|s| match s {
                        Signal::Event(Event::Published(pkid, _)) => *pkid,
                        Signal::Event(Event::AwaitAck(_)) => 1000,
                        Signal::Disconnected(_) => 2000,
                        _ => 3000,
                    })
                    .collect()
            })
            .collect()
    }

    #[test]
    fn reports_are_held_while_publishes_are_queued_and_sent_when_the_queue_is_empty() {
        let (mut f, rx, queued) = forwarder(3, LONG);
        published(&mut f, 1);
        published(&mut f, 2);
        assert!(batches(&rx).is_empty(), "held while one more is queued");
        published(&mut f, 3);
        assert_eq!(batches(&rx), vec![vec![1, 2, 3]]);
        assert!(!queued.any());
    }

    #[test]
    fn anything_but_a_report_goes_at_the_read_end_and_takes_the_held_reports_along() {
        let (mut f, rx, _) = forwarder(5, LONG);
        published(&mut f, 1);
        let _ = f.forward(Signal::Event(Event::DisconnectSent));
        assert!(batches(&rx).is_empty(), "not before the read's end");
        let _ = f.forward(Signal::ReadEnd);
        assert_eq!(batches(&rx), vec![vec![1, 3000]]);
    }

    #[test]
    fn an_idle_wait_sends_what_is_held() {
        let (mut f, rx, _) = forwarder(5, LONG);
        published(&mut f, 1);
        assert!(batches(&rx).is_empty());
        let _ = f.forward(Signal::Idle);
        assert_eq!(batches(&rx), vec![vec![1]]);
    }

    #[test]
    fn reports_are_held_no_longer_than_the_bound() {
        let (mut f, rx, _) = forwarder(5, Duration::ZERO);
        published(&mut f, 1);
        published(&mut f, 2);
        assert_eq!(batches(&rx), vec![vec![1], vec![2]]);
    }

    #[test]
    fn the_end_of_a_connection_goes_at_once_after_what_was_held() {
        let (mut f, rx, _) = forwarder(5, LONG);
        published(&mut f, 1);
        let _ = f.forward(Signal::Disconnected(Cause::new(CauseKind::Retry, "gone")));
        assert_eq!(batches(&rx), vec![vec![1, 2000]]);
        // The next connection's reports are not held on the old one's count.
        published(&mut f, 2);
        assert_eq!(batches(&rx), vec![vec![2]]);
    }

    #[test]
    fn the_bound_counts_from_the_write_not_from_the_hold() {
        let (mut f, rx, _) = forwarder(5, Duration::from_secs(60));
        let _ = f.forward(Signal::Event(Event::Published(1, Instant::now())));
        let _ = f.forward(Signal::ReadEnd);
        assert!(batches(&rx).is_empty());
        let long_ago = Instant::now()
            .checked_sub(Duration::from_secs(120))
            .unwrap_or_else(Instant::now);
        let (mut f, rx, _) = forwarder(5, Duration::from_secs(60));
        let _ = f.forward(Signal::Event(Event::Published(2, long_ago)));
        let _ = f.forward(Signal::ReadEnd);
        assert_eq!(
            batches(&rx),
            vec![vec![2]],
            "written two minutes ago: past the bound"
        );
    }

    #[test]
    fn before_the_command_intake_commits_only_what_is_urgent_goes() {
        let (mut f, rx, _) = forwarder(5, LONG);
        published(&mut f, 1);
        assert!(matches!(f.flush_urgent(), Ok(Flow::Continue)));
        assert!(batches(&rx).is_empty(), "reports alone are not urgent");
        let _ = f.forward(Signal::Event(Event::AwaitAck(4)));
        let _ = f.flush_urgent();
        assert_eq!(batches(&rx), vec![vec![1, 1000]]);
    }

    #[test]
    fn a_publisher_gone_ends_the_session() {
        let (mut f, rx, _) = forwarder(0, LONG);
        drop(rx);
        let _ = f.forward(Signal::Event(Event::DisconnectSent));
        assert!(matches!(f.forward(Signal::ReadEnd), Ok(Flow::Stop)));
    }

    #[test]
    fn a_parked_publish_is_counted_once() {
        let (mut f, rx, queued) = forwarder(3, LONG);
        let _ = f.forward(Signal::Event(Event::AwaitAck(7)));
        let _ = f.forward(Signal::ReadEnd);
        assert_eq!(
            batches(&rx),
            vec![vec![1000]],
            "a collision goes at the read's end"
        );
        // The ack freed id 7: rumqttc writes the parked publish, then the two still queued.
        published(&mut f, 7);
        published(&mut f, 8);
        assert!(batches(&rx).is_empty(), "one still queued: {:?}", queued.any());
        published(&mut f, 9);
        assert_eq!(batches(&rx), vec![vec![7, 8, 9]]);
    }
}
