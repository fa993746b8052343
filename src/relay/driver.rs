//! Drives one rumqttc connection: iterates it continuously, backs off between attempts, and
//! keeps events of different connections apart.

use std::time::Duration;

use crossbeam_channel::Receiver;
use rumqttc::{Connection, ConnectionError, Event, Outgoing};

use super::backoff::Backoff;
use crate::error::Result;

/// What the driver hands to the session logic.
pub(crate) enum Signal {
    /// An event of the current connection.
    Event(Event),
    /// The connection failed. Every event of that connection was delivered before this.
    Disconnected(String),
}

/// Whether the driver should keep going.
#[derive(Debug, PartialEq, Eq)]
pub(crate) enum Flow {
    Continue,
    Stop,
    /// Drop the connection and start a new one (after a backoff wait).
    Reconnect,
}

/// Runs until `on_signal` says stop, the stop channel fires during a backoff wait, a clean
/// disconnect is sent, or every client handle is dropped.
///
/// rumqttc keeps events it buffered before a failure (`state.events`) and hands them out after
/// the next ConnAck, where they would pass for the new connection's. So on failure the driver
/// drains them first, then reports the disconnect: callers see each connection's events
/// strictly between its ConnAck and its `Disconnected`. After `on_signal` has seen the
/// disconnect (and stopped submitting requests), the request channel is drained again, so
/// nothing queued for the old connection is sent on the new one.
pub(crate) fn drive(
    mut connection: Connection,
    stop: &Receiver<()>,
    mut backoff: Backoff,
    connect_timeout: Duration,
    mut on_signal: impl FnMut(Signal) -> Result<Flow>,
) -> Result<()> {
    let mut options = connection.eventloop.network_options();
    options.set_connection_timeout(connect_timeout.as_secs().max(1));
    connection.eventloop.set_network_options(options);
    loop {
        let event = match connection.recv() {
            // Every client handle was dropped: the owner is shutting down.
            Err(_) => return Ok(()),
            Ok(event) => event,
        };
        match event {
            Ok(event) => {
                tracing::trace!(?event, "mqtt event");
                let clean_disconnect = matches!(event, Event::Outgoing(Outgoing::Disconnect));
                if matches!(event, Event::Incoming(rumqttc::Packet::ConnAck(_))) {
                    backoff.reset();
                }
                match on_signal(Signal::Event(event))? {
                    Flow::Stop => return Ok(()),
                    _ if clean_disconnect => return Ok(()),
                    Flow::Continue => {}
                    Flow::Reconnect => {
                        // What rumqttc does on a network error, done on purpose.
                        connection.eventloop.clean();
                        connection.eventloop.network = None;
                        if !reconnect(
                            &mut connection,
                            stop,
                            &mut backoff,
                            "reconnect requested",
                            &mut on_signal,
                        )? {
                            return Ok(());
                        }
                    }
                }
            }
            Err(e) => {
                if !reconnect(&mut connection, stop, &mut backoff, &describe(&e), &mut on_signal)? {
                    return Ok(());
                }
            }
        }
    }
}

/// Delivers the failed connection's buffered events and the disconnect, forgets what was queued
/// for it, and waits out the backoff. False when it is time to stop.
fn reconnect(
    connection: &mut Connection,
    stop: &Receiver<()>,
    backoff: &mut Backoff,
    error: &str,
    on_signal: &mut impl FnMut(Signal) -> Result<Flow>,
) -> Result<bool> {
    let stale: Vec<Event> = connection.eventloop.state.events.drain(..).collect();
    for event in stale {
        if on_signal(Signal::Event(event))? == Flow::Stop {
            return Ok(false);
        }
    }
    if on_signal(Signal::Disconnected(error.to_owned()))? == Flow::Stop {
        return Ok(false);
    }
    connection.eventloop.clean();
    let delay = backoff.next_delay();
    tracing::debug!(?delay, "waiting before reconnecting");
    Ok(stop.recv_timeout(delay) == Err(crossbeam_channel::RecvTimeoutError::Timeout))
}

/// A one-line description of a connection error, for logs and status.
fn describe(e: &ConnectionError) -> String {
    match e {
        ConnectionError::Io(io) => format!("connection lost or refused: {io}"),
        ConnectionError::ConnectionRefused(code) => format!("broker refused the connection: {code:?}"),
        ConnectionError::NetworkTimeout => "connection attempt timed out".into(),
        other => other.to_string(),
    }
}
