//! Message ids are unique and never change once committed; the outbox sequence is commit order,
//! whichever handle or thread committed.

mod common;

use std::collections::{HashMap, HashSet};
use std::sync::{Arc, Barrier};
use std::time::Duration;

use common::{TestResult, temp_db};
use edge_outbox::{Error, MessageId, Options, Outbox, Synchronous, envelope::from_cbor};

/// Ids and payloads in the outbox, in `seq` order.
fn outbox_rows(path: &std::path::Path) -> TestResult<Vec<(i64, MessageId, Vec<u8>)>> {
    let conn = rusqlite::Connection::open(path)?;
    let mut stmt = conn.prepare("SELECT seq, id, payload FROM outbox ORDER BY seq")?;
    let rows = stmt
        .query_map([], |r| Ok((r.get(0)?, r.get::<_, Vec<u8>>(1)?, r.get(2)?)))?
        .collect::<Result<Vec<_>, _>>()?;
    rows.into_iter()
        .map(|(seq, id, payload)| Ok((seq, MessageId::from_slice(&id)?, payload)))
        .collect()
}

#[test]
fn ids_are_unique_and_read_back_unchanged() -> TestResult {
    let (_dir, path) = temp_db()?;
    let mut published = Vec::new();
    {
        let outbox = Outbox::open(&path)?;
        for t in 0..20 {
            let committed = outbox.transaction(|tx| {
                for m in 0..10 {
                    tx.publish("readings", &format!("probe-{m}"), &(t, m))?;
                }
                Ok::<_, Error>(())
            })?;
            assert_eq!(committed.ids.len(), 10);
            published.extend(committed.ids);
        }
    }

    let unique: HashSet<_> = published.iter().collect();
    assert_eq!(unique.len(), published.len(), "duplicate message ids minted");
    for id in &published {
        assert_eq!(id.as_bytes()[6] >> 4, 7, "{id} is not a UUIDv7");
        assert_eq!(id.to_string().parse::<MessageId>()?, *id);
    }

    // Read back after closing and reopening the file: the same ids, in publish order.
    let _reopened = Outbox::open(&path)?;
    let rows = outbox_rows(&path)?;
    let stored: Vec<MessageId> = rows.iter().map(|(_, id, _)| *id).collect();
    assert_eq!(stored, published);
    let first: (i32, i32) = from_cbor(&rows[0].2)?;
    let last: (i32, i32) = from_cbor(&rows[199].2)?;
    assert_eq!((first, last), ((0, 0), (19, 9)));
    Ok(())
}

/// Each writer commits `per_writer` transactions that increment one shared counter row and
/// publish the new value: the value is the transaction's position in commit order. Returns the
/// id each value was published under, as `Committed::ids` reported it.
fn run_writers(handles: Vec<Outbox>, per_writer: i64) -> TestResult<HashMap<i64, MessageId>> {
    let barrier = Arc::new(Barrier::new(handles.len()));
    let threads: Vec<_> = handles
        .into_iter()
        .map(|outbox| {
            let barrier = Arc::clone(&barrier);
            std::thread::spawn(move || -> Result<Vec<(i64, MessageId)>, Error> {
                barrier.wait();
                let mut mine = Vec::new();
                for _ in 0..per_writer {
                    let committed = outbox.transaction(|tx| {
                        // Read-then-write: safe only because the transaction is IMMEDIATE.
                        let n: i64 = tx.query_row("SELECT n FROM counter", [], |r| r.get(0))?;
                        tx.execute("UPDATE counter SET n = ?1", [n + 1])?;
                        tx.publish("counter", "the-counter", &(n + 1))?;
                        Ok::<_, Error>(n + 1)
                    })?;
                    mine.push((committed.value, committed.ids[0]));
                }
                Ok(mine)
            })
        })
        .collect();
    let mut by_value = HashMap::new();
    for t in threads {
        let mine = t.join().map_err(|_| "writer thread panicked")??;
        assert!(
            mine.windows(2).all(|w| w[0].0 < w[1].0),
            "one writer's commits out of order: {mine:?}"
        );
        for (value, id) in mine {
            assert!(
                by_value.insert(value, id).is_none(),
                "two transactions read counter {value}"
            );
        }
    }
    Ok(by_value)
}

/// The outbox in `seq` order lists the counter values 1, 2, 3, ... with the reported ids.
fn check_commit_order(path: &std::path::Path, by_value: &HashMap<i64, MessageId>) -> TestResult {
    let rows = outbox_rows(path)?;
    assert_eq!(rows.len(), by_value.len());
    for (i, (_, id, payload)) in rows.iter().enumerate() {
        let value: i64 = from_cbor(payload)?;
        assert_eq!(
            value,
            i as i64 + 1,
            "seq order differs from commit order at row {i}"
        );
        assert_eq!(
            by_value.get(&value),
            Some(id),
            "Committed.ids differs from the stored id"
        );
    }
    assert!(rows.windows(2).all(|w| w[0].0 < w[1].0));
    Ok(())
}

fn setup_counter(path: &std::path::Path) -> TestResult<Options> {
    // NORMAL only to keep 200 commits quick: commit order does not depend on it. A generous busy
    // timeout so a loaded machine queues writers instead of failing them.
    let options = Options::new()
        .synchronous(Synchronous::Normal)
        .busy_timeout(Duration::from_secs(60));
    Outbox::open_with(path, options.clone())?.transaction(|tx| {
        tx.execute_batch("CREATE TABLE counter (n INTEGER NOT NULL); INSERT INTO counter VALUES (0);")?;
        Ok::<_, Error>(())
    })?;
    Ok(options)
}

#[test]
fn seq_follows_commit_order_across_separate_handles() -> TestResult {
    let (_dir, path) = temp_db()?;
    let options = setup_counter(&path)?;
    let handles = (0..4)
        .map(|_| Outbox::open_with(&path, options.clone()))
        .collect::<Result<Vec<_>, _>>()?;
    let by_value = run_writers(handles, 50)?;
    assert_eq!(by_value.len(), 200);
    check_commit_order(&path, &by_value)
}

#[test]
fn seq_follows_commit_order_across_clones_and_handles() -> TestResult {
    let (_dir, path) = temp_db()?;
    let options = setup_counter(&path)?;
    let shared = Outbox::open_with(&path, options.clone())?;
    let other = Outbox::open_with(&path, options)?;
    let handles = vec![shared.clone(), shared.clone(), shared, other.clone(), other];
    let by_value = run_writers(handles, 40)?;
    assert_eq!(by_value.len(), 200);
    check_commit_order(&path, &by_value)
}

#[test]
fn a_retried_operation_keeps_its_id_when_derived_from_the_client_key() {
    let dir = tempfile::tempdir().expect("tempdir");
    let outbox = edge_outbox::Outbox::open(dir.path().join("t.db")).expect("open");
    let id = edge_outbox::MessageId::from_key("client-request-7");
    let publish = || {
        outbox.transaction(|tx| {
            let msg = edge_outbox::Message::new("orders", "o-7", &7)?.with_id(id);
            tx.send(&msg)
        })
    };
    // The first attempt's commit is lost to the client (say, a timeout); it retries.
    assert_eq!(publish().expect("first").value, id);
    assert_eq!(publish().expect("retry").value, id);
    let ids: Vec<Vec<u8>> = outbox.with_connection(|c| {
        let mut s = c.prepare("SELECT id FROM outbox").expect("prepare");
        s.query_map([], |r| r.get(0))
            .expect("query")
            .collect::<Result<_, _>>()
            .expect("rows")
    });
    assert_eq!(
        ids,
        vec![id.as_bytes().to_vec(); 2],
        "both rows carry the same id: consumers dedupe them"
    );
}
