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
//! New to the code? `docs/architecture.md` draws the threads, follows one message and one
//! command through them, and maps the modules.
//!
//! The tables are also a documented SQL interface (`docs/schema.md`): any process that speaks
//! SQLite can enqueue by inserting `(topic, key, payload)` into `outbox`.
//!
//! # Commands
//!
//! A relay with [`RelayConfig::commands`] stores each command it receives in the inbox and
//! acknowledges it; a handler applies it: [`Relay::start_with_handler`] (a thread of the relay),
//! or [`Outbox::apply_next`] from a loop of your own. Applying never holds the application's
//! write path:
//!
//! 1. the attempt is **claimed** in a small committed transaction before any handler code runs, so
//!    a handler that takes the process down (abort, out of memory, a watchdog) is counted, and
//!    after [`Options::max_attempts`] the command is dead-lettered as "handler did not return"
//!    instead of crash-looping the device;
//! 2. the handler runs on a **connection of its own**, in a write transaction that lasts as long
//!    as the handler: its database effect and the applied mark commit together, **exactly once**.
//!
//! Slow work (moving hardware, calling a service) does not belong in that transaction, which
//! holds SQLite's single write lock. A **two-phase handler** does it first, with no transaction
//! open, then records its effect: [`Relay::start_with_two_phase_handler`],
//! [`Outbox::apply_next_two_phase`]. The database effect stays exactly-once; the outside step is
//! **at least once** (a crash between the two runs it again), so make it idempotent, keyed on
//! [`Command::id`].
//!
//! ```
//! use edge_outbox::{ApplyOutcome, Envelope, Error, MessageId, Outbox};
//!
//! # let dir = tempfile::tempdir().expect("temp dir");
//! let outbox = Outbox::open(dir.path().join("device.db"))?;
//! outbox.with_connection(|c| c.execute_batch("CREATE TABLE valve (position INTEGER)"))?;
//! let id = MessageId::new_v7();
//! outbox.receive("valves/v1/set", &Envelope::command(id, "valve-1", &40)?.encode())?;
//!
//! let outcome = outbox.apply_next_two_phase(
//!     |cmd| {
//!         let target: i64 = cmd.payload_as()?; // a payload of the wrong type: rejected for good
//!         if !(0..=100).contains(&target) {
//!             return Err(Error::reject(format!("position {target} is out of range")));
//!         }
//!         // valve.move_to(target, idempotency_key = cmd.id)  -- seconds, outside any transaction
//!         Ok(target)
//!     },
//!     |tx, _cmd, reached| {
//!         tx.execute("INSERT INTO valve VALUES (?1)", [reached])?; // exactly once
//!         Ok::<_, Error>(())
//!     },
//! )?;
//! assert_eq!(outcome, ApplyOutcome::Applied { id, published: 0 });
//! # Ok::<(), edge_outbox::Error>(())
//! ```
//!
//! A handler error is retried with backoff, then dead-lettered; [`Error::reject`] (and a payload
//! that does not match [`Command::payload_as`]'s type) marks the command rejected at once (not a
//! dead letter; [`Error::with_reply`] answers the sender), and the next command of the key runs. Inside a handler's database step, writes through the application's
//! [`Outbox`] fail at once with [`Error::InsideCommandHandler`] (the step holds the write lock);
//! reads work. [`Relay::shutdown`] waits for a running handler only up to the shutdown timeout.
//!
//! Cloud-side senders build commands with [`Envelope::command`] and publish them with
//! [`send_command`] (or `edge-outbox send-command`); `docs/wire-format.md` ("Sending a command")
//! describes the format for other languages.
//!
//! # The cloud side: loss you can see
//!
//! Every message carries its source, an epoch and a number that counts 1, 2, 3, ... per
//! (source, epoch); every message the device removes before publishing it (evicted, expired,
//! dead-lettered, purged) is announced in the stream with a [`GapNotice`]. A cloud service feeds
//! what it receives, from any MQTT client, to a [`consumer::Consumer`], which recognises
//! duplicates and reports the announced gaps and the unexplained ones: messages lost after the
//! device handed them to the broker.
//!
//! # Features
//!
//! - `cli`: the `edge-outbox` command-line tool.
//! - `demo`: `edge-outbox demo`, with an in-process broker.
//! - `signed-commands`: the device applies only commands signed (COSE_Sign1, Ed25519) by a key
//!   it trusts ([`Options::trusted_command_keys`], [`TrustedKeys`], [`CommandSigner`]); the
//!   requirement is stored in the file and holds for every handle
//!   ([`Outbox::require_signed_commands`]; docs/security.md).
//! - `metrics`: [`metrics::encode`], the store's and the relay's figures in the Prometheus text
//!   format, and [`RelayConfig::metrics_file`] (enabled by `cli`).
//! - `failpoints`: named crash points for the crash tests; never in production builds.
//! - `mutants`: deliberately broken builds the tests must catch (`EDGE_OUTBOX_MUTANT`); never in
//!   production builds.

#![forbid(unsafe_code)]
#![cfg_attr(not(test), deny(clippy::unwrap_used, clippy::expect_used, clippy::panic))]

mod batch_wire;
mod batching;
mod cbor;
mod cloud_profile;
mod commands;
pub mod consumer;
pub mod envelope;
mod error;
#[doc(hidden)]
pub mod failpoint;
mod latest;
#[cfg(feature = "metrics")]
pub mod metrics;
mod mqtt;
#[doc(hidden)]
pub mod mutant;
mod payload_de;
#[cfg(feature = "schemas")]
mod payload_schema;
mod publish;
mod relay;
mod relay_config;
mod report;
mod routing_fields;
#[cfg(feature = "signed-commands")]
mod signed;
mod store;
mod time;
mod topic;

/// The rusqlite this crate is built with: [`Tx`] derefs to its `Transaction` and
/// [`Outbox::with_connection`] lends its `Connection`. Name its types through this path
/// (`edge_outbox::rusqlite::params!`, `edge_outbox::rusqlite::Error`) and they always match.
pub use rusqlite;

pub use batch_wire::BATCH_VERSION;
pub use batching::{Batching, Compression, MAX_BATCH_BYTES};
pub use cloud_profile::CloudProfile;
pub use commands::send_command;
pub use envelope::EnvelopeFormat;
pub use envelope::{Envelope, GapCause, GapNotice, MessageId, Published};
pub use error::{Error, Result, SchemaMismatch};
pub use latest::{LatestStats, LatestValues};
#[cfg(feature = "http-proxy")]
pub use mqtt::HttpProxy;
pub use mqtt::status::AckLatency;
pub use mqtt::{MqttConfig, Protocol, SasKey, TlsConfig, redact_url, subscribe};
#[cfg(feature = "schemas")]
pub use payload_schema::{EventSchema, Schemas};
pub use relay::{Relay, Status};
pub use relay_config::RelayConfig;
pub use report::RelayReport;
#[cfg(feature = "signed-commands")]
pub use signed::{CommandSigner, TrustedKeys};
pub use store::{
    ApplyOutcome, Command, Committed, DeadLetter, Limits, MAX_PRIORITY, Message, MessageClass, OnFull,
    Options, Origin, Outbox, Received, SCHEMA_VERSION, Salvaged, SalvagedTable, Stats, Synchronous, Tx,
    default_path, enqueue, integrity_check, schema_version,
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
