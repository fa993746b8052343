//! What the MQTT benchmarks share: the relay's settings, raw rumqttc speaking the relay's
//! protocol (the honest floor), and a subscriber that notes when each message arrives.
//!
//! `#[path = "common/mqtt.rs"] mod mqtt;` from the benchmarks that talk to a broker.

#![allow(dead_code, reason = "each benchmark uses a part")]

use std::sync::{Arc, Condvar, Mutex, MutexGuard, PoisonError};
use std::thread::{self, JoinHandle};
use std::time::{Duration, Instant};

use edge_outbox::{Envelope, MqttConfig, Protocol, RelayConfig};

pub type BoxResult<T> = Result<T, Box<dyn std::error::Error + Send + Sync>>;

/// mosquitto as a fleet runs it: its stock configuration, default receive maximum included.
pub fn stock_mosquitto() -> BoxResult<crate::support::Broker> {
    Ok(crate::support::Broker::builder()
        .kind(crate::support::BrokerKind::Mosquitto)
        .stock_config(true)
        .start()
        .map_err(|e| format!("this benchmark needs mosquitto: {e}"))?)
}

/// The relay's protocol: `EDGE_OUTBOX_BENCH_MQTT=3.1.1`, else MQTT 5 (the relay's default).
/// Raw rumqttc speaks the same one, so both get the same window from the broker.
pub fn protocol() -> Protocol {
    match std::env::var("EDGE_OUTBOX_BENCH_MQTT").as_deref() {
        Ok("3.1.1") => Protocol::V311,
        _ => Protocol::V5,
    }
}

pub fn relay_config(id: &str, port: u16, window: usize) -> RelayConfig {
    let mqtt = MqttConfig::new("127.0.0.1", port)
        .client_id(id)
        .protocol(protocol());
    RelayConfig::new(mqtt).max_in_flight(window)
}

/// Raw rumqttc of the relay's protocol: what an application would write with the bare client.
pub enum RawClient {
    V4(rumqttc::Client),
    V5(rumqttc::v5::Client),
}

// One per run, made once: boxing would put an indirection in the floor being measured.
#[allow(clippy::large_enum_variant)]
pub enum RawConnection {
    V4(rumqttc::Connection),
    V5(rumqttc::v5::Connection),
}

/// What raw rumqttc's event loop reported, as far as the benchmarks care.
#[derive(Debug, PartialEq, Eq)]
pub enum RawEvent {
    ConnAck,
    /// A publish written to the socket, with the packet id it took.
    Sent(u16),
    /// Its PUBACK.
    PubAck(u16),
    DisconnectSent,
    Other,
}

/// A clean-session client with `window` publishes in flight at most (the broker's receive
/// maximum lowers it under MQTT 5, as it does the relay's) and room for `window + 16` requests.
pub fn raw(port: u16, id: &str, window: usize) -> (RawClient, RawConnection) {
    let window = u16::try_from(window).unwrap_or(u16::MAX);
    match protocol() {
        Protocol::V5 => {
            let mut o = rumqttc::v5::MqttOptions::new(id, "127.0.0.1", port);
            o.set_keep_alive(Duration::from_secs(30))
                .set_clean_start(true)
                .set_max_packet_size(Some(256 * 1024))
                .set_outgoing_inflight_upper_limit(window);
            let (c, conn) = rumqttc::v5::Client::new(o, usize::from(window) + 16);
            (RawClient::V5(c), RawConnection::V5(conn))
        }
        _ => {
            let mut o = rumqttc::MqttOptions::new(id, "127.0.0.1", port);
            o.set_keep_alive(Duration::from_secs(30))
                .set_clean_session(true)
                .set_max_packet_size(256 * 1024, 256 * 1024)
                .set_inflight(window);
            let (c, conn) = rumqttc::Client::new(o, usize::from(window) + 16);
            (RawClient::V4(c), RawConnection::V4(conn))
        }
    }
}

impl RawClient {
    /// A QoS 1 publish; blocks while the request channel is full.
    pub fn publish(&self, topic: String, payload: Vec<u8>) -> BoxResult<()> {
        match self {
            RawClient::V4(c) => c.publish(topic, rumqttc::QoS::AtLeastOnce, false, payload)?,
            RawClient::V5(c) => c.publish(topic, rumqttc::v5::mqttbytes::QoS::AtLeastOnce, false, payload)?,
        }
        Ok(())
    }

    pub fn try_disconnect(&self) {
        let _ = match self {
            RawClient::V4(c) => c.try_disconnect().is_ok(),
            RawClient::V5(c) => c.try_disconnect().is_ok(),
        };
    }
}

impl RawConnection {
    pub fn next(&mut self, timeout: Duration) -> Result<RawEvent, String> {
        use rumqttc::v5::mqttbytes::v5::Packet as P5;
        match self {
            RawConnection::V4(c) => match c.recv_timeout(timeout) {
                Ok(Ok(rumqttc::Event::Incoming(rumqttc::Packet::PubAck(a)))) => Ok(RawEvent::PubAck(a.pkid)),
                Ok(Ok(rumqttc::Event::Outgoing(rumqttc::Outgoing::Publish(pkid)))) => {
                    Ok(RawEvent::Sent(pkid))
                }
                Ok(Ok(rumqttc::Event::Incoming(rumqttc::Packet::ConnAck(_)))) => Ok(RawEvent::ConnAck),
                Ok(Ok(rumqttc::Event::Outgoing(rumqttc::Outgoing::Disconnect))) => {
                    Ok(RawEvent::DisconnectSent)
                }
                Ok(Ok(_)) => Ok(RawEvent::Other),
                Ok(Err(e)) => Err(format!("raw rumqttc: {e}")),
                Err(e) => Err(format!("raw rumqttc: {e:?}")),
            },
            RawConnection::V5(c) => match c.recv_timeout(timeout) {
                Ok(Ok(rumqttc::v5::Event::Incoming(P5::PubAck(a)))) => Ok(RawEvent::PubAck(a.pkid)),
                Ok(Ok(rumqttc::v5::Event::Outgoing(rumqttc::Outgoing::Publish(pkid)))) => {
                    Ok(RawEvent::Sent(pkid))
                }
                Ok(Ok(rumqttc::v5::Event::Incoming(P5::ConnAck(_)))) => Ok(RawEvent::ConnAck),
                Ok(Ok(rumqttc::v5::Event::Outgoing(rumqttc::Outgoing::Disconnect))) => {
                    Ok(RawEvent::DisconnectSent)
                }
                Ok(Ok(_)) => Ok(RawEvent::Other),
                Ok(Err(e)) => Err(format!("raw rumqttc: {e}")),
                Err(e) => Err(format!("raw rumqttc: {e:?}")),
            },
        }
    }

    /// Iterates until the DISCONNECT asked for by `client` is written (or an error), at most 5 s.
    pub fn close(mut self, client: &RawClient) {
        client.try_disconnect();
        let deadline = Instant::now() + Duration::from_secs(5);
        while Instant::now() < deadline {
            match self.next(Duration::from_secs(1)) {
                Ok(RawEvent::DisconnectSent) | Err(_) => break,
                Ok(_) => {}
            }
        }
    }
}

#[derive(Default)]
struct Seen {
    /// When each expected sequence number (1-based) first arrived.
    at: Vec<Option<Instant>>,
    distinct: usize,
    /// Every delivery of an expected number, duplicates included.
    total: u64,
    /// Deliveries that were not envelopes or carried a number outside the expected range.
    strays: u64,
    error: Option<String>,
}

/// A subscriber on `plant/#` (its own connection, its own thread) that decodes every delivery as
/// an envelope and notes when each sequence number first arrived: the consumer in "the
/// subscriber holds every message". Its CPU is nobody's side: it is not counted.
///
/// It subscribes at QoS 0: a stock mosquitto queues at most 1000 QoS 1 messages for a
/// subscriber (`max_queued_messages`) and drops the rest while a backlog streams in faster than
/// the subscriber acknowledges, whereas QoS 0 messages to a connected client go straight to its
/// socket. On loopback nothing is lost that way, and a missing message fails the run anyway.
pub struct Arrivals {
    shared: Arc<(Mutex<Seen>, Condvar)>,
    client: rumqttc::Client,
    thread: Option<JoinHandle<()>>,
}

pub const FILTER: &str = "plant/#";

impl Arrivals {
    pub fn start(port: u16) -> BoxResult<Arrivals> {
        let mut o = rumqttc::MqttOptions::new(format!("bench-sub-{}", std::process::id()), "127.0.0.1", port);
        o.set_keep_alive(Duration::from_secs(30))
            .set_clean_session(true)
            .set_max_packet_size(1 << 20, 1 << 20);
        let (client, mut connection) = rumqttc::Client::new(o, 64);
        let shared: Arc<(Mutex<Seen>, Condvar)> = Arc::default();
        let (ready_tx, ready_rx) = crossbeam_channel::bounded::<()>(1);
        let thread = {
            let (shared, client) = (shared.clone(), client.clone());
            thread::Builder::new()
                .name("bench-subscriber".into())
                .spawn(move || {
                    for event in connection.iter() {
                        match event {
                            Ok(rumqttc::Event::Incoming(rumqttc::Packet::ConnAck(_))) => {
                                let _ = client.try_subscribe(FILTER, rumqttc::QoS::AtMostOnce);
                            }
                            Ok(rumqttc::Event::Incoming(rumqttc::Packet::SubAck(_))) => {
                                let _ = ready_tx.try_send(());
                            }
                            Ok(rumqttc::Event::Incoming(rumqttc::Packet::Publish(p))) => {
                                let now = Instant::now();
                                let seq = Envelope::decode(&p.payload).ok().map(|e| e.seq);
                                let (lock, cv) = &*shared;
                                let mut s = lock.lock().unwrap_or_else(PoisonError::into_inner);
                                match seq
                                    .and_then(|q| usize::try_from(q).ok())
                                    .filter(|&q| q >= 1 && q <= s.at.len())
                                {
                                    Some(q) => {
                                        s.total += 1;
                                        if s.at[q - 1].is_none() {
                                            s.at[q - 1] = Some(now);
                                            s.distinct += 1;
                                            cv.notify_all();
                                        }
                                    }
                                    None => s.strays += 1,
                                }
                            }
                            Ok(rumqttc::Event::Outgoing(rumqttc::Outgoing::Disconnect)) => break,
                            Ok(_) => {}
                            Err(e) => {
                                let (lock, cv) = &*shared;
                                lock.lock().unwrap_or_else(PoisonError::into_inner).error =
                                    Some(e.to_string());
                                cv.notify_all();
                                break;
                            }
                        }
                    }
                })?
        };
        ready_rx
            .recv_timeout(Duration::from_secs(10))
            .map_err(|_| "the bench subscriber did not subscribe within 10 s")?;
        Ok(Arrivals {
            shared,
            client,
            thread: Some(thread),
        })
    }

    fn lock(&self) -> MutexGuard<'_, Seen> {
        self.shared.0.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Forgets what arrived; from now on sequence numbers 1..=n are expected.
    pub fn expect(&self, n: usize) {
        let mut s = self.lock();
        s.at.clear();
        s.at.resize(n, None);
        s.distinct = 0;
        s.total = 0;
        s.strays = 0;
    }

    /// Grows the expected range to 1..=n, keeping what arrived.
    pub fn expect_up_to(&self, n: usize) {
        let mut s = self.lock();
        if s.at.len() < n {
            s.at.resize(n, None);
        }
    }

    /// Waits until every expected number arrived; returns when the last one did.
    pub fn wait_all(&self, stall: Duration) -> BoxResult<Instant> {
        let (lock, cv) = &*self.shared;
        let mut s = lock.lock().unwrap_or_else(PoisonError::into_inner);
        let mut progress = (s.distinct, Instant::now());
        loop {
            if let Some(e) = &s.error {
                return Err(format!("bench subscriber: {e}").into());
            }
            if s.distinct == s.at.len() {
                return Ok(s.at.iter().flatten().max().copied().unwrap_or_else(Instant::now));
            }
            if s.distinct != progress.0 {
                progress = (s.distinct, Instant::now());
            } else if progress.1.elapsed() > stall {
                let missing: Vec<usize> =
                    s.at.iter()
                        .enumerate()
                        .filter(|(_, t)| t.is_none())
                        .map(|(i, _)| i + 1)
                        .take(5)
                        .collect();
                return Err(format!(
                    "the subscriber holds {} of {} messages after {stall:?} without progress \
                     (missing e.g. seq {missing:?}; the broker drops what overflows max_queued_messages)",
                    s.distinct,
                    s.at.len()
                )
                .into());
            }
            s = cv
                .wait_timeout(s, Duration::from_millis(100))
                .unwrap_or_else(PoisonError::into_inner)
                .0;
        }
    }

    /// Waits for sequence number `seq`; returns when it arrived.
    pub fn wait_seq(&self, seq: usize, timeout: Duration) -> BoxResult<Instant> {
        let deadline = Instant::now() + timeout;
        let (lock, cv) = &*self.shared;
        let mut s = lock.lock().unwrap_or_else(PoisonError::into_inner);
        loop {
            if let Some(at) = s.at.get(seq.wrapping_sub(1)).copied().flatten() {
                return Ok(at);
            }
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return Err(format!("seq {seq} did not arrive within {timeout:?}").into());
            }
            s = cv.wait_timeout(s, left).unwrap_or_else(PoisonError::into_inner).0;
        }
    }

    /// (deliveries of expected numbers, distinct numbers, strays) so far.
    pub fn counts(&self) -> (u64, usize, u64) {
        let s = self.lock();
        (s.total, s.distinct, s.strays)
    }
}

impl Drop for Arrivals {
    fn drop(&mut self) {
        let _ = self.client.try_disconnect();
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}
