//! The connection thread's side of the publisher channel. Signals reach the publisher in order,
//! and a network read's events travel as one message: one wake-up of the publisher per read, not
//! per event (a read under load brings several PUBACKs, and the publisher would otherwise fall
//! asleep and be woken again for each). Once the publisher is gone, the session ends.

use crossbeam_channel::Sender;

use crate::error::Result;
use crate::mqtt::driver::{Flow, Signal};

pub(super) struct Forwarder {
    events: Sender<Vec<Signal>>,
    held: Vec<Signal>,
}

impl Forwarder {
    pub(super) fn new(events: Sender<Vec<Signal>>) -> Self {
        Forwarder {
            events,
            held: Vec::new(),
        }
    }

    /// Holds the signal until its read has been handed out; a connection's start and end go at
    /// once, since nothing of theirs follows in the same read.
    pub(super) fn forward(&mut self, signal: Signal) -> Result<Flow> {
        match signal {
            Signal::ReadEnd => self.flush(),
            // The end of a burst of commands is the command intake's alone.
            Signal::Quiet => Ok(Flow::Continue),
            Signal::Event(_) => {
                self.held.push(signal);
                Ok(Flow::Continue)
            }
            Signal::Connected(_) | Signal::Disconnected(_) => {
                self.held.push(signal);
                self.flush()
            }
        }
    }

    /// Sends what is held, if anything: at a read's end, and once the session is over.
    pub(super) fn flush(&mut self) -> Result<Flow> {
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
}
