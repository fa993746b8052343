//! The independent consumer's verdict: what the device committed against what the broker
//! delivered, and what the device applied against the commands sent.

use std::collections::{HashMap, HashSet};
use std::path::Path;

use edge_outbox::{Envelope, MessageId, Published};
use rusqlite::{Connection, OpenFlags};

use super::device::{COALESCING_KEY, EXPIRING_KEY};
use super::support::Message;
use super::writer::WRITER_BASE;

/// One row of the report table.
#[derive(Debug, Default, Clone)]
pub struct Verdict {
    pub scenario: String,
    /// Crashes, cuts or restarts injected.
    pub faults: usize,
    /// Of those, how many the device was seen to experience (a disconnect its relay counted, a
    /// crash it restarted from), where the scenario checks; `None` where every fault is a process
    /// kill, experienced by construction.
    pub experienced: Option<usize>,
    /// Whether this scenario allows `lost_by_broker` (it kills the broker).
    pub allow_broker_loss: bool,
    /// Business rows committed (orders in the device's database).
    pub committed: usize,
    /// Order messages delivered to the consumer, duplicates included.
    pub published: usize,
    pub duplicates: usize,
    /// Distinct order messages delivered.
    pub received: usize,
    /// Committed orders whose message never arrived, though the device never saw it acknowledged.
    pub lost: usize,
    /// Orders whose commit returned (the device or writer said so) and that the store does not
    /// hold, or holds with a gap in a writer's numbering.
    pub lost_commits: usize,
    /// Committed orders acknowledged by a broker that was then killed before delivering them
    /// (known only with sent-row retention; without it they count as `lost`).
    pub lost_by_broker: usize,
    /// Committed orders whose message the device moved to the dead letters.
    pub dead_lettered: usize,
    /// Committed orders not delivered and announced removed (coalesced or expired), where the
    /// scenario allows it.
    pub announced: usize,
    /// Messages delivered with no committed row behind them (a rolled-back transaction's, or one
    /// whose content differs from what committed).
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
    /// Applied commands whose reply never arrived.
    pub missing_receipts: usize,
    /// Replies for commands never applied.
    pub phantom_receipts: usize,
    /// Commands sent and never applied.
    pub missing_effects: usize,
    /// Balances that differ from the sum of the commands sent.
    pub wrong_balances: usize,
    /// Other problems a scenario found.
    pub notes: Vec<String>,
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
        bad(self.lost_commits, "returned commits missing from the store");
        bad(self.lost, "lost");
        if !self.allow_broker_loss {
            bad(
                self.lost_by_broker,
                "marked sent but never delivered, with no broker killed",
            );
        }
        bad(self.dead_lettered, "dead-lettered");
        bad(self.phantom, "phantom");
        bad(self.out_of_order_keys, "keys out of order");
        bad(self.reminted, "orders announced under two ids");
        bad(self.double_effects, "double effects");
        bad(
            self.missing_receipts,
            "applied commands whose reply never arrived",
        );
        bad(self.phantom_receipts, "replies for commands never applied");
        bad(self.missing_effects, "commands never applied");
        bad(self.wrong_balances, "wrong balances");
        if let Some(seen) = self.experienced
            && seen < self.faults
        {
            p.push(format!(
                "{} of {} faults never experienced by the relay",
                self.faults - seen,
                self.faults
            ));
        }
        p.extend(self.notes.iter().cloned());
        p
    }
}

/// An order: its number, key and amount, as committed and as its message carries it.
type Order = (i64, String, i64);

/// A command the orchestrator sent: id, account, amount.
pub type SentCommand = (MessageId, String, i64);

pub fn judge(
    scenario: &str,
    db: &Path,
    delivered: &[Message],
    commands: &[SentCommand],
    returned: &HashSet<i64>,
    announced_removals: bool,
) -> Verdict {
    let conn = Connection::open_with_flags(db, OpenFlags::SQLITE_OPEN_READ_ONLY).expect("open device db");
    let mut v = Verdict {
        scenario: scenario.to_owned(),
        commands_sent: commands.len(),
        ..Verdict::default()
    };

    // What the device (and any foreign writer) committed, in commit order per key: each key has
    // one writer, which numbers its orders in the order it commits them.
    let orders: Vec<Order> = rows(&conn, "SELECT n, key, amount FROM orders ORDER BY n");
    v.committed = orders.len();
    let committed: HashSet<&Order> = orders.iter().collect();
    // Each writer (the device, each foreign writer) numbers its orders 1, 2, ... from its base and
    // resumes after the highest it finds: a returned commit the store lost shows as a missing
    // number, or as a number said and not found.
    let numbers: HashSet<i64> = orders.iter().map(|(n, _, _)| *n).collect();
    let mut gaps = 0;
    let mut by_writer: HashMap<i64, i64> = HashMap::new();
    for n in &numbers {
        let high = by_writer.entry(n / WRITER_BASE).or_default();
        *high = (*high).max(*n);
    }
    for (w, high) in by_writer {
        let base = w * WRITER_BASE;
        gaps += ((base + 1)..=high).filter(|n| !numbers.contains(n)).count();
    }
    let missing = returned.iter().filter(|n| !numbers.contains(n)).count();
    v.lost_commits = gaps.max(missing);
    let dead: HashSet<i64> = rows::<Vec<u8>>(
        &conn,
        "SELECT payload FROM dead_letters WHERE origin = 'outbox' AND topic LIKE 'orders/%'",
    )
    .iter()
    .filter_map(|p| {
        edge_outbox::envelope::from_cbor::<Order>(p)
            .ok()
            .map(|(n, _, _)| n)
    })
    .collect();
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
    // Numbers announced removed, by cause, per epoch (a notice may come twice).
    let mut removed: HashMap<String, HashSet<(u64, u64)>> = HashMap::new();
    let mut envelopes = Vec::new();
    for m in delivered.iter().filter(|m| m.topic.starts_with("orders/")) {
        for item in Published::decode_all(&m.payload).expect("delivered item decodes") {
            match item {
                Published::Message(env) => envelopes.push(env),
                Published::Gap(g) => {
                    let numbers = removed.entry(g.cause.to_string()).or_default();
                    numbers.extend((g.first..=g.last).map(|seq| (g.epoch, seq)));
                }
                other => panic!("unexpected item on an order topic: {other:?}"),
            }
        }
    }
    for env in envelopes {
        let order: Order = env.payload_as().expect("order payload");
        v.published += 1;
        if !committed.contains(&order) {
            v.phantom += 1;
        }
        let (n, key, _) = order;
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
    // Orders of the coalescing and expiring keys may be announced instead of delivered: exactly
    // as many coalesced as are missing (a replaced value is never published), at least as many
    // expired (one may expire in flight and still arrive), and the latest value always arrives.
    let (mut coalesced_missing, mut expired_missing) = (0, 0);
    let mut latest: HashMap<&str, i64> = HashMap::new();
    for (n, key, _) in &orders {
        let e = latest.entry(key.as_str()).or_insert(*n);
        *e = (*e).max(*n);
    }
    for (n, key, _) in &orders {
        if !id_of.contains_key(n) {
            if announced_removals && key == COALESCING_KEY && latest.get(key.as_str()) != Some(n) {
                coalesced_missing += 1;
                continue;
            }
            if announced_removals && key == EXPIRING_KEY {
                expired_missing += 1;
                continue;
            }
            if dead.contains(n) {
                v.dead_lettered += 1;
            } else if acked.contains(n) {
                v.lost_by_broker += 1;
            } else {
                v.lost += 1;
            }
        }
    }
    let count = |cause: &str| removed.get(cause).map_or(0, HashSet::len);
    if coalesced_missing != count("coalesced") {
        v.notes.push(format!(
            "{coalesced_missing} coalescing orders missing, {} announced coalesced",
            count("coalesced")
        ));
    }
    if expired_missing > count("expired") {
        v.lost += expired_missing - count("expired");
    }
    v.announced = coalesced_missing + expired_missing.min(count("expired"));
    if !announced_removals && !removed.is_empty() {
        v.notes.push(format!(
            "gap notices in a scenario that removes nothing: {removed:?}"
        ));
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
    // Each applied command's reply (published in its apply transaction) arrived; none arrived
    // for a command that was not applied.
    let receipts: HashSet<String> = delivered
        .iter()
        .filter(|m| m.topic == "device/receipts")
        .filter_map(|m| Envelope::decode(&m.payload).ok()?.payload_as::<String>().ok())
        .collect();
    let applied_ids: HashSet<String> = applied
        .keys()
        .filter_map(|id| MessageId::from_slice(id).ok().map(|id| id.to_string()))
        .collect();
    v.missing_receipts = applied_ids.difference(&receipts).count();
    v.phantom_receipts = receipts.difference(&applied_ids).count();
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

impl FromRow for Order {
    fn from_row(r: &rusqlite::Row<'_>) -> rusqlite::Result<Self> {
        Ok((r.get(0)?, r.get(1)?, r.get(2)?))
    }
}

impl FromRow for (String, i64) {
    fn from_row(r: &rusqlite::Row<'_>) -> rusqlite::Result<Self> {
        Ok((r.get(0)?, r.get(1)?))
    }
}

/// The report table, as text for the terminal and as Markdown for docs/reliability.md.
pub fn table(verdicts: &[Verdict], markdown: bool) -> String {
    let header = [
        "scenario",
        "faults",
        "seen",
        "committed",
        "delivered",
        "dups",
        "dups/fault",
        "lost",
        "brk-lost",
        "dead",
        "phantom",
        "commands",
        "effects",
        "double",
        "skipped",
    ];
    let rows: Vec<Vec<String>> = verdicts
        .iter()
        .map(|v| {
            // Without a count, every fault was a process kill or abort: experienced by
            // construction (the device restarted from its store).
            let seen = v.experienced.map_or("kill".to_owned(), |n| n.to_string());
            vec![
                v.scenario.clone(),
                v.faults.to_string(),
                seen,
                v.committed.to_string(),
                v.received.to_string(),
                v.duplicates.to_string(),
                // What each crash or cut cost in messages sent again (at-least-once's price: at
                // most the in-flight window plus the acknowledged rows not yet marked).
                format!("{:.1}", v.duplicates as f64 / v.faults.max(1) as f64),
                v.lost.to_string(),
                v.lost_by_broker.to_string(),
                v.dead_lettered.to_string(),
                v.phantom.to_string(),
                v.commands_sent.to_string(),
                v.effects.to_string(),
                v.double_effects.to_string(),
                // A scenario that cannot run its real part fails instead (see build.rs).
                "no".to_owned(),
            ]
        })
        .collect();
    let mut out = String::new();
    if markdown {
        out.push_str(&format!("| {} |\n", header.join(" | ")));
        out.push_str(&format!("|{}\n", "---|".repeat(header.len())));
        for r in &rows {
            out.push_str(&format!("| {} |\n", r.join(" | ")));
        }
        return out;
    }
    let width = |i: usize| {
        rows.iter()
            .map(|r| r[i].len())
            .chain([header[i].len()])
            .max()
            .unwrap_or(0)
    };
    let line = |cells: Vec<&str>| {
        let mut l = String::new();
        for (i, c) in cells.iter().enumerate() {
            if i == 0 {
                l.push_str(&format!("{c:<w$}", w = width(0)));
            } else {
                l.push_str(&format!(" {c:>w$}", w = width(i)));
            }
        }
        l.push('\n');
        l
    };
    out.push_str(&line(header.to_vec()));
    for r in &rows {
        out.push_str(&line(r.iter().map(String::as_str).collect()));
    }
    out
}
