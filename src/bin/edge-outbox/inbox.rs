//! `edge-outbox inbox`: commands received, in arrival order.

use clap::Args;
use rusqlite::types::Value as Sql;
use rusqlite::{Connection, Row};
use serde_json::{Value as Json, json};

use crate::db::{self, sqlite_error};
use crate::decode;
use crate::output::{self, Table, now_ms, timestamp};
use crate::pending::text;
use crate::{Global, Result};

#[derive(Debug, Args)]
pub struct InboxArgs {
    /// Show at most this many commands.
    #[arg(long, value_name = "N", default_value_t = 50)]
    pub limit: u32,
    /// Also show applied, rejected and dead-lettered commands (applied ones keep their payload
    /// only with `Options::keep_applied_payloads`).
    #[arg(long)]
    pub all: bool,
}

const COLUMNS: &str = "seq, id, topic, key, payload, event_type, headers, source, received_at, \
                       applied_at, dead_at, attempts, next_attempt_at, last_error";

/// `rejected` came with schema version 8; a file not yet migrated (the CLI reads without
/// migrating) has none, and its rejections read as dead.
fn rejected_column(conn: &Connection) -> &'static str {
    match edge_outbox::schema_version(conn) {
        Ok(v) if v >= 8 => "rejected",
        _ => "0",
    }
}

pub fn run(global: &Global, args: &InboxArgs) -> Result<()> {
    let path = db::path(global)?;
    let conn = db::open_read(global, &path)?;
    let (unapplied, commands) = read(&conn, args).map_err(|e| sqlite_error(&path, e))?;
    if global.json {
        return output::print_json(&json!({
            "unapplied": unapplied,
            "shown": commands.len(),
            "commands": commands,
        }));
    }
    let mut table = Table::new(&[
        "SEQ", "RECEIVED", "STATE", "ATTEMPTS", "ID", "TOPIC", "KEY", "PAYLOAD",
    ]);
    for c in &commands {
        table.row(vec![
            c["seq"].to_string(),
            text(&c["received_at"]),
            text(&c["state"]),
            c["attempts"].to_string(),
            text(&c["id"]),
            text(&c["topic"]),
            text(&c["key"]),
            match &c["payload"] {
                // Dropped at apply unless `Options::keep_applied_payloads`.
                Json::Null if c["state"] == "applied" => "(not kept once applied)".to_owned(),
                payload => payload.to_string(),
            },
        ]);
    }
    let mut out = table.render();
    out.push_str(&format!(
        "{} shown; {unapplied} unapplied{}\n",
        commands.len(),
        if args.all { "" } else { " (--all for applied ones)" }
    ));
    output::print(&out)
}

fn read(conn: &Connection, args: &InboxArgs) -> rusqlite::Result<(u64, Vec<Json>)> {
    let tx = conn.unchecked_transaction()?;
    let unapplied: u64 = tx.query_row(
        "SELECT count(*) FROM inbox WHERE applied_at IS NULL AND dead_at IS NULL",
        [],
        |r| r.get(0),
    )?;
    // Separate statements so the unapplied listing uses its partial index.
    let rejected = rejected_column(&tx);
    let sql = if args.all {
        format!("SELECT {COLUMNS}, {rejected} FROM inbox ORDER BY seq LIMIT ?1")
    } else {
        format!(
            "SELECT {COLUMNS}, {rejected} FROM inbox WHERE applied_at IS NULL AND dead_at IS NULL ORDER BY seq LIMIT ?1"
        )
    };
    let now = now_ms();
    let mut stmt = tx.prepare(&sql)?;
    let commands = stmt
        .query_map([args.limit], |r| command(r, now))?
        .collect::<rusqlite::Result<Vec<_>>>()?;
    drop(stmt);
    tx.finish()?;
    Ok((unapplied, commands))
}

fn command(r: &Row<'_>, now: i64) -> rusqlite::Result<Json> {
    let received: i64 = r.get(8)?;
    let applied: Option<i64> = r.get(9)?;
    let dead: Option<i64> = r.get(10)?;
    let next_attempt: i64 = r.get(12)?;
    let rejected: bool = r.get(14)?;
    // `backoff`: a handler failed and the command waits before its next attempt.
    let state = match (applied, dead) {
        (Some(_), _) => "applied",
        (None, Some(_)) if rejected => "rejected",
        (None, Some(_)) => "dead",
        (None, None) if next_attempt > now => "backoff",
        (None, None) => "unapplied",
    };
    let payload: Sql = r.get(4)?;
    Ok(json!({
        "seq": r.get::<_, i64>(0)?,
        "id": decode::message_id(r.get(1)?),
        "topic": r.get::<_, String>(2)?,
        "key": r.get::<_, String>(3)?,
        "type": r.get::<_, Option<String>>(5)?,
        "headers": decode::column(r.get(6)?),
        "source": r.get::<_, String>(7)?,
        "state": state,
        "received_at": timestamp(received),
        "received_at_ms": received,
        "applied_at_ms": applied,
        "dead_at_ms": dead,
        "attempts": r.get::<_, i64>(11)?,
        "next_attempt_at_ms": (next_attempt > 0).then_some(next_attempt),
        "last_error": r.get::<_, Option<String>>(13)?,
        "payload": decode::column(payload),
    }))
}
