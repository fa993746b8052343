//! rumqttd 0.20 configuration for a broker on loopback ports, built in code: its sample
//! configuration binds 0.0.0.0 and opens a console port. Shared by the demo's in-process broker
//! and `edge-outbox broker` (the test suite's broker where mosquitto is absent).

use std::collections::HashMap;
use std::net::SocketAddr;
use std::path::Path;

/// A TLS listener: the server's certificate and key, and the CA that must have signed every
/// client's certificate (rumqttd is built with `verify-client-cert`: mutual TLS only).
pub struct TlsListener<'a> {
    pub listen: SocketAddr,
    pub cert: &'a Path,
    pub key: &'a Path,
    pub ca: &'a Path,
}

/// A plain MQTT 3.1.1 listener on `listen`, and a TLS one if asked; `passwords` (user to
/// password) makes both require a login.
pub fn rumqttd_config(
    listen: SocketAddr,
    max_packet: usize,
    tls: Option<&TlsListener<'_>>,
    passwords: Option<HashMap<String, String>>,
) -> rumqttd::Config {
    let plain = server("plain", listen, max_packet, None, passwords.clone());
    let mut v4 = HashMap::from([("1".to_owned(), plain)]);
    if let Some(t) = tls {
        let tls = rumqttd::TlsConfig::Rustls {
            capath: Some(t.ca.display().to_string()),
            certpath: t.cert.display().to_string(),
            keypath: t.key.display().to_string(),
        };
        v4.insert(
            "2".to_owned(),
            server("tls", t.listen, max_packet, Some(tls), passwords),
        );
    }
    rumqttd::Config {
        id: 0,
        router: rumqttd::RouterConfig {
            max_connections: 1_000,
            max_outgoing_packet_count: 200,
            // The commit log per filter: 10 segments of 100 MiB (allocated as used). A subscriber
            // further behind than that loses messages, so keep it generous.
            max_segment_size: 100 << 20,
            max_segment_count: 10,
            custom_segment: None,
            initialized_filters: None,
            shared_subscriptions_strategy: Default::default(),
        },
        v4: Some(v4),
        v5: None,
        ws: None,
        cluster: None,
        console: None,
        bridge: None,
        prometheus: None,
        metrics: None,
    }
}

fn server(
    kind: &str,
    listen: SocketAddr,
    max_packet: usize,
    tls: Option<rumqttd::TlsConfig>,
    auth: Option<HashMap<String, String>>,
) -> rumqttd::ServerSettings {
    let connections = rumqttd::ConnectionSettings {
        // Time a new TCP connection has to send CONNECT.
        connection_timeout_ms: 5_000,
        // Checked against each incoming packet's remaining length.
        max_payload_size: max_packet,
        // Despite the name: how many incoming packets are read in one batch per connection.
        max_inflight_count: 500,
        auth,
        external_auth: None,
        dynamic_filters: true,
    };
    rumqttd::ServerSettings {
        name: format!("rumqttd-v4-{kind}-{}", listen.port()),
        listen,
        tls,
        next_connection_delay_ms: 1,
        connections,
    }
}
