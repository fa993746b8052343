//! An MQTT-aware fault proxy: a TCP proxy between one client and the broker that reads the MQTT
//! packets going both ways (3.1.1 and 5), so a test can make the broker misbehave in ways a real
//! one does and a plain TCP proxy cannot: acknowledge out of order, never acknowledge, choke on
//! one message, accept a connection and drop it at once.
//!
//! ```ignore
//! let proxy = MqttProxy::start(broker.addr())?;
//! proxy.hold_pubacks(1);                                           // the next PUBACK is held back...
//! proxy.drop_after(Trigger::PubAckHeld, Duration::from_millis(500), Repeat::Once); // ...then the link drops
//! proxy.drop_pubacks(true);                                        // a broker that never acknowledges
//! proxy.close_on_publish(|p| p.payload_contains(b"poison"));       // a broker that chokes on one message
//! proxy.drop_after(Trigger::ConnAck, Duration::ZERO, Repeat::Always); // accepts CONNECT, drops at once
//! ```
//!
//! | command | effect |
//! |---|---|
//! | `hold_pubacks(n)` | the next `n` PUBACKs to clients are held back; later packets pass, so the client sees later acks first |
//! | `release_held()` | held PUBACKs are sent now, on their connection if it is still open |
//! | `drop_pubacks(on)` | every PUBACK to clients is discarded while on |
//! | `answer_pubacks_with(n, code)` | the next `n` PUBACKs to MQTT 5 clients carry reason `code` instead (a refusal, a quota), held ones included |
//! | `answer_connacks_with_receive_maximum(max)` | every MQTT 5 CONNACK carries a Receive Maximum of `max` as its only property while set (0 breaks the protocol) |
//! | `answer_subacks_with(code)` | every SUBACK refuses with `code` (MQTT 5; 0x80 under 3.1.1) while set |
//! | `close_on_publish(pred)` | a client PUBLISH matching `pred` closes its connection instead of reaching the broker |
//! | `swallow_publish(pred)` | a client PUBLISH matching `pred` is dropped, the connection kept: it is never acknowledged |
//! | `drop_after(trigger, after, repeat)` | a connection is closed `after` its `trigger` happened (once, or on every connection) |
//! | `cut()` | every current connection is closed |
//! | `authenticate(check)` | every CONNECT is shown to `check` first: a refusal is answered with a CONNACK "not authorized" and the connection closed; an accepted credential that expires has its connection closed at that moment, as a cloud broker does |
//!
//! Counters (`connections`, `connacks`, `publishes`, `pubacks_forwarded`) and waits on them let a
//! test see what the client did without sleeping. Std threads only: an accept thread, two pumps
//! per connection, and one short thread per scheduled drop; all joined on drop.

use std::collections::HashMap;
use std::io::{self, Read, Write};
use std::net::{Ipv4Addr, Shutdown, SocketAddr, TcpListener, TcpStream};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::thread::{self, JoinHandle};
use std::time::{Duration, Instant};

/// A client PUBLISH, as `close_on_publish` predicates see it.
#[derive(Debug, Clone)]
pub struct Publish {
    /// Empty when the client sent a topic alias only (MQTT 5).
    pub topic: String,
    pub qos: u8,
    pub retain: bool,
    pub pkid: u16,
    pub payload: Vec<u8>,
    /// MQTT 5: its user properties, in order, and its Content Type property.
    pub user_properties: Vec<(String, String)>,
    pub content_type: Option<String>,
    /// MQTT 5: its payload format indicator (1: UTF-8 text).
    pub payload_format: Option<u8>,
}

impl Publish {
    pub fn payload_contains(&self, needle: &[u8]) -> bool {
        !needle.is_empty() && self.payload.windows(needle.len()).any(|w| w == needle)
    }
}

/// What `drop_after` waits for on a connection.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Trigger {
    /// The broker's CONNACK was forwarded to the client.
    ConnAck,
    /// A PUBACK was held back (`hold_pubacks`).
    PubAckHeld,
    /// This many PUBACKs were forwarded on the connection.
    PubAcksForwarded(u64),
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Repeat {
    /// The first connection the trigger happens on.
    Once,
    /// Every connection.
    Always,
}

type Predicate = Arc<dyn Fn(&Publish) -> bool + Send + Sync>;

/// What a client's CONNECT says about who it is.
#[derive(Debug, Clone, Default)]
pub struct Connect {
    pub client_id: String,
    pub username: Option<String>,
    pub password: Option<Vec<u8>>,
}

/// `authenticate`'s verdict: refused (with why, for the test's log), or accepted until the
/// credential expires (`None`: it does not).
pub type AuthResult = Result<Option<std::time::SystemTime>, String>;
type Authenticator = Arc<dyn Fn(&Connect) -> AuthResult + Send + Sync>;

pub struct MqttProxy {
    addr: SocketAddr,
    shared: Arc<Shared>,
    acceptor: Option<JoinHandle<()>>,
}

struct Shared {
    upstream: SocketAddr,
    state: Mutex<State>,
    changed: Condvar,
}

#[derive(Default)]
struct State {
    shutdown: bool,
    next_id: u64,
    conns: HashMap<u64, Conn>,
    threads: Vec<JoinHandle<()>>,
    // Faults.
    hold_remaining: usize,
    held: Vec<(u64, Vec<u8>)>,
    rewrite: Option<(usize, u8)>,
    refuse_subscriptions: Option<u8>,
    receive_maximum: Option<u16>,
    drop_pubacks: bool,
    close_on: Option<Predicate>,
    swallow: Option<Predicate>,
    drop_rule: Option<(Trigger, Duration, Repeat)>,
    authenticator: Option<Authenticator>,
    // Counters.
    auth_accepted: u64,
    auth_refused: Vec<String>,
    expired_closes: u64,
    connections: u64,
    connacks: u64,
    publishes: u64,
    pubacks_forwarded: u64,
    pubacks_dropped: u64,
    closed_on_publish: u64,
    swallowed: u64,
    recording: bool,
    recorded: Vec<Publish>,
    bytes_to_broker: u64,
}

struct Conn {
    client: Arc<Mutex<TcpStream>>,
    client_raw: TcpStream,
    upstream: TcpStream,
    /// MQTT protocol level from the CONNECT (4: 3.1.1, 5: MQTT 5); 0 until seen.
    level: u8,
    pubacks: u64,
    closed: bool,
}

impl Conn {
    fn close(&mut self) {
        self.closed = true;
        let _ = self.client_raw.shutdown(Shutdown::Both);
        let _ = self.upstream.shutdown(Shutdown::Both);
    }
}

impl MqttProxy {
    /// Listens on 127.0.0.1 (port picked at run time) and forwards to `upstream`.
    pub fn start(upstream: SocketAddr) -> io::Result<MqttProxy> {
        let listener = TcpListener::bind((Ipv4Addr::LOCALHOST, 0))?;
        let addr = listener.local_addr()?;
        let shared = Arc::new(Shared {
            upstream,
            state: Mutex::new(State::default()),
            changed: Condvar::new(),
        });
        let acceptor = {
            let shared = shared.clone();
            thread::Builder::new()
                .name(format!("mqtt-proxy-{}", addr.port()))
                .spawn(move || accept_loop(&listener, &shared))?
        };
        Ok(MqttProxy {
            addr,
            shared,
            acceptor: Some(acceptor),
        })
    }

    /// Where clients connect.
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// Shows every CONNECT to `check` before it reaches the broker (see the module's table).
    pub fn authenticate(&self, check: impl Fn(&Connect) -> AuthResult + Send + Sync + 'static) {
        self.shared.update(|st| st.authenticator = Some(Arc::new(check)));
    }

    /// CONNECTs `authenticate` accepted.
    pub fn auth_accepted(&self) -> u64 {
        self.shared.lock().auth_accepted
    }

    /// Why each refused CONNECT was refused, in order.
    pub fn auth_refused(&self) -> Vec<String> {
        self.shared.lock().auth_refused.clone()
    }

    /// Connections closed because their credential expired.
    pub fn expired_closes(&self) -> u64 {
        self.shared.lock().expired_closes
    }

    /// Holds back the next `n` PUBACKs sent to clients (in addition to any still to hold).
    pub fn hold_pubacks(&self, n: usize) {
        self.shared.update(|st| st.hold_remaining += n);
    }

    /// Sends the held PUBACKs, each on its connection if that is still open; returns how many
    /// were sent.
    pub fn release_held(&self) -> usize {
        let (held, conns): (Vec<_>, HashMap<u64, Arc<Mutex<TcpStream>>>) = {
            let mut st = self.shared.lock();
            let held = std::mem::take(&mut st.held);
            let conns = st
                .conns
                .iter()
                .filter(|(_, c)| !c.closed)
                .map(|(id, c)| (*id, c.client.clone()))
                .collect();
            (held, conns)
        };
        let mut sent = 0;
        for (id, packet) in held {
            if let Some(client) = conns.get(&id)
                && lock(client).write_all(&packet).is_ok()
            {
                sent += 1;
            }
        }
        self.shared.changed.notify_all();
        sent
    }

    /// PUBACKs held back right now.
    pub fn held(&self) -> usize {
        self.shared.lock().held.len()
    }

    /// The next `n` PUBACKs to MQTT 5 clients carry reason `code` (0x87 not authorized, 0x97
    /// quota exceeded, ...) instead of the broker's: a broker that refuses. The broker itself did
    /// take those messages.
    pub fn answer_pubacks_with(&self, n: usize, code: u8) {
        self.shared.update(|st| st.rewrite = Some((n, code)));
    }

    /// While `Some`, every SUBACK refuses every filter with reason `code` (MQTT 5 clients;
    /// 3.1.1 clients get 0x80, the only failure 3.1.1 has).
    pub fn answer_subacks_with(&self, code: Option<u8>) {
        self.shared.update(|st| st.refuse_subscriptions = code);
    }

    /// While `Some`, every CONNACK to an MQTT 5 client carries a Receive Maximum of `max` as its
    /// only property (0 breaks the protocol).
    pub fn answer_connacks_with_receive_maximum(&self, max: Option<u16>) {
        self.shared.update(|st| st.receive_maximum = max);
    }

    /// While on, every PUBACK to clients is discarded: a broker that takes publishes and never
    /// acknowledges them.
    pub fn drop_pubacks(&self, on: bool) {
        self.shared.update(|st| st.drop_pubacks = on);
    }

    /// A client PUBLISH for which `pred` holds is not forwarded: its connection is closed instead
    /// (a broker that drops the connection over one message: too large, a denied topic).
    pub fn close_on_publish(&self, pred: impl Fn(&Publish) -> bool + Send + Sync + 'static) {
        self.shared.update(|st| st.close_on = Some(Arc::new(pred)));
    }

    pub fn clear_close_on_publish(&self) {
        self.shared.update(|st| st.close_on = None);
    }

    /// A client PUBLISH for which `pred` holds is dropped and its connection kept: the broker
    /// never sees it and never acknowledges it, and never says so (RabbitMQ 3.10 does this with a
    /// publish above its `max_message_size`).
    pub fn swallow_publish(&self, pred: impl Fn(&Publish) -> bool + Send + Sync + 'static) {
        self.shared.update(|st| st.swallow = Some(Arc::new(pred)));
    }

    /// While on, every client PUBLISH is kept, in the order the proxy saw them (`recorded()`).
    pub fn record_publishes(&self, on: bool) {
        self.shared.update(|st| st.recording = on);
    }

    /// The client PUBLISH packets recorded so far.
    pub fn recorded(&self) -> Vec<Publish> {
        self.shared.lock().recorded.clone()
    }

    /// PUBLISH packets dropped by `swallow_publish`.
    pub fn swallowed(&self) -> u64 {
        self.shared.lock().swallowed
    }

    /// Closes a connection `after` `trigger` happens on it: on the first such connection
    /// (`Repeat::Once`, after which the rule is gone) or on every one (`Repeat::Always`).
    pub fn drop_after(&self, trigger: Trigger, after: Duration, repeat: Repeat) {
        self.shared
            .update(|st| st.drop_rule = Some((trigger, after, repeat)));
    }

    pub fn clear_drop_after(&self) {
        self.shared.update(|st| st.drop_rule = None);
    }

    /// Closes every current connection.
    pub fn cut(&self) {
        self.shared.update(|st| {
            for c in st.conns.values_mut() {
                c.close();
            }
        });
    }

    /// TCP connections accepted so far.
    pub fn connections(&self) -> u64 {
        self.shared.lock().connections
    }

    /// CONNACKs forwarded to clients so far.
    pub fn connacks(&self) -> u64 {
        self.shared.lock().connacks
    }

    /// PUBLISH packets from clients so far (forwarded or not).
    pub fn publishes(&self) -> u64 {
        self.shared.lock().publishes
    }

    /// PUBACKs forwarded to clients so far (not counting held ones, released or not).
    pub fn pubacks_forwarded(&self) -> u64 {
        self.shared.lock().pubacks_forwarded
    }

    /// PUBACKs discarded by `drop_pubacks`.
    pub fn pubacks_dropped(&self) -> u64 {
        self.shared.lock().pubacks_dropped
    }

    /// Connections closed by `close_on_publish`.
    pub fn closed_on_publish(&self) -> u64 {
        self.shared.lock().closed_on_publish
    }

    /// Bytes from clients to the broker so far.
    pub fn bytes_to_broker(&self) -> u64 {
        self.shared.lock().bytes_to_broker
    }

    /// Waits until `connections() >= n`; false on timeout.
    pub fn wait_connections(&self, n: u64, timeout: Duration) -> bool {
        self.wait_until(timeout, |st| st.connections >= n)
    }

    /// Waits until `connacks() >= n`; false on timeout.
    pub fn wait_connacks(&self, n: u64, timeout: Duration) -> bool {
        self.wait_until(timeout, |st| st.connacks >= n)
    }

    /// Waits until `held() >= n`; false on timeout.
    pub fn wait_held(&self, n: usize, timeout: Duration) -> bool {
        self.wait_until(timeout, |st| st.held.len() >= n)
    }

    /// Waits until `publishes() >= n`; false on timeout.
    pub fn wait_publishes(&self, n: u64, timeout: Duration) -> bool {
        self.wait_until(timeout, |st| st.publishes >= n)
    }

    /// Waits until `closed_on_publish() >= n`; false on timeout.
    pub fn wait_closed_on_publish(&self, n: u64, timeout: Duration) -> bool {
        self.wait_until(timeout, |st| st.closed_on_publish >= n)
    }

    fn wait_until(&self, timeout: Duration, mut done: impl FnMut(&State) -> bool) -> bool {
        let deadline = Instant::now() + timeout;
        let mut st = self.shared.lock();
        loop {
            if done(&st) {
                return true;
            }
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
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

impl Drop for MqttProxy {
    fn drop(&mut self) {
        self.shared.update(|st| {
            st.shutdown = true;
            for c in st.conns.values_mut() {
                c.close();
            }
        });
        let _ = TcpStream::connect_timeout(&self.addr, Duration::from_secs(1));
        if let Some(a) = self.acceptor.take() {
            let _ = a.join();
        }
        let threads = std::mem::take(&mut self.shared.lock().threads);
        for t in threads {
            let _ = t.join();
        }
    }
}

impl Shared {
    fn lock(&self) -> MutexGuard<'_, State> {
        lock(&self.state)
    }

    fn update<T>(&self, f: impl FnOnce(&mut State) -> T) -> T {
        let out = f(&mut self.lock());
        self.changed.notify_all();
        out
    }
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

fn accept_loop(listener: &TcpListener, shared: &Arc<Shared>) {
    loop {
        let accepted = listener.accept();
        if shared.lock().shutdown {
            return;
        }
        let Ok((client, _)) = accepted else {
            thread::sleep(Duration::from_millis(50));
            continue;
        };
        shared.update(|st| st.connections += 1);
        let Ok(upstream) = TcpStream::connect_timeout(&shared.upstream, Duration::from_secs(2)) else {
            let _ = client.shutdown(Shutdown::Both);
            continue;
        };
        let _ = client.set_nodelay(true);
        let _ = upstream.set_nodelay(true);
        if let Err(e) = spawn_pumps(shared, client, upstream) {
            eprintln!("mqtt proxy: cannot start pumps: {e}");
        }
    }
}

fn spawn_pumps(shared: &Arc<Shared>, client: TcpStream, upstream: TcpStream) -> io::Result<()> {
    let client_writer = Arc::new(Mutex::new(client.try_clone()?));
    let (c_read, u_write) = (client.try_clone()?, upstream.try_clone()?);
    let u_read = upstream.try_clone()?;
    let mut st = shared.lock();
    if st.shutdown {
        return Ok(());
    }
    let id = st.next_id;
    st.next_id += 1;
    st.conns.insert(
        id,
        Conn {
            client: client_writer.clone(),
            client_raw: client,
            upstream,
            level: 0,
            pubacks: 0,
            closed: false,
        },
    );
    let (s1, s2) = (shared.clone(), shared.clone());
    let up = thread::Builder::new()
        .name(format!("mqtt-proxy-{id}-up"))
        .spawn(move || pump_up(&s1, id, c_read, u_write))?;
    let down = thread::Builder::new()
        .name(format!("mqtt-proxy-{id}-down"))
        .spawn(move || pump_down(&s2, id, u_read, &client_writer))?;
    // Reap finished threads so a long test with many connections does not pile them up.
    let (done, running): (Vec<_>, Vec<_>) = st.threads.drain(..).partition(|t| t.is_finished());
    st.threads = running;
    st.threads.push(up);
    st.threads.push(down);
    drop(st);
    for t in done {
        let _ = t.join();
    }
    Ok(())
}

/// Splits a byte stream into MQTT packets.
#[derive(Default)]
struct Framer {
    buf: Vec<u8>,
}

impl Framer {
    fn push(&mut self, bytes: &[u8]) {
        self.buf.extend_from_slice(bytes);
    }

    /// The next whole packet, if one is buffered.
    fn next(&mut self) -> Option<Vec<u8>> {
        let mut len: usize = 0;
        let mut shift = 0;
        let mut i = 1;
        loop {
            let b = *self.buf.get(i)?;
            len |= usize::from(b & 0x7f) << shift;
            i += 1;
            if b & 0x80 == 0 {
                break;
            }
            shift += 7;
            if i > 4 {
                // Malformed: pass the rest through untouched.
                return Some(std::mem::take(&mut self.buf));
            }
        }
        let total = i + len;
        if self.buf.len() < total {
            return None;
        }
        let rest = self.buf.split_off(total);
        Some(std::mem::replace(&mut self.buf, rest))
    }
}

/// The variable header and payload of a packet: after the fixed header.
fn body(packet: &[u8]) -> &[u8] {
    let mut i = 1;
    while i < packet.len() && i <= 4 && packet[i] & 0x80 != 0 {
        i += 1;
    }
    packet.get(i + 1..).unwrap_or(&[])
}

fn u16_at(bytes: &[u8], at: usize) -> Option<u16> {
    Some(u16::from_be_bytes([*bytes.get(at)?, *bytes.get(at + 1)?]))
}

/// A variable byte integer at `at`: (value, bytes used).
fn varint_at(bytes: &[u8], at: usize) -> Option<(usize, usize)> {
    let mut value = 0usize;
    for k in 0..4 {
        let b = *bytes.get(at + k)?;
        value |= usize::from(b & 0x7f) << (7 * k);
        if b & 0x80 == 0 {
            return Some((value, k + 1));
        }
    }
    None
}

fn parse_publish(packet: &[u8], level: u8) -> Option<Publish> {
    let qos = (packet[0] >> 1) & 3;
    let b = body(packet);
    let topic_len = usize::from(u16_at(b, 0)?);
    let topic = String::from_utf8_lossy(b.get(2..2 + topic_len)?).into_owned();
    let mut at = 2 + topic_len;
    let pkid = if qos > 0 {
        let id = u16_at(b, at)?;
        at += 2;
        id
    } else {
        0
    };
    let (mut user_properties, mut content_type, mut payload_format) = (Vec::new(), None, None);
    if level == 5 {
        let (props, used) = varint_at(b, at)?;
        at += used;
        let mut p = b.get(at..at + props)?;
        at += props;
        while let Some((&id, rest)) = p.split_first() {
            p = rest;
            match id {
                0x01 => {
                    payload_format = Some(*p.first()?);
                    p = p.get(1..)?;
                }
                0x02 => p = p.get(4..)?,
                0x23 => p = p.get(2..)?,
                0x0B => p = p.get(varint_at(p, 0)?.1..)?,
                0x03 => content_type = Some(string_at(&mut p)?),
                0x08 | 0x09 => {
                    string_at(&mut p)?;
                }
                0x26 => {
                    let name = string_at(&mut p)?;
                    user_properties.push((name, string_at(&mut p)?));
                }
                _ => return None,
            }
        }
    }
    Some(Publish {
        topic,
        qos,
        retain: packet[0] & 1 == 1,
        pkid,
        payload: b.get(at..)?.to_vec(),
        user_properties,
        content_type,
        payload_format,
    })
}

/// A length-prefixed MQTT string at the front of `p`, taken off it.
fn string_at(p: &mut &[u8]) -> Option<String> {
    let len = usize::from(u16_at(p, 0)?);
    let s = String::from_utf8_lossy(p.get(2..2 + len)?).into_owned();
    *p = p.get(2 + len..)?;
    Some(s)
}

/// An MQTT 5 PUBACK for the same packet id with reason `code` and no properties.
fn with_reason(puback: &[u8], code: u8) -> Vec<u8> {
    let b = body(puback);
    let (hi, lo) = (b.first().copied().unwrap_or(0), b.get(1).copied().unwrap_or(0));
    vec![0x40, 3, hi, lo, code]
}

/// The same SUBACK with every reason code replaced by `code` (0x80 under 3.1.1).
fn refused_suback(suback: &[u8], level: u8, code: u8) -> Vec<u8> {
    let b = body(suback);
    let mut codes_at = 2;
    if level == 5 {
        let Some((props, used)) = varint_at(b, 2) else {
            return suback.to_vec();
        };
        codes_at += used + props;
    }
    let code = if level == 5 { code } else { 0x80 };
    let header_len = suback.len() - b.len();
    let mut out = suback.to_vec();
    for byte in out.iter_mut().skip(header_len + codes_at) {
        *byte = code;
    }
    out
}

/// An MQTT 5 CONNACK with the broker's flags and reason code, and a Receive Maximum of `max` as
/// its only property.
fn connack_with_receive_maximum(connack: &[u8], max: u16) -> Vec<u8> {
    let b = body(connack);
    let (flags, reason) = (b.first().copied().unwrap_or(0), b.get(1).copied().unwrap_or(0));
    let [hi, lo] = max.to_be_bytes();
    vec![0x20, 6, flags, reason, 3, 0x21, hi, lo]
}

fn protocol_level(connect: &[u8]) -> u8 {
    let b = body(connect);
    let name_len = u16_at(b, 0).map_or(0, usize::from);
    b.get(2 + name_len).copied().unwrap_or(4)
}

/// What happens to a packet from the client.
enum Up {
    Forward,
    Swallow,
    Close,
}

fn pump_up(shared: &Arc<Shared>, id: u64, mut from: TcpStream, mut to: TcpStream) {
    let mut framer = Framer::default();
    let mut buf = vec![0u8; 64 * 1024];
    loop {
        let n = match from.read(&mut buf) {
            Ok(0) | Err(_) => break,
            Ok(n) => n,
        };
        framer.push(&buf[..n]);
        while let Some(packet) = framer.next() {
            let kind = packet[0] >> 4;
            let action = {
                let mut st = shared.lock();
                st.bytes_to_broker += packet.len() as u64;
                let level = st.conns.get(&id).map_or(4, |c| c.level);
                match kind {
                    1 => {
                        let level = protocol_level(&packet);
                        if let Some(c) = st.conns.get_mut(&id) {
                            c.level = level;
                        }
                        match st.authenticator.clone() {
                            None => Up::Forward,
                            Some(check) => {
                                drop(st);
                                let verdict = check(&parse_connect(&packet).unwrap_or_default());
                                let mut st = shared.lock();
                                match verdict {
                                    Ok(expires) => {
                                        st.auth_accepted += 1;
                                        drop(st);
                                        if let Some(at) = expires {
                                            close_at_expiry(shared, id, at);
                                        }
                                        Up::Forward
                                    }
                                    Err(why) => {
                                        st.auth_refused.push(why);
                                        let client = st.conns.get(&id).map(|c| c.client.clone());
                                        drop(st);
                                        // CONNACK "not authorized": 3.1.1's return code 5, MQTT 5's 0x87.
                                        let connack: &[u8] = if level == 5 {
                                            &[0x20, 0x03, 0x00, 0x87, 0x00]
                                        } else {
                                            &[0x20, 0x02, 0x00, 0x05]
                                        };
                                        if let Some(client) = client {
                                            let _ = lock(&client).write_all(connack);
                                        }
                                        Up::Close
                                    }
                                }
                            }
                        }
                    }
                    3 => {
                        st.publishes += 1;
                        let (close_on, swallow) = (st.close_on.clone(), st.swallow.clone());
                        let recording = st.recording;
                        drop(st);
                        let publish = parse_publish(&packet, level);
                        if recording && let Some(p) = &publish {
                            shared.lock().recorded.push(p.clone());
                        }
                        let matches = |pred: Option<Predicate>| {
                            pred.is_some_and(|p| publish.as_ref().is_some_and(|x| p(x)))
                        };
                        let action = if matches(close_on) {
                            Up::Close
                        } else if matches(swallow) {
                            Up::Swallow
                        } else {
                            Up::Forward
                        };
                        let mut st = shared.lock();
                        match action {
                            Up::Close => st.closed_on_publish += 1,
                            Up::Swallow => st.swallowed += 1,
                            Up::Forward => {}
                        }
                        action
                    }
                    _ => Up::Forward,
                }
            };
            shared.changed.notify_all();
            match action {
                Up::Close => {
                    close_conn(shared, id);
                    return;
                }
                Up::Swallow => continue,
                Up::Forward => {}
            }
            if to.write_all(&packet).is_err() {
                close_conn(shared, id);
                return;
            }
        }
    }
    close_conn(shared, id);
}

fn pump_down(shared: &Arc<Shared>, id: u64, mut from: TcpStream, client: &Mutex<TcpStream>) {
    let mut framer = Framer::default();
    let mut buf = vec![0u8; 64 * 1024];
    loop {
        let n = match from.read(&mut buf) {
            Ok(0) | Err(_) => break,
            Ok(n) => n,
        };
        framer.push(&buf[..n]);
        while let Some(mut packet) = framer.next() {
            let kind = packet[0] >> 4;
            let (forward, fired) = {
                let mut st = shared.lock();
                let mut fired = None;
                let forward = match kind {
                    2 => {
                        let level = st.conns.get(&id).map_or(4, |c| c.level);
                        if level == 5
                            && let Some(max) = st.receive_maximum
                        {
                            packet = connack_with_receive_maximum(&packet, max);
                        }
                        st.connacks += 1;
                        fired = Some(Trigger::ConnAck);
                        true
                    }
                    9 => {
                        if let Some(code) = st.refuse_subscriptions {
                            let level = st.conns.get(&id).map_or(4, |c| c.level);
                            packet = refused_suback(&packet, level, code);
                        }
                        true
                    }
                    4 if st.drop_pubacks => {
                        st.pubacks_dropped += 1;
                        false
                    }
                    4 => {
                        // Rewritten before it is held, so it is released with its new reason.
                        let level = st.conns.get(&id).map_or(4, |c| c.level);
                        if level == 5
                            && let Some((n, code)) = st.rewrite
                        {
                            st.rewrite = (n > 1).then_some((n - 1, code));
                            packet = with_reason(&packet, code);
                        }
                        if st.hold_remaining > 0 {
                            st.hold_remaining -= 1;
                            st.held.push((id, packet.clone()));
                            fired = Some(Trigger::PubAckHeld);
                            false
                        } else {
                            st.pubacks_forwarded += 1;
                            if let Some(c) = st.conns.get_mut(&id) {
                                c.pubacks += 1;
                                fired = Some(Trigger::PubAcksForwarded(c.pubacks));
                            }
                            true
                        }
                    }
                    _ => true,
                };
                (forward, fired)
            };
            // Forward before a drop is scheduled, so a CONNACK reaches the client first.
            if forward && lock(client).write_all(&packet).is_err() {
                close_conn(shared, id);
                return;
            }
            shared.changed.notify_all();
            if let Some(event) = fired {
                schedule_drop(shared, id, event);
            }
        }
    }
    close_conn(shared, id);
}

/// The fields of a CONNECT that say who the client is (3.1.1 and 5).
fn parse_connect(packet: &[u8]) -> Option<Connect> {
    let b = body(packet);
    let name_len = usize::from(u16_at(b, 0)?);
    let mut at = 2 + name_len;
    let level = *b.get(at)?;
    let flags = *b.get(at + 1)?;
    at += 4;
    if level == 5 {
        let (len, used) = varint_at(b, at)?;
        at += used + len;
    }
    let string = |at: &mut usize| -> Option<Vec<u8>> {
        let len = usize::from(u16_at(b, *at)?);
        let bytes = b.get(*at + 2..*at + 2 + len)?.to_vec();
        *at += 2 + len;
        Some(bytes)
    };
    let client_id = String::from_utf8(string(&mut at)?).ok()?;
    if flags & 0x04 != 0 {
        if level == 5 {
            let (len, used) = varint_at(b, at)?;
            at += used + len;
        }
        string(&mut at)?;
        string(&mut at)?;
    }
    let username = match flags & 0x80 {
        0 => None,
        _ => Some(String::from_utf8(string(&mut at)?).ok()?),
    };
    let password = match flags & 0x40 {
        0 => None,
        _ => Some(string(&mut at)?),
    };
    Some(Connect {
        client_id,
        username,
        password,
    })
}

/// Closes connection `id` when its credential expires at `at`, counting it.
fn close_at_expiry(shared: &Arc<Shared>, id: u64, at: std::time::SystemTime) {
    let after = at
        .duration_since(std::time::SystemTime::now())
        .unwrap_or_default();
    close_later(shared, id, after, "expiry", |st| st.expired_closes += 1);
}

/// Closes connection `id` once `after` has passed, on a thread of its own (joined with the
/// proxy), and then calls `closed` if it was still open. Ends early when the connection is gone
/// or the proxy stops.
fn close_later(shared: &Arc<Shared>, id: u64, after: Duration, what: &str, closed: fn(&mut State)) {
    let s = shared.clone();
    let spawned = thread::Builder::new()
        .name(format!("mqtt-proxy-{id}-{what}"))
        .spawn(move || {
            let deadline = Instant::now() + after;
            let mut st = s.lock();
            while !st.shutdown && st.conns.contains_key(&id) {
                let left = deadline.saturating_duration_since(Instant::now());
                if left.is_zero() {
                    break;
                }
                st = s
                    .changed
                    .wait_timeout(st, left)
                    .unwrap_or_else(|e| e.into_inner())
                    .0;
            }
            if st
                .conns
                .get_mut(&id)
                .filter(|c| !c.closed)
                .map(Conn::close)
                .is_some()
            {
                closed(&mut st);
            }
            drop(st);
            s.changed.notify_all();
        });
    if let Ok(t) = spawned {
        shared.lock().threads.push(t);
    }
}

fn schedule_drop(shared: &Arc<Shared>, id: u64, event: Trigger) {
    let mut st = shared.lock();
    let Some((trigger, after, repeat)) = st.drop_rule else {
        return;
    };
    if trigger != event {
        return;
    }
    if repeat == Repeat::Once {
        st.drop_rule = None;
    }
    if after.is_zero() {
        if let Some(c) = st.conns.get_mut(&id) {
            c.close();
        }
        drop(st);
        shared.changed.notify_all();
        return;
    }
    drop(st);
    close_later(shared, id, after, "drop", |_| {});
}

fn close_conn(shared: &Shared, id: u64) {
    shared.update(|st| {
        if let Some(mut c) = st.conns.remove(&id) {
            c.close();
        }
    });
}
