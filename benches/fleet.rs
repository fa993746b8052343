//! A fleet of devices against one broker, watched from the cloud by the consumer module.
//!
//! N devices (default 200), each its own database file, `Outbox` and `Relay` in this process,
//! commit messages at a steady rate (default 2 per second each, for 40 s) on `fleet/<device>/...`.
//! One cloud subscriber (`edge_outbox::subscribe`, persistent session) feeds every delivery to an
//! `edge_outbox::consumer::Consumer`. Mid-run the broker is killed (SIGKILL) and restarted on the
//! same port; the relays and the subscriber reconnect on their own. At the end every device's
//! committed count is compared with what the consumer accounted for.
//!
//! Broker: mosquitto (persistence on, autosave every second, queue limits raised: the test
//! harness's configuration), a single node. Then the same fleet on a 3-node RabbitMQ cluster
//! losing a node, once with quorum queues and once with classic ones, read by sharded consumer
//! processes that are killed and restarted (`fleet_cluster/mod.rs`, which lists its lines); where
//! RabbitMQ is not installed it says so and runs only the single node.
//!
//! Prints, one `bench: NAME VALUE` line each: `fleet_broker`, `fleet_devices`, `fleet_committed`,
//! `fleet_msgs_per_s` (distinct messages delivered per second of the run, from the first commit
//! to the last delivery), `fleet_lag_p50_ms` / `fleet_lag_p99_ms` (commit-side `ts` to arrival
//! at the consumer, over all messages; the same machine's clock on both sides) and
//! `fleet_lag_p99_worst_device_ms`, `fleet_duplicates`, `fleet_announced_gaps`,
//! `fleet_unexplained_gaps` (numbers missing between numbers that arrived), `fleet_lost_at_tail`
//! (missing after a device's last arrival: no later message shows them), `fleet_lost` (committed
//! minus delivered minus announced; equals the two before when the consumer saw everything), and
//! `fleet_rss_per_device_kib` (growth of this process's peak RSS from before the devices started,
//! divided by N: the devices share one process, so this is an average).
//!
//! Environment: `EDGE_OUTBOX_FLEET_DEVICES` (200), `EDGE_OUTBOX_FLEET_SECONDS` (40),
//! `EDGE_OUTBOX_FLEET_RATE` (messages per second per device, 2), `EDGE_OUTBOX_FLEET_RUNS` (which
//! runs, default `mosquitto,quorum,classic`), `EDGE_OUTBOX_BENCH_DIR` (where the databases go;
//! default the cargo target tmp dir).

mod common;
mod fleet_cluster;
#[path = "../tests/support/mod.rs"]
mod support;

use std::collections::HashMap;
use std::error::Error as StdError;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::thread;
use std::time::{Duration, Instant};

use common::{env_num, median, now_ms, quantile};
use edge_outbox::consumer::Consumer;
use edge_outbox::{MqttConfig, Outbox, Published, Relay};
use support::device::relay_config;
use support::{Broker, BrokerKind};

type BenchResult<T = ()> = Result<T, Box<dyn StdError + Send + Sync>>;

/// Writer threads: each commits for its share of the devices.
const WRITERS: usize = 4;

/// Where a device outside the fleet publishes until the subscriber is seen to receive: its
/// messages are not fed to the consumer.
const PROBE_TOPIC: &str = "fleet/probe";

/// What the cloud side has seen.
#[derive(Default)]
struct Cloud {
    consumer: Consumer,
    /// Per source: arrival wall time minus `ts`, in ms.
    lags: HashMap<String, Vec<f64>>,
    received: u64,
    /// A probe arrived: the subscription is in place.
    probed: bool,
    last_arrival: Option<Instant>,
    malformed: u64,
}

struct Device {
    name: String,
    outbox: Outbox,
    relay: Option<Relay>,
    committed: AtomicU64,
}

fn peak_rss_kib() -> u64 {
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with("VmHWM:"))
                .and_then(|l| l.split_whitespace().nth(1)?.parse().ok())
        })
        .unwrap_or(0)
}

fn bench_dir() -> BenchResult<tempfile::TempDir> {
    let base = std::env::var_os("EDGE_OUTBOX_BENCH_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from(env!("CARGO_TARGET_TMPDIR")));
    std::fs::create_dir_all(&base)?;
    Ok(tempfile::Builder::new().prefix("fleet-").tempdir_in(base)?)
}

/// Waits until `done` holds or `limit` passes; says which.
fn wait(limit: Duration, mut done: impl FnMut() -> bool) -> bool {
    let end = Instant::now() + limit;
    while Instant::now() < end {
        if done() {
            return true;
        }
        thread::sleep(Duration::from_millis(50));
    }
    done()
}

fn main() -> BenchResult {
    let devices_n = env_num("EDGE_OUTBOX_FLEET_DEVICES", 200.0)? as usize;
    let seconds = env_num("EDGE_OUTBOX_FLEET_SECONDS", 40.0)?;
    let rate = env_num("EDGE_OUTBOX_FLEET_RATE", 2.0)?;
    let runs = std::env::var("EDGE_OUTBOX_FLEET_RUNS").unwrap_or_else(|_| "mosquitto,quorum,classic".into());
    let runs: Vec<&str> = runs.split(',').map(str::trim).collect();
    if runs.contains(&"mosquitto") {
        single_broker(devices_n, seconds, rate)?;
    }
    for (name, queues) in [
        ("quorum", support::rabbit::Queues::Quorum),
        ("classic", support::rabbit::Queues::Classic),
    ] {
        if !runs.contains(&name) {
            continue;
        }
        if let Some(why) = support::rabbit::unavailable() {
            println!("fleet cluster ({name} queues): not run: {why}");
            continue;
        }
        let settings = fleet_cluster::Run {
            devices: devices_n,
            seconds,
            rate,
            queues,
        };
        fleet_cluster::run(&settings, bench_dir()?.path())?;
    }
    Ok(())
}

/// The fleet against one mosquitto, killed and restarted mid-run.
fn single_broker(devices_n: usize, seconds: f64, rate: f64) -> BenchResult {
    let mut broker = Broker::builder()
        .kind(BrokerKind::Mosquitto)
        .persistence(true)
        .start()?;
    println!(
        "fleet: {devices_n} devices, {rate} msg/s each for {seconds} s, against one mosquitto on {}",
        broker.addr()
    );
    let dir = bench_dir()?;

    // The cloud: one persistent subscriber, the consumer module behind it.
    let cloud = Arc::new(Mutex::new(Cloud {
        consumer: Consumer::new().from_start(true),
        ..Cloud::default()
    }));
    let (stop_tx, stop_rx) = crossbeam_channel::bounded::<()>(0);
    let subscriber = {
        let cloud = Arc::clone(&cloud);
        let addr = broker.addr();
        thread::spawn(move || {
            let mqtt = MqttConfig::new(addr.ip().to_string(), addr.port()).client_id("fleet-cloud");
            edge_outbox::subscribe(&mqtt, &["fleet/#".into()], true, &stop_rx, |topic, payload| {
                let arrived = now_ms();
                let mut c = cloud.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
                if topic == PROBE_TOPIC {
                    c.probed = true;
                    return;
                }
                c.received += 1;
                c.last_arrival = Some(Instant::now());
                match c.consumer.observe_bytes(payload) {
                    Ok((Published::Message(m), _)) => {
                        let lag = (arrived - m.created_ms as i64).max(0) as f64;
                        c.lags.entry(m.source.into_owned()).or_default().push(lag);
                    }
                    Ok(_) => {}
                    Err(_) => c.malformed += 1,
                }
            })
        })
    };
    // The subscription must be in place before the fleet writes (its session does not exist
    // before its first connection): a probe publishes until the subscriber sees one.
    {
        let probe = Outbox::open(dir.path().join("probe.db"))?;
        let relay = Relay::start(&probe, relay_config(broker.addr(), "fleet-probe"))?;
        let subscribed = wait(Duration::from_secs(30), || {
            let _ = probe.transaction(|tx| tx.publish(PROBE_TOPIC, "", &0u8));
            thread::sleep(Duration::from_millis(200));
            cloud.lock().map(|c| c.probed).unwrap_or(false)
        });
        relay.shutdown()?;
        if !subscribed {
            return Err("the cloud subscriber received no probe in 30 s".into());
        }
    }
    let rss_before = peak_rss_kib();

    let mut devices = Vec::with_capacity(devices_n);
    for i in 0..devices_n {
        let name = format!("dev-{i:03}");
        let outbox = Outbox::open(dir.path().join(format!("{name}.db")))?;
        let relay = Relay::start(&outbox, relay_config(broker.addr(), &name))?;
        devices.push(Device {
            name,
            outbox,
            relay: Some(relay),
            committed: AtomicU64::new(0),
        });
    }
    let devices = Arc::new(devices);
    println!("fleet: {devices_n} relays connected or connecting; writing");

    let started = Instant::now();
    let writing = Arc::new(AtomicBool::new(true));
    let writers: Vec<_> = (0..WRITERS)
        .map(|w| {
            let devices = Arc::clone(&devices);
            let writing = Arc::clone(&writing);
            thread::spawn(move || -> BenchResult {
                let tick = Duration::from_secs_f64(1.0 / rate);
                let mut next = Instant::now();
                while writing.load(Ordering::SeqCst) {
                    for d in devices.iter().skip(w).step_by(WRITERS) {
                        let n = d.committed.load(Ordering::SeqCst);
                        let topic = format!("fleet/{}/events", d.name);
                        d.outbox
                            .transaction(|tx| tx.publish(&topic, &format!("k{}", n % 4), &n))?;
                        d.committed.store(n + 1, Ordering::SeqCst);
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

    // Mid-run: the broker dies and comes back.
    thread::sleep(Duration::from_secs_f64(seconds * 0.4));
    let before_kill = cloud.lock().map(|c| c.received).unwrap_or(0);
    broker.kill()?;
    let killed_at = started.elapsed();
    thread::sleep(Duration::from_secs(3));
    broker.restart()?;
    println!(
        "fleet: broker killed at {:.1} s ({before_kill} deliveries so far), restarted after 3 s",
        killed_at.as_secs_f64()
    );
    thread::sleep(Duration::from_secs_f64(seconds * 0.6).saturating_sub(Duration::from_secs(3)));
    writing.store(false, Ordering::SeqCst);
    for w in writers {
        w.join().map_err(|_| "a writer panicked")??;
    }
    let committed: u64 = devices.iter().map(|d| d.committed.load(Ordering::SeqCst)).sum();
    let write_end = started.elapsed();
    println!(
        "fleet: {committed} messages committed in {:.1} s; draining",
        write_end.as_secs_f64()
    );

    let drained = wait(Duration::from_secs(300), || {
        devices
            .iter()
            .all(|d| d.outbox.stats().is_ok_and(|s| s.pending_messages == 0))
    });
    if !drained {
        let left: u64 = devices
            .iter()
            .filter_map(|d| d.outbox.stats().ok().map(|s| s.pending_messages))
            .sum();
        println!("fleet: the devices did not drain in 300 s ({left} messages still pending)");
    }
    // Deliveries still on their way: until each device's last number arrived, or 2 s of quiet.
    let expected: HashMap<String, u64> = devices
        .iter()
        .map(|d| (d.name.clone(), d.committed.load(Ordering::SeqCst)))
        .collect();
    wait(Duration::from_secs(60), || {
        let c = cloud.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        let quiet = c
            .last_arrival
            .is_some_and(|t| t.elapsed() > Duration::from_secs(2));
        let report = c.consumer.report();
        let complete = expected
            .iter()
            .all(|(name, n)| report.streams.iter().any(|s| &s.source == name && s.last >= *n));
        complete || quiet
    });
    drop(stop_tx);
    subscriber.join().map_err(|_| "the subscriber panicked")??;
    let rss_after = peak_rss_kib();
    let mut devices = Arc::try_unwrap(devices).map_err(|_| "devices still shared")?;
    for d in &mut devices {
        if let Some(relay) = d.relay.take() {
            relay.shutdown()?;
        }
    }

    let cloud = cloud.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
    let report = cloud.consumer.report();
    let last_arrival = cloud
        .last_arrival
        .map(|t| t.duration_since(started))
        .unwrap_or(write_end);
    let mut all_lags = Vec::new();
    let mut p99s = Vec::new();
    for lags in cloud.lags.values() {
        all_lags.extend_from_slice(lags);
        p99s.push(quantile(lags, 0.99));
    }
    let mut tail = 0u64;
    for (name, n) in &expected {
        let seen = report
            .streams
            .iter()
            .filter(|s| &s.source == name)
            .map(|s| s.last)
            .max()
            .unwrap_or(0);
        tail += n.saturating_sub(seen);
    }
    let lost = committed.saturating_sub(report.totals.delivered + report.totals.announced);
    let secs = last_arrival.as_secs_f64().max(f64::MIN_POSITIVE);
    println!("{report}");
    if cloud.malformed > 0 {
        println!("fleet: {} deliveries did not decode", cloud.malformed);
    }
    if lost != report.totals.unexplained + tail {
        println!(
            "fleet: MISMATCH: {lost} lost, but the consumer accounts for {} unexplained + {tail} at the tail",
            report.totals.unexplained
        );
    }
    println!("bench: fleet_broker mosquitto (single node)");
    println!("bench: fleet_devices {devices_n}");
    println!("bench: fleet_committed {committed}");
    println!(
        "bench: fleet_msgs_per_s {:.0}",
        report.totals.delivered as f64 / secs
    );
    if !all_lags.is_empty() {
        println!("bench: fleet_lag_p50_ms {:.0}", median(&all_lags));
        println!("bench: fleet_lag_p99_ms {:.0}", quantile(&all_lags, 0.99));
        println!(
            "bench: fleet_lag_p99_worst_device_ms {:.0}",
            p99s.iter().copied().fold(0.0, f64::max)
        );
    }
    println!("bench: fleet_duplicates {}", report.totals.duplicates);
    println!("bench: fleet_announced_gaps {}", report.totals.announced);
    println!("bench: fleet_unexplained_gaps {}", report.totals.unexplained);
    println!("bench: fleet_lost_at_tail {tail}");
    println!("bench: fleet_lost {lost}");
    println!(
        "bench: fleet_rss_per_device_kib {}",
        rss_after.saturating_sub(rss_before) / devices_n.max(1) as u64
    );
    println!("bench: fleet_run_s {:.1}", started.elapsed().as_secs_f64());
    Ok(())
}
