//! Schema migrations.
//!
//! The schema version lives in our own `edge_outbox_meta` table, not in `PRAGMA user_version`:
//! the application's business tables share this file, and `user_version` is the one integer an
//! application's own migration tool is most likely to use already. Each migration runs in one
//! `BEGIN IMMEDIATE` transaction, so two processes opening a new file at once migrate it once.

use rusqlite::{Connection, OptionalExtension, TransactionBehavior};

use crate::error::{Error, Result};

/// The newest schema version this build writes and understands.
pub const SCHEMA_VERSION: i64 = 9;

/// Column default for "now" in Unix milliseconds. `julianday` works in every SQLite a foreign
/// writer may link (Debian's Python ships 3.40), unlike `unixepoch('subsec')` (3.42+).
macro_rules! now_ms_sql {
    () => {
        "(CAST((julianday('now') - 2440587.5) * 86400000.0 AS INTEGER))"
    };
}

/// Migration `n` (1-based) takes the schema from version `n - 1` to `n`.
const MIGRATIONS: &[&str] = &[V1, V2, V3, V4, V5, V6, V7, V8, V9];

/// Version 1: the outbox, the inbox, dead letters.
const V1: &str = concat!(
    "
CREATE TABLE edge_outbox_meta (
    name  TEXT PRIMARY KEY,
    value
);

-- Pending messages only: the relay deletes a row when its PUBACK arrives (or moves it to
-- outbox_sent when sent rows are retained), so this table and its scans stay small.
CREATE TABLE outbox (
    seq        INTEGER PRIMARY KEY AUTOINCREMENT,  -- commit order; never reused
    id         BLOB    NOT NULL DEFAULT (randomblob(16)) CHECK (typeof(id) = 'blob' AND length(id) = 16),
    topic      TEXT    NOT NULL CHECK (length(topic) > 0),
    key        TEXT    NOT NULL DEFAULT '',
    payload    BLOB    NOT NULL,                   -- one CBOR item (BLOB), or TEXT sent as a CBOR text
    event_type TEXT,
    headers    BLOB,                               -- CBOR map text => text, or NULL
    evictable  INTEGER NOT NULL DEFAULT 0 CHECK (evictable IN (0, 1)),
    created_at INTEGER NOT NULL DEFAULT ",
    now_ms_sql!(),
    "
);
CREATE INDEX outbox_evictable ON outbox (seq) WHERE evictable = 1;

CREATE TABLE outbox_sent (
    seq        INTEGER PRIMARY KEY,
    id         BLOB    NOT NULL,
    topic      TEXT    NOT NULL,
    key        TEXT    NOT NULL,
    payload    BLOB,
    event_type TEXT,
    headers    BLOB,
    created_at INTEGER NOT NULL,
    sent_at    INTEGER NOT NULL
);
CREATE INDEX outbox_sent_by_time ON outbox_sent (sent_at);

-- Counters kept by triggers, so limits and stats cost one row read whatever the backlog, and
-- foreign writers (the SQL contract) keep them right without knowing they exist.
CREATE TABLE outbox_counters (
    only          INTEGER PRIMARY KEY CHECK (only = 1),
    pending_count INTEGER NOT NULL,
    pending_bytes INTEGER NOT NULL,
    evicted       INTEGER NOT NULL,
    evicted_bytes INTEGER NOT NULL
);
INSERT INTO outbox_counters VALUES (1, 0, 0, 0, 0);

CREATE TRIGGER outbox_count_insert AFTER INSERT ON outbox BEGIN
    UPDATE outbox_counters SET pending_count = pending_count + 1,
        pending_bytes = pending_bytes + length(CAST(NEW.payload AS BLOB)) WHERE only = 1;
END;
CREATE TRIGGER outbox_count_delete AFTER DELETE ON outbox BEGIN
    UPDATE outbox_counters SET pending_count = pending_count - 1,
        pending_bytes = pending_bytes - length(CAST(OLD.payload AS BLOB)) WHERE only = 1;
END;

CREATE TABLE inbox (
    seq             INTEGER PRIMARY KEY AUTOINCREMENT,  -- arrival order
    id              BLOB    NOT NULL UNIQUE CHECK (typeof(id) = 'blob' AND length(id) = 16),
    topic           TEXT    NOT NULL,
    key             TEXT    NOT NULL DEFAULT '',
    payload         BLOB,                               -- NULL once applied, unless kept
    event_type      TEXT,
    headers         BLOB,
    source          TEXT    NOT NULL DEFAULT '',
    received_at     INTEGER NOT NULL DEFAULT ",
    now_ms_sql!(),
    ",
    applied_at      INTEGER,
    dead_at         INTEGER,
    attempts        INTEGER NOT NULL DEFAULT 0,
    next_attempt_at INTEGER NOT NULL DEFAULT 0,
    last_error      TEXT
);
-- Unapplied commands in arrival order, and by key: whether an older one of the same key waits.
CREATE INDEX inbox_unapplied ON inbox (seq) WHERE applied_at IS NULL AND dead_at IS NULL;
CREATE INDEX inbox_unapplied_by_key ON inbox (key, seq) WHERE applied_at IS NULL AND dead_at IS NULL;
CREATE INDEX inbox_applied ON inbox (applied_at) WHERE applied_at IS NOT NULL;
-- Dead commands, for pruning the ones whose dead letter was dropped.
CREATE INDEX inbox_dead ON inbox (dead_at) WHERE dead_at IS NOT NULL;

CREATE TABLE dead_letters (
    dl_id      INTEGER PRIMARY KEY AUTOINCREMENT,
    origin     TEXT    NOT NULL CHECK (origin IN ('outbox', 'inbox')),
    message_id BLOB,            -- NULL when the input was too broken to carry one
    topic      TEXT    NOT NULL,
    key        TEXT    NOT NULL DEFAULT '',
    payload    BLOB,            -- the stored payload, or the raw bytes received
    event_type TEXT,
    headers    BLOB,
    reason     TEXT    NOT NULL,
    attempts   INTEGER NOT NULL DEFAULT 0,
    created_at INTEGER,
    dead_at    INTEGER NOT NULL DEFAULT ",
    now_ms_sql!(),
    "
);
"
);

/// Version 2: attempts are claimed before a handler runs (so one that takes the process down is
/// still counted), and commands that arrived retained are remembered as such.
const V2: &str = "
-- Set when an attempt starts (committed before the handler runs), cleared when it ends. Still set
-- after a restart: the handler never returned.
ALTER TABLE inbox ADD COLUMN attempt_started_at INTEGER;
-- Who runs that attempt: 'relay' (the relay's handler thread: one per file) or 'worker:<hex>'.
ALTER TABLE inbox ADD COLUMN claimed_by TEXT;
-- 1: delivered with the MQTT retain flag (kept only with RelayConfig::retained_commands). The
-- broker sends a retained message again at every subscription, so its id is kept past the
-- retention until a newer retained command on its topic replaces it.
ALTER TABLE inbox ADD COLUMN retained INTEGER NOT NULL DEFAULT 0 CHECK (retained IN (0, 1));
CREATE INDEX inbox_claimed ON inbox (seq) WHERE attempt_started_at IS NOT NULL;
CREATE INDEX inbox_retained ON inbox (topic, seq) WHERE retained = 1;
";

/// Version 3: the uptime clock (src/store/uptime.rs), and the stamps retention compares with it.
const V3: &str = "
INSERT INTO edge_outbox_meta (name, value) VALUES ('uptime_ms', 0) ON CONFLICT (name) DO NOTHING;
-- The uptime clock when the row was moved here (acknowledged); NULL for rows from version 2.
ALTER TABLE outbox_sent ADD COLUMN sent_uptime INTEGER;
-- The uptime clock when the command was applied or set aside as dead; NULL before that, and for
-- rows from version 2.
ALTER TABLE inbox ADD COLUMN done_uptime INTEGER;
";

/// Version 4: pending counts are folded in per batch of rows instead of per row by a trigger.
///
/// An insert no longer writes the counters row (a page written to the WAL at every commit, and a
/// trigger run per row: most of what a message cost beyond its own row). `outbox_counters` now
/// counts the rows up to `counted_through`; the rows above it (a short tail, whoever wrote them)
/// are counted when read, and folded into the counters now and then (see `store::counters`).
/// Deleting a counted row still updates the counters at once, whoever deletes it.
const V4: &str = "
ALTER TABLE outbox_counters ADD COLUMN counted_through INTEGER NOT NULL DEFAULT 0;
-- The counters cover every row so far.
UPDATE outbox_counters SET counted_through = coalesce((SELECT max(seq) FROM outbox), 0);
DROP TRIGGER outbox_count_insert;
DROP TRIGGER outbox_count_delete;
CREATE TRIGGER outbox_count_delete AFTER DELETE ON outbox
WHEN OLD.seq <= (SELECT counted_through FROM outbox_counters WHERE only = 1)
BEGIN
    UPDATE outbox_counters SET pending_count = pending_count - 1,
        pending_bytes = pending_bytes - length(CAST(OLD.payload AS BLOB)) WHERE only = 1;
END;
";

/// Version 5: loss the cloud can see. Epochs number each (source, epoch)'s messages from 1 with no
/// gap; every message the device removes before publishing it leaves a row in `outbox_gaps`, in
/// the transaction that removes it, until the relay has published its gap notice. Messages may
/// expire. (The SQL default for `outbox.id` becomes a valid UUIDv4 in `fix_id_default`.)
const V5: &str = concat!(
    "
-- One row per epoch. An epoch numbers the outbox rows from first_seq on: the envelope's seq is
-- outbox.seq - first_seq + 1, so each epoch starts at 1. A new epoch starts when the schema is
-- created, when the file turns out to be a copy (restored from a backup), and after a salvage.
CREATE TABLE edge_outbox_epochs (
    epoch      INTEGER PRIMARY KEY CHECK (epoch > 0),
    first_seq  INTEGER NOT NULL UNIQUE,
    reason     TEXT    NOT NULL,
    started_at INTEGER NOT NULL DEFAULT ",
    now_ms_sql!(),
    "
);
-- 63 random bits: a new number, whatever the file held before.
INSERT INTO edge_outbox_epochs (epoch, first_seq, reason)
VALUES (max(1, random() & 0x7FFFFFFFFFFFFFFF), 1,
        CASE WHEN EXISTS (SELECT 1 FROM sqlite_sequence WHERE name = 'outbox') THEN 'migrated' ELSE 'created' END);

-- Messages removed before they were published, until the relay's gap notice for them is
-- acknowledged. Written in the transaction that removes the message, so a crash cannot lose it.
CREATE TABLE outbox_gaps (
    gap_id     INTEGER PRIMARY KEY AUTOINCREMENT,  -- recording order: the relay reads from a cursor
    seq        INTEGER NOT NULL UNIQUE,            -- the removed message's outbox seq
    last_seq   INTEGER,                            -- a range seq..last_seq (a salvage); NULL: one
    topic      TEXT    NOT NULL,                   -- its topic: the notice is published there
    cause      TEXT    NOT NULL,                   -- evicted, expired, dead-lettered, purged, unrecoverable, coalesced (v6)
    why        TEXT,
    removed_at INTEGER NOT NULL DEFAULT ",
    now_ms_sql!(),
    "
);

-- When set (ms), the message is removed unpublished once this time has passed (a gap notice
-- says so).
ALTER TABLE outbox ADD COLUMN expires_at INTEGER;
CREATE INDEX outbox_expiring ON outbox (expires_at) WHERE expires_at IS NOT NULL;
"
);

/// Version 6: what a metered link needs. Priority lanes (higher drains first), latest-value
/// coalescing (a new reading replaces the unpublished one of its topic and key), and eviction that
/// takes the lowest priority first.
const V6: &str = "
-- 0 (default) to 3: under a backlog the relay publishes higher lanes first; within a lane, in seq
-- order. Indexed only above 0, so the default lane costs an insert nothing more.
ALTER TABLE outbox ADD COLUMN priority INTEGER NOT NULL DEFAULT 0 CHECK (priority BETWEEN 0 AND 3);
CREATE INDEX outbox_lanes ON outbox (priority, seq) WHERE priority > 0;
-- 1: inserting this row replaces (deletes, recording a gap) every older unclaimed coalescing row
-- of the same topic and key: only the latest value of a sensor waits out an outage.
ALTER TABLE outbox ADD COLUMN coalescing INTEGER NOT NULL DEFAULT 0 CHECK (coalescing IN (0, 1));
-- Set by the relay on a coalescing row it has taken for publishing: a row that may be on the wire
-- is never replaced (its PUBACK would delete the wrong message, or the cloud would get the
-- message and a gap notice for it).
ALTER TABLE outbox ADD COLUMN claimed INTEGER;
CREATE INDEX outbox_coalescing ON outbox (topic, key, seq) WHERE coalescing = 1;
ALTER TABLE outbox_counters ADD COLUMN coalesced INTEGER NOT NULL DEFAULT 0;
-- A trigger, so a foreign writer (the SQL contract) coalesces by setting the column alone.
CREATE TRIGGER outbox_coalesce AFTER INSERT ON outbox WHEN NEW.coalescing = 1
BEGIN
    INSERT OR IGNORE INTO outbox_gaps (seq, topic, cause)
        SELECT seq, topic, 'coalesced' FROM outbox
        WHERE topic = NEW.topic AND key = NEW.key AND coalescing = 1 AND claimed IS NULL
          AND seq < NEW.seq;
    UPDATE outbox_counters SET coalesced = coalesced + changes() WHERE only = 1;
    DELETE FROM outbox
        WHERE topic = NEW.topic AND key = NEW.key AND coalescing = 1 AND claimed IS NULL
          AND seq < NEW.seq;
END;
-- Eviction takes the lowest priority first, the oldest within it.
DROP INDEX outbox_evictable;
CREATE INDEX outbox_evictable ON outbox (priority, seq) WHERE evictable = 1;
";

/// Version 7: the command signature policy lives in the file, so every handle on it (a keyless
/// library handle, the CLI, a foreign writer) is held to it, not only the one configured with keys;
/// refused deliveries are bounded in the dead letters.
const V7: &str = concat!(
    "
-- One row once the device requires signed commands: the validity window every handle verifies
-- with. No row: commands need no signature.
CREATE TABLE edge_outbox_command_policy (
    only           INTEGER PRIMARY KEY CHECK (only = 1),
    max_age_ms     INTEGER NOT NULL CHECK (max_age_ms > 0),
    clock_skew_ms  INTEGER NOT NULL CHECK (clock_skew_ms >= 0),
    required_since INTEGER NOT NULL
);
-- The Ed25519 public keys trusted to sign commands, by the key id a command names.
CREATE TABLE edge_outbox_command_keys (
    key_id     TEXT    PRIMARY KEY CHECK (length(key_id) > 0),
    public_key BLOB    NOT NULL CHECK (typeof(public_key) = 'blob' AND length(public_key) = 32),
    trusted_at INTEGER NOT NULL
);
-- Every change to the two tables above, by whom: they change only through an explicit operation.
CREATE TABLE edge_outbox_command_policy_log (
    log_id     INTEGER PRIMARY KEY AUTOINCREMENT,
    changed_at INTEGER NOT NULL DEFAULT ",
    now_ms_sql!(),
    ",
    change     TEXT    NOT NULL
);
-- The trusted key id that verified the command's signature; NULL when none was required.
ALTER TABLE inbox ADD COLUMN signed_by TEXT;
-- A writer that does not verify signatures (plain SQL) cannot store a command the device would
-- apply unverified.
CREATE TRIGGER inbox_requires_signature BEFORE INSERT ON inbox
WHEN NEW.signed_by IS NULL AND EXISTS (SELECT 1 FROM edge_outbox_command_policy)
BEGIN
    SELECT RAISE(ABORT, 'edge-outbox: this device requires signed commands: deliver the signed bytes through Outbox::receive, which verifies them, instead of inserting into inbox');
END;

-- 1: a delivery refused before it was stored (malformed, not signed, too large). Anyone who can
-- publish on the command topic can make these: they are kept within Options::max_refusals and
-- max_refusal_bytes, the oldest evicted. Those of earlier versions are the inbox's with no attempt.
ALTER TABLE dead_letters ADD COLUMN refused INTEGER NOT NULL DEFAULT 0 CHECK (refused IN (0, 1));
UPDATE dead_letters SET refused = 1 WHERE origin = 'inbox' AND attempts = 0;
CREATE INDEX dead_letters_refused ON dead_letters (dl_id) WHERE refused = 1;
-- Pruning keeps a command id while a dead letter names it.
CREATE INDEX dead_letters_by_message ON dead_letters (message_id) WHERE message_id IS NOT NULL;
-- The refused dead letters kept (kept by triggers, whoever deletes them), and those evicted.
CREATE TABLE edge_outbox_refusals (
    only          INTEGER PRIMARY KEY CHECK (only = 1),
    kept          INTEGER NOT NULL,
    kept_bytes    INTEGER NOT NULL,
    evicted       INTEGER NOT NULL,
    evicted_bytes INTEGER NOT NULL
);
INSERT INTO edge_outbox_refusals
    SELECT 1, count(*), coalesce(sum(length(CAST(payload AS BLOB))), 0), 0, 0 FROM dead_letters WHERE refused = 1;
CREATE TRIGGER dead_letters_refused_insert AFTER INSERT ON dead_letters WHEN NEW.refused = 1
BEGIN
    UPDATE edge_outbox_refusals SET kept = kept + 1,
        kept_bytes = kept_bytes + coalesce(length(CAST(NEW.payload AS BLOB)), 0) WHERE only = 1;
END;
CREATE TRIGGER dead_letters_refused_delete AFTER DELETE ON dead_letters WHEN OLD.refused = 1
BEGIN
    UPDATE edge_outbox_refusals SET kept = kept - 1,
        kept_bytes = kept_bytes - coalesce(length(CAST(OLD.payload AS BLOB)), 0) WHERE only = 1;
END;
"
);

/// Version 8: a command its handler rejected is finished, not set aside: it is counted apart from
/// the dead letters (an operator has nothing to do about it; the cloud is told by the handler's
/// reply). An outgoing dead letter keeps its lane, coalescing, lifetime and evictability, so a
/// retry puts it back as it was written.
const V8: &str = "
-- 1: rejected by its handler (Error::reject). Finished like a dead command (dead_at set), but not
-- copied into dead_letters; its id is kept for the retention like an applied one's.
ALTER TABLE inbox ADD COLUMN rejected INTEGER NOT NULL DEFAULT 0 CHECK (rejected IN (0, 1));
CREATE INDEX inbox_rejected ON inbox (seq) WHERE rejected = 1;
-- Rejections of earlier versions: counted apart too. Their dead letters go (the inbox row keeps
-- topic, key, payload and reason until the retention prunes it).
UPDATE inbox SET rejected = 1
    WHERE dead_at IS NOT NULL AND applied_at IS NULL AND last_error LIKE 'rejected by the handler: %';
DELETE FROM dead_letters WHERE origin = 'inbox' AND refused = 0
    AND message_id IN (SELECT id FROM inbox WHERE rejected = 1);
-- An outgoing message's settings, put back as they were when it is retried.
ALTER TABLE dead_letters ADD COLUMN priority INTEGER NOT NULL DEFAULT 0 CHECK (priority BETWEEN 0 AND 3);
ALTER TABLE dead_letters ADD COLUMN coalescing INTEGER NOT NULL DEFAULT 0 CHECK (coalescing IN (0, 1));
ALTER TABLE dead_letters ADD COLUMN expires_at INTEGER;
ALTER TABLE dead_letters ADD COLUMN evictable INTEGER NOT NULL DEFAULT 0 CHECK (evictable IN (0, 1));
";

/// Version 9: the payload schemas (feature `schemas`), in the file so that every handle, the
/// relay, the CLI and foreign writers see one contract. A row is never changed: a new version is a
/// new row.
const V9: &str = concat!(
    "
CREATE TABLE edge_outbox_schemas (
    event_type    TEXT    NOT NULL CHECK (length(event_type) > 0),
    version       INTEGER NOT NULL CHECK (version >= 1),
    topic_filter  TEXT    NOT NULL,
    cddl          TEXT    NOT NULL,
    registered_at INTEGER NOT NULL DEFAULT ",
    now_ms_sql!(),
    ",
    PRIMARY KEY (event_type, version)
);
"
);

/// The column default that mints a message id for a foreign writer: 16 random bytes with the
/// UUID version (4) and variant (10xx) bits set. SQLite before 3.41 has no `unhex`, so the two
/// fixed nibbles are picked from a literal of every allowed byte; `||` yields text, and the CAST
/// gives back its bytes as a BLOB (NUL bytes included).
pub(crate) const UUID_V4_SQL: &str = "CAST(randomblob(6) \
    || substr(x'404142434445464748494a4b4c4d4e4f', (random() & 15) + 1, 1) \
    || randomblob(1) \
    || substr(x'808182838485868788898a8b8c8d8e8f909192939495969798999a9b9c9d9e9f\
a0a1a2a3a4a5a6a7a8a9aaabacadaeafb0b1b2b3b4b5b6b7b8b9babbbcbdbebf', (random() & 63) + 1, 1) \
    || randomblob(7) AS BLOB)";

/// Changes `outbox.id`'s default from `randomblob(16)` to [`UUID_V4_SQL`] without rebuilding the
/// table (which would drop its triggers and its AUTOINCREMENT counter). A default is not part of
/// the stored rows, so SQLite documents editing the schema text for it ("Making Other Kinds Of
/// Table Schema Changes"): in the migration's transaction, with the schema cookie bumped.
fn fix_id_default(tx: &rusqlite::Transaction<'_>) -> Result<()> {
    let old = "DEFAULT (randomblob(16))";
    let new = format!("DEFAULT ({UUID_V4_SQL})");
    let cookie: i64 = tx.query_row("PRAGMA schema_version", [], |r| r.get(0))?;
    tx.execute_batch("PRAGMA writable_schema = ON")?;
    let changed = tx.execute(
        "UPDATE sqlite_schema SET sql = replace(sql, ?1, ?2)
         WHERE type = 'table' AND name = 'outbox' AND instr(sql, ?1) > 0",
        [old, new.as_str()],
    );
    let bumped = tx.execute_batch(&format!("PRAGMA schema_version = {}", cookie + 1));
    tx.execute_batch("PRAGMA writable_schema = OFF")?;
    if changed? != 1 {
        return Err(Error::InvalidConfig(
            "the outbox table's id default is not the one edge-outbox created: not migrating it".into(),
        ));
    }
    bumped?;
    Ok(())
}

/// The schema version of the store `conn` is on: 0 for a file edge-outbox has never opened. Reads
/// only, so it works on a read-only connection (the CLI checks a file with it before touching it).
pub fn schema_version(conn: &Connection) -> Result<i64> {
    let has_meta: bool = conn.query_row(
        "SELECT EXISTS (SELECT 1 FROM sqlite_schema WHERE type = 'table' AND name = 'edge_outbox_meta')",
        [],
        |r| r.get(0),
    )?;
    if !has_meta {
        return Ok(0);
    }
    let v: Option<i64> = conn
        .query_row(
            "SELECT value FROM edge_outbox_meta WHERE name = 'schema_version'",
            [],
            |r| r.get(0),
        )
        .optional()?;
    Ok(v.unwrap_or(0))
}

/// Brings the schema up to [`SCHEMA_VERSION`], one transaction per step; idempotent.
pub(crate) fn migrate(conn: &mut Connection) -> Result<()> {
    let found = schema_version(conn)?;
    check_not_newer(found)?;
    if found == SCHEMA_VERSION {
        // Up to date: take no write lock, so opening works while another connection writes.
        return Ok(());
    }
    for (i, sql) in MIGRATIONS.iter().enumerate() {
        let target = i as i64 + 1;
        let tx = conn.transaction_with_behavior(TransactionBehavior::Immediate)?;
        // Re-read under the write lock: another process may have migrated meanwhile.
        let current = schema_version(&tx)?;
        check_not_newer(current)?;
        if current >= target {
            continue;
        }
        tx.execute_batch(sql)?;
        if target == 5 {
            fix_id_default(&tx)?;
        }
        tx.execute(
            "INSERT INTO edge_outbox_meta (name, value) VALUES ('schema_version', ?1)
             ON CONFLICT (name) DO UPDATE SET value = excluded.value",
            [target],
        )?;
        tx.commit()?;
        tracing::info!(version = target, "migrated edge-outbox schema");
    }
    Ok(())
}

fn check_not_newer(found: i64) -> Result<()> {
    if found > SCHEMA_VERSION {
        return Err(Error::SchemaTooNew {
            found,
            supported: SCHEMA_VERSION,
        });
    }
    Ok(())
}
