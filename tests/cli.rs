//! The `edge-outbox` binary end to end: each command run as a real process against a real store
//! (and, for the relay, a real broker), with its output and exit code checked, errors included.
#![cfg(feature = "cli")]

mod support;

use std::borrow::Cow;
use std::fs::File;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use edge_outbox::{ApplyOutcome, Envelope, MessageId, Outbox, Received};
use serde_json::Value;
use support::subscriber::QoS;
use support::{Broker, ChildGuard, Subscriber, WAIT};

type TestResult = Result<(), Box<dyn std::error::Error>>;

const BIN: &str = env!("CARGO_BIN_EXE_edge-outbox");

/// One finished run of the binary.
#[derive(Debug)]
struct Run {
    code: Option<i32>,
    stdout: String,
    stderr: String,
}

impl Run {
    fn json(&self) -> Result<Value, Box<dyn std::error::Error>> {
        serde_json::from_str(&self.stdout)
            .map_err(|e| format!("{e} in stdout: {}\n{}", self.stdout, self.stderr).into())
    }

    /// Asserts the exit code and that stderr is one line saying `needle`.
    fn fails_with(&self, code: i32, needle: &str) {
        assert_eq!(self.code, Some(code), "{self:#?}");
        assert!(self.stderr.contains(needle), "stderr lacks {needle:?}: {self:#?}");
        assert_eq!(self.stderr.lines().count(), 1, "one line: {self:#?}");
        assert!(self.stderr.starts_with("edge-outbox: error: "), "{self:#?}");
        assert!(!self.stderr.contains("panicked"), "{self:#?}");
    }
}

fn edge_outbox(args: &[&str]) -> Command {
    let mut cmd = Command::new(BIN);
    cmd.args(args).env_remove("RUST_LOG").stdin(Stdio::null());
    cmd
}

fn run(args: &[&str]) -> Run {
    run_cmd(edge_outbox(args))
}

fn run_cmd(mut cmd: Command) -> Run {
    let out = cmd.output().expect("run edge-outbox");
    Run {
        code: out.status.code(),
        stdout: String::from_utf8_lossy(&out.stdout).into_owned(),
        stderr: String::from_utf8_lossy(&out.stderr).into_owned(),
    }
}

/// `args` with `--db <db>` appended (after the command, where its own options go).
fn on(db: &Path, args: &[&str]) -> Run {
    let db = db.to_str().expect("utf-8 temp path");
    let mut all = args.to_vec();
    all.extend(["--db", db]);
    run(&all)
}

fn envelope(key: &str, payload: &Value) -> (MessageId, Vec<u8>) {
    let mut cbor = Vec::new();
    ciborium::into_writer(payload, &mut cbor).expect("encode payload");
    let id = MessageId::new_v7();
    let env = Envelope {
        id,
        source: Cow::Borrowed("cloud"),
        epoch: 0,
        seq: 1,
        key: Cow::Owned(key.to_owned()),
        created_ms: 0,
        event_type: Some(Cow::Borrowed("SetSpeed")),
        headers: vec![],
        payload: Cow::Owned(cbor),
    };
    (id, env.encode())
}

/// A store with three pending messages (CBOR map, CBOR with bytes, a TEXT row through the SQL
/// contract), two commands (one applied), and two dead letters (malformed input, and an outbox
/// message set aside).
struct Fixture {
    _dir: tempfile::TempDir,
    db: PathBuf,
    outbox: Outbox,
    published: Vec<MessageId>,
    commands: Vec<MessageId>,
}

fn fixture() -> Fixture {
    let dir = tempfile::tempdir().expect("tempdir");
    let db = dir.path().join("device.db");
    let outbox = Outbox::open(&db).expect("open");
    let mut published = Vec::new();
    let committed = outbox
        .transaction(|tx| {
            tx.execute_batch("CREATE TABLE orders (id TEXT PRIMARY KEY, total INTEGER)")?;
            tx.execute("INSERT INTO orders VALUES ('o-1', 40)", [])?;
            tx.publish(
                "orders/placed",
                "o-1",
                &serde_json::json!({"order": "o-1", "total": 40}),
            )?;
            let raw = ciborium::Value::Map(vec![(
                ciborium::Value::Text("blob".into()),
                ciborium::Value::Bytes(vec![0xde, 0xad]),
            )]);
            tx.publish("blobs", "b", &raw)?;
            Ok::<_, edge_outbox::Error>(())
        })
        .expect("commit");
    published.extend(committed.ids);
    outbox
        .with_connection(|c| {
            c.execute(
                "INSERT INTO outbox (topic, key, payload) VALUES ('logs/pump', '', 'pump started')",
                [],
            )
        })
        .expect("SQL contract insert");

    let mut commands = Vec::new();
    for (key, speed) in [("pump-1", 10), ("pump-2", 20)] {
        let (id, bytes) = envelope(key, &serde_json::json!({"speed": speed}));
        assert_eq!(
            outbox.receive("cmd/speed", &bytes).expect("receive"),
            Received::Stored(id)
        );
        commands.push(id);
    }
    let applied = outbox
        .apply_next(|_tx, _cmd| Ok::<(), String>(()))
        .expect("apply");
    assert!(matches!(applied, ApplyOutcome::Applied { .. }), "{applied:?}");

    let dead = outbox
        .receive("cmd/speed", b"\xffnot an envelope")
        .expect("receive");
    assert!(matches!(dead, Received::DeadLettered { .. }), "{dead:?}");
    outbox
        .with_connection(|c| {
            c.execute(
                "INSERT INTO dead_letters (origin, message_id, topic, key, payload, reason, created_at)
                 VALUES ('outbox', randomblob(16), 'alarms', 'pump-1', x'a16161f5', 'refused by the broker', 0)",
                [],
            )
        })
        .expect("dead letter");
    Fixture {
        _dir: dir,
        db,
        outbox,
        published,
        commands,
    }
}

#[test]
fn status_reports_the_store_in_text_and_json() -> TestResult {
    let f = fixture();
    let stats = f.outbox.stats()?;

    let text = on(&f.db, &["status"]);
    assert_eq!(text.code, Some(0), "{text:#?}");
    assert!(text.stderr.is_empty(), "{text:#?}");
    for needle in [
        &format!(
            "(schema {v}; this build supports {v})",
            v = edge_outbox::SCHEMA_VERSION
        ),
        &format!(
            "pending       3 messages, {} B, the oldest waiting for ",
            stats.pending_bytes
        ),
        "dead letters  2",
        "inbox         1 unapplied, 1 applied",
        "relay         not running",
    ] {
        assert!(text.stdout.contains(needle), "{needle:?} in\n{}", text.stdout);
    }

    let json = on(&f.db, &["status", "--json"]).json()?;
    assert_eq!(json["schema_version"], edge_outbox::SCHEMA_VERSION);
    assert_eq!(json["supported_schema_version"], edge_outbox::SCHEMA_VERSION);
    assert_eq!(json["epoch"], stats.epoch);
    // The CLI reads the documented schema itself; it must agree with the library.
    assert_eq!(json["pending"]["messages"], stats.pending_messages);
    assert_eq!(json["pending"]["bytes"], stats.pending_bytes);
    assert!(json["pending"]["oldest_age_ms"].is_u64());
    assert_eq!(json["evicted"]["messages"], stats.evicted);
    assert_eq!(json["coalesced"], stats.coalesced);
    assert_eq!(json["dead_letters"], stats.dead_letters);
    assert_eq!(json["inbox"]["unapplied"], stats.inbox_unapplied);
    assert_eq!(json["inbox"]["applied"], stats.inbox_applied);
    assert_eq!(json["file_bytes"], std::fs::metadata(&f.db)?.len());
    assert!(json["wal_bytes"].is_u64());
    assert_eq!(json["relay"]["running"], false);
    assert!(json["relay"]["status"].is_null());
    Ok(())
}

#[test]
fn pending_shows_rows_with_payloads_decoded() -> TestResult {
    let f = fixture();
    let json = on(&f.db, &["pending", "--json"]).json()?;
    assert_eq!(
        (json["total"].as_u64(), json["shown"].as_u64()),
        (Some(3), Some(3))
    );
    let m = json["messages"].as_array().ok_or("messages")?;
    assert_eq!(m[0]["id"], f.published[0].to_string(), "UUID form");
    assert_eq!(m[0]["topic"], "orders/placed");
    assert_eq!(m[0]["key"], "o-1");
    assert_eq!(m[0]["payload"], serde_json::json!({"order": "o-1", "total": 40}));
    assert!(m[0]["created_at"].as_str().is_some_and(|t| t.ends_with('Z')));
    assert!(m[0]["seq"].as_i64() < m[1]["seq"].as_i64(), "commit order");
    assert_eq!(m[1]["id"], f.published[1].to_string());
    assert_eq!(
        m[1]["payload"],
        serde_json::json!({"blob": "h'dead'"}),
        "bytes as h'hex'"
    );
    assert_eq!(
        m[2]["payload"], "pump started",
        "TEXT payload of the SQL contract"
    );
    assert_eq!(m[2]["key"], "");

    let limited = on(&f.db, &["pending", "--limit", "1", "--json"]).json()?;
    assert_eq!(
        (limited["total"].as_u64(), limited["shown"].as_u64()),
        (Some(3), Some(1))
    );

    let text = on(&f.db, &["pending"]);
    assert_eq!(text.code, Some(0), "{text:#?}");
    assert!(text.stdout.starts_with("SEQ  CREATED"), "{}", text.stdout);
    for needle in [
        f.published[0].to_string().as_str(),
        r#"{"order":"o-1","total":40}"#,
        r#""pump started""#,
        "3 of 3 pending shown",
    ] {
        assert!(text.stdout.contains(needle), "{needle:?} in\n{}", text.stdout);
    }
    Ok(())
}

#[test]
fn inbox_shows_unapplied_commands_and_with_all_the_applied_ones() -> TestResult {
    let f = fixture();
    let json = on(&f.db, &["inbox", "--json"]).json()?;
    assert_eq!(json["unapplied"], 1);
    let c = json["commands"].as_array().ok_or("commands")?;
    assert_eq!(c.len(), 1, "{json}");
    assert_eq!(c[0]["id"], f.commands[1].to_string());
    assert_eq!(c[0]["state"], "unapplied");
    assert_eq!(c[0]["key"], "pump-2");
    assert_eq!(c[0]["type"], "SetSpeed");
    assert_eq!(c[0]["source"], "cloud");
    assert_eq!(c[0]["payload"], serde_json::json!({"speed": 20}));

    let all = on(&f.db, &["inbox", "--all", "--json"]).json()?;
    let c = all["commands"].as_array().ok_or("commands")?;
    assert_eq!(c.len(), 2, "{all}");
    assert_eq!(c[0]["id"], f.commands[0].to_string());
    assert_eq!(c[0]["state"], "applied");
    assert!(c[0]["applied_at_ms"].is_i64());
    assert!(
        c[0]["payload"].is_null(),
        "applied payloads are dropped by default"
    );

    let text = on(&f.db, &["inbox"]);
    assert_eq!(text.code, Some(0), "{text:#?}");
    assert!(text.stdout.contains(r#"{"speed":20}"#), "{}", text.stdout);
    assert!(text.stdout.contains("1 shown; 1 unapplied"), "{}", text.stdout);
    // An applied command's payload is not kept: the table says so rather than `null`.
    let text = on(&f.db, &["inbox", "--all"]);
    assert!(text.stdout.contains("(not kept once applied)"), "{}", text.stdout);
    assert!(!text.stdout.contains("null"), "{}", text.stdout);
    Ok(())
}

/// A rejected command is shown as `rejected` with its reason and counted in `status`, not in the
/// dead letters; on a file of schema version 7 (the CLI reads without migrating), without the
/// column, the listing still works.
#[test]
fn inbox_and_status_show_a_rejection_apart_from_the_dead_letters() -> TestResult {
    let dir = tempfile::tempdir()?;
    let db = dir.path().join("device.db");
    let id = MessageId::new_v7();
    {
        let outbox = Outbox::open(&db)?;
        outbox.receive("cmd/speed", &Envelope::command(id, "pump-1", &500)?.encode())?;
        let outcome =
            outbox.apply_next(|_tx, _cmd| Err::<(), _>(edge_outbox::Error::reject("speed above 100")))?;
        assert!(matches!(outcome, ApplyOutcome::Rejected { .. }), "{outcome:?}");
    }
    let all = on(&db, &["inbox", "--all", "--json"]).json()?;
    let c = all["commands"].as_array().ok_or("commands")?;
    assert_eq!(c[0]["state"], "rejected", "{all}");
    assert!(
        c[0]["last_error"]
            .as_str()
            .is_some_and(|e| e.contains("speed above 100")),
        "{all}"
    );
    assert_eq!(c[0]["payload"], 500, "a rejected command keeps its payload");
    let status = on(&db, &["status", "--json"]).json()?;
    assert_eq!(status["inbox"]["rejected"], 1, "{status}");
    assert_eq!(status["dead_letters"], 0, "{status}");
    let text = on(&db, &["inbox", "--all"]);
    assert!(text.stdout.contains("rejected"), "{}", text.stdout);

    // Version 7 had no such column: the CLI reads it as dead, and does not fail.
    let conn = rusqlite::Connection::open(&db)?;
    conn.execute_batch(
        "DROP INDEX inbox_rejected; ALTER TABLE inbox DROP COLUMN rejected;
         UPDATE edge_outbox_meta SET value = 7 WHERE name = 'schema_version';",
    )?;
    drop(conn);
    let all = on(&db, &["inbox", "--all", "--json"]).json()?;
    assert_eq!(all["commands"][0]["state"], "dead", "{all}");
    Ok(())
}

#[test]
fn dead_letters_are_listed_retried_and_dropped() -> TestResult {
    let f = fixture();
    let json = on(&f.db, &["dead-letters", "list", "--json"]).json()?;
    assert_eq!(json["total"], 2);
    let d = json["dead_letters"].as_array().ok_or("dead_letters")?;
    let malformed = &d[0];
    assert_eq!(malformed["origin"], "inbox");
    assert!(malformed["message_id"].is_null());
    assert!(malformed["reason"].as_str().is_some_and(|r| !r.is_empty()));
    assert_eq!(
        malformed["payload"]["hex"], "ff6e6f7420616e20656e76656c6f7065",
        "raw bytes that are not CBOR are shown in hex"
    );
    let refused = &d[1];
    assert_eq!(refused["origin"], "outbox");
    assert_eq!(refused["reason"], "refused by the broker");
    assert_eq!(refused["payload"], serde_json::json!({"a": true}));
    let (malformed_id, refused_id) = (
        malformed["id"].as_i64().ok_or("id")?,
        refused["id"].as_i64().ok_or("id")?,
    );

    let text = on(&f.db, &["dead-letters", "list"]);
    assert_eq!(text.code, Some(0), "{text:#?}");
    assert!(
        text.stdout.contains("reason:  refused by the broker"),
        "{}",
        text.stdout
    );
    assert!(
        text.stdout.contains("2 of 2 dead letters shown"),
        "{}",
        text.stdout
    );

    // Retrying the outbox message queues it again behind the three pending ones.
    let retried = on(&f.db, &["dead-letters", "retry", &refused_id.to_string()]);
    assert_eq!(retried.code, Some(0), "{retried:#?}");
    assert_eq!(retried.stdout, format!("dead letter {refused_id} put back\n"));
    assert_eq!(f.outbox.stats()?.pending_messages, 4);
    let pending = on(&f.db, &["pending", "--json"]).json()?;
    assert_eq!(pending["messages"][3]["topic"], "alarms");

    let dropped = on(
        &f.db,
        &["dead-letters", "drop", &malformed_id.to_string(), "--json"],
    );
    assert_eq!(dropped.code, Some(0), "{dropped:#?}");
    assert_eq!(dropped.json()?["action"], "dropped");
    assert_eq!(f.outbox.stats()?.dead_letters, 0);
    assert_eq!(on(&f.db, &["dead-letters", "list", "--json"]).json()?["total"], 0);

    on(&f.db, &["dead-letters", "drop", &malformed_id.to_string()])
        .fails_with(5, &format!("dead letter {malformed_id} not found"));
    on(&f.db, &["dead-letters", "retry", "999"]).fails_with(5, "dead letter 999 not found");
    let bad_id = on(&f.db, &["dead-letters", "retry", "seven"]);
    assert_eq!(bad_id.code, Some(2), "{bad_id:#?}");
    Ok(())
}

#[test]
fn a_missing_file_is_reported_and_never_created() -> TestResult {
    let dir = tempfile::tempdir()?;
    let db = dir.path().join("typo.db");
    for args in [
        &["status"][..],
        &["status", "--json"],
        &["pending"],
        &["inbox"],
        &["dead-letters", "list"],
        &["dead-letters", "retry", "1"],
        &["dead-letters", "drop", "1"],
    ] {
        let r = on(&db, args);
        r.fails_with(3, &format!("no database at {}", db.display()));
        assert!(r.stdout.is_empty(), "{r:#?}");
    }
    assert_eq!(std::fs::read_dir(dir.path())?.count(), 0, "nothing created");

    // The default path (no --db) is the platform data directory, also left alone.
    let home = dir.path().join("home");
    let mut cmd = edge_outbox(&["status"]);
    cmd.env("HOME", &home).env_remove("XDG_DATA_HOME");
    let r = run_cmd(cmd);
    r.fails_with(3, "no database at ");
    if cfg!(target_os = "linux") {
        assert!(r.stderr.contains(".local/share/edge-outbox/outbox.db"), "{r:#?}");
    }
    assert!(!home.exists(), "no directory created");
    Ok(())
}

#[test]
fn a_file_that_is_not_a_database_is_refused_untouched() -> TestResult {
    let dir = tempfile::tempdir()?;
    let db = dir.path().join("notes.txt");
    let content = "these are not the pages you are looking for\n".repeat(100);
    std::fs::write(&db, &content)?;
    for args in [&["status"][..], &["pending"], &["dead-letters", "drop", "1"]] {
        on(&db, args).fails_with(3, "is not an SQLite database");
    }
    assert_eq!(std::fs::read_to_string(&db)?, content);
    assert_eq!(std::fs::read_dir(dir.path())?.count(), 1, "no -wal or -shm left");
    Ok(())
}

#[test]
fn another_applications_database_is_not_touched() -> TestResult {
    let dir = tempfile::tempdir()?;
    let db = dir.path().join("app.db");
    rusqlite::Connection::open(&db)?.execute_batch("CREATE TABLE t (x)")?;
    on(&db, &["status"]).fails_with(3, "has no edge-outbox tables");
    on(&db, &["dead-letters", "retry", "1"]).fails_with(3, "has no edge-outbox tables");
    let tables: i64 = rusqlite::Connection::open(&db)?.query_row(
        "SELECT count(*) FROM sqlite_schema WHERE type = 'table'",
        [],
        |r| r.get(0),
    )?;
    assert_eq!(tables, 1, "no edge-outbox tables were created");
    Ok(())
}

#[test]
fn a_newer_schema_is_refused() -> TestResult {
    let f = fixture();
    f.outbox.with_connection(|c| {
        c.execute(
            "UPDATE edge_outbox_meta SET value = 99 WHERE name = 'schema_version'",
            [],
        )
    })?;
    on(&f.db, &["status"]).fails_with(3, "schema version 99 was written by a newer edge-outbox");
    Ok(())
}

#[test]
fn a_locked_database_fails_writes_with_exit_3_and_reads_still_work() -> TestResult {
    let f = fixture();
    let holder = rusqlite::Connection::open(&f.db)?;
    holder.execute_batch("BEGIN EXCLUSIVE; INSERT INTO outbox (topic, payload) VALUES ('t', 'x');")?;

    let started = Instant::now();
    on(&f.db, &["dead-letters", "drop", "1", "--busy-timeout", "200"]).fails_with(3, "database is locked");
    assert!(
        started.elapsed() < Duration::from_secs(4),
        "gave up after --busy-timeout"
    );

    // WAL readers do not wait for the writer: status shows the last committed state.
    let status = on(&f.db, &["status", "--json", "--busy-timeout", "200"]).json()?;
    assert_eq!(status["pending"]["messages"], 3);
    assert_eq!(status["dead_letters"], 2, "the failed drop changed nothing");

    holder.execute_batch("COMMIT")?;
    let dropped = on(&f.db, &["dead-letters", "drop", "1"]);
    assert_eq!(dropped.code, Some(0), "{dropped:#?}");
    Ok(())
}

#[test]
fn bad_relay_arguments_are_usage_errors_and_create_nothing() -> TestResult {
    let dir = tempfile::tempdir()?;
    let db = dir.path().join("device.db");
    for url in [
        "127.0.0.1:1883",
        "http://broker:1883",
        "mqtt://broker:99999",
        "mqtt://:1883",
    ] {
        on(&db, &["relay", "--broker", url, "--client-id", "d"]).fails_with(2, "broker URL");
    }
    on(
        &db,
        &[
            "relay",
            "--broker",
            "mqtt://h",
            "--client-id",
            "d",
            "--ca",
            "ca.pem",
        ],
    )
    .fails_with(2, "need an mqtts:// broker URL");
    on(
        &db,
        &[
            "relay",
            "--broker",
            "mqtts://h",
            "--client-id",
            "d",
            "--ca",
            "/nonexistent/ca.pem",
        ],
    )
    .fails_with(2, "/nonexistent/ca.pem");
    on(
        &db,
        &[
            "relay",
            "--broker",
            "mqtt://h",
            "--client-id",
            "d",
            "--username",
            "u",
            "--password-file",
            "/nonexistent/pw",
        ],
    )
    .fails_with(2, "password file");
    let missing = on(&db, &["relay", "--broker", "mqtt://h"]);
    assert_eq!(missing.code, Some(2), "clap's usage error: {missing:#?}");
    assert!(missing.stderr.contains("--client-id"), "{missing:#?}");
    assert_eq!(std::fs::read_dir(dir.path())?.count(), 0, "nothing created");
    Ok(())
}

#[test]
fn help_documents_the_exit_codes() {
    let help = run(&["--help"]);
    assert_eq!(help.code, Some(0));
    for needle in [
        "Exit codes:",
        "3  database error",
        "4  another relay is already running",
    ] {
        assert!(help.stdout.contains(needle), "{needle:?} in\n{}", help.stdout);
    }
    let relay = run(&["relay", "--help"]);
    assert!(relay.stdout.contains("relay-status.json"), "{}", relay.stdout);
}

#[test]
fn database_options_are_listed_and_taken_only_by_commands_that_open_a_database() -> TestResult {
    for command in ["send-command", "encode-command", "consume"] {
        let help = run(&[command, "--help"]);
        assert_eq!(help.code, Some(0), "{help:#?}");
        for option in ["--db", "--app", "--busy-timeout"] {
            assert!(
                !help.stdout.contains(option),
                "{command} --help lists {option}:\n{}",
                help.stdout
            );
        }
        assert!(
            help.stdout.contains("--json"),
            "{command} --help:\n{}",
            help.stdout
        );
    }
    for command in [&["status"][..], &["dead-letters", "list"], &["relay"]] {
        let mut args = command.to_vec();
        args.push("--help");
        let help = run(&args);
        for option in ["--db", "--app", "--busy-timeout"] {
            assert!(
                help.stdout.contains(option),
                "{command:?} --help lacks {option}:\n{}",
                help.stdout
            );
        }
    }
    // Before the command or after it, both reach the same file.
    let dir = tempfile::tempdir()?;
    let db = dir.path().join("device.db");
    edge_outbox::Outbox::open(&db)?;
    let db = db.to_str().ok_or("utf-8 temp path")?;
    for args in [
        &["--db", db, "status"][..],
        &["status", "--db", db],
        &["--db", db, "dead-letters", "list"],
        &["dead-letters", "--db", db, "list"],
        &["dead-letters", "list", "--db", db],
    ] {
        let out = run(args);
        assert_eq!(out.code, Some(0), "{args:?}: {out:#?}");
    }
    // A database option before a command that opens none is refused, not ignored.
    run(&["--db", db, "encode-command", "--key", "k", "--payload", "1"]).fails_with(
        2,
        "--db applies to the commands that open a database; encode-command opens none",
    );
    Ok(())
}

/// A relay child process, killed if the test fails before it is stopped.
struct RelayProcess {
    child: ChildGuard,
    stderr: PathBuf,
}

impl RelayProcess {
    fn spawn(db: &Path, broker: &Broker, client_id: &str, extra: &[&str]) -> std::io::Result<Self> {
        Self::spawn_env(db, broker, client_id, extra, &[])
    }

    fn spawn_env(
        db: &Path,
        broker: &Broker,
        client_id: &str,
        extra: &[&str],
        env: &[(&str, &str)],
    ) -> std::io::Result<Self> {
        let stderr = db.with_extension(format!("{client_id}.stderr"));
        let url = format!("mqtt://127.0.0.1:{}", broker.port());
        let mut cmd = edge_outbox(&["relay", "--broker", &url, "--client-id", client_id]);
        cmd.args(extra)
            .envs(env.iter().copied())
            .arg("--db")
            .arg(db)
            .stdout(File::create(db.with_extension(format!("{client_id}.stdout")))?)
            .stderr(File::create(&stderr)?);
        Ok(RelayProcess {
            child: ChildGuard::new(cmd.spawn()?),
            stderr,
        })
    }

    fn signal(&self, name: &str) -> std::io::Result<()> {
        let status = Command::new("kill")
            .args([format!("-{name}"), self.child.id().to_string()])
            .status()?;
        assert!(status.success(), "kill -{name}");
        Ok(())
    }

    fn wait(&mut self, timeout: Duration) -> std::io::Result<Option<i32>> {
        let deadline = Instant::now() + timeout;
        loop {
            if let Some(status) = self.child.try_wait()? {
                return Ok(status.code());
            }
            assert!(Instant::now() < deadline, "relay did not stop: {}", self.log());
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    fn log(&self) -> String {
        std::fs::read_to_string(&self.stderr).unwrap_or_default()
    }
}

/// Polls `status --json` until `done` holds for it (the relay reports once a second).
fn wait_status(db: &Path, relay: &RelayProcess, mut done: impl FnMut(&Value) -> bool) -> Value {
    let deadline = Instant::now() + WAIT;
    loop {
        // Until the relay has created the file, status fails (exit 3): keep waiting.
        let run = on(db, &["status", "--json"]);
        if let Some(status) = run.json().ok().filter(|s| done(s)) {
            return status;
        }
        assert!(
            Instant::now() < deadline,
            "last status: {run:#?}\nrelay log: {}",
            relay.log()
        );
        std::thread::sleep(Duration::from_millis(100));
    }
}

/// `relay --batch FILTER --batch-zlib`: a backlog of one topic goes out as one compressed batch
/// that unpacks to every message in commit order (without the options: one publish each).
#[test]
fn relay_batch_options_publish_a_compressed_batch() -> TestResult {
    let broker = Broker::start()?;
    let sub = Subscriber::start(broker.addr(), "sensors/#")?;
    let dir = tempfile::tempdir()?;
    let db = dir.path().join("device.db");
    let outbox = Outbox::open(&db)?;
    let ids = outbox
        .transaction(|tx| {
            (0..20u64)
                .map(|i| tx.publish("sensors/hall", "t", &("reading", i)))
                .collect::<Result<Vec<_>, _>>()
        })?
        .value;
    let mut relay = RelayProcess::spawn(
        &db,
        &broker,
        "cli-batch",
        &["--batch", "sensors/#", "--batch-zlib", "--batch-linger-ms", "0"],
    )?;
    let status = wait_status(&db, &relay, |s| s["relay"]["status"]["acknowledged"] == 20);
    assert_eq!(status["pending"]["messages"], 0);
    let payloads = sub.payloads();
    assert_eq!(
        payloads.len(),
        1,
        "one publish: {:?}\nrelay log: {}",
        sub.messages(),
        relay.log()
    );
    let raw: ciborium::Value = ciborium::from_reader(&payloads[0][..])?;
    assert!(
        raw.as_map()
            .is_some_and(|m| m.iter().any(|(k, _)| k.as_text() == Some("zlib"))),
        "compressed"
    );
    let got: Vec<MessageId> = edge_outbox::Published::decode_all(&payloads[0])?
        .into_iter()
        .filter_map(|item| match item {
            edge_outbox::Published::Message(e) => Some(e.id),
            _ => None,
        })
        .collect();
    assert_eq!(got, ids, "every message once, in commit order");
    relay.signal("TERM")?;
    assert_eq!(relay.wait(WAIT)?, Some(0), "relay log: {}", relay.log());
    Ok(())
}

#[test]
fn relay_publishes_receives_commands_refuses_a_second_and_stops_on_sigterm() -> TestResult {
    let broker = Broker::start()?;
    let sub = Subscriber::start(broker.addr(), "orders/#")?;
    let dir = tempfile::tempdir()?;
    let db = dir.path().join("device.db");
    let outbox = Outbox::open(&db)?;
    let mut ids = Vec::new();
    for i in 0..3u64 {
        ids.extend(
            outbox
                .transaction(|tx| tx.publish("orders/placed", "o", &("order", i)))?
                .ids,
        );
    }

    let mut relay = RelayProcess::spawn(&db, &broker, "cli-relay", &["--commands", "cmd/cli-relay/#"])?;
    assert!(
        sub.wait_for(3, WAIT),
        "got {:?}\nrelay log: {}",
        sub.messages(),
        relay.log()
    );

    // Another process sees the relay, its counters and its command session.
    let status = wait_status(&db, &relay, |s| {
        s["relay"]["status"]["acknowledged"] == 3 && s["relay"]["status"]["commands_connected"] == true
    });
    assert_eq!(status["relay"]["running"], true);
    assert_eq!(status["relay"]["pid"], relay.child.id());
    assert_eq!(status["relay"]["status"]["client_id"], "cli-relay");
    assert_eq!(status["pending"]["messages"], 0);
    let text = on(&db, &["status"]);
    assert!(
        text.stdout.contains(&format!(
            "relay         running (pid {}), connected to",
            relay.child.id()
        )),
        "{}",
        text.stdout
    );

    // A row committed by another process after start is published too.
    ids.extend(
        outbox
            .transaction(|tx| tx.publish("orders/placed", "o", &("order", 3u64)))?
            .ids,
    );
    assert!(sub.wait_for(4, WAIT), "relay log: {}", relay.log());
    let got: Vec<MessageId> = sub
        .payloads()
        .iter()
        .map(|p| Envelope::decode(p).map(|e| e.id))
        .collect::<Result<_, _>>()?;
    assert_eq!(got, ids, "every message once, in commit order");

    // A command published to the broker lands in the inbox.
    let (command_id, bytes) = envelope("pump-1", &serde_json::json!({"speed": 7}));
    support::publish_raw(broker.addr(), "cmd/cli-relay/speed", &bytes, QoS::AtLeastOnce)?;
    let deadline = Instant::now() + WAIT;
    while on(&db, &["inbox", "--json"]).json()?["unapplied"] != 1 {
        assert!(Instant::now() < deadline, "command not stored: {}", relay.log());
        std::thread::sleep(Duration::from_millis(50));
    }
    let inbox = on(&db, &["inbox", "--json"]).json()?;
    assert_eq!(inbox["commands"][0]["id"], command_id.to_string());
    assert_eq!(inbox["commands"][0]["payload"], serde_json::json!({"speed": 7}));

    // One relay per file.
    let url = format!("mqtt://127.0.0.1:{}", broker.port());
    on(&db, &["relay", "--broker", &url, "--client-id", "second"]).fails_with(4, "already running");

    relay.signal("TERM")?;
    assert_eq!(relay.wait(WAIT)?, Some(0), "relay log: {}", relay.log());
    let log = relay.log();
    assert!(
        log.contains("stopped on SIGTERM: 4 published, 4 acknowledged; 0 pending"),
        "{log}"
    );
    assert!(!log.contains("panicked"), "{log}");
    assert!(
        !dir.path().join("device.db.relay-status.json").exists(),
        "status file removed"
    );
    let after = on(&db, &["status", "--json"]).json()?;
    assert_eq!(after["relay"]["running"], false);
    assert!(after["relay"]["status"].is_null());
    Ok(())
}

#[test]
fn relay_stops_on_sigint_and_reports_in_json() -> TestResult {
    let broker = Broker::start()?;
    let dir = tempfile::tempdir()?;
    let db = dir.path().join("new.db");
    // The relay creates a missing database (the sidecar starts before the application).
    let mut relay = RelayProcess::spawn(&db, &broker, "cli-sigint", &["--json"])?;
    wait_status(&db, &relay, |s| s["relay"]["status"]["connected"] == true);
    relay.signal("INT")?;
    assert_eq!(relay.wait(WAIT)?, Some(0), "relay log: {}", relay.log());
    let stdout = std::fs::read_to_string(db.with_extension("cli-sigint.stdout"))?;
    let summary: Value = serde_json::from_str(&stdout)?;
    assert_eq!(summary["stopped_by"], "SIGINT");
    assert_eq!(summary["pending"], 0);
    assert!(relay.log().contains("created a new one"), "{}", relay.log());
    Ok(())
}

/// A relay thread that dies (here a panic injected by a failpoint: the threads retry every error
/// they expect, so only a bug ends one) ends the process with exit 1, naming the thread, instead of
/// leaving a sidecar running that no longer publishes.
#[cfg(feature = "failpoints")]
#[test]
fn relay_exits_1_when_a_relay_thread_dies() -> TestResult {
    let broker = Broker::start()?;
    let dir = tempfile::tempdir()?;
    let db = dir.path().join("device.db");
    let env = [("EDGE_OUTBOX_FAILPOINT", "relay-loop:20:panic")];
    let mut relay = RelayProcess::spawn_env(&db, &broker, "cli-dies", &[], &env)?;
    assert_eq!(relay.wait(WAIT)?, Some(1), "relay log: {}", relay.log());
    let log = relay.log();
    assert!(
        log.contains("a relay thread stopped") && log.contains("edge-outbox-relay"),
        "{log}"
    );
    assert!(
        !dir.path().join("device.db.relay-status.json").exists(),
        "the status file is removed"
    );
    Ok(())
}

/// A store holding `n` pending messages, written in one transaction.
fn backlog(db: &Path, n: u64) -> Result<(), edge_outbox::Error> {
    Outbox::open(db)?.transaction(|tx| {
        for i in 0..n {
            tx.publish("orders/placed", "o", &("order", i))?;
        }
        Ok::<_, edge_outbox::Error>(())
    })?;
    Ok(())
}

/// Waits until the relay on `db` has acknowledged `n` and nothing is pending, stops it with
/// SIGTERM (by the pid it reports: under `script` the child is not the relay) and returns what it
/// wrote on stderr.
fn drain_and_stop(db: &Path, relay: &mut RelayProcess, n: u64) -> Result<String, Box<dyn std::error::Error>> {
    let status = wait_status(db, relay, |s| {
        s["relay"]["status"]["acknowledged"] == n && s["pending"]["messages"] == 0
    });
    let pid = status["relay"]["pid"].as_u64().ok_or("no relay pid")?;
    assert!(
        Command::new("kill")
            .args(["-TERM", &pid.to_string()])
            .status()?
            .success()
    );
    assert_eq!(relay.wait(WAIT)?, Some(0), "relay log: {}", relay.log());
    Ok(relay.log())
}

/// `--progress` draws its bar only on a terminal: piped stderr gets the plain log (no escape
/// sequence, no ETA), while under a pseudo-terminal (`script`, util-linux) the bar shows rows
/// left and an ETA. Catches a bar drawn to a non-terminal (a forced draw target, a hand-rolled
/// bar) and a `--progress` that draws nothing.
#[test]
fn relay_progress_bar_is_drawn_only_on_a_terminal() -> TestResult {
    const ROWS: u64 = 2000;
    let broker = Broker::start()?;
    let dir = tempfile::tempdir()?;

    let piped = dir.path().join("piped.db");
    backlog(&piped, ROWS)?;
    let mut relay = RelayProcess::spawn(&piped, &broker, "cli-progress-pipe", &["--progress"])?;
    let log = drain_and_stop(&piped, &mut relay, ROWS)?;
    assert!(!log.contains('\x1b'), "escape sequence on a pipe: {log:?}");
    assert!(
        !log.contains("ETA") && !log.contains(" left"),
        "a bar on a pipe: {log:?}"
    );
    assert!(log.contains("stderr is not a terminal, no bar drawn"), "{log}");
    assert!(
        log.contains(&format!(
            "stopped on SIGTERM: {ROWS} published, {ROWS} acknowledged"
        )),
        "{log}"
    );

    let tty = dir.path().join("tty.db");
    backlog(&tty, ROWS)?;
    let out = tty.with_extension("script.out");
    let command = format!(
        "'{BIN}' relay --broker mqtt://127.0.0.1:{} --client-id cli-progress-tty --progress --db '{}'",
        broker.port(),
        tty.display()
    );
    let mut script = Command::new("script");
    script
        .args(["-qfec", &command, "/dev/null"])
        .env("TERM", "xterm")
        .env_remove("RUST_LOG")
        .stdin(Stdio::null())
        .stdout(File::create(&out)?)
        .stderr(Stdio::null());
    let mut relay = RelayProcess {
        child: ChildGuard::new(script.spawn()?),
        stderr: out,
    };
    // The bar is redrawn on every tick: wait for its last frame, the backlog drained.
    let last_frame = format!("{ROWS}/{ROWS} acked | 0 left");
    let deadline = Instant::now() + WAIT;
    while !relay.log().contains(&last_frame) {
        assert!(
            Instant::now() < deadline,
            "no bar on a terminal: {:?}",
            relay.log()
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    let screen = drain_and_stop(&tty, &mut relay, ROWS)?;
    assert!(screen.contains("ETA") && screen.contains("\x1b["), "{screen:?}");
    assert!(screen.contains("stopped on SIGTERM"), "{screen:?}");
    Ok(())
}

/// Every field `status --json` prints, as dotted paths of its leaves (arrays, scalars, nulls).
fn json_fields(value: &Value, prefix: &str, out: &mut Vec<String>) {
    if let Value::Object(map) = value {
        for (k, v) in map {
            let path = if prefix.is_empty() {
                k.clone()
            } else {
                format!("{prefix}.{k}")
            };
            if v.is_object() {
                json_fields(v, &path, out);
            } else {
                out.push(path);
            }
        }
    }
}

/// `--broker` repeated is a failover list (a dead first broker, a live second one), `--src` names
/// the source in every envelope, and every field of `status --json` is in docs/operations.md.
#[test]
fn relay_takes_a_failover_list_and_a_source_and_status_fields_are_documented() -> TestResult {
    let broker = Broker::start()?;
    let sub = Subscriber::start(broker.addr(), "src/#")?;
    let dir = tempfile::tempdir()?;
    let db = dir.path().join("device.db");
    let outbox = Outbox::open(&db)?;
    outbox.transaction(|tx| tx.publish("src/t", "k", &1))?;
    // A port nobody listens on.
    let dead = std::net::TcpListener::bind("127.0.0.1:0")?.local_addr()?.port();
    let stderr = db.with_extension("failover.stderr");
    let mut cmd = edge_outbox(&[
        "relay",
        "--broker",
        &format!("mqtt://127.0.0.1:{dead}"),
        "--broker",
        &format!("mqtt://127.0.0.1:{}", broker.port()),
        "--client-id",
        "cli-failover",
        "--src",
        "pump-17",
    ]);
    cmd.arg("--db")
        .arg(&db)
        .stdout(Stdio::null())
        .stderr(File::create(&stderr)?);
    let mut relay = RelayProcess {
        child: ChildGuard::new(cmd.spawn()?),
        stderr,
    };
    assert!(sub.wait_for(1, WAIT), "relay log: {}", relay.log());
    let env = Envelope::decode(&sub.payloads()[0])?;
    assert_eq!(
        (env.source.as_ref(), env.epoch, env.seq),
        ("pump-17", outbox.epoch()?, 1)
    );
    let status = wait_status(&db, &relay, |s| s["relay"]["status"]["acknowledged"] == 1);
    let relay_status = &status["relay"]["status"];
    assert_eq!(relay_status["broker"], format!("127.0.0.1:{}", broker.port()));
    assert_eq!(
        relay_status["brokers"],
        serde_json::json!([
            format!("127.0.0.1:{dead}"),
            format!("127.0.0.1:{}", broker.port())
        ])
    );
    assert_eq!(relay_status["source"], "pump-17");
    assert_eq!(relay_status["epoch"], outbox.epoch()?);
    assert_eq!(status["epoch"], outbox.epoch()?);

    let doc = std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/docs/operations.md"))?;
    let table: String = doc
        .split_once("<!-- status-json: checked by tests/cli.rs -->")
        .ok_or("status-json marker missing from docs/operations.md")?
        .1
        .lines()
        .skip_while(|l| !l.starts_with('|'))
        .take_while(|l| l.starts_with('|'))
        .collect::<Vec<_>>()
        .join("\n");
    let mut fields = Vec::new();
    json_fields(&status, "", &mut fields);
    let undocumented: Vec<&String> = fields
        .iter()
        .filter(|f| !table.contains(&format!("`{f}`")))
        .collect();
    assert!(
        undocumented.is_empty(),
        "status --json fields missing from docs/operations.md: {undocumented:?}"
    );

    relay.signal("TERM")?;
    assert_eq!(relay.wait(WAIT)?, Some(0), "relay log: {}", relay.log());
    // A failover list shares one scheme.
    on(
        &db,
        &[
            "relay",
            "--broker",
            "mqtt://a",
            "--broker",
            "mqtts://b",
            "--client-id",
            "x",
        ],
    )
    .fails_with(2, "same scheme");
    Ok(())
}

/// `consume` counts per device what arrived and what the device announced, and with
/// `--fail-on-gap` exits 6 on a number missing without a notice.
#[test]
fn consume_reports_announced_and_unexplained_gaps() -> TestResult {
    let broker = Broker::start()?;
    let dir = tempfile::tempdir()?;
    let db = dir.path().join("device.db");
    let outbox = Outbox::open(&db)?;
    for (topic, n) in [
        ("cli-consume/a", 5),
        ("cli-consume/debug", 2),
        ("cli-consume/a", 1),
    ] {
        for i in 0..n {
            outbox.transaction(|tx| tx.publish(topic, "k", &i))?;
        }
    }
    // Number 3 is deleted behind the relay's back (lost); 6 and 7 are purged (announced).
    outbox.with_connection(|c| c.execute("DELETE FROM outbox WHERE seq = 3", []))?;
    let purged = on(&db, &["purge", "--topic", "cli-consume/debug"]);
    assert_eq!(purged.code, Some(0), "{purged:#?}");
    assert!(
        purged.stdout.contains("2 pending messages removed unpublished"),
        "{purged:#?}"
    );
    let neither = on(&db, &["purge"]);
    assert_eq!(neither.code, Some(2), "{neither:#?}");
    assert!(neither.stderr.contains("--topic"), "{neither:#?}");

    // The auditor's persistent session exists before the device publishes.
    support::Subscriber::builder(broker.addr())
        .client_id("cli-auditor")
        .clean_session(false)
        .filter("cli-consume/#")
        .start()?
        .stop();
    let relay = edge_outbox::Relay::start(
        &outbox,
        support::device::relay_config(broker.addr(), "cli-consume-device"),
    )?;
    assert!(support::wait_until(|| outbox
        .stats()
        .is_ok_and(|s| s.pending_messages == 0 && s.gaps_unannounced == 0)));
    relay.shutdown()?;

    let url = format!("mqtt://127.0.0.1:{}", broker.port());
    let run = run(&[
        "consume",
        "--broker",
        &url,
        "--mqtt-version",
        "3.1.1",
        "--topic",
        "cli-consume/#",
        "--client-id",
        "cli-auditor",
        "--from-start",
        "--grace",
        "0",
        "--fail-on-gap",
        "--stop-after",
        "6",
        "--for",
        "60",
        "--json",
    ]);
    assert_eq!(run.code, Some(6), "{run:#?}");
    assert!(
        run.stderr.contains("1 messages missing without a gap notice"),
        "{run:#?}"
    );
    let report = run.json()?;
    assert_eq!(report["totals"]["delivered"], 5, "{report}");
    assert_eq!(report["totals"]["announced"], 2, "{report}");
    assert_eq!(report["totals"]["unexplained"], 1, "{report}");
    let stream = &report["streams"][0];
    assert_eq!(stream["source"], "cli-consume-device");
    assert_eq!(stream["unexplained_ranges"], serde_json::json!([[3, 3]]));
    assert_eq!(stream["announced_by_cause"], serde_json::json!({"purged": 2}));
    Ok(())
}

/// `doctor` finds a damaged file (exit 3) and, with `--salvage`, moves it aside and salvages it;
/// a sound file passes.
#[test]
fn doctor_checks_and_salvages_a_damaged_file() -> TestResult {
    let dir = tempfile::tempdir()?;
    let db = dir.path().join("device.db");
    {
        let outbox = Outbox::open(&db)?;
        outbox.transaction(|tx| {
            for n in 0..2000u32 {
                tx.publish("t", "k", &format!("payload-{n:06}-{}", "y".repeat(80)))?;
            }
            Ok::<_, edge_outbox::Error>(())
        })?;
        outbox.with_connection(|c| c.execute_batch("PRAGMA wal_checkpoint(TRUNCATE)"))?;
    }
    let ok = on(&db, &["doctor"]);
    assert_eq!(ok.code, Some(0), "{ok:#?}");
    assert!(ok.stdout.starts_with("ok: "), "{ok:#?}");

    // A page of pending messages overwritten.
    let mut bytes = std::fs::read(&db)?;
    let page = bytes
        .chunks(4096)
        .position(|p| p.windows(14).any(|w| w == b"payload-001000"))
        .ok_or("page not found")?;
    bytes[page * 4096..(page + 1) * 4096].fill(0xAB);
    std::fs::write(&db, bytes)?;
    on(&db, &["doctor"]).fails_with(3, "damaged");

    let salvaged = on(&db, &["doctor", "--salvage"]);
    assert_eq!(salvaged.code, Some(0), "{salvaged:#?}");
    assert!(salvaged.stdout.contains("moved aside to"), "{salvaged:#?}");
    assert!(salvaged.stdout.contains("unrecoverable gap"), "{salvaged:#?}");
    assert!(
        std::fs::read_dir(dir.path())?
            .filter_map(|e| e.ok()?.file_name().into_string().ok())
            .any(|n| n.starts_with("device.db.corrupt-")),
        "the damaged file is kept aside"
    );
    let after = on(&db, &["doctor"]);
    assert_eq!(after.code, Some(0), "{after:#?}");
    let status = on(&db, &["status", "--json"]).json()?;
    assert_eq!(status["salvaged"], 1);
    let pending = status["pending"]["messages"].as_u64().ok_or("pending")?;
    assert!(pending > 1900 && pending < 2000, "{status}");
    Ok(())
}

/// `relay --expire FILTER=SECS --pace-messages N`: a message older than its topic's lifetime is
/// announced as expired instead of published, the rest flows; a malformed lifetime is a usage
/// error naming the expected form, before anything is opened.
#[test]
fn relay_takes_topic_lifetimes_and_a_pace() -> TestResult {
    let broker = Broker::start()?;
    let sub = Subscriber::start(broker.addr(), "cli-exp/#")?;
    let dir = tempfile::tempdir()?;
    let db = dir.path().join("device.db");
    let outbox = Outbox::open(&db)?;
    outbox.transaction(|tx| {
        tx.publish("cli-exp/old/t", "t", &1)?;
        tx.publish("cli-exp/new", "n", &2)
    })?;
    std::thread::sleep(Duration::from_millis(1_100));
    let bad = run(&[
        "relay",
        "--broker",
        "mqtt://h",
        "--client-id",
        "x",
        "--expire",
        "telemetry/#",
    ]);
    assert_eq!(bad.code, Some(2), "{bad:#?}");
    assert!(bad.stderr.contains("FILTER=SECS"), "{bad:#?}");
    let mut args = vec![
        "--expire",
        "cli-exp/old/#=1",
        "--pace-messages",
        "100",
        "--pace-bytes",
        "100000",
    ];
    if broker.kind() == support::BrokerKind::Rumqttd {
        // Its 3.1.1 listener (this test's subscriber) crashes on MQTT 5 properties.
        args.push("--no-message-expiry");
    }
    let relay = RelayProcess::spawn(&db, &broker, "cli-exp", &args)?;
    assert!(
        support::wait_until(|| outbox
            .stats()
            .is_ok_and(|s| s.pending_messages == 0 && s.gaps_unannounced == 0)),
        "relay log: {}",
        relay.log()
    );
    assert!(sub.wait_for(2, WAIT), "relay log: {}", relay.log());
    let items: Vec<edge_outbox::envelope::Published> = sub
        .payloads()
        .iter()
        .map(|p| edge_outbox::envelope::Published::decode(p))
        .collect::<Result<_, _>>()?;
    let keys: Vec<String> = items
        .iter()
        .filter_map(|i| match i {
            edge_outbox::envelope::Published::Message(env) => Some(env.key.to_string()),
            _ => None,
        })
        .collect();
    assert_eq!(keys, vec!["n"], "the old message expired: {items:?}");
    assert!(
        items
            .iter()
            .any(|i| matches!(i, edge_outbox::envelope::Published::Gap(g) if g.cause == edge_outbox::GapCause::Expired)),
        "{items:?}"
    );
    Ok(())
}
