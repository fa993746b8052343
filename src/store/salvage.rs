//! A damaged file does not brick the device: what can still be read is copied into a fresh file.
//!
//! The fresh file is built beside the damaged one (`<name>.salvaging`), from the damaged one read
//! on a connection of its own (an error there never touches the fresh file's transaction; nothing
//! is written to the damaged file): every table the application had, with
//! every row SQLite can still read, and edge-outbox's own tables (pending messages, their gap
//! rows, commands, dead letters). Pending messages keep their sequence numbers and epoch, so a
//! message the cloud already has is recognised as such; the numbers between readable rows that a
//! damaged page held are recorded as an `unrecoverable` gap for the relay to announce. New
//! messages are numbered in a new epoch, after every number the damaged file may have used. When
//! the epochs themselves are unreadable, pending messages are numbered anew and the gap rows are
//! not copied (their numbers name no epoch any more). A virtual table (FTS5, R*Tree) keeps its
//! definition as written and its shadow tables' rows, so no module is needed to copy it.
//!
//! Then the damaged file (and its WAL) is renamed `<name>.corrupt-<unix ms>` for an operator, and
//! the fresh one takes its place. A crash before that swap leaves the damaged file in place (the
//! next open salvages again); a crash in the middle of it leaves the fresh file under its
//! temporary name, and the next open finishes the swap ([`finish_interrupted`]).
//!
//! Reading around damage: rows are read in rowid order from a cursor; when a read fails, the
//! next readable rowid is found by seeking further (doubling the step, then halving back), and
//! the rowids skipped are reported lost. A row whose own content is unreadable is skipped alone.
//! A `WITHOUT ROWID` table has no rowid to seek by: it is copied in key order up to its first
//! unreadable page.

use std::path::{Path, PathBuf};

use rusqlite::types::Value;
use rusqlite::{Connection, OptionalExtension, TransactionBehavior, params};

use super::epoch;
use super::open;
use super::options::Options;
use crate::error::{Error, Result};
use crate::time::now_ms;

/// What a salvage did. See [`Outbox::salvage`](crate::Outbox::salvage).
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct Salvaged {
    /// Where the damaged file (and its WAL) now is.
    pub moved_to: PathBuf,
    /// The epoch new messages are numbered in.
    pub epoch: u64,
    /// Tables copied: name, rows copied, rows (or row ranges) that could not be read.
    pub tables: Vec<SalvagedTable>,
    /// Pending messages whose numbers could not be read, as outbox `seq` ranges: announced to
    /// the cloud as an `unrecoverable` gap. Numbers a gap row already accounted for (removed
    /// earlier, their own notice still to go) are left out.
    pub unrecoverable: Vec<(i64, i64)>,
    /// Pending messages salvaged.
    pub pending_messages: u64,
    /// Commands received and not yet applied, salvaged.
    pub unapplied_commands: u64,
}

/// One table of a salvage.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct SalvagedTable {
    /// The table.
    pub name: String,
    /// Rows copied.
    pub rows: u64,
    /// Rowid ranges that could not be read (`i64::MAX` as the end: up to the end of the table).
    /// For a `WITHOUT ROWID` table, positions in key order: its copy stops at the first
    /// unreadable page.
    pub lost: Vec<(i64, i64)>,
    /// Why the table could not be copied at all, if so.
    pub failed: Option<String>,
}

/// Tables edge-outbox fills in itself in the fresh file, or that are SQLite's.
const NOT_COPIED: &[&str] = &[
    "edge_outbox_meta",
    "edge_outbox_epochs",
    "outbox_counters",
    "sqlite_sequence",
];

/// Rows read per statement.
const BATCH: i64 = 500;

fn sibling(path: &Path, suffix: &str) -> PathBuf {
    let mut name = path.as_os_str().to_owned();
    name.push(suffix);
    PathBuf::from(name)
}

/// The fresh file's name while it is built.
fn temporary(path: &Path) -> PathBuf {
    sibling(path, ".salvaging")
}

/// If a salvage was interrupted between moving the damaged file aside and moving the fresh one in,
/// moves it in. Cheap when there is nothing to do (two `stat`s).
pub(crate) fn finish_interrupted(path: &Path) -> Result<()> {
    let fresh = temporary(path);
    if path.exists() || !fresh.exists() {
        return Ok(());
    }
    tracing::warn!(path = %path.display(), "finishing a salvage interrupted by a crash");
    std::fs::rename(&fresh, path).map_err(|e| Error::io(format!("moving {} into place", fresh.display()), e))
}

/// Salvages the damaged file at `path`: see the module docs. No relay may run on it.
pub(crate) fn salvage(path: &Path, options: &Options, why: &str) -> Result<Salvaged> {
    let _lock = super::relay_lock::RelayLock::acquire(path)?;
    let fresh = temporary(path);
    for leftover in [fresh.clone(), sibling(&fresh, "-wal"), sibling(&fresh, "-shm")] {
        match std::fs::remove_file(&leftover) {
            Ok(()) => {}
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
            Err(e) => return Err(Error::io(format!("removing {}", leftover.display()), e)),
        }
    }
    let mut report = {
        let mut conn = open::connect(&fresh, options)?;
        let report = copy_into(&mut conn, path)?;
        conn.execute_batch("PRAGMA wal_checkpoint(TRUNCATE)")?;
        conn.close().map_err(|(_, e)| Error::from(e))?;
        report
    };
    let moved_to = sibling(path, &format!(".corrupt-{}", now_ms()));
    let rename = |from: &Path, to: &Path| -> Result<()> {
        match std::fs::rename(from, to) {
            Ok(()) => Ok(()),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(()),
            Err(e) => Err(Error::io(
                format!("moving {} to {}", from.display(), to.display()),
                e,
            )),
        }
    };
    // The WAL first: were the main file moved and the WAL left, SQLite would apply the damaged
    // file's WAL to the fresh one.
    rename(&sibling(path, "-wal"), &sibling(&moved_to, "-wal"))?;
    let _ = std::fs::remove_file(sibling(path, "-shm"));
    rename(path, &moved_to)?;
    std::fs::rename(&fresh, path)
        .map_err(|e| Error::io(format!("moving {} into place", fresh.display()), e))?;
    if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
        // The renames are durable once the directory is synced.
        if let Ok(d) = std::fs::File::open(dir) {
            let _ = d.sync_all();
        }
    }
    report.moved_to = moved_to;
    tracing::error!(
        path = %path.display(),
        moved_to = %report.moved_to.display(),
        why,
        pending_messages = report.pending_messages,
        unapplied_commands = report.unapplied_commands,
        unrecoverable = ?report.unrecoverable,
        epoch = report.epoch,
        lost = ?report.tables.iter().filter(|t| !t.lost.is_empty() || t.failed.is_some()).collect::<Vec<_>>(),
        "the database was damaged: moved it aside and salvaged what was readable into a fresh file"
    );
    Ok(report)
}

/// Copies what is readable of the damaged file at `damaged` into the fresh store `conn`.
fn copy_into(conn: &mut Connection, damaged: &Path) -> Result<Salvaged> {
    let mut report = Salvaged {
        moved_to: PathBuf::new(),
        epoch: 0,
        tables: Vec::new(),
        unrecoverable: Vec::new(),
        pending_messages: 0,
        unapplied_commands: 0,
    };
    let src = Connection::open(damaged).and_then(|c| {
        // Reading must not write: no checkpoint of the damaged file's WAL into it on close.
        c.set_db_config(rusqlite::config::DbConfig::SQLITE_DBCONFIG_NO_CKPT_ON_CLOSE, true)?;
        c.query_row("SELECT count(*) FROM sqlite_schema", [], |r| r.get::<_, i64>(0))?;
        Ok(c)
    });
    let tx = conn.transaction_with_behavior(TransactionBehavior::Immediate)?;
    let salvaged_before: i64 = match &src {
        Ok(src) => {
            // The numbers acknowledged from this path, kept beside it: new messages must not
            // reuse them even if the damaged file's counter is unreadable.
            let published = super::published::read(damaged).unwrap_or(0);
            copy_all(src, &tx, &mut report, published)?;
            src.query_row(
                "SELECT value FROM edge_outbox_meta WHERE name = 'corruptions_salvaged'",
                [],
                |r| r.get(0),
            )
            .optional()
            .ok()
            .flatten()
            .unwrap_or(0)
        }
        Err(e) => {
            tracing::error!(error = %e, "nothing of the damaged file is readable: starting empty");
            report.tables.push(SalvagedTable {
                name: "sqlite_schema".into(),
                rows: 0,
                lost: vec![(1, i64::MAX)],
                failed: Some(e.to_string()),
            });
            epoch_after(&tx, 0, "salvaged")?;
            0
        }
    };
    report.epoch = epoch::current(&tx)?;
    tx.execute(
        "INSERT INTO edge_outbox_meta (name, value) VALUES ('corruptions_salvaged', ?1)
         ON CONFLICT (name) DO UPDATE SET value = excluded.value",
        [salvaged_before + 1],
    )?;
    tx.commit()?;
    Ok(report)
}

/// Copies from the damaged file `src` into the fresh one's open transaction `tx`; `published`:
/// the highest number acknowledged from it (its watermark).
fn copy_all(src: &Connection, tx: &Connection, report: &mut Salvaged, published: i64) -> Result<()> {
    // The damaged file's schema: what it had, in creation order.
    let schema: Vec<(String, String, Option<String>, i64)> = rows_or_empty(
        src,
        "SELECT type, name, sql, coalesce(rootpage, 0) FROM sqlite_schema ORDER BY rowid",
        |r| Ok((r.get(0)?, r.get(1)?, r.get(2)?, r.get(3)?)),
    );
    let old_epochs: Option<Vec<(i64, i64, String, i64)>> = src
        .prepare("SELECT epoch, first_seq, reason, started_at FROM edge_outbox_epochs ORDER BY first_seq")
        .and_then(|mut s| {
            s.query_map([], |r| Ok((r.get(0)?, r.get(1)?, r.get(2)?, r.get(3)?)))?
                .collect()
        })
        .ok()
        .filter(|e: &Vec<_>| !e.is_empty());
    let old_high: Option<i64> = src
        .query_row("SELECT seq FROM sqlite_sequence WHERE name = 'outbox'", [], |r| {
            r.get(0)
        })
        .optional()
        .ok()
        .flatten();

    let mut virtual_tables = Vec::new();
    for (kind, name, sql, rootpage) in &schema {
        if kind != "table" || name.starts_with("sqlite_") || NOT_COPIED.contains(&name.as_str()) {
            continue;
        }
        if *rootpage == 0 && !crate::mutant::active("salvage-virtual-table-recreated") {
            // A virtual table (FTS5, R*Tree, ...): its rows live in its shadow tables, which are
            // ordinary tables of this schema and are copied as they are. Only its definition is
            // kept, not created again through its module, which this build may lack.
            if let Some(sql) = sql {
                virtual_tables.push((name.clone(), sql.clone()));
            }
            continue;
        }
        if !exists(tx, name)? {
            let Some(sql) = sql else { continue };
            if let Err(e) = tx.execute_batch(sql) {
                report.tables.push(SalvagedTable {
                    name: name.clone(),
                    rows: 0,
                    lost: vec![(1, i64::MAX)],
                    failed: Some(format!("could not create it again: {e}")),
                });
                continue;
            }
        }
        // Without the damaged file's epochs, its messages cannot keep their numbers: they are
        // numbered anew, in the new epoch (their ids are kept, so the cloud recognises them).
        let renumber = name == "outbox" && old_epochs.is_none();
        // Nor can its gap rows: their numbers belong to epochs nobody can name any more, and
        // copied as they are they would name the renumbered messages. Their numbers show in the
        // cloud as unexplained, which is what they have become.
        if name == "outbox_gaps"
            && old_epochs.is_none()
            && !crate::mutant::active("salvage-renumbered-gaps-kept")
        {
            let rows = src
                .query_row("SELECT count(*) FROM outbox_gaps", [], |r| r.get::<_, i64>(0))
                .map_or_else(|_| "its".to_owned(), |n| n.to_string());
            tracing::error!(
                rows,
                "salvage: the epochs are unreadable, so the gap rows cannot be announced"
            );
            report.tables.push(SalvagedTable {
                name: name.clone(),
                rows: 0,
                lost: Vec::new(),
                failed: Some(format!(
                    "not copied: {rows} gap rows name numbers of epochs that could not be read"
                )),
            });
            continue;
        }
        let table = copy_table(src, tx, name, renumber);
        if name == "outbox" {
            report.pending_messages = table.rows;
        }
        if name == "inbox" {
            report.unapplied_commands = tx
                .query_row(
                    "SELECT count(*) FROM main.inbox WHERE applied_at IS NULL AND dead_at IS NULL",
                    [],
                    |r| r.get::<_, i64>(0),
                )
                .map_or(0, |n| u64::try_from(n).unwrap_or(0));
        }
        report.tables.push(table);
    }
    keep_virtual_tables(tx, &virtual_tables)?;
    for (kind, name, sql, _) in &schema {
        // The application's indexes, triggers and views, once its rows are in.
        if kind == "table" || name.starts_with("sqlite_") || exists(tx, name)? {
            continue;
        }
        if let Some(sql) = sql
            && let Err(e) = tx.execute_batch(sql)
        {
            tracing::warn!(name, error = %e, "salvage: could not create this {kind} again");
        }
    }

    // The numbering: the damaged file's epochs, then a new one after every number it may have
    // used (the highest ever given, or read, or lost).
    let outbox = report.tables.iter().find(|t| t.name == "outbox").cloned();
    let copied_high: i64 = tx.query_row("SELECT coalesce(max(seq), 0) FROM main.outbox", [], |r| r.get(0))?;
    let gaps_high: i64 = tx.query_row(
        "SELECT coalesce(max(coalesce(last_seq, seq)), 0) FROM main.outbox_gaps",
        [],
        |r| r.get(0),
    )?;
    let high = old_high
        .unwrap_or(0)
        .max(copied_high)
        .max(gaps_high)
        .max(published);
    if let Some(epochs) = &old_epochs {
        tx.execute("DELETE FROM main.edge_outbox_epochs", [])?;
        for (epoch, first, reason, started) in epochs {
            tx.execute(
                "INSERT INTO main.edge_outbox_epochs (epoch, first_seq, reason, started_at) VALUES (?1, ?2, ?3, ?4)",
                params![epoch, first, reason, started],
            )?;
        }
        if let Some(outbox) = &outbox {
            for &(first, last) in &outbox.lost {
                let last = last.min(high);
                let first = first.max(epochs.first().map_or(1, |e| e.1));
                if first > last {
                    continue;
                }
                // One gap row per range and epoch: a notice names one epoch.
                for (a, b) in split_by_epochs(first, last, epochs) {
                    report
                        .unrecoverable
                        .extend(super::unrecoverable::record(tx, a, b)?);
                }
            }
        }
    }
    epoch_after(tx, high, "salvaged")?;
    // The evictions and replacements counted so far, best effort.
    if let Ok((evicted, bytes)) =
        src.query_row("SELECT evicted, evicted_bytes FROM outbox_counters", [], |r| {
            Ok((r.get::<_, i64>(0)?, r.get::<_, i64>(1)?))
        })
    {
        tx.execute(
            "UPDATE main.outbox_counters SET evicted = ?1, evicted_bytes = ?2",
            [evicted, bytes],
        )?;
    }
    if let Ok(coalesced) = src.query_row("SELECT coalesced FROM outbox_counters", [], |r| {
        r.get::<_, i64>(0)
    }) {
        tx.execute("UPDATE main.outbox_counters SET coalesced = ?1", [coalesced])?;
    }
    // The uptime clock carries on from where it was, so the sent rows and command ids copied with
    // their stamps are not younger on it than they are (best effort: read as 0 they are kept
    // longer, never shorter).
    if let Ok(uptime) = super::uptime::now(src) {
        tx.execute(
            "UPDATE main.edge_outbox_meta SET value = max(value, ?1) WHERE name = 'uptime_ms'",
            [uptime],
        )?;
    }
    Ok(())
}

/// `first..=last` cut where an epoch starts.
fn split_by_epochs(first: i64, last: i64, epochs: &[(i64, i64, String, i64)]) -> Vec<(i64, i64)> {
    let mut out = Vec::new();
    let mut from = first;
    for start in epochs.iter().map(|e| e.1).filter(|&s| s > first && s <= last) {
        out.push((from, start - 1));
        from = start;
    }
    out.push((from, last));
    out
}

/// Sets the outbox counter to `high` (if below) and starts a new epoch after it.
fn epoch_after(tx: &Connection, high: i64, reason: &str) -> Result<u64> {
    let current: Option<i64> = tx
        .query_row(
            "SELECT seq FROM main.sqlite_sequence WHERE name = 'outbox'",
            [],
            |r| r.get(0),
        )
        .optional()?;
    match current {
        Some(seq) if seq >= high => {}
        Some(_) => {
            tx.execute(
                "UPDATE main.sqlite_sequence SET seq = ?1 WHERE name = 'outbox'",
                [high],
            )?;
        }
        None if high > 0 => {
            tx.execute(
                "INSERT INTO main.sqlite_sequence (name, seq) VALUES ('outbox', ?1)",
                [high],
            )?;
        }
        None => {}
    }
    epoch::start(tx, reason)
}

/// Writes the definitions of the damaged file's virtual tables into the fresh file's schema as
/// they were, as SQLite's own recovery does: their shadow tables are already copied, so each
/// table has its rows again, and no module is needed to do it (the CLI's SQLite has no FTS or
/// R*Tree). The schema cookie is bumped, so every connection reads the new schema.
fn keep_virtual_tables(tx: &Connection, tables: &[(String, String)]) -> Result<()> {
    let mut missing = Vec::new();
    for (name, sql) in tables {
        if !exists(tx, name)? {
            missing.push((name, sql));
        }
    }
    if missing.is_empty() {
        return Ok(());
    }
    let cookie: i64 = tx.query_row("PRAGMA schema_version", [], |r| r.get(0))?;
    tx.execute_batch("PRAGMA writable_schema = ON")?;
    let written = missing.iter().try_for_each(|(name, sql)| {
        tx.execute(
            "INSERT INTO main.sqlite_schema (type, name, tbl_name, rootpage, sql) VALUES ('table', ?1, ?1, 0, ?2)",
            [name.as_str(), sql.as_str()],
        )
        .map(drop)
    });
    let bumped = tx.execute_batch(&format!("PRAGMA schema_version = {}", cookie + 1));
    tx.execute_batch("PRAGMA writable_schema = OFF")?;
    written?;
    bumped?;
    for (name, _) in &missing {
        tracing::info!(
            name = name.as_str(),
            "salvage: kept a virtual table's definition; its rows are in its shadow tables"
        );
    }
    Ok(())
}

fn exists(tx: &Connection, name: &str) -> Result<bool> {
    Ok(tx.query_row(
        "SELECT EXISTS (SELECT 1 FROM main.sqlite_schema WHERE name = ?1)",
        [name],
        |r| r.get(0),
    )?)
}

fn rows_or_empty<T>(
    src: &Connection,
    sql: &str,
    f: impl FnMut(&rusqlite::Row<'_>) -> rusqlite::Result<T>,
) -> Vec<T> {
    let result = src.prepare(sql).and_then(|mut s| s.query_map([], f)?.collect());
    result.unwrap_or_else(|e| {
        tracing::warn!(error = %e, sql, "salvage: unreadable");
        Vec::new()
    })
}

fn columns(conn: &Connection, table: &str) -> rusqlite::Result<Vec<String>> {
    let mut stmt = conn.prepare(&format!("PRAGMA main.table_info({})", quote(table)))?;
    stmt.query_map([], |r| r.get::<_, String>(1))?.collect()
}

fn quote(name: &str) -> String {
    format!("\"{}\"", name.replace('"', "\"\""))
}

/// Copies the readable rows of `table` from `src` into `tx` (the columns both have), around
/// unreadable pages.
fn copy_table(src: &Connection, tx: &Connection, table: &str, renumber: bool) -> SalvagedTable {
    let mut out = SalvagedTable {
        name: table.to_owned(),
        rows: 0,
        lost: Vec::new(),
        failed: None,
    };
    let (old, new) = match (columns(src, table), columns(tx, table)) {
        (Ok(old), Ok(new)) => (old, new),
        (Err(e), _) | (_, Err(e)) => {
            out.failed = Some(format!("its columns are unreadable: {e}"));
            out.lost.push((1, i64::MAX));
            return out;
        }
    };
    let cols: Vec<String> = old
        .into_iter()
        .filter(|c| new.contains(c) && !(renumber && c == "seq"))
        .collect();
    if cols.is_empty() {
        return out;
    }
    let list = cols.iter().map(|c| quote(c)).collect::<Vec<_>>().join(", ");
    let t = quote(table);
    let holes = vec!["?"; cols.len()].join(", ");
    let insert = format!("INSERT OR IGNORE INTO main.{t} ({list}) VALUES ({holes})");
    if without_rowid(src, table) {
        copy_without_rowid(src, tx, &t, &list, &insert, cols.len(), &mut out);
        return out;
    }
    // `>=`, not `>`: seeking past a row goes through the page that holds it, which may be the
    // damaged one just skipped.
    let select = format!("SELECT rowid, {list} FROM {t} WHERE rowid >= ?1 ORDER BY rowid LIMIT {BATCH}");
    // The next rowid to read.
    let mut from = i64::MIN;
    loop {
        let mut batch: Vec<(i64, Vec<Value>)> = Vec::new();
        let read = (|| -> rusqlite::Result<()> {
            let mut stmt = src.prepare_cached(&select)?;
            let mut rows = stmt.query([from])?;
            while let Some(row) = rows.next()? {
                let values = (1..=cols.len())
                    .map(|i| row.get::<_, Value>(i))
                    .collect::<rusqlite::Result<_>>()?;
                batch.push((row.get(0)?, values));
            }
            Ok(())
        })();
        let got = batch.len();
        let mut last = None;
        for (rowid, values) in batch {
            last = Some(rowid);
            if inserted(tx, &insert, values) {
                out.rows += 1;
            } else {
                out.lost.push((rowid, rowid));
            }
        }
        if let Some(last) = last {
            match last.checked_add(1) {
                Some(next) => from = next,
                None => return out,
            }
        }
        match read {
            Ok(()) if got < BATCH as usize => return out,
            Ok(()) => {}
            // Rows were read before the failure: carry on after the last of them.
            Err(_) if got > 0 => {}
            Err(_) => match seek(src, &t, from) {
                // The next row can be found but not read: skip it alone.
                Ok(Some(next)) => {
                    out.lost.push((next, next));
                    match next.checked_add(1) {
                        Some(after) => from = after,
                        None => return out,
                    }
                }
                Ok(None) => return out,
                Err(()) => match next_readable(src, &t, from) {
                    Some(next) => {
                        out.lost.push((from, next - 1));
                        from = next;
                    }
                    None => {
                        out.lost.push((from, i64::MAX));
                        return out;
                    }
                },
            },
        }
    }
}

/// Inserts one copied row; false if it was refused (a constraint of the fresh table) or ignored.
fn inserted(tx: &Connection, insert: &str, values: Vec<Value>) -> bool {
    matches!(
        tx.prepare_cached(insert)
            .and_then(|mut s| s.execute(rusqlite::params_from_iter(values))),
        Ok(1)
    )
}

/// Whether `table` is a `WITHOUT ROWID` table (an application's, or FTS5's `_config` and `_idx`):
/// its rows are reached by their key only.
fn without_rowid(src: &Connection, table: &str) -> bool {
    src.query_row(
        "SELECT wr FROM pragma_table_list WHERE schema = 'main' AND name = ?1",
        [table],
        |r| r.get::<_, bool>(0),
    )
    .unwrap_or(false)
}

/// Copies a `WITHOUT ROWID` table in key order, as far as it can be read. There is no rowid to
/// seek past a damaged page by, so a failed read ends the copy: `lost` then names positions in
/// key order (the first unread one onwards), not rowids.
fn copy_without_rowid(
    src: &Connection,
    tx: &Connection,
    t: &str,
    list: &str,
    insert: &str,
    n: usize,
    out: &mut SalvagedTable,
) {
    let mut position: i64 = 0;
    let read = (|| -> rusqlite::Result<()> {
        let mut stmt = src.prepare(&format!("SELECT {list} FROM {t}"))?;
        let mut rows = stmt.query([])?;
        while let Some(row) = rows.next()? {
            let values = (0..n)
                .map(|i| row.get::<_, Value>(i))
                .collect::<rusqlite::Result<Vec<_>>>()?;
            position += 1;
            if inserted(tx, insert, values) {
                out.rows += 1;
            } else {
                out.lost.push((position, position));
            }
        }
        Ok(())
    })();
    if let Err(e) = read {
        tracing::warn!(table = t, rows = out.rows, error = %e, "salvage: stopped at an unreadable page of a table without rowids");
        out.lost.push((position + 1, i64::MAX));
    }
}

/// The first rowid at or after `from`, if the b-tree can be searched there.
fn seek(src: &Connection, table: &str, from: i64) -> std::result::Result<Option<i64>, ()> {
    src.query_row(
        &format!("SELECT rowid FROM {table} WHERE rowid >= ?1 ORDER BY rowid LIMIT 1"),
        [from],
        |r| r.get(0),
    )
    .optional()
    .map_err(|_| ())
}

/// The first rowid reachable past a damaged stretch that starts at `bad` (a seek there fails):
/// seeks further and further until one works, then back to the nearest start that works.
/// `None`: nothing readable follows.
fn next_readable(src: &Connection, table: &str, mut bad: i64) -> Option<i64> {
    let start = bad;
    let mut step: i64 = 1;
    let (mut good, mut found) = loop {
        let probe = start.checked_add(step)?;
        match seek(src, table, probe) {
            Ok(found) => break (probe, found),
            Err(()) => {
                bad = probe;
                step = step.checked_mul(2)?;
            }
        }
    };
    while good - bad > 1 {
        let mid = bad + (good - bad) / 2;
        match seek(src, table, mid) {
            Ok(f) => {
                good = mid;
                found = f;
            }
            Err(()) => bad = mid,
        }
    }
    found
}

#[cfg(test)]
mod tests {
    use super::split_by_epochs;

    #[test]
    fn ranges_are_cut_at_epoch_starts() {
        let epochs = vec![(11, 1, String::new(), 0), (22, 100, String::new(), 0)];
        assert_eq!(split_by_epochs(5, 50, &epochs), vec![(5, 50)]);
        assert_eq!(split_by_epochs(90, 120, &epochs), vec![(90, 99), (100, 120)]);
        assert_eq!(split_by_epochs(100, 120, &epochs), vec![(100, 120)]);
    }
}
