//! `edge-outbox relay`: the relay (and command session) as a standalone process, for
//! applications that write through the SQL contract. Runs until SIGINT or SIGTERM, then stops
//! cleanly: in-flight messages get up to `--shutdown-timeout` for their PUBACK, and whatever is
//! not acknowledged stays in the outbox for the next start.

use std::io::{IsTerminal as _, Write as _};
use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::thread;
use std::time::{Duration, Instant};

use clap::Args;
use crossbeam_channel::{Receiver, RecvTimeoutError};
use edge_outbox::{Batching, CloudProfile, Compression, Protocol, Relay, RelayConfig, Status};
use serde_json::json;
use signal_hook::consts::{SIGHUP, SIGINT, SIGTERM};
use signal_hook::iterator::Signals;
use tracing::level_filters::LevelFilter;

use crate::broker_args::BrokerArgs;
use crate::exit::CliError;
use crate::notify::Notifier;
use crate::output::{self, bytes, duration};
use crate::progress::DrainBar;
use crate::reload::{self, Reread};
use crate::{Global, Result, db, logging};

/// How often the live status line is redrawn on a terminal.
const LIVE_TICK: Duration = Duration::from_millis(250);
/// How often a summary is logged when stderr is not a terminal.
const LOG_EVERY: Duration = Duration::from_secs(60);
/// Off a terminal, how often the command checks that the relay's threads still run.
const CHECK_EVERY: Duration = Duration::from_secs(5);

#[derive(Debug, Clone, Args)]
#[command(after_help = "\
The database is created if it does not exist (other commands never create it). Other processes \
write to it through the SQL contract (docs/schema.md) and the relay notices their commits \
within the poll interval.

While it runs, the relay keeps <db>.relay-status.json up to date (rewritten when something \
changes, at least every 30 s); `edge-outbox status` shows it. --metrics-file keeps the same \
figures in the Prometheus text format for node_exporter's textfile collector. A second SIGINT or SIGTERM while stopping exits at once (code 1); messages not yet \
acknowledged stay pending and are published again on the next start.

MQTT 5 is the default: a broker can then refuse a message (ACL, size, quota) and the relay moves \
it to the dead letters with the reason code (`edge-outbox dead-letters list`). Under \
--mqtt-version 3.1.1 a broker cannot refuse: a message its ACL denies or that is above its size \
limit is acknowledged and lost (docs/reliability.md says which broker settings prevent it). A \
message the broker keeps dropping the connection over is set aside as poison after \
--poison-disconnects tries, so the rest of the outbox flows.

--progress draws a bar on stderr while a backlog drains: rows acknowledged since start, rows \
left, rate and ETA. It is drawn only when stderr is a terminal (and TERM is set and not `dumb`); \
otherwise the relay logs as without it.

Credentials: --username with --password-file, or user:password@ in the URL (visible to other \
local users in the process list: prefer the file). The password is never printed.

Exit codes: 0 stopped on a signal, 1 runtime error (also: a relay thread stopped; a bug, a \
panic, aborts the release build instead), 2 usage \
error (bad URL, TLS or password file), 3 database error, 4 another relay runs on this database.")]
pub struct RelayArgs {
    #[command(flatten)]
    pub broker: BrokerArgs,
    /// MQTT client id of the publishing session: one per device (required, here or as
    /// `client-id` in --config).
    #[arg(long, value_name = "ID")]
    pub client_id: Option<String>,
    /// Apply only commands signed by this key (repeatable): KEY_ID=FILE, the file holding the
    /// Ed25519 public key as 64 hex digits. The first start records the keys in the database;
    /// every later handle on it, this relay with no --trusted-key included, verifies with them.
    /// A start naming other keys than the file's is refused.
    #[cfg(feature = "signed-commands")]
    #[arg(long, value_name = "KEY_ID=FILE")]
    pub trusted_key: Vec<String>,
    /// The `src` of every envelope: the device's name as the cloud knows it [default: the
    /// client id]. Keep it stable: the cloud counts each source's messages (docs/wire-format.md).
    #[arg(long, value_name = "NAME")]
    pub src: Option<String>,
    /// Receive commands on this topic filter into the inbox (a second, persistent session, or
    /// the publishing one with --single-session).
    #[arg(long, value_name = "FILTER")]
    pub commands: Option<String>,
    /// Client id of the command session [default: <client-id>-commands].
    #[arg(
        long,
        value_name = "ID",
        requires = "commands",
        conflicts_with = "single_session"
    )]
    pub commands_client_id: Option<String>,
    /// One session per device: commands arrive on the publishing session's client id (for
    /// Azure IoT Hub, and AWS IoT policies that pin the client id). A --profile implies it.
    #[arg(long, requires = "commands")]
    pub single_session: bool,
    /// Follow a cloud's settings and limits: MQTT version, message size, one session per device,
    /// in-flight cap, ALPN on 443 (AWS), topic rules (docs/operations.md lists each). Options
    /// given explicitly override its settings; its rules stay.
    #[arg(long, value_name = "CLOUD", value_parser = ["aws-iot-core", "azure-iot-hub", "azure-event-grid"])]
    pub profile: Option<String>,
    /// Repeat each message's id, src, ep, seq, key and type outside the payload, for a cloud's
    /// rules engine: MQTT 5 user properties, or Azure IoT Hub's property bag [default: on with
    /// a --profile, else off].
    #[arg(long, value_name = "on|off", value_parser = clap::builder::BoolishValueParser::new())]
    pub routing_fields: Option<bool>,
    /// Publish CBOR envelopes, or JSON ones with the same fields for rules engines that read
    /// JSON bodies (a payload JSON cannot carry is dead-lettered) [default: cbor].
    #[arg(long, value_name = "FORMAT", value_parser = ["cbor", "json"])]
    pub envelope: Option<String>,
    /// Client certificate chain (PEM) for mutual TLS (mqtts only; with --key).
    #[arg(long, value_name = "FILE", requires = "key")]
    pub cert: Option<PathBuf>,
    /// Client private key (PEM) for mutual TLS (with --cert).
    #[arg(long, value_name = "FILE", requires = "cert")]
    pub key: Option<PathBuf>,
    /// Publish `online` (retained) here on connect, with `offline` as the last will.
    #[arg(long, value_name = "TOPIC")]
    pub status_topic: Option<String>,
    /// Most messages published and not yet acknowledged (beyond the broker's receive maximum they
    /// wait in the client's queue, except in a session shared with commands; an alarm waits behind
    /// up to this many: lower it on a slow link).
    #[arg(long, value_name = "N", default_value_t = 100,
          value_parser = clap::value_parser!(u16).range(1..))]
    pub max_in_flight: u16,
    /// Seconds to wait for in-flight acknowledgements when stopping.
    #[arg(long, value_name = "SECS", default_value_t = 5)]
    pub shutdown_timeout: u64,
    /// Seconds the oldest message in flight may wait for its PUBACK before the connection is
    /// renewed (and the wait counts against that message).
    #[arg(long, value_name = "SECS", default_value_t = 60,
          value_parser = clap::value_parser!(u64).range(1..))]
    pub ack_timeout: u64,
    /// Set a message aside to the dead letters once this many connections in a row ended over
    /// it (0: never).
    #[arg(long, value_name = "N", default_value_t = 3)]
    pub poison_disconnects: u32,
    /// Use MQTT 5 topic aliases: fewer bytes per message when topics repeat (see
    /// MqttConfig::topic_aliases for the brokers that mishandle them).
    #[arg(long)]
    pub topic_aliases: bool,
    /// Do not send MQTT 5's message expiry interval with messages that have a lifetime (for
    /// rumqttd 0.20 with MQTT 3.1.1 subscribers, whose listener crashes on MQTT 5 properties).
    #[arg(long)]
    pub no_message_expiry: bool,
    /// Keep the store's and the relay's metrics in this file, in the Prometheus text format
    /// (for node_exporter's textfile collector: a `*.prom` file in its directory); rewritten
    /// atomically when something changes, at least every 30 s; removed at exit.
    #[arg(long, value_name = "FILE")]
    pub metrics_file: Option<PathBuf>,
    /// The metrics file's permission bits, in octal: 600 (the owner only, the default), 640 (its
    /// group too: node_exporter's textfile collector runs as another user) or 644. Set exactly,
    /// whatever the umask.
    #[arg(long, value_name = "MODE", value_parser = parse_mode, requires = "metrics_file")]
    pub metrics_mode: Option<u32>,
    /// On a terminal, a progress bar instead of the status line: rows left, rate and ETA while
    /// a backlog drains. Never drawn when stderr is not a terminal.
    #[arg(long)]
    pub progress: bool,
    /// Batch the messages whose topic matches this filter (repeatable): consecutive messages of
    /// one topic go out as one publish, each still a full envelope (docs/wire-format.md,
    /// "Batches"; consumers must unpack them).
    #[arg(long, value_name = "FILTER")]
    pub batch: Vec<String>,
    /// Most bytes of envelopes in one batch, before compression.
    #[arg(long, value_name = "BYTES", default_value_t = 16 * 1024, requires = "batch")]
    pub batch_max_bytes: usize,
    /// Milliseconds a partial batch waits for more messages of its topic.
    #[arg(long, value_name = "MS", default_value_t = 50, requires = "batch")]
    pub batch_linger_ms: u64,
    /// Compress each batch with zlib.
    #[arg(long, requires = "batch")]
    pub batch_zlib: bool,
    /// Publish at most this many messages a second (a metered link; highest priority first).
    #[arg(long, value_name = "N", value_parser = clap::value_parser!(u32).range(1..))]
    pub pace_messages: Option<u32>,
    /// Publish at most this many bytes (topic and payload) a second.
    #[arg(long, value_name = "BYTES", value_parser = clap::value_parser!(u64).range(1..))]
    pub pace_bytes: Option<u64>,
    /// FILTER=SECS: messages on matching topics written without a lifetime of their own expire
    /// this long after their commit (removed unpublished, announced as a gap). Repeatable; the
    /// first match applies.
    #[arg(long, value_name = "FILTER=SECS", value_parser = parse_lifetime)]
    pub expire: Vec<(String, Duration)>,
    /// How log lines are written on stderr: `text`, or `json` (one object per line, for
    /// journald's and log shippers' JSON parsers).
    #[arg(long, value_name = "FORMAT", value_enum, default_value_t = logging::LogFormat::Text)]
    pub log_format: logging::LogFormat,
    /// The least severe log lines written; RUST_LOG, when set, overrides it (e.g.
    /// `edge_outbox=debug,rumqttc=warn`).
    #[arg(long, value_name = "LEVEL", value_enum, default_value_t = logging::LogLevel::Info)]
    pub log_level: logging::LogLevel,
}

/// An octal permission mode for `--metrics-mode`, at most 644 and at least 600.
pub fn parse_mode(arg: &str) -> std::result::Result<u32, String> {
    let mode = u32::from_str_radix(arg.trim_start_matches("0o"), 8)
        .map_err(|_| format!("{arg:?} is not an octal mode, e.g. 640"))?;
    if mode & !0o644 != 0 || mode & 0o600 != 0o600 {
        return Err(format!(
            "{arg}: the owner must read and write the file, and nobody else write or execute it (600, 640 or 644)"
        ));
    }
    Ok(mode)
}

/// `FILTER=SECS` for `--expire`.
pub fn parse_lifetime(arg: &str) -> std::result::Result<(String, Duration), String> {
    let (filter, secs) = arg
        .rsplit_once('=')
        .ok_or_else(|| format!("{arg:?}: expected FILTER=SECS, e.g. telemetry/#=3600"))?;
    let secs: u64 = secs
        .parse()
        .map_err(|_| format!("{arg:?}: {secs:?} is not a whole number of seconds"))?;
    if filter.is_empty() || secs == 0 {
        return Err(format!(
            "{arg:?}: the filter must not be empty and the lifetime at least 1 s"
        ));
    }
    Ok((filter.to_owned(), Duration::from_secs(secs)))
}

/// Why [`Watch::until_stop`] returned.
enum Stop {
    /// SIGINT or SIGTERM.
    Signal(i32),
    /// SIGHUP: re-read the settings.
    Reload,
    /// A relay thread ended on its own, or the database file is damaged.
    Ended,
}

/// Runs the relay until SIGINT or SIGTERM. With `reread` (a `--config` file), SIGHUP applies
/// the file's settings again (`reload.rs` says what changes and how).
pub fn run(global: &Global, args: &RelayArgs, reread: Option<Reread<'_>>) -> Result<()> {
    logging::init_as(LevelFilter::from(args.log_level), args.log_format);
    // Every argument is checked before anything is opened or created.
    let config = config(args)?;
    let path = db::path_creating_dir(global)?;
    let existed = path.exists();
    #[cfg(feature = "signed-commands")]
    let keys = crate::trusted_keys::parse(&args.trusted_key)?;
    #[cfg(not(feature = "signed-commands"))]
    let keys = None;
    let outbox = db::open_outbox_with(global, &path, keys)?;
    if !existed {
        tracing::warn!(target: "edge_outbox::cli", path = %path.display(), "there was no database: created a new one");
    }
    // Before the relay starts, so a signal from now on stops it cleanly.
    let stopping = Arc::new(AtomicBool::new(false));
    let installing = |e: std::io::Error| CliError::runtime(format!("installing signal handlers: {e}"));
    for signal in [SIGINT, SIGTERM] {
        // Exits at once on a second signal, once the first has set `stopping`. Registered
        // before the iterator: a handler's actions run in registration order, so the first
        // signal checks the flag before the thread that sets it can wake up.
        signal_hook::flag::register_conditional_shutdown(signal, 1, stopping.clone()).map_err(installing)?;
    }
    let signals = Signals::new([SIGINT, SIGTERM, SIGHUP]).map_err(installing)?;
    let (handle, received, waiter) = forward_signals(signals, &stopping)?;
    let mut relay = Relay::start(&outbox, config.clone())?;
    let broker = broker_of(&config);
    // The lock is held and the database open: ready, as far as a service manager can tell.
    let mut notifier = Notifier::from_env();
    notifier.ready(&first_line(&relay, &broker));
    let tty = std::io::stderr().is_terminal();
    if args.progress && !tty {
        tracing::info!(target: "edge_outbox::cli", "--progress: stderr is not a terminal, no bar drawn");
    }
    let mut watch = Watch {
        broker,
        tty,
        bar: (args.progress && tty).then(DrainBar::stderr),
        notifier,
    };
    let mut running = args.clone();
    let signal = loop {
        match watch.until_stop(&relay, &received) {
            Stop::Signal(signal) => break Some(signal),
            Stop::Ended => break None,
            Stop::Reload => {
                let Some(plan) = reload::plan(reread, global, &path, &running) else {
                    continue;
                };
                watch.notifier.reloading();
                tracing::info!(target: "edge_outbox::cli", "reload: stopping the relay's threads to start them with the new settings");
                if let Err(e) = relay.shutdown() {
                    return Err(CliError::runtime(format!("a relay thread stopped: {e}")));
                }
                let applied = if edge_outbox::mutant::active("reload-keeps-running-config") {
                    config.clone()
                } else {
                    plan.config.clone()
                };
                relay = Relay::start(&outbox, applied)?;
                apply_log_level(&running, &plan.args);
                for change in &plan.changes {
                    tracing::info!(target: "edge_outbox::cli", change = %change, "reload: applied");
                }
                tracing::info!(target: "edge_outbox::cli", changed = plan.changes.len(), "reload: done; credentials and certificates read again");
                watch.broker = broker_of(&plan.config);
                watch.notifier.ready(&first_line(&relay, &watch.broker));
                running = plan.args;
            }
        }
    };
    watch.notifier.stopping();
    drop(watch);
    handle.close();
    let _ = waiter.join();

    if let Some(signal) = signal {
        tracing::info!(target: "edge_outbox::cli", signal = signal_name(signal), "stopping");
    }
    let at_signal = relay.status().ok();
    let result = relay.shutdown();
    logging::clear_line();
    let Some(signal) = signal else {
        if let Some(why) = at_signal.as_ref().and_then(|s| s.database_damaged.clone()) {
            return Err(CliError::runtime(format!(
                "the database file is damaged ({why}): stopped so that the next start salvages it"
            )));
        }
        // A relay thread ended on its own: exit 1 so a supervisor restarts the relay, rather than
        // idle while nothing is published.
        let why = result
            .err()
            .map_or_else(|| "no error reported".to_owned(), |e| e.to_string());
        return Err(CliError::runtime(format!("a relay thread stopped: {why}")));
    };
    result.map_err(|e| CliError::runtime(format!("the relay stopped with an error: {e}")))?;
    let name = signal_name(signal);
    let pending = outbox.stats().map(|s| s.pending_messages).ok();
    summarize(global, name, at_signal.as_ref(), pending)
}

/// `HOST:PORT` of the first broker, for status lines until the relay names the one it uses.
fn broker_of(config: &RelayConfig) -> String {
    format!("{}:{}", config.mqtt().host(), config.mqtt().port())
}

/// The status line that goes with `READY=1`.
fn first_line(relay: &Relay, broker: &str) -> String {
    match relay.status() {
        Ok(s) => live_line(broker, &s),
        Err(e) => {
            tracing::warn!(target: "edge_outbox::cli", error = %e, "could not read the relay's status");
            format!("starting: connecting to {broker}")
        }
    }
}

/// A reload's new log level, unless RUST_LOG chose the filter.
fn apply_log_level(running: &RelayArgs, new: &RelayArgs) {
    if running.log_level == new.log_level {
        return;
    }
    match logging::set_level(LevelFilter::from(new.log_level)) {
        Ok(true) => {}
        Ok(false) => {
            tracing::warn!(target: "edge_outbox::cli", "reload: RUST_LOG is set and chooses the log filter; log-level not applied")
        }
        Err(e) => tracing::warn!(target: "edge_outbox::cli", error = %e, "reload: log-level not applied"),
    }
}

/// A thread that hands each signal to the main loop; SIGINT and SIGTERM also set `stopping`
/// (a second one then exits at once).
fn forward_signals(
    signals: Signals,
    stopping: &Arc<AtomicBool>,
) -> Result<(
    signal_hook::iterator::Handle,
    Receiver<i32>,
    thread::JoinHandle<()>,
)> {
    let (tx, rx) = crossbeam_channel::unbounded();
    let handle = signals.handle();
    let stopping = stopping.clone();
    let waiter = thread::Builder::new()
        .name("edge-outbox-signals".into())
        .spawn(move || {
            let mut signals = signals;
            for signal in signals.forever() {
                if signal != SIGHUP {
                    stopping.store(true, Ordering::SeqCst);
                }
                if tx.send(signal).is_err() {
                    break;
                }
            }
        })
        .map_err(|e| CliError::runtime(format!("spawning the signal thread: {e}")))?;
    Ok((handle, rx, waiter))
}

/// Broker settings from the arguments (and the config file's keys merged into them); every
/// problem is a usage error (exit 2). Reads the password and TLS files, and opens nothing else.
pub fn config(args: &RelayArgs) -> Result<RelayConfig> {
    let client_id = match args.client_id.as_deref() {
        None => {
            return Err(CliError::usage(
                "--client-id is required (or client-id in the --config file)",
            ));
        }
        Some("") => return Err(CliError::usage("--client-id must not be empty")),
        Some(id) => id,
    };
    check_pairs(args)?;
    let client_auth = args.cert.as_deref().zip(args.key.as_deref());
    let profile = args
        .profile
        .as_deref()
        .map(str::parse::<CloudProfile>)
        .transpose()?;
    let mut mqtt = args.broker.mqtt(client_auth)?;
    if let Some(profile) = profile {
        mqtt = mqtt.cloud(profile);
        // An explicit version wins over the profile's.
        if let Some(version) = &args.broker.mqtt_version {
            mqtt = mqtt.protocol(version.parse::<Protocol>()?);
        }
    }
    let mut mqtt = mqtt
        .client_id(client_id)
        .topic_aliases(args.topic_aliases)
        .message_expiry(!args.no_message_expiry);
    if let Some(topic) = &args.status_topic {
        mqtt = mqtt.status_topic(topic);
    }
    let mut config = RelayConfig::new(mqtt);
    // The profile first: the options after it replace its settings, and an explicit
    // --max-in-flight above its cap is refused rather than lowered.
    if let Some(profile) = profile {
        config = config.cloud(profile);
    }
    let mut config = config
        .status_file(true)
        .source(args.src.as_deref().unwrap_or(client_id))
        .max_in_flight(args.max_in_flight.into())
        .shutdown_timeout(Duration::from_secs(args.shutdown_timeout))
        .ack_timeout(Duration::from_secs(args.ack_timeout))
        .poison_disconnects(args.poison_disconnects);
    if let Some(filter) = &args.commands {
        config = config.commands(filter);
    }
    if let Some(id) = &args.commands_client_id {
        config = config.commands_client_id(id);
    }
    if args.single_session {
        config = config.single_session(true);
    }
    if let Some(on) = args.routing_fields {
        config = config.routing_fields(on);
    }
    if let Some(format) = &args.envelope {
        config = config.envelope_format(format.parse()?);
    }
    if let Some(file) = &args.metrics_file {
        config = config.metrics_file(file);
    }
    if let Some(mode) = args.metrics_mode {
        config = config.metrics_file_mode(mode);
    }
    let batching = Batching::new()
        .max_bytes(args.batch_max_bytes)
        .linger(Duration::from_millis(args.batch_linger_ms))
        .compression(if args.batch_zlib {
            Compression::Zlib
        } else {
            Compression::None
        });
    for filter in &args.batch {
        config = config.batch(filter, batching);
    }
    if let Some(n) = args.pace_messages {
        config = config.pace_messages(n);
    }
    if let Some(bytes) = args.pace_bytes {
        config = config.pace_bytes(bytes);
    }
    for (filter, lifetime) in &args.expire {
        config = config.expire_after(filter, *lifetime);
    }
    // What the relay would refuse at start, refused here: `config check` says so, and a reload
    // keeps the running settings instead of stopping on them.
    config.check()?;
    Ok(config)
}

/// Options that only mean something with another one. The command line checks these itself;
/// this catches a config file's keys, or a key and an option, that leave one out.
fn check_pairs(args: &RelayArgs) -> Result<()> {
    let pairs = [
        (args.cert.is_some(), args.key.is_some(), "cert", "key"),
        (args.key.is_some(), args.cert.is_some(), "key", "cert"),
        (
            args.metrics_mode.is_some(),
            args.metrics_file.is_some(),
            "metrics-mode",
            "metrics-file",
        ),
        (
            args.commands_client_id.is_some(),
            args.commands.is_some(),
            "commands-client-id",
            "commands",
        ),
        (
            args.single_session,
            args.commands.is_some(),
            "single-session",
            "commands",
        ),
        (
            args.broker.password_file.is_some(),
            args.broker.username.is_some(),
            "password-file",
            "username",
        ),
        (
            args.broker.password_env.is_some(),
            args.broker.username.is_some(),
            "password-env",
            "username",
        ),
    ];
    if let Some((_, _, option, needs)) = pairs.iter().find(|(set, other, ..)| *set && !*other) {
        return Err(CliError::usage(format!("{option} needs {needs} as well")));
    }
    if args.broker.password_file.is_some() && args.broker.password_env.is_some() {
        return Err(CliError::usage(
            "password-file and password-env both name the password: give one",
        ));
    }
    Ok(())
}

/// The running relay's outputs: the live line (or, with --progress, the drain bar) on a
/// terminal, or periodic log lines. (The relay writes the status file itself.)
struct Watch {
    broker: String,
    tty: bool,
    /// Only when stderr is a terminal; dropped (erased) when the watch ends.
    bar: Option<DrainBar>,
    /// The service manager's status line and watchdog.
    notifier: Notifier,
}

impl Watch {
    /// Reports until a signal arrives or a relay thread ends.
    fn until_stop(&mut self, relay: &Relay, signals: &Receiver<i32>) -> Stop {
        let tick = if self.tty { LIVE_TICK } else { CHECK_EVERY };
        let tick = self.notifier.tick_every().map_or(tick, |w| w.min(tick));
        let mut last_log = Instant::now();
        let mut status_failed = false;
        loop {
            if relay.is_finished() {
                return Stop::Ended;
            }
            let status = match relay.status() {
                Ok(s) => {
                    status_failed = false;
                    Some(s)
                }
                Err(e) => {
                    // Without a status no watchdog ping goes out either: say why, once.
                    if !status_failed {
                        tracing::warn!(target: "edge_outbox::cli", error = %e, "could not read the relay's status");
                    }
                    status_failed = true;
                    None
                }
            };
            if status.as_ref().is_some_and(|s| s.database_damaged.is_some()) {
                // The next start salvages the file: exit for the supervisor to restart us.
                return Stop::Ended;
            }
            if let Some(s) = &status {
                let broker = s.broker.as_deref().unwrap_or(&self.broker);
                self.notifier.tick(s, &live_line(broker, s));
            }
            if let Some(s) = status.filter(|_| self.tty || last_log.elapsed() >= LOG_EVERY) {
                let broker = s.broker.as_deref().unwrap_or(&self.broker);
                if let Some(bar) = &self.bar {
                    bar.update(link(broker, &s), &s);
                } else if self.tty {
                    logging::show_line(&live_line(broker, &s));
                } else {
                    last_log = Instant::now();
                    log_summary(&s);
                }
            }
            match signals.recv_timeout(tick) {
                Ok(SIGHUP) => return Stop::Reload,
                Ok(signal) => return Stop::Signal(signal),
                Err(RecvTimeoutError::Timeout) => {}
                Err(RecvTimeoutError::Disconnected) => return Stop::Signal(SIGTERM),
            }
        }
    }
}

/// Where the relay stands with its broker, for the live line and the drain bar.
fn link(broker: &str, s: &Status) -> String {
    if s.connected {
        format!("connected to {broker}")
    } else {
        format!("connecting to {broker}")
    }
}

fn live_line(broker: &str, s: &Status) -> String {
    let link = link(broker, s);
    let oldest = s
        .store
        .oldest_pending_age
        .map_or(String::new(), |a| format!(", oldest {}", duration(a)));
    let mut line = format!(
        "{link} | pending {} ({}{oldest}) | in flight {} | published {} acked {} | dead {}",
        s.store.pending_messages,
        bytes(s.store.pending_bytes),
        s.in_flight,
        s.published,
        s.acknowledged,
        s.store.dead_letters
    );
    if let (false, Some(error)) = (s.connected, &s.last_error) {
        line.push_str(&format!(" | {error}"));
    }
    // Longer than the terminal, it would wrap and the next redraw could not erase it.
    line.chars().take(110).collect()
}

fn log_summary(s: &Status) {
    tracing::info!(
        target: "edge_outbox::cli",
        connected = s.connected,
        pending = s.store.pending_messages,
        oldest_pending_ms = s.store.oldest_pending_age.map(|a| a.as_millis() as u64),
        in_flight = s.in_flight,
        published = s.published,
        acknowledged = s.acknowledged,
        dead_letters = s.store.dead_letters,
        commands_received = s.commands_received,
        commands_malformed = s.commands_malformed,
        commands_rejected = s.commands_rejected,
        commands_dead_lettered = s.commands_dead_lettered,
        last_error = s.last_error.as_deref().filter(|_| !s.connected),
        "relay status"
    );
}

fn signal_name(signal: i32) -> &'static str {
    match signal {
        SIGINT => "SIGINT",
        _ => "SIGTERM",
    }
}

/// The last word: what was done, and what is left for next time.
fn summarize(global: &Global, signal: &str, s: Option<&Status>, pending: Option<u64>) -> Result<()> {
    let (published, acknowledged) = s.map_or((0, 0), |s| (s.published, s.acknowledged));
    if global.json {
        return output::print_json(&json!({
            "stopped_by": signal,
            "published": published,
            "acknowledged": acknowledged,
            "pending": pending,
        }));
    }
    let left = pending.map_or(String::new(), |n| {
        format!("; {n} pending (published on the next start)")
    });
    // Always said, whatever RUST_LOG: it is the answer to "did it stop cleanly?".
    let _ = writeln!(
        std::io::stderr(),
        "edge-outbox: stopped on {signal}: {published} published, {acknowledged} acknowledged{left}"
    );
    Ok(())
}
