//! The SQL contract for foreign writers, statement by statement (docs/schema.md, "Writing from
//! another process"): each documented statement is run by Python's `sqlite3` on the system
//! SQLite, and what it claims is checked here.
//!
//! - readiness: the version check says "not ready" before edge-outbox created the schema;
//! - `INSERT ... RETURNING seq, id` (and `last_insert_rowid()` before 3.35) gives the row's
//!   number and id, and the epoch query its number on the wire;
//! - a writer's own id is kept; a wrong length is refused by the table; the same id twice is the
//!   same message to a deduplicating consumer (published twice, delivered once);
//! - ids minted by the column default are valid UUIDv4 (version and variant bits);
//! - `created_at` (the envelope's `ts`) is the insert time by the wall clock, not the commit;
//! - rolled-back transactions, failed statements, rolled-back savepoints and a writer that dies
//!   mid-transaction consume no sequence number; only deleting a row (forbidden) leaves a gap.

mod common;
mod support;

use std::collections::HashSet;

use common::{TestResult, query_i64, temp_db};
use edge_outbox::consumer::Consumer;
use edge_outbox::{MessageId, Outbox, Relay, SCHEMA_VERSION};
use support::device::relay_config;
use support::python::run_script;
use support::{Broker, Subscriber, WAIT};

const SCRIPT: &str = "tests/python/sql_contract_statements.py";

/// Runs one statement of the script on `db`; returns its `name value` lines.
fn statement(db: &std::path::Path, name: &str, args: &[&str]) -> TestResult<Vec<(String, String)>> {
    let mut all = vec![db.to_str().ok_or("path")?, name];
    all.extend_from_slice(args);
    let out = run_script(SCRIPT, &all)?;
    Ok(out
        .lines()
        .map(|l| {
            let (k, v) = l.split_once(' ').unwrap_or((l, ""));
            (k.to_owned(), v.to_owned())
        })
        .collect())
}

fn value<'a>(lines: &'a [(String, String)], name: &str) -> TestResult<&'a str> {
    Ok(lines
        .iter()
        .find(|(k, _)| k == name)
        .map(|(_, v)| v.as_str())
        .ok_or_else(|| format!("no {name} in {lines:?}"))?)
}

#[test]
#[cfg_attr(
    eo_skip_python,
    ignore = "needs python3: none on PATH, or EDGE_OUTBOX_SKIP=python (the build warning says which)"
)]
fn a_writer_checks_that_the_schema_is_ready_and_at_which_version() -> TestResult {
    let (_dir, db) = temp_db()?;
    // The application created the file but edge-outbox has not opened it yet.
    rusqlite::Connection::open(&db)?.execute_batch("CREATE TABLE readings (celsius REAL)")?;
    let before = statement(&db, "ready", &[])?;
    assert_eq!(before[0].0, "not-ready", "{before:?}");
    Outbox::open(&db)?;
    let after = statement(&db, "ready", &[])?;
    assert_eq!(after, [("ready".to_owned(), SCHEMA_VERSION.to_string())]);
    Ok(())
}

#[test]
#[cfg_attr(
    eo_skip_python,
    ignore = "needs python3: none on PATH, or EDGE_OUTBOX_SKIP=python (the build warning says which)"
)]
fn returning_gives_the_writer_its_rows_number_id_and_wire_number() -> TestResult {
    let (_dir, db) = temp_db()?;
    let outbox = Outbox::open(&db)?;
    outbox.transaction(|tx| tx.publish("contract/rust", "k", &"first, from rust"))?;
    let got = statement(&db, "returning", &[])?;
    let seq: i64 = value(&got, "seq")?.parse()?;
    assert_eq!(seq, 2);
    let stored: Vec<u8> = outbox
        .with_connection(|c| c.query_row("SELECT id FROM outbox WHERE seq = ?1", [seq], |r| r.get(0)))?;
    assert_eq!(value(&got, "id")?, common::to_hex(&stored));
    assert_eq!(value(&got, "epoch")?, outbox.epoch()?.to_string());
    assert_eq!(
        value(&got, "wire_seq")?,
        "2",
        "a new file's epoch counts from its first row"
    );
    assert_eq!(value(&got, "rowid_seq")?, "3");
    let stored: Vec<u8> =
        outbox.with_connection(|c| c.query_row("SELECT id FROM outbox WHERE seq = 3", [], |r| r.get(0)))?;
    assert_eq!(value(&got, "rowid_id")?, common::to_hex(&stored));
    Ok(())
}

#[test]
#[cfg_attr(
    eo_skip_python,
    ignore = "needs python3: none on PATH, or EDGE_OUTBOX_SKIP=python (the build warning says which)"
)]
fn a_writers_own_id_is_kept_and_the_same_id_twice_is_one_message_downstream() -> TestResult {
    let broker = Broker::start()?;
    let sub = Subscriber::start(broker.addr(), "contract/#")?;
    let (_dir, db) = temp_db()?;
    let outbox = Outbox::open(&db)?;
    let own = MessageId::new_v7();
    let got = statement(&db, "own-id", &[&common::to_hex(own.as_bytes())])?;
    // 32 bytes of hex text, and 8 bytes: both refused by the table's CHECK.
    assert_eq!(got[0].0, "refused", "{got:?}");
    assert!(got[0].1.starts_with("32 CHECK constraint failed"), "{got:?}");
    assert!(got[1].1.starts_with("8 CHECK constraint failed"), "{got:?}");
    assert_eq!(query_i64(&outbox, "SELECT count(*) FROM outbox")?, 2);
    assert_eq!(
        query_i64(
            &outbox,
            &format!(
                "SELECT count(*) FROM outbox WHERE id = x'{}'",
                common::to_hex(own.as_bytes())
            )
        )?,
        2
    );

    let relay = Relay::start(&outbox, relay_config(broker.addr(), "own-id"))?;
    assert!(sub.wait_for(2, WAIT), "both rows are published");
    relay.shutdown()?;
    let mut consumer = Consumer::new().from_start(true);
    for m in sub.messages() {
        consumer.observe_bytes(&m.payload)?;
    }
    let report = consumer.report();
    assert_eq!(
        (
            report.totals.delivered,
            report.totals.duplicates,
            report.totals.unexplained
        ),
        (1, 1, 0),
        "the second row is a duplicate of the first: {report}"
    );
    Ok(())
}

#[test]
#[cfg_attr(
    eo_skip_python,
    ignore = "needs python3: none on PATH, or EDGE_OUTBOX_SKIP=python (the build warning says which)"
)]
fn ids_minted_by_the_column_default_are_valid_uuid_v4() -> TestResult {
    let (_dir, db) = temp_db()?;
    Outbox::open(&db)?;
    let got = statement(&db, "default-ids", &["500"])?;
    assert_eq!(got.len(), 500);
    let mut distinct = HashSet::new();
    for (_, line) in &got {
        let fields: Vec<&str> = line.split(' ').collect();
        assert_eq!(fields[1..], ["4", "rfc4122"], "{line}");
        distinct.insert(fields[0].to_owned());
        // And as the crate reads it: version nibble 4, variant bits 10.
        let id: MessageId = fields[0].parse()?;
        assert_eq!(id.as_bytes()[6] >> 4, 4);
        assert_eq!(id.as_bytes()[8] >> 6, 0b10);
    }
    assert_eq!(distinct.len(), 500);
    Ok(())
}

#[test]
#[cfg_attr(
    eo_skip_python,
    ignore = "needs python3: none on PATH, or EDGE_OUTBOX_SKIP=python (the build warning says which)"
)]
fn ts_is_the_insert_time_by_the_wall_clock_not_the_commit() -> TestResult {
    let (_dir, db) = temp_db()?;
    let outbox = Outbox::open(&db)?;
    let got = statement(&db, "ts", &[])?;
    let seq: i64 = value(&got, "seq")?.parse()?;
    let created = query_i64(
        &outbox,
        &format!("SELECT created_at FROM outbox WHERE seq = {seq}"),
    )?;
    let before_insert: i64 = value(&got, "before_insert")?.parse()?;
    let after_insert: i64 = value(&got, "after_insert")?.parse()?;
    let before_commit: i64 = value(&got, "before_commit")?.parse()?;
    // The default goes through a floating-point Julian day: it may read 1 ms low.
    assert!(
        before_insert - 1 <= created && created <= after_insert,
        "created_at {created} is not within the insert ({before_insert}..={after_insert})"
    );
    assert!(
        created < before_commit,
        "created_at {created} is not before the commit"
    );
    Ok(())
}

#[test]
#[cfg_attr(
    eo_skip_python,
    ignore = "needs python3: none on PATH, or EDGE_OUTBOX_SKIP=python (the build warning says which)"
)]
fn what_a_foreign_writer_rolls_back_or_fails_consumes_no_number() -> TestResult {
    let (_dir, db) = temp_db()?;
    Outbox::open(&db)?;
    let got = statement(&db, "gapless", &[])?;
    assert_eq!(value(&got, "committed")?, "1 2 3 4", "{got:?}");
    Ok(())
}

#[test]
fn what_the_crate_rolls_back_or_refuses_consumes_no_number_and_a_deleted_row_does() -> TestResult {
    let (_dir, db) = temp_db()?;
    let outbox = Outbox::open_with(
        &db,
        edge_outbox::Options::new().limits(edge_outbox::Limits::new().max_payload_bytes(64)),
    )?;
    let seqs = |o: &Outbox| -> TestResult<Vec<i64>> {
        Ok(o.with_connection(|c| {
            c.prepare("SELECT seq FROM outbox ORDER BY seq")?
                .query_map([], |r| r.get(0))?
                .collect::<rusqlite::Result<Vec<i64>>>()
        })?)
    };
    outbox.transaction(|tx| tx.publish("t", "k", &1))?;
    // A transaction that returns an error, and one that panics, roll back.
    let _ = outbox.transaction(|tx| {
        tx.publish("t", "k", &2)?;
        Err::<(), _>(edge_outbox::Error::InvalidConfig("declined".into()))
    });
    let panicked = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        let _ = outbox.transaction(|tx| -> edge_outbox::Result<()> {
            tx.publish("t", "k", &3)?;
            panic!("the application panics mid-transaction");
        });
    }));
    assert!(panicked.is_err());
    // A refused publish (too large) inside a transaction that commits anyway.
    outbox.transaction(|tx| {
        assert!(tx.publish("t", "k", &"x".repeat(100)).is_err());
        tx.publish("t", "k", &4)
    })?;
    outbox.transaction(|tx| tx.publish("t", "k", &5))?;
    assert_eq!(seqs(&outbox)?, [1, 2, 3]);

    // What the contract forbids: a transaction that inserts a row and deletes it commits a
    // number that no message will carry (the consumer reports it as an unexplained gap).
    outbox.with_connection(|c| {
        c.execute_batch(
            "BEGIN IMMEDIATE;
             INSERT INTO outbox (topic, payload) VALUES ('t', x'01');
             DELETE FROM outbox WHERE seq = last_insert_rowid();
             COMMIT;",
        )
    })?;
    outbox.transaction(|tx| tx.publish("t", "k", &6))?;
    assert_eq!(seqs(&outbox)?, [1, 2, 3, 5]);
    Ok(())
}
