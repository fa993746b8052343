//! What a write costs the flash, counted in WAL frames (one page each), not timed: the figures
//! docs/operations.md ("Flash wear") gives per message are checked here.
//!
//! Each write is measured alone: the WAL is checkpointed and truncated, the transaction commits,
//! and `PRAGMA wal_checkpoint(PASSIVE)` reports how many frames it appended. A commit writes every
//! page it changed once, so the count is the distinct pages the transaction touched. The median
//! over many transactions leaves out the occasional B-tree page split (a new leaf every few dozen
//! rows) and the counters' fold (`store::counters`), both amortised.
//!
//! Broken builds these catch: a trigger or a counter that writes a page of its own at every
//! insert (schema 3 and before wrote the counters' row at every commit: one frame more per
//! message), a publish that touches an index or table it does not need. The first test shows the
//! measurement sees such a page.

mod common;

use common::{TestResult, temp_db};
use edge_outbox::{Message, Outbox};
use rusqlite::params;

/// Transactions measured per case (their median counts).
const SAMPLES: usize = 41;

const ORDERS: &str =
    "CREATE TABLE orders (n INTEGER PRIMARY KEY, order_id TEXT NOT NULL, total INTEGER NOT NULL)";

/// The frames one run of `write` appends to an empty WAL.
fn frames(outbox: &Outbox, write: &mut dyn FnMut(&Outbox) -> TestResult) -> TestResult<i64> {
    outbox.with_connection(|c| c.query_row("PRAGMA wal_checkpoint(TRUNCATE)", [], |_| Ok(())))?;
    write(outbox)?;
    let (busy, log): (i64, i64) = outbox.with_connection(|c| {
        c.query_row("PRAGMA wal_checkpoint(PASSIVE)", [], |r| {
            Ok((r.get(0)?, r.get(1)?))
        })
    })?;
    assert_eq!(busy, 0, "nothing else holds the file");
    Ok(log)
}

/// The median frame count of `write` over [`SAMPLES`] runs, after a warm-up that gives every
/// table its pages.
fn median_frames(outbox: &Outbox, mut write: impl FnMut(&Outbox, u64) -> TestResult) -> TestResult<i64> {
    let mut n = 0u64;
    for _ in 0..50 {
        n += 1;
        write(outbox, n)?;
    }
    let mut counts = Vec::with_capacity(SAMPLES);
    for _ in 0..SAMPLES {
        n += 1;
        counts.push(frames(outbox, &mut |o| write(o, n))?);
    }
    counts.sort_unstable();
    Ok(counts[SAMPLES / 2])
}

fn store() -> TestResult<(tempfile::TempDir, Outbox)> {
    let (dir, path) = temp_db()?;
    let outbox = Outbox::open(&path)?;
    outbox.with_connection(|c| c.execute_batch(ORDERS))?;
    Ok((dir, outbox))
}

/// A business row alone: the application's own page.
fn order_only(outbox: &Outbox, n: u64) -> TestResult {
    outbox.with_connection(|c| {
        c.execute(
            "INSERT INTO orders (order_id, total) VALUES (?1, ?2)",
            params![format!("o-{n}"), n as i64],
        )
    })?;
    Ok(())
}

/// A business row and `messages` messages (coalescing or not) in one transaction.
fn order_with(outbox: &Outbox, n: u64, messages: u64, coalescing: bool) -> TestResult {
    outbox.transaction(|tx| {
        tx.execute(
            "INSERT INTO orders (order_id, total) VALUES (?1, ?2)",
            params![format!("o-{n}"), n as i64],
        )?;
        for m in 0..messages {
            // A coalescing stream keeps one key, so each message replaces the one before.
            let key = if coalescing {
                "t1".to_owned()
            } else {
                format!("o-{n}-{m}")
            };
            let message = Message::new("orders/placed", key, &(n, m, "about a hundred bytes of event"))?
                .coalescing(coalescing);
            tx.send(&message)?;
        }
        Ok::<_, edge_outbox::Error>(())
    })?;
    Ok(())
}

#[test]
fn the_count_sees_an_extra_page_per_insert() -> TestResult {
    let (_dir, outbox) = store()?;
    let plain = median_frames(&outbox, |o, n| order_with(o, n, 1, false))?;
    // A broken build: the counters' row rewritten at every insert, as before schema 4.
    outbox.with_connection(|c| {
        c.execute_batch(
            "CREATE TRIGGER broken_count AFTER INSERT ON outbox BEGIN
                 UPDATE outbox_counters SET pending_count = pending_count + 1 WHERE only = 1;
             END",
        )
    })?;
    let broken = median_frames(&outbox, |o, n| order_with(o, n, 1, false))?;
    assert_eq!(
        broken,
        plain + 1,
        "a page written at every insert shows as one frame more"
    );
    Ok(())
}

#[test]
fn one_message_per_transaction_writes_three_pages() -> TestResult {
    let (_dir, outbox) = store()?;
    assert_eq!(
        median_frames(&outbox, order_only)?,
        1,
        "a business row alone: its own page"
    );
    // The business row's page, the outbox row's leaf, and sqlite_sequence (AUTOINCREMENT keeps
    // seq from being reused): the two the crate adds are the floor's one page and one more.
    assert_eq!(median_frames(&outbox, |o, n| order_with(o, n, 1, false))?, 3);
    Ok(())
}

#[test]
fn a_hundred_messages_per_transaction_share_their_pages() -> TestResult {
    let (_dir, outbox) = store()?;
    let frames = median_frames(&outbox, |o, n| order_with(o, n, 100, false))?;
    // About 100 rows of ~130 bytes fill three or four 4 KiB leaves; plus the interior page that
    // points to them, sqlite_sequence and the business page: under a tenth of a page per message.
    assert!(
        frames <= 8,
        "100 messages in one transaction wrote {frames} frames"
    );
    Ok(())
}

#[test]
fn a_coalescing_message_that_replaces_one_writes_seven_pages() -> TestResult {
    let (_dir, outbox) = store()?;
    // The business page, the outbox leaf (the new row in, the replaced one out), sqlite_sequence
    // (both tables' numbers), the coalescing index's leaf, the gap row's leaf and its unique seq
    // index, and the counters' coalesced count.
    let frames = median_frames(&outbox, |o, n| order_with(o, n, 1, true))?;
    assert_eq!(frames, 7, "a replacing coalescing message");
    Ok(())
}
