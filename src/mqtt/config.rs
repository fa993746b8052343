//! Broker connection settings: where, who, which protocol, and the limits the sessions honour.

use std::fmt;
use std::time::Duration;

use super::sas::SasKey;
use super::tls::TlsConfig;
use crate::error::{Error, Result};

/// The MQTT protocol version a session speaks.
///
/// MQTT 5 is the default: its PUBACK carries a reason code, so a broker can refuse a message (an
/// ACL, a size limit, a quota) and the relay moves it to the dead letters instead of deleting it.
/// Under MQTT 3.1.1 a broker cannot refuse a QoS 1 publish: mosquitto, for one, acknowledges a
/// publish its ACL denies or that is above `message_size_limit`, and drops it. The relay then
/// deletes the row and the message is lost, silently. Use 3.1.1 only for brokers that do not
/// speak 5 (RabbitMQ's MQTT plugin before 3.13, for one), and see docs/reliability.md for the
/// broker settings that keep it safe.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
#[non_exhaustive]
pub enum Protocol {
    /// MQTT 5.0 (default).
    #[default]
    V5,
    /// MQTT 3.1.1, for brokers that do not speak 5.
    V311,
}

impl Protocol {
    /// `"5"` or `"3.1.1"`, as the CLI's `--mqtt-version` takes it.
    pub fn as_str(self) -> &'static str {
        match self {
            Protocol::V5 => "5",
            Protocol::V311 => "3.1.1",
        }
    }
}

impl fmt::Display for Protocol {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "MQTT {}", self.as_str())
    }
}

impl std::str::FromStr for Protocol {
    type Err = Error;

    fn from_str(s: &str) -> Result<Self> {
        match s {
            "5" | "5.0" => Ok(Protocol::V5),
            "3.1.1" | "311" => Ok(Protocol::V311),
            other => Err(Error::InvalidConfig(format!(
                "MQTT version {other:?}: expected 5 or 3.1.1"
            ))),
        }
    }
}

/// Where and how to connect to the broker.
///
/// | setting | default |
/// |---|---|
/// | [`client_id`](Self::client_id) | `edge-outbox` |
/// | [`protocol`](Self::protocol) | [`Protocol::V5`] |
/// | [`keep_alive`](Self::keep_alive) | 30 s |
/// | [`connect_timeout`](Self::connect_timeout) | 10 s |
/// | [`max_packet_size`](Self::max_packet_size) | 256 KiB |
/// | [`credentials`](Self::credentials) | none |
/// | [`azure_sas`](Self::azure_sas) | none |
/// | [`tls`](Self::tls) | none: plain TCP |
/// | [`status_topic`](Self::status_topic) | none |
/// | [`topic_aliases`](Self::topic_aliases) | off |
/// | [`message_expiry`](Self::message_expiry) | on |
/// | [`failover`](Self::failover) | none: one broker |
/// | [`http_proxy`](Self::http_proxy) (feature `http-proxy`) | none: direct |
///
/// `Debug` never shows the password.
///
/// ```
/// use edge_outbox::MqttConfig;
/// let config = MqttConfig::new("broker.example", 8883)
///     .client_id("pump-17")
///     .credentials("pump-17", "secret")
///     .status_topic("devices/pump-17/status");
/// assert_eq!(config.port(), 8883);
/// assert!(!format!("{config:?}").contains("secret"));
/// ```
#[derive(Clone, PartialEq, Eq)]
#[must_use = "a builder: use the value it returns"]
pub struct MqttConfig {
    host: String,
    port: u16,
    client_id: String,
    protocol: Protocol,
    keep_alive: Duration,
    connect_timeout: Duration,
    max_packet_size: usize,
    credentials: Option<(String, String)>,
    /// Where the password comes from, read again at every connection (`credentials` holds what
    /// it said when the setting was made).
    password_file: Option<std::path::PathBuf>,
    tls: Option<TlsConfig>,
    status_topic: Option<String>,
    topic_aliases: bool,
    message_expiry: bool,
    /// More brokers, tried in turn after this one (`host`, `port`).
    failover: Vec<(String, u16)>,
    #[cfg(feature = "http-proxy")]
    proxy: Option<super::proxy::HttpProxy>,
    sas: Option<SasKey>,
    /// The cloud profile whose settings were applied (see [`MqttConfig::cloud`]).
    cloud: Option<crate::CloudProfile>,
    /// MQTT over WebSockets, on this URL path (see [`MqttConfig::websocket`]).
    websocket: Option<String>,
}

impl fmt::Debug for MqttConfig {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let mut f = f.debug_struct("MqttConfig");
        f.field("host", &self.host)
            .field("port", &self.port)
            .field("client_id", &self.client_id)
            .field("protocol", &self.protocol)
            .field("keep_alive", &self.keep_alive)
            .field("connect_timeout", &self.connect_timeout)
            .field("max_packet_size", &self.max_packet_size)
            // The username is not secret; the password is never shown.
            .field("username", &self.credentials.as_ref().map(|(user, _)| user))
            .field("password_file", &self.password_file)
            .field("tls", &self.tls_value())
            .field("status_topic", &self.status_topic)
            .field("topic_aliases", &self.topic_aliases)
            .field("message_expiry", &self.message_expiry)
            .field("failover", &self.failover)
            .field("sas", &self.sas)
            .field("cloud", &self.cloud)
            .field("websocket", &self.websocket);
        #[cfg(feature = "http-proxy")]
        f.field("proxy", &self.proxy);
        f.finish()
    }
}

// Here rather than in `crate::cloud_profile`, which stays a leaf that the store can use.
impl crate::CloudProfile {
    /// The MQTT version the profile connects with.
    pub fn protocol(self) -> Protocol {
        match self {
            crate::CloudProfile::AzureIotHub => Protocol::V311,
            crate::CloudProfile::AwsIotCore | crate::CloudProfile::AzureEventGrid => Protocol::V5,
        }
    }
}

/// MQTT's largest packet: a remaining length of at most 268,435,455 bytes plus 5 header bytes.
pub(crate) const PROTOCOL_MAX_PACKET: usize = 268_435_460;

impl MqttConfig {
    /// A broker at `host:port`, plain TCP, with the defaults above.
    pub fn new(host: impl Into<String>, port: u16) -> Self {
        MqttConfig {
            host: host.into(),
            port,
            client_id: "edge-outbox".into(),
            protocol: Protocol::V5,
            keep_alive: Duration::from_secs(30),
            connect_timeout: Duration::from_secs(10),
            max_packet_size: 256 * 1024,
            credentials: None,
            password_file: None,
            tls: None,
            status_topic: None,
            topic_aliases: false,
            message_expiry: true,
            failover: Vec::new(),
            #[cfg(feature = "http-proxy")]
            proxy: None,
            sas: None,
            cloud: None,
            websocket: None,
        }
    }

    /// Applies `profile`'s connection settings: its MQTT version, its message size limit as
    /// [`max_packet_size`](Self::max_packet_size), and for AWS IoT Core on port 443 with TLS and
    /// no ALPN of its own, the ALPN protocol `x-amzn-mqtt-ca` that port needs (offered whenever
    /// TLS is set, before or after this). Each is an ordinary setting: a later call replaces it.
    /// [`RelayConfig::cloud`](crate::RelayConfig::cloud) applies this too, unless it was applied
    /// already (so overrides made after it here are kept).
    ///
    /// ```
    /// use edge_outbox::{CloudProfile, MqttConfig, Protocol};
    /// let c = MqttConfig::new("my-hub.azure-devices.net", 8883).cloud(CloudProfile::AzureIotHub);
    /// assert_eq!((c.version(), c.packet_limit()), (Protocol::V311, 256 * 1024));
    /// ```
    pub fn cloud(mut self, profile: crate::CloudProfile) -> Self {
        self.protocol = profile.protocol();
        self.max_packet_size = profile.max_message_bytes();
        self.cloud = Some(profile);
        self
    }

    /// MQTT over WebSockets (subprotocol `mqtt`) to the broker's endpoint at `path` (commonly
    /// `/mqtt`; Azure IoT Hub's is `/$iothub/websocket`), for networks open to HTTP(S) only: a
    /// `ws://` URL, or `wss://` with [`tls`](Self::tls) set (`from_url` does both from the
    /// scheme). An [`http_proxy`](Self::http_proxy) carries it too. Feature `websocket`.
    ///
    /// ```
    /// let c = edge_outbox::MqttConfig::from_url("wss://my-hub.azure-devices.net/$iothub/websocket")?;
    /// assert_eq!((c.port(), c.websocket_path()), (443, Some("/$iothub/websocket")));
    /// # Ok::<(), edge_outbox::Error>(())
    /// ```
    #[cfg(feature = "websocket")]
    pub fn websocket(mut self, path: impl Into<String>) -> Self {
        self.websocket = Some(path.into());
        self
    }

    /// The WebSocket endpoint's path, when the broker is reached over WebSockets.
    pub fn websocket_path(&self) -> Option<&str> {
        self.websocket.as_deref()
    }

    /// The URL rumqttc connects to over WebSockets for the broker at `host:port`.
    pub(crate) fn websocket_url(&self, host: &str, port: u16) -> Option<String> {
        let scheme = if self.tls.is_some() { "wss" } else { "ws" };
        self.websocket
            .as_deref()
            .map(|path| format!("{scheme}://{}{path}", endpoint(host, port)))
    }

    /// The cloud profile applied with [`cloud`](Self::cloud), if any.
    pub fn cloud_profile(&self) -> Option<crate::CloudProfile> {
        self.cloud
    }

    /// Parses `mqtt://[user[:password]@]host[:port]` (plain TCP, default port 1883) or
    /// `mqtts://...` (TLS, default port 8883, the system's CAs unless [`MqttConfig::tls`] says
    /// otherwise). A username and password in the URL become the [credentials](Self::credentials)
    /// (percent-encoded characters such as `%40` for `@` are decoded). Errors never repeat the
    /// password.
    ///
    /// ```
    /// use edge_outbox::MqttConfig;
    /// let c = MqttConfig::from_url("mqtts://pump-17:s3cret@broker.example")?;
    /// assert_eq!((c.host(), c.port(), c.username()), ("broker.example", 8883, Some("pump-17")));
    /// # Ok::<(), edge_outbox::Error>(())
    /// ```
    pub fn from_url(url: &str) -> Result<Self> {
        let shown = redact_url(url);
        let bad = |why: &str| Error::InvalidConfig(format!("broker URL {shown:?}: {why}"));
        let (scheme, rest) = url
            .split_once("://")
            .ok_or_else(|| bad("expected mqtt://host:port or mqtts://host:port"))?;
        let (default_port, tls, websocket) = match scheme {
            "mqtt" | "tcp" => (1883, false, false),
            "mqtts" | "ssl" => (8883, true, false),
            "ws" => (80, false, true),
            "wss" => (443, true, true),
            _ => return Err(bad("scheme must be mqtt, mqtts, ws or wss")),
        };
        if websocket && cfg!(not(feature = "websocket")) {
            return Err(bad(
                "MQTT over WebSockets needs edge-outbox built with the `websocket` feature",
            ));
        }
        // A WebSocket URL has a path (the broker's endpoint, `/mqtt` by default); after the last
        // `@`, so a password may hold a `/`.
        let (rest, path) = match websocket {
            false => (rest, None),
            true => {
                let after_at = rest.rfind('@').map_or(0, |at| at + 1);
                match rest[after_at..].find('/') {
                    Some(slash) => (&rest[..after_at + slash], Some(&rest[after_at + slash..])),
                    None => (rest, None),
                }
            }
        };
        let authority = Authority::parse(rest, default_port).map_err(bad)?;
        let mut config = MqttConfig::new(authority.host, authority.port);
        if tls {
            config.tls = Some(TlsConfig::system_roots());
        }
        if websocket {
            config.websocket = Some(path.filter(|p| *p != "/").unwrap_or("/mqtt").to_owned());
        }
        config.credentials = authority.credentials;
        Ok(config)
    }

    /// The MQTT client id (default `edge-outbox`). Give every device its own: a broker disconnects
    /// the older of two clients with the same id.
    pub fn client_id(mut self, id: impl Into<String>) -> Self {
        self.client_id = id.into();
        self
    }

    /// The protocol version (default [`Protocol::V5`]). Never changed behind your back: a broker
    /// that does not answer an MQTT 5 CONNECT gets an error that names this option.
    pub fn protocol(mut self, protocol: Protocol) -> Self {
        self.protocol = protocol;
        self
    }

    /// Keep-alive interval (default 30 s; zero disables; otherwise at least 1 s). Under MQTT 5 a
    /// broker may impose its own (server keep-alive), which is used instead; and rumqttc's MQTT 5
    /// client takes no less than 5 s: a shorter interval is raised to 5 s (with a warning), and
    /// zero is refused.
    pub fn keep_alive(mut self, interval: Duration) -> Self {
        self.keep_alive = interval;
        self
    }

    /// How long one connection attempt may take, TLS handshake included (default 10 s).
    pub fn connect_timeout(mut self, timeout: Duration) -> Self {
        self.connect_timeout = timeout;
        self
    }

    /// Largest MQTT packet sent, in bytes (default 256 KiB). Under MQTT 5 the broker's own limit
    /// (from its CONNACK) applies too, whichever is smaller. A message that would not fit is
    /// dead-lettered before it is published, never retried forever.
    pub fn max_packet_size(mut self, bytes: usize) -> Self {
        self.max_packet_size = bytes;
        self
    }

    /// Username and password. The password is never logged, printed or shown by `Debug`.
    pub fn credentials(mut self, username: impl Into<String>, password: impl Into<String>) -> Self {
        self.credentials = Some((username.into(), password.into()));
        self.password_file = None;
        self
    }

    /// Username, and the password in the file at `path` (one trailing newline ignored), read now
    /// (a file that cannot be read is an error at once) and again at every connection: a rotated
    /// password is used from the next connection on, without a restart. The password is never
    /// logged, printed or shown by `Debug`.
    pub fn credentials_file(
        mut self,
        username: impl Into<String>,
        path: impl AsRef<std::path::Path>,
    ) -> Result<Self> {
        let path = path.as_ref();
        self.credentials = Some((username.into(), read_password(path)?));
        self.password_file = Some(path.to_path_buf());
        Ok(self)
    }

    /// Authenticate to Azure IoT Hub with the device's symmetric key: the username IoT Hub
    /// expects and a fresh SAS token for every connection, each connection replaced by a new one
    /// before its token expires ([`SasKey`]). The client id must be the device id. Instead of
    /// [`credentials`](Self::credentials), not with them.
    pub fn azure_sas(mut self, key: SasKey) -> Self {
        self.sas = Some(key);
        self
    }

    /// The SAS key, if one is set.
    pub fn sas(&self) -> Option<&SasKey> {
        self.sas.as_ref()
    }

    /// Connect over TLS. Plain TCP is never used when TLS is configured.
    pub fn tls(mut self, tls: TlsConfig) -> Self {
        self.tls = Some(tls);
        self
    }

    /// Publish `online` (retained) to this topic on every connection, and register `offline`
    /// (retained) as the last will, so the cloud sees when the device drops off. The payload is
    /// plain UTF-8 text, not a CBOR envelope: keep the topic outside the event topics consumers
    /// decode.
    pub fn status_topic(mut self, topic: impl Into<String>) -> Self {
        self.status_topic = Some(topic.into());
        self
    }

    /// MQTT 5 topic aliases on the publishing session (default off): a topic repeated on one
    /// connection goes out in full once, then as a two-byte alias, up to the broker's topic alias
    /// maximum. It cuts bytes on metered links when topics are long next to the messages.
    /// Off by default because not every broker gets them right: rumqttd 0.20 forwards the alias
    /// to its MQTT 3.1.1 subscribers and its 3.1.1 listener crashes on it. If a broker
    /// disconnects over an alias (reason 0x94 or 0x82), the relay stops using them.
    pub fn topic_aliases(mut self, on: bool) -> Self {
        self.topic_aliases = on;
        self
    }

    /// Under MQTT 5, publish a message that has a lifetime
    /// ([`Message::expires_after`](crate::Message::expires_after),
    /// [`RelayConfig::expire_after`](crate::RelayConfig::expire_after)) with the message expiry
    /// interval set to what is left of it, so the broker drops it too once it is stale (default
    /// on). Turn it off for rumqttd 0.20 when any MQTT 3.1.1 client subscribes to these topics:
    /// its 3.1.1 listener crashes on a publish that carries MQTT 5 properties. The relay never
    /// publishes an expired message either way.
    pub fn message_expiry(mut self, on: bool) -> Self {
        self.message_expiry = on;
        self
    }

    /// Adds a broker to try when the current one fails: the nodes of a cluster, or a standby.
    /// The sessions try the brokers in turn, the next one after each failed attempt or lost
    /// connection, with the usual [backoff](crate::RelayConfig::reconnect_backoff) between
    /// attempts; [`Status::broker`](crate::Status::broker) names the current one. Every broker
    /// gets the same client id, credentials, TLS settings and protocol.
    ///
    /// The relay's guarantees hold across brokers: rows are marked only on a PUBACK, and every
    /// new connection resumes from the oldest unacknowledged row. Brokers that are not one
    /// cluster do not share subscriptions or queued commands: consumers must read from all of
    /// them, and commands queued on one are delivered when the device connects there again.
    ///
    /// ```
    /// use edge_outbox::MqttConfig;
    /// let config = MqttConfig::new("node-1.example", 1883)
    ///     .failover("node-2.example", 1883)
    ///     .failover("node-3.example", 1883);
    /// assert_eq!(config.brokers().count(), 3);
    /// ```
    pub fn failover(mut self, host: impl Into<String>, port: u16) -> Self {
        self.failover.push((host.into(), port));
        self
    }

    /// Reach the brokers through this HTTP proxy (feature `http-proxy`), by an HTTP `CONNECT`
    /// tunnel, except those its [`no_proxy`](super::proxy::HttpProxy::no_proxy) list names. Every
    /// session of the relay, the command session and [`subscribe`](crate::subscribe) use it;
    /// TLS to the broker runs inside the tunnel. A proxy that refuses or drops the tunnel is a
    /// failed connection like any other: the relay backs off, tries again, and resumes from the
    /// oldest unacknowledged row.
    ///
    /// ```
    /// use edge_outbox::{HttpProxy, MqttConfig};
    /// let config = MqttConfig::from_url("mqtts://broker.example.com")?
    ///     .http_proxy(HttpProxy::from_url("http://proxy.corp:3128")?);
    /// assert_eq!(config.proxy().map(|p| p.port()), Some(3128));
    /// # Ok::<(), edge_outbox::Error>(())
    /// ```
    #[cfg(feature = "http-proxy")]
    pub fn http_proxy(mut self, proxy: super::proxy::HttpProxy) -> Self {
        self.proxy = Some(proxy);
        self
    }

    /// The HTTP proxy, if one is set (feature `http-proxy`).
    #[cfg(feature = "http-proxy")]
    pub fn proxy(&self) -> Option<&super::proxy::HttpProxy> {
        self.proxy.as_ref()
    }

    /// The proxy a connection to broker `host` goes through, if any.
    #[cfg(feature = "http-proxy")]
    pub(crate) fn proxy_for(&self, host: &str) -> Option<&super::proxy::HttpProxy> {
        self.proxy.as_ref().filter(|p| p.applies_to(host))
    }

    /// Every broker, in the order they are tried: this one, then the [`failover`](Self::failover)
    /// ones.
    pub fn brokers(&self) -> impl Iterator<Item = (&str, u16)> {
        std::iter::once((self.host.as_str(), self.port))
            .chain(self.failover.iter().map(|(h, p)| (h.as_str(), *p)))
    }

    /// The broker host.
    pub fn host(&self) -> &str {
        &self.host
    }

    /// The broker port.
    pub fn port(&self) -> u16 {
        self.port
    }

    /// The client id.
    pub fn id(&self) -> &str {
        &self.client_id
    }

    /// The protocol version.
    pub fn version(&self) -> Protocol {
        self.protocol
    }

    /// Whether topic aliases are on.
    pub fn uses_topic_aliases(&self) -> bool {
        self.topic_aliases
    }

    /// Whether publishes carry the message expiry interval (MQTT 5).
    pub fn sends_message_expiry(&self) -> bool {
        self.message_expiry
    }

    /// The username, if credentials are set (the password has no getter).
    pub fn username(&self) -> Option<&str> {
        self.credentials.as_ref().map(|(user, _)| user.as_str())
    }

    /// The maximum packet size.
    pub fn packet_limit(&self) -> usize {
        self.max_packet_size
    }

    /// The status topic, if any.
    pub fn status(&self) -> Option<&str> {
        self.status_topic.as_deref()
    }

    /// Whether TLS is configured.
    pub fn uses_tls(&self) -> bool {
        self.tls.is_some()
    }

    /// `host:port` of the first broker, for logs and status: never the credentials.
    pub(crate) fn endpoint(&self) -> String {
        endpoint(&self.host, self.port)
    }

    /// `host:port` of every broker, in the order they are tried.
    pub(crate) fn endpoints(&self) -> Vec<String> {
        self.brokers().map(|(h, p)| endpoint(h, p)).collect()
    }

    /// What the sessions authenticate with, for status: `sas-token`, `password`,
    /// `client-certificate`, comma-separated when several; `None` when nothing.
    pub(crate) fn credential_kind(&self) -> Option<String> {
        let kinds: Vec<&str> = [
            (self.sas.is_some(), "sas-token"),
            (self.credentials.is_some(), "password"),
            (
                self.tls.as_ref().is_some_and(TlsConfig::has_client_auth),
                "client-certificate",
            ),
        ]
        .into_iter()
        .filter_map(|(on, kind)| on.then_some(kind))
        .collect();
        (!kinds.is_empty()).then(|| kinds.join(", "))
    }

    pub(crate) fn keep_alive_value(&self) -> Duration {
        self.keep_alive
    }

    pub(crate) fn connect_timeout_value(&self) -> Duration {
        self.connect_timeout
    }

    pub(crate) fn credentials_value(&self) -> Option<(&str, &str)> {
        self.credentials.as_ref().map(|(u, p)| (u.as_str(), p.as_str()))
    }

    /// The password file, if the password comes from one.
    pub(crate) fn password_file(&self) -> Option<&std::path::Path> {
        self.password_file.as_deref()
    }

    /// The TLS settings connections use: as set, plus the ALPN protocol AWS IoT Core needs on
    /// port 443 with its profile and no ALPN of its own (applied here, at use, so that the order
    /// of `tls` and `cloud` calls does not matter).
    pub(crate) fn tls_value(&self) -> Option<std::borrow::Cow<'_, TlsConfig>> {
        let tls = self.tls.as_ref()?;
        if self.cloud == Some(crate::CloudProfile::AwsIotCore) && self.port == 443 && !tls.offers_alpn() {
            return Some(std::borrow::Cow::Owned(tls.clone().alpn("x-amzn-mqtt-ca")));
        }
        Some(std::borrow::Cow::Borrowed(tls))
    }

    /// Checks what rumqttc would otherwise assert on (it panics instead of returning errors).
    pub(crate) fn validate(&self, client_id: &str) -> Result<()> {
        if client_id.is_empty() {
            return Err(Error::InvalidConfig("MQTT client id is empty".into()));
        }
        if !self.keep_alive.is_zero() && self.keep_alive < Duration::from_secs(1) {
            return Err(Error::InvalidConfig(
                "keep_alive must be zero or at least 1 s".into(),
            ));
        }
        if self.keep_alive > Duration::from_secs(u64::from(u16::MAX)) {
            return Err(Error::InvalidConfig(
                "keep_alive must be at most 65535 s (MQTT encodes it in 16 bits)".into(),
            ));
        }
        if self.brokers().any(|(host, _)| host.is_empty()) {
            return Err(Error::InvalidConfig("broker host is empty".into()));
        }
        if self.max_packet_size < 128 || self.max_packet_size > PROTOCOL_MAX_PACKET {
            return Err(Error::InvalidConfig(format!(
                "max_packet_size must be from 128 bytes to {PROTOCOL_MAX_PACKET} (MQTT's limit)"
            )));
        }
        if let Some(topic) = &self.status_topic {
            crate::topic::check(topic, true)
                .map_err(|e| Error::InvalidConfig(format!("status topic: {e}")))?;
        }
        if let Some(path) = &self.websocket
            && (!path.starts_with('/') || path.chars().any(|c| c.is_whitespace() || c.is_control()))
        {
            return Err(Error::InvalidConfig(format!(
                "WebSocket path {path:?}: it starts with '/' and has no spaces or control characters"
            )));
        }
        #[cfg(feature = "http-proxy")]
        if let Some(proxy) = &self.proxy {
            proxy.validate()?;
            if let Some((host, _)) = self
                .brokers()
                .find(|(host, _)| host.contains(':') && proxy.applies_to(host))
            {
                return Err(Error::InvalidConfig(format!(
                    "broker {host}: an IPv6 address cannot be reached through the HTTP proxy \
                     (its CONNECT request takes a host name or IPv4 address): give the broker's \
                     host name, or list it in no_proxy"
                )));
            }
        }
        if let Some(sas) = &self.sas {
            if self.credentials.is_some() {
                return Err(Error::InvalidConfig(
                    "a username and password and a SAS key: give one of them (the SAS key makes both)".into(),
                ));
            }
            sas.validate(self.connect_timeout)?;
        }
        Ok(())
    }
}

/// The password in `path`: its text without one trailing newline (`\n` or `\r\n`).
pub(crate) fn read_password(path: &std::path::Path) -> Result<String> {
    let text = std::fs::read_to_string(path)
        .map_err(|e| Error::io(format!("reading password file {}", path.display()), e))?;
    let line = text.strip_suffix('\n').unwrap_or(&text);
    Ok(line.strip_suffix('\r').unwrap_or(line).to_owned())
}

/// What follows a URL's scheme: `[user[:password]@]host[:port][/]`, for the broker's and the
/// proxy's URLs alike.
pub(crate) struct Authority<'a> {
    pub host: &'a str,
    pub port: u16,
    /// The user and password, percent-decoded (a user alone has an empty password).
    pub credentials: Option<(String, String)>,
}

impl Authority<'_> {
    /// `rest` split, with `default_port` where none is given; the error says what is wrong
    /// without repeating the password.
    pub(crate) fn parse(rest: &str, default_port: u16) -> std::result::Result<Authority<'_>, &'static str> {
        let rest = rest.trim_end_matches('/');
        let (userinfo, hostport) = match rest.rsplit_once('@') {
            Some((userinfo, hostport)) => (Some(userinfo), hostport),
            None => (None, rest),
        };
        let (host, port) = split_host_port(hostport, default_port)?;
        let credentials = match userinfo {
            None => None,
            Some(userinfo) => {
                let (user, password) = userinfo.split_once(':').unwrap_or((userinfo, ""));
                let user = percent_decode(user).ok_or("malformed %-escape in the username")?;
                let password = percent_decode(password).ok_or("malformed %-escape in the password")?;
                if user.is_empty() {
                    return Err("a password needs a username (user:password@host)");
                }
                Some((user, password))
            }
        };
        Ok(Authority {
            host,
            port,
            credentials,
        })
    }
}

/// Splits the `host[:port]` of a URL (an IPv6 address in brackets, `[::1]:1883`), with
/// `default_port` where none is given; the error says what is wrong.
fn split_host_port(hostport: &str, default_port: u16) -> std::result::Result<(&str, u16), &'static str> {
    let (host, port) = match hostport.strip_prefix('[') {
        Some(rest) => {
            let (host, after) = rest.split_once(']').ok_or("missing ] after the IPv6 address")?;
            match after {
                "" => (host, None),
                _ => (
                    host,
                    Some(after.strip_prefix(':').ok_or("missing or malformed host")?),
                ),
            }
        }
        None => match hostport.rsplit_once(':') {
            Some((host, _)) if host.contains(':') => {
                return Err("an IPv6 address goes in brackets, as in [::1]:1883");
            }
            Some((host, port)) => (host, Some(port)),
            None => (hostport, None),
        },
    };
    let port = match port {
        Some(p) => p
            .parse::<u16>()
            .ok()
            .filter(|p| *p != 0)
            .ok_or("port is not a number from 1 to 65535")?,
        None => default_port,
    };
    if host.is_empty() || host.contains(['/', '?', '#', '@', '[', ']']) {
        return Err("missing or malformed host");
    }
    Ok((host, port))
}

/// `host:port`, with an IPv6 address in brackets.
pub(crate) fn endpoint(host: &str, port: u16) -> String {
    if host.contains(':') {
        format!("[{host}]:{port}")
    } else {
        format!("{host}:{port}")
    }
}

/// `url` with any password replaced by `***`: a broker URL safe to print (error messages, the
/// effective settings `edge-outbox config check` shows).
///
/// ```
/// assert_eq!(
///     edge_outbox::redact_url("mqtts://pump-17:s3cret@broker.example:8883"),
///     "mqtts://pump-17:***@broker.example:8883"
/// );
/// assert_eq!(edge_outbox::redact_url("mqtt://broker.example"), "mqtt://broker.example");
/// ```
pub fn redact_url(url: &str) -> String {
    // Without a scheme too: an operator who types `user:secret@host` gets an error naming it.
    let (scheme, rest) = url.split_once("://").map_or(("", url), |(s, r)| (s, r));
    let Some((userinfo, hostport)) = rest.rsplit_once('@') else {
        return url.to_owned();
    };
    let separator = if url.contains("://") { "://" } else { "" };
    let user = userinfo.split_once(':').map_or(userinfo, |(user, _)| user);
    let password = if userinfo.contains(':') { ":***" } else { "" };
    format!("{scheme}{separator}{user}{password}@{hostport}")
}

/// Decodes `%XX` escapes; `None` on a malformed escape or bytes that are not UTF-8.
fn percent_decode(s: &str) -> Option<String> {
    let bytes = s.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        if bytes[i] == b'%' {
            let hex = s.get(i + 1..i + 3)?;
            out.push(u8::from_str_radix(hex, 16).ok()?);
            i += 3;
        } else {
            out.push(bytes[i]);
            i += 1;
        }
    }
    String::from_utf8(out).ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_redacted_url_keeps_the_user_and_hides_the_password_with_or_without_a_scheme() {
        for (url, shown) in [
            ("mqtt://u:pw@h:1", "mqtt://u:***@h:1"),
            ("u:pw@h:1", "u:***@h:1"),
            ("u:p@w@h", "u:***@h"),
            ("mqtts://u@h", "mqtts://u@h"),
            ("mqtt://h:1", "mqtt://h:1"),
            ("h:1", "h:1"),
        ] {
            assert_eq!(redact_url(url), shown, "{url}");
        }
    }

    #[test]
    fn urls_parse_or_say_why() {
        let c = MqttConfig::from_url("mqtt://127.0.0.1:1884").expect("url");
        assert_eq!((c.host(), c.port(), c.uses_tls()), ("127.0.0.1", 1884, false));
        let c = MqttConfig::from_url("mqtts://broker.example").expect("url");
        assert_eq!((c.port(), c.uses_tls()), (8883, true));
        for (url, host, port) in [
            ("mqtt://[::1]", "::1", 1883),
            ("mqtt://[fe80::2]:1884", "fe80::2", 1884),
        ] {
            let c = MqttConfig::from_url(url).expect(url);
            assert_eq!((c.host(), c.port()), (host, port), "{url}");
        }
        for bad in [
            "127.0.0.1:1883",
            "http://x:1",
            "mqtt://:1883",
            "mqtt://h:99999",
            "mqtt://h:x",
            "mqtt://h:0",
            "mqtt://[::1",
            "mqtt://[::1]x",
            "mqtt://fe80::1",
            "mqtt://:pw@h",
            "mqtt://u:%zz@h",
        ] {
            let err = MqttConfig::from_url(bad).expect_err(bad);
            assert!(err.to_string().contains("broker URL"), "{err}");
        }
    }

    #[test]
    fn credentials_in_the_url_are_parsed_and_never_shown() {
        let c = MqttConfig::from_url("mqtts://pump%4017:s3cr%3At@broker.example:8884/").expect("url");
        assert_eq!(c.host(), "broker.example");
        assert_eq!(c.port(), 8884);
        assert_eq!(c.credentials_value(), Some(("pump@17", "s3cr:t")));
        assert!(!format!("{c:?}").contains("s3cr"), "{c:?}");
        let err = MqttConfig::from_url("mqtt://u:s3cret@h:notaport").expect_err("bad port");
        assert!(!err.to_string().contains("s3cret"), "{err}");
        assert!(err.to_string().contains("u:***@h"), "{err}");
        let c = MqttConfig::from_url("mqtt://justuser@h").expect("user only");
        assert_eq!(c.credentials_value(), Some(("justuser", "")));
    }

    #[test]
    fn rumqttc_asserts_become_errors() {
        let c = MqttConfig::new("h", 1).keep_alive(Duration::from_millis(10));
        assert!(c.validate("id").is_err());
        assert!(MqttConfig::new("h", 1).validate("").is_err());
        assert!(
            MqttConfig::new("h", 1)
                .max_packet_size(10)
                .validate("id")
                .is_err()
        );
        assert!(
            MqttConfig::new("h", 1)
                .status_topic("a/+")
                .validate("id")
                .is_err()
        );
    }

    #[test]
    fn protocol_names_parse() {
        assert_eq!("3.1.1".parse::<Protocol>().expect("3.1.1"), Protocol::V311);
        assert_eq!("5".parse::<Protocol>().expect("5"), Protocol::V5);
        assert!("4.0".parse::<Protocol>().is_err());
    }
}
