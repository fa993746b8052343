//! Everything about talking to a broker, for the relay and the command session alike: settings
//! and TLS, one client interface over rumqttc's MQTT 3.1.1 and 5 clients, one event type, the
//! driver that runs a session's connections, backoff, connection status, and the ack tracker.

mod aliases;
pub(crate) mod backoff;
mod cert_expiry;
mod client;
mod config;
pub(crate) mod driver;
pub(crate) mod event;
#[cfg(feature = "http-proxy")]
mod proxy;
mod sas;
pub(crate) mod status;
mod subscribe;
mod tls;
pub(crate) mod tracker;

pub(crate) use aliases::Aliases;
pub(crate) use client::{Extra, MqttClient, QueuedPublishes, Recv, Role, SessionOptions};
pub use config::{MqttConfig, Protocol, redact_url};
#[cfg(feature = "http-proxy")]
pub use proxy::HttpProxy;
pub use sas::SasKey;
pub use subscribe::subscribe;
pub use tls::TlsConfig;
