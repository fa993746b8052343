//! What an operator sees from outside the process: `edge-outbox metrics` and the relay's
//! `--metrics-file` in the Prometheus text format (parsed by Python's `prometheus_client`, both
//! its Prometheus and its OpenMetrics parser), the status file an application's relay writes when
//! asked, and an error that clears once its cause is gone.
#![cfg(feature = "cli")]

mod support;

use std::collections::HashMap;
use std::io::Write as _;
use std::path::Path;
use std::process::{Command, Stdio};
use std::time::Duration;

use edge_outbox::{MqttConfig, Outbox, Relay, RelayConfig, RelayReport};
use support::{Broker, ChildGuard, Proxy, wait_until};

type TestResult = Result<(), Box<dyn std::error::Error>>;

const BIN: &str = env!("CARGO_BIN_EXE_edge-outbox");

/// Samples by name and labels (`name{k=v,...}`), as Python's parser read them.
fn parse(text: &str) -> Result<HashMap<String, f64>, Box<dyn std::error::Error>> {
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/python/prom_parse.py");
    let mut child = Command::new(support::python::python())
        .arg(script)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()?;
    child.stdin.take().ok_or("stdin")?.write_all(text.as_bytes())?;
    let out = child.wait_with_output()?;
    if !out.status.success() {
        return Err(format!(
            "prometheus_client refused it: {}\n{text}",
            String::from_utf8_lossy(&out.stderr)
        )
        .into());
    }
    let samples: Vec<(String, HashMap<String, String>, f64)> = serde_json::from_slice(&out.stdout)?;
    Ok(samples
        .into_iter()
        .map(|(name, labels, value)| {
            let mut labels: Vec<String> = labels.into_iter().map(|(k, v)| format!("{k}={v}")).collect();
            labels.sort();
            let key = if labels.is_empty() {
                name
            } else {
                format!("{name}{{{}}}", labels.join(","))
            };
            (key, value)
        })
        .collect())
}

fn metrics_cli(db: &Path) -> Result<String, Box<dyn std::error::Error>> {
    let out = Command::new(BIN)
        .args(["--db", db.to_str().ok_or("path")?, "metrics"])
        .env_remove("RUST_LOG")
        .output()?;
    if !out.status.success() {
        return Err(format!("edge-outbox metrics: {}", String::from_utf8_lossy(&out.stderr)).into());
    }
    Ok(String::from_utf8(out.stdout)?)
}

fn commit(outbox: &Outbox, n: usize) -> edge_outbox::Result<()> {
    for i in 0..n {
        outbox.transaction(|tx| tx.publish("plant/metrics", "k", &format!("reading {i}")))?;
    }
    Ok(())
}

#[test]
#[cfg_attr(
    eo_skip_python,
    ignore = "needs python3: none on PATH, or EDGE_OUTBOX_SKIP=python (the build warning says which)"
)]
fn metrics_parse_with_prometheus_client_from_the_file_and_from_a_running_relay() -> TestResult {
    let dir = tempfile::tempdir()?;
    let db = dir.path().join("device.db");
    let outbox = Outbox::open(&db)?;
    commit(&outbox, 3)?;

    // From the database file alone: what is pending, and no relay.
    let m = parse(&metrics_cli(&db)?)?;
    assert_eq!(m.get("edge_outbox_pending_messages"), Some(&3.0), "{m:?}");
    assert_eq!(m.get("edge_outbox_relay_up"), Some(&0.0), "{m:?}");
    assert!(!m.contains_key("edge_outbox_relay_published_total"), "{m:?}");

    // The CLI relay keeps a metrics file; `metrics` then includes the relay's counters.
    let broker = Broker::start()?;
    let prom = dir.path().join("edge_outbox.prom");
    let mut relay = ChildGuard::new(
        Command::new(BIN)
            .args([
                "--db",
                db.to_str().ok_or("path")?,
                "relay",
                "--client-id",
                "metrics-test",
            ])
            .arg("--broker")
            .arg(format!("mqtt://{}:{}", broker.host(), broker.port()))
            .arg("--metrics-file")
            .arg(&prom)
            .env_remove("RUST_LOG")
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()?,
    );
    let acked = |text: &str| {
        parse(text)
            .ok()
            .and_then(|m| m.get("edge_outbox_relay_acknowledged_total").copied())
    };
    assert!(
        wait_until(|| std::fs::read_to_string(&prom).is_ok_and(|t| acked(&t) == Some(3.0))),
        "the metrics file shows the 3 PUBACKs: {:?}",
        std::fs::read_to_string(&prom)
    );
    let file = parse(&std::fs::read_to_string(&prom)?)?;
    assert_eq!(file.get("edge_outbox_relay_up"), Some(&1.0), "{file:?}");
    assert_eq!(file.get("edge_outbox_relay_connected"), Some(&1.0), "{file:?}");
    assert_eq!(
        file.get("edge_outbox_relay_ack_latency_seconds_count"),
        Some(&3.0),
        "{file:?}"
    );
    assert_eq!(
        file.get("edge_outbox_relay_ack_latency_seconds_bucket{le=+Inf}"),
        Some(&3.0),
        "{file:?}"
    );
    assert!(
        wait_until(|| metrics_cli(&db).is_ok_and(|t| acked(&t) == Some(3.0)
            && parse(&t).is_ok_and(|m| m.get("edge_outbox_pending_messages") == Some(&0.0)))),
        "`metrics` shows the running relay's counters and nothing pending"
    );
    let m = parse(&metrics_cli(&db)?)?;
    assert_eq!(
        m.get("edge_outbox_relay_dead_lettered_total{reason=refused}"),
        Some(&0.0),
        "{m:?}"
    );
    relay.kill_and_wait();
    drop(broker);
    Ok(())
}

fn report_of(db: &Path) -> Option<RelayReport> {
    RelayReport::read(db)
}

#[test]
fn an_application_relay_writes_the_status_file_and_its_error_clears_when_the_cause_is_gone() -> TestResult {
    let dir = tempfile::tempdir()?;
    let db = dir.path().join("device.db");
    let outbox = Outbox::open(&db)?;
    let broker = Broker::start()?;
    let proxy = Proxy::start(broker.addr())?;
    proxy.refuse(true);
    let mqtt = MqttConfig::new("127.0.0.1", proxy.port())
        .client_id("status-file")
        .connect_timeout(Duration::from_secs(2));
    let config = RelayConfig::new(mqtt)
        .reconnect_backoff(Duration::from_millis(20), Duration::from_millis(100))
        .status_file(true);
    let relay = Relay::start(&outbox, config)?;

    // Refused: the error is current, with its time, in the status and in the file.
    assert!(
        wait_until(|| report_of(&db).is_some_and(|r| !r.connected && r.last_error.is_some())),
        "the status file shows the outage: {:?}",
        report_of(&db)
    );
    let r = report_of(&db).ok_or("report")?;
    assert!(r.last_error_since_ms.is_some(), "{r:?}");
    assert!(r.is_fresh(), "{r:?}");
    let during = relay.status()?;
    assert!(
        during.last_error.is_some() && during.last_error_since.is_some(),
        "{during:?}"
    );
    let text = Command::new(BIN)
        .args(["--db", db.to_str().ok_or("path")?, "status"])
        .env_remove("RUST_LOG")
        .output()?;
    let text = String::from_utf8_lossy(&text.stdout).into_owned();
    assert!(
        text.contains("disconnected from") && text.contains("since"),
        "{text}"
    );

    // The broker comes back: the error clears and moves to the previous one.
    proxy.refuse(false);
    assert!(
        wait_until(|| relay
            .status()
            .is_ok_and(|s| s.connected && s.last_error.is_none())),
        "the error clears once connected: {:?}",
        relay.status()
    );
    let after = relay.status()?;
    assert!(
        after.previous_error.is_some() && after.previous_error_span.is_some(),
        "{after:?}"
    );
    assert!(
        wait_until(|| report_of(&db)
            .is_some_and(|r| r.connected && r.last_error.is_none() && r.previous_error.is_some())),
        "the status file follows: {:?}",
        report_of(&db)
    );
    relay.shutdown()?;
    assert!(report_of(&db).is_none(), "removed at shutdown");
    Ok(())
}

#[test]
fn a_relay_that_is_not_asked_writes_no_status_file() -> TestResult {
    let dir = tempfile::tempdir()?;
    let db = dir.path().join("device.db");
    let outbox = Outbox::open(&db)?;
    let broker = Broker::start()?;
    let relay = Relay::start(
        &outbox,
        RelayConfig::new(MqttConfig::new(broker.host(), broker.port()).client_id("no-status-file")),
    )?;
    assert!(wait_until(|| relay.status().is_ok_and(|s| s.connected)));
    commit(&outbox, 1)?;
    assert!(wait_until(|| outbox
        .stats()
        .is_ok_and(|s| s.pending_messages == 0)));
    assert!(!RelayReport::path(&db).exists());
    relay.shutdown()?;
    Ok(())
}
