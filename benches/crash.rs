//! Duplicates per crash: how many messages a relay killed with SIGKILL publishes again.
//!
//! At-least-once means a crash resends what was in flight (at most the in-flight window: the
//! broker may have passed those on before its PUBACK came back) plus what was acknowledged and
//! not yet marked. The second share is the relay's own: marks that lag behind PUBACKs turn every
//! crash into hundreds of resends, each paid for on a metered link.
//!
//! A store with a backlog (`EDGE_OUTBOX_BENCH_CRASH_ROWS`, default 300,000) is drained by a relay
//! in a child process (this binary again, `EDGE_OUTBOX_BENCH_CHILD=relay`) that is killed with
//! SIGKILL at a random moment 50 to 250 ms after each start, `EDGE_OUTBOX_BENCH_KILLS` times
//! (default 30); a last child drains the rest. A subscriber that stays connected throughout counts
//! every delivery by sequence number: duplicates = deliveries - distinct messages.
//!
//! Requires mosquitto. The output ends with one `bench: NAME VALUE` line per figure.

mod common;
#[path = "common/mqtt.rs"]
mod mqtt;
#[path = "../tests/support/mod.rs"]
mod support;

use std::path::PathBuf;
use std::process::{Command, Stdio};
use std::thread;
use std::time::{Duration, Instant};

use common::{Rng, env_num};
use edge_outbox::{Options, Outbox, Relay, Synchronous};
use mqtt::{Arrivals, BoxResult};
use support::ChildGuard;

const CHILD_ENV: &str = "EDGE_OUTBOX_BENCH_CHILD";
const WINDOW: usize = 100;

fn child() -> BoxResult<()> {
    let var = |name: &str| std::env::var(name).map_err(|_| format!("{name} not set"));
    let path = PathBuf::from(var("EDGE_OUTBOX_BENCH_CHILD_DB")?);
    let port: u16 = var("EDGE_OUTBOX_BENCH_CHILD_PORT")?.parse()?;
    let outbox = Outbox::open(&path)?;
    let relay = Relay::start(&outbox, mqtt::relay_config("bench-crash", port, WINDOW))?;
    loop {
        thread::sleep(Duration::from_secs(1));
        if relay.is_finished() {
            return Err("a relay thread ended".into());
        }
    }
}

fn spawn(path: &std::path::Path, port: u16) -> BoxResult<ChildGuard> {
    Ok(ChildGuard::new(
        Command::new(std::env::current_exe()?)
            .env(CHILD_ENV, "relay")
            .env("EDGE_OUTBOX_BENCH_CHILD_DB", path)
            .env("EDGE_OUTBOX_BENCH_CHILD_PORT", port.to_string())
            .stdout(Stdio::null())
            .spawn()?,
    ))
}

fn main() -> BoxResult<()> {
    if std::env::var(CHILD_ENV).as_deref() == Ok("relay") {
        return child();
    }
    let rows = env_num("EDGE_OUTBOX_BENCH_CRASH_ROWS", 300_000.0)?.round() as usize;
    let kills = env_num("EDGE_OUTBOX_BENCH_KILLS", 30.0)?.round() as usize;
    let base = common::bench_dir()?;
    let broker = mqtt::stock_mosquitto()?;
    let port = broker.port();
    let arrivals = Arrivals::start(port)?;
    let dir = tempfile::Builder::new().prefix("crash-").tempdir_in(&base)?;
    let path = dir.path().join("outbox.db");
    let outbox = Outbox::open_with(&path, Options::new().synchronous(Synchronous::Normal))?;
    let payload = ("pump-01", "discharge_pressure", 412.5_f64, "kPa", true);
    let mut committed = 0;
    while committed < rows {
        let n = 100.min(rows - committed);
        outbox.transaction(|tx| {
            for i in 0..n {
                tx.publish("plant/line-3/pump-01/telemetry", &format!("k{}", i % 8), &payload)?;
            }
            Ok::<_, edge_outbox::Error>(())
        })?;
        committed += n;
    }
    arrivals.expect(rows);
    println!(
        "edge-outbox crash benchmark: {rows} messages drained by relays (MQTT {}, window {WINDOW}) \
         killed {kills} times",
        mqtt::protocol().as_str()
    );
    let mut rng = Rng(11);
    let mut killed = 0;
    let started = Instant::now();
    while killed < kills {
        let mut c = spawn(&path, port)?;
        thread::sleep(Duration::from_millis(50 + rng.next_u64() % 200));
        c.kill_and_wait();
        killed += 1;
        if arrivals.counts().1 == rows {
            println!("  note: the backlog was drained after {killed} kills");
            break;
        }
    }
    let mut last = spawn(&path, port)?;
    arrivals.wait_all(Duration::from_secs(60))?;
    let deadline = Instant::now() + Duration::from_secs(60);
    while outbox.stats()?.pending_messages != 0 {
        if Instant::now() > deadline {
            return Err("the last relay did not mark everything".into());
        }
        thread::sleep(Duration::from_millis(10));
    }
    last.kill_and_wait();
    let (total, distinct, strays) = arrivals.counts();
    let dups = total - distinct as u64;
    let per = dups as f64 / killed as f64;
    println!(
        "  {total} deliveries of {distinct} messages ({strays} strays) in {:.1} s: {dups} duplicates, \
         {per:.1} per kill; target <= the in-flight window ({WINDOW}, or the broker's receive \
         maximum if lower: mosquitto's default is 20): {}",
        started.elapsed().as_secs_f64(),
        if per <= 20.0 {
            "met"
        } else if per <= WINDOW as f64 {
            "met for window 100, MISSED for the broker's 20"
        } else {
            "MISSED"
        }
    );
    drop(arrivals);
    drop(broker);
    println!();
    println!("bench: dups_per_crash {per:.1}");
    Ok(())
}
