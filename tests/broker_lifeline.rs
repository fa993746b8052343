//! A broker started by a test dies with the test process, however that ends: a test binary
//! killed with SIGKILL (a CI timeout, an operator's Ctrl-\) leaves no mosquitto or rumqttd
//! running.
//!
//! Broken build this catches: a harness that relies on `Drop` alone (a SIGKILLed process runs
//! none), which left mosquitto processes behind.

mod support;

use std::time::{Duration, Instant};

use support::child::{self, Child};
use support::{Broker, WAIT};

/// Whether `pid` still runs (a zombie waiting to be reaped has ended).
fn running(pid: u32) -> bool {
    std::fs::read_to_string(format!("/proc/{pid}/stat"))
        .ok()
        .and_then(|stat| stat.rsplit_once(") ").and_then(|(_, rest)| rest.chars().next()))
        .is_some_and(|state| state != 'Z' && state != 'X')
}

#[test]
#[ignore = "entry point of the child process of a_broker_dies_with_a_killed_test_process"]
fn broker_child() {
    if child::mode().as_deref() != Some("broker") {
        return;
    }
    let broker = Broker::start().expect("start a broker");
    child::say(&format!("pid {}", broker.pid().expect("a running broker")));
    std::thread::sleep(WAIT * 4);
}

#[test]
fn a_broker_dies_with_a_killed_test_process() -> Result<(), Box<dyn std::error::Error>> {
    let mut child = Child::start("broker_child", "broker", &[])?;
    let line = child
        .wait_for("pid ", WAIT)
        .ok_or("the child did not start its broker")?;
    let pid: u32 = line.trim_start_matches("pid ").parse()?;
    assert!(running(pid), "the broker is not running: {line}");
    child.kill();
    let deadline = Instant::now() + WAIT;
    while running(pid) {
        if Instant::now() >= deadline {
            // Not left behind by this test either.
            let _ = std::process::Command::new("kill")
                .arg("-9")
                .arg(pid.to_string())
                .status();
            return Err(format!("the broker (pid {pid}) outlived its killed test process").into());
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    Ok(())
}
