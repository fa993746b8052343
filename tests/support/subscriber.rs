//! An MQTT client independent of the crate under test: it subscribes and collects what arrives
//! (the consumer in end-to-end tests), and can publish (commands, raw baselines). Plus
//! [`publish_raw`] for one-shot publishing.
//!
//! The rumqttc `Connection` is iterated continuously on the client's own named thread; that thread
//! only ever calls non-blocking `try_*` methods (a blocking call there deadlocks when the request
//! channel is full). Waits block on a condvar signalled by that thread: no sleep-and-hope.

use std::collections::HashMap;
use std::fmt;
use std::io;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::thread::{self, JoinHandle};
use std::time::{Duration, Instant};

use rumqttc::{Client, Connection, Event, MqttOptions, Outgoing, Packet, SubscribeReasonCode, Transport};

pub use rumqttc::QoS;

/// Connect timeout (also bounds how long `stop()` can wait for a connect in progress).
const CONNECT_TIMEOUT_SECS: u64 = 3;
/// Pause between reconnect attempts: rumqttc retries at once after an error.
const RECONNECT_DELAY: Duration = Duration::from_millis(100);
/// Large enough for any payload a test sends (rumqttc's default is 10 KiB).
const MAX_PACKET: usize = 16 << 20;

/// One delivered PUBLISH.
#[derive(Clone, PartialEq, Eq)]
pub struct Message {
    pub topic: String,
    pub payload: Vec<u8>,
    pub qos: QoS,
    pub retain: bool,
    pub dup: bool,
}

impl fmt::Debug for Message {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Message")
            .field("topic", &self.topic)
            .field("payload_len", &self.payload.len())
            .field(
                "payload",
                &String::from_utf8_lossy(&self.payload[..self.payload.len().min(48)]),
            )
            .field("qos", &self.qos)
            .field("retain", &self.retain)
            .field("dup", &self.dup)
            .finish()
    }
}

/// Options for [`Subscriber`]. Defaults: a unique client id, clean session, QoS 1, keep-alive 5 s,
/// plain TCP, 16 MiB packet limit both ways, no subscription unless `filter` is set.
pub struct SubscriberBuilder {
    addr: SocketAddr,
    host: String,
    filter: Option<String>,
    qos: QoS,
    client_id: Option<String>,
    clean_session: bool,
    keep_alive: Duration,
    transport: Option<Transport>,
    credentials: Option<(String, String)>,
}

impl SubscriberBuilder {
    /// Username and password for a broker that requires them.
    pub fn credentials(mut self, user: &str, password: &str) -> Self {
        self.credentials = Some((user.to_owned(), password.to_owned()));
        self
    }

    /// The filter subscribed to on every ConnAck.
    pub fn filter(mut self, filter: impl Into<String>) -> Self {
        self.filter = Some(filter.into());
        self
    }

    pub fn qos(mut self, qos: QoS) -> Self {
        self.qos = qos;
        self
    }

    /// Needed for a persistent session (`clean_session(false)`) that a later client resumes.
    pub fn client_id(mut self, id: impl Into<String>) -> Self {
        self.client_id = Some(id.into());
        self
    }

    pub fn clean_session(mut self, clean: bool) -> Self {
        self.clean_session = clean;
        self
    }

    /// At least 1 s (rumqttc's minimum).
    pub fn keep_alive(mut self, keep_alive: Duration) -> Self {
        self.keep_alive = keep_alive;
        self
    }

    /// E.g. [`super::Pki::client_transport`] for TLS; the host name checked against the server
    /// certificate is `127.0.0.1` unless `host` changes it.
    pub fn transport(mut self, transport: Transport) -> Self {
        self.transport = Some(transport);
        self
    }

    /// The host name given to rumqttc (for TLS, the name the certificate must match); the port is
    /// always `addr`'s.
    pub fn host(mut self, host: impl Into<String>) -> Self {
        self.host = host.into();
        self
    }

    /// Connects and, with a filter, waits (up to [`super::WAIT`]) until the subscription is acknowledged,
    /// so messages published after this returns are delivered.
    pub fn start(self) -> io::Result<Subscriber> {
        let sub = self.spawn()?;
        if sub.filter.is_some() && !sub.wait_subscribed(1, super::WAIT) {
            let err = sub.last_error().unwrap_or_else(|| "no SubAck".to_owned());
            return Err(io::Error::new(
                io::ErrorKind::TimedOut,
                format!(
                    "subscriber {} on {}: not subscribed within {:?}: {err}",
                    sub.client_id,
                    sub.addr,
                    super::WAIT
                ),
            ));
        }
        Ok(sub)
    }

    /// Like `start`, but returns at once, without waiting for ConnAck or SubAck (e.g. when the
    /// broker is down yet).
    pub fn spawn(self) -> io::Result<Subscriber> {
        let client_id = self.client_id.unwrap_or_else(|| unique_id("test-sub"));
        let mut opts = MqttOptions::new(client_id.clone(), self.host, self.addr.port());
        opts.set_clean_session(self.clean_session)
            .set_keep_alive(self.keep_alive)
            .set_max_packet_size(MAX_PACKET, MAX_PACKET);
        if let Some(t) = self.transport {
            opts.set_transport(t);
        }
        if let Some((user, password)) = self.credentials {
            opts.set_credentials(user, password);
        }
        // Room for our own subscribe/disconnect requests and test publishes without blocking.
        let (client, mut connection) = Client::new(opts, 1_000);
        let mut net = connection.eventloop.network_options();
        net.set_connection_timeout(CONNECT_TIMEOUT_SECS);
        connection.eventloop.set_network_options(net);

        let shared = Arc::new(Shared {
            state: Mutex::new(State::default()),
            changed: Condvar::new(),
        });
        let thread = {
            let shared = shared.clone();
            let client = client.clone();
            let filter = self.filter.clone();
            let qos = self.qos;
            thread::Builder::new()
                .name(format!("test-sub-{client_id}"))
                .spawn(move || event_loop(connection, client, filter, qos, &shared))?
        };
        Ok(Subscriber {
            addr: self.addr,
            client_id,
            filter: self.filter,
            client,
            shared,
            thread: Some(thread),
        })
    }
}

/// A running client; see the module docs. Stopped (DISCONNECT, thread joined) on drop.
pub struct Subscriber {
    addr: SocketAddr,
    client_id: String,
    filter: Option<String>,
    client: Client,
    shared: Arc<Shared>,
    thread: Option<JoinHandle<()>>,
}

struct Shared {
    state: Mutex<State>,
    changed: Condvar,
}

#[derive(Default)]
struct State {
    messages: Vec<Message>,
    connected: bool,
    connacks: u64,
    subacks: u64,
    pubacks: u64,
    errors: u64,
    last_error: Option<String>,
    stop: bool,
}

impl Subscriber {
    /// Subscribes to `filter` at QoS 1 with a clean session; returns once subscribed.
    pub fn start(addr: SocketAddr, filter: &str) -> io::Result<Subscriber> {
        Subscriber::builder(addr).filter(filter).start()
    }

    pub fn builder(addr: SocketAddr) -> SubscriberBuilder {
        SubscriberBuilder {
            addr,
            host: addr.ip().to_string(),
            filter: None,
            qos: QoS::AtLeastOnce,
            client_id: None,
            clean_session: true,
            keep_alive: Duration::from_secs(5),
            transport: None,
            credentials: None,
        }
    }

    pub fn client_id(&self) -> &str {
        &self.client_id
    }

    /// Waits until at least `n` messages arrived in total; false on timeout.
    pub fn wait_for(&self, n: usize, timeout: Duration) -> bool {
        self.wait_until(timeout, |st| st.messages.len() >= n)
    }

    /// Waits until `done` holds for the messages received so far; false on timeout.
    pub fn wait_messages(&self, timeout: Duration, mut done: impl FnMut(&[Message]) -> bool) -> bool {
        self.wait_until(timeout, |st| done(&st.messages))
    }

    /// Waits until `n` SubAcks arrived in total (one per connection that subscribed).
    pub fn wait_subscribed(&self, n: u64, timeout: Duration) -> bool {
        self.wait_until(timeout, |st| st.subacks >= n)
    }

    /// Waits until `n` ConnAcks arrived in total: `wait_connected(2, ..)` sees a reconnect.
    pub fn wait_connected(&self, n: u64, timeout: Duration) -> bool {
        self.wait_until(timeout, |st| st.connacks >= n && st.connected)
    }

    /// Waits until `n` PubAcks arrived in total (for this client's own QoS 1 publishes).
    pub fn wait_pubacks(&self, n: u64, timeout: Duration) -> bool {
        self.wait_until(timeout, |st| st.pubacks >= n)
    }

    /// Waits until `n` connection errors were seen in total (refused, reset, keep-alive timeout, TLS).
    pub fn wait_errors(&self, n: u64, timeout: Duration) -> bool {
        self.wait_until(timeout, |st| st.errors >= n)
    }

    /// Everything received so far, in arrival order.
    pub fn messages(&self) -> Vec<Message> {
        self.lock().messages.clone()
    }

    pub fn payloads(&self) -> Vec<Vec<u8>> {
        self.lock().messages.iter().map(|m| m.payload.clone()).collect()
    }

    pub fn len(&self) -> usize {
        self.lock().messages.len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Removes and returns what was received so far (counts for `wait_for` restart from 0).
    pub fn take(&self) -> Vec<Message> {
        std::mem::take(&mut self.lock().messages)
    }

    pub fn is_connected(&self) -> bool {
        self.lock().connected
    }

    pub fn connacks(&self) -> u64 {
        self.lock().connacks
    }

    pub fn pubacks(&self) -> u64 {
        self.lock().pubacks
    }

    /// Connection errors seen so far (each is followed by a reconnect attempt).
    pub fn errors(&self) -> u64 {
        self.lock().errors
    }

    pub fn last_error(&self) -> Option<String> {
        self.lock().last_error.clone()
    }

    /// Queues a publish on this client (from the test thread, never the event-loop thread, so the
    /// blocking send is safe). With QoS 1, see `wait_pubacks`.
    pub fn publish(&self, topic: &str, payload: impl Into<Vec<u8>>, qos: QoS) -> io::Result<()> {
        self.client
            .publish(topic, qos, false, payload)
            .map_err(|e| io::Error::other(format!("publish to {topic}: {e}")))
    }

    /// Sends DISCONNECT (a persistent session then keeps queueing for this client id) and joins
    /// the thread. Takes at most the connect timeout (3 s) when a connect is in progress.
    pub fn stop(mut self) {
        self.shutdown();
    }

    fn shutdown(&mut self) {
        self.lock().stop = true;
        self.shared.changed.notify_all();
        // Wakes the event loop if it is idle on a connection; fails harmlessly if it is gone.
        let _ = self.client.try_disconnect();
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        self.shared.lock()
    }

    fn wait_until(&self, timeout: Duration, mut done: impl FnMut(&State) -> bool) -> bool {
        let deadline = Instant::now() + timeout;
        let mut st = self.lock();
        loop {
            if done(&st) {
                return true;
            }
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() || st.stop {
                return false;
            }
            st = self
                .shared
                .changed
                .wait_timeout(st, left)
                .unwrap_or_else(|e| e.into_inner())
                .0;
        }
    }
}

impl Drop for Subscriber {
    fn drop(&mut self) {
        self.shutdown();
    }
}

impl Shared {
    fn lock(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn update(&self, f: impl FnOnce(&mut State)) {
        f(&mut self.lock());
        self.changed.notify_all();
    }
}

fn event_loop(mut connection: Connection, client: Client, filter: Option<String>, qos: QoS, shared: &Shared) {
    loop {
        {
            let st = shared.lock();
            // Connected: keep polling so the queued DISCONNECT goes out (then we return below).
            if st.stop && !st.connected {
                return;
            }
        }
        let event = match connection.recv() {
            Ok(e) => e,
            // Every `Client` was dropped: nothing more can happen.
            Err(_) => return,
        };
        match event {
            Ok(Event::Incoming(Packet::ConnAck(_))) => {
                shared.update(|st| {
                    st.connected = true;
                    st.connacks += 1;
                });
                // Non-blocking: this thread drives the event loop. Also on a resumed session, where
                // it is harmless and covers a broker that lost the session.
                if let Some(f) = &filter
                    && let Err(e) = client.try_subscribe(f.clone(), qos)
                {
                    shared.update(|st| st.last_error = Some(format!("subscribe {f}: {e}")));
                }
            }
            Ok(Event::Incoming(Packet::SubAck(ack))) => {
                let failed = ack
                    .return_codes
                    .iter()
                    .any(|c| matches!(c, SubscribeReasonCode::Failure));
                shared.update(|st| {
                    if failed {
                        st.last_error = Some(format!("subscription refused: {:?}", ack.return_codes));
                    } else {
                        st.subacks += 1;
                    }
                });
            }
            Ok(Event::Incoming(Packet::Publish(p))) => {
                let m = Message {
                    topic: p.topic.clone(),
                    payload: p.payload.to_vec(),
                    qos: p.qos,
                    retain: p.retain,
                    dup: p.dup,
                };
                shared.update(|st| st.messages.push(m));
            }
            Ok(Event::Incoming(Packet::PubAck(_))) => shared.update(|st| st.pubacks += 1),
            Ok(Event::Outgoing(Outgoing::Disconnect)) => {
                shared.update(|st| st.connected = false);
                return;
            }
            Ok(_) => {}
            Err(e) => {
                let mut st = shared.lock();
                st.connected = false;
                if st.stop {
                    return;
                }
                st.errors += 1;
                st.last_error = Some(e.to_string());
                shared.changed.notify_all();
                // rumqttc reconnects on the next call at once: pace it, but wake up for `stop`.
                let deadline = Instant::now() + RECONNECT_DELAY;
                while !st.stop {
                    let left = deadline.saturating_duration_since(Instant::now());
                    if left.is_zero() {
                        break;
                    }
                    st = shared
                        .changed
                        .wait_timeout(st, left)
                        .unwrap_or_else(|e| e.into_inner())
                        .0;
                }
            }
        }
    }
}

fn unique_id(prefix: &str) -> String {
    static NEXT: AtomicU64 = AtomicU64::new(0);
    format!(
        "{prefix}-{}-{}",
        std::process::id(),
        NEXT.fetch_add(1, Ordering::Relaxed)
    )
}

/// Connects to `addr` (plain TCP), publishes one message, waits for its PUBACK (QoS 1), PUBCOMP
/// (QoS 2) or for it to be written (QoS 0), then closes the connection. Fails on a refused
/// connection (a CONNACK with an error code), or after 10 s. A connection lost before everything
/// is acknowledged (refused, reset, closed by the other end) is replaced by a new one, up to
/// [`RAW_RECLOSES`] times, and what was not acknowledged is published again on it, as any QoS 1
/// publisher does.
///
/// Two rumqttd 0.20 defects shape this (bytebeamio/rumqtt issue 928). A client that sends
/// DISCONNECT and then closes its socket makes rumqttd's router see two disconnects for one
/// connection id; when a new connection took that id in between, the second one closes the *new*
/// connection ("no-connection id N is already gone" in its log). So this never sends DISCONNECT:
/// it closes the socket, one disconnect. And rumqttc, reconnecting with a clean session, drops
/// what it had not got acknowledged (`pending` is cleared on a CONNACK without a session), so a
/// retry is a new client that publishes again, never rumqttc's own reconnect.
pub fn publish_raw(addr: SocketAddr, topic: &str, payload: &[u8], qos: QoS) -> io::Result<()> {
    publish_raw_many(addr, &[(topic, payload)], qos)
}

/// How many lost connections [`publish_raw`] survives.
pub const RAW_RECLOSES: u32 = 3;

/// [`publish_raw`] with the retain flag set: the broker keeps the message and delivers it to
/// every later subscription (with an empty payload, it clears the retained message).
pub fn publish_retained(addr: SocketAddr, topic: &str, payload: &[u8], qos: QoS) -> io::Result<()> {
    publish_raw_with(addr, &[(topic, payload)], qos, true)
}

/// [`publish_raw`] for several messages on one connection, in order.
pub fn publish_raw_many(addr: SocketAddr, messages: &[(&str, &[u8])], qos: QoS) -> io::Result<()> {
    publish_raw_with(addr, messages, qos, false)
}

fn publish_raw_with(addr: SocketAddr, messages: &[(&str, &[u8])], qos: QoS, retain: bool) -> io::Result<()> {
    const TIMEOUT: Duration = Duration::from_secs(10);
    let deadline = Instant::now() + TIMEOUT;
    let mut acked = vec![false; messages.len()];
    let mut lost = 0;
    loop {
        match publish_raw_once(addr, messages, qos, retain, &mut acked, deadline) {
            Ok(()) => return Ok(()),
            Err(RawError::Lost(why)) if lost < RAW_RECLOSES => {
                lost += 1;
                eprintln!("support: publish_raw to {addr}: {why}; publishing again on a new connection");
                thread::sleep(RECONNECT_DELAY);
            }
            Err(RawError::Lost(why)) => {
                return Err(io::Error::other(format!(
                    "publish_raw to {addr}: {why} (after {lost} lost connections)"
                )));
            }
            Err(RawError::Fatal(e)) => return Err(e),
        }
    }
}

enum RawError {
    /// The connection was lost: worth another one.
    Lost(String),
    /// Refused, timed out or misused: retrying would not help.
    Fatal(io::Error),
}

/// One connection's attempt: publishes every message not yet in `acked`, and marks them as their
/// acknowledgements come.
fn publish_raw_once(
    addr: SocketAddr,
    messages: &[(&str, &[u8])],
    qos: QoS,
    retain: bool,
    acked: &mut [bool],
    deadline: Instant,
) -> Result<(), RawError> {
    let todo: Vec<usize> = (0..messages.len()).filter(|&i| !acked[i]).collect();
    if todo.is_empty() {
        return Ok(());
    }
    let mut opts = MqttOptions::new(unique_id("publish-raw"), addr.ip().to_string(), addr.port());
    opts.set_max_packet_size(MAX_PACKET, MAX_PACKET)
        .set_keep_alive(Duration::from_secs(5));
    // Every request fits in the channel, so `try_publish` never fails for lack of room.
    let (client, mut connection) = Client::new(opts, todo.len() + 2);
    let fatal = |what: String| RawError::Fatal(io::Error::other(format!("publish_raw to {addr}: {what}")));
    for &i in &todo {
        let (topic, payload) = messages[i];
        client
            .try_publish(topic, qos, retain, payload.to_vec())
            .map_err(|e| fatal(e.to_string()))?;
    }
    // A fresh client sends the requests in order, so the n-th outgoing publish is todo[n]; its
    // packet id says which acknowledgement is whose.
    let mut written = 0;
    let mut by_pkid: HashMap<u16, usize> = HashMap::new();
    while todo.iter().any(|&i| !acked[i]) {
        let left = deadline.saturating_duration_since(Instant::now());
        let event = match connection.recv_timeout(left) {
            Ok(Ok(event)) => event,
            Ok(Err(rumqttc::ConnectionError::ConnectionRefused(code))) => {
                return Err(fatal(format!("connection refused: {code:?}")));
            }
            Ok(Err(e)) => return Err(RawError::Lost(e.to_string())),
            Err(e) => {
                let done = acked.iter().filter(|&&a| a).count();
                return Err(RawError::Fatal(io::Error::new(
                    io::ErrorKind::TimedOut,
                    format!(
                        "publish_raw to {addr}: {e:?} after {done}/{} acknowledged",
                        acked.len()
                    ),
                )));
            }
        };
        match event {
            Event::Outgoing(Outgoing::Publish(pkid)) => {
                if let Some(&i) = todo.get(written) {
                    written += 1;
                    if qos == QoS::AtMostOnce {
                        acked[i] = true;
                    } else {
                        by_pkid.insert(pkid, i);
                    }
                }
            }
            Event::Incoming(Packet::PubAck(ack)) if qos == QoS::AtLeastOnce => {
                if let Some(i) = by_pkid.remove(&ack.pkid) {
                    acked[i] = true;
                }
            }
            Event::Incoming(Packet::PubComp(comp)) if qos == QoS::ExactlyOnce => {
                if let Some(i) = by_pkid.remove(&comp.pkid) {
                    acked[i] = true;
                }
            }
            _ => {}
        }
    }
    // Dropping the connection closes the socket: no DISCONNECT (see `publish_raw`).
    Ok(())
}
