//! Opening the store: a new file is created owner-only and migrated once, however many handles
//! race to open it; reopening changes nothing; the application's own tables and `user_version`
//! are left alone; a newer schema or a file that is not a database is a clear error.

mod common;

use std::sync::{Arc, Barrier};

use common::{TestResult, query_i64, temp_db};
use edge_outbox::{Error, Options, Outbox, SCHEMA_VERSION, Synchronous};

fn schema_version(outbox: &Outbox) -> TestResult<i64> {
    query_i64(
        outbox,
        "SELECT value FROM edge_outbox_meta WHERE name = 'schema_version'",
    )
}

/// The rows of `edge_outbox_meta`, by name: one each, however often the file was opened.
fn meta_names(outbox: &Outbox) -> TestResult<Vec<String>> {
    Ok(outbox.with_connection(|c| {
        c.prepare("SELECT name FROM edge_outbox_meta ORDER BY name")?
            .query_map([], |r| r.get(0))?
            .collect::<rusqlite::Result<Vec<_>>>()
    })?)
}

/// Back to what version 2 wrote (after [`TO_VERSION_3`]): no uptime clock, no stamps.
const TO_VERSION_2: &str = "ALTER TABLE outbox_sent DROP COLUMN sent_uptime;
     ALTER TABLE inbox DROP COLUMN done_uptime;
     DELETE FROM edge_outbox_meta WHERE name = 'uptime_ms';
     UPDATE edge_outbox_meta SET value = 2 WHERE name = 'schema_version';";

/// Every table, index and trigger, as SQLite stores their definitions.
fn schema_sql(outbox: &Outbox) -> TestResult<Vec<(String, String)>> {
    Ok(outbox.with_connection(|c| {
        c.prepare("SELECT name, coalesce(sql, '') FROM sqlite_schema ORDER BY name")?
            .query_map([], |r| Ok((r.get(0)?, r.get(1)?)))?
            .collect::<rusqlite::Result<Vec<_>>>()
    })?)
}

#[test]
fn a_new_file_is_created_migrated_and_configured() -> TestResult {
    let (dir, _) = temp_db()?;
    let path = dir.path().join("nested/dirs/device.db");
    let outbox = Outbox::open(&path)?;
    assert_eq!(schema_version(&outbox)?, SCHEMA_VERSION);
    let names: Vec<String> = schema_sql(&outbox)?.into_iter().map(|(n, _)| n).collect();
    for table in [
        "edge_outbox_meta",
        "outbox",
        "outbox_sent",
        "outbox_counters",
        "inbox",
        "dead_letters",
    ] {
        assert!(
            names.iter().any(|n| n == table),
            "missing table {table}: {names:?}"
        );
    }
    let mode: String = outbox.with_connection(|c| c.query_row("PRAGMA journal_mode", [], |r| r.get(0)))?;
    assert_eq!(mode, "wal");
    assert_eq!(
        query_i64(&outbox, "PRAGMA auto_vacuum")?,
        2,
        "incremental auto-vacuum"
    );
    assert_eq!(query_i64(&outbox, "PRAGMA synchronous")?, 2, "FULL by default");
    assert_eq!(
        query_i64(&outbox, "PRAGMA user_version")?,
        0,
        "user_version is the application's"
    );
    Ok(())
}

#[cfg(unix)]
#[test]
fn the_file_and_its_wal_are_owner_only() -> TestResult {
    use std::os::unix::fs::PermissionsExt;
    let (_dir, path) = temp_db()?;
    let outbox = Outbox::open(&path)?;
    outbox.transaction(|tx| tx.publish("t", "k", &1))?;
    let mode =
        |p: &std::path::Path| -> TestResult<u32> { Ok(std::fs::metadata(p)?.permissions().mode() & 0o777) };
    assert_eq!(mode(&path)?, 0o600, "database file");
    let wal = path.with_extension("db-wal");
    assert!(wal.exists(), "the WAL exists while the handle is open");
    assert_eq!(mode(&wal)?, 0o600, "WAL file");
    Ok(())
}

#[test]
fn reopening_is_idempotent_and_keeps_data() -> TestResult {
    let (_dir, path) = temp_db()?;
    let first = Outbox::open(&path)?;
    let schema = schema_sql(&first)?;
    let id = first.transaction(|tx| tx.publish("t", "k", &"kept"))?.value;
    drop(first);
    for _ in 0..3 {
        let again = Outbox::open(&path)?;
        assert_eq!(schema_version(&again)?, SCHEMA_VERSION);
        assert_eq!(schema_sql(&again)?, schema, "reopening changed the schema");
        assert_eq!(meta_names(&again)?, ["file_id", "schema_version", "uptime_ms"]);
        assert_eq!(
            query_i64(&again, "SELECT count(*) FROM edge_outbox_epochs")?,
            1,
            "reopening the same file starts no epoch"
        );
        let stored: Vec<u8> =
            again.with_connection(|c| c.query_row("SELECT id FROM outbox", [], |r| r.get(0)))?;
        assert_eq!(stored, id.as_bytes());
        assert_eq!(again.stats()?.pending_messages, 1);
    }
    Ok(())
}

/// Several handles opening a brand-new file at the same moment all succeed, and it is migrated
/// once. (Switching a new file to WAL needs an exclusive lock and SQLite reports contention on it as
/// SQLITE_BUSY at once, without the busy handler: opening must wait for it like any other lock.)
#[test]
fn handles_racing_to_open_a_new_file_migrate_it_once() -> TestResult {
    const OPENERS: usize = 8;
    for round in 0..15 {
        let (_dir, path) = temp_db()?;
        let barrier = Arc::new(Barrier::new(OPENERS));
        let threads: Vec<_> = (0..OPENERS)
            .map(|_| {
                let (path, barrier) = (path.clone(), Arc::clone(&barrier));
                std::thread::spawn(move || {
                    barrier.wait();
                    // NORMAL only to keep the rounds quick; the race is the same at FULL.
                    Outbox::open_with(&path, Options::new().synchronous(Synchronous::Normal))
                })
            })
            .collect();
        let mut handles = Vec::new();
        for t in threads {
            match t.join().map_err(|_| "open panicked")? {
                Ok(outbox) => handles.push(outbox),
                Err(e) => return Err(format!("round {round}: a concurrent open failed: {e:?}").into()),
            }
        }
        for outbox in &handles {
            assert_eq!(schema_version(outbox)?, SCHEMA_VERSION);
        }
        assert_eq!(
            meta_names(&handles[0])?,
            ["file_id", "schema_version", "uptime_ms"]
        );
        assert_eq!(
            query_i64(&handles[0], "SELECT count(*) FROM edge_outbox_epochs")?,
            1,
            "one epoch: the schema was created once"
        );
        assert_eq!(
            query_i64(
                &handles[0],
                "SELECT count(*) FROM sqlite_schema WHERE name = 'outbox'"
            )?,
            1
        );
        assert_eq!(query_i64(&handles[0], "PRAGMA auto_vacuum")?, 2);
        // Every handle can write.
        for outbox in &handles {
            outbox.transaction(|tx| tx.publish("t", "k", &1))?;
        }
        assert_eq!(handles[0].stats()?.pending_messages, OPENERS as u64);
    }
    Ok(())
}

#[test]
fn the_applications_tables_and_user_version_survive_open() -> TestResult {
    let (_dir, path) = temp_db()?;
    {
        // The application had the file first, with its own schema and migration counter.
        let conn = rusqlite::Connection::open(&path)?;
        conn.execute_batch(
            "CREATE TABLE orders (id TEXT PRIMARY KEY, total INTEGER);
             INSERT INTO orders VALUES ('o-1', 40), ('o-2', 60);
             CREATE INDEX orders_total ON orders (total);
             PRAGMA user_version = 42;",
        )?;
    }
    let outbox = Outbox::open(&path)?;
    assert_eq!(query_i64(&outbox, "SELECT sum(total) FROM orders")?, 100);
    assert_eq!(query_i64(&outbox, "PRAGMA user_version")?, 42);
    assert_eq!(schema_version(&outbox)?, SCHEMA_VERSION);
    // The existing file is now in WAL mode, and business writes and messages commit together.
    let mode: String = outbox.with_connection(|c| c.query_row("PRAGMA journal_mode", [], |r| r.get(0)))?;
    assert_eq!(mode, "wal");
    outbox.transaction(|tx| {
        tx.execute("INSERT INTO orders VALUES ('o-3', 5)", [])?;
        tx.publish("orders/placed", "o-3", &5)
    })?;
    drop(outbox);
    let again = Outbox::open(&path)?;
    assert_eq!(query_i64(&again, "SELECT count(*) FROM orders")?, 3);
    assert_eq!(query_i64(&again, "PRAGMA user_version")?, 42);
    Ok(())
}

#[test]
fn a_newer_schema_is_refused_and_left_untouched() -> TestResult {
    let (_dir, path) = temp_db()?;
    Outbox::open(&path)?.transaction(|tx| tx.publish("t", "k", &1))?;
    let newer = SCHEMA_VERSION + 1;
    {
        let conn = rusqlite::Connection::open(&path)?;
        conn.execute(
            "UPDATE edge_outbox_meta SET value = ?1 WHERE name = 'schema_version'",
            [newer],
        )?;
        // A table only the newer version knows about.
        conn.execute_batch("CREATE TABLE outbox_v2_extra (x INTEGER)")?;
    }
    let err = Outbox::open(&path).expect_err("newer schema");
    match &err {
        Error::SchemaTooNew { found, supported } => assert_eq!((*found, *supported), (newer, SCHEMA_VERSION)),
        other => panic!("expected SchemaTooNew, got {other:?}"),
    }
    assert!(err.to_string().contains("upgrade edge-outbox"), "{err}");
    let conn = rusqlite::Connection::open(&path)?;
    let version: i64 = conn.query_row(
        "SELECT value FROM edge_outbox_meta WHERE name = 'schema_version'",
        [],
        |r| r.get(0),
    )?;
    assert_eq!(version, newer);
    let rows: i64 = conn.query_row("SELECT count(*) FROM outbox", [], |r| r.get(0))?;
    assert_eq!(rows, 1);
    Ok(())
}

#[test]
fn a_file_that_is_not_a_database_is_refused_and_left_untouched() -> TestResult {
    let (_dir, path) = temp_db()?;
    let junk = "this is a configuration file, not an SQLite database\n".repeat(100);
    std::fs::write(&path, &junk)?;
    let err = Outbox::open(&path).expect_err("not a database");
    match &err {
        Error::NotADatabase { path: p } => assert_eq!(p, &path),
        other => panic!("expected NotADatabase, got {other:?}"),
    }
    assert!(err.to_string().contains("not an SQLite database"), "{err}");
    assert_eq!(std::fs::read_to_string(&path)?, junk);
    Ok(())
}

#[test]
fn invalid_options_are_refused_before_the_file_is_created() -> TestResult {
    let (_dir, path) = temp_db()?;
    let bad = [
        edge_outbox::Options::new().max_attempts(0),
        edge_outbox::Options::new().limits(edge_outbox::Limits::new().max_payload_bytes(0)),
        edge_outbox::Options::new().retry_backoff(
            std::time::Duration::from_secs(2),
            std::time::Duration::from_secs(1),
        ),
        edge_outbox::Options::new().page_size(1000),
        edge_outbox::Options::new().page_size(256),
        edge_outbox::Options::new().page_size(131_072),
    ];
    for options in bad {
        let err = Outbox::open_with(&path, options).expect_err("invalid");
        assert!(matches!(err, Error::InvalidConfig(_)), "{err:?}");
    }
    assert!(!path.exists(), "an invalid configuration created the file");
    Ok(())
}

/// `Options::page_size` applies to a file it creates; an existing file keeps its page size, and
/// its rows, when opened with another.
#[test]
fn page_size_applies_to_new_files_only() -> TestResult {
    let (_dir, path) = temp_db()?;
    let outbox = Outbox::open_with(&path, edge_outbox::Options::new().page_size(1024))?;
    outbox.transaction(|tx| tx.publish("t", "k", &"kept"))?;
    assert_eq!(query_i64(&outbox, "PRAGMA page_size")?, 1024);
    drop(outbox);
    let reopened = Outbox::open_with(&path, edge_outbox::Options::new().page_size(8192))?;
    assert_eq!(query_i64(&reopened, "PRAGMA page_size")?, 1024);
    assert_eq!(reopened.stats()?.pending_messages, 1);
    Ok(())
}

#[test]
fn opening_an_up_to_date_file_takes_no_write_lock() {
    let dir = tempfile::tempdir().expect("tempdir");
    let path = dir.path().join("busy.db");
    edge_outbox::Outbox::open(&path).expect("create");
    // Another connection holds the write lock, as an application's long transaction would.
    let writer = rusqlite::Connection::open(&path).expect("writer");
    writer.execute_batch("BEGIN IMMEDIATE").expect("lock");
    let options = edge_outbox::Options::new().busy_timeout(std::time::Duration::from_millis(50));
    let reopened =
        edge_outbox::Outbox::open_with(&path, options).expect("open while another connection writes");
    assert_eq!(reopened.stats().expect("stats").pending_messages, 0);
    writer.execute_batch("COMMIT").expect("commit");
}

/// Version 4's counters undone: what version 3 wrote (a trigger per insert and per delete).
const TO_VERSION_3: &str = "
    DROP TRIGGER outbox_count_delete;
    ALTER TABLE outbox_counters DROP COLUMN counted_through;
    CREATE TRIGGER outbox_count_insert AFTER INSERT ON outbox BEGIN
        UPDATE outbox_counters SET pending_count = pending_count + 1,
            pending_bytes = pending_bytes + length(CAST(NEW.payload AS BLOB)) WHERE only = 1;
    END;
    CREATE TRIGGER outbox_count_delete AFTER DELETE ON outbox BEGIN
        UPDATE outbox_counters SET pending_count = pending_count - 1,
            pending_bytes = pending_bytes - length(CAST(OLD.payload AS BLOB)) WHERE only = 1;
    END;
    UPDATE outbox_counters SET pending_count = (SELECT count(*) FROM outbox),
        pending_bytes = (SELECT coalesce(sum(length(CAST(payload AS BLOB))), 0) FROM outbox);
    UPDATE edge_outbox_meta SET value = 3 WHERE name = 'schema_version';";

/// A version 3 file (counters kept by a trigger per row) is migrated to version 4 with its counts:
/// the pending rows it had are counted, and rows inserted and deleted after it, by the crate or
/// by plain SQL, are counted right.
#[test]
fn version_3_counters_are_migrated_and_stay_exact() -> TestResult {
    let (_dir, path) = temp_db()?;
    {
        let outbox = Outbox::open(&path)?;
        for i in 0..5 {
            outbox.transaction(|tx| tx.publish("t", "k", &format!("payload {i}")))?;
        }
        drop(outbox);
        let conn = rusqlite::Connection::open(&path)?;
        down_to_4(&conn)?;
        conn.execute_batch(TO_VERSION_3)?;
        let v3: (i64, i64) = conn.query_row(
            "SELECT pending_count, pending_bytes FROM outbox_counters",
            [],
            |r| Ok((r.get(0)?, r.get(1)?)),
        )?;
        assert_eq!(v3.0, 5);
    }
    let outbox = Outbox::open(&path)?;
    assert_eq!(schema_version(&outbox)?, SCHEMA_VERSION);
    let exact = |outbox: &Outbox| -> TestResult<(u64, u64)> {
        Ok(outbox.with_connection(|c| {
            c.query_row(
                "SELECT count(*), coalesce(sum(length(CAST(payload AS BLOB))), 0) FROM outbox",
                [],
                |r| Ok((r.get(0)?, r.get(1)?)),
            )
        })?)
    };
    let stats = |outbox: &Outbox| -> TestResult<(u64, u64)> {
        let s = outbox.stats()?;
        Ok((s.pending_messages, s.pending_bytes))
    };
    assert_eq!(stats(&outbox)?, exact(&outbox)?, "migrated counts");
    // More than a fold's worth of rows through the crate, some through plain SQL, then deletes
    // on both sides of `counted_through`.
    for i in 0..1100 {
        outbox.transaction(|tx| tx.publish("t", "k", &i))?;
    }
    outbox.with_connection(|c| {
        c.execute_batch(
            "INSERT INTO outbox (topic, key, payload) VALUES ('t', 'k', 'foreign one'), ('t', 'k', 'two');
             DELETE FROM outbox WHERE seq % 7 = 0;",
        )
    })?;
    assert_eq!(stats(&outbox)?, exact(&outbox)?, "after inserts and deletes");
    let counted: i64 = query_i64(&outbox, "SELECT counted_through FROM outbox_counters")?;
    assert!(counted > 5, "the writer folded the tail in: {counted}");
    outbox.prune()?;
    assert_eq!(stats(&outbox)?, exact(&outbox)?, "after the cleanup's fold");
    outbox.with_connection(|c| c.execute_batch("DELETE FROM outbox"))?;
    assert_eq!(stats(&outbox)?, (0, 0), "all gone");
    Ok(())
}

/// A file written by version 1 (no attempt claims, no retained flag) is migrated in place when a
/// version 2 build opens it: its commands keep their ids, attempts and errors, and are applied.
#[test]
fn a_version_1_inbox_is_migrated_to_version_2_with_its_commands() -> TestResult {
    let (_dir, path) = temp_db()?;
    let pending = edge_outbox::MessageId::new_v7();
    {
        let outbox = Outbox::open(&path)?;
        outbox.receive("cmd", &common::command_bytes(pending, "k", &3)?)?;
        drop(outbox);
        // Back to what version 1 wrote, as an older build left the file.
        let conn = rusqlite::Connection::open(&path)?;
        down_to_4(&conn)?;
        conn.execute_batch(TO_VERSION_3)?;
        conn.execute_batch(TO_VERSION_2)?;
        conn.execute_batch(
            "DROP INDEX inbox_claimed;
             DROP INDEX inbox_retained;
             ALTER TABLE inbox DROP COLUMN attempt_started_at;
             ALTER TABLE inbox DROP COLUMN claimed_by;
             ALTER TABLE inbox DROP COLUMN retained;
             UPDATE inbox SET attempts = 1, last_error = 'sensor busy';
             UPDATE edge_outbox_meta SET value = 1 WHERE name = 'schema_version';",
        )?;
    }
    let outbox = Outbox::open(&path)?;
    assert_eq!(schema_version(&outbox)?, SCHEMA_VERSION);
    assert_eq!(
        query_i64(
            &outbox,
            "SELECT count(*) FROM inbox WHERE attempts = 1 AND last_error = 'sensor busy'
               AND attempt_started_at IS NULL AND claimed_by IS NULL AND retained = 0"
        )?,
        1
    );
    let outcome = outbox.apply_next(|_tx, cmd| {
        assert_eq!((cmd.id, cmd.attempts), (pending, 1));
        Ok::<_, Error>(())
    })?;
    assert_eq!(
        outcome,
        edge_outbox::ApplyOutcome::Applied {
            id: pending,
            published: 0
        }
    );
    assert_eq!(query_i64(&outbox, "SELECT attempts FROM inbox")?, 2);
    Ok(())
}

/// Undoes migration 9 on `conn`'s file: no payload schemas table.
fn down_to_8(conn: &rusqlite::Connection) -> TestResult {
    conn.execute_batch(
        "DROP TABLE edge_outbox_schemas;
         UPDATE edge_outbox_meta SET value = 8 WHERE name = 'schema_version';",
    )?;
    Ok(())
}

/// A version 8 file is migrated to version 9 in place: it keeps its pending messages and gets the
/// payload schemas table, with the shape of a file this build creates.
#[test]
fn a_version_8_file_gets_the_schemas_table_and_keeps_its_messages() -> TestResult {
    let (_dir, path) = temp_db()?;
    let fresh = {
        let outbox = Outbox::open(&path)?;
        outbox.transaction(|tx| tx.publish("t", "k", &1))?;
        let fresh = shape(&outbox)?;
        drop(outbox);
        down_to_8(&rusqlite::Connection::open(&path)?)?;
        fresh
    };
    let outbox = Outbox::open(&path)?;
    assert_eq!(schema_version(&outbox)?, SCHEMA_VERSION);
    assert_eq!(outbox.stats()?.pending_messages, 1);
    assert_eq!(query_i64(&outbox, "SELECT count(*) FROM edge_outbox_schemas")?, 0);
    assert_eq!(shape(&outbox)?, fresh);
    Ok(())
}

/// Undoes migration 8 on `conn`'s file: what a version 7 build left, its rejections written as
/// version 7 wrote them (dead, and copied into the dead letters).
fn down_to_7(conn: &rusqlite::Connection) -> TestResult {
    down_to_8(conn)?;
    conn.execute_batch(
        "INSERT INTO dead_letters (origin, message_id, topic, key, payload, event_type, headers,
                                   reason, attempts, created_at)
             SELECT 'inbox', id, topic, key, payload, event_type, headers, last_error, attempts, received_at
             FROM inbox WHERE rejected = 1;
         DROP INDEX inbox_rejected;
         ALTER TABLE inbox DROP COLUMN rejected;
         ALTER TABLE dead_letters DROP COLUMN priority;
         ALTER TABLE dead_letters DROP COLUMN coalescing;
         ALTER TABLE dead_letters DROP COLUMN expires_at;
         ALTER TABLE dead_letters DROP COLUMN evictable;
         UPDATE edge_outbox_meta SET value = 7 WHERE name = 'schema_version';",
    )?;
    Ok(())
}

/// A version 7 file is migrated to version 8 in place: its rejected commands are counted apart
/// from the dead letters (their dead letters go, the inbox rows keep everything), a handler's
/// failure stays a dead letter, and it has the shape of a file this build creates.
#[test]
fn a_version_7_file_counts_its_rejections_apart_from_dead_letters() -> TestResult {
    let (_dir, path) = temp_db()?;
    let (rejected, failed) = (edge_outbox::MessageId::new_v7(), edge_outbox::MessageId::new_v7());
    {
        let outbox = Outbox::open_with(&path, Options::new().max_attempts(1))?;
        outbox.receive("cmd", &common::command_bytes(rejected, "a", &3)?)?;
        outbox.receive("cmd", &common::command_bytes(failed, "b", &4)?)?;
        outbox.apply_next(|_tx, _cmd| Err::<(), _>(Error::reject("never")))?;
        outbox.apply_next(|_tx, _cmd| Err::<(), _>("sensor busy"))?;
        drop(outbox);
        let conn = rusqlite::Connection::open(&path)?;
        down_to_7(&conn)?;
        let dead: i64 = conn.query_row("SELECT count(*) FROM dead_letters", [], |r| r.get(0))?;
        assert_eq!(dead, 2, "version 7 wrote both as dead letters");
    }
    let outbox = Outbox::open(&path)?;
    assert_eq!(schema_version(&outbox)?, SCHEMA_VERSION);
    let stats = outbox.stats()?;
    assert_eq!((stats.inbox_rejected, stats.dead_letters), (1, 1), "{stats:?}");
    let dead = outbox.dead_letters(10)?;
    assert_eq!(dead[0].message_id, Some(failed));
    assert_eq!(
        query_i64(
            &outbox,
            "SELECT count(*) FROM inbox WHERE rejected = 1 AND payload IS NOT NULL"
        )?,
        1
    );
    let (_fresh_dir, fresh_path) = temp_db()?;
    assert_eq!(shape(&outbox)?, shape(&Outbox::open(&fresh_path)?)?);
    Ok(())
}

/// Undoes migrations 8 and 7 on `conn`'s file: what a version 6 build left.
fn down_to_6(conn: &rusqlite::Connection) -> TestResult {
    down_to_7(conn)?;
    conn.execute_batch(
        "DROP TRIGGER dead_letters_refused_insert;
         DROP TRIGGER dead_letters_refused_delete;
         DROP TABLE edge_outbox_refusals;
         DROP INDEX dead_letters_refused;
         DROP INDEX dead_letters_by_message;
         ALTER TABLE dead_letters DROP COLUMN refused;
         DROP TRIGGER inbox_requires_signature;
         DROP TABLE edge_outbox_command_policy;
         DROP TABLE edge_outbox_command_keys;
         DROP TABLE edge_outbox_command_policy_log;
         ALTER TABLE inbox DROP COLUMN signed_by;
         UPDATE edge_outbox_meta SET value = 6 WHERE name = 'schema_version';",
    )?;
    Ok(())
}

/// The shape of a file's schema: every table's columns, every index's and trigger's SQL.
fn shape(o: &Outbox) -> TestResult<Vec<(String, String)>> {
    Ok(o.with_connection(|c| {
        c.prepare(
            "SELECT name, CASE type WHEN 'table' THEN
                 (SELECT group_concat(name || ' ' || type || ' ' || \"notnull\" || ' ' || coalesce(dflt_value, ''), ', ')
                  FROM pragma_table_info(m.name))
             ELSE sql END
             FROM sqlite_schema m WHERE name NOT LIKE 'sqlite_%' ORDER BY name",
        )?
        .query_map([], |r| Ok((r.get(0)?, r.get::<_, Option<String>>(1)?.unwrap_or_default())))?
        .collect::<Result<Vec<_>, _>>()
    })?)
}

/// A version 6 file is migrated to version 7 in place: its commands are kept and applied, it
/// requires no signature until told to, its refused deliveries are counted as such, and it has
/// the shape of a file this build creates.
#[test]
fn a_version_6_inbox_is_migrated_to_version_7_and_requires_no_signature() -> TestResult {
    let (_dir, path) = temp_db()?;
    let pending = edge_outbox::MessageId::new_v7();
    {
        let outbox = Outbox::open(&path)?;
        outbox.receive("cmd", &common::command_bytes(pending, "k", &3)?)?;
        outbox.receive("cmd", b"junk")?;
        drop(outbox);
        down_to_6(&rusqlite::Connection::open(&path)?)?;
    }
    let outbox = Outbox::open(&path)?;
    assert_eq!(schema_version(&outbox)?, SCHEMA_VERSION);
    assert_eq!(
        query_i64(&outbox, "SELECT count(*) FROM edge_outbox_command_policy")?,
        0
    );
    assert_eq!(
        query_i64(&outbox, "SELECT count(*) FROM inbox WHERE signed_by IS NULL")?,
        1
    );
    let stats = outbox.stats()?;
    assert_eq!(
        (stats.refusals_kept, stats.refusals_kept_bytes),
        (1, 4),
        "{stats:?}"
    );
    let outcome = outbox.apply_next(|_tx, _cmd| Ok::<_, Error>(()))?;
    assert_eq!(
        outcome,
        edge_outbox::ApplyOutcome::Applied {
            id: pending,
            published: 0
        }
    );
    let (_fresh_dir, fresh_path) = temp_db()?;
    assert_eq!(shape(&outbox)?, shape(&Outbox::open(&fresh_path)?)?);
    Ok(())
}

/// Undoes migrations 7 and 6 on `conn`'s file: what a version 5 build left.
fn down_to_5(conn: &rusqlite::Connection) -> TestResult {
    down_to_6(conn)?;
    conn.execute_batch(
        "DROP TRIGGER outbox_coalesce;
         DROP INDEX outbox_coalescing;
         DROP INDEX outbox_lanes;
         DROP INDEX outbox_evictable;
         CREATE INDEX outbox_evictable ON outbox (seq) WHERE evictable = 1;
         ALTER TABLE outbox DROP COLUMN claimed;
         ALTER TABLE outbox DROP COLUMN coalescing;
         ALTER TABLE outbox DROP COLUMN priority;
         ALTER TABLE outbox_counters DROP COLUMN coalesced;
         UPDATE edge_outbox_meta SET value = 5 WHERE name = 'schema_version';",
    )?;
    Ok(())
}

/// A version 5 file is migrated to version 6 in place: its pending rows keep their numbers and
/// land in lane 0, not coalescing; the new columns, indexes and trigger work on them at once.
#[test]
fn a_version_5_outbox_is_migrated_to_version_6_with_its_rows_in_lane_0() -> TestResult {
    let (_dir, path) = temp_db()?;
    {
        let outbox = Outbox::open(&path)?;
        for i in 0..3 {
            outbox.transaction(|tx| tx.publish("t", "k", &i))?;
        }
        drop(outbox);
        down_to_5(&rusqlite::Connection::open(&path)?)?;
    }
    let outbox = Outbox::open(&path)?;
    assert_eq!(schema_version(&outbox)?, SCHEMA_VERSION);
    assert_eq!(
        query_i64(
            &outbox,
            "SELECT count(*) FROM outbox WHERE priority = 0 AND coalescing = 0 AND claimed IS NULL"
        )?,
        3
    );
    outbox.transaction(|tx| {
        tx.send(&edge_outbox::Message::new("t", "k", &3)?.coalescing(true))?;
        tx.send(&edge_outbox::Message::new("t", "k", &4)?.coalescing(true))
    })?;
    // The old rows are not coalescing: only the first new one is replaced.
    assert_eq!(outbox.stats()?.pending_messages, 4);
    assert_eq!(outbox.stats()?.coalesced, 1);
    assert_eq!(query_i64(&outbox, "SELECT max(seq) FROM outbox")?, 5);
    // The same indexes and triggers as a file created by this build, and the same columns.
    let (_fresh_dir, fresh_path) = temp_db()?;
    let fresh = Outbox::open(&fresh_path)?;
    assert_eq!(shape(&outbox)?, shape(&fresh)?);
    Ok(())
}

/// Undoes migrations 6 and 5 on `conn`'s file: what a version 4 build left.
fn down_to_4(conn: &rusqlite::Connection) -> TestResult {
    down_to_5(conn)?;
    let sql: String = conn.query_row("SELECT sql FROM sqlite_schema WHERE name = 'outbox'", [], |r| {
        r.get(0)
    })?;
    let start = sql.find("DEFAULT (CAST(").ok_or("no UUIDv4 default")?;
    let end = start + sql[start..].find("AS BLOB))").ok_or("no end of the default")? + "AS BLOB))".len();
    let v2 = format!("{}DEFAULT (randomblob(16)){}", &sql[..start], &sql[end..]);
    let cookie: i64 = conn.query_row("PRAGMA schema_version", [], |r| r.get(0))?;
    conn.execute_batch("BEGIN; PRAGMA writable_schema = ON;")?;
    conn.execute("UPDATE sqlite_schema SET sql = ?1 WHERE name = 'outbox'", [v2])?;
    conn.execute_batch(&format!(
        "PRAGMA schema_version = {}; PRAGMA writable_schema = OFF; COMMIT;",
        cookie + 1
    ))?;
    conn.execute_batch(
        "DROP TABLE edge_outbox_epochs;
         DROP TABLE outbox_gaps;
         DROP INDEX outbox_expiring;
         ALTER TABLE outbox DROP COLUMN expires_at;
         DELETE FROM edge_outbox_meta WHERE name = 'file_id';
         UPDATE edge_outbox_meta SET value = 4 WHERE name = 'schema_version';",
    )?;
    Ok(())
}

/// A version 4 file is migrated to version 5 in place: its pending rows, its sequence counter
/// and the triggers that count rows all survive; the numbering carries on in an epoch that
/// starts at its first row (so numbers already published keep their meaning); the SQL default
/// mints UUIDv4 ids from then on.
#[test]
fn a_version_4_outbox_is_migrated_to_version_5_and_its_numbering_carries_on() -> TestResult {
    let (_dir, path) = temp_db()?;
    {
        let outbox = Outbox::open(&path)?;
        for i in 0..5 {
            outbox.transaction(|tx| tx.publish("t", "k", &i))?;
        }
        drop(outbox);
        let conn = rusqlite::Connection::open(&path)?;
        // Three were published and deleted; two are pending.
        conn.execute("DELETE FROM outbox WHERE seq <= 3", [])?;
        down_to_4(&conn)?;
        let sql: String = conn.query_row("SELECT sql FROM sqlite_schema WHERE name = 'outbox'", [], |r| {
            r.get(0)
        })?;
        assert!(sql.contains("DEFAULT (randomblob(16))"), "{sql}");
        assert_eq!(
            conn.query_row("PRAGMA integrity_check", [], |r| r.get::<_, String>(0))?,
            "ok"
        );
    }
    let outbox = Outbox::open(&path)?;
    assert_eq!(schema_version(&outbox)?, SCHEMA_VERSION);
    let ok: String = outbox.with_connection(|c| c.query_row("PRAGMA integrity_check", [], |r| r.get(0)))?;
    assert_eq!(ok, "ok");
    assert_eq!(
        query_i64(
            &outbox,
            "SELECT first_seq FROM edge_outbox_epochs WHERE reason = 'migrated'"
        )?,
        1
    );
    assert_eq!(
        outbox.stats()?.pending_messages,
        2,
        "the counting triggers survive"
    );
    outbox.with_connection(|c| c.execute("INSERT INTO outbox (topic, payload) VALUES ('t', x'01')", []))?;
    assert_eq!(
        query_i64(&outbox, "SELECT max(seq) FROM outbox")?,
        6,
        "no number is reused"
    );
    let hex: String = outbox
        .with_connection(|c| c.query_row("SELECT hex(id) FROM outbox WHERE seq = 6", [], |r| r.get(0)))?;
    assert_eq!(&hex[12..13], "4", "version nibble of {hex}");
    assert!(["8", "9", "A", "B"].contains(&&hex[16..17]), "variant of {hex}");
    assert_eq!(outbox.stats()?.pending_messages, 3);
    Ok(())
}

/// A file written by version 2 (no uptime clock) is migrated in place: the clock starts at zero,
/// and rows acknowledged or applied before have no stamp, so only the wall clock decides when they
/// are old: an old sent row is pruned, a recent one kept, and the applied command's id is kept.
#[test]
fn a_version_2_file_gets_the_uptime_clock_and_its_unstamped_rows_age_on_the_wall_clock() -> TestResult {
    let (_dir, path) = temp_db()?;
    let applied = edge_outbox::MessageId::new_v7();
    let hour = std::time::Duration::from_secs(3600);
    let options = || Options::new().sent_retention(hour).inbox_retention(hour);
    {
        let outbox = Outbox::open_with(&path, options())?;
        outbox.receive("cmd", &common::command_bytes(applied, "k", &3)?)?;
        outbox.apply_next(|_tx, _cmd| Ok::<_, Error>(()))?;
        drop(outbox);
        let conn = rusqlite::Connection::open(&path)?;
        down_to_4(&conn)?;
        conn.execute_batch(TO_VERSION_3)?;
        conn.execute_batch(TO_VERSION_2)?;
        let now = common::now_ms();
        conn.execute(
            "INSERT INTO outbox_sent (seq, id, topic, key, payload, created_at, sent_at)
             VALUES (1, randomblob(16), 't', 'old', x'00', 0, 0),
                    (2, randomblob(16), 't', 'recent', x'00', ?1, ?1)",
            [now],
        )?;
    }
    let outbox = Outbox::open_with(&path, options())?;
    assert_eq!(schema_version(&outbox)?, SCHEMA_VERSION);
    assert_eq!(meta_names(&outbox)?, ["file_id", "schema_version", "uptime_ms"]);
    assert_eq!(
        query_i64(
            &outbox,
            "SELECT value FROM edge_outbox_meta WHERE name = 'uptime_ms'"
        )?,
        0
    );
    assert_eq!(
        query_i64(
            &outbox,
            "SELECT count(*) FROM outbox_sent WHERE sent_uptime IS NULL"
        )?,
        2
    );
    outbox.prune()?;
    let kept: Vec<String> = outbox.with_connection(|c| {
        c.prepare("SELECT key FROM outbox_sent ORDER BY seq")?
            .query_map([], |r| r.get(0))?
            .collect::<rusqlite::Result<Vec<_>>>()
    })?;
    assert_eq!(kept, ["recent"]);
    assert_eq!(
        query_i64(
            &outbox,
            "SELECT count(*) FROM inbox WHERE applied_at IS NOT NULL AND done_uptime IS NULL"
        )?,
        1
    );
    Ok(())
}
