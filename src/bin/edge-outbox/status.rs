//! `edge-outbox status`: the store's counters, sizes, and whether a relay is running.

use std::path::Path;
use std::time::Duration;

use edge_outbox::{SCHEMA_VERSION, Stats};
use rusqlite::Connection;
use serde_json::json;

use crate::db;
use crate::output::{self, age_ms, bytes, count, duration};
use crate::relay_probe::{self, Probe};
use crate::status_file::{self, RelayReport};

/// A Unix-milliseconds time as an operator reads it: `12:01:07 UTC` today, the full RFC 3339
/// time otherwise.
fn clock(ms: i64) -> String {
    let stamp = crate::output::timestamp(ms);
    let today = crate::output::timestamp(crate::output::now_ms());
    match (stamp.get(..10), today.get(..10), stamp.get(11..19)) {
        (Some(day), Some(now), Some(hms)) if day == now => format!("{hms} UTC"),
        _ => stamp,
    }
}
use crate::{Global, Result};

/// The library's stats, read over the read-only connection, and the file's schema version.
struct Counters {
    schema_version: i64,
    oldest_pending_ms: Option<u64>,
    stats: Stats,
    /// The key ids the file requires commands to be signed by, and since when; `None`: unsigned
    /// commands are accepted.
    signed: Option<(Vec<String>, i64)>,
}

pub fn run(global: &Global) -> Result<()> {
    let path = db::path(global)?;
    let conn = db::open_read(global, &path)?;
    let counters = read(&conn).map_err(|e| db::library_error(&path, e))?;
    drop(conn);
    let relay = Relay::find(&path);
    let sizes = (db::file_size(&path), db::file_size(&db::sibling(&path, "-wal")));
    if global.json {
        output::print_json(&to_json(&path, &counters, sizes, &relay))
    } else {
        output::print(&to_text(&path, &counters, sizes, &relay))
    }
}

fn read(conn: &Connection) -> edge_outbox::Result<Counters> {
    let stats = Stats::read(conn)?;
    let schema_version = edge_outbox::schema_version(conn)?;
    Ok(Counters {
        schema_version,
        oldest_pending_ms: stats.oldest_pending_age.map(|d| d.as_millis() as u64),
        stats,
        signed: if schema_version >= 7 {
            signature_policy(conn)?
        } else {
            None
        },
    })
}

/// The command signature policy, read from its documented tables (docs/schema.md).
fn signature_policy(conn: &Connection) -> edge_outbox::Result<Option<(Vec<String>, i64)>> {
    use rusqlite::OptionalExtension as _;
    let since: Option<i64> = conn
        .query_row("SELECT required_since FROM edge_outbox_command_policy", [], |r| {
            r.get(0)
        })
        .optional()?;
    let Some(since) = since else {
        return Ok(None);
    };
    let keys = conn
        .prepare("SELECT key_id FROM edge_outbox_command_keys ORDER BY key_id")?
        .query_map([], |r| r.get(0))?
        .collect::<rusqlite::Result<Vec<String>>>()?;
    Ok(Some((keys, since)))
}

/// The relay as other processes can see it: the lock, and the status file if it is current.
struct Relay {
    probe: Probe,
    report: Option<RelayReport>,
    report_age_ms: u64,
}

impl Relay {
    fn find(path: &Path) -> Relay {
        let probe = relay_probe::probe(path);
        let report = status_file::read(path);
        let report_age_ms = report.as_ref().map_or(0, |r| age_ms(r.written_at_ms));
        Relay {
            probe,
            report,
            report_age_ms,
        }
    }

    /// The status file, if it describes the relay running now.
    fn current(&self) -> Option<&RelayReport> {
        let fresh = self.report.as_ref().is_some_and(RelayReport::is_fresh);
        let holder_matches = match &self.probe {
            Probe::Running { pid: Some(pid) } => self.report.as_ref().is_some_and(|r| r.pid == *pid),
            Probe::Running { pid: None } | Probe::Unknown(_) => true,
            Probe::NotRunning => false,
        };
        self.report.as_ref().filter(|_| fresh && holder_matches)
    }

    fn running(&self) -> Option<bool> {
        match self.probe {
            Probe::NotRunning => Some(false),
            Probe::Running { .. } => Some(true),
            Probe::Unknown(_) => self.current().map(|_| true),
        }
    }
}

fn to_json(path: &Path, c: &Counters, (file, wal): (u64, u64), relay: &Relay) -> serde_json::Value {
    let pid = match &relay.probe {
        Probe::Running { pid } => *pid,
        _ => None,
    };
    json!({
        "db": path.display().to_string(),
        "schema_version": c.schema_version,
        "supported_schema_version": SCHEMA_VERSION,
        "file_bytes": file,
        "wal_bytes": wal,
        "pending": {
            "messages": c.stats.pending_messages,
            "bytes": c.stats.pending_bytes,
            "oldest_age_ms": c.oldest_pending_ms,
        },
        "evicted": { "messages": c.stats.evicted, "bytes": c.stats.evicted_bytes },
        "coalesced": c.stats.coalesced,
        "epoch": c.stats.epoch,
        "gaps_unannounced": c.stats.gaps_unannounced,
        "salvaged": c.stats.salvaged,
        "signed_commands": match &c.signed {
            Some((keys, since)) => json!({ "required": true, "keys": keys, "since_ms": since }),
            None => json!({ "required": false }),
        },
        "dead_letters": c.stats.dead_letters,
        "refusals": {
            "kept": c.stats.refusals_kept,
            "kept_bytes": c.stats.refusals_kept_bytes,
            "evicted": c.stats.refusals_evicted,
        },
        "inbox": {
            "unapplied": c.stats.inbox_unapplied,
            "applied": c.stats.inbox_applied,
            "rejected": c.stats.inbox_rejected,
        },
        "relay": {
            "running": relay.running(),
            "pid": pid,
            "probe_error": match &relay.probe { Probe::Unknown(why) => Some(why), _ => None },
            "status": relay.current(),
            "status_age_ms": relay.current().map(|_| relay.report_age_ms),
        },
    })
}

fn to_text(path: &Path, c: &Counters, (file, wal): (u64, u64), relay: &Relay) -> String {
    let mut lines = vec![
        format!(
            "database      {} (schema {}; this build supports {SCHEMA_VERSION})",
            path.display(),
            c.schema_version
        ),
        format!("size          {} file, {} WAL", bytes(file), bytes(wal)),
        format!(
            "pending       {}, {}{}",
            count(c.stats.pending_messages, "message"),
            bytes(c.stats.pending_bytes),
            c.oldest_pending_ms.map_or(String::new(), |ms| format!(
                ", the oldest waiting for {}",
                duration(Duration::from_millis(ms))
            ))
        ),
        format!(
            "evicted       {}, {}",
            count(c.stats.evicted, "message"),
            bytes(c.stats.evicted_bytes)
        ),
        format!(
            "coalesced     {} (replaced unsent by a newer value of their topic and key)",
            count(c.stats.coalesced, "message")
        ),
        format!(
            "epoch         {} ({} removed unpublished, not yet announced to the cloud{})",
            c.stats.epoch,
            count(c.stats.gaps_unannounced, "message"),
            if c.stats.salvaged > 0 {
                format!("; salvaged after damage {}", count(c.stats.salvaged, "time"))
            } else {
                String::new()
            }
        ),
        match &c.signed {
            Some((keys, since)) => format!(
                "commands      must be signed by one of [{}] (required since {})",
                keys.join(", "),
                clock(*since)
            ),
            None => "commands      accepted unsigned (no signature required)".to_owned(),
        },
        format!(
            "dead letters  {} (outgoing and incoming, kept until retried or dropped{})",
            c.stats.dead_letters,
            if c.stats.refusals_kept + c.stats.refusals_evicted > 0 {
                format!(
                    "; {} refused deliveries, {}, {} older ones evicted",
                    c.stats.refusals_kept,
                    bytes(c.stats.refusals_kept_bytes),
                    c.stats.refusals_evicted
                )
            } else {
                String::new()
            }
        ),
        format!(
            "inbox         {} unapplied, {} applied, {} rejected (ids kept for deduplication)",
            c.stats.inbox_unapplied, c.stats.inbox_applied, c.stats.inbox_rejected
        ),
    ];
    lines.extend(relay_lines(relay));
    let mut text = lines.join("\n");
    text.push('\n');
    text
}

/// The figures that grow with any outage (the oldest pending message need not: a coalescing
/// stream keeps it young): how long publishing has been down, and the last PUBACK's age.
fn lag_line(r: &RelayReport) -> String {
    let ago = |ms: i64| duration(Duration::from_millis(age_ms(ms)));
    let down = match r.disconnected_since_ms {
        Some(since) => format!("publishing down for {}", ago(since)),
        None => "publishing connected".to_owned(),
    };
    let ack = match r.last_ack_ms {
        Some(at) => format!("last PUBACK {} ago", ago(at)),
        None => "no PUBACK yet".to_owned(),
    };
    format!("{down}, {ack}")
}

fn relay_lines(relay: &Relay) -> Vec<String> {
    let head = match &relay.probe {
        Probe::NotRunning => "relay         not running".to_owned(),
        Probe::Running { pid: Some(pid) } => format!("relay         running (pid {pid})"),
        Probe::Running { pid: None } => "relay         running".to_owned(),
        Probe::Unknown(why) => format!("relay         unknown ({why})"),
    };
    let Some(r) = relay.current() else {
        let note = match (&relay.probe, &relay.report) {
            (Probe::Running { .. }, None) => {
                "              no status file: counters are only known inside that process"
            }
            (Probe::Running { .. }, Some(_)) => {
                "              its status file is stale or from another process: is it hung?"
            }
            _ => return vec![head],
        };
        return vec![head, note.to_owned()];
    };
    let protocol = if r.protocol.is_empty() {
        String::new()
    } else {
        format!(" over MQTT {}", r.protocol)
    };
    let connection = if r.connected {
        format!("connected to {}{protocol} as {}", r.broker, r.client_id)
    } else {
        // What an operator needs first: why, and since when.
        let why = match (&r.last_error, r.last_error_since_ms) {
            (Some(e), Some(since)) => format!(": {e}, since {}", clock(since)),
            (Some(e), None) => format!(": {e}"),
            (None, _) => String::new(),
        };
        format!(
            "disconnected from {}{protocol} (client {}){why}",
            r.broker, r.client_id
        )
    };
    let failover = if r.brokers.len() > 1 {
        format!(" (failover list: {})", r.brokers.join(", "))
    } else {
        String::new()
    };
    let mut lines = vec![
        format!("{head}, {connection}{failover}"),
        format!(
            "              since start: {} in flight, {} published, {} acknowledged, {} dead-lettered \
             ({} refused by the broker, {} set aside as poison), {} expired, {} announced as gaps \
             in {}, {}",
            r.in_flight,
            count(r.published, "message"),
            r.acknowledged,
            r.dead_lettered,
            r.refused,
            r.isolated,
            r.expired,
            r.gaps_announced,
            count(r.notices_published, "notice"),
            count(r.connections, "connection")
        ),
    ];
    lines.push(format!("              {}", lag_line(r)));
    if let Some(kind) = &r.credential {
        let expires = r.credential_expires_ms.map_or(String::new(), |at| {
            format!(", the current one expires {} (renewed before then)", clock(at))
        });
        lines.push(format!("              authenticates with: {kind}{expires}"));
    }
    if let Some(filter) = &r.commands {
        lines.push(format!(
            "              commands on {filter}: {}, {} received, {} duplicates, {} malformed, \
             {} retained ignored; {} applied, {} rejected, {} dead-lettered after their attempts",
            if r.commands_connected {
                "subscribed"
            } else {
                "not connected"
            },
            r.commands_received,
            r.commands_duplicate,
            r.commands_malformed,
            r.commands_retained_ignored,
            r.commands_applied,
            r.commands_rejected,
            r.commands_dead_lettered
        ));
    }
    if let (true, Some(e)) = (r.connected, &r.last_error) {
        let since = r
            .last_error_since_ms
            .map_or(String::new(), |t| format!(", since {}", clock(t)));
        lines.push(format!("              error: {e}{since}"));
    }
    if let Some(e) = &r.previous_error {
        let cleared = r
            .previous_error_cleared_ms
            .map_or(String::new(), |t| format!(", cleared {}", clock(t)));
        lines.push(format!("              previous error: {e}{cleared}"));
    }
    lines.push(format!(
        "              (relay status file written {} ago)",
        duration(Duration::from_millis(relay.report_age_ms))
    ));
    lines
}
