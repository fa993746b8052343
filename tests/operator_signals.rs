//! What an operator sees at the default log level: the first connection failure at WARN with its
//! cause (it used to be DEBUG: nothing appeared for a minute), repeats of the same failure not
//! repeated, and the recovery at INFO.
#![cfg(feature = "cli")]

mod support;

use std::fs::File;
use std::path::Path;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use support::{Broker, ChildGuard, Proxy, WAIT};

fn wait_log(path: &Path, what: &str, mut done: impl FnMut(&str) -> bool) -> String {
    let deadline = Instant::now() + WAIT;
    loop {
        let log = std::fs::read_to_string(path).unwrap_or_default();
        if done(&log) {
            return log;
        }
        assert!(
            Instant::now() < deadline,
            "waiting for {what}; log so far:\n{log}"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
}

#[test]
fn the_first_failure_is_a_warning_with_its_cause_and_repeats_are_not_repeated() {
    let broker = Broker::start().expect("broker");
    let proxy = Proxy::start(broker.addr()).expect("proxy");
    proxy.refuse(true);
    let dir = tempfile::tempdir().expect("tempdir");
    let stderr = dir.path().join("relay.stderr");
    let child = Command::new(env!("CARGO_BIN_EXE_edge-outbox"))
        .args(["relay", "--client-id", "signals", "--db"])
        .arg(dir.path().join("device.db"))
        .args(["--broker", &format!("mqtt://{}", proxy.addr())])
        .env_remove("RUST_LOG")
        .stdout(Stdio::null())
        .stderr(File::create(&stderr).expect("stderr file"))
        .spawn()
        .expect("relay");
    let _relay = ChildGuard::new(child);

    // Several attempts, each refused the same way.
    assert!(proxy.wait_accepted(4, WAIT), "the relay keeps trying");
    let log = wait_log(&stderr, "the first failure", |l| l.contains("cannot connect"));
    let failures: Vec<&str> = log.lines().filter(|l| l.contains("cannot connect")).collect();
    assert_eq!(failures.len(), 1, "one WARN for a repeated failure:\n{log}");
    assert!(failures[0].contains("WARN"), "{}", failures[0]);
    assert!(
        failures[0].contains("cause="),
        "the cause is given: {}",
        failures[0]
    );
    assert!(
        !log.lines().any(|l| l.contains("still failing")),
        "the same cause is not repeated within a minute:\n{log}"
    );

    proxy.refuse(false);
    // A PUBACK proves the new connection healthy (otherwise: one keep-alive, 30 s by default).
    let outbox = edge_outbox::Outbox::open(dir.path().join("device.db")).expect("open");
    outbox
        .transaction(|tx| tx.publish("signals/t", "k", &1))
        .expect("commit");
    let log = wait_log(&stderr, "the recovery", |l| l.contains("connected again after"));
    let recovered = log
        .lines()
        .find(|l| l.contains("connected again after"))
        .unwrap_or_default();
    assert!(recovered.contains("INFO"), "{recovered}");
}

#[test]
fn the_command_session_reports_its_outage_and_its_recovery_the_same_way() {
    let broker = Broker::start().expect("broker");
    let proxy = Proxy::start(broker.addr()).expect("proxy");
    proxy.refuse(true);
    let dir = tempfile::tempdir().expect("tempdir");
    let stderr = dir.path().join("relay.stderr");
    let child = Command::new(env!("CARGO_BIN_EXE_edge-outbox"))
        .args([
            "relay",
            "--client-id",
            "signals-cmd",
            "--commands",
            "signals/commands/#",
            "--db",
        ])
        .arg(dir.path().join("device.db"))
        .args(["--broker", &format!("mqtt://{}", proxy.addr())])
        .env_remove("RUST_LOG")
        .stdout(Stdio::null())
        .stderr(File::create(&stderr).expect("stderr file"))
        .spawn()
        .expect("relay");
    let _relay = ChildGuard::new(child);

    let session =
        |l: &str| l.contains("session=\"command session\"") || l.contains("session=command session");
    // Both sessions try, several times each.
    assert!(proxy.wait_accepted(8, WAIT), "the sessions keep trying");
    let log = wait_log(&stderr, "the command session's first failure", |l| {
        l.lines().any(|l| session(l) && l.contains("cannot connect"))
    });
    let failures: Vec<&str> = log
        .lines()
        .filter(|l| session(l) && l.contains("cannot connect"))
        .collect();
    assert_eq!(failures.len(), 1, "one WARN for a repeated failure:\n{log}");
    assert!(
        failures[0].contains("WARN") && failures[0].contains("cause="),
        "{}",
        failures[0]
    );

    proxy.refuse(false);
    // A granted SUBACK proves the command session healthy.
    let log = wait_log(&stderr, "the command session's recovery", |l| {
        l.lines()
            .any(|l| session(l) && l.contains("connected again after"))
    });
    let recovered = log
        .lines()
        .find(|l| session(l) && l.contains("connected again after"))
        .unwrap_or_default();
    assert!(recovered.contains("INFO"), "{recovered}");
}
