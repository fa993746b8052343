//! What checking a payload schema costs a publish (feature `schemas`): one store, whose file has
//! a schema for `checked/#`, publishing the same order event to `checked/orders` and to
//! `plain/orders` (no schema, so the registry is consulted but nothing is checked) in alternating
//! 25 ms turns, 100 messages per transaction at `synchronous = NORMAL`, where CPU dominates and
//! the check shows most. Plus the check alone, through `Schemas::check`, in nanoseconds.

use std::path::Path;
use std::time::{Duration, Instant};

use edge_outbox::{EventSchema, Options, Outbox, Schemas, Synchronous};
use serde::Serialize;

use super::common::median;

type BoxResult<T> = Result<T, Box<dyn std::error::Error>>;

const ORDER: &str = "order = { order_id: tstr, customer: tstr, sku: tstr, quantity: uint,
                               total_cents: uint, currency: tstr, placed_at_ms: int }";

#[derive(Serialize)]
struct Order {
    order_id: String,
    customer: &'static str,
    sku: &'static str,
    quantity: u32,
    total_cents: u64,
    currency: &'static str,
    placed_at_ms: i64,
}

fn order(n: u64) -> Order {
    Order {
        order_id: format!("ord-{n:010}"),
        customer: "cust-0342",
        sku: "SKU-B220-BLU",
        quantity: (n % 5 + 1) as u32,
        total_cents: 1250 + (n % 1000) * 7,
        currency: "EUR",
        placed_at_ms: 1_764_000_000_000,
    }
}

/// Messages per second publishing to `topic` for `turn`, 100 per transaction.
fn turn(outbox: &Outbox, topic: &str, n: &mut u64, turn: Duration) -> BoxResult<f64> {
    let start = Instant::now();
    let mut sent = 0u64;
    while start.elapsed() < turn {
        outbox.transaction(|tx| {
            for _ in 0..100 {
                *n += 1;
                tx.publish(topic, "k", &order(*n))?;
            }
            Ok::<_, edge_outbox::Error>(())
        })?;
        sent += 100;
    }
    Ok(sent as f64 / start.elapsed().as_secs_f64())
}

/// (checked over plain publishes per second, the check alone in ns per message).
pub fn measure(base: &Path, secs: f64) -> BoxResult<(f64, f64)> {
    let dir = tempfile::Builder::new().prefix("schema-cost-").tempdir_in(base)?;
    let path = dir.path().join("device.db");
    let schema = EventSchema::new("order.placed", 1, "checked/#", ORDER);
    let outbox = Outbox::open_with(
        &path,
        Options::new().synchronous(Synchronous::Normal).schema(schema),
    )?;
    let slice = Duration::from_millis(25);
    let mut n = 0;
    turn(&outbox, "checked/orders", &mut n, slice)?;
    turn(&outbox, "plain/orders", &mut n, slice)?;
    let mut ratios = Vec::new();
    let until = Instant::now() + Duration::from_secs_f64(secs);
    while Instant::now() < until || ratios.len() < 2 {
        // Both orders of the pair in turn, so neither always follows the other's checkpoint.
        let (checked, plain) = if ratios.len() % 2 == 0 {
            let c = turn(&outbox, "checked/orders", &mut n, slice)?;
            (c, turn(&outbox, "plain/orders", &mut n, slice)?)
        } else {
            let p = turn(&outbox, "plain/orders", &mut n, slice)?;
            (turn(&outbox, "checked/orders", &mut n, slice)?, p)
        };
        ratios.push(checked / plain);
    }
    let stamped: i64 = outbox.with_connection(|c| {
        c.query_row(
            "SELECT count(*) FROM outbox WHERE event_type = 'order.placed'",
            [],
            |r| r.get(0),
        )
    })?;
    if stamped == 0 {
        return Err("no message was checked against the schema".into());
    }
    let schemas = Schemas::load(&rusqlite::Connection::open(&path)?)?;
    let payload = edge_outbox::envelope::to_cbor(&order(1))?;
    let reps = 20_000u32;
    let start = Instant::now();
    for _ in 0..reps {
        schemas.check("checked/orders", None, None, std::hint::black_box(&payload))?;
    }
    let ns = start.elapsed().as_nanos() as f64 / f64::from(reps);
    Ok((median(&ratios), ns))
}
