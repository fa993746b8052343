//! Drives one MQTT session: a fresh rumqttc client and event loop for every connection, a backoff
//! between attempts that resets only once a connection proved healthy, and each connection's
//! events kept strictly between its `Connected` and its `Disconnected`. With several brokers (a
//! failover list), each failed attempt or lost connection moves on to the next one in turn.
//!
//! Why a fresh client per connection: rumqttc 0.25 keeps a packet-id collision across reconnects
//! (`state.collision` survives `clean()`) and reads no request while it is set, so acks out of
//! order with a full window followed by a drop stopped publishing for good. It also hands out
//! events buffered before a failure after the next CONNACK, where they would pass for the new
//! connection's. A new client shares nothing with the old one; the old one's buffered events are
//! delivered before its `Disconnected`. The session logic gets the new client with `Connected`.

use std::sync::Mutex;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant, SystemTime};

use crossbeam_channel::{Receiver, RecvTimeoutError, TryRecvError};

use super::backoff::Backoff;
use super::client::{Connection, MqttClient, Opened, Recv, SessionOptions};
use super::event::{Cause, CauseKind, Event, Granted, Step, SubResult, protocol_note};
use crate::error::Result;

/// What the driver hands to the session logic, in order.
pub(crate) enum Signal {
    /// A new connection is up: the client to use on it and what the broker granted.
    Connected(Link),
    /// An event of the current connection.
    Event(Event),
    /// The connection ended. Every event of it was delivered before this; its client is dead.
    Disconnected(Cause),
    /// The events of a network read that brought one or more deliveries have all been handed
    /// out: the end of a burst, so the command intake stores what it holds in one transaction
    /// and acknowledges it.
    Quiet,
    /// Every event of a network read, or of a request written, has been handed out (rumqttc
    /// holds no more): one that forwards events to another thread may send what it gathered.
    ReadEnd,
    /// Nothing came within the driver's wait: whatever is held back goes now.
    Idle,
}

/// A live connection, as the session logic sees it.
pub(crate) struct Link {
    pub client: MqttClient,
    pub granted: Granted,
    /// `host:port` of the broker this connection is to.
    pub endpoint: String,
    /// When the credential this connection authenticated with expires (a SAS token).
    pub credential_expires: Option<SystemTime>,
}

/// What a connection's credentials allow: when to replace it, and when its token expires.
#[derive(Clone, Copy)]
struct Credentials {
    renew: Option<Instant>,
    expires: Option<SystemTime>,
}

/// How long a connection is kept at least, however soon its credentials expire.
const RENEW_MIN_HOLD: Duration = Duration::from_secs(1);

/// How often a quiet, connected session checks for a reconnect request while one may come (see
/// [`SessionHandle::set_watching`])...
const REQUEST_CHECK: Duration = Duration::from_millis(200);
/// ...and otherwise: an idle connection wakes its thread this rarely (plus its keep-alive).
const IDLE_CHECK: Duration = Duration::from_secs(10);

/// Whether the driver should keep going.
#[derive(Debug, PartialEq, Eq)]
pub(crate) enum Flow {
    Continue,
    /// End the session (a clean DISCONNECT if connected).
    Stop,
    /// Drop the connection and make a new one (after a backoff wait), for this reason.
    Reconnect(Cause),
}

/// What others may do to a running session: end it (the owner shutting down) or ask for a new
/// connection (the session logic, from another thread).
#[derive(Debug, Default)]
pub(crate) struct SessionHandle {
    slot: Mutex<Slot>,
    reconnect: Mutex<Option<Cause>>,
    /// A reconnect request may come soon: check often.
    watching: AtomicBool,
}

#[derive(Debug, Default)]
struct Slot {
    client: Option<MqttClient>,
    closed: bool,
}

impl SessionHandle {
    /// Ends the session: a DISCONNECT on the current connection, and no connection after it.
    pub(crate) fn close(&self) {
        let mut slot = lock(&self.slot);
        slot.closed = true;
        if let Some(client) = slot.client.take() {
            let _ = client.try_disconnect();
        }
    }

    /// Asks for the current connection to be replaced; the driver acts on it within a fraction
    /// of a second while [`watching`](Self::set_watching), else within [`IDLE_CHECK`].
    pub(crate) fn request_reconnect(&self, cause: Cause) {
        *lock(&self.reconnect) = Some(cause);
    }

    /// Whether a reconnect request may come soon (the publisher has messages in flight, or waits
    /// out a quota): the driver then checks for one often. An idle session is left asleep.
    pub(crate) fn set_watching(&self, watching: bool) {
        self.watching.store(watching, Ordering::Relaxed);
    }

    /// Makes `client` the current one; false if the session was closed meanwhile.
    fn install(&self, client: &MqttClient) -> bool {
        let mut slot = lock(&self.slot);
        if slot.closed {
            return false;
        }
        slot.client = Some(client.clone());
        // A request made for an earlier connection (while it closed) is not this one's.
        lock(&self.reconnect).take();
        true
    }

    fn clear(&self) {
        lock(&self.slot).client = None;
        lock(&self.reconnect).take();
    }

    fn take_reconnect(&self) -> Option<Cause> {
        lock(&self.reconnect).take()
    }
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
}

/// One session to drive.
pub(crate) struct Driver<'a> {
    /// For log lines: `relay` or `command session`.
    pub name: &'static str,
    pub options: &'a SessionOptions,
    pub handle: &'a SessionHandle,
    pub stop: &'a Receiver<()>,
    pub backoff: Backoff,
}

/// How one connection ended.
enum End {
    /// The session logic said stop: disconnect cleanly and return.
    Stop,
    /// A DISCONNECT was sent: the session is over.
    Done,
    Failed {
        cause: Cause,
        connected: bool,
        healthy: bool,
    },
    /// The connection's credentials expire soon: replace it now, with fresh ones.
    Renew(Cause),
}

impl Driver<'_> {
    /// Runs until `on_signal` says stop, the stop channel fires while waiting to reconnect, the
    /// handle is closed, or a DISCONNECT is sent.
    pub(crate) fn run(mut self, mut on_signal: impl FnMut(Signal) -> Result<Flow>) -> Result<()> {
        let mut at = 0;
        let mut log = ConnectionLog::new(self.name, self.options.endpoint(at).to_owned());
        loop {
            if self.stop.try_recv() != Err(TryRecvError::Empty) {
                return Ok(());
            }
            let end = match self.options.open(at) {
                // The credentials could not be read or made: a failed attempt; the next one
                // reads them again.
                Err(cause) => End::Failed {
                    cause,
                    connected: false,
                    healthy: false,
                },
                Ok(Opened {
                    client,
                    mut connection,
                    renew,
                    expires,
                }) => {
                    if !self.handle.install(&client) {
                        return Ok(());
                    }
                    let credentials = Credentials { renew, expires };
                    let end = self.connection(
                        at,
                        &client,
                        &mut connection,
                        credentials,
                        &mut log,
                        &mut on_signal,
                    );
                    self.handle.clear();
                    match end? {
                        End::Stop => {
                            disconnect_cleanly(&client, &mut connection);
                            return Ok(());
                        }
                        End::Renew(cause) => {
                            // A planned replacement: same broker, no backoff, nothing counted as
                            // failed. What is read until the DISCONNECT goes out still counts;
                            // PUBACKs still on their way are lost with the connection, and their
                            // rows are sent again on the next.
                            if disconnect_forwarding(&client, &mut connection, &mut on_signal)? == Flow::Stop
                            {
                                return Ok(());
                            }
                            drop((client, connection));
                            tracing::info!(session = self.name, broker = %self.options.endpoint(at), "{cause}");
                            if on_signal(Signal::Disconnected(cause))? == Flow::Stop {
                                return Ok(());
                            }
                            continue;
                        }
                        // The client and its connection end here, before the backoff.
                        other => other,
                    }
                }
            };
            match end {
                End::Done | End::Stop | End::Renew(_) => return Ok(()),
                End::Failed {
                    cause,
                    connected,
                    healthy,
                } => {
                    log.failed(&cause, connected, healthy);
                    if on_signal(Signal::Disconnected(cause))? == Flow::Stop {
                        return Ok(());
                    }
                    if self.options.brokers() > 1 {
                        at = (at + 1) % self.options.brokers();
                        log.next_broker(self.options.endpoint(at));
                    }
                    let delay = self.backoff.next_delay();
                    tracing::debug!(session = self.name, ?delay, "waiting before reconnecting");
                    if self.stop.recv_timeout(delay) != Err(RecvTimeoutError::Timeout) {
                        return Ok(());
                    }
                }
            }
        }
    }

    fn connection(
        &mut self,
        at: usize,
        client: &MqttClient,
        connection: &mut Connection,
        credentials: Credentials,
        log: &mut ConnectionLog,
        on_signal: &mut impl FnMut(Signal) -> Result<Flow>,
    ) -> Result<End> {
        let mut connected_at: Option<Instant> = None;
        let mut keep_alive = self.options.keep_alive();
        let mut healthy = false;
        // A delivery was handed out: say `Quiet` once rumqttc has handed out the rest of what it
        // read. Never found by polling with a zero timeout: a poll cancelled while it writes
        // loses the packet it was writing.
        let mut burst = false;
        loop {
            // Never sooner than a moment after the CONNACK: a token whose life is mostly spent
            // connecting is left to expire, which the broker ends as a failure, with backoff,
            // rather than renewed in a loop.
            let renew = credentials
                .renew
                .zip(connected_at)
                .map(|(renew, at)| renew.max(at + RENEW_MIN_HOLD));
            let connected = connected_at.is_some();
            // Once connected, wake up now and then to act on a reconnect request even when the
            // connection is quiet (often only while one may come), and when the connection
            // has held long enough to count as healthy.
            let wait = connected_at.map(|at| {
                let mut wait = if self.handle.watching.load(Ordering::Relaxed) {
                    REQUEST_CHECK
                } else {
                    IDLE_CHECK
                };
                if !healthy {
                    let held_at = at + held_after(keep_alive);
                    wait = wait.min(
                        held_at
                            .saturating_duration_since(Instant::now())
                            .max(REQUEST_CHECK),
                    );
                }
                if let Some(renew) = renew {
                    wait = wait.min(renew.saturating_duration_since(Instant::now()));
                }
                wait
            });
            // Renewed, and reconnects requested, at a read's end only: a burst of commands that
            // read brought is then stored and acknowledged first.
            let read_done = !connection.has_buffered();
            if connected && read_done && renew.is_some_and(|at| Instant::now() >= at) {
                if deliver_buffered(connection, on_signal)? == Flow::Stop {
                    return Ok(End::Stop);
                }
                return Ok(End::Renew(Cause::new(
                    CauseKind::Renew,
                    "renewing the connection's credentials before they expire",
                )));
            }
            let step = match connection.recv(connected, wait) {
                // Every client handle was dropped: cannot happen while `client` lives.
                Recv::Closed => return Ok(End::Done),
                Recv::Idle => {
                    let flow = match on_signal(Signal::Idle)? {
                        Flow::Continue => self
                            .handle
                            .take_reconnect()
                            .map_or(Flow::Continue, Flow::Reconnect),
                        other => other,
                    };
                    match flow {
                        Flow::Stop => return Ok(End::Stop),
                        Flow::Reconnect(cause) => {
                            return failed(connection, on_signal, cause, connected, healthy);
                        }
                        Flow::Continue => {}
                    }
                    if !healthy && held(connected_at, keep_alive) {
                        healthy = true;
                        self.backoff.reset();
                        log.healthy();
                    }
                    continue;
                }
                Recv::Step(step) => step,
                Recv::Failed(cause) => return failed(connection, on_signal, cause, connected, healthy),
            };
            let flow = match step {
                Step::ConnAck(granted)
                    if granted.receive_max == Some(0) && !crate::mutant::active("receive-max-zero-taken") =>
                {
                    // MQTT 5 makes it a protocol error. rumqttc would take it as a cap of nothing
                    // and write no request on this connection (no publish, subscription or ack)
                    // while its pings keep it looking alive.
                    let cause = Cause::new(
                        CauseKind::Broker,
                        "the broker's CONNACK gave a Receive Maximum of 0, which MQTT 5 forbids",
                    );
                    return failed(connection, on_signal, cause, false, false);
                }
                Step::ConnAck(granted) => {
                    connected_at = Some(Instant::now());
                    if let Some(secs) = granted.server_keep_alive {
                        keep_alive = Duration::from_secs(u64::from(secs));
                    }
                    log.connected(protocol_note(self.options.protocol()));
                    on_signal(Signal::Connected(Link {
                        client: client.clone(),
                        granted,
                        endpoint: self.options.endpoint(at).to_owned(),
                        credential_expires: credentials.expires,
                    }))?
                }
                Step::Event(event) => {
                    // Healthy: a PUBACK or a granted subscription came, or the connection has
                    // held for one keep-alive. Only then does the backoff start again from its
                    // minimum: a broker that accepts CONNECT and drops at once backs off.
                    if !healthy && (proves_health(&event) || held(connected_at, keep_alive)) {
                        healthy = true;
                        self.backoff.reset();
                        log.healthy();
                    }
                    burst |= matches!(event, Event::Delivery(_));
                    match event {
                        Event::Other => Flow::Continue,
                        Event::DisconnectSent => {
                            on_signal(Signal::Event(Event::DisconnectSent))?;
                            return Ok(End::Done);
                        }
                        event => on_signal(Signal::Event(event))?,
                    }
                }
            };
            let read_done = !connection.has_buffered();
            let flow = if flow == Flow::Continue && burst && read_done {
                burst = false;
                on_signal(Signal::Quiet)?
            } else {
                flow
            };
            let flow = match flow {
                Flow::Continue if read_done => on_signal(Signal::ReadEnd)?,
                other => other,
            };
            let flow = match flow {
                Flow::Continue if read_done => self
                    .handle
                    .take_reconnect()
                    .map_or(Flow::Continue, Flow::Reconnect),
                other => other,
            };
            match flow {
                Flow::Continue => {}
                Flow::Stop => return Ok(End::Stop),
                Flow::Reconnect(cause) => {
                    return failed(connection, on_signal, cause, connected_at.is_some(), healthy);
                }
            }
        }
    }
}

fn proves_health(event: &Event) -> bool {
    match event {
        Event::PubAck(..) => true,
        Event::SubAck(results) => results.iter().all(|r| *r == SubResult::Granted),
        _ => false,
    }
}

fn held(connected_at: Option<Instant>, keep_alive: Duration) -> bool {
    connected_at.is_some_and(|t| t.elapsed() >= held_after(keep_alive))
}

/// How long a connection must hold to count as healthy: one keep-alive, or half a minute with
/// keep-alive disabled.
fn held_after(keep_alive: Duration) -> Duration {
    if keep_alive.is_zero() {
        Duration::from_secs(30)
    } else {
        keep_alive
    }
}

/// The end of a connection: its buffered events first, then how it ended.
fn failed(
    connection: &mut Connection,
    on_signal: &mut impl FnMut(Signal) -> Result<Flow>,
    cause: Cause,
    connected: bool,
    healthy: bool,
) -> Result<End> {
    if deliver_buffered(connection, on_signal)? == Flow::Stop {
        return Ok(End::Stop);
    }
    Ok(End::Failed {
        cause,
        connected,
        healthy,
    })
}

/// Hands over what rumqttc read before the connection ended: it belongs to that connection.
fn deliver_buffered(
    connection: &mut Connection,
    on_signal: &mut impl FnMut(Signal) -> Result<Flow>,
) -> Result<Flow> {
    for step in connection.take_buffered() {
        match step {
            // A CONNACK cannot be buffered behind the failure of its own connection.
            Step::ConnAck(_) | Step::Event(Event::Other) => {}
            Step::Event(event) => {
                if on_signal(Signal::Event(event))? == Flow::Stop {
                    return Ok(Flow::Stop);
                }
            }
        }
    }
    Ok(Flow::Continue)
}

/// [`disconnect_cleanly`], handing the session logic each event that comes meanwhile.
fn disconnect_forwarding(
    client: &MqttClient,
    connection: &mut Connection,
    on_signal: &mut impl FnMut(Signal) -> Result<Flow>,
) -> Result<Flow> {
    if client.try_disconnect().is_err() {
        return Ok(Flow::Continue);
    }
    let deadline = Instant::now() + DISCONNECT_WAIT;
    while let Some(left) = deadline.checked_duration_since(Instant::now()) {
        match connection.recv(true, Some(left)) {
            Recv::Step(Step::Event(Event::DisconnectSent)) | Recv::Failed(_) | Recv::Idle | Recv::Closed => {
                break;
            }
            Recv::Step(Step::ConnAck(_) | Step::Event(Event::Other)) => {}
            Recv::Step(Step::Event(event)) => {
                if on_signal(Signal::Event(event))? == Flow::Stop {
                    return Ok(Flow::Stop);
                }
            }
        }
    }
    deliver_buffered(connection, on_signal)
}

/// How long a clean DISCONNECT may take to be written.
const DISCONNECT_WAIT: Duration = Duration::from_secs(2);

/// Sends DISCONNECT and lets rumqttc write it, for a bounded time: the broker then discards the
/// last will.
fn disconnect_cleanly(client: &MqttClient, connection: &mut Connection) {
    if client.try_disconnect().is_err() {
        return;
    }
    let deadline = Instant::now() + DISCONNECT_WAIT;
    while let Some(left) = deadline.checked_duration_since(Instant::now()) {
        match connection.recv(true, Some(left)) {
            Recv::Step(Step::Event(Event::DisconnectSent)) | Recv::Failed(_) | Recv::Idle | Recv::Closed => {
                return;
            }
            Recv::Step(_) => {}
        }
    }
}

/// Log lines for operators: the first failure and every change of state at WARN or INFO with its
/// cause; repeats of the same failure at DEBUG, with a WARN summary once a minute.
struct ConnectionLog {
    name: &'static str,
    endpoint: String,
    /// Attempts that failed since the last healthy connection (a connection dropped before it
    /// proved healthy counts as failed).
    failures: u32,
    failing_since: Option<Instant>,
    last_cause: Option<String>,
    last_summary: Instant,
}

/// A failure repeated for this long is summarised again at WARN.
const SUMMARY_EVERY: Duration = Duration::from_secs(60);

impl ConnectionLog {
    fn new(name: &'static str, endpoint: String) -> Self {
        ConnectionLog {
            name,
            endpoint,
            failures: 0,
            failing_since: None,
            last_cause: None,
            last_summary: Instant::now(),
        }
    }

    fn connected(&mut self, protocol_note: Option<&str>) {
        if self.failures == 0 {
            tracing::info!(session = self.name, broker = %self.endpoint, "connected");
            if let Some(note) = protocol_note {
                tracing::warn!(session = self.name, "{note}");
            }
        } else {
            tracing::debug!(session = self.name, broker = %self.endpoint, attempt = self.failures + 1, "connected");
        }
    }

    /// The next attempt goes to another broker of the failover list.
    fn next_broker(&mut self, endpoint: &str) {
        tracing::info!(session = self.name, from = %self.endpoint, to = %endpoint, "trying the next broker of the failover list");
        self.endpoint = endpoint.to_owned();
    }

    fn healthy(&mut self) {
        if self.failures > 0 {
            let since = self.failing_since.map(|t| t.elapsed()).unwrap_or_default();
            tracing::info!(
                session = self.name,
                broker = %self.endpoint,
                failed_attempts = self.failures,
                "connected again after {} failed attempts in {:.0?}",
                self.failures,
                since
            );
        }
        self.failures = 0;
        self.failing_since = None;
        self.last_cause = None;
    }

    fn failed(&mut self, cause: &Cause, connected: bool, healthy: bool) {
        if healthy {
            tracing::warn!(session = self.name, broker = %self.endpoint, cause = %cause, "disconnected");
            self.failures = 0;
        }
        self.failures += 1;
        let now = Instant::now();
        let since = *self.failing_since.get_or_insert(now);
        let same = self.last_cause.as_deref() == Some(cause.text.as_str());
        if healthy {
            // Said above.
        } else if self.failures == 1 {
            let what = if connected {
                "connection dropped before it proved healthy"
            } else {
                "cannot connect"
            };
            tracing::warn!(
                session = self.name,
                broker = %self.endpoint,
                cause = %cause,
                "{what}; retrying with backoff (repeats are summarised)"
            );
            self.last_summary = now;
        } else if !same {
            tracing::warn!(session = self.name, broker = %self.endpoint, cause = %cause, attempts = self.failures, "still failing, now: {cause}");
            self.last_summary = now;
        } else if self.last_summary.elapsed() >= SUMMARY_EVERY {
            tracing::warn!(
                session = self.name,
                broker = %self.endpoint,
                cause = %cause,
                attempts = self.failures,
                "still failing: {} attempts in {:.0?}",
                self.failures,
                now.duration_since(since)
            );
            self.last_summary = now;
        } else {
            tracing::debug!(session = self.name, cause = %cause, attempts = self.failures, "connection attempt failed");
        }
        self.last_cause = Some(cause.text.clone());
    }
}
