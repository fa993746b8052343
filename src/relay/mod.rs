//! The relay: background threads that publish the outbox over MQTT and, optionally, receive and
//! apply commands.

mod forwarder;
mod reporter;

use std::fmt::Display;
use std::sync::Arc;
use std::thread::{self, JoinHandle};
use std::time::{Duration, Instant};

use crossbeam_channel::{Receiver, RecvTimeoutError, Sender};

use self::forwarder::Forwarder;
use self::reporter::Reporter;
use crate::commands::{CommandSession, DeliveryLimits, Handler, Intake, TwoPhase, run_handler};
use crate::error::{Error, Result};
use crate::mqtt::backoff::Backoff;
use crate::mqtt::driver::{Driver, Flow, SessionHandle, Signal};
use crate::mqtt::event::Event;
pub use crate::mqtt::status::Status;
use crate::mqtt::status::StatusCell;
use crate::mqtt::{Role, SessionOptions};
use crate::publish::{Barrier, Marker, Marks, Publisher, count_steps, wal_path};
use crate::relay_config::RelayConfig;
use crate::report::Identity;
use crate::store::relay_lock::RelayLock;
use crate::store::watch::FileWatch;
use crate::store::{Command, Outbox, Tx, connect};

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
        let shared = config.shares_session();
        let publish_role = if shared {
            Role::Device {
                max_in_flight: window,
                read_limit: config.command_read_limit,
            }
        } else {
            Role::Publisher {
                max_in_flight: window,
            }
        };
        let publish_options = SessionOptions::new(&config.mqtt, config.mqtt.id(), publish_role)?;
        let command_options = match &config.commands {
            Some(_) if !shared => Some(SessionOptions::new(
                &config.mqtt,
                &config.commands_client(),
                Role::Commands {
                    read_limit: config.command_read_limit,
                    persistent: true,
                },
            )?),
            _ => None,
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
        let status = Arc::new(StatusCell::new());
        count_steps(&relay_conn, &status);
        count_steps(&marker_conn, &status);
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
        relay.watch = FileWatch::start(&wal_path(outbox.path()), vec![changes_tx, handler_changes_tx]);
        let watched = relay.watch.is_some();
        let backoff = Backoff::new(config.backoff_min, config.backoff_max);
        let endpoints = config.mqtt.endpoints().join(", ");

        // Commands: stored by an intake, in a session of their own or in the publishing one.
        let (arrivals_tx, arrivals_rx) = crossbeam_channel::bounded(1);
        let mut intake = match &config.commands {
            Some(filter) => Some(relay.intake(outbox, &config, filter, arrivals_tx, &stop_rx, &backoff)?),
            None => None,
        };

        // Publishing session: one thread drives the connections, one feeds them rows, one marks
        // acks. In single-session mode the connection thread also stores commands.
        let session = Arc::new(SessionHandle::default());
        relay.publish_session = Some(session.clone());
        let (events_tx, events_rx) = crossbeam_channel::unbounded();
        {
            let stop = stop_rx.clone();
            let backoff = backoff.clone();
            let session = session.clone();
            let mut intake = if shared { intake.take() } else { None };
            relay.spawn_thread("edge-outbox-mqtt", move || {
                let driver = Driver {
                    name: if intake.is_some() {
                        "relay (with commands)"
                    } else {
                        "relay"
                    },
                    options: &publish_options,
                    handle: &session,
                    stop: &stop,
                    backoff,
                };
                let mut forwarder = Forwarder::new(events_tx);
                let ran = driver.run(|signal| match intake.as_mut() {
                    Some(intake) => {
                        // The intake may commit now (a burst's end or a full burst, the
                        // connection's end): PUBACKs already read go first, so that marking
                        // never waits on that commit.
                        if matches!(
                            signal,
                            Signal::Quiet | Signal::Event(Event::Delivery(_)) | Signal::Disconnected(_)
                        ) && forwarder.flush_urgent()? == Flow::Stop
                        {
                            return Ok(Flow::Stop);
                        }
                        let flow = intake.on_signal(&signal)?;
                        if Intake::takes(&signal) {
                            return Ok(flow);
                        }
                        // The publisher still gets the signal (a PUBACK that ended a burst of
                        // commands) whatever the intake wants of the connection.
                        let forwarded = forwarder.forward(signal)?;
                        Ok(if flow == Flow::Continue { forwarded } else { flow })
                    }
                    None => forwarder.forward(signal),
                });
                // What the last read brought, when the session ended in the middle of it.
                forwarder.flush()?;
                ran?;
                if let Some(intake) = intake {
                    intake.status.set_commands_connected(false);
                }
                Ok(())
            })?;
        }
        let (marks_tx, marks_rx) = crossbeam_channel::unbounded();
        let marked = Arc::new(std::sync::atomic::AtomicU64::new(0));
        let marker = Marker {
            marked: marked.clone(),
            conn: marker_conn,
            options: outbox.options().clone(),
            status: status.clone(),
            rx: marks_rx,
            watermark: crate::store::published::Watermark::new(outbox.path()),
        };
        relay.spawn_thread("edge-outbox-marker", move || marker.run())?;
        let publisher = Publisher {
            conn: relay_conn,
            marks: Marks::new(marks_tx, marked),
            barrier: Barrier::new(outbox.path()),
            durable_seq: outbox.durable_seq(),
            options: publishing_options(outbox, &config),
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
                    credential: config.mqtt.credential_kind(),
                },
                status: status.clone(),
                status_file: config.status_file,
                metrics_file: config.metrics_file.clone(),
                metrics_file_mode: config.metrics_file_mode,
                stop: stop_rx.clone(),
            };
            relay.spawn_thread("edge-outbox-report", move || reporter.run())?;
        }

        if let (Some(intake), Some(mqtt)) = (intake, command_options) {
            let handle = Arc::new(SessionHandle::default());
            relay.command_session = Some(handle.clone());
            let session = CommandSession {
                intake,
                mqtt,
                handle,
                backoff,
            };
            relay.spawn_thread("edge-outbox-commands", move || session.run())?;
        }
        if let Some(handler) = handler {
            // Without commands in this process, the handler applies what others store (SQL
            // contract).
            let arrivals = if config.commands.is_some() {
                arrivals_rx
            } else {
                crossbeam_channel::never()
            };
            relay.spawn_handler(outbox, handler, arrivals, handler_changes, &stop_rx)?;
        }
        tracing::info!(
            broker = %endpoints,
            protocol = %config.mqtt.version(),
            client_id = config.mqtt.id(),
            single_session = shared,
            proxy = %proxy_label(&config.mqtt),
            credential = config.mqtt.credential_kind().as_deref().unwrap_or("none"),
            commands = ?config.commands,
            lock = %relay.lock.as_ref().map(|l| l.path().display().to_string()).unwrap_or_default(),
            "relay started"
        );
        Ok(relay)
    }

    /// The command intake: its own connection, which always syncs, since a command is
    /// acknowledged once stored; under NORMAL a power cut could then erase it and the broker
    /// would never redeliver it.
    fn intake(
        &self,
        outbox: &Outbox,
        config: &RelayConfig,
        filter: &str,
        arrivals: Sender<()>,
        stop: &Receiver<()>,
        backoff: &Backoff,
    ) -> Result<Intake> {
        let conn = connect(outbox.path(), outbox.options())?;
        conn.pragma_update(None, "synchronous", "FULL")?;
        Ok(Intake {
            conn,
            options: outbox.options().clone(),
            filter: filter.to_owned(),
            arrivals,
            stop: stop.clone(),
            status: self.status.clone(),
            store_backoff: backoff.clone(),
            limits: DeliveryLimits {
                max_bytes: config.max_command_bytes,
                accept_retained: config.retained_commands,
            },
            client: None,
            unstored: Vec::new(),
            held: Vec::new(),
            shared: config.single_session,
        })
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

/// The store's options as the publisher applies them: with a cloud profile, the cloud's topic
/// rules, also for rows written by a process that did not set them.
fn publishing_options(outbox: &Outbox, config: &RelayConfig) -> crate::store::Options {
    let mut options = outbox.options().clone();
    // The relay's profile and client id decide, whatever the writer's handle was opened with.
    if let Some(cloud) = config.cloud {
        options.limits = options.limits.cloud(cloud, config.mqtt.id());
    }
    options
}

/// The HTTP proxy the relay's sessions go through, for its start line: `host:port` or `none`.
fn proxy_label(mqtt: &crate::MqttConfig) -> String {
    #[cfg(feature = "http-proxy")]
    if let Some(proxy) = mqtt.proxy() {
        return proxy.to_string();
    }
    let _ = mqtt;
    "none".into()
}
