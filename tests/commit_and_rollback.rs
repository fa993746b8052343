//! A business change and its message commit together or not at all: a closure that returns an
//! error or panics leaves neither behind, and the store keeps working afterwards.

mod common;

use std::panic::{AssertUnwindSafe, catch_unwind};
use std::time::Duration;

use common::{TestResult, temp_db};
use edge_outbox::{Error, Limits, Message, Options, Outbox, envelope::from_cbor};

/// An application's own error type: the closure may fail for business reasons too.
#[derive(Debug)]
enum AppError {
    Store(Error),
    Declined(&'static str),
}

impl From<Error> for AppError {
    fn from(e: Error) -> Self {
        AppError::Store(e)
    }
}

impl From<rusqlite::Error> for AppError {
    fn from(e: rusqlite::Error) -> Self {
        AppError::Store(e.into())
    }
}

fn create_orders(outbox: &Outbox) -> Result<(), Error> {
    outbox.transaction(|tx| {
        tx.execute_batch("CREATE TABLE orders (id TEXT PRIMARY KEY, total INTEGER NOT NULL)")?;
        Ok::<_, Error>(())
    })?;
    Ok(())
}

/// (business rows, outbox rows), read through a separate connection, as another process sees them.
fn counts(path: &std::path::Path) -> TestResult<(i64, i64)> {
    let conn = rusqlite::Connection::open(path)?;
    let orders = conn.query_row("SELECT count(*) FROM orders", [], |r| r.get(0))?;
    let messages = conn.query_row("SELECT count(*) FROM outbox", [], |r| r.get(0))?;
    Ok((orders, messages))
}

#[test]
fn commit_stores_business_rows_and_messages_together() -> TestResult {
    let (_dir, path) = temp_db()?;
    let outbox = Outbox::open(&path)?;
    create_orders(&outbox)?;

    let committed = outbox.transaction(|tx| {
        tx.execute("INSERT INTO orders VALUES ('o-1', 40)", [])?;
        tx.publish("orders/placed", "o-1", &("o-1", 40))?;
        tx.execute("INSERT INTO orders VALUES ('o-2', 60)", [])?;
        tx.publish("orders/placed", "o-2", &("o-2", 60))?;
        Ok::<_, Error>("done")
    })?;
    assert_eq!(committed.value, "done");
    assert_eq!(committed.ids.len(), 2);
    assert_eq!(counts(&path)?, (2, 2));
    assert_eq!(outbox.stats()?.pending_messages, 2);

    // The rows are the ones published, in publish order, with the payloads given.
    let conn = rusqlite::Connection::open(&path)?;
    let mut stmt = conn.prepare("SELECT id, topic, key, payload FROM outbox ORDER BY seq")?;
    let rows = stmt
        .query_map([], |r| {
            Ok((
                r.get::<_, Vec<u8>>(0)?,
                r.get::<_, String>(1)?,
                r.get::<_, String>(2)?,
                r.get::<_, Vec<u8>>(3)?,
            ))
        })?
        .collect::<Result<Vec<_>, _>>()?;
    let expected = [("o-1", 40), ("o-2", 60)];
    assert_eq!(rows.len(), expected.len());
    for ((row, id), (order, total)) in rows.iter().zip(&committed.ids).zip(expected) {
        assert_eq!(row.0, id.as_bytes());
        assert_eq!((row.1.as_str(), row.2.as_str()), ("orders/placed", order));
        assert_eq!(from_cbor::<(String, i64)>(&row.3)?, (order.to_owned(), total));
    }
    Ok(())
}

#[test]
fn closure_error_rolls_back_business_rows_and_messages() -> TestResult {
    let (_dir, path) = temp_db()?;
    let outbox = Outbox::open(&path)?;
    create_orders(&outbox)?;
    outbox.transaction(|tx| {
        tx.execute("INSERT INTO orders VALUES ('o-1', 40)", [])?;
        tx.publish("orders/placed", "o-1", &40)
    })?;

    let result = outbox.transaction(|tx| {
        tx.execute("INSERT INTO orders VALUES ('o-2', 60)", [])?;
        tx.publish("orders/placed", "o-2", &60)?;
        tx.send(&Message::new("audit", "o-2", "placed")?.event_type("Audit.v1"))?;
        Err::<(), _>(AppError::Declined("credit check failed"))
    });
    assert!(
        matches!(result, Err(AppError::Declined("credit check failed"))),
        "{result:?}"
    );
    assert_eq!(counts(&path)?, (1, 1), "the failed transaction left rows behind");
    assert_eq!(outbox.stats()?.pending_messages, 1);
    assert_eq!(
        outbox.stats()?.pending_bytes,
        2,
        "pending bytes count the committed payload only"
    );

    // A store error inside the closure (here a payload over the limit) rolls back the same way.
    let (_dir2, path2) = temp_db()?;
    let small = Outbox::open_with(&path2, Options::new().limits(Limits::new().max_payload_bytes(8)))?;
    create_orders(&small)?;
    let err = small
        .transaction(|tx| {
            tx.execute("INSERT INTO orders VALUES ('o-3', 1)", [])?;
            tx.publish("orders/placed", "o-3", "a payload well over eight bytes")?;
            Ok::<_, AppError>(())
        })
        .expect_err("payload over the limit");
    assert!(
        matches!(err, AppError::Store(Error::PayloadTooLarge { max: 8, .. })),
        "{err:?}"
    );
    assert_eq!(counts(&path2)?, (0, 0));
    Ok(())
}

#[test]
fn closure_panic_rolls_back_and_the_store_stays_usable() -> TestResult {
    let (_dir, path) = temp_db()?;
    let outbox = Outbox::open(&path)?;
    create_orders(&outbox)?;
    let clone = outbox.clone();

    let panicked = catch_unwind(AssertUnwindSafe(|| {
        clone.transaction(|tx| -> Result<(), Error> {
            tx.execute("INSERT INTO orders VALUES ('o-1', 40)", [])?;
            tx.publish("orders/placed", "o-1", &40)?;
            panic!("application bug in the middle of a transaction")
        })
    }));
    assert!(panicked.is_err(), "the panic should reach the caller");
    assert_eq!(
        counts(&path)?,
        (0, 0),
        "the panicking transaction left rows behind"
    );

    // The write lock was released: another connection can write at once (a leaked transaction
    // would make this fail with Busy after the short timeout).
    let other = Outbox::open_with(&path, Options::new().busy_timeout(Duration::from_millis(200)))?;
    other.transaction(|tx| {
        tx.execute("INSERT INTO orders VALUES ('o-2', 60)", [])?;
        tx.publish("orders/placed", "o-2", &60)
    })?;

    // The handle that panicked, and its clones, still work.
    for (i, handle) in [&outbox, &clone].into_iter().enumerate() {
        let id = format!("o-{}", i + 3);
        handle.transaction(|tx| {
            tx.execute("INSERT INTO orders VALUES (?1, 1)", [&id])?;
            tx.publish("orders/placed", &id, &1)
        })?;
    }
    assert_eq!(counts(&path)?, (3, 3));
    assert_eq!(outbox.stats()?.pending_messages, 3);
    Ok(())
}

#[test]
fn enqueue_joins_a_caller_owned_transaction() -> TestResult {
    let (_dir, path) = temp_db()?;
    let outbox = Outbox::open(&path)?;
    create_orders(&outbox)?;
    let limits = Limits::default();
    let mut conn = rusqlite::Connection::open(&path)?;

    let tx = conn.transaction()?;
    tx.execute("INSERT INTO orders VALUES ('o-1', 40)", [])?;
    edge_outbox::enqueue(&tx, &limits, &Message::new("orders/placed", "o-1", &40)?)?;
    drop(tx); // rusqlite rolls back on drop
    assert_eq!(counts(&path)?, (0, 0));

    let tx = conn.transaction()?;
    tx.execute("INSERT INTO orders VALUES ('o-1', 40)", [])?;
    let id = edge_outbox::enqueue(&tx, &limits, &Message::new("orders/placed", "o-1", &40)?)?;
    tx.commit()?;
    assert_eq!(counts(&path)?, (1, 1));
    let stored: Vec<u8> =
        outbox.with_connection(|c| c.query_row("SELECT id FROM outbox", [], |r| r.get(0)))?;
    assert_eq!(stored, id.as_bytes());
    assert_eq!(outbox.stats()?.pending_messages, 1);
    Ok(())
}
