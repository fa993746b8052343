//! The scenarios: each injects one kind of failure into a running device and returns the
//! checker's verdict once the device has been allowed to finish.

use std::os::unix::process::ExitStatusExt;
use std::time::{Duration, Instant};

use super::checker::Verdict;
use super::device::DeviceEnv;
use super::lab::Lab;
use super::support::{Broker, WAIT};

/// A small deterministic generator; the seed is printed so a failing run can be replayed
/// with `CRASH_SEED`.
pub struct Rng(u64);

/// The seed of this run, for the report.
pub static SEED: std::sync::OnceLock<u64> = std::sync::OnceLock::new();

impl Rng {
    pub fn from_env() -> Rng {
        let seed = std::env::var("CRASH_SEED")
            .ok()
            .and_then(|s| s.parse().ok())
            .unwrap_or_else(|| {
                std::time::SystemTime::now()
                    .duration_since(std::time::UNIX_EPOCH)
                    .map_or(1, |d| d.as_nanos() as u64)
            });
        println!("crash: seed {seed} (CRASH_SEED={seed} replays it)");
        let _ = SEED.set(seed);
        Rng(seed | 1)
    }

    pub fn below(&mut self, n: u64) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0 % n.max(1)
    }
}

const READY: Duration = Duration::from_secs(30);

/// Arms one failpoint, lets the device crash there, restarts it and checks. With `keep_sent`,
/// acknowledged rows are kept (moved to `outbox_sent`) instead of deleted.
pub fn failpoint(name: &str, nth: u32, keep_sent: bool) -> Verdict {
    failpoint_with(name, nth, keep_sent, false, false)
}

/// As [`failpoint`], with commands arriving on the publishing session (single-session mode).
pub fn failpoint_single_session(name: &str, nth: u32) -> Verdict {
    failpoint_with(name, nth, false, false, true)
}

/// As [`failpoint`], with every order on one batched topic (`DeviceEnv::BATCH`): the crash falls
/// between a batch's PUBACK and the marking of its rows, or inside that marking.
pub fn failpoint_batched(name: &str, nth: u32) -> Verdict {
    failpoint_with(name, nth, false, true, false)
}

fn failpoint_with(name: &str, nth: u32, keep_sent: bool, batched: bool, single_session: bool) -> Verdict {
    let mut lab = Lab::new(Broker::start().expect("broker"), false, 400);
    if single_session {
        lab.single_session();
    }
    if keep_sent {
        lab.env.push((DeviceEnv::KEEP_SENT, "1".into()));
    }
    if batched {
        lab.env.push((DeviceEnv::BATCH, "1".into()));
    }
    // The device must not finish before the commands it is about to be sent arrive: the command
    // failpoints are hit while applying them.
    lab.env.push((DeviceEnv::COMMANDS, "6".into()));
    let mut device = lab.start(Some(&format!("{name}:{nth}")));
    if single_session {
        assert!(
            device.wait_line("sessions single", READY),
            "the device ran with two sessions: the scenario tested nothing of single-session mode"
        );
    }
    // "ready" once the command session is subscribed; a failpoint on the publishing side may
    // abort the device before that, and then the stdout it announces on closes. Either way the
    // commands are queued for it (Lab::new made its session persistent).
    device.wait_line("ready", READY);
    lab.send_commands(6);
    let status = device.wait_exit(Duration::from_secs(60));
    assert_eq!(
        status.signal(),
        Some(libc_sigabrt()),
        "{name}:{nth}: the failpoint was not hit ({status:?})"
    );
    lab.send_commands(2);
    lab.env.retain(|(k, _)| *k != DeviceEnv::COMMANDS);
    let retention = if keep_sent { "kept" } else { "deleted" };
    let batches = if batched { ", batched" } else { "" };
    let sessions = if single_session { ", single session" } else { "" };
    lab.finish(
        &format!("failpoint {name} (sent {retention}{batches}{sessions})"),
        1,
    )
}

fn libc_sigabrt() -> i32 {
    6
}

/// SIGKILLs the device at random moments under load, `kills` times, restarting it each time;
/// every other run uses `synchronous = NORMAL` (a process crash must lose nothing there either).
pub fn random_kills(kills: usize, rng: &mut Rng) -> Verdict {
    random_kills_with(kills, rng, Variant::Plain)
}

/// [`random_kills`] with the orders in priority lanes, one key coalescing and one expiring, and
/// the relay paced below the load: nothing lost, nothing phantom, each key in order, and exactly
/// the replaced values announced.
pub fn random_kills_in_lanes(kills: usize, rng: &mut Rng) -> Verdict {
    random_kills_with(kills, rng, Variant::Lanes)
}

/// [`random_kills`] with batching on (one topic, zlib, 20 ms linger): a batch is marked only on
/// its PUBACK and published again whole after a restart, so nothing is lost, nothing phantom, and
/// each key keeps its order.
pub fn random_kills_batched(kills: usize, rng: &mut Rng) -> Verdict {
    random_kills_with(kills, rng, Variant::Batched)
}

/// [`random_kills`] in single-session mode: publishing and commands on one persistent session.
pub fn random_kills_single_session(kills: usize, rng: &mut Rng) -> Verdict {
    random_kills_with(kills, rng, Variant::SingleSession)
}

/// Which option a random-kill run turns on.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Variant {
    Plain,
    Lanes,
    Batched,
    SingleSession,
}

fn random_kills_with(kills: usize, rng: &mut Rng, variant: Variant) -> Verdict {
    let mut lab = Lab::new(Broker::start().expect("broker"), false, 1_000_000);
    match variant {
        Variant::Plain => {}
        Variant::Lanes => {
            lab.set_env(DeviceEnv::LANES, "1");
            lab.announced_removals = true;
        }
        Variant::Batched => lab.set_env(DeviceEnv::BATCH, "1"),
        Variant::SingleSession => lab.single_session(),
    }
    let mut device = lab.start(None);
    if variant == Variant::SingleSession {
        assert!(
            device.wait_line("sessions single", READY),
            "the device ran with two sessions: the scenario tested nothing of single-session mode"
        );
    }
    assert!(device.wait_line("ready", READY), "device never became ready");
    device.kill();
    for k in 0..kills {
        lab.set_env(DeviceEnv::SYNC, if k % 2 == 1 { "normal" } else { "full" });
        let device = lab.start(None);
        // Between 0 and 300 ms: during startup, recovery, connecting, committing, publishing,
        // marking, storing and applying commands.
        std::thread::sleep(Duration::from_millis(rng.below(300)));
        device.kill();
        if k % 5 == 0 {
            lab.send_commands(1);
        }
    }
    // Finish a little past what was committed, so the last run also commits.
    lab.orders = lab.last_order() + 50;
    let verdict = lab.finish(
        match variant {
            Variant::Plain => "random SIGKILL (FULL and NORMAL)",
            Variant::Lanes => "random SIGKILL, lanes, coalescing, expiry, pace (FULL and NORMAL)",
            Variant::Batched => "random SIGKILL, batched (FULL and NORMAL)",
            Variant::SingleSession => "random SIGKILL, single session (FULL and NORMAL)",
        },
        kills,
    );
    // A run whose option never took effect tested nothing of it.
    match variant {
        Variant::Plain | Variant::SingleSession => {}
        Variant::Lanes => assert!(
            verdict.announced > 0,
            "no order was coalesced or expired: the scenario tested nothing of them"
        ),
        Variant::Batched => {
            let batches = lab
                .sub
                .messages()
                .iter()
                .filter(|m| m.topic == "orders/batched")
                .filter(|m| edge_outbox::Published::decode_all(&m.payload).is_ok_and(|items| items.len() > 1))
                .count();
            assert!(
                batches > 0,
                "no batch was published: the scenario tested nothing of batching"
            );
            println!("crash: random_kills_batched: {batches} batches among the deliveries");
        }
    }
    verdict
}

/// How long a relay may take to notice a half-open link: two keep-alives of 5 s and a margin.
const HALF_OPEN_NOTICED: Duration = Duration::from_secs(20);

/// Cuts, half-opens (held until the relay's keep-alive notices) and refuses the device's
/// connections while it commits, with short stalls in between; each disconnecting fault is
/// injected only while the relay is connected, and must be counted by it as a lost connection.
pub fn proxy_chaos(rng: &mut Rng) -> Verdict {
    const FAULTS: usize = 16;
    let mut lab = Lab::new(Broker::start().expect("broker"), true, 1_000_000);
    lab.env.push((DeviceEnv::KEEP_SENT, "1".into()));
    lab.env.push((DeviceEnv::PACE_US, "1000".into()));
    let mut device = lab.start(None);
    assert!(device.wait_line("ready", READY), "device never became ready");
    let proxy = lab.proxy.take().expect("proxy");
    let (mut experienced, mut stalls, mut half_opens, mut unrecovered) = (0, 0, 0, 0);
    for _ in 0..FAULTS {
        assert!(
            device.wait_seen(WAIT, |s| s.connected),
            "the relay did not reconnect: {:?}",
            device.seen()
        );
        let before = device.seen().disconnects;
        if rng.below(3) == 0 {
            // Short of the keep-alive: no fault the relay must notice, but acks wait.
            proxy.stall();
            std::thread::sleep(Duration::from_millis(100 + rng.below(400)));
            proxy.resume();
            stalls += 1;
        }
        let noticed = match rng.below(3) {
            0 => {
                proxy.cut();
                device.wait_seen(WAIT, |s| s.disconnects > before)
            }
            // The relay alone learns of a dead route, through its keep-alive (5 s here, the least
            // rumqttc allows under MQTT 5): it must notice before the cut that ends the fault.
            1 if half_opens < 3 => {
                half_opens += 1;
                proxy.half_open();
                let noticed = device.wait_seen(HALF_OPEN_NOTICED, |s| s.disconnects > before);
                proxy.cut();
                noticed
            }
            _ => {
                proxy.refuse(true);
                proxy.cut();
                std::thread::sleep(Duration::from_millis(100 + rng.below(400)));
                proxy.refuse(false);
                device.wait_seen(WAIT, |s| s.disconnects > before)
            }
        };
        if noticed {
            experienced += 1;
        }
        // The command session of this same process must come back too: a command sent now is
        // applied before the next fault.
        lab.send_commands(1);
        if !lab.wait_last_command_applied() {
            unrecovered += 1;
        }
        std::thread::sleep(Duration::from_millis(100 + rng.below(300)));
    }
    let resent = device.seen().resent;
    lab.proxy = Some(proxy);
    let mut v = lab.finish_in_place(
        device,
        &format!("proxy cut/half-open/refuse (+{stalls} stalls)"),
        FAULTS,
    );
    v.experienced = Some(experienced);
    if unrecovered > 0 {
        v.notes.push(format!(
            "{unrecovered} commands sent after a fault were not applied by the same process"
        ));
    }
    // Rows in flight at a cut are published again on the next connection: a relay that resumed
    // elsewhere would resend nothing.
    if resent == 0 {
        v.notes.push("no row was ever resent after a cut".into());
    }
    v
}

/// Lanes, coalescing, expiry, the pace and batching together, with the connection cut at random
/// moments while the device commits: nothing lost, nothing phantom, each key in order, exactly the
/// replaced and expired values announced, and rows (batches among them) in flight at a cut
/// published again.
pub fn cuts_in_lanes_batched(rng: &mut Rng) -> Verdict {
    const CUTS: usize = 10;
    let mut lab = Lab::new(Broker::start().expect("broker"), true, 1_000_000);
    lab.set_env(DeviceEnv::LANES, "1");
    lab.set_env(DeviceEnv::BATCH, "1");
    lab.announced_removals = true;
    let mut device = lab.start(None);
    assert!(device.wait_line("ready", READY), "device never became ready");
    let proxy = lab.proxy.take().expect("proxy");
    let mut experienced = 0;
    for _ in 0..CUTS {
        assert!(
            device.wait_seen(WAIT, |s| s.connected),
            "the relay did not reconnect: {:?}",
            device.seen()
        );
        std::thread::sleep(Duration::from_millis(50 + rng.below(300)));
        // PUBACKs held back first, so the cut falls with a window (a batch among it) in flight.
        proxy.stall();
        std::thread::sleep(Duration::from_millis(50 + rng.below(150)));
        let before = device.seen().disconnects;
        proxy.cut();
        proxy.resume();
        if device.wait_seen(WAIT, |s| s.disconnects > before) {
            experienced += 1;
        }
    }
    let resent = device.seen().resent;
    lab.proxy = Some(proxy);
    let mut v = lab.finish_in_place(
        device,
        "proxy cuts, lanes, coalescing, expiry, pace, batching",
        CUTS,
    );
    v.experienced = Some(experienced);
    if v.announced == 0 {
        v.notes
            .push("no order was coalesced or expired: the scenario tested nothing of them".into());
    }
    if resent == 0 {
        v.notes.push("no row was ever resent after a cut".into());
    }
    v
}

/// Two other processes commit orders through the SQL contract (plain rusqlite, one FULL, one
/// NORMAL, some transactions rolled back) while the device, whose relay publishes everything,
/// commits its own and is SIGKILLed `kills` times.
pub fn foreign_writers(kills: usize, rng: &mut Rng) -> Verdict {
    const WRITER_ORDERS: u64 = 1500;
    let mut lab = Lab::new(Broker::start().expect("broker"), false, 1_000_000);
    lab.env.push((DeviceEnv::PACE_US, "2000".into()));
    let mut device = lab.start(None);
    // The device creates the tables the writers insert into.
    assert!(device.wait_line("ready", READY), "device never became ready");
    let mut writers = [lab.start_writer(WRITER_ORDERS), lab.start_writer(WRITER_ORDERS)];
    for _ in 0..kills {
        std::thread::sleep(Duration::from_millis(50 + rng.below(300)));
        device.kill();
        device = lab.start(None);
    }
    for (i, w) in writers.iter_mut().enumerate() {
        let deadline = Instant::now() + Duration::from_secs(120);
        let status = loop {
            if let Some(status) = w.try_wait().expect("writer status") {
                break status;
            }
            assert!(Instant::now() < deadline, "writer {} did not finish", i + 1);
            std::thread::sleep(Duration::from_millis(20));
        };
        assert!(status.success(), "writer {} failed: {status:?}", i + 1);
    }
    device.kill();
    lab.orders = lab.last_order() + 50;
    lab.finish("foreign SQL writers, relay SIGKILL", kills)
}

/// Kills the broker with SIGKILL mid-run and restarts it, several times. What it had acknowledged
/// and not yet delivered is the broker's loss (mosquitto saves every second; rumqttd keeps nothing),
/// the one loss this scenario allows, counted apart.
pub fn broker_kills(rng: &mut Rng) -> Verdict {
    let broker = Broker::builder().persistence(true).start().expect("broker");
    // The device reaches the broker through a proxy, held shut after each restart until the
    // consumer has subscribed again: what the broker loses then is only what it had acknowledged
    // and not yet delivered, not what it received while nobody was subscribed.
    let mut lab = Lab::new(broker, true, 1_000_000);
    lab.allow_broker_loss = true;
    lab.env.push((DeviceEnv::KEEP_SENT, "1".into()));
    lab.env.push((DeviceEnv::PACE_US, "1000".into()));
    let mut device = lab.start(None);
    assert!(device.wait_line("ready", READY), "device never became ready");
    let mut faults = 0;
    let mut restarted = Instant::now();
    for _ in 0..3 {
        std::thread::sleep(Duration::from_millis(300 + rng.below(700)));
        let proxy = lab.proxy.as_ref().expect("proxy");
        proxy.refuse(true);
        lab.broker.kill().expect("kill the broker");
        proxy.cut();
        std::thread::sleep(Duration::from_millis(200 + rng.below(500)));
        restarted = Instant::now();
        lab.broker.restart().expect("restart the broker");
        faults += 1;
        assert!(
            lab.sub.wait_subscribed(faults as u64 + 1, super::support::WAIT),
            "the consumer subscribed again after restart {faults}"
        );
        lab.proxy.as_ref().expect("proxy").refuse(false);
    }
    assert!(
        lab.sub.wait_connected(faults as u64 + 1, super::support::WAIT),
        "consumer reconnected"
    );
    // A killed broker may have lost the device's session (mosquitto saves every second), and with it
    // anything queued there: commands go out once the device has subscribed again, so any command
    // not applied would be the device's fault, not the broker's.
    assert!(
        device.wait_line_since("ready", Some(restarted), READY),
        "the device's command session came back"
    );
    lab.send_commands(6);
    let disconnects = device.seen().disconnects as usize;
    let mut v = lab.finish_in_place(device, "broker SIGKILL + restart", faults);
    v.experienced = Some(disconnects.min(faults));
    v
}

/// Fills the device's disk while the broker is unreachable; the drain frees it again.
pub fn disk_full() -> Verdict {
    // 60 pages of 4 KiB hold the schema and about 1,500 orders with their messages.
    let mut lab = Lab::new(Broker::start().expect("broker"), true, 2500);
    lab.env.push((DeviceEnv::MAX_PAGES, "60".into()));
    let proxy = lab.proxy.as_ref().expect("proxy");
    proxy.refuse(true);
    let mut device = lab.start(None);
    assert!(
        device.wait_line("full", Duration::from_secs(60)),
        "the disk never filled"
    );
    lab.proxy.as_ref().expect("proxy").refuse(false);
    assert!(
        device.wait_line("done", Duration::from_secs(120)),
        "the run did not complete after space was freed"
    );
    let status = device.wait_exit(Duration::from_secs(20));
    assert!(status.success(), "device exit {status:?}");
    let mut v = lab.finish("disk full, then drained", 1);
    // It said "full": its commits failed for lack of space, and it went on.
    v.experienced = Some(1);
    v
}
