//! `edge-outbox`: inspect a store and run the relay as a standalone process.
//!
//! One module per command; this file holds the command line and maps every failure to a
//! documented exit code (see `exit.rs` and `docs/operations.md`).

#![forbid(unsafe_code)]
#![cfg_attr(not(test), deny(clippy::unwrap_used, clippy::expect_used, clippy::panic))]

mod broker_args;
mod command;
mod config_check;
mod config_file;
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
mod notify;
mod output;
#[cfg(feature = "package-assets")]
mod package_assets;
mod pending;
mod progress;
mod purge;
mod relay;
mod relay_probe;
mod reload;
mod schema;
#[cfg(feature = "schemas")]
mod schema_pending;
mod status;
mod status_file;
#[cfg(feature = "signed-commands")]
mod trust;
#[cfg(feature = "signed-commands")]
mod trusted_keys;

use std::path::{Path, PathBuf};
use std::process::ExitCode;

use clap::parser::ValueSource;
use clap::{ArgMatches, Args, CommandFactory as _, FromArgMatches as _, Parser, Subcommand};

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
    /// Print one JSON document on stdout instead of text.
    #[arg(long, global = true)]
    json: bool,
    /// The database options given before the command (`edge-outbox --db PATH status`).
    #[command(flatten)]
    store: StoreBefore,
    #[command(subcommand)]
    command: Command,
}

/// The options of commands that open a database, given before the command name. Not global:
/// the commands that open none (send-command, encode-command, consume, demo) do not list them.
#[derive(Debug, Clone, Default, Args)]
struct StoreBefore {
    /// The database file, for the commands that open one [default: the data directory of
    /// --app, e.g. ~/.local/share/edge-outbox/outbox.db]
    #[arg(long, value_name = "PATH", conflicts_with = "app")]
    db: Option<PathBuf>,
    /// Use the default database of this application name (as `edge_outbox::default_path`)
    /// [default: edge-outbox]
    #[arg(long, value_name = "NAME")]
    app: Option<String>,
    /// How long to wait for another connection's write lock, in milliseconds [default: 5000]
    #[arg(long, value_name = "MS")]
    busy_timeout: Option<u64>,
}

/// The same options after the command name (`edge-outbox status --db PATH`), where they win.
#[derive(Debug, Clone, Default, Args)]
struct Store {
    /// The database file [default: the data directory of --app, e.g.
    /// ~/.local/share/edge-outbox/outbox.db]
    #[arg(long, global = true, value_name = "PATH", conflicts_with = "app")]
    db: Option<PathBuf>,
    /// Use the default database of this application name (as `edge_outbox::default_path`)
    /// [default: edge-outbox]
    #[arg(long, global = true, value_name = "NAME")]
    app: Option<String>,
    /// How long to wait for another connection's write lock, in milliseconds [default: 5000]
    #[arg(long, global = true, value_name = "MS")]
    busy_timeout: Option<u64>,
}

/// What a command runs with: where the database is, how to print.
#[derive(Debug, Clone)]
pub struct Global {
    /// The database file, if named; else the default one of `app`.
    pub db: Option<PathBuf>,
    /// The application name whose default database is used.
    pub app: String,
    /// One JSON document on stdout instead of text.
    pub json: bool,
    /// How long to wait for another connection's write lock, in milliseconds.
    pub busy_timeout: u64,
}

impl Global {
    /// For a command that opens a database: its own options first, then those before it.
    fn store(json: bool, before: &StoreBefore, after: &Store) -> Global {
        let (db, app) = if after.db.is_some() || after.app.is_some() {
            (after.db.clone(), after.app.clone())
        } else {
            (before.db.clone(), before.app.clone())
        };
        Global {
            db,
            app: app.unwrap_or_else(|| "edge-outbox".to_owned()),
            json,
            busy_timeout: after.busy_timeout.or(before.busy_timeout).unwrap_or(5000),
        }
    }

    /// For a command that opens no database: a database option given before it is a usage
    /// error, not silently ignored.
    fn without_store(json: bool, before: &StoreBefore, command: &str) -> Result<Global> {
        let given = [
            before.db.as_ref().map(|_| "--db"),
            before.app.as_ref().map(|_| "--app"),
            before.busy_timeout.map(|_| "--busy-timeout"),
        ];
        if let Some(option) = given.into_iter().flatten().next() {
            return Err(CliError::usage(format!(
                "{option} applies to the commands that open a database; {command} opens none"
            )));
        }
        Ok(Global {
            db: None,
            app: "edge-outbox".to_owned(),
            json,
            busy_timeout: 5000,
        })
    }
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Pending messages, oldest age, dead letters, evictions, inbox, sizes, and the relay.
    Status {
        #[command(flatten)]
        store: Store,
    },
    /// The store's and the running relay's figures in the Prometheus text format.
    Metrics {
        #[command(flatten)]
        store: Store,
    },
    /// Messages waiting to be published, oldest first, payloads decoded to JSON.
    Pending {
        #[command(flatten)]
        store: Store,
        #[command(flatten)]
        args: pending::PendingArgs,
    },
    /// Commands received, oldest first (unapplied only unless --all), payloads decoded to JSON.
    Inbox {
        #[command(flatten)]
        store: Store,
        #[command(flatten)]
        args: inbox::InboxArgs,
    },
    /// Messages and commands set aside for an operator.
    DeadLetters {
        #[command(flatten)]
        store: Store,
        #[command(subcommand)]
        command: dead_letters::DeadLettersCommand,
    },
    /// Remove pending messages unpublished (a topic's, or all); the cloud is told of the gap.
    Purge {
        #[command(flatten)]
        store: Store,
        #[command(flatten)]
        args: purge::PurgeArgs,
    },
    /// Change the keys commands must be signed by (logged); `status` shows them.
    #[cfg(feature = "signed-commands")]
    #[command(name = "trusted-keys")]
    TrustedKeys {
        #[command(flatten)]
        store: Store,
        #[command(subcommand)]
        command: trust::TrustCommand,
    },
    /// The payload schemas recorded in the file: list, show, check the pending rows.
    Schema {
        #[command(flatten)]
        store: Store,
        #[command(subcommand)]
        command: schema::SchemaCommand,
    },
    /// Check the database file for damage; with --salvage, move a damaged one aside and salvage it.
    Doctor {
        #[command(flatten)]
        store: Store,
        #[command(flatten)]
        args: doctor::DoctorArgs,
    },
    /// Publish the outbox (and receive commands) until SIGINT or SIGTERM.
    Relay {
        #[command(flatten)]
        store: Store,
        /// Read the settings from this TOML file: every option has a key of its name (`db`,
        /// `broker`, `max-in-flight`, ...); an option on the command line wins over its key.
        /// `edge-outbox config check FILE` checks one.
        #[arg(long, value_name = "FILE")]
        config: Option<PathBuf>,
        #[command(flatten)]
        args: Box<relay::RelayArgs>,
    },
    /// The relay's config file.
    Config {
        #[command(subcommand)]
        command: ConfigCommand,
    },
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

#[derive(Debug, Subcommand)]
enum ConfigCommand {
    /// Check a relay config file, and print the settings `relay --config FILE [OPTIONS]` would
    /// run with: every default written out, secrets redacted. Reads the TLS, password and key
    /// files it names; opens no database and no connection. Exit 2 on any error, naming the
    /// file, its line and the key.
    Check {
        /// The config file.
        file: PathBuf,
        #[command(flatten)]
        store: Store,
        #[command(flatten)]
        args: Box<relay::RelayArgs>,
    },
}

fn main() -> ExitCode {
    #[cfg(feature = "package-assets")]
    if let Some(code) = package_assets::intercept(Cli::command()) {
        return code;
    }
    // Help and version go to stdout with 0; usage errors to stderr with 2.
    let matches = Cli::command().get_matches();
    let cli = match Cli::from_arg_matches(&matches) {
        Ok(cli) => cli,
        Err(e) => e.format(&mut Cli::command()).exit(),
    };
    if !matches!(cli.command, Command::Relay { .. }) {
        // The library logs little below warn; the relay sets its own level.
        logging::init(tracing::level_filters::LevelFilter::WARN);
    }
    let (json, before) = (cli.json, &cli.store);
    let on = |store: &Store| Global::store(json, before, store);
    let without = |command: &str| Global::without_store(json, before, command);
    let result = match cli.command {
        Command::Status { store } => status::run(&on(&store)),
        Command::Metrics { store } => metrics::run(&on(&store)),
        Command::Pending { store, args } => pending::run(&on(&store), &args),
        Command::Inbox { store, args } => inbox::run(&on(&store), &args),
        Command::DeadLetters { store, command } => dead_letters::run(&on(&store), &command),
        Command::Purge { store, args } => purge::run(&on(&store), &args),
        Command::Schema { store, command } => schema::run(&on(&store), &command),
        Command::Doctor { store, args } => doctor::run(&on(&store), &args),
        #[cfg(feature = "signed-commands")]
        Command::TrustedKeys { store, command } => trust::run(&on(&store), &command),
        Command::Relay { config, .. } => {
            // The settings are read from the command line's matches and the file, at the start
            // and again on each reload.
            let given = matches.subcommand_matches("relay");
            let read = || -> Result<(Global, relay::RelayArgs)> {
                let m = given.ok_or_else(|| CliError::runtime("the relay's command line is gone"))?;
                let usage = |e: clap::Error| CliError::usage(e.to_string());
                let store = Store::from_arg_matches(m).map_err(usage)?;
                let args = Box::new(relay::RelayArgs::from_arg_matches(m).map_err(usage)?);
                with_file(json, before, store, config.as_deref(), args, given)
            };
            let reread = config.is_some().then_some(&read as reload::Reread<'_>);
            read().and_then(|(global, args)| relay::run(&global, &args, reread))
        }
        Command::Config {
            command: ConfigCommand::Check { file, store, args },
        } => {
            let given = matches
                .subcommand_matches("config")
                .and_then(|m| m.subcommand_matches("check"));
            with_file(json, before, store, Some(&file), args, given)
                .and_then(|(global, args)| config_check::run(&global, &args))
        }
        Command::Consume(args) => without("consume").and_then(|g| consume::run(&g, &args)),
        Command::Send(args) => without("send-command").and_then(|g| command::send(&g, &args)),
        Command::Encode(args) => without("encode-command").and_then(|_| command::encode(&args)),
        #[cfg(feature = "demo")]
        Command::Demo => without("demo").and_then(|g| demo::run(&g)),
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

/// The relay's settings: the config file's keys (if one is named) under the command line's
/// options. `given` holds the command's own matches, which say what the command line gave.
fn with_file(
    json: bool,
    before: &StoreBefore,
    mut store: Store,
    file: Option<&Path>,
    mut args: Box<relay::RelayArgs>,
    given: Option<&ArgMatches>,
) -> Result<(Global, relay::RelayArgs)> {
    if let Some(path) = file {
        let mut keys = config_file::load(path)?;
        if [&before.db, &store.db].iter().all(|db| db.is_none())
            && [&before.app, &store.app].iter().all(|app| app.is_none())
        {
            store.db = keys.db.take();
            store.app = keys.app.take();
        }
        if before.busy_timeout.is_none() && store.busy_timeout.is_none() {
            store.busy_timeout = keys.busy_timeout.take();
        }
        let on_command_line =
            |id: &str| given.is_some_and(|m| m.value_source(id) == Some(ValueSource::CommandLine));
        config_file::merge(keys, &mut args, on_command_line);
    }
    Ok((Global::store(json, before, &store), *args))
}

/// Shorthand for command results.
pub type Result<T, E = CliError> = std::result::Result<T, E>;
