//! `edge-outbox dead-letters list | retry ID | drop ID`.

use clap::Subcommand;
use rusqlite::Connection;
use rusqlite::types::Value as Sql;
use serde_json::{Value as Json, json};

use crate::db::{self, sqlite_error};
use crate::decode;
use crate::output::{self, timestamp};
use crate::pending::text;
use crate::{Global, Result};

#[derive(Debug, Subcommand)]
pub enum DeadLettersCommand {
    /// Dead letters, oldest first, with the reason and the payload decoded to JSON.
    List {
        /// Show at most this many.
        #[arg(long, value_name = "N", default_value_t = 50)]
        limit: u32,
    },
    /// Put one back: a message is queued again (same id, behind what is pending), a command gets
    /// a fresh set of attempts.
    Retry {
        /// The dead letter's ID, as `list` shows it.
        #[arg(value_parser = clap::value_parser!(i64).range(1..))]
        id: i64,
    },
    /// Delete one for good.
    Drop {
        /// The dead letter's ID, as `list` shows it.
        #[arg(value_parser = clap::value_parser!(i64).range(1..))]
        id: i64,
    },
}

pub fn run(global: &Global, command: &DeadLettersCommand) -> Result<()> {
    let path = db::path(global)?;
    match *command {
        DeadLettersCommand::List { limit } => {
            let conn = db::open_read(global, &path)?;
            let (total, letters) = read(&conn, limit).map_err(|e| sqlite_error(&path, e))?;
            if global.json {
                output::print_json(&json!({
                    "total": total,
                    "shown": letters.len(),
                    "dead_letters": letters,
                }))
            } else {
                output::print(&render(total, &letters))
            }
        }
        DeadLettersCommand::Retry { id } => {
            db::open_write(global, &path)?.retry_dead_letter(id)?;
            done(global, id, "retried", "put back")
        }
        DeadLettersCommand::Drop { id } => {
            db::open_write(global, &path)?.drop_dead_letter(id)?;
            done(global, id, "dropped", "deleted")
        }
    }
}

fn done(global: &Global, id: i64, action: &str, said: &str) -> Result<()> {
    if global.json {
        output::print_json(&json!({ "dead_letter_id": id, "action": action }))
    } else {
        output::print(&format!("dead letter {id} {said}\n"))
    }
}

fn read(conn: &Connection, limit: u32) -> rusqlite::Result<(u64, Vec<Json>)> {
    let tx = conn.unchecked_transaction()?;
    let total: u64 = tx.query_row("SELECT count(*) FROM dead_letters", [], |r| r.get(0))?;
    let mut stmt = tx.prepare(
        "SELECT dl_id, origin, message_id, topic, key, payload, event_type, headers, reason,
                attempts, created_at, dead_at
         FROM dead_letters ORDER BY dl_id LIMIT ?1",
    )?;
    let letters = stmt
        .query_map([limit], |r| {
            let payload: Sql = r.get(5)?;
            let dead: i64 = r.get(11)?;
            Ok(json!({
                "id": r.get::<_, i64>(0)?,
                "origin": r.get::<_, String>(1)?,
                "message_id": decode::message_id(r.get(2)?),
                "topic": r.get::<_, String>(3)?,
                "key": r.get::<_, String>(4)?,
                "type": r.get::<_, Option<String>>(6)?,
                "headers": decode::column(r.get(7)?),
                "reason": r.get::<_, String>(8)?,
                "attempts": r.get::<_, i64>(9)?,
                "created_at_ms": r.get::<_, Option<i64>>(10)?,
                "dead_at": timestamp(dead),
                "dead_at_ms": dead,
                "payload_bytes": decode::column_len(&payload),
                "payload": decode::column(payload),
            }))
        })?
        .collect::<rusqlite::Result<Vec<_>>>()?;
    drop(stmt);
    tx.finish()?;
    Ok((total, letters))
}

/// One block per dead letter: the reasons are long, a table would be unreadable.
fn render(total: u64, letters: &[Json]) -> String {
    let mut out = String::new();
    for d in letters {
        out.push_str(&format!(
            "#{}  {}  dead since {}  attempts {}\n    topic {}  key {}  message {}\n    reason:  {}\n    payload: {}\n",
            d["id"],
            text(&d["origin"]),
            text(&d["dead_at"]),
            d["attempts"],
            text(&d["topic"]),
            text(&d["key"]),
            text(&d["message_id"]),
            text(&d["reason"]),
            d["payload"],
        ));
    }
    out.push_str(&format!(
        "{} of {total} dead letters shown{}\n",
        letters.len(),
        if total > 0 {
            "; `edge-outbox dead-letters retry ID` or `drop ID`"
        } else {
            ""
        }
    ));
    out
}
