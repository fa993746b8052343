//! `<db>.relay-status.json`: what a running `edge-outbox relay` reports to other processes.
//!
//! A relay in another process cannot be asked for its counters, so the relay command rewrites
//! this small file every second (write to a temporary file, then rename: readers never see half
//! of one) and deletes it when it stops. `status` shows it when it is fresh: a file older than
//! [`FRESH`] comes from a relay that crashed or hangs. Relays started in-process by an
//! application (`Relay::start`) do not write it.

use std::path::{Path, PathBuf};
use std::time::Duration;

use serde::{Deserialize, Serialize};

use crate::db::sibling;

/// The status file is rewritten this often...
pub const INTERVAL: Duration = Duration::from_secs(1);
/// ...and counts as current while younger than this.
pub const FRESH: Duration = Duration::from_secs(5);
/// Bumped when a field changes meaning; readers ignore files of another format.
pub const FORMAT: u32 = 1;

/// The file's content. Counters are since the relay started.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct RelayReport {
    pub format: u32,
    pub pid: u32,
    pub written_at_ms: i64,
    pub started_at_ms: i64,
    /// The broker connected to (or last tried).
    pub broker: String,
    /// The failover list, in the order tried. Added later in format 1: absent in older files.
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
    pub client_id: String,
    pub commands: Option<String>,
    pub connected: bool,
    pub commands_connected: bool,
    pub in_flight: u64,
    pub published: u64,
    pub acknowledged: u64,
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
    /// The broker's maximum packet size from its CONNACK, if it sent one.
    #[serde(default)]
    pub broker_max_packet_size: Option<u32>,
    pub connections: u64,
    pub commands_received: u64,
    pub commands_duplicate: u64,
    /// Added later in format 1: absent (0) in files of older relays.
    #[serde(default)]
    pub commands_malformed: u64,
    #[serde(default)]
    pub commands_rejected: u64,
    #[serde(default)]
    pub commands_dead_lettered: u64,
    #[serde(default)]
    pub commands_retained_ignored: u64,
    pub last_error: Option<String>,
}

pub fn path(db: &Path) -> PathBuf {
    sibling(db, ".relay-status.json")
}

/// Replaces the file atomically. Readable by the owner only, like the database.
pub fn write(db: &Path, report: &RelayReport) -> std::io::Result<()> {
    let target = path(db);
    let tmp = sibling(db, ".relay-status.json.tmp");
    let json = serde_json::to_vec_pretty(report).map_err(std::io::Error::other)?;
    let mut open = std::fs::OpenOptions::new();
    open.write(true).create(true).truncate(true);
    #[cfg(unix)]
    std::os::unix::fs::OpenOptionsExt::mode(&mut open, 0o600);
    std::io::Write::write_all(&mut open.open(&tmp)?, &json)?;
    std::fs::rename(&tmp, &target)
}

/// Deletes the file (the relay stopped); a missing file is fine.
pub fn remove(db: &Path) {
    let _ = std::fs::remove_file(path(db));
    let _ = std::fs::remove_file(sibling(db, ".relay-status.json.tmp"));
}

/// The last report, if there is a readable one of this format.
pub fn read(db: &Path) -> Option<RelayReport> {
    let bytes = std::fs::read(path(db)).ok()?;
    serde_json::from_slice::<RelayReport>(&bytes)
        .ok()
        .filter(|r| r.format == FORMAT)
}
