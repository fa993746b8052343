//! rumqttd 0.20 configuration for an in-process broker on a loopback port, built in code: its
//! sample configuration binds 0.0.0.0 and opens a console port. Shared by the demo and the test
//! harness (tests/support/broker.rs includes this file).

use std::collections::HashMap;
use std::net::SocketAddr;

/// rumqttd 0.20 config built in code (its sample config binds 0.0.0.0 and opens a console port):
/// MQTT 3.1.1 on `listen`, and MQTT 5 on `listen_v5` if given (rumqttd serves the two versions on
/// separate listeners).
pub fn rumqttd_config(
    listen: SocketAddr,
    listen_v5: Option<SocketAddr>,
    max_packet: usize,
) -> rumqttd::Config {
    let connections = rumqttd::ConnectionSettings {
        // Time a new TCP connection has to send CONNECT.
        connection_timeout_ms: 5_000,
        // Checked against each incoming packet's remaining length.
        max_payload_size: max_packet,
        // Despite the name: how many incoming packets are read in one batch per connection.
        max_inflight_count: 500,
        auth: None,
        external_auth: None,
        dynamic_filters: true,
    };
    let server = |name: &str, listen: SocketAddr| rumqttd::ServerSettings {
        name: format!("rumqttd-{name}-{}", listen.port()),
        listen,
        tls: None,
        next_connection_delay_ms: 1,
        connections: connections.clone(),
    };
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
        v4: Some(HashMap::from([("1".to_owned(), server("v4", listen))])),
        v5: listen_v5.map(|addr| HashMap::from([("1".to_owned(), server("v5", addr))])),
        ws: None,
        cluster: None,
        console: None,
        bridge: None,
        prometheus: None,
        metrics: None,
    }
}
