//! A consumer's state in SQLite: the tables, writing what changed since the last save, and
//! reading it all back.
//!
//! Only what changed is written: the ids remembered since the last save (and the oldest ones
//! that left the window deleted), each stream touched (its counts, its causes, and its journal of
//! gaps opened and closed and keys moved). A save costs what the items since the last one did,
//! not what the consumer holds.
//!
//! Numbers are `u64` on the wire and `INTEGER` (signed 64-bit) here: they are stored with their
//! bits unchanged, so an epoch above `i64::MAX` reads back as itself.

use std::collections::{BTreeMap, HashMap};
use std::time::{Duration, Instant};

use rusqlite::{Connection, OptionalExtension, Transaction, params};

use super::Consumer;
use super::stream::{Change, SavedStream, Stream};
use crate::envelope::MessageId;
use crate::error::{Error, Result};

/// The layout's version, in `consumer_meta`; a file with another one is refused.
const FORMAT: i64 = 1;

const SCHEMA: &str = "
CREATE TABLE IF NOT EXISTS consumer_meta (
    name  TEXT PRIMARY KEY,
    value INTEGER NOT NULL
) WITHOUT ROWID;
CREATE TABLE IF NOT EXISTS consumer_ids (
    n  INTEGER PRIMARY KEY,
    id BLOB NOT NULL
);
CREATE TABLE IF NOT EXISTS consumer_streams (
    source     TEXT NOT NULL,
    epoch      INTEGER NOT NULL,
    base       INTEGER NOT NULL,
    high       INTEGER NOT NULL,
    horizon    INTEGER NOT NULL,
    delivered  INTEGER NOT NULL,
    duplicates INTEGER NOT NULL,
    late       INTEGER NOT NULL,
    reordered  INTEGER NOT NULL,
    forgotten  INTEGER NOT NULL,
    unplaced   INTEGER NOT NULL,
    PRIMARY KEY (source, epoch)
) WITHOUT ROWID;
CREATE TABLE IF NOT EXISTS consumer_announced (
    source TEXT NOT NULL,
    epoch  INTEGER NOT NULL,
    cause  TEXT NOT NULL,
    count  INTEGER NOT NULL,
    PRIMARY KEY (source, epoch, cause)
) WITHOUT ROWID;
CREATE TABLE IF NOT EXISTS consumer_gaps (
    source   TEXT NOT NULL,
    epoch    INTEGER NOT NULL,
    first    INTEGER NOT NULL,
    last     INTEGER NOT NULL,
    since_ms INTEGER NOT NULL,
    PRIMARY KEY (source, epoch, first)
) WITHOUT ROWID;
CREATE TABLE IF NOT EXISTS consumer_keys (
    n      INTEGER PRIMARY KEY,
    source TEXT NOT NULL,
    epoch  INTEGER NOT NULL,
    key    TEXT NOT NULL,
    seq    INTEGER NOT NULL,
    UNIQUE (source, epoch, key)
);
";

/// Bits unchanged: see the module docs.
fn int(v: u64) -> i64 {
    i64::from_ne_bytes(v.to_ne_bytes())
}

fn nat(v: i64) -> u64 {
    u64::from_ne_bytes(v.to_ne_bytes())
}

/// Creates the tables in a new file, or checks an existing file's format.
pub(crate) fn create(conn: &Connection) -> Result<()> {
    conn.execute_batch(SCHEMA)?;
    let format: Option<i64> = conn
        .query_row("SELECT value FROM consumer_meta WHERE name = 'format'", [], |r| {
            r.get(0)
        })
        .optional()?;
    match format {
        None => {
            conn.execute(
                "INSERT INTO consumer_meta (name, value) VALUES ('format', ?1)",
                [FORMAT],
            )?;
            Ok(())
        }
        Some(FORMAT) => Ok(()),
        Some(other) => Err(Error::InvalidConfig(format!(
            "the consumer state was written in format {other}, this build reads format {FORMAT}"
        ))),
    }
}

fn meta(conn: &Connection, name: &str) -> Result<u64> {
    let v: Option<i64> = conn
        .query_row("SELECT value FROM consumer_meta WHERE name = ?1", [name], |r| {
            r.get(0)
        })
        .optional()?;
    Ok(v.map_or(0, nat))
}

fn set_meta(tx: &Transaction<'_>, name: &str, value: u64) -> Result<()> {
    tx.prepare_cached(
        "INSERT INTO consumer_meta (name, value) VALUES (?1, ?2)
         ON CONFLICT (name) DO UPDATE SET value = excluded.value",
    )?
    .execute(params![name, int(value)])?;
    Ok(())
}

/// A wall-clock time for an instant, to survive a restart (a gap's age counts across it).
fn wall_ms(at: Instant, now: Instant, now_ms: i64) -> i64 {
    now_ms.saturating_sub(crate::time::ms(now.saturating_duration_since(at)))
}

fn instant(ms: i64, now: Instant, now_ms: i64) -> Instant {
    let age = Duration::from_millis(u64::try_from(now_ms.saturating_sub(ms)).unwrap_or(0));
    now.checked_sub(age).unwrap_or(now)
}

/// Writes what changed in `consumer` since its last save, inside the caller's transaction.
pub(crate) fn save(tx: &Transaction<'_>, consumer: &mut Consumer) -> Result<()> {
    if crate::mutant::active("consumer-state-unsaved") {
        return Ok(());
    }
    let (now, now_ms) = (Instant::now(), crate::time::now_ms());
    let ids = consumer.window.unsaved.take().unwrap_or_default();
    consumer.window.unsaved = Some(Vec::new());
    if !ids.is_empty() {
        let mut serial = meta(tx, "ids_serial")?;
        let mut insert = tx.prepare_cached("INSERT INTO consumer_ids (n, id) VALUES (?1, ?2)")?;
        for id in ids {
            serial += 1;
            insert.execute(params![int(serial), id.as_bytes().as_slice()])?;
        }
        let capacity = u64::try_from(consumer.window.capacity()).unwrap_or(u64::MAX);
        tx.prepare_cached("DELETE FROM consumer_ids WHERE n <= ?1")?
            .execute([int(serial.saturating_sub(capacity))])?;
        set_meta(tx, "ids_serial", serial)?;
    }
    let touched = consumer.unsaved.take().unwrap_or_default();
    consumer.unsaved = Some(Default::default());
    for (source, epoch) in touched {
        let Some(stream) = consumer.streams.get_mut(&(source.clone(), epoch)) else {
            continue;
        };
        save_stream(tx, &source, epoch, stream, now, now_ms)?;
    }
    set_meta(tx, "unnumbered_delivered", consumer.unnumbered.delivered)?;
    set_meta(tx, "unnumbered_duplicates", consumer.unnumbered.duplicates)?;
    set_meta(tx, "schema_violations", consumer.schema_violations)?;
    Ok(())
}

fn save_stream(
    tx: &Transaction<'_>,
    source: &str,
    epoch: u64,
    stream: &mut Stream,
    now: Instant,
    now_ms: i64,
) -> Result<()> {
    let s = stream.saved();
    tx.prepare_cached(
        "INSERT OR REPLACE INTO consumer_streams (source, epoch, base, high, horizon, delivered,
             duplicates, late, reordered, forgotten, unplaced)
         VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8, ?9, ?10, ?11)",
    )?
    .execute(params![
        source,
        int(epoch),
        int(s.base),
        int(s.high),
        int(s.horizon),
        int(s.delivered),
        int(s.duplicates),
        int(s.late),
        int(s.reordered),
        int(s.forgotten),
        int(s.unplaced)
    ])?;
    let mut cause = tx.prepare_cached(
        "INSERT OR REPLACE INTO consumer_announced (source, epoch, cause, count)
         VALUES (?1, ?2, ?3, ?4)",
    )?;
    for (name, count) in &s.announced {
        cause.execute(params![source, int(epoch), name, int(*count)])?;
    }
    for change in stream.journal.replace(Vec::new()).unwrap_or_default() {
        match change {
            Change::Opened { first, last, since } => {
                tx.prepare_cached(
                    "INSERT OR REPLACE INTO consumer_gaps (source, epoch, first, last, since_ms)
                     VALUES (?1, ?2, ?3, ?4, ?5)",
                )?
                .execute(params![
                    source,
                    int(epoch),
                    int(first),
                    int(last),
                    wall_ms(since, now, now_ms)
                ])?;
            }
            Change::Closed { first } => {
                tx.prepare_cached(
                    "DELETE FROM consumer_gaps WHERE source = ?1 AND epoch = ?2 AND first = ?3",
                )?
                .execute(params![source, int(epoch), int(first)])?;
            }
            Change::Key { key, seq } => {
                // A new key takes the next `n`, the end of the order; a known one keeps its place.
                tx.prepare_cached(
                    "INSERT INTO consumer_keys (source, epoch, key, seq) VALUES (?1, ?2, ?3, ?4)
                     ON CONFLICT (source, epoch, key) DO UPDATE SET seq = excluded.seq",
                )?
                .execute(params![source, int(epoch), key, int(seq)])?;
            }
            Change::KeyForgotten { key } => {
                tx.prepare_cached("DELETE FROM consumer_keys WHERE source = ?1 AND epoch = ?2 AND key = ?3")?
                    .execute(params![source, int(epoch), key])?;
            }
        }
    }
    Ok(())
}

type StreamId = (String, u64);

/// Replaces `consumer`'s state with the one saved in `conn`, keeping its settings.
pub(crate) fn load(conn: &Connection, consumer: &mut Consumer) -> Result<()> {
    consumer.forget_state();
    consumer.keep_changes();
    let (now, now_ms) = (Instant::now(), crate::time::now_ms());

    let capacity = i64::try_from(consumer.window.capacity()).unwrap_or(i64::MAX);
    let mut ids: Vec<MessageId> = conn
        .prepare("SELECT id FROM consumer_ids ORDER BY n DESC LIMIT ?1")?
        .query_map([capacity], |r| r.get::<_, Vec<u8>>(0))?
        .map(|blob| {
            let blob = blob?;
            let bytes: [u8; 16] = blob
                .as_slice()
                .try_into()
                .map_err(|_| Error::Decode(format!("a saved message id of {} bytes", blob.len())))?;
            Ok(MessageId::from_bytes(bytes))
        })
        .collect::<Result<_>>()?;
    ids.reverse();
    consumer.window.restore(ids);

    let mut announced: HashMap<StreamId, BTreeMap<String, u64>> = HashMap::new();
    for row in conn
        .prepare("SELECT source, epoch, cause, count FROM consumer_announced")?
        .query_map([], |r| {
            Ok((
                r.get::<_, String>(0)?,
                r.get::<_, i64>(1)?,
                r.get(2)?,
                r.get::<_, i64>(3)?,
            ))
        })?
    {
        let (source, epoch, cause, count) = row?;
        announced
            .entry((source, nat(epoch)))
            .or_default()
            .insert(cause, nat(count));
    }
    let mut gaps: HashMap<StreamId, Vec<(u64, u64, Instant)>> = HashMap::new();
    for row in conn
        .prepare("SELECT source, epoch, first, last, since_ms FROM consumer_gaps")?
        .query_map([], |r| {
            Ok((
                r.get::<_, String>(0)?,
                r.get::<_, i64>(1)?,
                r.get::<_, i64>(2)?,
                r.get::<_, i64>(3)?,
                r.get::<_, i64>(4)?,
            ))
        })?
    {
        let (source, epoch, first, last, since_ms) = row?;
        gaps.entry((source, nat(epoch))).or_default().push((
            nat(first),
            nat(last),
            instant(since_ms, now, now_ms),
        ));
    }
    let mut keys: HashMap<StreamId, Vec<(String, u64)>> = HashMap::new();
    for row in conn
        .prepare("SELECT source, epoch, key, seq FROM consumer_keys ORDER BY n")?
        .query_map([], |r| {
            Ok((
                r.get::<_, String>(0)?,
                r.get::<_, i64>(1)?,
                r.get(2)?,
                r.get::<_, i64>(3)?,
            ))
        })?
    {
        let (source, epoch, key, seq) = row?;
        keys.entry((source, nat(epoch)))
            .or_default()
            .push((key, nat(seq)));
    }
    for row in conn
        .prepare(
            "SELECT source, epoch, base, high, horizon, delivered, duplicates, late, reordered,
                    forgotten, unplaced FROM consumer_streams",
        )?
        .query_map([], |r| {
            let n = |i| r.get::<_, i64>(i).map(nat);
            Ok((
                r.get::<_, String>(0)?,
                n(1)?,
                SavedStream {
                    base: n(2)?,
                    high: n(3)?,
                    horizon: n(4)?,
                    delivered: n(5)?,
                    duplicates: n(6)?,
                    late: n(7)?,
                    reordered: n(8)?,
                    forgotten: n(9)?,
                    unplaced: n(10)?,
                    announced: BTreeMap::new(),
                },
            ))
        })?
    {
        let (source, epoch, mut saved) = row?;
        let id = (source, epoch);
        saved.announced = announced.remove(&id).unwrap_or_default();
        let stream = Stream::restored(
            saved,
            gaps.remove(&id).unwrap_or_default(),
            keys.remove(&id).unwrap_or_default(),
        );
        consumer.sources.insert(id.0.clone());
        consumer.streams.insert(id, stream);
    }
    consumer.unnumbered.delivered = meta(conn, "unnumbered_delivered")?;
    consumer.unnumbered.duplicates = meta(conn, "unnumbered_duplicates")?;
    consumer.schema_violations = meta(conn, "schema_violations")?;
    Ok(())
}
