//! Secrets and permissions: a password given in the broker URL is used and never printed (not in
//! the logs at any level, not in `status`, `status --json` or the status file, not in an error
//! about the URL), and what the relay creates is its owner's only whatever the umask: the
//! directories 0700, the database, the relay lock and the status file 0600. The lock is named
//! after the canonical path: two spellings of one database are one lock.
#![cfg(feature = "cli")]

mod support;

use std::fs::File;
use std::os::unix::fs::PermissionsExt as _;
use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};
use std::time::{Duration, Instant};

use support::{Broker, BrokerKind, ChildGuard, Subscriber, WAIT, check};

const SECRET: &str = "S3cr3t-n0t-f0r-l0gs";
const USER: &str = "pump-17";

fn edge_outbox() -> Command {
    Command::new(env!("CARGO_BIN_EXE_edge-outbox"))
}

fn run(db: &Path, args: &[&str]) -> Output {
    edge_outbox()
        .arg("--db")
        .arg(db)
        .args(args)
        .output()
        .expect("run edge-outbox")
}

fn text(o: &Output) -> String {
    format!(
        "{}{}",
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr)
    )
}

fn mode(path: &Path) -> u32 {
    std::fs::metadata(path)
        .unwrap_or_else(|e| panic!("{}: {e}", path.display()))
        .permissions()
        .mode()
        & 0o777
}

/// A broker that requires a login (mosquitto's password file, rumqttd's login table): the
/// password must be right for anything to be delivered.
fn broker(_dir: &Path) -> Broker {
    Broker::builder()
        .user(USER, SECRET)
        .user("checker", "checker-pw")
        .start()
        .expect("broker")
}

/// A relay child process, killed if the test fails before it is stopped.
struct Relay {
    child: ChildGuard,
    stderr: PathBuf,
}

#[test]
fn a_password_in_the_url_is_used_and_never_printed_and_files_are_owner_only() {
    let tmp = tempfile::tempdir().expect("tempdir");
    let broker = broker(tmp.path());
    let sub = Subscriber::builder(broker.addr())
        .filter("orders/#")
        .credentials("checker", "checker-pw")
        .start()
        .expect("subscriber");
    // Directories the relay must create, under a umask that would make everything world-readable.
    let db = tmp.path().join("new").join("sub").join("device.db");
    let url = format!("mqtt://{USER}:{SECRET}@127.0.0.1:{}", broker.port());
    let stderr = tmp.path().join("relay.stderr");
    let child = Command::new("sh")
        .arg("-c")
        .arg("umask 000 && exec \"$@\"")
        .arg("sh")
        .arg(env!("CARGO_BIN_EXE_edge-outbox"))
        .args([
            "relay",
            "--client-id",
            USER,
            "--status-topic",
            "devices/pump-17/status",
        ])
        .args(["--broker", &url, "--db"])
        .arg(&db)
        .env("RUST_LOG", "trace")
        .stdout(Stdio::null())
        .stderr(File::create(&stderr).expect("stderr file"))
        .spawn()
        .expect("start the relay");
    let relay = Relay {
        child: ChildGuard::new(child),
        stderr,
    };

    // Wait for the relay to create the file, then write through the SQL contract.
    let deadline = Instant::now() + WAIT;
    while !run(&db, &["status", "--json"]).status.success() {
        assert!(Instant::now() < deadline, "no database: {}", read(&relay.stderr));
        std::thread::sleep(Duration::from_millis(50));
    }
    let outbox = edge_outbox::Outbox::open(&db).expect("open");
    let committed: Vec<_> = (0..5)
        .map(|i| {
            let id = outbox
                .transaction(|tx| tx.publish("orders/secret", "k", &i))
                .expect("commit")
                .ids[0];
            (id, "k".to_owned())
        })
        .collect();
    check::wait_and_check(&sub, &committed, WAIT).unwrap_or_else(|e| {
        panic!(
            "delivered with the URL's credentials: {e}\n{}",
            read(&relay.stderr)
        )
    });

    // Wait for a status file that reports the relay connected.
    let status_file = PathBuf::from(format!("{}.relay-status.json", db.display()));
    let deadline = Instant::now() + WAIT;
    while !read(&status_file).contains("\"connected\": true") {
        assert!(
            Instant::now() < deadline,
            "no status file: {}",
            read(&relay.stderr)
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    let status = run(&db, &["status"]);
    let json = run(&db, &["status", "--json"]);
    assert!(
        status.status.success() && json.status.success(),
        "{}",
        text(&status)
    );
    assert!(
        text(&status).contains("connected to 127.0.0.1"),
        "{}",
        text(&status)
    );
    let file = read(&status_file);

    // Permissions, under umask 000.
    assert_eq!(mode(&tmp.path().join("new")), 0o700, "created directory");
    assert_eq!(
        mode(&tmp.path().join("new").join("sub")),
        0o700,
        "created directory"
    );
    assert_eq!(mode(&db), 0o600, "database");
    assert_eq!(
        mode(&PathBuf::from(format!("{}.relay-lock", db.display()))),
        0o600,
        "relay lock"
    );
    assert_eq!(mode(&status_file), 0o600, "status file");
    // The published watermark, written by the marker once the messages above are acknowledged.
    let watermark = PathBuf::from(format!("{}.published", db.display()));
    let deadline = Instant::now() + WAIT;
    while !watermark.exists() {
        assert!(Instant::now() < deadline, "no published watermark");
        std::thread::sleep(Duration::from_millis(20));
    }
    assert_eq!(mode(&watermark), 0o600, "published watermark");

    // A second relay on another spelling of the same path is refused (exit 4).
    let dotted = tmp
        .path()
        .join("new")
        .join(".")
        .join("sub")
        .join("..")
        .join("sub")
        .join("device.db");
    let second = run(
        &dotted,
        &[
            "relay",
            "--client-id",
            "second",
            "--broker",
            &format!("mqtt://127.0.0.1:{}", broker.port()),
        ],
    );
    assert_eq!(second.status.code(), Some(4), "{}", text(&second));

    // A bad URL: the error names it without the password.
    let bad = run(
        &tmp.path().join("other.db"),
        &[
            "relay",
            "--client-id",
            "x",
            "--broker",
            &format!("mqtt://{USER}:{SECRET}@h:notaport"),
        ],
    );
    assert_eq!(bad.status.code(), Some(2), "{}", text(&bad));
    assert!(text(&bad).contains("***"), "{}", text(&bad));

    let status_kill = Command::new("kill")
        .args(["-TERM", &relay.child.id().to_string()])
        .status()
        .expect("kill");
    assert!(status_kill.success());
    let deadline = Instant::now() + WAIT;
    let mut relay = relay;
    while relay.child.try_wait().expect("wait").is_none() {
        assert!(Instant::now() < deadline, "the relay did not stop");
        std::thread::sleep(Duration::from_millis(20));
    }
    let log = read(&relay.stderr);
    assert!(
        log.contains("password in --broker is visible"),
        "a warning about argv: {log}"
    );
    for (what, haystack) in [
        ("the relay's log (RUST_LOG=trace)", log.as_str()),
        ("status", &text(&status)),
        ("status --json", &text(&json)),
        ("the status file", &file),
        ("the bad URL's error", &text(&bad)),
        ("the second relay's error", &text(&second)),
    ] {
        assert!(
            !haystack.contains(SECRET),
            "the password is printed in {what}:\n{haystack}"
        );
    }
}

#[test]
fn a_refused_password_is_reported_without_it() {
    let tmp = tempfile::tempdir().expect("tempdir");
    let broker = broker(tmp.path());
    let wrong = "wr0ng-S3cr3t-guess";
    let outbox = support::device::open_device(tmp.path());
    let mqtt =
        edge_outbox::MqttConfig::from_url(&format!("mqtt://{USER}:{wrong}@127.0.0.1:{}", broker.port()))
            .expect("url")
            .client_id("refused")
            .connect_timeout(Duration::from_secs(2));
    let relay = edge_outbox::Relay::start(&outbox, edge_outbox::RelayConfig::new(mqtt)).expect("relay");
    let deadline = Instant::now() + WAIT;
    let error = loop {
        if let Some(e) = relay.status().expect("status").last_error {
            break e;
        }
        assert!(Instant::now() < deadline, "no error");
        std::thread::sleep(Duration::from_millis(20));
    };
    // mosquitto answers a bad login with a refusing CONNACK; rumqttd closes the connection.
    if broker.kind() == BrokerKind::Mosquitto {
        assert!(error.contains("refused"), "{error}");
    }
    assert!(!error.contains(wrong), "{error}");
    let debug = format!("{:?}", relay.status().expect("status"));
    assert!(!debug.contains(wrong), "{debug}");
    relay.shutdown().expect("shutdown");
}

fn read(path: &Path) -> String {
    std::fs::read_to_string(path).unwrap_or_default()
}

/// Every malformed broker URL the CLI refuses, whatever is wrong with it (no scheme, as an
/// operator types it; a port that is not a number; TLS options on a plain URL), is a usage error
/// that shows the URL with its password replaced.
#[test]
fn a_refused_broker_url_never_shows_its_password() {
    let tmp = tempfile::tempdir().expect("tempdir");
    let ca = tmp.path().join("ca.pem");
    std::fs::write(&ca, "not a certificate").expect("ca file");
    let cases: [(&str, Vec<String>); 4] = [
        ("no scheme", vec![format!("{USER}:{SECRET}@127.0.0.1:1883")]),
        ("no scheme, no port", vec![format!("{USER}:{SECRET}@broker")]),
        ("a bad port", vec![format!("mqtt://{USER}:{SECRET}@h:notaport")]),
        (
            "--ca on a plain URL",
            vec![
                format!("mqtt://{USER}:{SECRET}@127.0.0.1:1883"),
                "--ca".into(),
                ca.display().to_string(),
            ],
        ),
    ];
    for (what, broker_args) in cases {
        let mut args = vec!["relay", "--client-id", "x", "--broker"];
        args.extend(broker_args.iter().map(String::as_str));
        let out = run(&tmp.path().join("device.db"), &args);
        assert_eq!(out.status.code(), Some(2), "{what}: {}", text(&out));
        assert!(
            !text(&out).contains(SECRET),
            "{what}: the password is printed:\n{}",
            text(&out)
        );
    }
}
