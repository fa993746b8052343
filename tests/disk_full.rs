//! Running out of space: a full disk (simulated with `PRAGMA max_page_count`) fails the write with
//! `Error::DiskFull`, loses nothing committed, and writes succeed again once space is freed. The
//! outbox's own limits reject (rolling back the caller's business row) or evict only what was
//! marked evictable, oldest first, counting every eviction.

mod common;

use common::{TestResult, command_bytes, query_i64, temp_db};
use edge_outbox::{Error, Limits, Message, MessageId, OnFull, Options, Outbox, Received, envelope::to_cbor};

fn open(path: &std::path::Path, options: Options) -> TestResult<Outbox> {
    let outbox = Outbox::open_with(path, options)?;
    outbox.transaction(|tx| {
        tx.execute_batch("CREATE TABLE notes (n INTEGER PRIMARY KEY, body TEXT NOT NULL)")?;
        Ok::<_, Error>(())
    })?;
    Ok(outbox)
}

/// Inserts a business row and publishes a message about it, in one transaction.
fn write_note(outbox: &Outbox, n: i64, body: &str) -> Result<MessageId, Error> {
    let committed = outbox.transaction(|tx| {
        tx.execute(
            "INSERT INTO notes (n, body) VALUES (?1, ?2)",
            rusqlite::params![n, body],
        )?;
        tx.publish("notes", &format!("note-{n}"), &(n, body))
    })?;
    Ok(committed.value)
}

/// Ids of the pending messages, in seq order.
fn pending_ids(outbox: &Outbox) -> TestResult<Vec<MessageId>> {
    let ids: Vec<Vec<u8>> = outbox.with_connection(|c| {
        c.prepare("SELECT id FROM outbox ORDER BY seq")?
            .query_map([], |r| r.get::<_, Vec<u8>>(0))?
            .collect::<rusqlite::Result<Vec<_>>>()
    })?;
    Ok(ids
        .iter()
        .map(|id| MessageId::from_slice(id))
        .collect::<Result<_, _>>()?)
}

fn set_max_pages(outbox: &Outbox, pages: i64) -> TestResult {
    outbox.with_connection(|c| c.pragma_update(None, "max_page_count", pages))?;
    Ok(())
}

/// The notes and pending messages are exactly the committed ones, and the file is sound.
fn check_intact(outbox: &Outbox, committed: &[MessageId]) -> TestResult {
    assert_eq!(
        query_i64(outbox, "SELECT count(*) FROM notes")?,
        committed.len() as i64
    );
    assert_eq!(pending_ids(outbox)?, committed);
    assert_eq!(outbox.stats()?.pending_messages, committed.len() as u64);
    assert_eq!(query_i64(outbox, "SELECT count(*) FROM inbox")?, 0);
    let ok: String = outbox.with_connection(|c| c.query_row("PRAGMA integrity_check", [], |r| r.get(0)))?;
    assert_eq!(ok, "ok");
    Ok(())
}

#[test]
fn a_full_disk_fails_writes_keeps_commits_and_recovers() -> TestResult {
    let (_dir, path) = temp_db()?;
    let outbox = open(&path, Options::new())?;
    let body = "x".repeat(2000);
    let mut committed = Vec::new();
    for n in 0..5 {
        committed.push(write_note(&outbox, n, &body)?);
    }

    // Leave a few pages of headroom, then write until the disk is full.
    let pages = query_i64(&outbox, "PRAGMA page_count")?;
    set_max_pages(&outbox, pages + 4)?;
    let mut n = 5;
    let full = loop {
        match write_note(&outbox, n, &body) {
            Ok(id) => committed.push(id),
            Err(e) => break e,
        }
        n += 1;
        assert!(n < 1000, "max_page_count never made the disk full");
    };
    assert!(matches!(full, Error::DiskFull), "expected DiskFull, got {full:?}");
    assert!(full.to_string().contains("free space"), "{full}");

    // A message alone (no business row) fails the same way, and so does receiving a command:
    // the caller must not acknowledge it, and its redelivery is stored later.
    let big = "y".repeat(60_000);
    let err = outbox
        .transaction(|tx| tx.publish("notes", "big", &big))
        .expect_err("no room for a 60 kB message");
    assert!(matches!(err, Error::DiskFull), "{err:?}");
    let command_id = MessageId::new_v7();
    let command = command_bytes(command_id, "k", &big)?;
    let err = outbox
        .receive("commands/note", &command)
        .expect_err("no room for the command");
    assert!(matches!(err, Error::DiskFull), "{err:?}");

    // Everything committed before is intact, and nothing of the failed writes is there.
    check_intact(&outbox, &committed)?;
    // Also through a fresh connection (which has no page cap), as after a restart.
    check_intact(&Outbox::open(&path)?, &committed)?;

    // Free space by deleting rows (as the relay does once messages are acknowledged): the freed
    // pages are reused under the same cap.
    let deleted = outbox.with_connection(|c| {
        c.execute_batch(
            "DELETE FROM notes WHERE n < 3;
             DELETE FROM outbox WHERE seq IN (SELECT seq FROM outbox ORDER BY seq LIMIT 3);",
        )?;
        c.query_row("SELECT changes()", [], |r| r.get::<_, i64>(0))
    })?;
    assert_eq!(deleted, 3);
    committed.drain(..3);
    committed.push(write_note(&outbox, n, &body)?);
    check_intact(&outbox, &committed)?;

    // Raise the cap ("a bigger disk"): the large writes that failed now succeed.
    set_max_pages(&outbox, 1_000_000)?;
    let committed_big = outbox.transaction(|tx| tx.publish("notes", "big", &big))?;
    committed.push(committed_big.value);
    assert_eq!(
        outbox.receive("commands/note", &command)?,
        Received::Stored(command_id)
    );
    assert_eq!(pending_ids(&outbox)?, committed);
    Ok(())
}

#[test]
fn reject_at_the_pending_message_limit_rolls_back_the_business_row() -> TestResult {
    let (_dir, path) = temp_db()?;
    let limits = Limits::new().max_pending_messages(3).on_full(OnFull::Reject);
    let outbox = open(&path, Options::new().limits(limits))?;
    for n in 0..3 {
        write_note(&outbox, n, "ok")?;
    }
    let err = write_note(&outbox, 3, "one too many").expect_err("limit reached");
    match &err {
        Error::StorageFull { limit } => assert!(limit.contains("3 pending messages"), "{limit}"),
        other => panic!("expected StorageFull, got {other:?}"),
    }
    assert_eq!(
        query_i64(&outbox, "SELECT count(*) FROM notes")?,
        3,
        "business row not rolled back"
    );
    assert_eq!(outbox.stats()?.pending_messages, 3);
    assert_eq!(outbox.stats()?.evicted, 0);

    // Once the relay drains one message, there is room again.
    outbox
        .with_connection(|c| c.execute("DELETE FROM outbox WHERE seq = (SELECT min(seq) FROM outbox)", []))?;
    write_note(&outbox, 3, "fits now")?;
    assert_eq!(query_i64(&outbox, "SELECT count(*) FROM notes")?, 4);
    Ok(())
}

#[test]
fn reject_at_the_pending_byte_limit() -> TestResult {
    let (_dir, path) = temp_db()?;
    let eight = to_cbor("1234567")?; // 8 bytes: a 1-byte text head and 7 characters
    assert_eq!(eight.len(), 8);
    let limits = Limits::new().max_pending_bytes(20);
    let outbox = open(&path, Options::new().limits(limits))?;
    outbox.transaction(|tx| {
        tx.publish("t", "k", "1234567")?;
        tx.publish("t", "k", "1234567")
    })?;
    assert_eq!(outbox.stats()?.pending_bytes, 16);
    let err = outbox
        .transaction(|tx| tx.publish("t", "k", "1234567"))
        .expect_err("24 > 20");
    assert!(
        matches!(&err, Error::StorageFull { limit } if limit.contains("20 pending bytes")),
        "{err:?}"
    );
    // Exactly at the limit is allowed.
    outbox.transaction(|tx| tx.publish("t", "k", "123"))?;
    assert_eq!(outbox.stats()?.pending_bytes, 20);
    // A message bigger than the whole limit can never fit, whatever is pending.
    let (_dir2, path2) = temp_db()?;
    let empty = open(&path2, Options::new().limits(Limits::new().max_pending_bytes(20)))?;
    let err = empty
        .transaction(|tx| tx.publish("t", "k", &"z".repeat(30)))
        .expect_err("too big");
    assert!(
        matches!(&err, Error::StorageFull { limit } if limit.contains("larger than")),
        "{err:?}"
    );
    Ok(())
}

#[test]
fn evict_oldest_removes_only_evictable_messages_oldest_first() -> TestResult {
    let (_dir, path) = temp_db()?;
    let limits = Limits::new().max_pending_messages(3).on_full(OnFull::EvictOldest);
    let outbox = open(&path, Options::new().limits(limits))?;
    let send = |name: &str, evictable: bool| -> Result<MessageId, Error> {
        let message = Message::new("telemetry", "probe", name)?.evictable(evictable);
        Ok(outbox.transaction(|tx| tx.send(&message))?.value)
    };
    let e1 = send("e1", true)?;
    let n1 = send("n1", false)?;
    let e2 = send("e2", true)?;
    assert_eq!(outbox.stats()?.evicted, 0);

    let n2 = send("n2", false)?;
    assert_eq!(
        pending_ids(&outbox)?,
        vec![n1, e2, n2],
        "e1, the oldest evictable, goes first"
    );
    let stats = outbox.stats()?;
    assert_eq!(
        (stats.evicted, stats.evicted_bytes),
        (1, to_cbor("e1")?.len() as u64)
    );

    let n3 = send("n3", false)?;
    assert_eq!(pending_ids(&outbox)?, vec![n1, n2, n3]);
    assert_eq!(outbox.stats()?.evicted, 2);

    // Nothing evictable left: the write is rejected with its business row, nothing is evicted.
    let err = outbox
        .transaction(|tx| {
            tx.execute("INSERT INTO notes (n, body) VALUES (1, 'x')", [])?;
            tx.send(&Message::new("telemetry", "probe", "n4")?.evictable(true))
        })
        .expect_err("full of non-evictable messages");
    assert!(matches!(err, Error::StorageFull { .. }), "{err:?}");
    assert_eq!(query_i64(&outbox, "SELECT count(*) FROM notes")?, 0);
    assert_eq!(pending_ids(&outbox)?, vec![n1, n2, n3]);
    assert_eq!(outbox.stats()?.evicted, 2);
    let _ = e1;
    Ok(())
}

#[test]
fn evict_oldest_by_bytes_evicts_as_many_as_needed_or_rolls_back() -> TestResult {
    let (_dir, path) = temp_db()?;
    let ten = "123456789"; // 10 bytes of CBOR
    let limits = Limits::new().max_pending_bytes(35).on_full(OnFull::EvictOldest);
    let outbox = open(&path, Options::new().limits(limits))?;
    let mut evictable = Vec::new();
    for _ in 0..3 {
        let message = Message::new("telemetry", "probe", ten)?.evictable(true);
        evictable.push(outbox.transaction(|tx| tx.send(&message))?.value);
    }
    assert_eq!(outbox.stats()?.pending_bytes, 30);

    // 24 more bytes: 54 > 35, so the two oldest evictable messages go (34 fits).
    let big = "x".repeat(23);
    assert_eq!(to_cbor(&big)?.len(), 24);
    let kept = outbox.transaction(|tx| tx.publish("orders", "o-1", &big))?.value;
    assert_eq!(pending_ids(&outbox)?, vec![evictable[2], kept]);
    let stats = outbox.stats()?;
    assert_eq!(
        (stats.evicted, stats.evicted_bytes, stats.pending_bytes),
        (2, 20, 34)
    );

    // Evicting everything evictable would still not make room for 30 more bytes: the write is
    // rejected, and the eviction it started is rolled back with it (nothing counted, nothing lost).
    let err = outbox
        .transaction(|tx| tx.publish("orders", "o-2", &"x".repeat(28)))
        .expect_err("cannot fit");
    assert!(matches!(err, Error::StorageFull { .. }), "{err:?}");
    assert_eq!(pending_ids(&outbox)?, vec![evictable[2], kept]);
    assert_eq!(outbox.stats()?.evicted, 2);
    Ok(())
}

#[test]
fn a_payload_over_the_maximum_is_refused_at_publish() -> TestResult {
    let (_dir, path) = temp_db()?;
    let outbox = open(&path, Options::new().limits(Limits::new().max_payload_bytes(100)))?;
    let at_limit = "a".repeat(98); // 2-byte head + 98 = 100
    let over = "a".repeat(99);
    outbox.transaction(|tx| tx.publish("t", "k", &at_limit))?;

    let err = outbox
        .transaction(|tx| {
            tx.execute("INSERT INTO notes (n, body) VALUES (1, 'x')", [])?;
            tx.publish("t", "k", &over)
        })
        .expect_err("101 bytes");
    assert!(
        matches!(err, Error::PayloadTooLarge { size: 101, max: 100 }),
        "{err:?}"
    );
    assert!(err.to_string().contains("raise the limit"), "{err}");
    assert_eq!(query_i64(&outbox, "SELECT count(*) FROM notes")?, 0);

    let err = outbox
        .transaction(|tx| tx.send(&Message::new("t", "k", &over)?))
        .expect_err("send checks too");
    assert!(matches!(err, Error::PayloadTooLarge { .. }), "{err:?}");
    let mut conn = rusqlite::Connection::open(&path)?;
    let tx = conn.transaction()?;
    let limits = Limits::new().max_payload_bytes(100);
    let err = edge_outbox::enqueue(&tx, &limits, &Message::new("t", "k", &over)?).expect_err("enqueue too");
    assert!(matches!(err, Error::PayloadTooLarge { .. }), "{err:?}");
    drop(tx);
    assert_eq!(outbox.stats()?.pending_messages, 1);
    Ok(())
}
