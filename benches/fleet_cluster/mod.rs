//! The fleet on a 3-node RabbitMQ cluster (`tests/support/rabbit.rs`): N devices, each its own
//! database and relay with a failover list of the three nodes (MQTT 3.1.1, the devices spread over
//! them), publish under `fleet/s<k>/<device>/events`; one `examples/cloud_consumer.rs` process per
//! shard `k` (its own file and persistent session, connected first to node 1, so node 1 holds the
//! consumers' queues) reads them. Mid-run node 1 is killed with SIGKILL and started again 10 s
//! later; two consumer processes are killed and restarted. After the run every device sends a
//! last round, so that a loss shows as a gap.
//!
//! The quorum run's lines are `bench: fleet_cluster_<name>`, the classic run's
//! `bench: fleet_cluster_classic_<name>`: `devices`, `committed`, `delivered` (messages the
//! consumers called new), `msgs_per_s` (delivered over the time from the first commit to the last
//! arrival), `lag_p50_ms`/`lag_p99_ms` (commit to arrival), `failover_p50_s`/`failover_max_s`
//! (from the kill until each relay that was on node 1 is connected to another node; every time is
//! also printed), `duplicates`, `broker_lost` (the bench's own count), `unexplained_gaps` and
//! `lost_at_tail` (what the consumers can see of it).
//!
//! The bench's own count of what the broker lost: what each relay had acknowledged minus the rows
//! its shard's consumer stored for it. With quorum queues it must be 0 and so must the unexplained
//! gaps; with classic queues the consumers' unexplained gaps (plus anything lost after a device's
//! last arrival) must equal it. Prints `bench: fleet_cluster_<queues>_...` lines.

use std::collections::BTreeMap;
use std::path::Path;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::thread;
use std::time::{Duration, Instant};

use crate::common::{median, quantile};
use crate::support::example::{CloudConsumer, totals};
use crate::support::rabbit::{Queues, RabbitCluster};
use crate::{BenchResult, WRITERS, wait};
use edge_outbox::{MqttConfig, Outbox, Protocol, Relay, RelayConfig};

/// Consumer processes, one shard of the fleet each.
const SHARDS: usize = 4;

/// How long node 1 stays down.
const OUTAGE: Duration = Duration::from_secs(10);

struct Device {
    name: String,
    topic: String,
    outbox: Outbox,
    relay: Relay,
}

/// Settings of one run.
pub struct Run {
    pub devices: usize,
    pub seconds: f64,
    pub rate: f64,
    pub queues: Queues,
}

/// Starts shard `shard`'s consumer; `wait`: until it has subscribed (not while its queue's node
/// is down).
fn start_consumer(
    cluster: &RabbitCluster,
    dir: &Path,
    shard: usize,
    wait: bool,
) -> BenchResult<CloudConsumer> {
    // Node 1 first: the consumers' sessions (their queues) are declared there.
    let brokers: Vec<String> = cluster.mqtt_addrs().iter().map(|a| a.to_string()).collect();
    let db = dir.join(format!("cloud-s{shard}.db"));
    let start = if wait {
        CloudConsumer::start
    } else {
        CloudConsumer::spawn
    };
    start(&[
        &brokers.join(","),
        db.to_str().ok_or("path")?,
        &format!("fleet/s{shard}/#"),
        "--client-id",
        &format!("cloud-s{shard}"),
        "--from-start",
        "--exit-when-idle",
        "8",
        "--report-every",
        "3600",
    ])
    .map_err(|e| e.to_string().into())
}

/// Per source: rows stored, and their lags (arrival minus commit, ms).
fn stored(db: &Path) -> BenchResult<BTreeMap<String, (u64, Vec<f64>)>> {
    let conn = rusqlite::Connection::open(db)?;
    let mut stmt = conn.prepare("SELECT source, received_ms - created_ms FROM events")?;
    let mut out: BTreeMap<String, (u64, Vec<f64>)> = BTreeMap::new();
    for row in stmt.query_map([], |r| Ok((r.get::<_, String>(0)?, r.get::<_, i64>(1)?)))? {
        let (source, lag) = row?;
        let entry = out.entry(source).or_default();
        entry.0 += 1;
        entry.1.push(lag.max(0) as f64);
    }
    Ok(out)
}

pub fn run(settings: &Run, dir: &Path) -> BenchResult {
    let label = match settings.queues {
        Queues::Quorum => "quorum",
        Queues::Classic => "classic",
    };
    // The consumer processes: `cargo bench` builds no example.
    let cargo = std::env::var_os("CARGO").unwrap_or_else(|| "cargo".into());
    let built = std::process::Command::new(cargo)
        .args(["build", "--release", "--example", "cloud_consumer"])
        .status()?;
    if !built.success() {
        return Err("building examples/cloud_consumer.rs failed".into());
    }
    let booting = Instant::now();
    let mut cluster = RabbitCluster::start(settings.queues).map_err(|e| e.to_string())?;
    println!(
        "fleet cluster ({label} queues): 3 RabbitMQ nodes up in {:.1} s; {} devices, {} msg/s each for {} s, {SHARDS} consumer processes",
        booting.elapsed().as_secs_f64(),
        settings.devices,
        settings.rate,
        settings.seconds
    );
    let dir = tempfile::Builder::new()
        .prefix(&format!("cluster-{label}-"))
        .tempdir_in(dir)?;
    let mut consumers: Vec<Option<CloudConsumer>> = (0..SHARDS)
        .map(|k| start_consumer(&cluster, dir.path(), k, true).map(Some))
        .collect::<BenchResult<_>>()?;

    let nodes = cluster.mqtt_addrs();
    let mut devices = Vec::with_capacity(settings.devices);
    for i in 0..settings.devices {
        let name = format!("dev-{i:03}");
        let first = nodes[i % 3];
        let mut mqtt = MqttConfig::new(first.ip().to_string(), first.port())
            .client_id(&name)
            .protocol(Protocol::V311)
            .keep_alive(Duration::from_secs(5))
            .connect_timeout(Duration::from_secs(2));
        for other in (1..3).map(|k| nodes[(i + k) % 3]) {
            mqtt = mqtt.failover(other.ip().to_string(), other.port());
        }
        let config =
            RelayConfig::new(mqtt).reconnect_backoff(Duration::from_millis(50), Duration::from_millis(1000));
        let outbox = Outbox::open(dir.path().join(format!("{name}.db")))?;
        let relay = Relay::start(&outbox, config)?;
        devices.push(Device {
            topic: format!("fleet/s{}/{name}/events", i % SHARDS),
            name,
            outbox,
            relay,
        });
    }
    let devices = Arc::new(devices);
    let node1 = nodes[0].to_string();

    let started = Instant::now();
    let writing = Arc::new(AtomicBool::new(true));
    let committed = Arc::new(AtomicU64::new(0));
    let writers: Vec<_> = (0..WRITERS)
        .map(|w| {
            let (devices, writing, committed) =
                (Arc::clone(&devices), Arc::clone(&writing), Arc::clone(&committed));
            let rate = settings.rate;
            thread::spawn(move || -> BenchResult {
                let tick = Duration::from_secs_f64(1.0 / rate);
                let mut next = Instant::now();
                while writing.load(Ordering::SeqCst) {
                    for d in devices.iter().skip(w).step_by(WRITERS) {
                        d.outbox
                            .transaction(|tx| tx.publish(&d.topic, &d.name, &0u8).map(|_| ()))?;
                        committed.fetch_add(1, Ordering::SeqCst);
                    }
                    next += tick;
                    if let Some(rest) = next.checked_duration_since(Instant::now()) {
                        thread::sleep(rest);
                    }
                }
                Ok(())
            })
        })
        .collect();

    // Mid-run: node 1, the consumers' queues' node, dies; the relays on it fail over.
    thread::sleep(Duration::from_secs_f64(settings.seconds * 0.3));
    let on_node1: Vec<usize> = devices
        .iter()
        .enumerate()
        .filter(|(_, d)| {
            d.relay
                .status()
                .is_ok_and(|s| s.broker.as_deref() == Some(node1.as_str()))
        })
        .map(|(i, _)| i)
        .collect();
    cluster.kill(0)?;
    let killed = Instant::now();
    let mut failover: BTreeMap<usize, Duration> = BTreeMap::new();
    let mut restarted = false;
    while killed.elapsed() < OUTAGE {
        for &i in &on_node1 {
            if failover.contains_key(&i) {
                continue;
            }
            if devices[i]
                .relay
                .status()
                .is_ok_and(|s| s.connected && s.broker.as_deref().is_some_and(|b| b != node1))
            {
                failover.insert(i, killed.elapsed());
            }
        }
        // Two consumers killed and restarted while the node is down.
        if !restarted && killed.elapsed() > OUTAGE / 2 {
            for k in [1, 3] {
                if let Some(c) = consumers[k].take() {
                    c.kill();
                }
            }
            thread::sleep(Duration::from_millis(500));
            for k in [1, 3] {
                consumers[k] = Some(start_consumer(&cluster, dir.path(), k, false)?);
            }
            restarted = true;
        }
        thread::sleep(Duration::from_millis(20));
    }
    let back = Instant::now();
    cluster.restart(0)?;
    println!(
        "fleet cluster ({label}): node 1 killed at {:.1} s with {} relays on it, started again after {:.1} s (up in {:.1} s); consumers 1 and 3 killed and restarted meanwhile",
        (killed - started).as_secs_f64(),
        on_node1.len(),
        OUTAGE.as_secs_f64(),
        back.elapsed().as_secs_f64()
    );
    let rest = Duration::from_secs_f64(settings.seconds).saturating_sub(started.elapsed());
    thread::sleep(rest);
    writing.store(false, Ordering::SeqCst);
    for w in writers {
        w.join().map_err(|_| "a writer panicked")??;
    }
    // A last round once everything is back, so that a loss before it shows as a gap.
    thread::sleep(Duration::from_secs(3));
    for d in devices.iter() {
        d.outbox
            .transaction(|tx| tx.publish(&d.topic, &d.name, &1u8).map(|_| ()))?;
        committed.fetch_add(1, Ordering::SeqCst);
    }
    let drained = wait(Duration::from_secs(300), || {
        devices
            .iter()
            .all(|d| d.outbox.stats().is_ok_and(|s| s.pending_messages == 0))
    });
    if !drained {
        println!("fleet cluster ({label}): the devices did not drain in 300 s");
    }
    let mut acknowledged: BTreeMap<String, (usize, u64)> = BTreeMap::new();
    let devices = Arc::try_unwrap(devices).map_err(|_| "devices still shared")?;
    for (i, d) in devices.into_iter().enumerate() {
        let status = d.relay.status()?;
        d.relay.shutdown()?;
        acknowledged.insert(d.name, (i % SHARDS, status.acknowledged));
    }

    let (mut delivered, mut duplicates, mut unexplained) = (0, 0, 0);
    let mut broker_lost = 0u64;
    let mut tail = 0u64;
    let mut lags = Vec::new();
    let mut last_arrival = 0.0f64;
    for (k, consumer) in consumers.into_iter().enumerate() {
        let consumer = consumer.ok_or("consumer")?;
        let (_status, said) = consumer
            .wait(Duration::from_secs(600))
            .map_err(|e| e.to_string())?;
        let (d, dup, _announced, u) = totals(&said).map_err(|e| e.to_string())?;
        (delivered, duplicates, unexplained) = (delivered + d, duplicates + dup, unexplained + u);
        let db = dir.path().join(format!("cloud-s{k}.db"));
        let rows = stored(&db)?;
        let conn = rusqlite::Connection::open(&db)?;
        let high: BTreeMap<String, u64> = conn
            .prepare("SELECT source, max(seq) FROM events GROUP BY source")?
            .query_map([], |r| Ok((r.get::<_, String>(0)?, r.get::<_, i64>(1)?)))?
            .map(|r| r.map(|(s, h)| (s, h.max(0) as u64)))
            .collect::<Result<_, _>>()?;
        for (name, (shard, acked)) in &acknowledged {
            if *shard != k {
                continue;
            }
            let (count, device_lags) = rows.get(name).cloned().unwrap_or_default();
            broker_lost += acked.saturating_sub(count);
            tail += acked.saturating_sub(high.get(name).copied().unwrap_or(0));
            lags.extend(device_lags);
        }
        let last: Option<i64> = conn.query_row("SELECT max(received_ms) FROM events", [], |r| r.get(0))?;
        last_arrival = last_arrival.max(last.unwrap_or(0) as f64);
    }
    let first_commit = crate::common::now_ms() as f64 - started.elapsed().as_secs_f64() * 1000.0;
    let secs = ((last_arrival - first_commit) / 1000.0).max(f64::MIN_POSITIVE);
    let mut failover_s: Vec<f64> = failover.values().map(Duration::as_secs_f64).collect();
    failover_s.sort_by(f64::total_cmp);
    println!(
        "fleet cluster ({label}): failover times of the {} relays on node 1 (s): {:?}{}",
        on_node1.len(),
        failover_s
            .iter()
            .map(|s| (s * 100.0).round() / 100.0)
            .collect::<Vec<_>>(),
        if failover.len() < on_node1.len() {
            format!(
                " ({} did not move within the outage)",
                on_node1.len() - failover.len()
            )
        } else {
            String::new()
        }
    );
    if unexplained + tail != broker_lost {
        println!(
            "fleet cluster ({label}): MISMATCH: the broker lost {broker_lost}, the consumers report {unexplained} unexplained + {tail} at the tail"
        );
    }
    // The quorum run's lines carry the plain names (`fleet_cluster_unexplained_gaps`).
    let prefix = match settings.queues {
        Queues::Quorum => "fleet_cluster",
        Queues::Classic => "fleet_cluster_classic",
    };
    let p = |name: &str, value: String| println!("bench: {prefix}_{name} {value}");
    p("devices", settings.devices.to_string());
    p("committed", committed.load(Ordering::SeqCst).to_string());
    p("delivered", delivered.to_string());
    p("msgs_per_s", format!("{:.0}", delivered as f64 / secs));
    if !lags.is_empty() {
        p("lag_p50_ms", format!("{:.0}", median(&lags)));
        p("lag_p99_ms", format!("{:.0}", quantile(&lags, 0.99)));
    }
    if !failover_s.is_empty() {
        p("failover_p50_s", format!("{:.2}", median(&failover_s)));
        p(
            "failover_max_s",
            format!("{:.2}", failover_s[failover_s.len() - 1]),
        );
    }
    p("duplicates", duplicates.to_string());
    p("broker_lost", broker_lost.to_string());
    p("unexplained_gaps", unexplained.to_string());
    p("lost_at_tail", tail.to_string());
    Ok(())
}
