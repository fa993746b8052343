//! The SQL contract (docs/schema.md): another process, here Python with the standard `sqlite3`
//! module and the system SQLite, enqueues by inserting `(topic, key, payload)` in its own
//! transaction and applies commands with the documented update; the Rust side reads it all back.

mod common;
mod support;

use std::collections::BTreeMap;

use common::{TestResult, command_bytes, now_ms, query_i64, temp_db};
use edge_outbox::envelope::from_cbor;
use edge_outbox::{ApplyOutcome, Error, MessageId, Outbox, Received};
use support::python::run_script;

struct Row {
    seq: i64,
    id: Vec<u8>,
    topic: String,
    key: String,
    payload_type: String,
    payload: Vec<u8>,
    evictable: i64,
    created_at: i64,
}

fn rows(outbox: &Outbox) -> TestResult<Vec<Row>> {
    Ok(outbox.with_connection(|c| {
        c.prepare(
            "SELECT seq, id, topic, key, typeof(payload), CAST(payload AS BLOB), evictable, created_at
             FROM outbox ORDER BY seq",
        )?
        .query_map([], |r| {
            Ok(Row {
                seq: r.get(0)?,
                id: r.get(1)?,
                topic: r.get(2)?,
                key: r.get(3)?,
                payload_type: r.get(4)?,
                payload: r.get(5)?,
                evictable: r.get(6)?,
                created_at: r.get(7)?,
            })
        })?
        .collect::<rusqlite::Result<Vec<_>>>()
    })?)
}

#[test]
#[cfg_attr(
    eo_skip_python,
    ignore = "needs python3: none on PATH, or EDGE_OUTBOX_SKIP=python (the build warning says which)"
)]
fn rows_inserted_by_python_are_read_back() -> TestResult {
    let (_dir, path) = temp_db()?;
    let outbox = Outbox::open(&path)?;
    outbox.transaction(|tx| {
        tx.execute_batch("CREATE TABLE readings (probe TEXT NOT NULL, celsius REAL NOT NULL)")?;
        tx.publish("sensors/temp", "probe-0", &"from rust, before")
    })?;

    let started = now_ms();
    let version = run_script(
        "tests/python/sql_contract_writer.py",
        &[path.to_str().ok_or("path")?],
    )?;
    eprintln!("python's sqlite3 links SQLite {}", version.trim());
    // Rust keeps writing after the foreign writer: the sequence carries on.
    outbox.transaction(|tx| tx.publish("sensors/temp", "probe-0", &"from rust, after"))?;

    let rows = rows(&outbox)?;
    let topics: Vec<&str> = rows.iter().map(|r| r.topic.as_str()).collect();
    assert_eq!(
        topics,
        [
            "sensors/temp",
            "sensors/temp",
            "sensors/temp",
            "alerts",
            "logs",
            "sensors/temp"
        ],
        "the rolled-back row must be absent, the others in commit order"
    );
    assert!(rows.windows(2).all(|w| w[0].seq < w[1].seq), "seq not increasing");
    let ids: std::collections::HashSet<&[u8]> = rows.iter().map(|r| r.id.as_slice()).collect();
    assert_eq!(ids.len(), rows.len(), "ids not unique");
    for row in &rows {
        assert_eq!(row.id.len(), 16, "id of {} is {} bytes", row.topic, row.id.len());
        MessageId::from_slice(&row.id)?;
        assert_eq!(row.evictable, 0);
        let age = now_ms() - row.created_at;
        assert!(
            (-60_000..60_000).contains(&age),
            "created_at {} is {age} ms from now",
            row.created_at
        );
    }
    for row in &rows[1..5] {
        assert!(
            row.created_at >= started - 1000,
            "python row created before the script ran"
        );
    }

    // The payloads decode to what Python wrote.
    let python_rows = &rows[1..5];
    assert_eq!(python_rows[0].key, "probe-1");
    let reading: BTreeMap<String, ciborium::Value> = from_cbor(&python_rows[0].payload)?;
    assert_eq!(reading["probe"].as_text(), Some("probe-1"));
    assert_eq!(reading["celsius"].as_float(), Some(21.5));
    assert_eq!(from_cbor::<Vec<u32>>(&python_rows[1].payload)?, vec![1, 2, 3]);
    assert_eq!(python_rows[2].key, "", "the key defaults to ''");
    assert_eq!(from_cbor::<String>(&python_rows[2].payload)?, "overheat");
    assert_eq!(python_rows[3].payload_type, "text");
    assert_eq!(python_rows[3].payload, b"plain text line");
    assert_eq!(query_i64(&outbox, "SELECT count(*) FROM readings")?, 1);

    // The triggers counted Python's rows too.
    let stats = outbox.stats()?;
    assert_eq!(stats.pending_messages, 6);
    let bytes: usize = rows.iter().map(|r| r.payload.len()).sum();
    assert_eq!(stats.pending_bytes, bytes as u64);
    assert!(stats.oldest_pending_age.is_some());
    Ok(())
}

#[test]
#[cfg_attr(
    eo_skip_python,
    ignore = "needs python3: none on PATH, or EDGE_OUTBOX_SKIP=python (the build warning says which)"
)]
fn a_python_handler_applies_a_command_once_through_the_contract() -> TestResult {
    let (_dir, path) = temp_db()?;
    let db = path.to_str().ok_or("path")?;
    let outbox = Outbox::open(&path)?;
    outbox.transaction(|tx| {
        tx.execute_batch("CREATE TABLE account (balance INTEGER NOT NULL); INSERT INTO account VALUES (0);")?;
        Ok::<_, Error>(())
    })?;
    let first = MessageId::new_v7();
    let second = MessageId::new_v7();
    assert_eq!(
        outbox.receive("commands/credit", &command_bytes(first, "acct", &30)?)?,
        Received::Stored(first)
    );
    outbox.receive("commands/credit", &command_bytes(second, "acct", &12)?)?;

    let hex = |id: MessageId| common::to_hex(id.as_bytes());
    assert_eq!(
        run_script("tests/python/sql_contract_handler.py", &[db])?.trim(),
        format!("applied {}", hex(first))
    );
    // A redelivery of the applied command stays a duplicate.
    assert_eq!(
        outbox.receive("commands/credit", &command_bytes(first, "acct", &30)?)?,
        Received::Duplicate(first)
    );
    assert_eq!(
        run_script("tests/python/sql_contract_handler.py", &[db])?.trim(),
        format!("applied {}", hex(second))
    );
    assert_eq!(
        run_script("tests/python/sql_contract_handler.py", &[db])?.trim(),
        "none"
    );

    // The Rust side agrees: nothing left to apply, both effects once, both replies pending.
    assert_eq!(
        outbox.apply_next(|_, _| Err::<(), _>("must not run"))?,
        ApplyOutcome::Idle { next_due: None }
    );
    assert_eq!(query_i64(&outbox, "SELECT balance FROM account")?, 42);
    let stats = outbox.stats()?;
    assert_eq!(
        (stats.inbox_applied, stats.inbox_unapplied, stats.pending_messages),
        (2, 0, 2)
    );
    let replies: Vec<Vec<u8>> = outbox.with_connection(|c| {
        c.prepare("SELECT payload FROM outbox ORDER BY seq")?
            .query_map([], |r| r.get::<_, Vec<u8>>(0))?
            .collect::<rusqlite::Result<Vec<_>>>()
    })?;
    let reply: BTreeMap<String, ciborium::Value> = from_cbor(&replies[0])?;
    assert_eq!(reply["credited"], ciborium::Value::Integer(30.into()));
    assert_eq!(
        reply["command"],
        ciborium::Value::Bytes(first.as_bytes().to_vec())
    );
    Ok(())
}
