//! `edge-outbox pending`: messages waiting to be published, oldest first.

use clap::Args;
use rusqlite::Connection;
use rusqlite::types::Value as Sql;
use serde_json::{Value as Json, json};

use crate::db::{self, sqlite_error};
use crate::decode;
use crate::output::{self, Table, timestamp};
use crate::{Global, Result};

#[derive(Debug, Args)]
pub struct PendingArgs {
    /// Show at most this many messages.
    #[arg(long, value_name = "N", default_value_t = 50)]
    pub limit: u32,
}

pub fn run(global: &Global, args: &PendingArgs) -> Result<()> {
    let path = db::path(global)?;
    let conn = db::open_read(global, &path)?;
    let (total, messages) = read(&conn, args.limit).map_err(|e| sqlite_error(&path, e))?;
    if global.json {
        return output::print_json(&json!({
            "total": total,
            "shown": messages.len(),
            "messages": messages,
        }));
    }
    let mut table = Table::new(&["SEQ", "CREATED", "ID", "TOPIC", "KEY", "PAYLOAD"]);
    for m in &messages {
        table.row(vec![
            m["seq"].to_string(),
            text(&m["created_at"]),
            text(&m["id"]),
            text(&m["topic"]),
            text(&m["key"]),
            m["payload"].to_string(),
        ]);
    }
    let mut out = table.render();
    out.push_str(&format!("{} of {total} pending shown\n", messages.len()));
    output::print(&out)
}

/// The pending count and the first `limit` rows as JSON objects.
fn read(conn: &Connection, limit: u32) -> rusqlite::Result<(u64, Vec<Json>)> {
    let tx = conn.unchecked_transaction()?;
    let total: u64 = tx.query_row("SELECT count(*) FROM outbox", [], |r| r.get(0))?;
    let mut stmt = tx.prepare(
        "SELECT seq, id, topic, key, payload, event_type, headers, evictable, created_at
         FROM outbox ORDER BY seq LIMIT ?1",
    )?;
    let rows = stmt.query_map([limit], |r| {
        let payload: Sql = r.get(4)?;
        let created: i64 = r.get(8)?;
        Ok(json!({
            "seq": r.get::<_, i64>(0)?,
            "id": decode::message_id(r.get(1)?),
            "topic": r.get::<_, String>(2)?,
            "key": r.get::<_, String>(3)?,
            "type": r.get::<_, Option<String>>(5)?,
            "headers": decode::column(r.get(6)?),
            "evictable": r.get::<_, bool>(7)?,
            "created_at": timestamp(created),
            "created_at_ms": created,
            "payload_bytes": decode::column_len(&payload),
            "payload": decode::column(payload),
        }))
    })?;
    let messages = rows.collect::<rusqlite::Result<Vec<_>>>()?;
    drop(stmt);
    tx.finish()?;
    Ok((total, messages))
}

/// A JSON string without its quotes (`-` when empty or null); anything else as JSON.
pub fn text(v: &Json) -> String {
    match v {
        Json::String(s) if !s.is_empty() => s.clone(),
        Json::String(_) | Json::Null => "-".to_owned(),
        other => other.to_string(),
    }
}
