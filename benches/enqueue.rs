//! What the outbox costs a write transaction.
//!
//! Four variants of one transaction, measured side by side in rounds on real files:
//!
//! - **a**: a business insert alone (`BEGIN IMMEDIATE`, `INSERT INTO orders`, `COMMIT`);
//! - **b**: the same insert plus [`Tx::publish`](edge_outbox::Tx::publish) of the order as an
//!   event, through [`Outbox::transaction`] (the crate's public API, nothing else);
//! - **d**: the same insert plus a hand-written rusqlite insert of a bare outbox row into a
//!   minimal table (integer key, 16 random id bytes, topic, key, the CBOR payload, time; no
//!   triggers, no constraints): what an application would write by hand, the floor. The
//!   headline is b/d;
//! - **c**: the same insert plus a hand-written rusqlite insert of the same row into the crate's
//!   own `outbox` table (its triggers and constraints included): b/c is the crate's code alone.
//!
//! at `synchronous = FULL` and `NORMAL`, with one row and with 100 rows (100 orders and 100
//! messages) per transaction. Each configuration gets a fresh file, opened by
//! [`Outbox::open_with`] so the pragmas (WAL, synchronous, auto-vacuum, WAL size limit) are the
//! crate's own, and all three variants run on that one connection (a and c through
//! [`Outbox::with_connection`]), as an application's business tables and outbox share one file.
//! One connection matters: the bundled SQLite is built with `SQLITE_ENABLE_MEMORY_MANAGEMENT`,
//! so all connections in a process share one page-cache LRU, and a variant on a second connection
//! evicts the pages of the others (measured: the business insert then misses the cache on every
//! statement).
//!
//! Noise on a shared machine hits all variants alike: a round gives each variant one time slice,
//! taken in turns of 25 ms (a, b, c, d, then b, c, d, a, ... through rotations and their reverses,
//! so each variant follows each other one equally often and inherits its share of pending WAL
//! checkpoints), and the table shows the median over rounds; a ratio is the median of the
//! per-round ratios, with its interquartile range. Still, with other work on the machine, run it
//! twice: a noisy run shows as a wide interquartile range.
//!
//! Message ids are minted with uuid's `fast-rng` (a userspace generator, the crate's own
//! setting); the header prints what minting an id costs in this build.
//!
//! Environment:
//! - `EDGE_OUTBOX_BENCH_SECS`: measuring budget for the whole run (default 120);
//! - `EDGE_OUTBOX_BENCH_ROUNDS`: rounds per configuration (default 18);
//! - `EDGE_OUTBOX_BENCH_CONFIGS`: comma-separated subset of `full_single,full_batch100,
//!   normal_single,normal_batch100` (default all);
//! - `EDGE_OUTBOX_BENCH_DIR`: where the temporary databases go (default the cargo target dir;
//!   it must be a real disk, not tmpfs, or FULL measures nothing).
//!
//! A section after the table measures where the crate's table costs over the bare one: copies
//! of its outbox table with one part taken out at a time (see `table_cost`). With feature
//! `schemas`, a last section measures what checking a payload schema costs a publish (see
//! `schema_cost`).
//!
//! The output ends with one `bench: NAME VALUE` line per figure.

mod common;
#[cfg(feature = "schemas")]
mod schema_cost;
mod table_cost;

use std::error::Error as StdError;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use common::{Rng, env_num, median, now_ms, quantile};

use edge_outbox::{MessageId, Options, Outbox, Synchronous};
use rusqlite::{Transaction, TransactionBehavior, params};
use serde::Serialize;

type BoxResult<T> = Result<T, Box<dyn StdError>>;

const TOPIC: &str = "orders/placed";

const BUSINESS_SCHEMA: &str = "CREATE TABLE orders (
    id          INTEGER PRIMARY KEY,
    order_id    TEXT    NOT NULL,
    customer    TEXT    NOT NULL,
    sku         TEXT    NOT NULL,
    quantity    INTEGER NOT NULL,
    total_cents INTEGER NOT NULL,
    placed_at   INTEGER NOT NULL
)";

const INSERT_ORDER: &str = "INSERT INTO orders (order_id, customer, sku, quantity, total_cents, placed_at)
     VALUES (?1, ?2, ?3, ?4, ?5, ?6)";

/// The columns the crate writes; the others keep their defaults (NULL event type and headers,
/// not evictable), as in the crate's row.
const INSERT_OUTBOX: &str =
    "INSERT INTO outbox (id, topic, key, payload, created_at) VALUES (?1, ?2, ?3, ?4, ?5)";

/// The bare outbox an application would write by hand: no triggers, no constraints.
const BARE_SCHEMA: &str = "CREATE TABLE bare_outbox (
    n          INTEGER PRIMARY KEY,
    id         BLOB    NOT NULL,
    topic      TEXT    NOT NULL,
    key        TEXT    NOT NULL,
    payload    BLOB    NOT NULL,
    created_at INTEGER NOT NULL
)";

const INSERT_BARE: &str =
    "INSERT INTO bare_outbox (id, topic, key, payload, created_at) VALUES (?1, ?2, ?3, ?4, ?5)";

/// The event: what a device would announce for the business row. About 100 bytes of CBOR.
#[derive(Serialize)]
struct OrderPlaced<'a> {
    order_id: &'a str,
    customer: &'a str,
    sku: &'a str,
    quantity: u32,
    total_cents: u64,
    currency: &'a str,
    placed_at_ms: i64,
}

const CUSTOMERS: [&str; 4] = ["cust-0017", "cust-0342", "cust-1288", "cust-9001"];
const SKUS: [&str; 3] = ["SKU-A100-RED", "SKU-B220-BLU", "SKU-C310-GRN"];

/// Makes the next order: every variant pays for this alike.
struct Orders {
    n: u64,
    order_id: String,
}

impl Orders {
    fn new() -> Self {
        Orders {
            n: 0,
            order_id: String::with_capacity(16),
        }
    }

    fn next(&mut self) -> OrderPlaced<'_> {
        use std::fmt::Write;
        self.n += 1;
        let n = self.n;
        self.order_id.clear();
        let _ = write!(self.order_id, "ord-{n:010}");
        OrderPlaced {
            order_id: &self.order_id,
            customer: CUSTOMERS[(n % 4) as usize],
            sku: SKUS[(n % 3) as usize],
            quantity: (n % 5 + 1) as u32,
            total_cents: 1250 + (n % 1000) * 7,
            currency: "EUR",
            placed_at_ms: now_ms(),
        }
    }
}

fn insert_order(tx: &Transaction<'_>, o: &OrderPlaced<'_>) -> rusqlite::Result<()> {
    tx.prepare_cached(INSERT_ORDER)?.execute(params![
        o.order_id,
        o.customer,
        o.sku,
        o.quantity,
        o.total_cents as i64,
        o.placed_at_ms
    ])?;
    Ok(())
}

impl Rng {
    /// 16 random-looking bytes: the cheapest id, for the floor.
    fn id(&mut self) -> [u8; 16] {
        let mut id = [0; 16];
        id[..8].copy_from_slice(&self.next_u64().to_le_bytes());
        id[8..].copy_from_slice(&self.next_u64().to_le_bytes());
        id
    }
}

#[derive(Clone, Copy, PartialEq, Eq)]
enum Variant {
    A,
    B,
    C,
    D,
}

const VARIANTS: [Variant; 4] = [Variant::A, Variant::B, Variant::C, Variant::D];

/// One configuration's store: one file, one connection, shared by the variants as an
/// application's business tables and outbox share them.
struct Store {
    outbox: Outbox,
    orders: Orders,
    rng: Rng,
    buf: Vec<u8>,
    /// Transactions committed by each variant, to check what the file holds at the end.
    committed: [u64; 4],
}

impl Store {
    fn new(path: &Path, sync: Synchronous) -> BoxResult<Self> {
        let outbox = Outbox::open_with(path, Options::new().synchronous(sync))?;
        outbox.with_connection(|c| c.execute_batch(&format!("{BUSINESS_SCHEMA}; {BARE_SCHEMA}")))?;
        let seed = SystemTime::now().duration_since(UNIX_EPOCH)?.as_nanos() as u64;
        Ok(Store {
            outbox,
            orders: Orders::new(),
            rng: Rng(seed),
            buf: Vec::with_capacity(256),
            committed: [0; 4],
        })
    }

    /// One transaction of `rows` orders (and `rows` messages for b, c and d).
    fn transaction(&mut self, variant: Variant, rows: usize) -> BoxResult<()> {
        let Store {
            outbox,
            orders,
            rng,
            buf,
            committed,
        } = self;
        match variant {
            Variant::A => outbox.with_connection(|conn| {
                let tx = Transaction::new_unchecked(conn, TransactionBehavior::Immediate)?;
                for _ in 0..rows {
                    insert_order(&tx, &orders.next())?;
                }
                tx.commit()
            })?,
            Variant::B => {
                outbox.transaction(|tx| {
                    for _ in 0..rows {
                        let o = orders.next();
                        insert_order(tx, &o)?;
                        tx.publish(TOPIC, o.order_id, &o)?;
                    }
                    Ok::<_, edge_outbox::Error>(())
                })?;
            }
            // By hand: into the crate's own table (C) or a bare minimal one (D, the floor).
            Variant::C | Variant::D => outbox.with_connection(|conn| -> BoxResult<()> {
                let insert = if matches!(variant, Variant::C) {
                    INSERT_OUTBOX
                } else {
                    INSERT_BARE
                };
                let tx = Transaction::new_unchecked(conn, TransactionBehavior::Immediate)?;
                for _ in 0..rows {
                    let o = orders.next();
                    insert_order(&tx, &o)?;
                    buf.clear();
                    ciborium::into_writer(&o, &mut *buf)?;
                    tx.prepare_cached(insert)?.execute(params![
                        rng.id(),
                        TOPIC,
                        o.order_id,
                        &buf[..],
                        now_ms()
                    ])?;
                }
                tx.commit()?;
                Ok(())
            })?,
        }
        committed[variant as usize] += 1;
        Ok(())
    }

    /// Runs `variant` for `slice` (at least one transaction); returns the transactions and the
    /// time they took.
    fn run(&mut self, variant: Variant, rows: usize, slice: Duration) -> BoxResult<(u64, Duration)> {
        let start = Instant::now();
        let mut n = 0u64;
        loop {
            self.transaction(variant, rows)?;
            n += 1;
            let elapsed = start.elapsed();
            if elapsed >= slice {
                return Ok((n, elapsed));
            }
        }
    }

    /// Checks that the file holds exactly what the variants claim to have committed.
    fn check(&self, rows: usize) -> BoxResult<()> {
        let (orders, outbox, bare): (u64, u64, u64) =
            self.outbox.with_connection(|c| -> rusqlite::Result<_> {
                Ok((
                    c.query_row("SELECT count(*) FROM orders", [], |r| r.get(0))?,
                    c.query_row("SELECT count(*) FROM outbox", [], |r| r.get(0))?,
                    c.query_row("SELECT count(*) FROM bare_outbox", [], |r| r.get(0))?,
                ))
            })?;
        let [a, b, c, d] = self.committed.map(|n| n * rows as u64);
        if orders != a + b + c + d || outbox != b + c || bare != d {
            return Err(format!(
                "the file holds {orders} orders, {outbox} messages and {bare} bare rows; expected {}, {} and {d}",
                a + b + c + d,
                b + c
            )
            .into());
        }
        Ok(())
    }
}

struct Config {
    name: &'static str,
    label: &'static str,
    sync: Synchronous,
    rows: usize,
}

const CONFIGS: [Config; 4] = [
    Config {
        name: "full_single",
        label: "FULL    1 row",
        sync: Synchronous::Full,
        rows: 1,
    },
    Config {
        name: "full_batch100",
        label: "FULL    100 rows",
        sync: Synchronous::Full,
        rows: 100,
    },
    Config {
        name: "normal_single",
        label: "NORMAL  1 row",
        sync: Synchronous::Normal,
        rows: 1,
    },
    Config {
        name: "normal_batch100",
        label: "NORMAL  100 rows",
        sync: Synchronous::Normal,
        rows: 100,
    },
];

/// How long a variant runs before the next one takes over, within a round.
const TURN: Duration = Duration::from_millis(25);

/// The order of the variants in successive turns: every rotation and its reverse, so each
/// variant goes first, last, and after each of the others equally often (what a slice leaves
/// behind, such as WAL frames awaiting a checkpoint or pages the kernel is still writing back,
/// falls on every variant alike).
const ORDERS: [[usize; 4]; 8] = [
    [0, 1, 2, 3],
    [1, 2, 3, 0],
    [2, 3, 0, 1],
    [3, 0, 1, 2],
    [3, 2, 1, 0],
    [0, 3, 2, 1],
    [1, 0, 3, 2],
    [2, 1, 0, 3],
];

/// The results of one configuration.
struct Outcome {
    config: &'static Config,
    /// Median transactions per second of a, b, c and d.
    tps: [f64; 4],
    /// Median, 25th and 75th percentile of the per-round ratios b/d, b/c, b/a, d/a and c/a.
    ratios: [[f64; 3]; 5],
    /// [`fsync_latency`] before and after.
    fsync_ms: [f64; 2],
}

fn measure(config: &'static Config, base: &Path, rounds: usize, slice: Duration) -> BoxResult<Outcome> {
    let dir = tempfile::Builder::new().prefix("enqueue-").tempdir_in(base)?;
    let fsync_before = fsync_latency(dir.path())?;
    let mut store = Store::new(&dir.path().join("device.db"), config.sync)?;
    // Warm up: statement caches, page cache, the first WAL checkpoints.
    for v in VARIANTS {
        store.run(v, config.rows, slice / 2)?;
    }
    // A round gives each variant `slice` in turns of `TURN`, so a burst of load from elsewhere
    // falls on all of them rather than on one variant's whole slice.
    let turns = (slice.as_secs_f64() / TURN.as_secs_f64()).round().max(1.0) as usize;
    let turn = slice / turns as u32;
    let mut per_round: Vec<[f64; 4]> = Vec::with_capacity(rounds);
    for round in 0..rounds {
        let mut done = [(0u64, Duration::ZERO); 4];
        for t in 0..turns {
            for i in ORDERS[(round * turns + t) % ORDERS.len()] {
                let (n, took) = store.run(VARIANTS[i], config.rows, turn)?;
                done[i].0 += n;
                done[i].1 += took;
            }
        }
        per_round.push(done.map(|(n, took)| n as f64 / took.as_secs_f64()));
    }
    store.check(config.rows)?;
    let column = |f: &dyn Fn(&[f64; 4]) -> f64| -> Vec<f64> { per_round.iter().map(f).collect() };
    let tps = [0, 1, 2, 3].map(|i| median(&column(&|t| t[i])));
    let ratio_of = |num: usize, den: usize| {
        let v = column(&|t| t[num] / t[den]);
        [median(&v), quantile(&v, 0.25), quantile(&v, 0.75)]
    };
    Ok(Outcome {
        config,
        tps,
        ratios: [
            ratio_of(1, 3),
            ratio_of(1, 2),
            ratio_of(1, 0),
            ratio_of(3, 0),
            ratio_of(2, 0),
        ],
        fsync_ms: [fsync_before, fsync_latency(dir.path())?],
    })
}

/// The file system type holding `dir`, from /proc/self/mounts (Linux; "unknown" elsewhere).
fn fs_type(dir: &Path) -> String {
    let Ok(mounts) = std::fs::read_to_string("/proc/self/mounts") else {
        return "unknown".into();
    };
    let dir = dir.canonicalize().unwrap_or_else(|_| dir.to_path_buf());
    mounts
        .lines()
        .filter_map(|line| {
            let mut fields = line.split_whitespace();
            let _device = fields.next()?;
            let mount = PathBuf::from(fields.next()?.replace("\\040", " "));
            let fs = fields.next()?;
            dir.starts_with(&mount).then(|| (mount, fs.to_owned()))
        })
        .max_by_key(|(mount, _)| mount.components().count())
        .map_or_else(|| "unknown".into(), |(_, fs)| fs)
}

/// Median of a 4 KiB write plus `fdatasync` in `dir`, in milliseconds: what every commit at FULL
/// waits for, so the FULL ratios can be read against it (on a VM it can change by 20x from one
/// minute to the next).
fn fsync_latency(dir: &Path) -> BoxResult<f64> {
    use std::io::{Seek, SeekFrom, Write};
    let mut file = tempfile::tempfile_in(dir)?;
    let page = [0x5a_u8; 4096];
    let mut took = Vec::with_capacity(64);
    for i in 0..64u64 {
        file.seek(SeekFrom::Start((i % 16) * 4096))?;
        file.write_all(&page)?;
        let start = Instant::now();
        file.sync_data()?;
        took.push(start.elapsed().as_secs_f64() * 1e3);
    }
    Ok(median(&took))
}

/// What minting one message id costs here, in nanoseconds (best of five batches).
fn id_cost_ns() -> f64 {
    const N: u32 = 20_000;
    (0..5)
        .map(|_| {
            let start = Instant::now();
            for _ in 0..N {
                std::hint::black_box(MessageId::new_v7());
            }
            start.elapsed().as_secs_f64() * 1e9 / f64::from(N)
        })
        .fold(f64::INFINITY, f64::min)
}

fn payload_size() -> BoxResult<usize> {
    let mut orders = Orders::new();
    let mut buf = Vec::new();
    ciborium::into_writer(&orders.next(), &mut buf)?;
    Ok(buf.len())
}

fn main() -> BoxResult<()> {
    let secs = env_num("EDGE_OUTBOX_BENCH_SECS", 120.0)?;
    let rounds = env_num("EDGE_OUTBOX_BENCH_ROUNDS", 18.0)?.round().max(1.0) as usize;
    let selected: Vec<&'static Config> = match std::env::var("EDGE_OUTBOX_BENCH_CONFIGS") {
        Ok(list) => {
            let names: Vec<&str> = list.split(',').map(str::trim).filter(|s| !s.is_empty()).collect();
            if let Some(bad) = names.iter().find(|n| !CONFIGS.iter().any(|c| c.name == **n)) {
                return Err(format!("EDGE_OUTBOX_BENCH_CONFIGS: unknown configuration {bad:?}").into());
            }
            CONFIGS.iter().filter(|c| names.contains(&c.name)).collect()
        }
        Err(_) => CONFIGS.iter().collect(),
    };
    let base = common::bench_dir()?;
    let fs = fs_type(&base);
    // Per configuration: a warm-up of half a slice per variant, then `rounds` slices of each.
    let slice = Duration::from_secs_f64(secs / selected.len().max(1) as f64 / (4.0 * (rounds as f64 + 0.5)));

    println!("edge-outbox enqueue benchmark");
    println!("  a = business insert alone (rusqlite, BEGIN IMMEDIATE)");
    println!("  b = a + tx.publish(topic, key, &value) through Outbox::transaction");
    println!("  d = a + hand-written insert of a bare outbox row in a minimal table (the floor)");
    println!("  c = a + hand-written insert of the same row in the crate's outbox table (triggers included)");
    println!(
        "  payload {} bytes of CBOR; {rounds} rounds of {:.2} s per variant in 25 ms turns; medians",
        payload_size()?,
        slice.as_secs_f64()
    );
    println!(
        "  MessageId::new_v7 costs {:.0} ns here (uuid's fast-rng feature, if on, saves a getrandom syscall)",
        id_cost_ns()
    );
    println!("  databases in {} ({fs})", base.display());
    println!("  fsync ms: median 4 KiB write + fdatasync there, probed before and after each configuration");
    if matches!(fs.as_str(), "tmpfs" | "ramfs") {
        println!("  WARNING: {fs} is memory, not disk: FULL figures mean nothing; set EDGE_OUTBOX_BENCH_DIR");
    }
    println!();

    let started = Instant::now();
    let mut outcomes = Vec::new();
    for config in selected {
        outcomes.push(measure(config, &base, rounds, slice)?);
    }

    println!(
        "{:<17} {:>9} {:>9} {:>9} {:>9}   {:<18} {:<18} {:<18} {:<18} {:>11}",
        "configuration",
        "a tx/s",
        "b tx/s",
        "d tx/s",
        "c tx/s",
        "b/d [p25-p75]",
        "b/c [p25-p75]",
        "b/a [p25-p75]",
        "d/a [p25-p75]",
        "fsync ms"
    );
    for o in &outcomes {
        let r = |i: usize| {
            format!(
                "{:.3} [{:.2}-{:.2}]",
                o.ratios[i][0], o.ratios[i][1], o.ratios[i][2]
            )
        };
        println!(
            "{:<17} {:>9.0} {:>9.0} {:>9.0} {:>9.0}   {:<18} {:<18} {:<18} {:<18} {:>11}",
            o.config.label,
            o.tps[0],
            o.tps[1],
            o.tps[3],
            o.tps[2],
            r(0),
            r(1),
            r(2),
            r(3),
            format!("{:.2}/{:.2}", o.fsync_ms[0], o.fsync_ms[1])
        );
    }
    println!();
    println!("target: b/d >= 0.95 everywhere (the crate against a bare row written by hand)");
    for o in &outcomes {
        let bd = o.ratios[0][0];
        println!(
            "  {:<17} b/d {bd:.3}  {}",
            o.config.label,
            if bd >= 0.95 { "met" } else { "MISSED" }
        );
    }
    let table = table_cost::measure(&base, (secs / 10.0).max(0.5))?;
    println!();
    println!(
        "where the crate's table costs (NORMAL; copies of its outbox table, one part taken out; tx/s over d)"
    );
    println!("  {:<30} {:>8} {:>8}", "table", "1 row", "100 rows");
    for (_, label, r) in &table {
        println!("  {label:<30} {:>8.3} {:>8.3}", r[0], r[1]);
    }
    #[cfg(feature = "schemas")]
    let schema = schema_cost::measure(&base, (secs / 10.0).max(0.5))?;
    #[cfg(feature = "schemas")]
    println!(
        "payload schema: checked/plain publishes per second {:.3} (NORMAL, 100 per tx); the check alone {:.0} ns per message",
        schema.0, schema.1
    );
    println!("measured in {:.0} s", started.elapsed().as_secs_f64());
    println!();
    for o in &outcomes {
        let name = o.config.name;
        for (i, v) in ["a", "b", "c", "d"].iter().enumerate() {
            println!("bench: enqueue_{name}_{v}_tx_per_s {:.0}", o.tps[i]);
        }
        for (i, v) in ["b_over_d", "b_over_c", "b_over_a", "d_over_a", "c_over_a"]
            .iter()
            .enumerate()
        {
            println!("bench: enqueue_{name}_{v} {:.3}", o.ratios[i][0]);
        }
    }
    for (name, _, r) in &table {
        println!("bench: enqueue_table_cost_{name}_single_over_d {:.3}", r[0]);
        println!("bench: enqueue_table_cost_{name}_batch100_over_d {:.3}", r[1]);
    }
    #[cfg(feature = "schemas")]
    {
        println!("bench: enqueue_schema_checked_over_plain {:.3}", schema.0);
        println!("bench: schema_check_ns_per_message {:.0}", schema.1);
    }
    Ok(())
}
