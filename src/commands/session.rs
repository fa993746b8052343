//! The command session: receive, store, then acknowledge.
//!
//! It connects with a persistent session (`clean_session = false` under 3.1.1, a session that
//! never expires under MQTT 5) and its own client id, so the broker queues commands while the
//! device is offline, and with manual acks, so a command is acknowledged only after it is
//! committed in the inbox. Deliveries that arrive together (a burst: those one network read
//! brought, as when the broker sends its queue after an outage) are held until the driver has
//! handed out the rest of that read ([`Signal::Quiet`]), or [`MAX_BURST`] are held, and then
//! stored in one transaction, so a burst costs one commit and one sync of the file rather than
//! one per command; every one of them is acknowledged after that commit. Acks are sent from the event-loop thread, in arrival order, once per delivery,
//! and always on the connection the delivery came on: each connection has its own client, so an
//! ack never reaches a newer connection (MQTT-4.6.0-2). Storing never waits on application
//! code; applying is a separate step.
//!
//! In single-session mode ([`RelayConfig::single_session`](crate::RelayConfig::single_session))
//! the same [`Intake`] runs inside the publishing session's connection thread instead: it takes
//! the deliveries and the subscription's answer, and everything else goes on to the publisher.
//!
//! A subscription the broker refuses (an ACL, a filter it does not support) is an error the
//! operator sees, in the log and in [`Status::last_error`](crate::Status::last_error), not a
//! silent absence of commands. A delivery up to the read limit is taken, one above the delivery
//! limit is dead-lettered (without its bytes) and acknowledged, so it cannot wedge the session by
//! being redelivered forever; retained deliveries are ignored unless asked for (see
//! [`super::delivery`]).

use std::sync::Arc;

use crossbeam_channel::{Receiver, Sender};
use rusqlite::Connection;

use super::delivery::{self, DeliveryLimits, Handled, Incoming};
use crate::error::Result;
use crate::mqtt::backoff::Backoff;
use crate::mqtt::driver::{Driver, Flow, SessionHandle, Signal};
use crate::mqtt::event::{Cause, CauseKind, Delivery, Event, SubResult, reason_name};
use crate::mqtt::status::{Source, StatusCell};
use crate::mqtt::{MqttClient, SessionOptions};
use crate::store::{Options, Received};

/// A command session of its own: its own client id and connection thread.
pub(crate) struct CommandSession {
    pub intake: Intake,
    pub mqtt: SessionOptions,
    pub handle: Arc<SessionHandle>,
    pub backoff: Backoff,
}

impl CommandSession {
    pub(crate) fn run(self) -> Result<()> {
        let CommandSession {
            mut intake,
            mqtt,
            handle,
            backoff,
        } = self;
        let stop = intake.stop.clone();
        let driver = Driver {
            name: "command session",
            options: &mqtt,
            handle: &handle,
            stop: &stop,
            backoff,
        };
        driver.run(|signal| intake.on_signal(&signal))?;
        intake.status.set_commands_connected(false);
        Ok(())
    }
}

/// The most deliveries held for one transaction. A burst is what one network read brought, which
/// rumqttc bounds itself (a few packets per read); this bounds the memory and the transaction
/// should that change.
pub(crate) const MAX_BURST: usize = 256;

/// The receiving side of commands, for whichever session carries them: subscribes on every new
/// connection, stores each burst of deliveries, and acknowledges them once stored.
pub(crate) struct Intake {
    pub conn: Connection,
    pub options: Options,
    pub filter: String,
    pub arrivals: Sender<()>,
    pub stop: Receiver<()>,
    pub status: Arc<StatusCell>,
    /// Between attempts to store a command the database refused.
    pub store_backoff: Backoff,
    pub limits: DeliveryLimits,
    /// The current connection's client: acks go out on it only.
    pub client: Option<MqttClient>,
    /// (Mutant only) deliveries acknowledged before they were stored.
    pub unstored: Vec<Delivery>,
    /// Deliveries of the current burst, not yet stored nor acknowledged.
    pub held: Vec<Delivery>,
    /// Runs in the publishing session's connection thread (single-session mode): a command the
    /// database will not take ends the connection instead of holding the thread, which also
    /// reads the publisher's PUBACKs and keeps the connection alive.
    pub shared: bool,
}

impl Intake {
    /// Acts on one signal of the session. Signals that are not about commands are left alone
    /// (see [`takes`](Self::takes)).
    pub(crate) fn on_signal(&mut self, signal: &Signal) -> Result<Flow> {
        match signal {
            Signal::Connected(link) => {
                // A burst belongs to its connection (the driver ends each with Disconnected,
                // which stores what is held): never acknowledged on a newer one.
                self.held.clear();
                tracing::debug!(session_present = link.granted.session_present, filter = %self.filter, "command session connected");
                if link.client.try_subscribe(&self.filter).is_err() {
                    tracing::error!("could not queue the command subscription");
                    return Ok(Flow::Reconnect(Cause::new(
                        CauseKind::Retry,
                        "could not queue the command subscription",
                    )));
                }
                self.client = Some(link.client.clone());
            }
            Signal::Event(Event::SubAck(results)) => self.on_suback(results),
            Signal::Event(Event::Delivery(delivery)) if crate::mutant::active("ack-before-commit") => {
                // Broken on purpose: acknowledged now, stored once the ack is on the wire. A
                // crash in between loses the command.
                if let Some(c) = self.client.as_ref() {
                    let _ = c.try_ack(delivery);
                }
                self.unstored.push(Delivery::clone(delivery));
            }
            Signal::Event(Event::AckSent(pkid)) if !self.unstored.is_empty() => {
                if let Some(i) = self.unstored.iter().position(|d| d.pkid() == *pkid) {
                    let delivery = self.unstored.remove(i);
                    crate::failpoint::hit("command-stored-before-ack");
                    return self.store(std::slice::from_ref(&delivery));
                }
            }
            // Acknowledged on the wire: the broker will not send it again.
            Signal::Event(Event::AckSent(_)) => crate::failpoint::hit("command-acked"),
            Signal::Event(Event::Delivery(delivery)) => {
                // Held, not acknowledged: stored with the rest of its burst, then acknowledged
                // (and nothing after it is acknowledged before it: acks go in order).
                self.held.push(Delivery::clone(delivery));
                if self.held.len() >= MAX_BURST || crate::mutant::active("command-commit-each") {
                    return self.store_and_ack();
                }
            }
            Signal::Quiet => return self.store_and_ack(),
            Signal::Event(_) | Signal::ReadEnd | Signal::Idle => {}
            Signal::Disconnected(cause) => {
                // The connection failed with a burst held: stored now, unacknowledged (the
                // connection is gone). A broker that keeps the session sends it again and the
                // inbox recognises it; one that does not (the next broker of a failover list, a
                // QoS 0 delivery) would not, so it is not left to redelivery.
                // (Mutant only) acks that never reached the wire: store what they were for.
                let unacked: Vec<Delivery> = std::mem::take(&mut self.held)
                    .into_iter()
                    .chain(std::mem::take(&mut self.unstored))
                    .collect();
                if self.store(&unacked)? == Flow::Stop {
                    return Ok(Flow::Stop);
                }
                self.client = None;
                self.status.set_commands_connected(false);
                if cause.kind != CauseKind::Renew {
                    self.status
                        .set_error(Source::Commands, format!("command session: {cause}"));
                }
            }
        }
        Ok(Flow::Continue)
    }

    /// Whether a signal is the intake's alone: a shared session gives the publisher the rest.
    pub(crate) fn takes(signal: &Signal) -> bool {
        matches!(
            signal,
            Signal::Event(Event::SubAck(_) | Event::Delivery(_) | Event::AckSent(_)) | Signal::Quiet
        )
    }

    /// Stores the held burst in one transaction, then acknowledges each delivery of it in order.
    fn store_and_ack(&mut self) -> Result<Flow> {
        if self.held.is_empty() {
            return Ok(Flow::Continue);
        }
        let burst = std::mem::take(&mut self.held);
        let flow = self.store(&burst)?;
        if flow != Flow::Continue {
            // Not stored (stopping, or the shared connection is renewed to receive it again):
            // not acknowledged either.
            return Ok(flow);
        }
        crate::failpoint::hit("command-stored-before-ack");
        for delivery in &burst {
            let acked = self.client.as_ref().is_some_and(|c| c.try_ack(delivery).is_ok());
            if !acked {
                // Without this ack no later one may be sent: start a new connection and let
                // the broker redeliver (the inbox recognises the duplicate).
                tracing::warn!("could not queue a command ack; reconnecting");
                return Ok(Flow::Reconnect(Cause::new(
                    CauseKind::Retry,
                    "could not queue a command acknowledgement",
                )));
            }
        }
        Ok(Flow::Continue)
    }

    fn on_suback(&self, results: &[SubResult]) {
        let refused: Vec<String> = results
            .iter()
            .filter_map(|r| match r {
                SubResult::Refused(code) => Some(format!("0x{code:02X} {}", reason_name(*code))),
                SubResult::Granted => None,
            })
            .collect();
        if refused.is_empty() {
            // Ready: connected and subscribed.
            self.status.set_commands_connected(true);
        } else {
            let error = format!(
                "the broker refused the command subscription {:?} ({}): no command will arrive; \
                 check the broker's ACL for this client",
                self.filter,
                refused.join(", ")
            );
            tracing::error!("{error}");
            self.status.set_commands_connected(false);
            self.status.set_error(Source::Commands, error);
        }
    }

    /// Stores a burst of deliveries in one transaction, retrying the database until it takes
    /// them or the relay stops.
    fn store(&mut self, burst: &[Delivery]) -> Result<Flow> {
        if burst.is_empty() {
            return Ok(Flow::Continue);
        }
        let incoming: Vec<Incoming<'_>> = burst
            .iter()
            .map(|d| Incoming {
                topic: d.topic.as_str(),
                bytes: &d.payload,
                retained: d.retain,
            })
            .collect();
        let handled = loop {
            match delivery::handle_burst(&self.conn, &self.options, self.limits, &incoming) {
                Ok(handled) => {
                    self.status.clear_error(Source::Storing);
                    break handled;
                }
                Err(e) if self.shared => {
                    // Unacknowledged, so the broker sends it again on the next connection, after
                    // the driver's backoff; publishing goes on meanwhile.
                    tracing::error!(error = %e, commands = burst.len(), "could not store commands; reconnecting to receive them again");
                    self.status
                        .set_error(Source::Storing, format!("storing a command: {e}"));
                    return Ok(Flow::Reconnect(Cause::new(
                        CauseKind::Retry,
                        format!("could not store a command: {e}"),
                    )));
                }
                Err(e) => {
                    tracing::error!(error = %e, commands = burst.len(), "could not store commands; retrying");
                    self.status
                        .set_error(Source::Storing, format!("storing a command: {e}"));
                    if self.stop.recv_timeout(self.store_backoff.next_delay())
                        != Err(crossbeam_channel::RecvTimeoutError::Timeout)
                    {
                        // Shutting down: leave them unacknowledged; the broker redelivers.
                        return Ok(Flow::Stop);
                    }
                }
            }
        };
        self.store_backoff.reset();
        tracing::debug!(
            commands = burst.len(),
            "stored a burst of commands in one transaction"
        );
        let mut stored = false;
        for (delivery, received) in burst.iter().zip(&handled) {
            match received {
                Handled::Received(Received::Stored(id)) => {
                    tracing::debug!(%id, topic = %delivery.topic, "command stored");
                    self.status.on_command(false);
                    stored = true;
                }
                Handled::Received(Received::Duplicate(id)) => {
                    tracing::debug!(%id, "duplicate command delivery ignored");
                    self.status.on_command(true);
                }
                Handled::Received(Received::DeadLettered { .. }) => self.status.on_malformed(),
                Handled::IgnoredRetained => {
                    tracing::info!(topic = %delivery.topic, "retained command delivery ignored");
                    self.status.on_retained_ignored();
                }
            }
        }
        if stored {
            let _ = self.arrivals.try_send(());
        }
        Ok(Flow::Continue)
    }
}
