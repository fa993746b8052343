//! The relay: background threads that publish the outbox over MQTT and, optionally, receive and
//! apply commands.

mod durability;
mod gaps;
mod lock;

pub(crate) use gaps::FALLBACK_TOPIC as GAP_FALLBACK_TOPIC;

/// The relay lock of `db`, taken while a damaged file is salvaged: no relay may use it meanwhile.
pub(crate) fn lock_for_salvage(db: &std::path::Path) -> Result<RelayLock> {
    RelayLock::acquire(db)
}
mod marker;
mod publisher;
mod report;
pub(crate) mod rows;
mod watch;

use std::fmt::Display;
use std::sync::Arc;
use std::thread::{self, JoinHandle};
use std::time::{Duration, Instant};

use crossbeam_channel::{Receiver, RecvTimeoutError, Sender};

use self::lock::RelayLock;
use self::marker::{Marker, Marks};
use self::publisher::{DEFAULT_SHUTDOWN_TIMEOUT, Publisher};
pub use self::report::RelayReport;
use self::report::{Identity, Reporter};
use self::watch::FileWatch;
pub(crate) use self::watch::Unsettled;
use crate::commands::{CommandSession, DeliveryLimits, Handler, TwoPhase, run_handler, validate_filter};
use crate::error::{Error, Result};
use crate::mqtt::backoff::Backoff;
use crate::mqtt::driver::{Driver, Flow, SessionHandle, Signal};
pub use crate::mqtt::status::Status;
use crate::mqtt::status::StatusCell;
use crate::mqtt::{MqttConfig, Role, SessionOptions};
use crate::store::{Command, Outbox, Tx, connect};

/// How the relay runs. Setters return `Self`; [`Relay::start`] validates.
///
/// | setting | default |
/// |---|---|
/// | [`source`](Self::source) | the MQTT client id |
/// | [`max_in_flight`](Self::max_in_flight) | 100 |
/// | [`poll_interval`](Self::poll_interval) | 50 ms (where the file cannot be watched) |
/// | [`reconnect_backoff`](Self::reconnect_backoff) | 100 ms doubling to 30 s, with jitter |
/// | [`shutdown_timeout`](Self::shutdown_timeout) | 5 s |
/// | [`prune_interval`](Self::prune_interval) | 10 min |
/// | [`ack_timeout`](Self::ack_timeout) | 60 s |
/// | [`poison_disconnects`](Self::poison_disconnects) | 3 |
/// | [`commands`](Self::commands) | none: publish only, one MQTT session |
/// | [`max_command_bytes`](Self::max_command_bytes) | 64 KiB |
/// | [`command_read_limit`](Self::command_read_limit) | 16 MiB |
/// | [`retained_commands`](Self::retained_commands) | false: retained deliveries are ignored |
/// | [`status_file`](Self::status_file) | false |
/// | `metrics_file` (feature `metrics`) | none |
/// | [`integrity_check_interval`](Self::integrity_check_interval) | 1 h |
#[derive(Debug, Clone, PartialEq, Eq)]
#[must_use = "a builder: use the value it returns"]
pub struct RelayConfig {
    pub(crate) mqtt: MqttConfig,
    pub(crate) source: String,
    pub(crate) max_in_flight: usize,
    pub(crate) poll_interval: Duration,
    pub(crate) backoff_min: Duration,
    pub(crate) backoff_max: Duration,
    pub(crate) shutdown_timeout: Duration,
    pub(crate) prune_interval: Duration,
    pub(crate) ack_timeout: Duration,
    pub(crate) poison_disconnects: u32,
    pub(crate) commands: Option<String>,
    pub(crate) commands_client_id: Option<String>,
    pub(crate) max_command_bytes: usize,
    pub(crate) command_read_limit: usize,
    pub(crate) retained_commands: bool,
    pub(crate) status_file: bool,
    pub(crate) metrics_file: Option<std::path::PathBuf>,
    pub(crate) integrity_interval: Duration,
}

impl RelayConfig {
    /// A relay publishing to the broker in `mqtt`.
    pub fn new(mqtt: MqttConfig) -> Self {
        RelayConfig {
            source: mqtt.id().to_owned(),
            mqtt,
            max_in_flight: 100,
            poll_interval: Duration::from_millis(50),
            backoff_min: Duration::from_millis(100),
            backoff_max: Duration::from_secs(30),
            shutdown_timeout: DEFAULT_SHUTDOWN_TIMEOUT,
            prune_interval: Duration::from_secs(600),
            ack_timeout: Duration::from_secs(60),
            poison_disconnects: 3,
            commands: None,
            commands_client_id: None,
            max_command_bytes: 64 * 1024,
            command_read_limit: 16 * 1024 * 1024,
            retained_commands: false,
            status_file: false,
            metrics_file: None,
            integrity_interval: Duration::from_secs(3600),
        }
    }

    /// Write `<db>.relay-status.json` while running, as `edge-outbox relay` does, so that
    /// `edge-outbox status` (and any other process: [`RelayReport::read`]) sees this relay's
    /// connection, counters and current error (default false). It is rewritten when something
    /// changes (at most once a second) and at least every 30 s, and removed at shutdown.
    pub fn status_file(mut self, on: bool) -> Self {
        self.status_file = on;
        self
    }

    /// Keep a file of the store's and this relay's metrics in the Prometheus text format at
    /// `path`, for node_exporter's textfile collector (`--collector.textfile.directory`; name it
    /// `*.prom`). Written like the status file (see [`status_file`](Self::status_file)), through
    /// a temporary file renamed over it, and removed at shutdown. See [`crate::metrics`].
    #[cfg(feature = "metrics")]
    pub fn metrics_file(mut self, path: impl Into<std::path::PathBuf>) -> Self {
        self.metrics_file = Some(path.into());
        self
    }

    /// The `src` field of every envelope (default: the MQTT client id).
    pub fn source(mut self, source: impl Into<String>) -> Self {
        self.source = source.into();
        self
    }

    /// Most messages published and not yet acknowledged (default 100, at most 65535).
    pub fn max_in_flight(mut self, n: usize) -> Self {
        self.max_in_flight = n;
        self
    }

    /// How often an idle relay checks the file for rows committed by other processes or other
    /// handles where it cannot watch the file (default 50 ms; a cheap `PRAGMA data_version`).
    ///
    /// Commits through the same [`Outbox`] handle wake the relay at once. On Linux the relay also
    /// watches the WAL file (inotify), which every commit writes to, and wakes on its changes:
    /// other processes' commits are seen at once too, and an idle relay checks the file only
    /// every 2 s (or at this interval, if longer) as a safety net. Elsewhere, or where inotify is
    /// refused (its per-user limits), this interval is how soon such a commit is seen.
    pub fn poll_interval(mut self, interval: Duration) -> Self {
        self.poll_interval = interval;
        self
    }

    /// Wait between connection attempts: from `min`, doubling to `max`, with jitter (default
    /// 100 ms to 30 s). It starts again from `min` only after a connection proved healthy (a
    /// PUBACK came, or it held for one keep-alive), never on CONNACK alone: a broker that accepts
    /// a connection and drops it at once is retried less and less often. The same wait applies
    /// after the broker answers "quota exceeded".
    pub fn reconnect_backoff(mut self, min: Duration, max: Duration) -> Self {
        self.backoff_min = min;
        self.backoff_max = max;
        self
    }

    /// How long [`Relay::shutdown`] waits for in-flight PUBACKs (default 5 s). Unacknowledged
    /// messages stay in the outbox and are published again next time.
    pub fn shutdown_timeout(mut self, timeout: Duration) -> Self {
        self.shutdown_timeout = timeout;
        self
    }

    /// How often applied command ids and retained sent rows past their retention are pruned and
    /// free pages returned to the file system (default 10 min). It runs in short slices whether
    /// or not the outbox is empty, so a device that never catches up is still cleaned.
    pub fn prune_interval(mut self, interval: Duration) -> Self {
        self.prune_interval = interval;
        self
    }

    /// How long the oldest message in flight may wait for its PUBACK while the connection stays
    /// up (default 60 s). Then the connection is renewed and the message published again, and
    /// the wait counts as a strike against it (see
    /// [`poison_disconnects`](Self::poison_disconnects)): some brokers neither acknowledge nor
    /// disconnect for a publish they will not take (RabbitMQ 3.10 above `max_message_size`).
    pub fn ack_timeout(mut self, timeout: Duration) -> Self {
        self.ack_timeout = timeout;
        self
    }

    /// Poison isolation: a message that was the oldest unacknowledged one on the wire when this
    /// many connections in a row ended (dropped by the broker, or renewed after the ack timeout)
    /// is moved to the dead letters with the cause, so the messages behind it flow (default 3;
    /// 0 never isolates). A DISCONNECT whose MQTT 5 reason code names the packet (packet too
    /// large, topic name invalid, not authorized, payload format invalid, malformed packet)
    /// counts as all of them at once; a broker that is busy, shutting down or quota-limited
    /// counts nothing. A single transient drop never dead-letters anything (unless this is 1).
    ///
    /// Per key, the messages behind an isolated one are published without it: the dead letter
    /// is the gap, and retrying it queues it again after them.
    pub fn poison_disconnects(mut self, n: u32) -> Self {
        self.poison_disconnects = n;
        self
    }

    /// Receive commands on this topic filter, in a second, persistent session (`clean_session =
    /// false`) whose client id is the main one plus `-commands`, unless set with
    /// [`commands_client_id`](Self::commands_client_id). [`Relay::start`] checks the filter
    /// against MQTT's rules (`+` and `#` as whole levels, `#` last, no control characters, at
    /// most 65,535 bytes) and fails with [`Error::InvalidConfig`] naming the rule.
    pub fn commands(mut self, filter: impl Into<String>) -> Self {
        self.commands = Some(filter.into());
        self
    }

    /// Largest command delivery stored, in bytes of MQTT payload (default 64 KiB). A larger one is
    /// dead-lettered without its bytes (the reason gives its size) and acknowledged, and the
    /// session goes on. The payload inside a stored command is also held to
    /// [`Limits::max_payload_bytes`](crate::Limits::max_payload_bytes).
    pub fn max_command_bytes(mut self, bytes: usize) -> Self {
        self.max_command_bytes = bytes;
        self
    }

    /// Largest MQTT packet the command session reads at all (default 16 MiB), so that a delivery
    /// above [`max_command_bytes`](Self::max_command_bytes) can still be read, dead-lettered and
    /// acknowledged. A packet above this cannot be read: under MQTT 3.1.1 the broker cannot be
    /// told, and would deliver it again at every connection. Configure the broker to refuse
    /// larger messages on the command topics (mosquitto: `message_size_limit`).
    pub fn command_read_limit(mut self, bytes: usize) -> Self {
        self.command_read_limit = bytes;
        self
    }

    /// Store command deliveries that carry MQTT's retain flag (default false: acknowledge and
    /// ignore them, counted in [`Status::commands_retained_ignored`]). A broker sends a retained
    /// message again at every subscription, which the command session makes at every connection.
    /// When stored, its id is kept past the inbox retention while it is the newest retained
    /// command on its topic, so a resent retained command is always recognised, never applied
    /// twice.
    pub fn retained_commands(mut self, store: bool) -> Self {
        self.retained_commands = store;
        self
    }

    /// How often the relay checks the database file for damage while it runs (default 1 h),
    /// within [`Options::integrity_check_budget`](crate::Options::integrity_check_budget). Damage
    /// is logged at ERROR and reported in [`Status::database_damaged`]; the relay goes on with
    /// what it can read, and the next [`Outbox::open`] salvages the file
    /// ([`Options::salvage_on_corruption`](crate::Options::salvage_on_corruption)): restart the
    /// application (`edge-outbox relay` exits with code 1 for its supervisor to restart it).
    pub fn integrity_check_interval(mut self, interval: Duration) -> Self {
        self.integrity_interval = interval;
        self
    }

    /// The command session's client id.
    pub fn commands_client_id(mut self, id: impl Into<String>) -> Self {
        self.commands_client_id = Some(id.into());
        self
    }

    /// The broker settings.
    pub fn mqtt(&self) -> &MqttConfig {
        &self.mqtt
    }

    /// The envelopes' `src`.
    pub fn source_name(&self) -> &str {
        &self.source
    }

    fn validate(&self) -> Result<()> {
        if self.max_in_flight == 0 || self.max_in_flight > usize::from(u16::MAX) {
            return Err(Error::InvalidConfig(
                "max_in_flight must be from 1 to 65535".into(),
            ));
        }
        if self.poll_interval.is_zero() {
            return Err(Error::InvalidConfig("poll_interval must be above zero".into()));
        }
        if self.ack_timeout.is_zero() {
            return Err(Error::InvalidConfig("ack_timeout must be above zero".into()));
        }
        if let Some(filter) = &self.commands {
            validate_filter(filter)?;
        }
        if self.max_command_bytes == 0 {
            return Err(Error::InvalidConfig(
                "max_command_bytes must be at least 1".into(),
            ));
        }
        if self.command_read_limit < self.max_command_bytes {
            return Err(Error::InvalidConfig(format!(
                "command_read_limit ({} bytes) is below max_command_bytes ({} bytes): an oversized \
                 command could not be read to be dead-lettered",
                self.command_read_limit, self.max_command_bytes
            )));
        }
        Ok(())
    }

    fn commands_client(&self) -> String {
        self.commands_client_id
            .clone()
            .unwrap_or_else(|| format!("{}-commands", self.mqtt.id()))
    }
}

/// A running relay: its threads, their shared status, and the lock that makes it the only relay
/// on its file. Stop it with [`Relay::shutdown`]; dropping it does the same, ignoring errors.
///
/// ```no_run
/// use edge_outbox::{MqttConfig, Outbox, Relay, RelayConfig};
///
/// let outbox = Outbox::open("/var/lib/pump/outbox.db")?;
/// let relay = Relay::start(&outbox, RelayConfig::new(MqttConfig::new("127.0.0.1", 1883).client_id("pump-17")))?;
/// outbox.transaction(|tx| tx.publish("pumps/17/started", "pump-17", &true))?;
/// println!("{:?}", relay.status()?);
/// relay.shutdown()?;
/// # Ok::<(), edge_outbox::Error>(())
/// ```
#[must_use = "the relay stops when this handle is dropped; keep it, and call `shutdown` to stop it cleanly"]
pub struct Relay {
    stop: Option<Sender<()>>,
    threads: Vec<JoinHandle<Result<()>>>,
    command_session: Option<Arc<SessionHandle>>,
    /// The publishing session, ended from here only if the publisher thread died (see
    /// `stop_and_join`).
    publish_session: Option<Arc<SessionHandle>>,
    status: Arc<StatusCell>,
    outbox: Outbox,
    lock: Option<RelayLock>,
    shutdown_timeout: Duration,
    /// Closed when the handler thread ends: what a shutdown waits on, up to its deadline.
    handler_done: Option<Receiver<()>>,
    /// The watch on the WAL file, if there is one: stopped once the threads are joined.
    watch: Option<FileWatch>,
}

impl Relay {
    /// Starts publishing `outbox` (and receiving commands, if configured) in background threads.
    /// Commands are stored in the inbox; apply them with [`Outbox::apply_next`], from this or
    /// another process, or use [`Relay::start_with_handler`].
    ///
    /// Fails with [`Error::RelayAlreadyRunning`] if a relay holds this file's lock.
    pub fn start(outbox: &Outbox, config: RelayConfig) -> Result<Relay> {
        Self::spawn(outbox, config, None)
    }

    /// Like [`Relay::start`], plus a thread that applies each stored command with `handler`, in
    /// the transaction that marks it applied (see [`Outbox::apply_next`]).
    ///
    /// The thread has a connection of its own: the handler never holds the application's
    /// [`Outbox`] handle, and the write lock is held only while the handler runs. Since the
    /// handler runs inside that write transaction, keep it to database work; for slow outside
    /// work use [`start_with_two_phase_handler`](Self::start_with_two_phase_handler). Reads
    /// through the application's `Outbox` from inside the handler work; writes through it fail
    /// at once with [`Error::InsideCommandHandler`]. Each attempt is counted before the handler
    /// runs, so one that takes the process down is counted when the relay starts again.
    pub fn start_with_handler<E, F>(outbox: &Outbox, config: RelayConfig, mut handler: F) -> Result<Relay>
    where
        F: FnMut(&mut Tx<'_>, &Command) -> std::result::Result<(), E> + Send + 'static,
        E: Display + 'static,
    {
        let boxed: Handler = Box::new(TwoPhase {
            act: |_: &Command| Ok::<_, std::convert::Infallible>(()),
            record: move |tx: &mut Tx<'_>, cmd: &Command, ()| handler(tx, cmd),
        });
        Self::spawn(outbox, config, Some(boxed))
    }

    /// Like [`Relay::start_with_handler`], with a two-phase handler: `act` does the slow outside
    /// work with no transaction open, then `record` writes its database effect in the transaction
    /// that marks the command applied. `record`'s effect commits exactly once; `act` runs at
    /// least once (again after a crash between the two), so key its outside effect on
    /// [`Command::id`]. See [`Outbox::apply_next_two_phase`].
    ///
    /// ```no_run
    /// use edge_outbox::{Command, MqttConfig, Outbox, Relay, RelayConfig};
    ///
    /// # fn move_valve(_to: i64, _idempotency_key: &str) -> edge_outbox::Result<i64> { Ok(0) }
    /// let outbox = Outbox::open("/var/lib/pump/outbox.db")?;
    /// let config = RelayConfig::new(MqttConfig::new("127.0.0.1", 1883).client_id("pump-17"))
    ///     .commands("devices/pump-17/commands/#");
    /// let relay = Relay::start_with_two_phase_handler(
    ///     &outbox,
    ///     config,
    ///     // Seconds of hardware I/O; the application keeps committing meanwhile.
    ///     |cmd: &Command| move_valve(cmd.payload_as()?, &cmd.id.to_string()),
    ///     |tx, cmd, reached: i64| {
    ///         tx.execute("UPDATE valve SET position = ?1", [reached])?;
    ///         tx.publish("devices/pump-17/valve", &cmd.key, &reached)?;
    ///         Ok::<_, edge_outbox::Error>(())
    ///     },
    /// )?;
    /// # relay.shutdown()?;
    /// # Ok::<(), edge_outbox::Error>(())
    /// ```
    pub fn start_with_two_phase_handler<P, EA, ER, A, R>(
        outbox: &Outbox,
        config: RelayConfig,
        act: A,
        record: R,
    ) -> Result<Relay>
    where
        A: FnMut(&Command) -> std::result::Result<P, EA> + Send + 'static,
        EA: Display + 'static,
        R: FnMut(&mut Tx<'_>, &Command, P) -> std::result::Result<(), ER> + Send + 'static,
        ER: Display + 'static,
        P: 'static,
    {
        Self::spawn(outbox, config, Some(Box::new(TwoPhase { act, record })))
    }

    fn spawn(outbox: &Outbox, config: RelayConfig, handler: Option<Handler>) -> Result<Relay> {
        config.validate()?;
        // validate() keeps max_in_flight within 1..=65535.
        let window = u16::try_from(config.max_in_flight).unwrap_or(u16::MAX);
        let publish_options = SessionOptions::new(
            &config.mqtt,
            config.mqtt.id(),
            Role::Publisher {
                max_in_flight: window,
            },
        )?;
        let command_options = match &config.commands {
            Some(_) => Some(SessionOptions::new(
                &config.mqtt,
                &config.commands_client(),
                Role::Commands {
                    read_limit: config.command_read_limit,
                    persistent: true,
                },
            )?),
            None => None,
        };
        let lock = RelayLock::acquire(outbox.path())?;
        let relay_conn = connect(outbox.path(), outbox.options())?;
        let marker_conn = connect(outbox.path(), outbox.options())?;
        // Losing a mark to a power cut only means publishing that row again, so the relay's own
        // writes skip the fsync: fewer flash writes, and throughput not bound by fdatasync.
        relay_conn.pragma_update(None, "synchronous", "NORMAL")?;
        marker_conn.pragma_update(None, "synchronous", "NORMAL")?;
        // The publisher's rare writes never checkpoint (the marker's and the application's do),
        // so publishing never waits for one.
        relay_conn.pragma_update(None, "wal_autocheckpoint", 0)?;

        let (stop_tx, stop_rx) = crossbeam_channel::bounded::<()>(0);
        let status = Arc::new(StatusCell::default());
        let mut relay = Relay {
            stop: Some(stop_tx),
            threads: Vec::new(),
            command_session: None,
            publish_session: None,
            status: status.clone(),
            outbox: outbox.clone(),
            lock: Some(lock),
            shutdown_timeout: config.shutdown_timeout,
            handler_done: None,
            watch: None,
        };
        // Other processes' commits wake the publisher (and the handler) through the WAL file.
        let (changes_tx, changes_rx) = crossbeam_channel::bounded::<()>(1);
        let (handler_changes_tx, handler_changes_rx) = crossbeam_channel::bounded::<()>(1);
        relay.watch = FileWatch::start(
            &durability::wal_path(outbox.path()),
            vec![changes_tx, handler_changes_tx],
        );
        let watched = relay.watch.is_some();
        let backoff = Backoff::new(config.backoff_min, config.backoff_max);
        let endpoints = config.mqtt.endpoints().join(", ");

        // Publishing session: one thread drives the connections, one feeds them rows, one marks
        // acks.
        let session = Arc::new(SessionHandle::default());
        relay.publish_session = Some(session.clone());
        let (events_tx, events_rx) = crossbeam_channel::unbounded();
        {
            let stop = stop_rx.clone();
            let backoff = backoff.clone();
            let session = session.clone();
            relay.spawn_thread("edge-outbox-mqtt", move || {
                let driver = Driver {
                    name: "relay",
                    options: &publish_options,
                    handle: &session,
                    stop: &stop,
                    backoff,
                };
                driver.run(|signal| forward(&events_tx, signal))
            })?;
        }
        let (marks_tx, marks_rx) = crossbeam_channel::unbounded();
        let marker = Marker {
            conn: marker_conn,
            options: outbox.options().clone(),
            status: status.clone(),
            rx: marks_rx,
        };
        relay.spawn_thread("edge-outbox-marker", move || marker.run())?;
        let publisher = Publisher {
            conn: relay_conn,
            marks: Marks::new(marks_tx),
            barrier: durability::Barrier::new(outbox.path()),
            durable_seq: outbox.durable_seq(),
            options: outbox.options().clone(),
            config: config.clone(),
            events: events_rx,
            session,
            wake: outbox.wake_receiver(),
            changes: watched.then_some(changes_rx),
            stop: stop_rx.clone(),
            status: status.clone(),
        };
        relay.spawn_thread(PUBLISHER_THREAD, move || publisher.run())?;
        let handler_changes = watched.then_some(handler_changes_rx);
        if config.status_file || config.metrics_file.is_some() {
            let reporter = Reporter {
                db: outbox.path().to_path_buf(),
                conn: connect(outbox.path(), outbox.options())?,
                identity: Identity {
                    started_at_ms: crate::time::now_ms(),
                    broker: config.mqtt.endpoint(),
                    brokers: config.mqtt.endpoints(),
                    source: config.source_name().to_owned(),
                    protocol: config.mqtt.version().as_str().to_owned(),
                    client_id: config.mqtt.id().to_owned(),
                    commands: config.commands.clone(),
                },
                status: status.clone(),
                status_file: config.status_file,
                metrics_file: config.metrics_file.clone(),
                stop: stop_rx.clone(),
            };
            relay.spawn_thread("edge-outbox-report", move || reporter.run())?;
        }

        if let (Some(filter), Some(mqtt)) = (&config.commands, command_options) {
            let (arrivals_tx, arrivals_rx) = crossbeam_channel::bounded(1);
            let handle = Arc::new(SessionHandle::default());
            relay.command_session = Some(handle.clone());
            let session_conn = connect(outbox.path(), outbox.options())?;
            // A command is acknowledged once stored; under NORMAL a power cut could then erase it
            // and the broker would never redeliver it. So this connection always syncs.
            session_conn.pragma_update(None, "synchronous", "FULL")?;
            let session = CommandSession {
                conn: session_conn,
                options: outbox.options().clone(),
                mqtt,
                handle,
                filter: filter.clone(),
                arrivals: arrivals_tx,
                stop: stop_rx.clone(),
                status: status.clone(),
                backoff,
                limits: DeliveryLimits {
                    max_bytes: config.max_command_bytes,
                    accept_retained: config.retained_commands,
                },
            };
            relay.spawn_thread("edge-outbox-commands", move || session.run())?;
            if let Some(handler) = handler {
                relay.spawn_handler(outbox, handler, arrivals_rx, handler_changes, &stop_rx)?;
            }
        } else if let Some(handler) = handler {
            // No command session in this process: apply what others store (SQL contract).
            relay.spawn_handler(
                outbox,
                handler,
                crossbeam_channel::never(),
                handler_changes,
                &stop_rx,
            )?;
        }
        tracing::info!(
            broker = %endpoints,
            protocol = %config.mqtt.version(),
            client_id = config.mqtt.id(),
            commands = ?config.commands,
            lock = %relay.lock.as_ref().map(|l| l.path().display().to_string()).unwrap_or_default(),
            "relay started"
        );
        Ok(relay)
    }

    fn spawn_handler(
        &mut self,
        outbox: &Outbox,
        handler: Handler,
        arrivals: Receiver<()>,
        changes: Option<Receiver<()>>,
        stop: &Receiver<()>,
    ) -> Result<()> {
        let (done_tx, done_rx) = crossbeam_channel::bounded::<()>(0);
        self.handler_done = Some(done_rx);
        let (outbox, stop, status) = (outbox.clone(), stop.clone(), self.status.clone());
        self.spawn_thread(HANDLER_THREAD, move || {
            let _done = done_tx;
            run_handler(outbox, handler, arrivals, changes, stop, status)
        })
    }

    fn spawn_thread(&mut self, name: &str, f: impl FnOnce() -> Result<()> + Send + 'static) -> Result<()> {
        let handle = thread::Builder::new()
            .name(name.to_owned())
            .spawn(f)
            .map_err(|e| Error::io(format!("spawning thread {name}"), e))?;
        self.threads.push(handle);
        Ok(())
    }

    /// Connection state, counters and the store's stats.
    pub fn status(&self) -> Result<Status> {
        Ok(self.status.snapshot(self.outbox.stats()?))
    }

    /// True once any of the relay's threads has ended. They retry database and network errors and
    /// run until [`shutdown`](Self::shutdown), so before that this means one failed (a bug: a
    /// panic) and the relay no longer publishes or receives: call `shutdown` for the error.
    /// A supervisor polls this to exit, and be restarted, instead of idling (`edge-outbox relay`
    /// exits with code 1).
    pub fn is_finished(&self) -> bool {
        self.threads.iter().any(JoinHandle::is_finished)
    }

    /// Stops taking new rows, waits (up to the shutdown timeout) for in-flight PUBACKs, marks
    /// them, disconnects both sessions and joins every thread. Returns the first thread's error.
    pub fn shutdown(mut self) -> Result<()> {
        self.stop_and_join()
    }

    fn stop_and_join(&mut self) -> Result<()> {
        let deadline = Instant::now() + self.shutdown_timeout;
        // Dropping the sender wakes every thread's stop receiver at once.
        drop(self.stop.take());
        if let Some(session) = self.command_session.take() {
            session.close();
        }
        let mut first_error = None;
        // The publisher first: it ends the publishing session itself, with a DISCONNECT once its
        // in-flight messages are acknowledged. If it died instead, nothing would tell the
        // connection thread to stop before the next keep-alive: send the DISCONNECT here.
        if let Some(i) = self
            .threads
            .iter()
            .position(|h| h.thread().name() == Some(PUBLISHER_THREAD))
        {
            join_thread(self.threads.remove(i), &mut first_error);
        }
        if let Some(session) = self.publish_session.take() {
            session.close();
        }
        for handle in self.threads.drain(..) {
            if handle.thread().name() == Some(HANDLER_THREAD)
                && let Some(done) = self.handler_done.take()
                && done.recv_deadline(deadline) == Err(RecvTimeoutError::Timeout)
                && let Some((command, running_for)) = self.status.applying()
            {
                let e = Error::HandlerStuck { command, running_for };
                tracing::error!(error = %e, "command handler did not stop");
                first_error.get_or_insert(e);
                continue; // detached: it may still return, and its thread then ends
            }
            join_thread(handle, &mut first_error);
        }
        self.watch.take();
        self.lock.take();
        first_error.map_or(Ok(()), Err)
    }
}

impl Drop for Relay {
    fn drop(&mut self) {
        if !self.threads.is_empty() && !thread::panicking() {
            let _ = self.stop_and_join();
        }
    }
}

impl std::fmt::Debug for Relay {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Relay")
            .field("path", &self.outbox.path())
            .field("threads", &self.threads.len())
            .finish_non_exhaustive()
    }
}

/// The publisher thread's name: `stop_and_join` joins it before the others.
const PUBLISHER_THREAD: &str = "edge-outbox-relay";
/// The handler thread's name: `stop_and_join` waits for it only until the shutdown deadline.
const HANDLER_THREAD: &str = "edge-outbox-handler";

/// Joins one relay thread; keeps the first error (a panic is [`Error::Panicked`]).
fn join_thread(handle: JoinHandle<Result<()>>, first_error: &mut Option<Error>) {
    let name = handle.thread().name().unwrap_or("edge-outbox").to_owned();
    let result = match handle.join() {
        Ok(result) => result,
        Err(_) => Err(Error::Panicked(name.clone())),
    };
    if let Err(e) = result {
        tracing::error!(thread = %name, error = %e, "relay thread failed");
        first_error.get_or_insert(e);
    }
}

/// The connection thread's side of the publisher channel: every signal goes to the publisher,
/// in order; once the publisher is gone, the session ends.
fn forward(events: &Sender<Signal>, signal: Signal) -> Result<Flow> {
    Ok(if events.send(signal).is_ok() {
        Flow::Continue
    } else {
        Flow::Stop
    })
}
