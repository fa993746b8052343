//! `edge-outbox relay --config FILE`: a config file says what the options say, an option on the
//! command line wins over its key, every kind of error names the file, its line and the key
//! (exit 2), and a relay started from a file alone publishes.
//!
//! The settings are compared through `config check`, which prints what the relay would run with:
//! the same file and options give the same settings as `relay --config` (both go through one
//! merge), and a key the merge forgot shows up as a difference from its option.
#![cfg(all(feature = "cli", unix))]

mod support;

use std::path::Path;
use std::process::{Command, Output, Stdio};

use edge_outbox::Outbox;
use serde_json::Value;
use support::{Broker, ChildGuard, Pki, Subscriber, WAIT};

type TestResult<T = ()> = Result<T, Box<dyn std::error::Error>>;

fn edge_outbox(args: &[&str]) -> TestResult<Output> {
    Ok(Command::new(env!("CARGO_BIN_EXE_edge-outbox"))
        .args(args)
        .env_remove("RUST_LOG")
        .stdin(Stdio::null())
        .output()?)
}

/// The effective settings of `config check FILE OPTIONS...`, as JSON.
fn settings(file: &Path, options: &[&str]) -> TestResult<Value> {
    let path = file.to_string_lossy();
    let mut args = vec!["--json", "config", "check", &path];
    args.extend_from_slice(options);
    let out = edge_outbox(&args)?;
    if !out.status.success() {
        return Err(format!(
            "config check {options:?} failed: {}",
            String::from_utf8_lossy(&out.stderr)
        )
        .into());
    }
    Ok(serde_json::from_slice(&out.stdout)?)
}

fn write(dir: &Path, name: &str, text: &str) -> TestResult<std::path::PathBuf> {
    let path = dir.join(name);
    std::fs::write(&path, text)?;
    Ok(path)
}

/// Each flag set docs/operations.md shows, as options and as a file: the same settings.
#[test]
fn a_file_says_what_each_documented_set_of_options_says() -> TestResult {
    let dir = tempfile::tempdir()?;
    let d = dir.path();
    let pki = Pki::generate(&d.join("pki"), "config")?;
    let password = write(d, "mqtt-password", "s3cret\n")?;
    let empty = write(d, "empty.toml", "")?;
    let sas_key = write(d, "sas-key", "AAECAwQFBgcICQoLDA0ODxAREhMUFRYXGBkaGxwdHh8=\n")?;
    let sas_key = sas_key.to_string_lossy().into_owned();
    let db = d.join("outbox.db");
    let (db, ca, cert, key, password) = (
        db.to_string_lossy().into_owned(),
        pki.ca_cert.to_string_lossy().into_owned(),
        pki.client_cert.to_string_lossy().into_owned(),
        pki.client_key.to_string_lossy().into_owned(),
        password.to_string_lossy().into_owned(),
    );
    let sets: Vec<(Vec<&str>, String)> = vec![
        (
            // "relay": TLS with client certificates, credentials, commands and a status topic.
            vec![
                "--db",
                &db,
                "--broker",
                "mqtts://broker.example:8883",
                "--client-id",
                "pump-17",
                "--ca",
                &ca,
                "--cert",
                &cert,
                "--key",
                &key,
                "--username",
                "pump-17",
                "--password-file",
                &password,
                "--commands",
                "devices/pump-17/commands/#",
                "--status-topic",
                "devices/pump-17/status",
            ],
            format!(
                "db = {db:?}\nbroker = \"mqtts://broker.example:8883\"\nclient-id = \"pump-17\"\n\
                 ca = {ca:?}\ncert = {cert:?}\nkey = {key:?}\nusername = \"pump-17\"\n\
                 password-file = {password:?}\ncommands = \"devices/pump-17/commands/#\"\n\
                 status-topic = \"devices/pump-17/status\"\n"
            ),
        ),
        (
            // "On a metered link": pacing and expiry.
            vec![
                "--db",
                &db,
                "--broker",
                "mqtt://127.0.0.1:1883",
                "--client-id",
                "pump-17",
                "--pace-messages",
                "20",
                "--pace-bytes",
                "4096",
                "--expire",
                "telemetry/#=3600",
                "--expire",
                "logs/#=60",
                "--no-message-expiry",
            ],
            format!(
                "db = {db:?}\nbroker = [\"mqtt://127.0.0.1:1883\"]\nclient-id = \"pump-17\"\n\
                 pace-messages = 20\npace-bytes = 4096\nexpire = [\"telemetry/#=3600\", \"logs/#=60\"]\n\
                 no-message-expiry = true\n"
            ),
        ),
        (
            // "On port 443 only": ALPN for AWS IoT Core.
            vec![
                "--db",
                &db,
                "--client-id",
                "pump-17",
                "--broker",
                "mqtts://a1b2c3d4e5f6g7-ats.iot.eu-west-1.amazonaws.com:443",
                "--alpn",
                "x-amzn-mqtt-ca",
                "--ca",
                &ca,
                "--cert",
                &cert,
                "--key",
                &key,
            ],
            format!(
                "db = {db:?}\nclient-id = \"pump-17\"\n\
                 broker = \"mqtts://a1b2c3d4e5f6g7-ats.iot.eu-west-1.amazonaws.com:443\"\n\
                 alpn = [\"x-amzn-mqtt-ca\"]\nca = {ca:?}\ncert = {cert:?}\nkey = {key:?}\n"
            ),
        ),
        (
            // "Connecting to Azure IoT Hub": a SAS key, tokens renewed.
            vec![
                "--db",
                &db,
                "--client-id",
                "pump-17",
                "--broker",
                "mqtts://my-hub.azure-devices.net:8883",
                "--mqtt-version",
                "3.1.1",
                "--sas-key-file",
                &sas_key,
                "--sas-lifetime",
                "600",
            ],
            format!(
                "db = {db:?}\nclient-id = \"pump-17\"\nbroker = \"mqtts://my-hub.azure-devices.net:8883\"\n\
                 mqtt-version = \"3.1.1\"\nsas-key-file = {sas_key:?}\nsas-lifetime = 600\n"
            ),
        ),
        (
            // "Behind a proxy or on 443 only": an HTTP proxy and the brokers reached directly.
            vec![
                "--db",
                &db,
                "--client-id",
                "pump-17",
                "--broker",
                "mqtts://broker.example.com:8883",
                "--proxy",
                "http://proxy.corp.example:3128",
                "--no-proxy",
                "localhost,.plant.local",
            ],
            format!(
                "db = {db:?}\nclient-id = \"pump-17\"\nbroker = \"mqtts://broker.example.com:8883\"\n\
                 proxy = \"http://proxy.corp.example:3128\"\nno-proxy = \"localhost,.plant.local\"\n"
            ),
        ),
        (
            // Every other option: batching, windows, timeouts, metrics, logs, a failover list.
            vec![
                "--db",
                &db,
                "--busy-timeout",
                "9000",
                "--broker",
                "mqtt://127.0.0.1:1883",
                "--broker",
                "mqtt://127.0.0.1:1884",
                "--mqtt-version",
                "3.1.1",
                "--client-id",
                "pump-17",
                "--src",
                "pump-17-site-a",
                "--commands",
                "cmd/#",
                "--commands-client-id",
                "pump-17-cmd",
                "--max-in-flight",
                "20",
                "--shutdown-timeout",
                "9",
                "--ack-timeout",
                "30",
                "--poison-disconnects",
                "0",
                "--topic-aliases",
                "--metrics-file",
                "/tmp/edge_outbox.prom",
                "--metrics-mode",
                "640",
                "--progress",
                "--batch",
                "telemetry/#",
                "--batch",
                "logs/#",
                "--batch-max-bytes",
                "8192",
                "--batch-linger-ms",
                "10",
                "--batch-zlib",
                "--log-format",
                "json",
                "--log-level",
                "debug",
            ],
            format!(
                "db = {db:?}\nbusy-timeout = 9000\n\
                 broker = [\"mqtt://127.0.0.1:1883\", \"mqtt://127.0.0.1:1884\"]\n\
                 mqtt-version = \"3.1.1\"\nclient-id = \"pump-17\"\nsrc = \"pump-17-site-a\"\n\
                 commands = \"cmd/#\"\ncommands-client-id = \"pump-17-cmd\"\nmax-in-flight = 20\n\
                 shutdown-timeout = 9\nack-timeout = 30\npoison-disconnects = 0\n\
                 topic-aliases = true\nmetrics-file = \"/tmp/edge_outbox.prom\"\n\
                 metrics-mode = \"640\"\nprogress = true\nbatch = [\"telemetry/#\", \"logs/#\"]\n\
                 batch-max-bytes = 8192\nbatch-linger-ms = 10\nbatch-zlib = true\n\
                 log-format = \"json\"\nlog-level = \"debug\"\n"
            ),
        ),
    ];
    let defaults = settings(
        &write(
            d,
            "minimal.toml",
            &format!("db = {db:?}\nbroker = \"mqtt://h\"\nclient-id = \"x\"\n"),
        )?,
        &[],
    )?;
    for (i, (options, text)) in sets.iter().enumerate() {
        let from_options = settings(&empty, options)?;
        let from_file = settings(&write(d, &format!("set{i}.toml"), text)?, &[])?;
        assert_eq!(
            from_file, from_options,
            "flag set {i}: the file and the options differ"
        );
        assert_ne!(
            from_file, defaults,
            "flag set {i} changes nothing: the comparison proves nothing"
        );
    }
    // A secret is named, never shown.
    let shown = settings(
        &write(
            d,
            "url.toml",
            "broker = \"mqtt://pump:s3cret@h\"\nclient-id = \"x\"\nproxy = \"http://dev:pr0xy-s3cret@proxy:3128\"\n",
        )?,
        &[],
    )?;
    assert_eq!(shown["broker"][0], "mqtt://pump:***@h");
    assert_eq!(shown["proxy"], "http://dev:***@proxy:3128");
    assert!(!shown.to_string().contains("s3cret"));
    Ok(())
}

#[test]
fn an_option_on_the_command_line_wins_over_its_key() -> TestResult {
    let dir = tempfile::tempdir()?;
    let file = write(
        dir.path(),
        "relay.toml",
        "db = \"/var/lib/edge-outbox/outbox.db\"\nbroker = [\"mqtt://a:1883\", \"mqtt://b:1883\"]\n\
         client-id = \"from-file\"\nmax-in-flight = 50\nlog-level = \"warn\"\nbatch = [\"t/#\"]\n",
    )?;
    let s = settings(
        &file,
        &[
            "--max-in-flight",
            "7",
            "--broker",
            "mqtt://c:1883",
            "--db",
            "/tmp/x.db",
        ],
    )?;
    assert_eq!(s["max-in-flight"], 7, "the option wins");
    assert_eq!(
        s["broker"],
        serde_json::json!(["mqtt://c:1883"]),
        "a repeated option replaces the whole list"
    );
    assert_eq!(s["db"], "/tmp/x.db");
    assert_eq!(s["client-id"], "from-file", "keys without an option given stay");
    assert_eq!(s["log-level"], "warn");
    assert_eq!(s["batch"], serde_json::json!(["t/#"]));
    // The database options before the command name win too.
    let path = file.to_string_lossy();
    let out = edge_outbox(&["--json", "--db", "/tmp/y.db", "config", "check", &path])?;
    let s: Value = serde_json::from_slice(&out.stdout)?;
    assert_eq!(s["db"], "/tmp/y.db");
    Ok(())
}

#[test]
fn each_kind_of_error_names_the_file_its_line_and_the_key() -> TestResult {
    let dir = tempfile::tempdir()?;
    let cases = [
        (
            "client-id = \"x\"\nmax-inflight = 3\n",
            "line 2, key max-inflight",
            "unknown field",
        ),
        ("client-id = 5\n", "line 1, key client-id", "expected a string"),
        (
            "client-id = \"x\"\n\nmax-in-flight = 0\n",
            "line 3, key max-in-flight",
            "at least 1",
        ),
        (
            "client-id = \"x\"\nmetrics-mode = \"777\"\n",
            "line 2, key metrics-mode",
            "600, 640 or 644",
        ),
        (
            "client-id = \"x\"\nexpire = [\"t/#\"]\n",
            "line 2, key expire",
            "FILTER=SECS",
        ),
        (
            "broker = \"ftp://h\"\n",
            "line 1, key broker",
            "scheme must be mqtt, mqtts, ws or wss",
        ),
        (
            "mqtt-version = \"4\"\n",
            "line 1, key mqtt-version",
            "expected 5 or 3.1.1",
        ),
        (
            "log-level = \"loud\"\n",
            "line 1, key log-level",
            "unknown variant",
        ),
        ("client-id = \"x\n", "line 1", "invalid"),
    ];
    for (i, (text, place, why)) in cases.iter().enumerate() {
        let file = write(dir.path(), &format!("bad{i}.toml"), text)?;
        for command in ["check", "relay"] {
            let path = file.to_string_lossy();
            let args: Vec<&str> = if command == "check" {
                vec!["config", "check", &path]
            } else {
                vec!["relay", "--config", &path]
            };
            let out = edge_outbox(&args)?;
            let stderr = String::from_utf8_lossy(&out.stderr);
            assert_eq!(out.status.code(), Some(2), "{command} on case {i}: {stderr}");
            let named = format!("config file {}, {place}", file.display());
            assert!(
                stderr.contains(&named),
                "{command} on case {i}: {stderr:?} lacks {named:?}"
            );
            assert!(
                stderr.contains(why),
                "{command} on case {i}: {stderr:?} lacks {why:?}"
            );
        }
    }
    // A key that needs another, and a relay without a client id anywhere.
    let lone = write(
        dir.path(),
        "lone.toml",
        "broker = \"mqtt://h\"\nclient-id = \"x\"\ncert = \"/c.pem\"\n",
    )?;
    let out = edge_outbox(&["config", "check", &lone.to_string_lossy()])?;
    assert_eq!(out.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&out.stderr).contains("cert needs key"));
    let nameless = write(dir.path(), "nameless.toml", "broker = \"mqtt://h\"\n")?;
    let out = edge_outbox(&["config", "check", &nameless.to_string_lossy()])?;
    assert_eq!(out.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&out.stderr).contains("--client-id is required"));
    Ok(())
}

/// The relay started with nothing but `--config` publishes what the database holds.
#[test]
fn a_relay_started_from_a_file_alone_publishes() -> TestResult {
    let broker = Broker::start()?;
    let dir = tempfile::tempdir()?;
    let db = dir.path().join("device.db");
    {
        let outbox = Outbox::open(&db)?;
        outbox.transaction(|tx| tx.publish("config/t", "k", &1u32))?;
    }
    let file = write(
        dir.path(),
        "relay.toml",
        &format!(
            "db = {:?}\nbroker = \"mqtt://{}\"\nclient-id = \"from-file\"\nlog-format = \"json\"\n",
            db.to_string_lossy(),
            broker.addr()
        ),
    )?;
    let sub = Subscriber::start(broker.addr(), "config/#")?;
    let child = Command::new(env!("CARGO_BIN_EXE_edge-outbox"))
        .args(["relay", "--config", &file.to_string_lossy()])
        .env_remove("RUST_LOG")
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()?;
    let _relay = ChildGuard::new(child);
    assert!(
        sub.wait_for(1, WAIT),
        "nothing published by the relay started from the file"
    );
    Ok(())
}

/// The shipped example config is valid as it is, and so is every key it shows commented out.
#[test]
fn the_example_config_checks_and_its_commented_keys_exist() -> TestResult {
    let example = concat!(env!("CARGO_MANIFEST_DIR"), "/contrib/edge-outbox/relay.toml");
    let out = edge_outbox(&["config", "check", example])?;
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let text = std::fs::read_to_string(example)?;
    let mut keys = 0;
    let uncommented: String = text
        .lines()
        .map(|line| match line.strip_prefix("# ") {
            Some(rest)
                if rest
                    .split_once(" = ")
                    .is_some_and(|(k, _)| k.chars().all(|c| c.is_ascii_lowercase() || c == '-')) =>
            {
                keys += 1;
                format!("{rest}\n")
            }
            _ => format!("{line}\n"),
        })
        .collect();
    assert!(
        keys >= 25,
        "only {keys} commented keys found: the example's form changed"
    );
    let dir = tempfile::tempdir()?;
    let file = write(dir.path(), "all.toml", &uncommented)?;
    let out = edge_outbox(&["config", "check", &file.to_string_lossy()])?;
    let stderr = String::from_utf8_lossy(&out.stderr);
    // The files it names do not exist here, so the check may fail later, but not on a key.
    assert!(
        !stderr.contains("config file"),
        "a commented key is not valid: {stderr}"
    );
    Ok(())
}

/// `password-env` names a variable: an unset one is a usage error naming it, a set one is read
/// and never printed.
#[test]
fn a_password_from_the_environment_is_read_and_never_shown() -> TestResult {
    let dir = tempfile::tempdir()?;
    let file = write(
        dir.path(),
        "env.toml",
        "broker = \"mqtt://h\"\nclient-id = \"x\"\nusername = \"u\"\npassword-env = \"EDGE_OUTBOX_TEST_PASSWORD\"\n",
    )?;
    let path = file.to_string_lossy();
    let unset = Command::new(env!("CARGO_BIN_EXE_edge-outbox"))
        .args(["config", "check", &path])
        .env_remove("EDGE_OUTBOX_TEST_PASSWORD")
        .output()?;
    assert_eq!(unset.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&unset.stderr).contains("EDGE_OUTBOX_TEST_PASSWORD"));
    let set = Command::new(env!("CARGO_BIN_EXE_edge-outbox"))
        .args(["--json", "config", "check", &path])
        .env("EDGE_OUTBOX_TEST_PASSWORD", "s3cret-from-env")
        .output()?;
    assert!(set.status.success(), "{}", String::from_utf8_lossy(&set.stderr));
    let s: Value = serde_json::from_slice(&set.stdout)?;
    assert_eq!(s["password-env"], "EDGE_OUTBOX_TEST_PASSWORD");
    assert!(!String::from_utf8_lossy(&set.stdout).contains("s3cret-from-env"));
    assert!(!String::from_utf8_lossy(&set.stderr).contains("s3cret-from-env"));
    Ok(())
}
