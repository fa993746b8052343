//! Transactional outbox and inbox for edge devices: "write locally, publish when connected",
//! without the dual-write bug.
//!
//! The application's business tables, the outbox and the inbox live in one SQLite file in WAL
//! mode. A business change and the message announcing it commit in one transaction; a relay
//! publishes committed messages over MQTT QoS1 as CBOR envelopes whenever the broker is
//! reachable, at least once, in commit order per key. Incoming commands go through the inbox,
//! whose message id commits with the command's effect, so a redelivered command does nothing
//! twice.
//!
//! ```
//! use edge_outbox::Outbox;
//!
//! # let dir = tempfile::tempdir().expect("temp dir");
//! let outbox = Outbox::open(dir.path().join("device.db"))?;
//! outbox.transaction(|tx| {
//!     tx.execute_batch("CREATE TABLE IF NOT EXISTS orders (id TEXT PRIMARY KEY, total INTEGER)")?;
//!     tx.execute("INSERT INTO orders VALUES ('o-1', 40)", [])?;
//!     tx.publish("orders/placed", "o-1", &("o-1", 40))?;
//!     Ok::<_, edge_outbox::Error>(())
//! })?;
//! assert_eq!(outbox.stats()?.pending_messages, 1);
//! # Ok::<(), edge_outbox::Error>(())
//! ```
//!
//! The tables are also a documented SQL interface (`docs/schema.md`): any process that speaks
//! SQLite can enqueue by inserting `(topic, key, payload)` into `outbox`.

#![forbid(unsafe_code)]
#![deny(missing_docs)]
#![cfg_attr(not(test), deny(clippy::unwrap_used, clippy::expect_used, clippy::panic))]

mod cbor;
mod commands;
pub mod envelope;
mod error;
#[doc(hidden)]
pub mod failpoint;
mod mqtt;
mod relay;
#[cfg(feature = "signed-commands")]
mod signed;
mod store;
mod time;

pub use commands::send_command;
pub use envelope::{Envelope, MessageId};
pub use error::{Error, Result};
pub use mqtt::{MqttConfig, TlsConfig};
pub use relay::{Relay, RelayConfig, Status};
#[cfg(feature = "signed-commands")]
pub use signed::{CommandSigner, TrustedKeys};
pub use store::{
    ApplyOutcome, Command, Committed, DeadLetter, Limits, Message, OnFull, Options, Origin, Outbox, Received,
    SCHEMA_VERSION, Stats, Synchronous, Tx, default_path, enqueue, schema_version,
};

#[cfg(test)]
mod tests {
    #[test]
    fn public_handles_are_send_and_sync() {
        fn check<T: Send + Sync>() {}
        check::<crate::Outbox>();
        check::<crate::Error>();
        check::<crate::MessageId>();
    }
}

/// The README's examples, compiled and run as doctests.
#[cfg(doctest)]
#[doc = include_str!("../README.md")]
struct ReadmeDoctests;
