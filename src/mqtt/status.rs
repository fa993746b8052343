//! What a running relay reports about itself.

use std::sync::atomic::Ordering::{AcqRel, Relaxed};
use std::sync::atomic::{AtomicBool, AtomicU64};
use std::sync::{Mutex, OnceLock, PoisonError};

use crossbeam_channel::{Receiver, Sender};
use std::time::{Duration, Instant, SystemTime};

use super::event::Granted;
use crate::envelope::MessageId;
use crate::store::Stats;

/// A snapshot of a running relay and its store. See [`Relay::status`](crate::Relay::status).
#[derive(Debug, Clone, PartialEq, Eq, Default)]
#[non_exhaustive]
pub struct Status {
    /// The publishing session is connected.
    pub connected: bool,
    /// The command session is connected and subscribed (false when no command session is
    /// configured).
    pub commands_connected: bool,
    /// The error the relay is in now, if any: the most recent one whose cause is not gone yet
    /// (a connection refused, a mark that failed, ...). It clears once its cause is gone (the
    /// session connected again, a mark succeeded) and moves to
    /// [`previous_error`](Self::previous_error).
    pub last_error: Option<String>,
    /// When [`last_error`](Self::last_error) began (it may have repeated since).
    pub last_error_since: Option<SystemTime>,
    /// The most recent error that cleared, if any.
    pub previous_error: Option<String>,
    /// When [`previous_error`](Self::previous_error) began, and when it cleared.
    pub previous_error_span: Option<(SystemTime, SystemTime)>,
    /// Messages handed to the MQTT client and not yet acknowledged (some may wait in its queue
    /// behind the broker's receive maximum).
    pub in_flight: u64,
    /// Outbox messages handed to the broker since start (resends count again; each message of a
    /// batch counts; gap notices do not, see [`notices_published`](Self::notices_published)).
    pub published: u64,
    /// Of those, messages handed over again after a reconnect because their PUBACK had not
    /// arrived (at-least-once at work: each is a possible duplicate downstream).
    pub resent: u64,
    /// PUBACKs received for outbox rows since start.
    pub acknowledged: u64,
    /// Outbox rows moved to the dead letters since start (any reason: unpublishable as stored,
    /// refused by the broker, or isolated as poison).
    pub dead_lettered: u64,
    /// Of those, rows the broker refused with a PUBACK reason code (MQTT 5).
    pub refused: u64,
    /// Of those, rows set aside as poison: the oldest unacknowledged message across consecutive
    /// disconnects or ack timeouts.
    pub isolated: u64,
    /// Messages removed unpublished because their expiry passed, since start.
    pub expired: u64,
    /// Messages covered by gap notices the broker acknowledged since start: every message the
    /// device removed unpublished (evicted, expired, dead-lettered, purged) is announced to the
    /// cloud this way.
    pub gaps_announced: u64,
    /// Gap notices handed to the broker since start (each may cover many messages).
    pub notices_published: u64,
    /// The broker the publishing session is connected to, or last tried (`host:port`, from the
    /// failover list of [`MqttConfig`](crate::MqttConfig)).
    pub broker: Option<String>,
    /// What the relay's periodic integrity check found wrong with the database file, if it
    /// found damage: restart the application, whose next open salvages the file.
    pub database_damaged: Option<String>,
    /// The broker's maximum packet size from its last CONNACK (MQTT 5), if it sent one. Messages
    /// needing a larger packet are dead-lettered; an application can size
    /// [`Limits::max_payload_bytes`](crate::Limits::max_payload_bytes) from it.
    pub broker_max_packet_size: Option<u32>,
    /// The broker's receive maximum from its last CONNACK (MQTT 5), if it sent one: the in-flight
    /// window is at most this.
    pub broker_receive_maximum: Option<u16>,
    /// Successful connections of the publishing session since start.
    pub connections: u64,
    /// Connections of the publishing session lost since start (failed attempts not counted).
    pub disconnects: u64,
    /// Command deliveries stored since start.
    pub commands_received: u64,
    /// Command deliveries recognised as duplicates since start.
    pub commands_duplicate: u64,
    /// Commands applied by the registered handler since start.
    pub commands_applied: u64,
    /// Command deliveries dead-lettered on arrival since start: not a valid envelope, too large,
    /// or (with signed commands) not signed by a trusted key.
    pub commands_malformed: u64,
    /// Commands the handler rejected for good ([`Error::CommandRejected`](crate::Error::CommandRejected))
    /// since start.
    pub commands_rejected: u64,
    /// Commands dead-lettered since start because their attempts were used up (failing, or never
    /// returning).
    pub commands_dead_lettered: u64,
    /// Retained deliveries on the command topic ignored since start (see
    /// [`RelayConfig::retained_commands`](crate::RelayConfig::retained_commands)).
    pub commands_retained_ignored: u64,
    /// How long PUBACKs took since start: from a message going on the wire to its PUBACK.
    pub ack_latency: AckLatency,
    /// Since when the publishing session has been down (the relay's start, or the end of its last
    /// connection); `None` while it is connected. With [`last_ack_at`](Self::last_ack_at), the
    /// figure to alert on: it grows with any outage, however the backlog looks (a coalescing
    /// stream keeps the oldest pending message young).
    pub disconnected_since: Option<SystemTime>,
    /// When the broker last acknowledged a message; `None` before the first PUBACK. Messages
    /// pending and a last PUBACK long ago means publishing is stuck, connected or not.
    pub last_ack_at: Option<SystemTime>,
    /// When the credential of the publishing session's current (or last) connection expires: its
    /// SAS token ([`MqttConfig::azure_sas`](crate::MqttConfig::azure_sas)), which the relay
    /// replaces before then, or its client certificate's `notAfter` (as read at that
    /// connection: a rotated file shows from the next one); `None` for credentials that do not
    /// expire.
    pub credential_expires_at: Option<SystemTime>,
    /// SQLite virtual-machine steps the publishing side ran since start (the publisher's reads,
    /// claims, gap notices and cleanup, and the marker's marks), counted by SQLite itself. Their
    /// work: per published message it stays flat however long the backlog, so a figure that grows
    /// with the backlog is a query that lost its index.
    pub database_steps: u64,
    /// The relay's own syncs of the WAL file, its durability barrier: one per read that found
    /// rows whose commit may not be on stable storage yet (SQLite's own syncs are not counted).
    pub wal_syncs: u64,
    /// How long ago the publishing thread last went round its loop; `None` before its first
    /// pass. While the thread runs it passes at least once per poll (at most 2 s apart with the
    /// file watched, else [`RelayConfig::poll_interval`](crate::RelayConfig::poll_interval)), plus
    /// the time one step of its work takes (a database read that waits out the busy timeout at
    /// worst), idle or not. An age far above that means the thread is wedged: the figure a
    /// watchdog checks (`edge-outbox relay` sends systemd's `WATCHDOG=1` only while it is low).
    pub publisher_heartbeat_age: Option<Duration>,
    /// The store's counters.
    pub store: Stats,
}

/// A histogram of PUBACK latencies (see [`Status::ack_latency`]).
#[derive(Debug, Clone, PartialEq, Eq, Default)]
#[non_exhaustive]
pub struct AckLatency {
    /// `(upper bound in microseconds, PUBACKs in this bucket)`, bounds rising; each bucket counts
    /// the latencies above the previous bound and up to its own. The last bound is `u64::MAX`.
    pub buckets: Vec<(u64, u64)>,
    /// Every latency added up, in microseconds.
    pub sum_micros: u64,
    /// PUBACKs measured.
    pub count: u64,
}

/// Upper bounds of the PUBACK latency buckets, in microseconds: 1 ms to 10 s.
const ACK_BOUNDS_US: [u64; 14] = [
    1_000,
    2_500,
    5_000,
    10_000,
    25_000,
    50_000,
    100_000,
    250_000,
    500_000,
    1_000_000,
    2_500_000,
    5_000_000,
    10_000_000,
    u64::MAX,
];

#[derive(Debug, Default)]
pub(crate) struct StatusCell {
    connected: AtomicBool,
    commands_connected: AtomicBool,
    in_flight: AtomicU64,
    published: AtomicU64,
    resent: AtomicU64,
    acknowledged: AtomicU64,
    dead_lettered: AtomicU64,
    refused: AtomicU64,
    isolated: AtomicU64,
    expired: AtomicU64,
    gaps_announced: AtomicU64,
    notices_published: AtomicU64,
    broker: Mutex<Option<String>>,
    damaged: Mutex<Option<String>>,
    connections: AtomicU64,
    disconnects: AtomicU64,
    commands_received: AtomicU64,
    commands_duplicate: AtomicU64,
    commands_applied: AtomicU64,
    commands_malformed: AtomicU64,
    commands_rejected: AtomicU64,
    commands_dead_lettered: AtomicU64,
    commands_retained_ignored: AtomicU64,
    errors: Mutex<Errors>,
    granted: Mutex<Granted>,
    ack_buckets: [AtomicU64; ACK_BOUNDS_US.len()],
    ack_sum_us: AtomicU64,
    wal_syncs: AtomicU64,
    database_steps: AtomicU64,
    /// Unix ms; 0: none. Set from [`StatusCell::new`] until the first CONNACK.
    disconnected_since_ms: AtomicU64,
    /// Unix ms of the last accepted PUBACK; 0: none yet.
    last_ack_ms: AtomicU64,
    /// Unix ms when the current connection's credential expires; 0: it does not.
    credential_expires_ms: AtomicU64,
    /// [`monotonic_ms`] of the publishing thread's last pass through its loop; 0: none yet.
    publisher_beat_ms: AtomicU64,
    /// Something changed since the reporter last looked (see [`StatusCell::changes`]).
    dirty: AtomicBool,
    changed: OnceLock<Sender<()>>,
    /// The command the handler thread is applying, and since when: what a shutdown that gives up
    /// on it reports.
    applying: Mutex<Option<(MessageId, Instant)>>,
}

/// Where an error comes from: each clears on its own sign of recovery.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Source {
    /// The publishing session's connection: clears on its next CONNACK.
    Connection,
    /// A quota pause: clears on the next accepted PUBACK.
    Quota,
    /// Reading the outbox: clears on the next successful read.
    Reading,
    /// Marking acknowledged rows: clears on the next successful mark.
    Marking,
    /// The command session: clears once it is subscribed again.
    Commands,
    /// Storing a command: clears once one is stored.
    Storing,
    /// Applying commands: clears on the next successful apply step.
    Applying,
    /// The database file failed its integrity check: never clears (a restart salvages it).
    Damaged,
}

/// The errors active now, one per source, and the last one that cleared.
#[derive(Debug, Default)]
struct Errors {
    /// (source, message, since), most recent last.
    active: Vec<(Source, String, SystemTime)>,
    /// (message, since, cleared at).
    previous: Option<(String, SystemTime, SystemTime)>,
}

/// Now, in Unix milliseconds (never 0, which the cell reads as "none").
fn unix_ms_now() -> u64 {
    SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(1, |d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX).max(1))
}

/// Milliseconds on the monotonic clock since this process first asked (never 0): a heartbeat's
/// age must not jump with the wall clock.
fn monotonic_ms() -> u64 {
    static START: OnceLock<Instant> = OnceLock::new();
    let start = *START.get_or_init(Instant::now);
    u64::try_from(start.elapsed().as_millis())
        .unwrap_or(u64::MAX)
        .saturating_add(1)
}

fn from_unix_ms(ms: u64) -> Option<SystemTime> {
    (ms != 0).then(|| std::time::UNIX_EPOCH + Duration::from_millis(ms))
}

impl StatusCell {
    /// The cell of a relay starting now: disconnected since now.
    pub(crate) fn new() -> StatusCell {
        let cell = StatusCell::default();
        cell.disconnected_since_ms.store(unix_ms_now(), Relaxed);
        cell
    }

    /// Notes a change for the reporter: one wake-up per quiet period, not one per message.
    /// Called after the change: a reporter that takes the change (`take_change`) after this
    /// sees the new values, and one that took it before gets the wake-up sent here. The swap
    /// orders them: the reporter's swap reads this one's write, and the values written before it.
    fn touch(&self) {
        if !self.dirty.swap(true, AcqRel)
            && let Some(tx) = self.changed.get()
        {
            let _ = tx.try_send(());
        }
    }

    /// A receiver that gets a message when something changes after [`take_change`] was called
    /// (one reporter per relay).
    ///
    /// [`take_change`]: Self::take_change
    pub(crate) fn changes(&self) -> Receiver<()> {
        let (tx, rx) = crossbeam_channel::bounded(1);
        let _ = self.changed.set(tx);
        rx
    }

    /// Clears the change flag: the next change sends a message again.
    pub(crate) fn take_change(&self) {
        self.dirty.swap(false, AcqRel);
    }

    /// Records `error` from `source` as the relay's current error (since now, unless the same
    /// error was already active).
    pub(crate) fn set_error(&self, source: Source, error: String) {
        let mut e = self.errors.lock().unwrap_or_else(PoisonError::into_inner);
        let since = match e.active.iter().position(|(s, _, _)| *s == source) {
            Some(i) => {
                let (_, old, since) = e.active.remove(i);
                if old == error { since } else { SystemTime::now() }
            }
            None => SystemTime::now(),
        };
        e.active.push((source, error, since));
        self.touch();
    }

    /// The cause of `source`'s error is gone: it moves to the previous error.
    pub(crate) fn clear_error(&self, source: Source) {
        let mut e = self.errors.lock().unwrap_or_else(PoisonError::into_inner);
        if let Some(i) = e.active.iter().position(|(s, _, _)| *s == source) {
            let (_, message, since) = e.active.remove(i);
            e.previous = Some((message, since, SystemTime::now()));
        }
        self.touch();
    }

    pub(crate) fn on_connected(&self, granted: &Granted) {
        self.clear_error(Source::Connection);
        self.connected.store(true, Relaxed);
        self.disconnected_since_ms.store(0, Relaxed);
        self.in_flight.store(0, Relaxed);
        self.connections.fetch_add(1, Relaxed);
        *self
            .granted
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner) = granted.clone();
        self.touch();
    }

    /// The publishing session's connection ended, or an attempt failed: only the end of a
    /// connection that was up counts as a disconnect.
    pub(crate) fn on_disconnected(&self, error: String) {
        if self.connected.swap(false, Relaxed) {
            self.disconnects.fetch_add(1, Relaxed);
        }
        self.mark_disconnected();
        self.in_flight.store(0, Relaxed);
        self.set_error(Source::Connection, error);
        self.touch();
    }

    /// The publishing session replaces its connection to renew its credentials: not connected
    /// for a moment, but no outage and no error.
    pub(crate) fn on_renewing(&self) {
        self.connected.store(false, Relaxed);
        self.in_flight.store(0, Relaxed);
        self.touch();
    }

    pub(crate) fn set_connected(&self, connected: bool) {
        self.connected.store(connected, Relaxed);
        if connected {
            self.disconnected_since_ms.store(0, Relaxed);
        } else {
            self.mark_disconnected();
        }
        self.touch();
    }

    /// Down from now, unless already down (the outage began earlier).
    fn mark_disconnected(&self) {
        let _ = self
            .disconnected_since_ms
            .compare_exchange(0, unix_ms_now(), Relaxed, Relaxed);
    }

    pub(crate) fn set_commands_connected(&self, connected: bool) {
        if connected {
            self.clear_error(Source::Commands);
        }
        self.commands_connected.store(connected, Relaxed);
        self.touch();
    }

    /// A gap notice went to the broker: in flight, but not an outbox message.
    pub(crate) fn on_notice_published(&self, in_flight: usize) {
        self.notices_published.fetch_add(1, Relaxed);
        self.in_flight.store(in_flight as u64, Relaxed);
        self.touch();
    }

    pub(crate) fn on_published(&self, in_flight: usize, resend: bool) {
        self.published.fetch_add(1, Relaxed);
        if resend {
            self.resent.fetch_add(1, Relaxed);
        }
        self.in_flight.store(in_flight as u64, Relaxed);
        self.touch();
    }

    /// An accepted PUBACK, `latency` after its message went on the wire (if known).
    pub(crate) fn on_acked(&self, in_flight: usize, latency: Option<Duration>) {
        if let Some(latency) = latency {
            let us = u64::try_from(latency.as_micros()).unwrap_or(u64::MAX);
            let bucket = ACK_BOUNDS_US
                .iter()
                .position(|&b| us <= b)
                .unwrap_or(ACK_BOUNDS_US.len() - 1);
            self.ack_buckets[bucket].fetch_add(1, Relaxed);
            self.ack_sum_us.fetch_add(us, Relaxed);
        }
        self.acknowledged.fetch_add(1, Relaxed);
        self.last_ack_ms.store(unix_ms_now(), Relaxed);
        self.in_flight.store(in_flight as u64, Relaxed);
        self.touch();
    }

    /// A PUBACK that did not acknowledge (a refusal, a quota): one fewer in flight.
    pub(crate) fn on_answered(&self, in_flight: usize) {
        self.in_flight.store(in_flight as u64, Relaxed);
        self.touch();
    }

    pub(crate) fn on_dead_lettered(&self, n: usize) {
        self.dead_lettered.fetch_add(n as u64, Relaxed);
        self.touch();
    }

    pub(crate) fn on_refused(&self, n: usize) {
        self.refused.fetch_add(n as u64, Relaxed);
        self.touch();
    }

    pub(crate) fn on_expired(&self, n: u64) {
        self.expired.fetch_add(n, Relaxed);
    }

    pub(crate) fn on_gap_announced(&self, messages: i64) {
        self.gaps_announced
            .fetch_add(u64::try_from(messages).unwrap_or(0), Relaxed);
    }

    /// When the publishing session's new connection's credential expires.
    pub(crate) fn set_credential_expires(&self, at: Option<SystemTime>) {
        let ms = at
            .and_then(|t| t.duration_since(std::time::UNIX_EPOCH).ok())
            .map_or(0, |d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX).max(1));
        self.credential_expires_ms.store(ms, Relaxed);
        self.touch();
    }

    /// The broker the publishing session now connects to.
    pub(crate) fn set_broker(&self, endpoint: &str) {
        *self.broker.lock().unwrap_or_else(PoisonError::into_inner) = Some(endpoint.to_owned());
    }

    pub(crate) fn set_damaged(&self, why: String) {
        *self.damaged.lock().unwrap_or_else(PoisonError::into_inner) = Some(why);
    }

    pub(crate) fn on_isolated(&self) {
        self.isolated.fetch_add(1, Relaxed);
        self.touch();
    }

    pub(crate) fn on_command(&self, duplicate: bool) {
        let counter = if duplicate {
            &self.commands_duplicate
        } else {
            &self.commands_received
        };
        counter.fetch_add(1, Relaxed);
        self.touch();
    }

    pub(crate) fn on_applied(&self) {
        self.commands_applied.fetch_add(1, Relaxed);
        self.touch();
    }

    pub(crate) fn on_malformed(&self) {
        self.commands_malformed.fetch_add(1, Relaxed);
        self.touch();
    }

    pub(crate) fn on_rejected(&self) {
        self.commands_rejected.fetch_add(1, Relaxed);
        self.touch();
    }

    pub(crate) fn on_commands_dead_lettered(&self, n: u64) {
        self.commands_dead_lettered.fetch_add(n, Relaxed);
        self.touch();
    }

    pub(crate) fn on_retained_ignored(&self) {
        self.commands_retained_ignored.fetch_add(1, Relaxed);
        self.touch();
    }

    /// The publishing thread went round its loop. Not a change for the reporter: it happens
    /// on every pass, idle or not.
    pub(crate) fn beat(&self) {
        self.publisher_beat_ms.store(monotonic_ms(), Relaxed);
    }

    /// The relay synced the WAL file itself (its durability barrier).
    pub(crate) fn on_wal_sync(&self) {
        self.wal_syncs.fetch_add(1, Relaxed);
    }

    pub(crate) fn wal_syncs(&self) -> u64 {
        self.wal_syncs.load(Relaxed)
    }

    /// SQLite ran `n` more virtual-machine steps on one of the publishing side's connections.
    pub(crate) fn on_database_steps(&self, n: u64) {
        self.database_steps.fetch_add(n, Relaxed);
    }

    pub(crate) fn set_applying(&self, command: Option<MessageId>) {
        *self.applying.lock().unwrap_or_else(PoisonError::into_inner) =
            command.map(|id| (id, Instant::now()));
    }

    /// The command being applied and for how long, if any.
    pub(crate) fn applying(&self) -> Option<(MessageId, Duration)> {
        self.applying
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .map(|(id, since)| (id, since.elapsed()))
    }

    pub(crate) fn snapshot(&self, store: Stats) -> Status {
        let granted = self
            .granted
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .clone();
        let (last_error, last_error_since, previous_error, previous_error_span) = {
            let e = self.errors.lock().unwrap_or_else(PoisonError::into_inner);
            let now = e.active.last().map(|(_, m, since)| (m.clone(), *since));
            let before = e.previous.clone();
            (
                now.as_ref().map(|(m, _)| m.clone()),
                now.map(|(_, since)| since),
                before.as_ref().map(|(m, _, _)| m.clone()),
                before.map(|(_, since, cleared)| (since, cleared)),
            )
        };
        Status {
            connected: self.connected.load(Relaxed),
            commands_connected: self.commands_connected.load(Relaxed),
            last_error,
            last_error_since,
            previous_error,
            previous_error_span,
            in_flight: self.in_flight.load(Relaxed),
            published: self.published.load(Relaxed),
            resent: self.resent.load(Relaxed),
            acknowledged: self.acknowledged.load(Relaxed),
            dead_lettered: self.dead_lettered.load(Relaxed),
            refused: self.refused.load(Relaxed),
            isolated: self.isolated.load(Relaxed),
            expired: self.expired.load(Relaxed),
            gaps_announced: self.gaps_announced.load(Relaxed),
            notices_published: self.notices_published.load(Relaxed),
            broker: self.broker.lock().unwrap_or_else(PoisonError::into_inner).clone(),
            database_damaged: self
                .damaged
                .lock()
                .unwrap_or_else(PoisonError::into_inner)
                .clone(),
            broker_max_packet_size: granted.max_packet_size,
            broker_receive_maximum: granted.receive_max,
            connections: self.connections.load(Relaxed),
            disconnects: self.disconnects.load(Relaxed),
            commands_received: self.commands_received.load(Relaxed),
            commands_duplicate: self.commands_duplicate.load(Relaxed),
            commands_applied: self.commands_applied.load(Relaxed),
            commands_malformed: self.commands_malformed.load(Relaxed),
            commands_rejected: self.commands_rejected.load(Relaxed),
            commands_dead_lettered: self.commands_dead_lettered.load(Relaxed),
            commands_retained_ignored: self.commands_retained_ignored.load(Relaxed),
            ack_latency: {
                let buckets: Vec<(u64, u64)> = ACK_BOUNDS_US
                    .iter()
                    .zip(&self.ack_buckets)
                    .map(|(&b, n)| (b, n.load(Relaxed)))
                    .collect();
                AckLatency {
                    count: buckets.iter().map(|b| b.1).sum(),
                    buckets,
                    sum_micros: self.ack_sum_us.load(Relaxed),
                }
            },
            disconnected_since: from_unix_ms(self.disconnected_since_ms.load(Relaxed)),
            last_ack_at: from_unix_ms(self.last_ack_ms.load(Relaxed)),
            credential_expires_at: from_unix_ms(self.credential_expires_ms.load(Relaxed)),
            database_steps: self.database_steps.load(Relaxed),
            wal_syncs: self.wal_syncs(),
            publisher_heartbeat_age: match self.publisher_beat_ms.load(Relaxed) {
                0 => None,
                at => Some(Duration::from_millis(monotonic_ms().saturating_sub(at))),
            },
            store,
        }
    }
}

/// One line for a log or a terminal: the connection (and the broker of the failover list it is
/// on), the publishing counters (expired and announced removals when there are any), a damaged
/// database, the command counters when a command session runs, the last error, then the store
/// ([`Stats`]'s `Display`).
///
/// ```
/// let mut status = edge_outbox::Status::default();
/// assert!(status.to_string().starts_with("disconnected, 0 in flight, 0 acknowledged"));
/// status.connected = true;
/// status.broker = Some("broker-b.example:1883".into());
/// assert!(status.to_string().starts_with("connected to broker-b.example:1883, 0 in flight"));
/// ```
impl std::fmt::Display for Status {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let connected = if self.connected {
            "connected"
        } else {
            "disconnected"
        };
        write!(f, "{connected}")?;
        if let Some(broker) = self.broker.as_deref().filter(|_| self.connected) {
            write!(f, " to {broker}")?;
        }
        write!(
            f,
            ", {} in flight, {} acknowledged, {} resent, {} dead-lettered",
            self.in_flight, self.acknowledged, self.resent, self.dead_lettered
        )?;
        if self.gaps_announced > 0 || self.expired > 0 {
            write!(
                f,
                ", {} expired, {} removed messages announced",
                self.expired, self.gaps_announced
            )?;
        }
        if let Some(damage) = &self.database_damaged {
            write!(f, "; DATABASE DAMAGED: {damage}")?;
        }
        if self.commands_connected || self.commands_received > 0 {
            write!(
                f,
                "; commands {}, {} received, {} applied, {} dead-lettered",
                if self.commands_connected {
                    "connected"
                } else {
                    "disconnected"
                },
                self.commands_received,
                self.commands_applied,
                self.commands_dead_lettered
            )?;
        }
        if let Some(e) = &self.last_error {
            write!(f, "; last error: {e}")?;
        }
        write!(f, "; store: {}", self.store)
    }
}
