//! Test harness shared by the integration tests: `mod support;` from any `tests/*.rs`.
//!
//! - [`alpn_front`]: a TLS front that serves only clients offering its ALPN protocol (AWS IoT
//!   Core on port 443).
//! - [`azure_sas`]: Azure IoT Hub's rules for a device with a symmetric key: the username form, the
//!   SAS token's signature and expiry, one connection per device id.
//! - [`broker`]: a real MQTT broker process on 127.0.0.1 with a port picked at run time (mosquitto
//!   when it is installed or asked for, rumqttd otherwise; `EDGE_OUTBOX_BROKER` chooses).
//! - [`child`]: child processes killed when their test ends, fails or panics, and this test
//!   binary run again as a child process that can abort or be killed.
//! - [`example`]: the cloud consumer example as a child process, killed and restarted.
//! - [`damage`]: rows with a mark findable in the file, and a page holding one overwritten.
//! - [`proxy`]: a TCP proxy that cuts, stalls, refuses and half-opens connections on command.
//! - [`ledger`]: a device whose commands credit a balance, behind a relay.
//! - [`mqtt_proxy`]: an MQTT-aware proxy that holds back or drops PUBACKs, chokes on chosen
//!   messages and drops connections after an event (a broker that misbehaves).
//! - [`mutant`]: this test binary run again with a mutant on, for the scenario mutants: it must
//!   fail, on its own verdict.
//! - [`mux`]: one address for MQTT 3.1.1 and 5 clients in front of rumqttd.
//! - [`rabbit`]: a 3-node RabbitMQ cluster as child processes, nodes killed and restarted.
//! - [`python`]: an interpreter with `cbor2` for the interoperability tests, provisioned once.
//! - [`subscriber`]: an independent rumqttc client that collects what arrives, and one-shot publishing.
//! - [`tls`]: a CA, server and client certificates generated at run time (rcgen).
//!
//! Every test binary compiles this module but uses only part of it.
#![allow(dead_code, unused_imports)]

pub mod alpn_front;
pub mod azure_sas;
pub mod broker;
pub mod check;
pub mod child;
pub mod credits;
pub mod damage;
pub mod device;
pub mod example;
pub mod ledger;
pub mod mqtt_proxy;
pub mod mutant;
pub mod mux;
pub mod ports;
pub mod powercut;
pub mod proxy;
pub mod python;
pub mod rabbit;
pub mod subscriber;
pub mod tls;

pub use broker::{Broker, BrokerKind, TlsListener};
pub use child::ChildGuard;
pub use mqtt_proxy::{MqttProxy, Repeat, Trigger};
pub use proxy::Proxy;
pub use subscriber::{Message, Subscriber, publish_raw, publish_raw_many, publish_retained};
pub use tls::Pki;

use std::time::Duration;

/// Default bound for waits in tests: generous, because CI machines are slow, and only ever reached
/// when something is broken (waits return as soon as their condition holds).
pub const WAIT: Duration = Duration::from_secs(45);

/// Polls `cond` every few milliseconds until it holds (true) or [`WAIT`] has passed (false).
pub fn wait_until(mut cond: impl FnMut() -> bool) -> bool {
    let deadline = std::time::Instant::now() + WAIT;
    while std::time::Instant::now() < deadline {
        if cond() {
            return true;
        }
        // Conditions on another thread's or process's progress give no signal to wait on.
        std::thread::sleep(Duration::from_millis(5));
    }
    false
}
