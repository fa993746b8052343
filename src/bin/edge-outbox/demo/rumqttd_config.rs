//! rumqttd 0.20 configuration for a broker on loopback ports, built in code: its sample
//! configuration binds 0.0.0.0 and opens a console port. Shared by the demo's in-process broker
//! and `edge-outbox broker` (the test suite's broker where mosquitto is absent). rumqttd serves
//! MQTT 3.1.1 and MQTT 5 on separate listeners.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::path::Path;

/// Where to listen: MQTT 3.1.1, and MQTT 5 if given.
#[derive(Debug, Clone, Copy)]
pub struct Listeners {
    pub v311: SocketAddr,
    pub v5: Option<SocketAddr>,
}

/// TLS listeners: the server's certificate and key, and the CA that must have signed every
/// client's certificate (rumqttd is built with `verify-client-cert`: mutual TLS only).
pub struct TlsListeners<'a> {
    pub listen: Listeners,
    pub cert: &'a Path,
    pub key: &'a Path,
    pub ca: &'a Path,
}

/// Plain listeners, TLS ones if asked, an MQTT 3.1.1 WebSocket listener on `ws` if given
/// (rumqttd's WebSocket listener speaks 3.1.1 only); `passwords` (user to password) makes them
/// all require a login.
pub fn rumqttd_config(
    plain: Listeners,
    max_packet: usize,
    tls: Option<&TlsListeners<'_>>,
    ws: Option<SocketAddr>,
    passwords: Option<HashMap<String, String>>,
) -> rumqttd::Config {
    let ws = ws.map(|addr| {
        HashMap::from([(
            "ws".to_owned(),
            server("ws", addr, max_packet, None, passwords.clone()),
        )])
    });
    let mut v4 = HashMap::new();
    let mut v5 = HashMap::new();
    let mut add = |name: &str, listen: Listeners, tls: Option<rumqttd::TlsConfig>| {
        let server = |version: &str, addr: SocketAddr| {
            let name = format!("{name}-{version}");
            server(&name, addr, max_packet, tls.clone(), passwords.clone())
        };
        v4.insert(format!("{name}-v4"), server("v4", listen.v311));
        if let Some(addr) = listen.v5 {
            v5.insert(format!("{name}-v5"), server("v5", addr));
        }
    };
    add("plain", plain, None);
    if let Some(t) = tls {
        let config = rumqttd::TlsConfig::Rustls {
            capath: Some(t.ca.display().to_string()),
            certpath: t.cert.display().to_string(),
            keypath: t.key.display().to_string(),
        };
        add("tls", t.listen, Some(config));
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
        v5: (!v5.is_empty()).then_some(v5),
        ws,
        cluster: None,
        console: None,
        bridge: None,
        prometheus: None,
        metrics: None,
    }
}

fn server(
    name: &str,
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
        name: format!("rumqttd-{name}-{}", listen.port()),
        listen,
        tls,
        next_connection_delay_ms: 1,
        connections,
    }
}
