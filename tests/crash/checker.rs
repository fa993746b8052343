//! The independent consumer's verdict: what the device committed against what the broker
//! delivered, and what the device applied against the commands sent.

use std::collections::{HashMap, HashSet};
use std::path::Path;

use edge_outbox::{Envelope, MessageId};
use rusqlite::{Connection, OpenFlags};

use super::support::Message;

/// One row of the report table.
#[derive(Debug, Default, Clone)]
pub struct Verdict {
    pub scenario: String,
    /// Crashes, cuts or restarts injected.
    pub faults: usize,
    /// Business rows committed (orders in the device's database).
    pub committed: usize,
    /// Order messages delivered to the consumer, duplicates included.
    pub published: usize,
    pub duplicates: usize,
    /// Distinct order messages delivered.
    pub received: usize,
    /// Committed orders whose message never arrived, though the device never saw it acknowledged.
    pub lost: usize,
    /// Committed orders acknowledged by a broker that was then killed before delivering them.
    pub lost_by_broker: usize,
    /// Messages delivered with no committed row behind them.
    pub phantom: usize,
    /// Keys whose first arrivals are not in commit order.
    pub out_of_order_keys: usize,
    /// One order announced under two message ids (an id minted per attempt).
    pub reminted: usize,
    pub commands_sent: usize,
    /// Ledger rows: applied command effects.
    pub effects: usize,
    /// Commands applied more than once.
    pub double_effects: usize,
    /// Commands sent and never applied.
    pub missing_effects: usize,
    /// Balances that differ from the sum of the commands sent.
    pub wrong_balances: usize,
}

impl Verdict {
    /// Nothing lost by the device, nothing phantom, order kept, every command applied once.
    pub fn problems(&self) -> Vec<String> {
        let mut p = Vec::new();
        let mut bad = |n: usize, what: &str| {
            if n > 0 {
                p.push(format!("{n} {what}"));
            }
        };
        bad(self.lost, "lost");
        bad(self.phantom, "phantom");
        bad(self.out_of_order_keys, "keys out of order");
        bad(self.reminted, "orders announced under two ids");
        bad(self.double_effects, "double effects");
        bad(self.missing_effects, "commands never applied");
        bad(self.wrong_balances, "wrong balances");
        p
    }
}

/// A command the orchestrator sent: id, account, amount.
pub type SentCommand = (MessageId, String, i64);

pub fn judge(
    scenario: &str,
    faults: usize,
    db: &Path,
    delivered: &[Message],
    commands: &[SentCommand],
) -> Verdict {
    let conn = Connection::open_with_flags(db, OpenFlags::SQLITE_OPEN_READ_ONLY).expect("open device db");
    let mut v = Verdict {
        scenario: scenario.to_owned(),
        faults,
        commands_sent: commands.len(),
        ..Verdict::default()
    };

    // What the device committed, in commit order.
    let orders: Vec<(i64, String)> = rows(&conn, "SELECT n, key FROM orders ORDER BY n");
    v.committed = orders.len();
    let committed: HashSet<i64> = orders.iter().map(|(n, _)| *n).collect();
    // Rows the broker acknowledged (kept when the scenario asks for sent retention).
    let acked: HashSet<i64> = rows::<Vec<u8>>(
        &conn,
        "SELECT payload FROM outbox_sent WHERE topic LIKE 'orders/%'",
    )
    .iter()
    .filter_map(|p| {
        edge_outbox::envelope::from_cbor::<(i64, String, i64)>(p)
            .ok()
            .map(|(n, _, _)| n)
    })
    .collect();

    // What the consumer got.
    let mut first_arrival: HashMap<String, Vec<i64>> = HashMap::new();
    let mut id_of: HashMap<i64, MessageId> = HashMap::new();
    let mut seen_ids = HashSet::new();
    for m in delivered.iter().filter(|m| m.topic.starts_with("orders/")) {
        let env = Envelope::decode(&m.payload).expect("delivered envelope decodes");
        let (n, key, _amount): (i64, String, i64) = env.payload_as().expect("order payload");
        v.published += 1;
        if !committed.contains(&n) {
            v.phantom += 1;
        }
        match id_of.insert(n, env.id) {
            Some(previous) if previous != env.id => v.reminted += 1,
            _ => {}
        }
        if seen_ids.insert(env.id) {
            first_arrival.entry(key).or_default().push(n);
        }
    }
    v.received = seen_ids.len();
    v.duplicates = v.published - v.received;
    for (n, _) in &orders {
        if !id_of.contains_key(n) {
            if acked.contains(n) {
                v.lost_by_broker += 1;
            } else {
                v.lost += 1;
            }
        }
    }
    v.out_of_order_keys = first_arrival
        .values()
        .filter(|ns| !ns.windows(2).all(|w| w[0] < w[1]))
        .count();

    // Commands: each applied exactly once, and balances add up.
    let ledger: Vec<Vec<u8>> = rows(&conn, "SELECT command_id FROM ledger");
    v.effects = ledger.len();
    let mut applied: HashMap<Vec<u8>, usize> = HashMap::new();
    for id in ledger {
        *applied.entry(id).or_default() += 1;
    }
    v.double_effects = applied.values().filter(|&&c| c > 1).count();
    v.missing_effects = commands
        .iter()
        .filter(|(id, _, _)| !applied.contains_key(id.as_bytes().as_slice()))
        .count();
    let mut expected: HashMap<String, i64> = HashMap::new();
    for (_, account, amount) in commands {
        *expected.entry(account.clone()).or_default() += amount;
    }
    let balances: HashMap<String, i64> =
        rows::<(String, i64)>(&conn, "SELECT account, balance FROM accounts")
            .into_iter()
            .collect();
    v.wrong_balances = expected
        .iter()
        .filter(|(account, sum)| balances.get(*account).copied().unwrap_or(0) != **sum)
        .count();
    v
}

fn rows<T: FromRow>(conn: &Connection, sql: &str) -> Vec<T> {
    let mut stmt = conn.prepare(sql).expect("prepare");
    stmt.query_map([], |r| T::from_row(r))
        .expect("query")
        .collect::<Result<_, _>>()
        .expect("rows")
}

trait FromRow: Sized {
    fn from_row(r: &rusqlite::Row<'_>) -> rusqlite::Result<Self>;
}

impl FromRow for Vec<u8> {
    fn from_row(r: &rusqlite::Row<'_>) -> rusqlite::Result<Self> {
        r.get(0)
    }
}

impl FromRow for (i64, String) {
    fn from_row(r: &rusqlite::Row<'_>) -> rusqlite::Result<Self> {
        Ok((r.get(0)?, r.get(1)?))
    }
}

impl FromRow for (String, i64) {
    fn from_row(r: &rusqlite::Row<'_>) -> rusqlite::Result<Self> {
        Ok((r.get(0)?, r.get(1)?))
    }
}

/// Prints the verdicts as the first article's table, with real processes behind it.
pub fn print_table(verdicts: &[Verdict]) {
    println!();
    println!(
        "{:<36} {:>6} {:>9} {:>9} {:>5} {:>9} {:>5} {:>8} {:>7} {:>8} {:>7} {:>6}",
        "scenario",
        "faults",
        "committed",
        "published",
        "dups",
        "received",
        "lost",
        "brk-lost",
        "phantom",
        "commands",
        "effects",
        "double"
    );
    for v in verdicts {
        println!(
            "{:<36} {:>6} {:>9} {:>9} {:>5} {:>9} {:>5} {:>8} {:>7} {:>8} {:>7} {:>6}",
            v.scenario,
            v.faults,
            v.committed,
            v.published,
            v.duplicates,
            v.received,
            v.lost,
            v.lost_by_broker,
            v.phantom,
            v.commands_sent,
            v.effects,
            v.double_effects
        );
    }
}
