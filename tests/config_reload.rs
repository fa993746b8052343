//! `edge-outbox relay --config FILE` on SIGHUP: the file is read again and applied by restarting
//! the relay's threads in the same process, so a rotated password and new pacing take effect with
//! no message lost (the delivery check: every committed id arrives, in order per key); a file
//! that no longer loads, or a setting that needs a restart, changes nothing that runs.
//!
//! Broken reloads these catch: the password file not read again, or no reconnect (the broker was
//! restarted with only the new password, so a relay on the old one publishes nothing more), a reload that drops or forgets rows (the check), a bad
//! file applied or taking the relay down, a restart-only setting applied, SIGHUP killing a relay
//! started without a file.
#![cfg(all(feature = "cli", unix))]

mod support;

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use support::device::{commit_orders, open_device};
use support::{Broker, BrokerKind, ChildGuard, Subscriber, WAIT, check};

type TestResult<T = ()> = Result<T, Box<dyn std::error::Error>>;

fn write(path: &Path, text: &str) -> TestResult {
    std::fs::write(path, text)?;
    Ok(())
}

fn signal(pid: u32, name: &str) -> TestResult {
    let status = Command::new("kill")
        .args([&format!("-{name}"), &pid.to_string()])
        .status()?;
    assert!(status.success(), "kill -{name} {pid} failed");
    Ok(())
}

/// `edge-outbox ARGS...`, its log lines (JSON, as the tests ask) in `log`.
fn relay(args: &[&str], log: &Path) -> TestResult<Child> {
    Ok(Command::new(env!("CARGO_BIN_EXE_edge-outbox"))
        .args(args)
        .env_remove("RUST_LOG")
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(std::fs::File::create(log)?)
        .spawn()?)
}

/// The relay from a config file alone.
fn relay_from(file: &Path, log: &Path) -> TestResult<Child> {
    relay(&["relay", "--config", &file.to_string_lossy()], log)
}

/// The log's records, parsed (each line one JSON object).
fn records(log: &Path) -> Vec<serde_json::Value> {
    std::fs::read_to_string(log)
        .unwrap_or_default()
        .lines()
        .filter_map(|line| serde_json::from_str(line).ok())
        .collect()
}

/// Waits until a record's message starts with `prefix` `n` times; returns those records.
fn wait_log(log: &Path, prefix: &str, n: usize) -> Vec<serde_json::Value> {
    let deadline = Instant::now() + WAIT;
    loop {
        let found: Vec<_> = records(log)
            .into_iter()
            .filter(|r| r["message"].as_str().is_some_and(|m| m.starts_with(prefix)))
            .collect();
        if found.len() >= n || Instant::now() > deadline {
            return found;
        }
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// SIGTERM, then the exit code.
fn stop(relay: ChildGuard) -> TestResult<Option<i32>> {
    signal(relay.id(), "TERM")?;
    let mut child = relay.into_inner();
    let deadline = Instant::now() + WAIT;
    while Instant::now() < deadline {
        if let Some(status) = child.try_wait()? {
            return Ok(status.code());
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    drop(ChildGuard::new(child));
    Err("the relay did not stop on SIGTERM".into())
}

fn config(db: &Path, broker: &Broker, password_file: &Path, pace: u32) -> String {
    format!(
        "db = {:?}\nbroker = \"mqtt://{}\"\nclient-id = \"reload-device\"\nusername = \"device\"\n\
         password-file = {:?}\npace-messages = {pace}\nlog-format = \"json\"\n",
        db.to_string_lossy(),
        broker.addr(),
        password_file.to_string_lossy()
    )
}

/// mosquitto's password file rewritten, and mosquitto restarted on it: every client reconnects,
/// and only with a password the new file holds.
fn rotate_broker_passwords(broker: &mut Broker, users: &[(&str, &str)]) -> TestResult {
    let file: PathBuf = broker.dir().join("passwords");
    for (i, (user, password)) in users.iter().enumerate() {
        let mut cmd = Command::new("mosquitto_passwd");
        cmd.arg("-b");
        if i == 0 {
            cmd.arg("-c");
        }
        assert!(cmd.arg(&file).args([user, password]).status()?.success());
    }
    broker.restart()?;
    Ok(())
}

#[test]
fn sighup_applies_a_rotated_password_and_new_pacing_and_loses_nothing() -> TestResult {
    // mosquitto: its password file can be changed under a running broker.
    let mut broker = Broker::builder()
        .kind(BrokerKind::Mosquitto)
        .user("cloud", "cloud-secret")
        .user("device", "one")
        .start()?;
    let dir = tempfile::tempdir()?;
    let outbox = open_device(dir.path());
    let db = dir.path().join("device.db");
    let password = dir.path().join("mqtt-password");
    write(&password, "one\n")?;
    let file = dir.path().join("relay.toml");
    write(&file, &config(&db, &broker, &password, 1000))?;
    let sub = Subscriber::builder(broker.addr())
        .credentials("cloud", "cloud-secret")
        .filter("orders/#")
        .spawn()?;
    assert!(
        sub.wait_subscribed(1, WAIT),
        "the cloud's subscriber is not subscribed"
    );

    let log = dir.path().join("relay.log");
    let relay = ChildGuard::new(relay_from(&file, &log)?);
    let pid = relay.id();
    let mut committed = commit_orders(&outbox, &["a", "b"], 30, 0);
    assert!(
        check::wait_for_unique(&sub, 30, WAIT),
        "the first 30 did not arrive"
    );

    // The broker now takes only the new password, and the relay, disconnected, is refused until
    // it reads the new one.
    rotate_broker_passwords(&mut broker, &[("cloud", "cloud-secret"), ("device", "two")])?;
    let old = Subscriber::builder(broker.addr())
        .credentials("device", "one")
        .spawn()?;
    let new = Subscriber::builder(broker.addr())
        .credentials("device", "two")
        .spawn()?;
    assert!(
        new.wait_connected(1, WAIT),
        "the broker does not take the new password"
    );
    assert!(
        old.wait_errors(1, WAIT) && old.connacks() == 0,
        "the broker still takes the old password"
    );
    old.stop();
    new.stop();

    // Rows committed while the relay is refused, while it reloads, and after.
    committed.extend(commit_orders(&outbox, &["a", "b"], 20, 0));
    assert!(
        sub.wait_subscribed(2, WAIT),
        "the cloud's subscriber did not subscribe again"
    );
    // The new password in a new file the config now names: a password rewritten in place is
    // read at the next connection without any reload, but a changed path takes the reload.
    let rotated = dir.path().join("mqtt-password-2");
    write(&rotated, "two\n")?;
    write(&file, &config(&db, &broker, &rotated, 500))?;
    signal(pid, "HUP")?;
    committed.extend(commit_orders(&outbox, &["a", "b", "c"], 30, 0));
    assert_eq!(
        wait_log(&log, "reload: done", 1).len(),
        1,
        "no reload: {:?}",
        records(&log)
    );

    let delivery = check::wait_and_check(&sub, &committed, WAIT)?;
    assert_eq!(delivery.unique, committed.len());
    let applied = wait_log(&log, "reload: applied", 1);
    assert!(
        applied
            .iter()
            .any(|r| r["fields"]["change"] == "pace-messages: 1000 -> 500"),
        "the pacing change is not logged as applied: {applied:?}"
    );
    assert!(
        !std::fs::read_to_string(&log)?.contains("two"),
        "the password appears in the log"
    );
    assert_eq!(stop(relay)?, Some(0));
    Ok(())
}

#[test]
fn a_bad_reload_changes_nothing_and_a_restart_only_setting_stays() -> TestResult {
    let broker = Broker::start()?;
    let dir = tempfile::tempdir()?;
    let outbox = open_device(dir.path());
    let db = dir.path().join("device.db");
    let file = dir.path().join("relay.toml");
    let good = format!(
        "db = {:?}\nbroker = \"mqtt://{}\"\nclient-id = \"reload-device\"\nlog-format = \"json\"\n",
        db.to_string_lossy(),
        broker.addr()
    );
    write(&file, &good)?;
    let sub = Subscriber::start(broker.addr(), "orders/#")?;
    let log = dir.path().join("relay.log");
    let relay = ChildGuard::new(relay_from(&file, &log)?);
    let pid = relay.id();
    let mut committed = commit_orders(&outbox, &["a"], 10, 0);
    assert!(check::wait_for_unique(&sub, 10, WAIT));

    // A file that no longer parses: refused, with its line and key; the relay runs on.
    write(&file, &format!("{good}max-in-flight = \"many\"\n"))?;
    signal(pid, "HUP")?;
    let refused = wait_log(&log, "reload refused", 1);
    let why = refused
        .first()
        .map(|r| r["fields"]["error"].to_string())
        .unwrap_or_default();
    assert!(
        why.contains("line 5") && why.contains("max-in-flight"),
        "the refusal does not name the line and key: {refused:?}"
    );
    committed.extend(commit_orders(&outbox, &["a"], 10, 0));
    check::wait_and_check(&sub, &committed, WAIT)?;
    assert!(
        wait_log(&log, "reload: stopping", 0).is_empty(),
        "a refused reload restarted the relay"
    );

    // A new client id needs a restart: named in a WARN line, the running one kept.
    write(&file, &good.replace("reload-device", "another-device"))?;
    signal(pid, "HUP")?;
    let warned = wait_log(&log, "reload: this setting needs a restart", 1);
    assert!(
        warned
            .iter()
            .any(|r| r["level"] == "WARN" && r["fields"]["key"] == "client-id"),
        "no WARN naming client-id: {warned:?}"
    );
    assert_eq!(wait_log(&log, "reload: done", 1).len(), 1);
    assert!(
        wait_log(&log, "reload: applied", 0).is_empty(),
        "a restart-only change was applied"
    );
    committed.extend(commit_orders(&outbox, &["a"], 10, 0));
    check::wait_and_check(&sub, &committed, WAIT)?;
    assert!(
        broker.kind() != BrokerKind::Mosquitto || !broker.log().contains("another-device"),
        "the relay connected with the new client id"
    );
    assert_eq!(stop(relay)?, Some(0));
    Ok(())
}

#[test]
fn sighup_without_a_config_file_is_logged_and_changes_nothing() -> TestResult {
    let broker = Broker::start()?;
    let dir = tempfile::tempdir()?;
    let outbox = open_device(dir.path());
    let db = dir.path().join("device.db");
    let log = dir.path().join("relay.log");
    let (db, url) = (db.to_string_lossy(), format!("mqtt://{}", broker.addr()));
    let child = relay(
        &[
            "relay",
            "--db",
            &db,
            "--log-format",
            "json",
            "--broker",
            &url,
            "--client-id",
            "no-file",
        ],
        &log,
    )?;
    let relay = ChildGuard::new(child);
    let sub = Subscriber::start(broker.addr(), "orders/#")?;
    assert!(sub.wait_subscribed(1, WAIT));
    assert!(!wait_log(&log, "", 1).is_empty(), "the relay logged nothing");
    signal(relay.id(), "HUP")?;
    assert_eq!(
        wait_log(&log, "SIGHUP: the relay runs without --config", 1).len(),
        1
    );
    let committed = commit_orders(&outbox, &["a"], 5, 0);
    check::wait_and_check(&sub, &committed, WAIT)?;
    assert_eq!(stop(relay)?, Some(0));
    Ok(())
}

/// The broken build the rotation test catches: a reload that restarts with the old settings.
#[cfg(feature = "mutants")]
#[test]
fn the_reload_keeps_running_config_mutant_is_caught() -> TestResult {
    if support::mutant::in_mutant_run() {
        return Ok(());
    }
    support::mutant::caught_by(
        "reload-keeps-running-config",
        "sighup_applies_a_rotated_password_and_new_pacing_and_loses_nothing",
        "committed messages lost",
    )?;
    Ok(())
}
