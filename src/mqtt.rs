//! Broker connection settings, turned into rumqttc options.

use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use rumqttc::{LastWill, MqttOptions, QoS, TlsConfiguration, Transport};
use rustls::RootCertStore;
use rustls_pki_types::pem::PemObject;
use rustls_pki_types::{CertificateDer, PrivateKeyDer};

use crate::error::{Error, Result};

/// Where and how to connect to the broker.
///
/// | setting | default |
/// |---|---|
/// | [`client_id`](Self::client_id) | `edge-outbox` |
/// | [`keep_alive`](Self::keep_alive) | 30 s |
/// | [`connect_timeout`](Self::connect_timeout) | 10 s |
/// | [`max_packet_size`](Self::max_packet_size) | 256 KiB |
/// | [`credentials`](Self::credentials) | none |
/// | [`tls`](Self::tls) | none: plain TCP |
/// | [`status_topic`](Self::status_topic) | none |
///
/// ```
/// use edge_outbox::MqttConfig;
/// let config = MqttConfig::new("broker.example", 8883)
///     .client_id("pump-17")
///     .credentials("pump-17", "secret")
///     .status_topic("devices/pump-17/status");
/// assert_eq!(config.port(), 8883);
/// ```
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MqttConfig {
    host: String,
    port: u16,
    client_id: String,
    keep_alive: Duration,
    connect_timeout: Duration,
    max_packet_size: usize,
    credentials: Option<(String, String)>,
    tls: Option<TlsConfig>,
    status_topic: Option<String>,
}

impl MqttConfig {
    /// A broker at `host:port`, plain TCP, with the defaults above.
    pub fn new(host: impl Into<String>, port: u16) -> Self {
        MqttConfig {
            host: host.into(),
            port,
            client_id: "edge-outbox".into(),
            keep_alive: Duration::from_secs(30),
            connect_timeout: Duration::from_secs(10),
            max_packet_size: 256 * 1024,
            credentials: None,
            tls: None,
            status_topic: None,
        }
    }

    /// Parses `mqtt://host:port` (plain TCP, default port 1883) or `mqtts://host:port` (TLS with
    /// the CA given later through [`MqttConfig::tls`], default port 8883).
    pub fn from_url(url: &str) -> Result<Self> {
        let bad = |why: &str| Error::InvalidConfig(format!("broker URL {url:?}: {why}"));
        let (scheme, rest) = url
            .split_once("://")
            .ok_or_else(|| bad("expected mqtt://host:port"))?;
        let default_port = match scheme {
            "mqtt" | "tcp" => 1883,
            "mqtts" | "ssl" => 8883,
            _ => return Err(bad("scheme must be mqtt or mqtts")),
        };
        let rest = rest.trim_end_matches('/');
        let (host, port) = match rest.rsplit_once(':') {
            Some((h, p)) if !h.ends_with(']') || h.starts_with('[') => (
                h,
                p.parse::<u16>()
                    .map_err(|_| bad("port is not a number from 1 to 65535"))?,
            ),
            _ => (rest, default_port),
        };
        let host = host.trim_start_matches('[').trim_end_matches(']');
        if host.is_empty() || host.contains('/') {
            return Err(bad("missing or malformed host"));
        }
        let mut config = MqttConfig::new(host, port);
        if default_port == 8883 {
            config.tls = Some(TlsConfig::system_roots());
        }
        Ok(config)
    }

    /// The MQTT client id (default `edge-outbox`). Give every device its own: a broker disconnects
    /// the older of two clients with the same id.
    pub fn client_id(mut self, id: impl Into<String>) -> Self {
        self.client_id = id.into();
        self
    }

    /// Keep-alive interval (default 30 s; zero disables; otherwise at least 1 s).
    pub fn keep_alive(mut self, interval: Duration) -> Self {
        self.keep_alive = interval;
        self
    }

    /// How long one connection attempt may take, TLS handshake included (default 10 s).
    pub fn connect_timeout(mut self, timeout: Duration) -> Self {
        self.connect_timeout = timeout;
        self
    }

    /// Largest MQTT packet sent or accepted, in bytes (default 256 KiB). Keep it at or below the
    /// broker's limit; a message that would not fit is dead-lettered, never retried forever.
    pub fn max_packet_size(mut self, bytes: usize) -> Self {
        self.max_packet_size = bytes;
        self
    }

    /// Username and password.
    pub fn credentials(mut self, username: impl Into<String>, password: impl Into<String>) -> Self {
        self.credentials = Some((username.into(), password.into()));
        self
    }

    /// Connect over TLS. Plain TCP is never used when TLS is configured.
    pub fn tls(mut self, tls: TlsConfig) -> Self {
        self.tls = Some(tls);
        self
    }

    /// Publish `online` (retained) to this topic on every connection, and register `offline`
    /// (retained) as the last will, so the cloud sees when the device drops off.
    pub fn status_topic(mut self, topic: impl Into<String>) -> Self {
        self.status_topic = Some(topic.into());
        self
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

    pub(crate) fn connect_timeout_value(&self) -> Duration {
        self.connect_timeout
    }

    /// rumqttc options for one session. `client_id` overrides ours (the command session uses its
    /// own). The publishing session (`clean_session`) registers the status topic's last will; the
    /// command session (persistent) acknowledges deliveries itself, after storing them.
    pub(crate) fn to_rumqttc(&self, client_id: &str, clean_session: bool) -> Result<MqttOptions> {
        // rumqttc asserts on these instead of returning errors: validate first, never panic.
        if client_id.is_empty() {
            return Err(Error::InvalidConfig("MQTT client id is empty".into()));
        }
        if !self.keep_alive.is_zero() && self.keep_alive < Duration::from_secs(1) {
            return Err(Error::InvalidConfig(
                "keep_alive must be zero or at least 1 s".into(),
            ));
        }
        if self.host.is_empty() {
            return Err(Error::InvalidConfig("broker host is empty".into()));
        }
        if self.max_packet_size < 128 {
            return Err(Error::InvalidConfig(
                "max_packet_size must be at least 128 bytes".into(),
            ));
        }
        let mut options = MqttOptions::new(client_id, self.host.as_str(), self.port);
        options
            .set_keep_alive(self.keep_alive)
            .set_clean_session(clean_session)
            .set_max_packet_size(self.max_packet_size, self.max_packet_size);
        if let Some((user, password)) = &self.credentials {
            options.set_credentials(user.as_str(), password.as_str());
        }
        if let Some(tls) = &self.tls {
            options.set_transport(Transport::tls_with_config(tls.client_config()?));
        }
        match (clean_session, &self.status_topic) {
            (true, Some(topic)) => {
                options.set_last_will(LastWill::new(topic.as_str(), "offline", QoS::AtLeastOnce, true));
            }
            (false, _) => {
                options.set_manual_acks(true);
            }
            (true, None) => {}
        }
        Ok(options)
    }
}

/// TLS settings: which CA to trust and, for mutual TLS, the client's certificate and key (PEM).
#[derive(Clone, PartialEq, Eq)]
pub struct TlsConfig {
    ca_pem: Option<Vec<u8>>,
    client_auth: Option<(Vec<u8>, Vec<u8>)>,
}

impl std::fmt::Debug for TlsConfig {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // Never print key material.
        f.debug_struct("TlsConfig")
            .field("custom_ca", &self.ca_pem.is_some())
            .field("client_auth", &self.client_auth.is_some())
            .finish()
    }
}

impl TlsConfig {
    /// Trust the CA certificates in this PEM.
    pub fn with_ca_pem(ca_pem: impl Into<Vec<u8>>) -> Self {
        TlsConfig {
            ca_pem: Some(ca_pem.into()),
            client_auth: None,
        }
    }

    /// Trust the CA certificates in the PEM file at `path`.
    pub fn with_ca_file(path: impl AsRef<Path>) -> Result<Self> {
        Ok(Self::with_ca_pem(read(path.as_ref())?))
    }

    /// Trust the operating system's root certificates.
    pub fn system_roots() -> Self {
        TlsConfig {
            ca_pem: None,
            client_auth: None,
        }
    }

    /// Present this certificate chain and private key (PEM) for mutual TLS.
    pub fn client_auth_pem(mut self, cert_pem: impl Into<Vec<u8>>, key_pem: impl Into<Vec<u8>>) -> Self {
        self.client_auth = Some((cert_pem.into(), key_pem.into()));
        self
    }

    /// Present the certificate chain and private key in these PEM files for mutual TLS.
    pub fn client_auth_files(self, cert: impl AsRef<Path>, key: impl AsRef<Path>) -> Result<Self> {
        Ok(self.client_auth_pem(read(cert.as_ref())?, read(key.as_ref())?))
    }

    /// A rustls configuration with the ring provider passed explicitly, so nothing depends on a
    /// process-wide default provider being installed.
    fn client_config(&self) -> Result<TlsConfiguration> {
        let bad = |what: &str, e: &dyn std::fmt::Display| Error::InvalidConfig(format!("TLS {what}: {e}"));
        let mut roots = RootCertStore::empty();
        match &self.ca_pem {
            Some(pem) => {
                for cert in CertificateDer::pem_slice_iter(pem) {
                    roots
                        .add(cert.map_err(|e| bad("CA certificate", &e))?)
                        .map_err(|e| bad("CA certificate", &e))?;
                }
            }
            None => {
                let found = rustls_native_roots();
                for cert in found {
                    // A malformed system root is skipped, as browsers do.
                    let _ = roots.add(cert);
                }
            }
        }
        if roots.is_empty() {
            return Err(Error::InvalidConfig("TLS: no CA certificate to trust".into()));
        }
        let provider = Arc::new(rustls::crypto::ring::default_provider());
        let builder = rustls::ClientConfig::builder_with_provider(provider)
            .with_safe_default_protocol_versions()
            .map_err(|e| bad("protocol versions", &e))?
            .with_root_certificates(roots);
        let config = match &self.client_auth {
            Some((cert_pem, key_pem)) => {
                let certs = CertificateDer::pem_slice_iter(cert_pem)
                    .collect::<std::result::Result<Vec<_>, _>>()
                    .map_err(|e| bad("client certificate", &e))?;
                let key = PrivateKeyDer::from_pem_slice(key_pem).map_err(|e| bad("client key", &e))?;
                builder
                    .with_client_auth_cert(certs, key)
                    .map_err(|e| bad("client certificate", &e))?
            }
            None => builder.with_no_client_auth(),
        };
        Ok(TlsConfiguration::Rustls(Arc::new(config)))
    }
}

fn read(path: &Path) -> Result<Vec<u8>> {
    std::fs::read(path).map_err(|e| Error::io(format!("reading {}", path.display()), e))
}

/// The system's root certificates from the usual PEM bundle locations.
fn rustls_native_roots() -> Vec<CertificateDer<'static>> {
    const BUNDLES: &[&str] = &[
        "/etc/ssl/certs/ca-certificates.crt",
        "/etc/pki/tls/certs/ca-bundle.crt",
        "/etc/ssl/cert.pem",
    ];
    BUNDLES
        .iter()
        .find_map(|p| std::fs::read(p).ok())
        .map(|pem| {
            CertificateDer::pem_slice_iter(&pem)
                .filter_map(|c| c.ok())
                .collect()
        })
        .unwrap_or_default()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn urls_parse_or_say_why() {
        let c = MqttConfig::from_url("mqtt://127.0.0.1:1884").expect("url");
        assert_eq!((c.host(), c.port(), c.uses_tls()), ("127.0.0.1", 1884, false));
        let c = MqttConfig::from_url("mqtts://broker.example").expect("url");
        assert_eq!((c.port(), c.uses_tls()), (8883, true));
        for bad in [
            "127.0.0.1:1883",
            "http://x:1",
            "mqtt://:1883",
            "mqtt://h:99999",
            "mqtt://h:x",
        ] {
            let err = MqttConfig::from_url(bad).expect_err(bad);
            assert!(err.to_string().contains("broker URL"), "{err}");
        }
    }

    #[test]
    fn rumqttc_asserts_become_errors() {
        let c = MqttConfig::new("h", 1).keep_alive(Duration::from_millis(10));
        assert!(c.to_rumqttc("id", true).is_err());
        assert!(MqttConfig::new("h", 1).to_rumqttc("", false).is_err());
    }

    #[test]
    fn garbage_ca_is_an_error_not_a_panic() {
        let c = MqttConfig::new("h", 1).tls(TlsConfig::with_ca_pem("not a pem"));
        assert!(c.to_rumqttc("id", true).is_err());
    }
}
