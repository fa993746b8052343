//! `edge-outbox schema list | show TYPE | check`: the payload schemas recorded in the file
//! (docs/schemas.md), read-only. `check` (feature `schemas`) checks the pending rows, or one
//! payload, against them, and exits 7 when one breaks its schema.

use clap::{Args, Subcommand};
use rusqlite::Connection;
use serde_json::json;

use crate::exit::CliError;
use crate::{Global, Result, db, output};

#[derive(Debug, Subcommand)]
pub enum SchemaCommand {
    /// Every schema: event type, version, topic filter, when it was registered.
    List,
    /// The CDDL of an event type (its newest version unless --version).
    Show {
        /// The event type, e.g. order.placed.
        event_type: String,
        /// The version to show.
        #[arg(long)]
        version: Option<u32>,
    },
    /// Check the pending rows (or one payload) against the schemas; exit 7 if one breaks its schema.
    #[cfg(feature = "schemas")]
    Check(CheckArgs),
}

#[derive(Debug, Args)]
pub struct CheckArgs {
    /// Check this payload, given as JSON (encoded to CBOR as a writer would), instead of the
    /// pending rows.
    #[arg(long, value_name = "JSON", requires = "topic")]
    payload: Option<String>,
    /// The topic the payload would be published on.
    #[arg(long)]
    topic: Option<String>,
    /// The payload's event type (selects its schema before the topic does).
    #[arg(long = "type", value_name = "EVENT_TYPE")]
    event_type: Option<String>,
}

struct Row {
    event_type: String,
    version: u32,
    topic_filter: String,
    cddl: String,
    registered_at: i64,
}

pub fn run(global: &Global, command: &SchemaCommand) -> Result<()> {
    let path = db::path(global)?;
    let conn = db::open_read(global, &path)?;
    match command {
        SchemaCommand::List => list(global, &rows(&conn)?),
        SchemaCommand::Show { event_type, version } => {
            let rows = rows(&conn)?;
            let found = rows
                .iter()
                .filter(|r| &r.event_type == event_type && version.is_none_or(|v| r.version == v))
                .max_by_key(|r| r.version)
                .ok_or_else(|| {
                    CliError::new(
                        crate::exit::Code::NotFound,
                        format!(
                            "no schema {event_type}{} in this file",
                            version.map(|v| format!(" v{v}")).unwrap_or_default()
                        ),
                    )
                })?;
            if global.json {
                output::print_json(&json!({
                    "event_type": found.event_type, "version": found.version,
                    "topic_filter": found.topic_filter, "cddl": found.cddl,
                }))
            } else {
                output::print(&format!("{}\n", found.cddl.trim_end()))
            }
        }
        #[cfg(feature = "schemas")]
        SchemaCommand::Check(args) => check(global, &conn, args),
    }
}

fn list(global: &Global, rows: &[Row]) -> Result<()> {
    if global.json {
        let list: Vec<_> = rows
            .iter()
            .map(|r| {
                json!({
                    "event_type": r.event_type, "version": r.version,
                    "topic_filter": r.topic_filter, "registered_at_ms": r.registered_at,
                })
            })
            .collect();
        return output::print_json(&json!({ "schemas": list }));
    }
    if rows.is_empty() {
        return output::print("no payload schemas in this file\n");
    }
    let mut table = output::Table::new(&["EVENT TYPE", "VERSION", "TOPICS", "REGISTERED"]);
    for r in rows {
        table.row(vec![
            r.event_type.clone(),
            r.version.to_string(),
            r.topic_filter.clone(),
            output::timestamp(r.registered_at),
        ]);
    }
    output::print(&table.render())
}

/// The file's schemas; none in a file from before they existed (schema version 8).
fn rows(conn: &Connection) -> Result<Vec<Row>> {
    let exists: bool = conn.query_row(
        "SELECT EXISTS (SELECT 1 FROM sqlite_schema WHERE type = 'table' AND name = 'edge_outbox_schemas')",
        [],
        |r| r.get(0),
    )?;
    if !exists {
        return Ok(Vec::new());
    }
    let mut stmt = conn.prepare(
        "SELECT event_type, version, topic_filter, cddl, registered_at FROM edge_outbox_schemas ORDER BY rowid",
    )?;
    let rows = stmt
        .query_map([], |r| {
            Ok(Row {
                event_type: r.get(0)?,
                version: r.get(1)?,
                topic_filter: r.get(2)?,
                cddl: r.get(3)?,
                registered_at: r.get(4)?,
            })
        })?
        .collect::<rusqlite::Result<Vec<_>>>()?;
    Ok(rows)
}

#[cfg(feature = "schemas")]
fn check(global: &Global, conn: &Connection, args: &CheckArgs) -> Result<()> {
    let schemas = edge_outbox::Schemas::load(conn)?;
    if let (Some(payload), Some(topic)) = (&args.payload, &args.topic) {
        let value: serde_json::Value = serde_json::from_str(payload)
            .map_err(|e| CliError::usage(format!("--payload is not valid JSON: {e}")))?;
        let cbor = edge_outbox::envelope::to_cbor(&value)?;
        schemas.check(topic, args.event_type.as_deref(), None, &cbor)?;
        return if global.json {
            output::print_json(&json!({ "ok": true }))
        } else {
            output::print("the payload matches its schema\n")
        };
    }
    let bad = super::schema_pending::failing(conn, &schemas)?;
    if global.json {
        let list: Vec<_> = bad
            .iter()
            .map(|(seq, topic, why)| json!({ "seq": seq, "topic": topic, "reason": why }))
            .collect();
        output::print_json(&json!({ "failing": list }))?;
    } else {
        for (seq, topic, why) in &bad {
            output::print(&format!("#{seq} {topic}: {why}\n"))?;
        }
    }
    match bad.len() {
        0 => {
            if !global.json {
                output::print("every pending row matches its schema\n")?;
            }
            Ok(())
        }
        n => Err(CliError::new(
            crate::exit::Code::SchemaViolation,
            format!("{n} pending row(s) break their schema: the relay will dead-letter them"),
        )),
    }
}
