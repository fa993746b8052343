//! What a running relay tells other processes: `<db>.relay-status.json`, and with the `metrics`
//! feature a Prometheus text file for node_exporter's textfile collector.
//!
//! A relay in another process (or inside an application) cannot be asked for its counters, so a
//! reporter thread writes them to a file beside the database: `edge-outbox status` reads it to
//! tell "broker unreachable" from "relay stuck". The thread sleeps until a counter or the
//! connection changes, writes at most once per [`MIN_INTERVAL`], and at least once per
//! [`HEARTBEAT`] while the relay runs (so a file older than [`FRESH`] comes from a relay that
//! crashed or hangs). Each write goes to a temporary file that is then renamed over the old one:
//! readers never see half of one. Both files are removed when the relay stops. Opt-in:
//! [`RelayConfig::status_file`](crate::RelayConfig::status_file) (the `edge-outbox relay`
//! command always writes it).

use std::path::{Path, PathBuf};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use serde::{Deserialize, Serialize};

use crate::time::now_ms;

/// A change is written at most this often...
pub(crate) const MIN_INTERVAL: Duration = Duration::from_secs(1);
/// ...and the file at least this often while the relay runs...
pub(crate) const HEARTBEAT: Duration = Duration::from_secs(30);
/// ...so it counts as current while younger than this.
const FRESH: Duration = Duration::from_secs(90);
/// Bumped when a field changes meaning; readers ignore files of another format.
const FORMAT: u32 = 1;

/// The content of `<db>.relay-status.json`: a running relay's counters (since it started) and
/// connection state. See [`RelayReport::read`].
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[non_exhaustive]
pub struct RelayReport {
    /// The file's format (1); files of another are ignored.
    pub format: u32,
    /// The relay's process.
    pub pid: u32,
    /// When this was written, Unix milliseconds.
    pub written_at_ms: i64,
    /// When the relay started, Unix milliseconds.
    pub started_at_ms: i64,
    /// `host:port` of the broker connected to (or last tried).
    pub broker: String,
    /// The failover list, in the order tried.
    #[serde(default)]
    pub brokers: Vec<String>,
    /// The envelopes' `src`.
    #[serde(default)]
    pub source: String,
    /// The epoch the relay numbers messages in.
    #[serde(default)]
    pub epoch: u64,
    /// `5` or `3.1.1`.
    #[serde(default)]
    pub protocol: String,
    /// The publishing session's client id.
    pub client_id: String,
    /// The command topic filter, if commands are received.
    pub commands: Option<String>,
    /// The publishing session is connected.
    pub connected: bool,
    /// The command session is connected and subscribed.
    pub commands_connected: bool,
    /// Messages handed to the MQTT client and not yet acknowledged (some may wait in its queue
    /// behind the broker's receive maximum).
    pub in_flight: u64,
    /// Messages handed to the broker (resends included).
    pub published: u64,
    /// Of those, handed over again after a reconnect.
    #[serde(default)]
    pub resent: u64,
    /// PUBACKs received for outbox rows.
    pub acknowledged: u64,
    /// Outbox rows moved to the dead letters (any reason).
    pub dead_lettered: u64,
    /// Of those, refused by the broker (MQTT 5 reason codes).
    #[serde(default)]
    pub refused: u64,
    /// Of those, set aside as poison.
    #[serde(default)]
    pub isolated: u64,
    /// Messages removed unpublished because their expiry passed.
    #[serde(default)]
    pub expired: u64,
    /// Messages covered by gap notices the broker acknowledged.
    #[serde(default)]
    pub gaps_announced: u64,
    /// Gap notices handed to the broker (see `Status::notices_published`).
    #[serde(default)]
    pub notices_published: u64,
    /// The broker's maximum packet size from its CONNACK, if it sent one.
    #[serde(default)]
    pub broker_max_packet_size: Option<u32>,
    /// Successful connections of the publishing session.
    pub connections: u64,
    /// Connections of the publishing session lost.
    #[serde(default)]
    pub disconnects: u64,
    /// Command deliveries stored.
    pub commands_received: u64,
    /// Command deliveries recognised as duplicates.
    pub commands_duplicate: u64,
    /// Commands applied by the relay's handler.
    #[serde(default)]
    pub commands_applied: u64,
    /// Command deliveries dead-lettered on arrival.
    #[serde(default)]
    pub commands_malformed: u64,
    /// Commands the handler rejected for good.
    #[serde(default)]
    pub commands_rejected: u64,
    /// Commands dead-lettered with their attempts used up.
    #[serde(default)]
    pub commands_dead_lettered: u64,
    /// Retained command deliveries ignored.
    #[serde(default)]
    pub commands_retained_ignored: u64,
    /// The error the relay is in now (see [`Status::last_error`](crate::Status::last_error)).
    pub last_error: Option<String>,
    /// Since when, Unix milliseconds.
    #[serde(default)]
    pub last_error_since_ms: Option<i64>,
    /// The last error that cleared.
    #[serde(default)]
    pub previous_error: Option<String>,
    /// When it cleared, Unix milliseconds.
    #[serde(default)]
    pub previous_error_cleared_ms: Option<i64>,
    /// PUBACK latency: `(upper bound in microseconds, count)` per bucket (see
    /// [`AckLatency`](crate::AckLatency)).
    #[serde(default)]
    pub ack_latency_buckets: Vec<(u64, u64)>,
    /// Every PUBACK latency added up, in microseconds.
    #[serde(default)]
    pub ack_latency_sum_micros: u64,
    /// The relay's own syncs of the WAL file (its durability barrier; SQLite's own are not
    /// counted).
    #[serde(default)]
    pub wal_syncs: u64,
    /// SQLite virtual-machine steps the publishing side ran (see `Status::database_steps`).
    #[serde(default)]
    pub database_steps: u64,
    /// Since when the publishing session has been down, Unix milliseconds; `None` while connected
    /// (see `Status::disconnected_since`).
    #[serde(default)]
    pub disconnected_since_ms: Option<i64>,
    /// When the broker last acknowledged a message, Unix milliseconds (see `Status::last_ack_at`).
    #[serde(default)]
    pub last_ack_ms: Option<i64>,
    /// What the publishing session authenticates with: `sas-token`, `password`,
    /// `client-certificate` (comma-separated when several), or none.
    #[serde(default)]
    pub credential: Option<String>,
    /// When the current connection's credential expires, Unix milliseconds (see
    /// `Status::credential_expires_at`).
    #[serde(default)]
    pub credential_expires_ms: Option<i64>,
    /// Bytes this process caused to be written to storage since it started (Linux
    /// `/proc/self/io` `write_bytes`), if known.
    #[serde(default)]
    pub process_write_bytes: Option<u64>,
}

impl RelayReport {
    /// Where the relay of the database at `db` writes its report.
    pub fn path(db: &Path) -> PathBuf {
        sibling(db, ".relay-status.json")
    }

    /// The report of the relay on `db`, if there is a readable one of this format. Check
    /// [`is_fresh`](Self::is_fresh): an old one comes from a relay that is gone or hangs.
    pub fn read(db: &Path) -> Option<RelayReport> {
        let bytes = std::fs::read(Self::path(db)).ok()?;
        serde_json::from_slice::<RelayReport>(&bytes)
            .ok()
            .filter(|r| r.format == FORMAT)
    }

    /// Whether it is recent enough to describe a running relay: a relay rewrites it on every
    /// change and at least every 30 s; one not rewritten for 90 s is gone or hangs.
    pub fn is_fresh(&self) -> bool {
        self.age() <= FRESH
    }

    /// How long ago it was written.
    pub fn age(&self) -> Duration {
        Duration::from_millis(u64::try_from(now_ms().saturating_sub(self.written_at_ms)).unwrap_or(0))
    }
}

/// `db`'s canonical path plus `suffix`: two spellings of one database (a symlink, `./x.db` and
/// `x.db`) name the same file, as they do the relay's lock.
pub(crate) fn sibling(db: &Path, suffix: &str) -> PathBuf {
    let db = std::fs::canonicalize(db).unwrap_or_else(|_| db.to_path_buf());
    let mut name = db.into_os_string();
    name.push(suffix);
    PathBuf::from(name)
}

/// Replaces `target` with `bytes` atomically (a temporary file renamed over it), with permission
/// bits `mode` exactly (the umask does not narrow them): the owner only, like the database, unless
/// the file is for another user's reader (see [`RelayConfig::metrics_file_mode`](crate::RelayConfig::metrics_file_mode)).
pub(crate) fn write_atomically(target: &Path, bytes: &[u8], mode: u32) -> std::io::Result<()> {
    let mut tmp = target.as_os_str().to_owned();
    tmp.push(".tmp");
    let tmp = PathBuf::from(tmp);
    let mut open = std::fs::OpenOptions::new();
    open.write(true).create(true).truncate(true);
    #[cfg(unix)]
    std::os::unix::fs::OpenOptionsExt::mode(&mut open, 0o600);
    let mut file = open.open(&tmp)?;
    // Always, not only for another mode: a temporary file left by a crash keeps the bits it was
    // created with, which `mode` above sets only for a new file.
    #[cfg(unix)]
    {
        use std::os::unix::fs::PermissionsExt as _;
        file.set_permissions(std::fs::Permissions::from_mode(mode))?;
    }
    #[cfg(not(unix))]
    let _ = mode;
    std::io::Write::write_all(&mut file, bytes)?;
    std::fs::rename(&tmp, target)
}

pub(crate) fn remove(target: &Path) {
    let _ = std::fs::remove_file(target);
    let mut tmp = target.as_os_str().to_owned();
    tmp.push(".tmp");
    let _ = std::fs::remove_file(PathBuf::from(tmp));
}

fn unix_ms(t: SystemTime) -> i64 {
    t.duration_since(UNIX_EPOCH)
        .map_or(0, |d| i64::try_from(d.as_millis()).unwrap_or(i64::MAX))
}

/// What the report says besides the counters.
#[derive(Debug, Clone)]
pub(crate) struct Identity {
    pub started_at_ms: i64,
    pub broker: String,
    pub brokers: Vec<String>,
    pub source: String,
    pub protocol: String,
    pub client_id: String,
    pub commands: Option<String>,
    pub credential: Option<String>,
}

/// The report from a snapshot of the relay's status.
pub(crate) fn report(id: &Identity, s: &crate::Status, wal_syncs: u64) -> RelayReport {
    RelayReport {
        format: FORMAT,
        pid: std::process::id(),
        written_at_ms: now_ms(),
        started_at_ms: id.started_at_ms,
        broker: s.broker.clone().unwrap_or_else(|| id.broker.clone()),
        brokers: id.brokers.clone(),
        source: id.source.clone(),
        epoch: s.store.epoch,
        protocol: id.protocol.clone(),
        client_id: id.client_id.clone(),
        commands: id.commands.clone(),
        connected: s.connected,
        commands_connected: s.commands_connected,
        in_flight: s.in_flight,
        published: s.published,
        resent: s.resent,
        acknowledged: s.acknowledged,
        dead_lettered: s.dead_lettered,
        refused: s.refused,
        isolated: s.isolated,
        expired: s.expired,
        gaps_announced: s.gaps_announced,
        notices_published: s.notices_published,
        broker_max_packet_size: s.broker_max_packet_size,
        connections: s.connections,
        disconnects: s.disconnects,
        commands_received: s.commands_received,
        commands_duplicate: s.commands_duplicate,
        commands_applied: s.commands_applied,
        commands_malformed: s.commands_malformed,
        commands_rejected: s.commands_rejected,
        commands_dead_lettered: s.commands_dead_lettered,
        commands_retained_ignored: s.commands_retained_ignored,
        last_error: s.last_error.clone(),
        last_error_since_ms: s.last_error_since.map(unix_ms),
        previous_error: s.previous_error.clone(),
        previous_error_cleared_ms: s.previous_error_span.map(|(_, cleared)| unix_ms(cleared)),
        ack_latency_buckets: s.ack_latency.buckets.clone(),
        ack_latency_sum_micros: s.ack_latency.sum_micros,
        wal_syncs,
        database_steps: s.database_steps,
        disconnected_since_ms: s.disconnected_since.map(unix_ms),
        last_ack_ms: s.last_ack_at.map(unix_ms),
        credential: id.credential.clone(),
        credential_expires_ms: s.credential_expires_at.map(unix_ms),
        process_write_bytes: process_write_bytes(),
    }
}

/// `write_bytes` of `/proc/self/io`: what this process caused to be written to storage.
pub(crate) fn process_write_bytes() -> Option<u64> {
    let io = std::fs::read_to_string("/proc/self/io").ok()?;
    io.lines()
        .find_map(|l| l.strip_prefix("write_bytes:"))
        .and_then(|v| v.trim().parse().ok())
}
