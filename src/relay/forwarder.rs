//! The connection thread's side of the publisher channel. Signals reach the publisher in order,
//! gathered into as few messages as order allows: the publisher otherwise falls asleep and is
//! woken again for every rumqttc event. Once the publisher is gone, the session ends.
//!
//! - The events of one network read go together, once rumqttc has handed out the last of them
//!   (`Signal::ReadEnd`): under load a read brings several PUBACKs.
//! - rumqttc writes one queued publish per step and reports each (`Published`). While more of
//!   the publisher's publishes are queued, it writes the next without waiting for the network,
//!   so those reports are held until the queue is empty or something else comes.
//! - Anything held goes when the wait for the next event passes with nothing (`Signal::Idle`),
//!   so a report is never held longer than one wait: the publisher's ack timeout counts from it.
//! - A connection's start and end go at once.

use crossbeam_channel::Sender;

use crate::error::Result;
use crate::mqtt::QueuedPublishes;
use crate::mqtt::driver::{Flow, Signal};
use crate::mqtt::event::Event;

pub(super) struct Forwarder {
    events: Sender<Vec<Signal>>,
    held: Vec<Signal>,
    /// The current connection's publishes not yet taken by its event loop.
    queued: Option<QueuedPublishes>,
    /// What is held includes more than reports of publishes written: it goes at the read's end.
    urgent: bool,
}

impl Forwarder {
    pub(super) fn new(events: Sender<Vec<Signal>>) -> Self {
        Forwarder {
            events,
            held: Vec::new(),
            queued: None,
            urgent: false,
        }
    }

    pub(super) fn forward(&mut self, signal: Signal) -> Result<Flow> {
        match signal {
            Signal::ReadEnd => {
                let more_publishes = self.queued.as_ref().is_some_and(QueuedPublishes::any);
                if self.urgent || !(more_publishes || reports_wait_for_news()) {
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
                    Event::Published(_) => self.taken(),
                    // Its packet id is still in use: rumqttc takes no request until an ack
                    // frees it, so nothing more follows without the network.
                    Event::AwaitAck(_) => {
                        self.taken();
                        self.urgent = true;
                    }
                    _ => self.urgent = true,
                }
                self.held.push(Signal::Event(event));
                Ok(Flow::Continue)
            }
            Signal::Connected(link) => {
                self.queued = Some(link.client.queued_publishes());
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

    /// Sends what is held, if anything: also once the session is over.
    pub(super) fn flush(&mut self) -> Result<Flow> {
        self.urgent = false;
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
/// something, however long: a publish it never answers is never timed out.
fn reports_wait_for_news() -> bool {
    crate::mutant::active("reports-wait-for-news")
}
