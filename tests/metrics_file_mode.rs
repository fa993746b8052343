//! The relay's metrics file is owner-only by default, like the database, and readable by the
//! textfile collector's user when asked (`--metrics-mode 640`, `RelayConfig::metrics_file_mode`),
//! exactly, whatever the umask. A mode that would let others write or execute it is refused.
#![cfg(all(feature = "cli", unix))]

mod support;

use std::os::unix::fs::PermissionsExt as _;
use std::path::Path;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use support::{Broker, ChildGuard, WAIT};

type TestResult<T = ()> = Result<T, Box<dyn std::error::Error>>;

/// Starts the relay under `umask 077` (as the shipped unit sets it) and returns the metrics
/// file's permission bits once it is written.
fn mode_written(dir: &Path, broker: &Broker, mode: Option<&str>) -> TestResult<u32> {
    let metrics = dir.join("edge_outbox.prom");
    let mut script = format!(
        "umask 077; exec \"$0\" relay --client-id modes --db {} --broker mqtt://{} --metrics-file {}",
        dir.join("device.db").display(),
        broker.addr(),
        metrics.display()
    );
    if let Some(mode) = mode {
        script.push_str(&format!(" --metrics-mode {mode}"));
    }
    let child = Command::new("sh")
        .args(["-c", &script, env!("CARGO_BIN_EXE_edge-outbox")])
        .env_remove("RUST_LOG")
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()?;
    let _relay = ChildGuard::new(child);
    let deadline = Instant::now() + WAIT;
    loop {
        if let Ok(meta) = std::fs::metadata(&metrics) {
            return Ok(meta.permissions().mode() & 0o777);
        }
        if Instant::now() >= deadline {
            return Err("the metrics file was not written".into());
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

#[test]
fn the_metrics_file_is_owner_only_by_default_and_group_readable_when_asked() -> TestResult {
    let broker = Broker::start()?;
    let dir = tempfile::tempdir()?;
    assert_eq!(
        mode_written(dir.path(), &broker, None)?,
        0o600,
        "owner only by default"
    );
    let dir = tempfile::tempdir()?;
    assert_eq!(
        mode_written(dir.path(), &broker, Some("640"))?,
        0o640,
        "group-readable, although the umask is 077"
    );
    Ok(())
}

#[test]
fn a_mode_letting_others_write_or_execute_is_a_usage_error() -> TestResult {
    let dir = tempfile::tempdir()?;
    for mode in ["666", "0755", "400", "rw-r-----"] {
        let out = Command::new(env!("CARGO_BIN_EXE_edge-outbox"))
            .args(["relay", "--client-id", "modes", "--db"])
            .arg(dir.path().join("device.db"))
            .args(["--broker", "mqtt://127.0.0.1:1", "--metrics-file"])
            .arg(dir.path().join("m.prom"))
            .args(["--metrics-mode", mode])
            .stdin(Stdio::null())
            .output()?;
        assert_eq!(out.status.code(), Some(2), "{mode}: {out:?}");
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(stderr.contains("--metrics-mode"), "{mode}: {stderr}");
        assert!(
            !dir.path().join("device.db").exists(),
            "nothing created for a usage error"
        );
    }
    let config = edge_outbox::RelayConfig::new(edge_outbox::MqttConfig::new("127.0.0.1", 1))
        .metrics_file(dir.path().join("m.prom"))
        .metrics_file_mode(0o666);
    let outbox = edge_outbox::Outbox::open(dir.path().join("lib.db"))?;
    // Others may write; and the owner may not (a file the relay could not rewrite).
    for mode in [0o666, 0o440] {
        let config = config.clone().metrics_file_mode(mode);
        match edge_outbox::Relay::start(&outbox, config) {
            Err(edge_outbox::Error::InvalidConfig(why)) => {
                assert!(why.contains("metrics_file_mode"), "{why}")
            }
            other => {
                return Err(format!(
                    "{mode:o}: expected InvalidConfig, got {:?}",
                    other.map(|_| "a relay")
                )
                .into());
            }
        }
    }
    Ok(())
}
