//! `edge-outbox relay --log-format json`: every line on stderr is one JSON object a JSON parser
//! reads (`timestamp`, `level`, `target`, `message`, `fields`), the fields keep their types, and
//! the password is not in them.
#![cfg(all(feature = "cli", unix))]

mod support;

use std::fs::File;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use serde_json::Value;
use support::{ChildGuard, WAIT};

type TestResult<T = ()> = Result<T, Box<dyn std::error::Error>>;

#[test]
fn every_log_line_is_a_json_object_with_typed_fields_and_no_secret() -> TestResult {
    let dir = tempfile::tempdir()?;
    // A port nobody listens on: the relay logs its connection failure at WARN, with the cause.
    let port = std::net::TcpListener::bind("127.0.0.1:0")?.local_addr()?.port();
    let password = dir.path().join("password");
    std::fs::write(&password, "s3cret-for-json-logs")?;
    let stderr = dir.path().join("relay.stderr");
    let child = Command::new(env!("CARGO_BIN_EXE_edge-outbox"))
        .args([
            "relay",
            "--client-id",
            "json-logs",
            "--log-format",
            "json",
            "--db",
        ])
        .arg(dir.path().join("device.db"))
        .args([
            "--broker",
            &format!("mqtt://127.0.0.1:{port}"),
            "--username",
            "device",
        ])
        .arg("--password-file")
        .arg(&password)
        .env_remove("RUST_LOG")
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(File::create(&stderr)?)
        .spawn()?;
    let mut child = ChildGuard::new(child);
    let deadline = Instant::now() + WAIT;
    let log = loop {
        let log = std::fs::read_to_string(&stderr)?;
        if log.contains("cannot connect") {
            break log;
        }
        assert!(Instant::now() < deadline, "no connection failure logged:\n{log}");
        std::thread::sleep(Duration::from_millis(50));
    };
    child.kill_and_wait();
    assert!(
        !log.contains("s3cret-for-json-logs"),
        "the password was logged:\n{log}"
    );
    let mut warned = false;
    for line in log.lines().filter(|l| !l.trim().is_empty()) {
        let record: Value = serde_json::from_str(line).map_err(|e| format!("{e}: {line}"))?;
        for key in ["timestamp", "level", "target", "message", "fields"] {
            assert!(record.get(key).is_some(), "no {key:?} in {line}");
        }
        let timestamp = record["timestamp"].as_str().unwrap_or_default();
        assert!(
            timestamp.len() == 24 && timestamp.ends_with('Z') && timestamp.as_bytes()[10] == b'T',
            "RFC 3339 in UTC: {timestamp}"
        );
        assert!(record["fields"].is_object(), "{line}");
        if record["level"] == "WARN"
            && record["message"]
                .as_str()
                .is_some_and(|m| m.contains("cannot connect"))
        {
            warned = true;
            assert!(
                record["fields"]["cause"].as_str().is_some_and(|c| !c.is_empty()),
                "the cause is a field: {line}"
            );
        }
    }
    assert!(warned, "a WARN record for the connection failure:\n{log}");
    Ok(())
}
