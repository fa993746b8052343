//! A cloud-side subscriber with the relay's connection handling: reconnects with backoff, the
//! failover list, TLS, MQTT 5 or 3.1.1. `edge-outbox consume` and the fleet bench use it; a
//! service may too, or any MQTT client of its choosing (the consumer module needs none).

use std::sync::Arc;

use crossbeam_channel::Receiver;

use super::backoff::Backoff;
use super::driver::{Driver, Flow, SessionHandle, Signal};
use super::event::{Cause, CauseKind, Event, SubResult};
use super::{MqttClient, MqttConfig, Role, SessionOptions};
use crate::error::{Error, Result};

/// Largest message read, in bytes.
const READ_LIMIT: usize = 16 * 1024 * 1024;

/// Subscribes to `filters` (QoS 1) on the broker in `mqtt` and calls `on_message(topic, payload)`
/// for every delivery, in arrival order, acknowledging each after the call returns. Runs until
/// `stop` fires (or its sender is dropped); reconnects on its own, trying the failover brokers in
/// turn, with a backoff from 100 ms to 10 s.
///
/// With `persistent`, the session is kept by the broker while disconnected (MQTT's
/// `clean_session = false`, no expiry under MQTT 5), so nothing published meanwhile is missed:
/// give `mqtt` a client id of its own, stable across restarts. Without, each connection starts
/// afresh.
///
/// ```no_run
/// use edge_outbox::consumer::Consumer;
/// use edge_outbox::MqttConfig;
///
/// let (stop_tx, stop) = crossbeam_channel::bounded::<()>(0);
/// let mut consumer = Consumer::new();
/// let mqtt = MqttConfig::new("broker.example", 1883).client_id("cloud-auditor");
/// edge_outbox::subscribe(&mqtt, &["fleet/+/events/#".into()], true, &stop, |_topic, payload| {
///     let _ = consumer.observe_bytes(payload);
/// })?;
/// # drop(stop_tx);
/// # Ok::<(), edge_outbox::Error>(())
/// ```
pub fn subscribe(
    mqtt: &MqttConfig,
    filters: &[String],
    persistent: bool,
    stop: &Receiver<()>,
    mut on_message: impl FnMut(&str, &[u8]),
) -> Result<()> {
    if filters.is_empty() {
        return Err(Error::InvalidConfig(
            "subscribe needs at least one topic filter".into(),
        ));
    }
    for filter in filters {
        crate::topic::validate_filter(filter)?;
    }
    let options = SessionOptions::new(
        mqtt,
        mqtt.id(),
        Role::Commands {
            read_limit: READ_LIMIT,
            persistent,
        },
    )?;
    let handle = Arc::new(SessionHandle::default());
    let driver = Driver {
        name: "subscriber",
        options: &options,
        handle: &handle,
        stop,
        backoff: Backoff::new(
            std::time::Duration::from_millis(100),
            std::time::Duration::from_secs(10),
        ),
    };
    let mut client: Option<MqttClient> = None;
    let (done_tx, done) = crossbeam_channel::bounded::<()>(0);
    std::thread::scope(|scope| {
        // A quiet connection hands the session logic nothing to look at: end it from here.
        scope.spawn(|| {
            crossbeam_channel::select! {
                recv(stop) -> _ => handle.close(),
                recv(done) -> _ => {}
            }
        });
        let result = run(driver, filters, &mut client, &mut on_message);
        drop(done_tx);
        result
    })
}

fn run(
    driver: Driver<'_>,
    filters: &[String],
    client: &mut Option<MqttClient>,
    on_message: &mut impl FnMut(&str, &[u8]),
) -> Result<()> {
    driver.run(|signal| {
        match signal {
            Signal::Connected(link) => {
                for filter in filters {
                    if link.client.try_subscribe(filter).is_err() {
                        return Ok(Flow::Reconnect(Cause::new(
                            CauseKind::Retry,
                            "could not queue a subscription",
                        )));
                    }
                }
                *client = Some(link.client);
            }
            Signal::Event(Event::SubAck(results)) => {
                if results.iter().any(|r| matches!(r, SubResult::Refused(_))) {
                    tracing::error!(
                        ?filters,
                        "the broker refused a subscription: check its ACL for this client"
                    );
                }
            }
            Signal::Event(Event::Delivery(delivery)) => {
                on_message(&delivery.topic, &delivery.payload);
                if client.as_ref().is_none_or(|c| c.try_ack(&delivery).is_err()) {
                    return Ok(Flow::Reconnect(Cause::new(
                        CauseKind::Retry,
                        "could not queue an acknowledgement",
                    )));
                }
            }
            Signal::Event(_) | Signal::Quiet | Signal::ReadEnd | Signal::Idle => {}
            Signal::Disconnected(cause) => {
                tracing::debug!(%cause, "subscriber disconnected");
                *client = None;
            }
        }
        Ok(Flow::Continue)
    })
}
