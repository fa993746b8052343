//! `edge-outbox doctor`: is the database file damaged, and (with `--salvage`) the salvage by hand.

use std::time::Duration;

use clap::Args;
use edge_outbox::{Options, Outbox, Salvaged};
use rusqlite::{Connection, OpenFlags};
use serde_json::json;

use crate::exit::CliError;
use crate::{Global, Result, db, output};

#[derive(Debug, Args)]
#[command(after_help = "\
Runs SQLite's full integrity check (no time limit; it reads the whole file) without writing \
anything. A damaged file: exit code 3, unless --salvage, which moves it (and its WAL) aside as \
<db>.corrupt-<unix ms> and copies everything readable into a fresh file at the same path, as \
opening the store does by default (docs/operations.md, \"A damaged database\"). No relay or \
application may have the file open meanwhile.")]
pub struct DoctorArgs {
    /// If the file is damaged, salvage it.
    #[arg(long)]
    pub salvage: bool,
}

pub fn run(global: &Global, args: &DoctorArgs) -> Result<()> {
    let path = db::path(global)?;
    db::require_file(&path)?;
    let damage = {
        let flags = OpenFlags::SQLITE_OPEN_READ_ONLY | OpenFlags::SQLITE_OPEN_NO_MUTEX;
        let conn = Connection::open_with_flags(&path, flags).map_err(|e| db::sqlite_error(&path, e))?;
        conn.busy_timeout(Duration::from_millis(global.busy_timeout))
            .map_err(|e| db::sqlite_error(&path, e))?;
        edge_outbox::integrity_check(&conn).map_err(|e| db::library_error(&path, e))?
    };
    let Some(damage) = damage else {
        if global.json {
            return output::print_json(&json!({ "db": path.display().to_string(), "ok": true }));
        }
        return output::print(&format!(
            "ok: {} passes SQLite's integrity check\n",
            path.display()
        ));
    };
    if !args.salvage {
        return Err(CliError::database(format!(
            "{} is damaged: {damage}; `edge-outbox doctor --salvage` moves it aside and salvages what is readable",
            path.display()
        )));
    }
    let options = Options::new().busy_timeout(Duration::from_millis(global.busy_timeout));
    let salvaged = Outbox::salvage(&path, &options).map_err(|e| db::library_error(&path, e))?;
    if global.json {
        return output::print_json(&to_json(&path, &damage, &salvaged));
    }
    output::print(&to_text(&path, &damage, &salvaged))
}

fn to_text(path: &std::path::Path, damage: &str, s: &Salvaged) -> String {
    let mut out = format!(
        "damaged: {damage}\nmoved aside to {}\nsalvaged into {} (new epoch {}): {} pending messages, {} unapplied commands\n",
        s.moved_to.display(),
        path.display(),
        s.epoch,
        s.pending_messages,
        s.unapplied_commands
    );
    for t in &s.tables {
        let lost = if t.lost.is_empty() {
            String::new()
        } else {
            format!(", {} unreadable stretches", t.lost.len())
        };
        let failed = t.failed.as_ref().map_or(String::new(), |f| format!(" ({f})"));
        out.push_str(&format!("  {:<24} {} rows{lost}{failed}\n", t.name, t.rows));
    }
    if !s.unrecoverable.is_empty() {
        out.push_str(&format!(
            "unreadable pending messages, announced to the cloud as an unrecoverable gap: {:?}\n",
            s.unrecoverable
        ));
    }
    out
}

fn to_json(path: &std::path::Path, damage: &str, s: &Salvaged) -> serde_json::Value {
    json!({
        "db": path.display().to_string(),
        "ok": false,
        "damage": damage,
        "moved_to": s.moved_to.display().to_string(),
        "epoch": s.epoch,
        "pending_messages": s.pending_messages,
        "unapplied_commands": s.unapplied_commands,
        "unrecoverable": s.unrecoverable,
        "tables": s.tables.iter().map(|t| json!({
            "name": t.name,
            "rows": t.rows,
            "lost": t.lost,
            "failed": t.failed,
        })).collect::<Vec<_>>(),
    })
}
