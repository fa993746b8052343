//! A device's write path, offline: orders and their events commit together, a failed
//! transaction leaves nothing behind, and a redelivered command is applied once.
//!
//! Run: `cargo run --example quickstart`

use edge_outbox::{ApplyOutcome, Envelope, MessageId, Outbox, Received};

/// The application's own error: a business rule said no, or the outbox failed. A transaction's
/// closure may return any error type that an `edge_outbox::Error` converts into.
#[derive(Debug)]
enum OrderError {
    Declined(&'static str),
    Outbox(edge_outbox::Error),
}

impl From<edge_outbox::Error> for OrderError {
    fn from(e: edge_outbox::Error) -> Self {
        OrderError::Outbox(e)
    }
}

/// The business rows are written through rusqlite (re-exported by the crate, so its version matches).
impl From<edge_outbox::rusqlite::Error> for OrderError {
    fn from(e: edge_outbox::rusqlite::Error) -> Self {
        OrderError::Outbox(e.into())
    }
}

impl std::fmt::Display for OrderError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            OrderError::Declined(why) => write!(f, "order declined: {why}"),
            OrderError::Outbox(e) => write!(f, "outbox: {e}"),
        }
    }
}

impl std::error::Error for OrderError {}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let dir = tempfile::tempdir()?;
    let outbox = Outbox::open(dir.path().join("device.db"))?;
    outbox.with_connection(|c| {
        c.execute_batch(
            "CREATE TABLE orders (id TEXT PRIMARY KEY, total INTEGER NOT NULL);
             CREATE TABLE balance (account TEXT PRIMARY KEY, credits INTEGER NOT NULL);
             INSERT INTO balance VALUES ('acct-7', 0);",
        )
    })?;

    // 1. A business row and its event in one transaction.
    let placed = outbox.transaction(|tx| {
        tx.execute("INSERT INTO orders VALUES ('o-1', 40)", [])?;
        tx.publish("orders/placed", "o-1", &("o-1", 40))?;
        Ok::<_, edge_outbox::Error>(())
    })?;
    println!("committed order o-1 with event {}", placed.ids[0]);

    // 2. A transaction that fails half-way leaves neither the order nor its event.
    let failed = outbox.transaction(|tx| {
        tx.execute("INSERT INTO orders VALUES ('o-2', 99)", [])?;
        tx.publish("orders/placed", "o-2", &("o-2", 99))?;
        Err::<(), _>(OrderError::Declined("payment declined"))
    });
    let orders: i64 =
        outbox.with_connection(|c| c.query_row("SELECT count(*) FROM orders", [], |r| r.get(0)))?;
    println!(
        "failed transaction: {} -> orders={orders}, pending events={}",
        failed.is_err(),
        outbox.stats()?.pending_messages
    );

    // 3. A command arrives twice (the broker redelivers); it is applied once.
    let command = Envelope {
        id: MessageId::new_v7(),
        source: "cloud".into(),
        epoch: 0,
        seq: 1,
        key: "acct-7".into(),
        created_ms: 0,
        event_type: Some("AddCredits".into()),
        headers: vec![],
        payload: edge_outbox::envelope::to_cbor(&40)?.into(),
    }
    .encode();
    for delivery in 1..=2 {
        let r = outbox.receive("devices/d1/commands", &command)?;
        let shown = match r {
            Received::Stored(id) => format!("stored {id}"),
            Received::Duplicate(id) => format!("duplicate {id}, ignored"),
            other => format!("{other:?}"),
        };
        println!("delivery {delivery}: {shown}");
    }
    while let ApplyOutcome::Applied { .. } = outbox.apply_next(|tx, cmd| {
        let credits: i64 = cmd.payload_as()?;
        tx.execute(
            "UPDATE balance SET credits = credits + ?1 WHERE account = ?2",
            (credits, &cmd.key),
        )?;
        Ok::<_, edge_outbox::Error>(())
    })? {}
    let credits: i64 =
        outbox.with_connection(|c| c.query_row("SELECT credits FROM balance", [], |r| r.get(0)))?;
    println!("balance after two deliveries of +40: {credits}");
    println!("{:#?}", outbox.stats()?);
    Ok(())
}
