//! `edge-outbox`: inspect a store and run the relay as a standalone process.
//!
//! One module per command; this file holds the command line and maps every failure to a
//! documented exit code (see `exit.rs` and `docs/operations.md`).

#![forbid(unsafe_code)]
#![cfg_attr(not(test), deny(clippy::unwrap_used, clippy::expect_used, clippy::panic))]

mod broker_args;
mod command;
mod consume;
mod db;
mod dead_letters;
mod decode;
#[cfg(feature = "demo")]
mod demo;
mod doctor;
mod exit;
mod inbox;
mod logging;
mod metrics;
mod output;
mod pending;
mod progress;
mod purge;
mod relay;
mod relay_probe;
mod status;
mod status_file;
#[cfg(feature = "signed-commands")]
mod trust;
#[cfg(feature = "signed-commands")]
mod trusted_keys;

use std::path::PathBuf;
use std::process::ExitCode;

use clap::{Args, Parser, Subcommand};

use crate::exit::CliError;

const EXIT_CODES: &str = "\
Exit codes:
  0  success (the relay: stopped cleanly on SIGINT or SIGTERM)
  1  runtime error (I/O, a relay thread failed, an unexpected database error)
  2  usage error (bad arguments, a bad broker URL, unreadable TLS or password files)
  3  database error (no such file, not an SQLite or edge-outbox database, locked, read-only,
     schema too new)
  4  another relay is already running on this database
  5  the dead letter named does not exist
  6  consume --fail-on-gap: messages went missing without a gap notice

Errors are one line on stderr. See docs/operations.md.";

/// Inspect an edge-outbox store and run its relay.
///
/// Reading commands (status, pending, inbox, dead-letters list) open the database read-only and
/// never create it; they work while another process writes.
#[derive(Debug, Parser)]
#[command(name = "edge-outbox", version, after_help = EXIT_CODES)]
struct Cli {
    #[command(flatten)]
    global: Global,
    #[command(subcommand)]
    command: Command,
}

/// Options every command takes.
#[derive(Debug, Clone, Args)]
pub struct Global {
    /// The database file [default: the data directory of --app, e.g.
    /// ~/.local/share/edge-outbox/outbox.db]
    #[arg(long, global = true, value_name = "PATH", conflicts_with = "app")]
    pub db: Option<PathBuf>,
    /// Use the default database of this application name (as `edge_outbox::default_path`).
    #[arg(long, global = true, value_name = "NAME", default_value = "edge-outbox")]
    pub app: String,
    /// Print one JSON document on stdout instead of text.
    #[arg(long, global = true)]
    pub json: bool,
    /// How long to wait for another connection's write lock, in milliseconds.
    #[arg(long, global = true, value_name = "MS", default_value_t = 5000)]
    pub busy_timeout: u64,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Pending messages, oldest age, dead letters, evictions, inbox, sizes, and the relay.
    Status,
    /// The store's and the running relay's figures in the Prometheus text format.
    Metrics,
    /// Messages waiting to be published, oldest first, payloads decoded to JSON.
    Pending(pending::PendingArgs),
    /// Commands received, oldest first (unapplied only unless --all), payloads decoded to JSON.
    Inbox(inbox::InboxArgs),
    /// Messages and commands set aside for an operator.
    #[command(subcommand)]
    DeadLetters(dead_letters::DeadLettersCommand),
    /// Remove pending messages unpublished (a topic's, or all); the cloud is told of the gap.
    Purge(purge::PurgeArgs),
    /// Change the keys commands must be signed by (logged); `status` shows them.
    #[cfg(feature = "signed-commands")]
    #[command(subcommand, name = "trusted-keys")]
    TrustedKeys(trust::TrustCommand),
    /// Check the database file for damage; with --salvage, move a damaged one aside and salvage it.
    Doctor(doctor::DoctorArgs),
    /// Publish the outbox (and receive commands) until SIGINT or SIGTERM.
    Relay(Box<relay::RelayArgs>),
    /// Send a command to a device: a CBOR envelope built from JSON, published at QoS 1.
    #[command(name = "send-command")]
    Send(Box<command::SendArgs>),
    /// Write a command's CBOR envelope to stdout (for mosquitto_pub -s, or any other sender).
    #[command(name = "encode-command")]
    Encode(command::EncodeArgs),
    /// Subscribe as the cloud and print, per device, what arrived, what it announced as
    /// removed, and what went missing unexplained.
    Consume(Box<consume::ConsumeArgs>),
    /// The dual-write problem and its fix, with real processes and crashes: prints a table.
    #[cfg(feature = "demo")]
    Demo,
    /// A demo device or consumer (started by `demo`).
    #[cfg(feature = "demo")]
    #[command(hide = true)]
    DemoChild(demo::ChildArgs),
    /// rumqttd on loopback until stdin closes (the test suite's broker where mosquitto is absent).
    #[cfg(feature = "demo")]
    #[command(hide = true)]
    Broker(demo::BrokerArgs),
}

fn main() -> ExitCode {
    let cli = match Cli::try_parse() {
        Ok(cli) => cli,
        // Help and version go to stdout with 0; usage errors to stderr with 2.
        Err(e) => e.exit(),
    };
    if !matches!(cli.command, Command::Relay(_)) {
        // The library logs little below warn; the relay sets its own level.
        logging::init(tracing::level_filters::LevelFilter::WARN);
    }
    let result = match cli.command {
        Command::Status => status::run(&cli.global),
        Command::Metrics => metrics::run(&cli.global),
        Command::Pending(args) => pending::run(&cli.global, &args),
        Command::Inbox(args) => inbox::run(&cli.global, &args),
        Command::DeadLetters(command) => dead_letters::run(&cli.global, &command),
        Command::Purge(args) => purge::run(&cli.global, &args),
        Command::Doctor(args) => doctor::run(&cli.global, &args),
        #[cfg(feature = "signed-commands")]
        Command::TrustedKeys(command) => trust::run(&cli.global, &command),
        Command::Consume(args) => consume::run(&cli.global, &args),
        Command::Relay(args) => relay::run(&cli.global, &args),
        Command::Send(args) => command::send(&cli.global, &args),
        Command::Encode(args) => command::encode(&args),
        #[cfg(feature = "demo")]
        Command::Demo => demo::run(&cli.global),
        #[cfg(feature = "demo")]
        Command::DemoChild(args) => demo::run_child(&args),
        #[cfg(feature = "demo")]
        Command::Broker(args) => demo::run_broker(&args),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => e.report(),
    }
}

/// Shorthand for command results.
pub type Result<T, E = CliError> = std::result::Result<T, E>;
