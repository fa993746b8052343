//! A foreign writer: another OS process that commits orders through the SQL contract with plain
//! rusqlite (no edge-outbox code), the way a C or Python application would, while the device's
//! relay is killed and restarted around it. Its orders land in the same `orders` table, numbered
//! from its own range, on keys of its own.

use std::time::Duration;

use rusqlite::{Connection, TransactionBehavior};

use super::device::ROLLED_BACK;

/// Configuration, from the environment.
pub struct WriterEnv;

impl WriterEnv {
    pub const DB: &'static str = "CRASH_WRITER_DB";
    pub const ID: &'static str = "CRASH_WRITER_ID";
    pub const ORDERS: &'static str = "CRASH_WRITER_ORDERS";
}

/// Writer `w` numbers its orders from `w * WRITER_BASE + 1`.
pub const WRITER_BASE: i64 = 1_000_000_000;

pub fn run() -> Result<(), Box<dyn std::error::Error>> {
    let var = |name: &str| std::env::var(name).map_err(|_| format!("{name} unset"));
    let db = var(WriterEnv::DB)?;
    let id: i64 = var(WriterEnv::ID)?.parse()?;
    let orders: i64 = var(WriterEnv::ORDERS)?.parse()?;
    let mut conn = Connection::open(&db)?;
    conn.busy_timeout(Duration::from_secs(30))?;
    // One writer syncs every commit, the other leaves it to the WAL checkpoint: the contract holds
    // for both.
    conn.pragma_update(None, "synchronous", if id % 2 == 0 { "FULL" } else { "NORMAL" })?;
    let base = id * WRITER_BASE;
    let next: i64 = conn.query_row(
        "SELECT coalesce(max(n), ?1) + 1 FROM orders WHERE n > ?1 AND n <= ?1 + ?2",
        [base, WRITER_BASE],
        |r| r.get(0),
    )?;
    for n in next..=base + orders {
        let key = format!("w{id}-k{}", n % 2);
        // Every fifth order is first attempted in a transaction that rolls back.
        let attempts: &[i64] = if n % 5 == 0 { &[ROLLED_BACK, 0] } else { &[0] };
        for &marker in attempts {
            let amount = if marker == ROLLED_BACK {
                ROLLED_BACK
            } else {
                n * 10
            };
            let tx = conn.transaction_with_behavior(TransactionBehavior::Immediate)?;
            tx.execute("INSERT INTO orders VALUES (?1, ?2, ?3)", (n, &key, amount))?;
            let payload = edge_outbox::envelope::to_cbor(&(n, &key, amount))?;
            tx.execute(
                "INSERT INTO outbox (topic, key, payload) VALUES (?1, ?2, ?3)",
                (format!("orders/{key}"), &key, payload),
            )?;
            if marker == ROLLED_BACK {
                tx.rollback()?;
            } else {
                tx.commit()?;
                println!("committed {n}");
            }
        }
        std::thread::sleep(Duration::from_micros(500));
    }
    println!("done");
    Ok(())
}
