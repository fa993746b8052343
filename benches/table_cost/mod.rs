//! Where the crate's outbox table costs an insert over a bare one (the c/d column), one part at a
//! time. One store opened by `Outbox::open_with` (the crate's pragmas), and in its file copies of
//! the crate's `outbox` table, each with one part taken out: `AUTOINCREMENT`, the AFTER INSERT
//! trigger (coalescing), the partial indexes, the CHECK constraints, and all four. Every variant
//! inserts the same row with the same columns in turns of 25 ms on the one connection, one
//! business insert beside each message, 1 and 100 messages per transaction at
//! `synchronous = NORMAL`, where CPU and WAL bytes show rather than fsync. The result is each
//! variant's transactions per second over the bare table's (d), median over rounds: what removing
//! that part would give back, measured rather than assumed.
//!
//! The copies are made from the crate's own schema text (read from `sqlite_schema`, renamed), so
//! they follow the schema as it changes; a copy that does not come out as intended (a part that
//! was not found to remove) is an error, not a quiet mismeasurement.

use std::path::Path;
use std::time::{Duration, Instant};

use edge_outbox::{Options, Outbox, Synchronous};
use rusqlite::{Connection, Transaction, TransactionBehavior, params};

use super::common::median;

type BoxResult<T> = Result<T, Box<dyn std::error::Error>>;

/// One copy of the outbox table: which parts it keeps.
struct Variant {
    name: &'static str,
    label: &'static str,
    autoincrement: bool,
    triggers: bool,
    indexes: bool,
    checks: bool,
}

const fn copy(name: &'static str, label: &'static str, parts: [bool; 4]) -> Variant {
    Variant {
        name,
        label,
        autoincrement: parts[0],
        triggers: parts[1],
        indexes: parts[2],
        checks: parts[3],
    }
}

/// The crate's table as it is, then without one part, then without all of them.
const COPIES: [Variant; 6] = [
    copy("t_all", "the crate's table", [true, true, true, true]),
    copy("t_no_autoinc", "without AUTOINCREMENT", [false, true, true, true]),
    copy(
        "t_no_trigger",
        "without the insert trigger",
        [true, false, true, true],
    ),
    copy(
        "t_no_index",
        "without the partial indexes",
        [true, true, false, true],
    ),
    copy("t_no_check", "without the CHECKs", [true, true, true, false]),
    copy("t_none", "without all four", [false, false, false, false]),
];

const BARE: &str = "CREATE TABLE t_bare (
    n          INTEGER PRIMARY KEY,
    id         BLOB    NOT NULL,
    topic      TEXT    NOT NULL,
    key        TEXT    NOT NULL,
    payload    BLOB    NOT NULL,
    created_at INTEGER NOT NULL
)";

/// The crate's outbox schema (table, indexes, triggers) as a copy named `v.name`, without the
/// parts `v` leaves out.
fn copy_ddl(conn: &Connection, v: &Variant) -> BoxResult<String> {
    let mut stmt = conn.prepare(
        "SELECT type, sql FROM sqlite_schema WHERE tbl_name = 'outbox' AND sql IS NOT NULL ORDER BY rowid",
    )?;
    let objects = stmt
        .query_map([], |r| Ok((r.get::<_, String>(0)?, r.get::<_, String>(1)?)))?
        .collect::<rusqlite::Result<Vec<_>>>()?;
    let name = v.name;
    let mut ddl = String::new();
    for (kind, sql) in objects {
        match kind.as_str() {
            "trigger" if !v.triggers && sql.contains("AFTER INSERT") => continue,
            "index" if !v.indexes => continue,
            _ => {}
        }
        let mut sql = sql
            .replace("CREATE TABLE outbox (", &format!("CREATE TABLE {name} ("))
            .replace("INDEX outbox_", &format!("INDEX {name}_"))
            .replace("TRIGGER outbox_", &format!("TRIGGER {name}_"))
            .replace(" ON outbox ", &format!(" ON {name} "))
            .replace(" ON outbox\n", &format!(" ON {name}\n"))
            .replace("FROM outbox\n", &format!("FROM {name}\n"));
        if kind == "table" {
            if !v.autoincrement {
                sql = without(&sql, " AUTOINCREMENT")?;
            }
            if !v.checks {
                if !sql.contains(" CHECK (") {
                    return Err("the outbox table has no CHECK: the copy would measure nothing".into());
                }
                while let Some(start) = sql.find(" CHECK (") {
                    let end = closing_paren(&sql, start + " CHECK ".len())?;
                    sql.replace_range(start..=end, "");
                }
            }
        }
        if sql.contains(" outbox ") || sql.contains(" outbox\n") {
            return Err(
                format!("copying the outbox schema for {name}: a reference was not renamed: {sql}").into(),
            );
        }
        ddl.push_str(&sql);
        ddl.push_str(";\n");
    }
    Ok(ddl)
}

fn without(sql: &str, part: &str) -> BoxResult<String> {
    if !sql.contains(part) {
        return Err(format!("the outbox table has no{part}: the copy would measure nothing").into());
    }
    Ok(sql.replacen(part, "", 1))
}

/// The index of the parenthesis closing the one at `open`.
fn closing_paren(sql: &str, open: usize) -> BoxResult<usize> {
    let mut depth = 0usize;
    for (i, b) in sql.bytes().enumerate().skip(open) {
        match b {
            b'(' => depth += 1,
            b')' => {
                depth -= 1;
                if depth == 0 {
                    return Ok(i);
                }
            }
            _ => {}
        }
    }
    Err("unbalanced CHECK in the outbox schema".into())
}

/// Each copy's transactions per second over the bare table's, median over rounds, for 1 and 100
/// messages per transaction: `[(name, label, [one, hundred])]`.
pub fn measure(base: &Path, budget_secs: f64) -> BoxResult<Vec<(&'static str, &'static str, [f64; 2])>> {
    let dir = tempfile::Builder::new().prefix("table-cost-").tempdir_in(base)?;
    let outbox = Outbox::open_with(
        dir.path().join("device.db"),
        Options::new().synchronous(Synchronous::Normal),
    )?;
    outbox.with_connection(|c| -> BoxResult<()> {
        c.execute_batch(&format!(
            "{BARE}; CREATE TABLE orders (n INTEGER PRIMARY KEY, order_id TEXT NOT NULL, total INTEGER NOT NULL);"
        ))?;
        for v in &COPIES {
            c.execute_batch(&copy_ddl(c, v)?)?;
        }
        Ok(())
    })?;
    let tables: Vec<&str> = std::iter::once("t_bare")
        .chain(COPIES.iter().map(|v| v.name))
        .collect();
    let payload = [0xa5_u8; 100];
    let mut n: u64 = 0;
    let mut results = vec![[0.0; 2]; COPIES.len()];
    for (slot, rows) in [1usize, 100].into_iter().enumerate() {
        let turn = Duration::from_millis(25);
        let rounds = ((budget_secs / 2.0) / (turn.as_secs_f64() * tables.len() as f64)).max(3.0) as usize;
        let mut per_round: Vec<Vec<f64>> = Vec::with_capacity(rounds);
        for round in 0..rounds {
            let mut tps = vec![0.0; tables.len()];
            for k in 0..tables.len() {
                let t = (k + round) % tables.len();
                let insert = format!(
                    "INSERT INTO {} (id, topic, key, payload, created_at) VALUES (?1, ?2, ?3, ?4, ?5)",
                    tables[t]
                );
                let start = Instant::now();
                let mut txs = 0u64;
                while start.elapsed() < turn {
                    outbox.with_connection(|c| -> rusqlite::Result<()> {
                        let tx = Transaction::new_unchecked(c, TransactionBehavior::Immediate)?;
                        for _ in 0..rows {
                            n += 1;
                            let order_id = format!("ord-{n:010}");
                            tx.prepare_cached("INSERT INTO orders (order_id, total) VALUES (?1, ?2)")?
                                .execute(params![order_id, n as i64])?;
                            let mut id = [0u8; 16];
                            id[..8].copy_from_slice(&n.to_le_bytes());
                            id[8..].copy_from_slice(&n.wrapping_mul(0x9E37_79B9_7F4A_7C15).to_le_bytes());
                            tx.prepare_cached(&insert)?.execute(params![
                                &id[..],
                                "orders/placed",
                                order_id,
                                &payload[..],
                                1_764_000_000_000_i64
                            ])?;
                        }
                        tx.commit()
                    })?;
                    txs += 1;
                }
                tps[t] = txs as f64 / start.elapsed().as_secs_f64();
            }
            per_round.push(tps);
        }
        for (i, result) in results.iter_mut().enumerate() {
            let ratios: Vec<f64> = per_round.iter().map(|t| t[i + 1] / t[0]).collect();
            result[slot] = median(&ratios);
        }
    }
    Ok(COPIES
        .iter()
        .zip(results)
        .map(|(v, r)| (v.name, v.label, r))
        .collect())
}
