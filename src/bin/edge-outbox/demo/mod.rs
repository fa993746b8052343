//! `edge-outbox demo`: the first article's crash windows, with real processes.
//!
//! An in-process broker (rumqttd) on a free loopback port; for each scenario a device and a
//! consumer run as child processes of this binary, the device crashes where the article says, and
//! the table shows what each side ended up with: the dual write loses an order or charges for one
//! that does not exist; the outbox publishes twice and the inbox charges once.

mod broker;
mod child;
mod rumqttd_config;

pub use broker::{BrokerArgs, run as run_broker};
pub use child::ChildArgs;

use std::io::{BufRead, BufReader, IsTerminal, Write};
use std::net::{Ipv4Addr, SocketAddr, TcpListener, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use rumqttc::{Client, Event, MqttOptions, Packet, QoS};

use self::child::Role;
use crate::Global;
use crate::Result;
use crate::exit::CliError;

/// One row of the table.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Row {
    scenario: &'static str,
    orders: i64,
    published: i64,
    delivered: i64,
    charges: i64,
}

pub fn run(global: &Global) -> Result<()> {
    let broker = start_broker()?;
    let work = WorkDir::new()?;
    let progress = Progress::new();
    let mut rows = Vec::new();

    let scenarios: [(&'static str, &[Role], bool); 4] = [
        (
            "dual write: commit, crash, publish",
            &[Role::CommitThenCrash],
            false,
        ),
        (
            "dual write: publish, crash, commit",
            &[Role::PublishThenCrash],
            false,
        ),
        (
            "outbox, relay crash, no dedupe",
            &[Role::OutboxCrashAfterPublish, Role::OutboxResume],
            false,
        ),
        (
            "outbox, relay crash, inbox dedupe",
            &[Role::OutboxCrashAfterPublish, Role::OutboxResume],
            true,
        ),
    ];
    for (i, (scenario, steps, dedupe)) in scenarios.into_iter().enumerate() {
        progress.show(&format!("[{}/5] {scenario}", i + 1));
        let lab = Lab::new(&work.0, &broker, i, dedupe)?;
        for &role in steps {
            lab.device(role)?;
        }
        let expected = if steps.len() > 1 {
            2
        } else {
            i64::from(role_publishes(steps[0]))
        };
        lab.wait_deliveries(expected)?;
        rows.push(lab.row(scenario)?);
        if dedupe {
            progress.show("[5/5] ...and the broker redelivers all");
            lab.redeliver_all(&broker)?;
            let mut again = lab.row("  ...and the broker redelivers all")?;
            again.published = rows[rows.len() - 1].published;
            rows.push(again);
        }
    }
    progress.done();
    print(global, &rows)?;
    let ok = rows[0].orders == 1
        && rows[0].charges == 0
        && rows[1].orders == 0
        && rows[1].charges == 1
        && rows[2].charges == 2
        && rows[3..].iter().all(|r| r.orders == 1 && r.charges == 1);
    if ok {
        Ok(())
    } else {
        Err(CliError::runtime(
            "the demo did not show what it should: see the table",
        ))
    }
}

fn role_publishes(role: Role) -> u8 {
    u8::from(role == Role::PublishThenCrash)
}

fn print(global: &Global, rows: &[Row]) -> Result<()> {
    let mut out = std::io::stdout().lock();
    let w = |e: std::io::Error| CliError::output(&e);
    if global.json {
        let json: Vec<_> = rows
            .iter()
            .map(|r| {
                serde_json::json!({"scenario": r.scenario.trim(), "orders": r.orders, "published": r.published,
                                   "delivered": r.delivered, "charges": r.charges})
            })
            .collect();
        writeln!(out, "{}", serde_json::Value::Array(json)).map_err(w)?;
        return Ok(());
    }
    writeln!(
        out,
        "{:<38} {:>6} {:>9} {:>9} {:>7}",
        "scenario", "orders", "published", "delivered", "charges"
    )
    .map_err(w)?;
    for r in rows {
        writeln!(
            out,
            "{:<38} {:>6} {:>9} {:>9} {:>7}",
            r.scenario, r.orders, r.published, r.delivered, r.charges
        )
        .map_err(w)?;
    }
    writeln!(
        out,
        "\nThe dual write leaves an order nobody charges, or a charge for an order that does not exist.\n\
         The outbox commits the order and its event together; its relay crashed after the broker's\n\
         PUBACK and published again (at least once). Without deduplication that is a second charge;\n\
         with the inbox, the message id commits with the charge, and even a full redelivery charges once."
    )
    .map_err(w)?;
    Ok(())
}

/// rumqttd in a background thread; `start()` never returns, and the demo exits when it is done.
fn start_broker() -> Result<SocketAddr> {
    for _ in 0..10 {
        let port = TcpListener::bind((Ipv4Addr::LOCALHOST, 0))
            .and_then(|l| l.local_addr())
            .map_err(|e| CliError::runtime(format!("finding a free port: {e}")))?
            .port();
        let addr = SocketAddr::from((Ipv4Addr::LOCALHOST, port));
        let listen = rumqttd_config::Listeners { v311: addr, v5: None };
        let config = rumqttd_config::rumqttd_config(listen, 1 << 20, None, None, None);
        let thread = std::thread::Builder::new()
            .name("demo-broker".into())
            .spawn(move || rumqttd::Broker::new(config).start().is_ok())
            .map_err(|e| CliError::runtime(format!("starting the broker: {e}")))?;
        let deadline = Instant::now() + Duration::from_secs(5);
        while Instant::now() < deadline && !thread.is_finished() {
            if TcpStream::connect(addr).is_ok() {
                return Ok(addr);
            }
            std::thread::sleep(Duration::from_millis(10));
        }
    }
    Err(CliError::runtime("the in-process broker did not start"))
}

/// A scratch directory for the scenario databases, removed at the end.
struct WorkDir(PathBuf);

impl WorkDir {
    fn new() -> Result<Self> {
        let dir = std::env::temp_dir().join(format!("edge-outbox-demo-{}", std::process::id()));
        std::fs::create_dir_all(&dir)
            .map_err(|e| CliError::runtime(format!("creating {}: {e}", dir.display())))?;
        Ok(WorkDir(dir))
    }
}

impl Drop for WorkDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// One scenario: its device database, and its consumer running as a child.
struct Lab {
    broker: SocketAddr,
    prefix: String,
    device_db: PathBuf,
    consumer_db: PathBuf,
    consumer: Child,
}

impl Lab {
    fn new(dir: &Path, broker: &SocketAddr, n: usize, dedupe: bool) -> Result<Lab> {
        let prefix = format!("demo/{n}");
        let consumer_db = dir.join(format!("consumer-{n}.db"));
        let role = if dedupe {
            Role::DedupingConsumer
        } else {
            Role::Consumer
        };
        let mut consumer = spawn(role, broker, &consumer_db, &prefix)?
            .stdout(Stdio::piped())
            .spawn()
            .map_err(spawn_error)?;
        let stdout = consumer
            .stdout
            .take()
            .ok_or_else(|| CliError::runtime("consumer has no stdout"))?;
        let ready = BufReader::new(stdout)
            .lines()
            .map_while(std::result::Result::ok)
            .any(|l| l == "ready");
        if !ready {
            return Err(CliError::runtime("the demo consumer did not start"));
        }
        Ok(Lab {
            broker: *broker,
            prefix,
            device_db: dir.join(format!("device-{n}.db")),
            consumer_db,
            consumer,
        })
    }

    /// Runs one device step to its end (a crash is an expected end).
    fn device(&self, role: Role) -> Result<()> {
        let status = spawn(role, &self.broker, &self.device_db, &self.prefix)?
            .stdout(Stdio::null())
            .status()
            .map_err(spawn_error)?;
        let crashes = role != Role::OutboxResume;
        if crashes == status.success() {
            return Err(CliError::runtime(format!(
                "demo device {role:?} ended unexpectedly: {status}"
            )));
        }
        Ok(())
    }

    fn count(&self, db: &Path, table: &str) -> Result<i64> {
        if !db.exists() {
            return Ok(0);
        }
        let conn = rusqlite::Connection::open(db)?;
        let exists: bool = conn.query_row(
            "SELECT EXISTS (SELECT 1 FROM sqlite_schema WHERE name = ?1)",
            [table],
            |r| r.get(0),
        )?;
        if !exists {
            return Ok(0);
        }
        Ok(conn.query_row(&format!("SELECT count(*) FROM {table}"), [], |r| r.get(0))?)
    }

    fn wait_deliveries(&self, n: i64) -> Result<()> {
        let deadline = Instant::now() + Duration::from_secs(20);
        while self.count(&self.consumer_db, "deliveries")? < n {
            if Instant::now() > deadline {
                return Err(CliError::runtime(
                    "the consumer did not receive what was published",
                ));
            }
            std::thread::sleep(Duration::from_millis(10));
        }
        // Anything more (there should be nothing) would arrive within this grace period.
        std::thread::sleep(Duration::from_millis(200));
        Ok(())
    }

    fn row(&self, scenario: &'static str) -> Result<Row> {
        let delivered = self.count(&self.consumer_db, "deliveries")?;
        Ok(Row {
            scenario,
            orders: self.count(&self.device_db, "orders")?,
            published: delivered,
            delivered,
            charges: self.count(&self.consumer_db, "charges")?,
        })
    }

    /// Publishes again every message the consumer received, as a broker replaying a topic would.
    fn redeliver_all(&self, broker: &SocketAddr) -> Result<()> {
        let conn = rusqlite::Connection::open(&self.consumer_db)?;
        let mut stmt = conn.prepare("SELECT payload FROM deliveries")?;
        let payloads: Vec<Vec<u8>> = stmt
            .query_map([], |r| r.get(0))?
            .collect::<std::result::Result<_, _>>()?;
        let before = self.count(&self.consumer_db, "deliveries")?;
        let mut options = MqttOptions::new("demo-replayer", broker.ip().to_string(), broker.port());
        options.set_keep_alive(Duration::from_secs(5));
        let (client, mut connection) = Client::new(options, payloads.len() + 2);
        for p in &payloads {
            client
                .try_publish(
                    format!("{}/orders", self.prefix),
                    QoS::AtLeastOnce,
                    false,
                    p.clone(),
                )
                .map_err(|e| CliError::runtime(format!("replaying: {e}")))?;
        }
        let mut acked = 0;
        for event in connection.iter() {
            match event {
                Ok(Event::Incoming(Packet::PubAck(_))) => {
                    acked += 1;
                    if acked == payloads.len() {
                        break;
                    }
                }
                Ok(_) => {}
                Err(e) => return Err(CliError::runtime(format!("replaying: {e}"))),
            }
        }
        self.wait_deliveries(before + payloads.len() as i64)
    }
}

impl Drop for Lab {
    /// The consumer is stopped by pid whether the scenario succeeded or not.
    fn drop(&mut self) {
        let _ = self.consumer.kill();
        let _ = self.consumer.wait();
    }
}

fn spawn(role: Role, broker: &SocketAddr, db: &Path, prefix: &str) -> Result<Command> {
    let exe = std::env::current_exe().map_err(|e| CliError::runtime(format!("finding own path: {e}")))?;
    let mut cmd = Command::new(exe);
    cmd.arg("demo-child")
        .arg("--role")
        .arg(clap::ValueEnum::to_possible_value(&role).map_or_else(String::new, |v| v.get_name().to_owned()))
        .arg("--broker")
        .arg(broker.to_string())
        .arg("--db")
        .arg(db)
        .arg("--prefix")
        .arg(prefix)
        .stderr(if std::env::var_os("DEMO_DEBUG").is_some() {
            Stdio::inherit()
        } else {
            Stdio::null()
        })
        .env("RUST_LOG", "off");
    Ok(cmd)
}

fn spawn_error(e: std::io::Error) -> CliError {
    CliError::runtime(format!("starting a demo process: {e}"))
}

pub fn run_child(args: &ChildArgs) -> Result<()> {
    child::run(args)
}

/// A live line on a terminal; nothing when output is redirected.
struct Progress {
    live: bool,
}

impl Progress {
    fn new() -> Self {
        Progress {
            live: std::io::stderr().is_terminal(),
        }
    }

    fn show(&self, what: &str) {
        if self.live {
            eprint!("\r\x1b[2K{what} ...");
            let _ = std::io::stderr().flush();
        }
    }

    fn done(&self) {
        if self.live {
            eprint!("\r\x1b[2K");
        }
    }
}
