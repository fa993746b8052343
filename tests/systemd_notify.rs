//! `edge-outbox relay` under a service manager (`Type=notify`): `READY=1` once it holds the lock
//! and has the database open, `STATUS=` lines as its state changes, `WATCHDOG=1` while its
//! publishing thread keeps going round its loop, `STOPPING=1` on SIGTERM. Checked on a real
//! `NOTIFY_SOCKET` (a Unix datagram socket this test binds, as systemd does), with the relay a
//! real child process. A publishing thread that hangs (failpoint `relay-loop:N:hang`) stops the
//! pings while the process stays up: the service manager would restart it.
#![cfg(all(feature = "cli", unix))]

mod support;

use std::fs::File;
use std::os::unix::net::UnixDatagram;
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use support::{Broker, ChildGuard, WAIT};

type TestResult<T = ()> = Result<T, Box<dyn std::error::Error>>;

/// The watchdog interval the tests ask for: short, so a withheld ping shows within seconds.
const WATCHDOG: Duration = Duration::from_secs(1);
#[cfg_attr(not(feature = "failpoints"), allow(dead_code))]
/// How old a heartbeat may be and still count as alive, whatever the interval: an idle
/// publishing thread passes its loop at least every 2 s (src/bin/edge-outbox/notify.rs).
const IDLE_PASS: Duration = Duration::from_secs(3);

/// A notification, with when it arrived.
struct Note {
    #[cfg_attr(not(feature = "failpoints"), allow(dead_code))]
    at: Instant,
    text: String,
}

/// The service manager's end: a datagram socket bound in `dir`.
fn listen(dir: &Path) -> TestResult<(UnixDatagram, std::path::PathBuf)> {
    let path = dir.join("notify.sock");
    let socket = UnixDatagram::bind(&path)?;
    socket.set_read_timeout(Some(Duration::from_millis(100)))?;
    Ok((socket, path))
}

/// Every notification that arrives within `span`.
fn collect(socket: &UnixDatagram, span: Duration, notes: &mut Vec<Note>) {
    let end = Instant::now() + span;
    let mut buf = [0u8; 4096];
    while Instant::now() < end {
        if let Ok(n) = socket.recv(&mut buf) {
            notes.push(Note {
                at: Instant::now(),
                text: String::from_utf8_lossy(&buf[..n]).into_owned(),
            });
        }
    }
}

fn relay(dir: &Path, broker: &Broker, socket: &Path, failpoint: Option<&str>) -> TestResult<Child> {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_edge-outbox"));
    cmd.args(["relay", "--client-id", "notified", "--db"])
        .arg(dir.join("device.db"))
        .args(["--broker", &format!("mqtt://{}", broker.addr())])
        .env("NOTIFY_SOCKET", socket)
        .env("WATCHDOG_USEC", WATCHDOG.as_micros().to_string())
        .env_remove("WATCHDOG_PID")
        .env_remove("RUST_LOG")
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(File::create(dir.join("relay.stderr"))?);
    match failpoint {
        Some(spec) => cmd.env("EDGE_OUTBOX_FAILPOINT", spec),
        None => cmd.env_remove("EDGE_OUTBOX_FAILPOINT"),
    };
    Ok(cmd.spawn()?)
}

fn sigterm(child: &Child) -> TestResult {
    let status = Command::new("kill")
        .args(["-TERM", &child.id().to_string()])
        .status()?;
    assert!(status.success(), "kill -TERM");
    Ok(())
}

/// The child's exit status, waited for at most [`WAIT`].
fn wait_exit(child: &mut Child) -> TestResult<std::process::ExitStatus> {
    let deadline = Instant::now() + WAIT;
    loop {
        if let Some(status) = child.try_wait()? {
            return Ok(status);
        }
        if Instant::now() >= deadline {
            return Err("the relay did not exit within the wait".into());
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

fn count(notes: &[Note], what: &str) -> usize {
    notes.iter().filter(|n| n.text.lines().any(|l| l == what)).count()
}

#[test]
fn ready_status_watchdog_and_stopping_arrive_on_a_real_notify_socket() -> TestResult {
    let broker = Broker::start()?;
    let dir = tempfile::tempdir()?;
    let (socket, path) = listen(dir.path())?;
    let mut child = ChildGuard::new(relay(dir.path(), &broker, &path, None)?);
    let mut notes = Vec::new();
    let deadline = Instant::now() + WAIT;
    while count(&notes, "READY=1") == 0 && Instant::now() < deadline {
        collect(&socket, Duration::from_millis(200), &mut notes);
    }
    assert_eq!(count(&notes, "READY=1"), 1, "READY=1 once");
    // Several watchdog intervals: a ping in each half interval, and the state once connected.
    collect(&socket, WATCHDOG * 4, &mut notes);
    let pings = count(&notes, "WATCHDOG=1");
    assert!(pings >= 4, "{pings} pings in four watchdog intervals");
    assert!(
        notes
            .iter()
            .any(|n| n.text.lines().any(|l| l.starts_with("STATUS=connected to"))),
        "a STATUS line once connected: {:?}",
        notes.iter().map(|n| &n.text).collect::<Vec<_>>()
    );
    sigterm(&child)?;
    collect(&socket, Duration::from_secs(2), &mut notes);
    assert_eq!(count(&notes, "STOPPING=1"), 1, "STOPPING=1 on SIGTERM");
    let status = wait_exit(&mut child)?;
    assert!(status.success(), "stopped cleanly: {status:?}");
    Ok(())
}

/// `systemctl reload` (the unit's `ExecReload` sends SIGHUP): `RELOADING=1`, then `READY=1`
/// once the relay runs again with the re-read file, and the watchdog fed again after it.
#[test]
fn a_reload_says_reloading_then_ready() -> TestResult {
    let broker = Broker::start()?;
    let dir = tempfile::tempdir()?;
    let (socket, path) = listen(dir.path())?;
    let file = dir.path().join("relay.toml");
    std::fs::write(
        &file,
        format!(
            "db = {:?}\nbroker = \"mqtt://{}\"\nclient-id = \"notified\"\n",
            dir.path().join("device.db").to_string_lossy(),
            broker.addr()
        ),
    )?;
    let child = Command::new(env!("CARGO_BIN_EXE_edge-outbox"))
        .args(["relay", "--config", &file.to_string_lossy()])
        .env("NOTIFY_SOCKET", &path)
        .env("WATCHDOG_USEC", WATCHDOG.as_micros().to_string())
        .env_remove("WATCHDOG_PID")
        .env_remove("RUST_LOG")
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(File::create(dir.path().join("relay.stderr"))?)
        .spawn()?;
    let mut child = ChildGuard::new(child);
    let mut notes = Vec::new();
    let deadline = Instant::now() + WAIT;
    while count(&notes, "READY=1") == 0 && Instant::now() < deadline {
        collect(&socket, Duration::from_millis(200), &mut notes);
    }
    assert_eq!(count(&notes, "READY=1"), 1, "READY=1 once at start");
    let status = Command::new("kill")
        .args(["-HUP", &child.id().to_string()])
        .status()?;
    assert!(status.success(), "kill -HUP");
    let deadline = Instant::now() + WAIT;
    while count(&notes, "READY=1") < 2 && Instant::now() < deadline {
        collect(&socket, Duration::from_millis(200), &mut notes);
    }
    let texts: Vec<&str> = notes.iter().map(|n| n.text.as_str()).collect();
    let reloading = texts.iter().position(|t| t.lines().any(|l| l == "RELOADING=1"));
    let ready_again = texts
        .iter()
        .enumerate()
        .filter(|(_, t)| t.lines().any(|l| l == "READY=1"))
        .nth(1)
        .map(|(i, _)| i);
    assert!(
        reloading.is_some() && reloading < ready_again,
        "RELOADING=1, then READY=1: {texts:?}"
    );
    let before = count(&notes, "WATCHDOG=1");
    collect(&socket, WATCHDOG * 2, &mut notes);
    assert!(
        count(&notes, "WATCHDOG=1") > before,
        "no watchdog ping after the reload"
    );
    sigterm(&child)?;
    assert!(wait_exit(&mut child)?.success());
    Ok(())
}

/// Needs the `failpoints` feature (the hang); the ARM stage's suite is built without it.
#[cfg(feature = "failpoints")]
#[test]
fn the_watchdog_ping_stops_while_the_publishing_thread_hangs() -> TestResult {
    let broker = Broker::start()?;
    let dir = tempfile::tempdir()?;
    let (socket, path) = listen(dir.path())?;
    // The publishing thread hangs on its 5th pass through its loop (within its first seconds:
    // it connects, reads, and passes at least every 2 s when idle).
    let child = ChildGuard::new(relay(dir.path(), &broker, &path, Some("relay-loop:5:hang"))?);
    let stderr = dir.path().join("relay.stderr");
    let mut notes = Vec::new();
    let deadline = Instant::now() + WAIT;
    let hung_at = loop {
        collect(&socket, Duration::from_millis(100), &mut notes);
        if std::fs::read_to_string(&stderr)?.contains("this thread hangs") {
            break Instant::now();
        }
        assert!(Instant::now() < deadline, "the failpoint was not hit");
    };
    assert_eq!(count(&notes, "READY=1"), 1, "READY=1 once");
    collect(&socket, IDLE_PASS + WATCHDOG * 3, &mut notes);
    // Pings go on while the last heartbeat is younger than the allowance; none after it and
    // the half interval a due ping may wait.
    let late: Vec<Duration> = notes
        .iter()
        .filter(|n| {
            n.text == "WATCHDOG=1" && n.at > hung_at + IDLE_PASS + WATCHDOG / 2 + Duration::from_millis(500)
        })
        .map(|n| n.at - hung_at)
        .collect();
    assert!(
        late.is_empty(),
        "WATCHDOG=1 after the publisher hung, at {late:?} after the hang"
    );
    let log = std::fs::read_to_string(&stderr)?;
    assert!(
        log.contains("withholding the watchdog ping"),
        "the relay says why it withholds the ping:\n{log}"
    );
    drop(child);
    Ok(())
}

/// The broken build the hang test catches: pings sent whatever the publishing thread does.
#[cfg(all(feature = "mutants", feature = "failpoints"))]
#[test]
fn the_watchdog_ignores_heartbeat_mutant_is_caught() -> TestResult {
    if support::mutant::in_mutant_run() {
        return Ok(());
    }
    support::mutant::caught_by(
        "watchdog-ignores-heartbeat",
        "the_watchdog_ping_stops_while_the_publishing_thread_hangs",
        "WATCHDOG=1 after the publisher hung",
    )?;
    Ok(())
}

/// docs/operations.md shows the shipped unit as it is.
#[test]
fn the_documented_unit_is_the_shipped_one() -> TestResult {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let unit = std::fs::read_to_string(root.join("contrib/systemd/edge-outbox-relay.service"))?;
    let docs = std::fs::read_to_string(root.join("docs/operations.md"))?;
    assert!(
        docs.contains(&format!("```ini\n{unit}```")),
        "docs/operations.md's systemd section differs from contrib/systemd/edge-outbox-relay.service"
    );
    for line in [
        "Type=notify",
        "WatchdogSec=",
        "StateDirectory=",
        "NoNewPrivileges=yes",
        "ProtectSystem=strict",
    ] {
        assert!(unit.lines().any(|l| l.starts_with(line)), "the unit has {line}");
    }
    Ok(())
}
