//! The two rumqttc clients (MQTT 3.1.1 and 5) behind one small interface: build a fresh client
//! and connection for each connection attempt, publish, subscribe, acknowledge, disconnect.

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use bytes::Bytes;
use rumqttc::v5::mqttbytes::v5 as v5p;
use rumqttc::{QoS, TlsConfiguration, Transport};

use std::path::PathBuf;

use super::config::{MqttConfig, Protocol, read_password};
use super::event::{self, Cause, CauseKind, Delivery, RawPublish, Step};
use super::sas::SasKey;
use super::tls::TlsConfig;
use crate::error::{Error, Result};

/// rumqttc's MQTT 5 client asserts a keep-alive of at least 5 s.
const V5_MIN_KEEP_ALIVE: Duration = Duration::from_secs(5);

/// What a session is for: the options differ.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Role {
    /// The relay's publishing session: clean, the status topic's last will, at most this many
    /// publishes in flight.
    Publisher { max_in_flight: u16 },
    /// The command session: persistent, manual acks, incoming packets up to `read_limit` (the
    /// inbox dead-letters what is above its own, smaller, limit, so an oversized command never
    /// wedges the session). [`subscribe`](super::subscribe) uses it too, `persistent` or not.
    Commands { read_limit: usize, persistent: bool },
    /// Both in one session (single-session mode): the publisher's window and last will, and
    /// the command session's persistence, manual acks and read limit.
    Device { max_in_flight: u16, read_limit: usize },
}

impl Role {
    /// Whether the session starts clean (the broker keeps nothing for it between connections).
    fn clean(self) -> bool {
        match self {
            Role::Publisher { .. } => true,
            Role::Commands { persistent, .. } => !persistent,
            // (The mutant forgets the session between connections: commands sent while the
            // device is offline are lost.)
            Role::Device { .. } => crate::mutant::active("single-session-clean"),
        }
    }

    /// The publishing window, for a session that publishes the outbox.
    fn window(self) -> Option<u16> {
        match self {
            Role::Publisher { max_in_flight } | Role::Device { max_in_flight, .. } => {
                Some(max_in_flight.max(1))
            }
            Role::Commands { .. } => None,
        }
    }

    /// The largest packet read, for a session that receives commands (with manual acks).
    fn reads(self) -> Option<usize> {
        match self {
            Role::Commands { read_limit, .. } | Role::Device { read_limit, .. } => Some(read_limit),
            Role::Publisher { .. } => None,
        }
    }
}

/// A new client and connection, and what its credentials allow.
pub(crate) struct Opened {
    pub client: MqttClient,
    pub connection: Connection,
    /// When to replace the connection, its token about to expire.
    pub renew: Option<Instant>,
    /// When its token expires.
    pub expires: Option<SystemTime>,
}

/// Validated rumqttc options for one session, cloned into a new client for each connection.
#[derive(Clone)]
pub(crate) struct SessionOptions {
    protocol: Protocol,
    /// One per broker, in the order they are tried.
    options: Vec<Options>,
    endpoints: Vec<String>,
    request_capacity: usize,
    connect_secs: u64,
    /// The command session: TCP_NODELAY for its acks.
    commands: bool,
    /// Credentials made for each connection (Azure IoT Hub's SAS tokens), with the client id
    /// and the host (the first broker's) they are signed for.
    sas: Option<(SasKey, String, String)>,
    /// TLS settings, made into a rustls configuration again for every connection: certificate,
    /// key and CA files are read each time, so a rotation takes effect at the next connection.
    tls: Option<TlsConfig>,
    /// The username, and the file its password is read from at every connection.
    password_file: Option<(String, PathBuf)>,
    /// When a client certificate given as text expires (one from a file is read at each
    /// connection).
    cert_expiry: Option<SystemTime>,
    /// MQTT over WebSockets.
    websocket: bool,
}

#[derive(Clone)]
enum Options {
    V4(Box<rumqttc::MqttOptions>),
    V5(Box<rumqttc::v5::MqttOptions>),
}

impl SessionOptions {
    /// Checks `config` (rumqttc asserts instead of returning errors, so everything it would assert
    /// on is checked here first) and builds the options for `client_id` in `role`.
    pub(crate) fn new(config: &MqttConfig, client_id: &str, role: Role) -> Result<Self> {
        config.validate(client_id)?;
        let keep_alive = config.keep_alive_value();
        let websocket = config.websocket_path().is_some();
        let transport = match config.tls_value() {
            Some(tls) => Some(secure_transport(websocket, tls.client_config()?)),
            None => plain_transport(websocket),
        };
        let connect_secs = config.connect_timeout_value().as_secs().max(1);
        // Room for the whole window plus the status message and a disconnect, so a non-blocking
        // publish never fails for lack of room while the connection is up. And room for an ack
        // per delivery the broker can have unacknowledged on one connection (packet ids are 16
        // bits): rumqttc sends one queued request per turn of its loop but reads up to ten
        // packets in one, so acks queue up while a backlog streams in, and a full channel would
        // force a reconnect (and the broker to start over).
        let request_capacity =
            usize::from(role.window().unwrap_or(0)) + role.reads().map_or(0, |_| usize::from(u16::MAX)) + 16;
        let mut all = Vec::new();
        for (host, port) in config.brokers() {
            let options = match config.version() {
                Protocol::V311 => {
                    // Over WebSockets rumqttc takes the whole URL as the host.
                    let url = config.websocket_url(host, port);
                    let mut o = rumqttc::MqttOptions::new(client_id, url.as_deref().unwrap_or(host), port);
                    o.set_keep_alive(keep_alive).set_clean_session(role.clean());
                    if let Some((user, password)) = config.credentials_value() {
                        o.set_credentials(user, password);
                    }
                    if let Some(t) = transport.clone() {
                        o.set_transport(t);
                    }
                    #[cfg(feature = "http-proxy")]
                    if let Some(proxy) = config
                        .proxy_for(host)
                        .filter(|_| !crate::mutant::active("proxy-ignored"))
                    {
                        o.set_proxy(proxy.rumqttc());
                    }
                    // Incoming: the command read limit where commands arrive, else our own
                    // limit (the broker only sends acknowledgements).
                    o.set_max_packet_size(
                        role.reads().unwrap_or(config.packet_limit()),
                        config.packet_limit(),
                    )
                    .set_manual_acks(role.reads().is_some());
                    if let Some(window) = role.window() {
                        o.set_inflight(window);
                        if let Some(topic) = config.status() {
                            o.set_last_will(rumqttc::LastWill::new(topic, "offline", QoS::AtLeastOnce, true));
                        }
                    }
                    Options::V4(Box::new(o))
                }
                Protocol::V5 => {
                    if keep_alive.is_zero() {
                        return Err(Error::InvalidConfig(
                            "keep_alive 0 (disabled) is not available with MQTT 5 (rumqttc's client \
                             needs at least 5 s): set a keep-alive, or use MQTT 3.1.1"
                                .into(),
                        ));
                    }
                    let url = config.websocket_url(host, port);
                    let mut o =
                        rumqttc::v5::MqttOptions::new(client_id, url.as_deref().unwrap_or(host), port);
                    if keep_alive < V5_MIN_KEEP_ALIVE {
                        tracing::warn!(
                            ?keep_alive,
                            "keep-alive raised to 5 s: rumqttc's MQTT 5 client takes no less"
                        );
                    }
                    o.set_keep_alive(keep_alive.max(V5_MIN_KEEP_ALIVE))
                        .set_clean_start(role.clean())
                        .set_connection_timeout(connect_secs);
                    if let Some((user, password)) = config.credentials_value() {
                        o.set_credentials(user, password);
                    }
                    if let Some(t) = transport.clone() {
                        o.set_transport(t);
                    }
                    #[cfg(feature = "http-proxy")]
                    if let Some(proxy) = config
                        .proxy_for(host)
                        .filter(|_| !crate::mutant::active("proxy-ignored"))
                    {
                        o.set_proxy(proxy.rumqttc());
                    }
                    o.set_max_packet_size(Some(packet_u32(role.reads().unwrap_or(config.packet_limit()))))
                        .set_manual_acks(role.reads().is_some());
                    if let Some(window) = role.window() {
                        // rumqttc's in-flight cap; the broker's receive maximum lowers it.
                        o.set_outgoing_inflight_upper_limit(window);
                        if let Some(topic) = config.status() {
                            o.set_last_will(v5p::LastWill::new(
                                topic,
                                "offline",
                                v5_qos(QoS::AtLeastOnce),
                                true,
                                None,
                            ));
                        }
                    }
                    // A persistent session under MQTT 5 needs an expiry: without one it ends with
                    // the connection and the broker keeps nothing while we are offline. u32::MAX:
                    // never expires, as a 3.1.1 persistent session.
                    if !role.clean() {
                        o.set_session_expiry_interval(Some(u32::MAX));
                    }
                    if role.reads().is_some() {
                        let mut net = o.network_options();
                        net.set_tcp_nodelay(true);
                        o.set_network_options(net);
                    }
                    Options::V5(Box::new(o))
                }
            };
            all.push(options);
        }
        Ok(SessionOptions {
            protocol: config.version(),
            options: all,
            endpoints: config.endpoints(),
            request_capacity,
            connect_secs,
            commands: role.reads().is_some(),
            // Settings given as text are built once, above: only files can change.
            tls: config
                .tls_value()
                .filter(|tls| tls.reads_files())
                .map(std::borrow::Cow::into_owned),
            cert_expiry: config.tls_value().and_then(|tls| tls.client_cert_expiry()),
            websocket,
            password_file: config
                .password_file()
                .zip(config.username())
                .map(|(path, user)| (user.to_owned(), path.to_path_buf())),
            // Every broker of a failover list gets tokens for the first one's host (the hub's
            // name), unless the key names the hub: an address or another name would be refused.
            sas: config
                .sas()
                .map(|key| (key.clone(), client_id.to_owned(), config.host().to_owned())),
        })
    }

    pub(crate) fn protocol(&self) -> Protocol {
        self.protocol
    }

    /// The keep-alive rumqttc will use (before a broker's server keep-alive overrides it).
    pub(crate) fn keep_alive(&self) -> Duration {
        match self.options.first() {
            Some(Options::V4(o)) => o.keep_alive(),
            Some(Options::V5(o)) => o.keep_alive(),
            None => Duration::ZERO,
        }
    }

    /// How many brokers there are to try.
    pub(crate) fn brokers(&self) -> usize {
        self.options.len()
    }

    /// `host:port` of broker `at` (wrapping around the list).
    pub(crate) fn endpoint(&self, at: usize) -> &str {
        self.endpoints
            .get(at % self.endpoints.len().max(1))
            .map_or("", String::as_str)
    }

    /// A new client and connection: nothing of an earlier connection's state survives, in
    /// particular not a packet-id collision (rumqttc keeps it across reconnects, which stops
    /// publishing for good: docs/reliability.md, "The collision wedge").
    /// `at` picks the broker (wrapping around the list). With a SAS key, the connection gets a
    /// new token, and the instant by which it must be replaced comes with it.
    /// A file that cannot be read now (or no longer parses) fails this attempt, with its cause,
    /// as a connection that failed: the next attempt reads it again.
    pub(crate) fn open(&self, at: usize) -> std::result::Result<Opened, Cause> {
        // `new` built one set of options per broker, and a config has at least one.
        let at = at % self.options.len().max(1);
        let mut options = self.options[at].clone();
        let cannot = |e: Error| Cause::new(CauseKind::Connect, e.to_string());
        if let Some(tls) = &self.tls {
            options.set_transport(secure_transport(
                self.websocket,
                tls.client_config().map_err(cannot)?,
            ));
        }
        if let Some((user, path)) = &self.password_file
            && !crate::mutant::active("credential-files-read-once")
        {
            options.set_credentials(user, read_password(path).map_err(cannot)?);
        }
        let mut renew = None;
        let mut expires = None;
        if let Some((key, client_id, host)) = &self.sas {
            let now = SystemTime::now();
            let signed = key.sign(host, client_id, now);
            expires = Some(signed.expires);
            if !crate::mutant::active("sas-not-renewed") {
                renew = Some(Instant::now() + signed.renew.duration_since(now).unwrap_or_default());
            }
            let password = match crate::mutant::active("sas-not-renewed") {
                // The token the first connection got, for every connection after it.
                true => first_token(&signed.password),
                false => signed.password,
            };
            options.set_credentials(signed.username, password);
        }
        if expires.is_none() {
            expires = match &self.tls {
                Some(tls) => tls.client_cert_expiry(),
                None => self.cert_expiry,
            };
            warn_if_expiring(expires);
        }
        let (client, connection) = match options {
            Options::V4(o) => {
                let (client, mut connection) = rumqttc::Client::new(*o, self.request_capacity);
                // 3.1.1 keeps the connect timeout with the event loop, not the options.
                let mut net = connection.eventloop.network_options();
                net.set_connection_timeout(self.connect_secs);
                // Acks are tiny and each one lets the broker send the next command: Nagle would
                // hold them back waiting for the broker's TCP ack, stalling a backlog.
                net.set_tcp_nodelay(self.commands);
                connection.eventloop.set_network_options(net);
                (Inner::V4(client), Connection::V4(Box::new(connection)))
            }
            Options::V5(o) => {
                let (client, connection) = rumqttc::v5::Client::new(*o, self.request_capacity);
                (Inner::V5(client), Connection::V5(Box::new(connection)))
            }
        };
        let client = MqttClient {
            inner: client,
            queued: QueuedPublishes::default(),
        };
        Ok(Opened {
            client,
            connection,
            renew,
            expires,
        })
    }
}

/// TLS, directly or under WebSockets (`wss`).
fn secure_transport(websocket: bool, config: std::sync::Arc<rustls::ClientConfig>) -> Transport {
    let tls = TlsConfiguration::Rustls(config);
    #[cfg(feature = "websocket")]
    if websocket {
        return Transport::Wss(tls);
    }
    let _ = websocket;
    Transport::tls_with_config(tls)
}

/// Plain TCP (rumqttc's default, `None`), or WebSockets (`ws`).
fn plain_transport(websocket: bool) -> Option<Transport> {
    #[cfg(feature = "websocket")]
    if websocket {
        return Some(Transport::Ws);
    }
    let _ = websocket;
    None
}

/// How long before a client certificate's expiry each connection warns about it.
const CERT_WARNING: Duration = Duration::from_secs(14 * 86_400);

/// A WARN line at each connection while the client certificate is within [`CERT_WARNING`] of its
/// expiry, or past it (the broker then refuses the handshake): rotate the files, no restart needed.
fn warn_if_expiring(expires: Option<SystemTime>) {
    let Some(expires) = expires else { return };
    let unix_s = expires.duration_since(UNIX_EPOCH).map_or(0, |d| d.as_secs());
    match expires.duration_since(SystemTime::now()) {
        Err(_) => tracing::warn!(
            expired_at_unix_s = unix_s,
            "the client certificate has expired: replace its files (read again at every connection)"
        ),
        Ok(left) if left < CERT_WARNING => tracing::warn!(
            expires_at_unix_s = unix_s,
            days_left = left.as_secs() / 86_400,
            "the client certificate expires soon: replace its files (read again at every connection)"
        ),
        Ok(_) => {}
    }
}

impl Options {
    /// What a connection made now needs that `SessionOptions::new` could not fix for good.
    fn set_transport(&mut self, transport: Transport) {
        match self {
            Options::V4(o) => {
                o.set_transport(transport);
            }
            Options::V5(o) => {
                o.set_transport(transport);
            }
        }
    }

    fn set_credentials(&mut self, username: impl Into<String>, password: impl Into<String>) {
        match self {
            Options::V4(o) => {
                o.set_credentials(username, password);
            }
            Options::V5(o) => {
                o.set_credentials(username, password);
            }
        }
    }
}

/// Mutant `sas-not-renewed`: the first token made in this process, kept for good.
fn first_token(token: &str) -> String {
    static FIRST: std::sync::OnceLock<String> = std::sync::OnceLock::new();
    FIRST.get_or_init(|| token.to_owned()).clone()
}

fn v5_qos(qos: QoS) -> rumqttc::v5::mqttbytes::QoS {
    match qos {
        QoS::AtMostOnce => rumqttc::v5::mqttbytes::QoS::AtMostOnce,
        QoS::AtLeastOnce => rumqttc::v5::mqttbytes::QoS::AtLeastOnce,
        QoS::ExactlyOnce => rumqttc::v5::mqttbytes::QoS::ExactlyOnce,
    }
}

fn packet_u32(bytes: usize) -> u32 {
    u32::try_from(bytes).unwrap_or(u32::MAX)
}

/// A handle on one connection's request channel. Every method is non-blocking: the driver
/// thread uses it too, and a blocking call there deadlocks when the channel is full.
#[derive(Clone)]
pub(crate) struct MqttClient {
    inner: Inner,
    /// Publishes queued and not yet taken by the event loop: see [`QueuedPublishes`].
    queued: QueuedPublishes,
}

#[derive(Clone)]
enum Inner {
    V4(rumqttc::Client),
    V5(rumqttc::v5::Client),
}

impl std::fmt::Debug for MqttClient {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self.inner {
            Inner::V4(_) => "MqttClient(3.1.1)",
            Inner::V5(_) => "MqttClient(5)",
        })
    }
}

/// How many publishes one client queued that its event loop has not taken yet. Each one queued
/// comes out of the event loop as an outgoing `Published` (or `AwaitAck`, when its packet id is
/// still in use) or the connection fails; whoever reads those events calls
/// [`QueuedPublishes::taken`]. While some are queued, the event loop writes the next without
/// waiting for the network (unless the broker's receive maximum is on the wire: then for a
/// PUBACK), so the connection thread can hold what it forwards a moment longer.
#[derive(Clone, Debug, Default)]
pub(crate) struct QueuedPublishes(Arc<AtomicUsize>);

impl QueuedPublishes {
    /// One more is queued.
    pub(crate) fn queued(&self) {
        self.0.fetch_add(1, Ordering::AcqRel);
    }

    /// The event loop took one (never below zero).
    pub(crate) fn taken(&self) {
        let _ = self
            .0
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |n| n.checked_sub(1));
    }

    pub(crate) fn any(&self) -> bool {
        self.0.load(Ordering::Acquire) > 0
    }
}

/// A request could not be queued: the connection is gone or its channel is full.
#[derive(Debug)]
pub(crate) struct NotQueued;

/// A publish's MQTT 5 properties beyond QoS and retain.
#[derive(Debug, Default, Clone, Copy)]
pub(crate) struct Extra<'a> {
    /// A topic alias: with `Some((n, false))` the topic is sent and alias `n` bound to it, with
    /// `Some((n, true))` only the alias is sent (the broker already knows it on this
    /// connection).
    pub alias: Option<(u16, bool)>,
    /// The message expiry interval, in seconds.
    pub expiry: Option<u32>,
    /// Routing fields: user properties and the content type.
    pub routing: Option<&'a crate::routing_fields::Routing>,
    /// The payload is a JSON envelope: say so (Content Type `application/json`, payload format
    /// indicator UTF-8), so that a broker that forwards JSON as JSON (Event Grid) does.
    pub json: bool,
}

impl Extra<'_> {
    fn is_empty(&self) -> bool {
        self.alias.is_none() && self.expiry.is_none() && self.routing.is_none() && !self.json
    }
}

impl MqttClient {
    /// Queues a publish, with the MQTT 5 properties in `extra` (all ignored under 3.1.1, which
    /// has none).
    pub(crate) fn try_publish(
        &self,
        topic: &str,
        qos: QoS,
        retain: bool,
        payload: impl Into<Bytes>,
        extra: Extra<'_>,
    ) -> Result<(), NotQueued> {
        // Counted before it is queued, so the event loop never takes one not counted yet.
        self.queued.queued();
        let queued = match &self.inner {
            Inner::V4(c) => c.try_publish(topic, qos, retain, payload.into()).is_ok(),
            Inner::V5(c) if extra.is_empty() => {
                c.try_publish(topic, v5_qos(qos), retain, payload.into()).is_ok()
            }
            Inner::V5(c) => {
                let (user_properties, content_type) = match extra.routing {
                    Some(r) => (
                        r.pairs
                            .iter()
                            .map(|(k, v)| ((*k).to_owned(), v.clone()))
                            .collect(),
                        Some(r.content_type.to_owned()),
                    ),
                    None => (Vec::new(), None),
                };
                let content_type = content_type.or_else(|| extra.json.then(|| "application/json".to_owned()));
                let properties = v5p::PublishProperties {
                    payload_format_indicator: extra.json.then_some(1),
                    topic_alias: extra.alias.map(|(n, _)| n),
                    message_expiry_interval: extra.expiry,
                    user_properties,
                    content_type,
                    ..Default::default()
                };
                let topic = match extra.alias {
                    Some((_, true)) => "",
                    _ => topic,
                };
                c.try_publish_with_properties(topic, v5_qos(qos), retain, payload.into(), properties)
                    .is_ok()
            }
        };
        if queued {
            Ok(())
        } else {
            self.queued.taken();
            Err(NotQueued)
        }
    }

    /// The count of this client's publishes not yet taken by its event loop.
    pub(crate) fn queued_publishes(&self) -> QueuedPublishes {
        self.queued.clone()
    }

    /// Queues a QoS 1 subscription.
    pub(crate) fn try_subscribe(&self, filter: &str) -> Result<(), NotQueued> {
        match &self.inner {
            Inner::V4(c) => c.try_subscribe(filter, QoS::AtLeastOnce).map_err(|_| NotQueued),
            Inner::V5(c) => c
                .try_subscribe(filter, v5_qos(QoS::AtLeastOnce))
                .map_err(|_| NotQueued),
        }
    }

    /// Queues the acknowledgement of a delivery (manual acks).
    pub(crate) fn try_ack(&self, delivery: &Delivery) -> Result<(), NotQueued> {
        match (&self.inner, &delivery.raw) {
            (Inner::V4(c), RawPublish::V4(p)) => c.try_ack(p).map_err(|_| NotQueued),
            (Inner::V5(c), RawPublish::V5(p)) => c.try_ack(p).map_err(|_| NotQueued),
            // A delivery from a connection of the other protocol cannot be acknowledged here.
            _ => Err(NotQueued),
        }
    }

    /// Queues a DISCONNECT.
    pub(crate) fn try_disconnect(&self) -> Result<(), NotQueued> {
        match &self.inner {
            Inner::V4(c) => c.try_disconnect().map_err(|_| NotQueued),
            Inner::V5(c) => c.try_disconnect().map_err(|_| NotQueued),
        }
    }
}

/// One connection's event loop (rumqttc's `Connection`).
pub(crate) enum Connection {
    V4(Box<rumqttc::Connection>),
    V5(Box<rumqttc::v5::Connection>),
}

/// What waiting for the next step gave.
pub(crate) enum Recv {
    Step(Step),
    Failed(Cause),
    /// Nothing within the timeout.
    Idle,
    /// Every client handle was dropped.
    Closed,
}

impl Connection {
    /// The next step, blocking; with a `timeout`, at most that long (only once connected: a
    /// timeout abandons whatever rumqttc was doing, which during a connect is the connect).
    /// `connected`: a CONNACK was seen (it shapes error descriptions).
    pub(crate) fn recv(&mut self, connected: bool, timeout: Option<Duration>) -> Recv {
        match self {
            Connection::V4(c) => {
                let got = match timeout {
                    None => c.recv().map_err(|_| true),
                    Some(t) => c
                        .recv_timeout(t)
                        .map_err(|e| e == rumqttc::RecvTimeoutError::Disconnected),
                };
                match got {
                    Ok(Ok(e)) => {
                        tracing::trace!(event = ?e, "mqtt event");
                        Recv::Step(event::from_v4(e))
                    }
                    Ok(Err(e)) => Recv::Failed(event::cause_v4(&e, connected)),
                    Err(true) => Recv::Closed,
                    Err(false) => Recv::Idle,
                }
            }
            Connection::V5(c) => {
                let got = match timeout {
                    None => c.recv().map_err(|_| true),
                    Some(t) => c
                        .recv_timeout(t)
                        .map_err(|e| e == rumqttc::v5::RecvTimeoutError::Disconnected),
                };
                match got {
                    Ok(Ok(e)) => {
                        // One per rumqttc event, on the connection's thread (the relay bench
                        // timestamps PUBACKs with it).
                        tracing::trace!(event = ?e, "mqtt event");
                        Recv::Step(event::from_v5(e))
                    }
                    Ok(Err(e)) => Recv::Failed(event::cause_v5(&e, connected)),
                    Err(true) => Recv::Closed,
                    Err(false) => Recv::Idle,
                }
            }
        }
    }

    /// Whether rumqttc holds events it has read and not handed out yet: the rest of one network
    /// read (it decodes every packet a read brought, up to a bound, before handing out the first).
    pub(crate) fn has_buffered(&self) -> bool {
        match self {
            Connection::V4(c) => !c.eventloop.state.events.is_empty(),
            Connection::V5(c) => !c.eventloop.state.events.is_empty(),
        }
    }

    /// Events rumqttc read before the connection failed and has not handed out yet (it keeps
    /// them in `state.events` and would deliver them after the next CONNACK). They belong to the
    /// connection that just ended.
    pub(crate) fn take_buffered(&mut self) -> Vec<Step> {
        match self {
            Connection::V4(c) => c.eventloop.state.events.drain(..).map(event::from_v4).collect(),
            Connection::V5(c) => c.eventloop.state.events.drain(..).map(event::from_v5).collect(),
        }
    }
}
