//! The command session: receive, store, then acknowledge.
//!
//! It connects with `clean_session = false` and its own client id, so the broker queues commands
//! while the device is offline, and with manual acks, so a command is acknowledged only after it
//! is committed in the inbox. Acks are sent from the event-loop thread, in arrival order, once
//! per delivery, before the next poll: rumqttc drops queued acks when the connection fails, so an
//! ack never reaches a newer connection than its delivery came on (MQTT-4.6.0-2). Storing never
//! waits on application code; applying is a separate step.

use std::sync::Arc;
use std::time::Duration;

use crossbeam_channel::{Receiver, Sender};
use rumqttc::{Client, Event, Packet, QoS, SubscribeReasonCode};
use rusqlite::Connection;

use super::delivery::{self, DeliveryLimits, Handled};
use super::outage::Outage;
use crate::error::Result;
use crate::relay::backoff::Backoff;
use crate::relay::driver::{Flow, Signal, drive};
use crate::relay::status::StatusCell;
use crate::store::{Options, Received};

pub(crate) struct CommandSession {
    pub conn: Connection,
    pub options: Options,
    pub client: Client,
    pub filter: String,
    pub arrivals: Sender<()>,
    pub stop: Receiver<()>,
    pub status: Arc<StatusCell>,
    pub backoff: Backoff,
    pub connect_timeout: Duration,
    pub limits: DeliveryLimits,
}

impl CommandSession {
    pub(crate) fn run(self, mut connection: rumqttc::Connection) -> Result<()> {
        // Acks are tiny and each one lets the broker send the next command: Nagle would hold
        // them back waiting for the broker's TCP ack, stalling a backlog's delivery.
        let mut network = connection.eventloop.network_options();
        network.set_tcp_nodelay(true);
        connection.eventloop.set_network_options(network);
        let CommandSession {
            conn,
            options,
            client,
            filter,
            arrivals,
            stop,
            status,
            backoff,
            connect_timeout,
            limits,
        } = self;
        let mut store_backoff = backoff.clone();
        let mut outage = Outage::default();
        drive(connection, &stop, backoff, connect_timeout, |signal| {
            match signal {
                Signal::Event(Event::Incoming(Packet::ConnAck(ack))) => {
                    outage.on_connected();
                    tracing::info!(session_present = ack.session_present, %filter, "command session connected");
                    if let Err(e) = client.try_subscribe(filter.as_str(), QoS::AtLeastOnce) {
                        tracing::error!(error = %e, "could not subscribe to commands");
                        return Ok(Flow::Reconnect);
                    }
                }
                Signal::Event(Event::Incoming(Packet::SubAck(ack))) => {
                    if ack
                        .return_codes
                        .iter()
                        .any(|c| matches!(c, SubscribeReasonCode::Failure))
                    {
                        let error = format!("broker refused the command subscription {filter:?}");
                        tracing::error!(%error);
                        status.set_error(error);
                    } else {
                        // Ready: connected and subscribed.
                        status.set_commands_connected(true);
                    }
                }
                Signal::Event(Event::Incoming(Packet::Publish(publish))) => {
                    // Store first; until it is stored the delivery is not acknowledged, and
                    // neither is anything after it (acks go in order).
                    let received = loop {
                        let (topic, retain) = (publish.topic.as_str(), publish.retain);
                        match delivery::handle(&conn, &options, limits, topic, &publish.payload, retain) {
                            Ok(r) => break r,
                            Err(e) => {
                                tracing::error!(error = %e, topic = %publish.topic, "could not store a command; retrying");
                                status.set_error(format!("storing a command: {e}"));
                                if stop.recv_timeout(store_backoff.next_delay())
                                    != Err(crossbeam_channel::RecvTimeoutError::Timeout)
                                {
                                    // Shutting down: leave it unacknowledged; the broker redelivers.
                                    return Ok(Flow::Stop);
                                }
                            }
                        }
                    };
                    store_backoff.reset();
                    crate::failpoint::hit("command-stored-before-ack");
                    match &received {
                        Handled::Received(Received::Stored(id)) => {
                            tracing::debug!(%id, topic = %publish.topic, "command stored");
                            status.on_command(false);
                            let _ = arrivals.try_send(());
                        }
                        Handled::Received(Received::Duplicate(id)) => {
                            tracing::debug!(%id, "duplicate command delivery ignored");
                            status.on_command(true);
                        }
                        Handled::Received(Received::DeadLettered { .. }) => status.on_malformed(),
                        Handled::IgnoredRetained => {
                            tracing::info!(topic = %publish.topic, "retained command delivery ignored");
                            status.on_retained_ignored();
                        }
                    }
                    if let Err(e) = client.try_ack(&publish) {
                        // Without this ack no later one may be sent: start a new connection
                        // and let the broker redeliver (the inbox recognises the duplicate).
                        tracing::warn!(error = %e, "could not queue a command ack; reconnecting");
                        return Ok(Flow::Reconnect);
                    }
                }
                Signal::Event(_) => {}
                Signal::Disconnected(error) => {
                    status.set_commands_connected(false);
                    outage.on_disconnected(&error);
                    status.set_error(format!("command session: {error}"));
                }
            }
            Ok(Flow::Continue)
        })?;
        status.set_commands_connected(false);
        Ok(())
    }
}
