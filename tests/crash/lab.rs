//! The orchestrator's bench: a broker, an optional proxy, the consumer, the device's database,
//! and the device itself as a child process that can be started, killed and restarted.

use std::collections::HashSet;
use std::io::{BufRead, BufReader};
use std::path::PathBuf;
use std::process::{Command, ExitStatus, Stdio};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant};

use crossbeam_channel::Receiver;
use edge_outbox::{Envelope, MessageId, Published};
use rumqttc::QoS;

use super::checker::{self, SentCommand, Verdict};
use super::device::{CLIENT_ID, COMMAND_CLIENT_ID, COMMAND_FILTER, DeviceEnv};
use super::support::{Broker, ChildGuard, Proxy, Subscriber, WAIT, publish_raw};
use super::writer::{WRITER_BASE, WriterEnv};

pub struct Lab {
    pub broker: Broker,
    pub proxy: Option<Proxy>,
    pub sub: Subscriber,
    /// Keeps the device's directory alive for the scenario.
    _dir: tempfile::TempDir,
    pub db: PathBuf,
    pub orders: u64,
    pub env: Vec<(&'static str, String)>,
    pub commands: Vec<SentCommand>,
    next_command: i64,
    /// The one loss a scenario may allow: what a killed broker had acknowledged and not delivered.
    pub allow_broker_loss: bool,
    /// The device runs with [`super::device::DeviceEnv::LANES`]: orders of its coalescing and
    /// expiring keys may be announced removed instead of delivered.
    pub announced_removals: bool,
    /// Foreign writer processes started so far (their ids).
    writers: u32,
    /// Every order a device or writer said was committed (its commit returned), across restarts:
    /// what the store is held to, rather than what it happens to contain.
    returned: Arc<Mutex<HashSet<i64>>>,
}

impl Lab {
    pub fn new(broker: Broker, via_proxy: bool, orders: u64) -> Lab {
        // rumqttd 0.20's 3.1.1 listener (the subscriber here) crashes on MQTT 5 properties.
        let env = if broker.kind() == super::support::BrokerKind::Rumqttd {
            vec![(DeviceEnv::NO_MESSAGE_EXPIRY, "1".to_owned())]
        } else {
            Vec::new()
        };
        let proxy = via_proxy.then(|| Proxy::start(broker.addr()).expect("proxy"));
        // A persistent consumer session: it keeps what the broker queued across a broker restart.
        let sub = Subscriber::builder(broker.addr())
            .filter("#")
            .clean_session(false)
            .start()
            .expect("consumer");
        // The device's command session as it is after its first connection: persistent and
        // subscribed, so commands sent while the device is down (or before it first subscribes:
        // a failpoint may abort it earlier) are queued for it.
        Subscriber::builder(broker.addr())
            .client_id(COMMAND_CLIENT_ID)
            .filter(COMMAND_FILTER)
            .clean_session(false)
            .start()
            .expect("device command session")
            .stop();
        let dir = tempfile::tempdir().expect("tempdir");
        let db = dir.path().join("device.db");
        Lab {
            broker,
            proxy,
            sub,
            _dir: dir,
            db,
            orders,
            env,
            commands: Vec::new(),
            next_command: 1,
            allow_broker_loss: false,
            announced_removals: false,
            writers: 0,
            returned: Arc::default(),
        }
    }

    fn device_addr(&self) -> String {
        let addr = self.proxy.as_ref().map_or(self.broker.addr(), Proxy::addr);
        format!("{}:{}", addr.ip(), addr.port())
    }

    /// Starts the device, with a failpoint armed if given.
    pub fn start(&self, failpoint: Option<&str>) -> Device {
        let mut cmd = Command::new(std::env::current_exe().expect("own path"));
        cmd.arg("--device")
            .env(DeviceEnv::DB, &self.db)
            .env(DeviceEnv::BROKER, self.device_addr())
            .env(DeviceEnv::ORDERS, self.orders.to_string())
            .env(DeviceEnv::COMMANDS, self.commands.len().to_string())
            .env("EDGE_OUTBOX_FAILPOINT", failpoint.unwrap_or(""))
            // Its lifeline: it exits when this end closes, however this process ends.
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(device_stderr());
        for (k, v) in &self.env {
            cmd.env(k, v);
        }
        let mut child = cmd.spawn().expect("spawn device");
        let stdout = child.stdout.take().expect("device stdout");
        let (tx, rx) = crossbeam_channel::unbounded();
        let seen = Arc::new(Mutex::new(RelaySeen::default()));
        let seen_by_reader = seen.clone();
        let returned = self.returned.clone();
        std::thread::spawn(move || {
            for line in BufReader::new(stdout).lines().map_while(Result::ok) {
                if let Some(status) = line.strip_prefix("status ") {
                    *seen_by_reader.lock().unwrap_or_else(PoisonError::into_inner) = RelaySeen::parse(status);
                    continue;
                }
                if let Some(n) = committed(&line) {
                    returned.lock().unwrap_or_else(PoisonError::into_inner).insert(n);
                    continue;
                }
                if tx.send((Instant::now(), line)).is_err() {
                    break;
                }
            }
        });
        Device {
            child: ChildGuard::new(child),
            lines: rx,
            seen,
        }
    }

    /// Starts foreign writer number `self.writers + 1`, committing `orders` orders through the
    /// SQL contract (see `writer.rs`); returns it and its id.
    pub fn start_writer(&mut self, orders: u64) -> ChildGuard {
        self.writers += 1;
        self.writer(self.writers, orders)
    }

    /// (Re)starts writer `id` (it resumes after the last order it committed).
    pub fn writer(&self, id: u32, orders: u64) -> ChildGuard {
        let mut child = Command::new(std::env::current_exe().expect("own path"))
            .arg("--writer")
            .env(WriterEnv::DB, &self.db)
            .env(WriterEnv::ID, id.to_string())
            .env(WriterEnv::ORDERS, orders.to_string())
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .spawn()
            .expect("spawn writer");
        let stdout = child.stdout.take().expect("writer stdout");
        let returned = self.returned.clone();
        std::thread::spawn(move || {
            for line in BufReader::new(stdout).lines().map_while(Result::ok) {
                if let Some(n) = committed(&line) {
                    returned.lock().unwrap_or_else(PoisonError::into_inner).insert(n);
                }
            }
        });
        ChildGuard::new(child)
    }

    /// Waits until the last command sent has its ledger row (applied); false after `WAIT`.
    pub fn wait_last_command_applied(&self) -> bool {
        let Some((id, _, _)) = self.commands.last() else {
            return true;
        };
        let deadline = Instant::now() + WAIT;
        while Instant::now() < deadline {
            let applied =
                rusqlite::Connection::open_with_flags(&self.db, rusqlite::OpenFlags::SQLITE_OPEN_READ_ONLY)
                    .and_then(|c| {
                        c.query_row(
                            "SELECT EXISTS (SELECT 1 FROM ledger WHERE command_id = ?1)",
                            [id.as_bytes().as_slice()],
                            |r| r.get::<_, bool>(0),
                        )
                    })
                    .unwrap_or(false);
            if applied {
                return true;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        false
    }

    /// Sends `n` credit commands to the device's command topic (directly to the broker; the
    /// device's persistent session queues them while it is down).
    pub fn send_commands(&mut self, n: usize) {
        for _ in 0..n {
            let j = self.next_command;
            self.next_command += 1;
            let id = MessageId::new_v7();
            let account = format!("acct-{}", j % 3);
            let bytes = Envelope {
                id,
                source: "cloud".into(),
                epoch: 0,
                seq: j as u64,
                key: account.clone().into(),
                created_ms: 0,
                event_type: Some("AddCredits".into()),
                headers: vec![],
                payload: edge_outbox::envelope::to_cbor(&j).expect("cbor").into(),
            }
            .encode();
            publish_raw(
                self.broker.addr(),
                "device/commands/credit",
                &bytes,
                QoS::AtLeastOnce,
            )
            .expect("send command");
            self.commands.push((id, account, j));
        }
    }

    /// Runs the device without faults until it reports done, then waits for the consumer to
    /// have every committed order (bounded) and judges.
    pub fn finish(&self, scenario: &str, faults: usize) -> Verdict {
        self.settle(self.start(None), scenario, faults)
    }

    /// Asks `device`, which lived through the scenario's faults, to stop committing and drain,
    /// and judges what it does: a relay that did not recover shows here, where a fresh process
    /// would hide it.
    pub fn finish_in_place(&self, mut device: Device, scenario: &str, faults: usize) -> Verdict {
        device.ask_to_finish(self.commands.len());
        self.settle(device, scenario, faults)
    }

    /// Waits for `device` to say "done" (see `wait_done`), then for the consumer, and judges.
    fn settle(&self, mut device: Device, scenario: &str, faults: usize) -> Verdict {
        let stuck = self.wait_done(&mut device);
        if stuck.is_some() {
            device.kill();
        } else {
            let status = device.wait_exit(Duration::from_secs(20));
            assert!(
                status.success(),
                "{scenario}: the final device run failed ({status:?})"
            );
        }
        self.wait_for_orders();
        let returned = self
            .returned
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .clone();
        let mut verdict = checker::judge(
            scenario,
            &self.db,
            &self.sub.messages(),
            &self.commands,
            &returned,
            self.announced_removals,
        );
        verdict.faults = faults;
        verdict.allow_broker_loss = self.allow_broker_loss;
        verdict.notes.extend(stuck);
        verdict
    }

    /// Waits for the final run's "done". `None` once it is said; otherwise why the wait ended:
    /// more effects than commands were sent (a double apply, certain already), the device's
    /// "waiting ..." report unchanged for `STUCK` (it will not finish: say, a command it waits for
    /// was lost), or no "done" within 120 s.
    fn wait_done(&self, device: &mut Device) -> Option<String> {
        const STUCK: Duration = Duration::from_secs(10);
        let deadline = Instant::now() + Duration::from_secs(120);
        let mut last = String::from("(nothing said)");
        loop {
            let wait = STUCK.min(deadline.saturating_duration_since(Instant::now()));
            match device.next_line(wait) {
                Some(line) if line == "done" => return None,
                Some(line) => {
                    if let Some(effects) = line
                        .split_whitespace()
                        .find_map(|f| f.strip_prefix("effects="))
                        .and_then(|e| e.parse::<usize>().ok())
                        && effects > self.commands.len()
                    {
                        return Some(format!("the final run applied commands twice: {line}"));
                    }
                    if line.starts_with("waiting ") {
                        last = line;
                    }
                }
                None if device.exited().is_some() => {
                    return Some(format!(
                        "the final run exited with {:?} before it was done: {last}",
                        device.exited()
                    ));
                }
                None if Instant::now() >= deadline => {
                    return Some(format!("the final run did not finish in 120 s: {last}"));
                }
                None => return Some(format!("the final run stopped moving for {STUCK:?}: {last}")),
            }
        }
    }

    /// The ids of the commands the device applied (its ledger), as their receipts carry them.
    fn applied_commands(&self) -> Vec<String> {
        let conn = rusqlite::Connection::open(&self.db).expect("db");
        let mut stmt = conn.prepare("SELECT command_id FROM ledger").expect("prepare");
        stmt.query_map([], |r| r.get::<_, Vec<u8>>(0))
            .expect("query")
            .filter_map(|id| MessageId::from_slice(&id.ok()?).ok().map(|id| id.to_string()))
            .collect()
    }

    fn committed_orders(&self) -> Vec<i64> {
        let conn = rusqlite::Connection::open(&self.db).expect("db");
        let mut stmt = conn.prepare("SELECT n FROM orders").expect("prepare");
        stmt.query_map([], |r| r.get(0))
            .expect("query")
            .collect::<Result<_, _>>()
            .expect("rows")
    }

    /// Waits until the consumer has every committed order, or nothing arrived for `QUIET` (the
    /// device has finished: everything it published was acknowledged, so what is still missing
    /// then is lost, and waiting longer only delays the verdict), or `WAIT`.
    fn wait_for_orders(&self) {
        const QUIET: Duration = Duration::from_secs(5);
        let mut missing: HashSet<i64> = self.committed_orders().into_iter().collect();
        let mut receipts: HashSet<String> = self.applied_commands().into_iter().collect();
        let mut decoded = 0;
        let deadline = Instant::now() + WAIT;
        while !(missing.is_empty() && receipts.is_empty()) && Instant::now() < deadline {
            let before = decoded;
            self.sub.wait_messages(QUIET, |msgs| {
                for m in &msgs[decoded..] {
                    let orders = order_numbers(m);
                    if !orders.is_empty() {
                        for n in orders {
                            missing.remove(&n);
                        }
                    } else if let Some(id) = receipt(m) {
                        receipts.remove(&id);
                    }
                }
                decoded = msgs.len();
                missing.is_empty() && receipts.is_empty()
            });
            if decoded == before {
                break;
            }
        }
    }

    /// The highest order number the device (not a foreign writer) committed so far.
    pub fn last_order(&self) -> u64 {
        self.committed_orders()
            .into_iter()
            .filter(|&n| n < WRITER_BASE)
            .max()
            .unwrap_or(0) as u64
    }

    /// Sets (or replaces) one of the device's environment variables for its next start.
    pub fn set_env(&mut self, name: &'static str, value: &str) {
        self.env.retain(|(k, _)| *k != name);
        self.env.push((name, value.to_owned()));
    }

    /// Commands arrive on the device's publishing session (single-session mode), which is made
    /// persistent and subscribed here, as [`Lab::new`] does for the separate command session.
    pub fn single_session(&mut self) {
        self.set_env(DeviceEnv::SINGLE_SESSION, "1");
        Subscriber::builder(self.broker.addr())
            .client_id(CLIENT_ID)
            .filter(COMMAND_FILTER)
            .clean_session(false)
            .start()
            .expect("device's shared session")
            .stop();
    }
}

/// The order number of a `committed <n>` line.
fn committed(line: &str) -> Option<i64> {
    line.strip_prefix("committed ")?.parse().ok()
}

/// The order numbers an order message carries (a batch carries several), if it is one.
fn order_numbers(m: &super::support::Message) -> Vec<i64> {
    if !m.topic.starts_with("orders/") {
        return Vec::new();
    }
    Published::decode_all(&m.payload)
        .unwrap_or_default()
        .into_iter()
        .filter_map(|item| match item {
            Published::Message(env) => env.payload_as::<(i64, String, i64)>().ok().map(|(n, _, _)| n),
            _ => None,
        })
        .collect()
}

/// The command id a receipt carries, if the message is one.
fn receipt(m: &super::support::Message) -> Option<String> {
    if m.topic != "device/receipts" {
        return None;
    }
    Envelope::decode(&m.payload).ok()?.payload_as::<String>().ok()
}

/// A running device process.
pub struct Device {
    child: ChildGuard,
    /// Protocol lines, with when they were read (status lines go to `seen` instead).
    lines: Receiver<(Instant, String)>,
    seen: Arc<Mutex<RelaySeen>>,
}

/// What the device's relay last said about its connection (its `status ...` lines).
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct RelaySeen {
    pub connected: bool,
    pub connections: u64,
    pub disconnects: u64,
    pub resent: u64,
}

impl RelaySeen {
    fn parse(line: &str) -> RelaySeen {
        let mut seen = RelaySeen::default();
        for field in line.split_whitespace() {
            match field.split_once('=') {
                Some(("connected", v)) => seen.connected = v == "true",
                Some(("connections", v)) => seen.connections = v.parse().unwrap_or(0),
                Some(("disconnects", v)) => seen.disconnects = v.parse().unwrap_or(0),
                Some(("resent", v)) => seen.resent = v.parse().unwrap_or(0),
                _ => {}
            }
        }
        seen
    }
}

impl Device {
    /// The next protocol line, or `None` after `timeout` or once the device exited.
    pub fn next_line(&mut self, timeout: Duration) -> Option<String> {
        self.lines.recv_timeout(timeout).ok().map(|(_, line)| line)
    }

    /// Waits for a protocol line from the device; false on timeout or exit.
    pub fn wait_line(&mut self, want: &str, timeout: Duration) -> bool {
        self.wait_line_since(want, None, timeout)
    }

    /// Waits for a protocol line printed after `since` (older ones are skipped).
    pub fn wait_line_since(&mut self, want: &str, since: Option<Instant>, timeout: Duration) -> bool {
        let deadline = Instant::now() + timeout;
        loop {
            match self.lines.recv_deadline(deadline) {
                Ok((at, line)) if line == want && since.is_none_or(|s| at >= s) => return true,
                Ok(_) => {}
                Err(_) => return false,
            }
        }
    }

    /// Asks the device to stop committing and drain, with `commands` applied (a `finish` line on
    /// its stdin).
    pub fn ask_to_finish(&mut self, commands: usize) {
        use std::io::Write as _;
        if let Some(stdin) = self.child.stdin.as_mut() {
            let _ = writeln!(stdin, "finish {commands}");
            let _ = stdin.flush();
        }
    }

    /// How the device exited, if it has.
    pub fn exited(&mut self) -> Option<ExitStatus> {
        self.child.try_wait().ok().flatten()
    }

    /// SIGKILL, by pid, and reap.
    pub fn kill(mut self) {
        self.child.kill_and_wait();
    }

    /// What the relay last reported.
    pub fn seen(&self) -> RelaySeen {
        *self.seen.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Waits until the relay's report satisfies `done`; false on timeout.
    pub fn wait_seen(&self, timeout: Duration, done: impl Fn(&RelaySeen) -> bool) -> bool {
        let deadline = Instant::now() + timeout;
        while !done(&self.seen()) {
            if Instant::now() > deadline {
                return false;
            }
            // The reader thread updates `seen` as lines come; a short poll is the simplest wait.
            std::thread::sleep(Duration::from_millis(5));
        }
        true
    }

    /// Waits for the device to exit on its own; kills it after `timeout`.
    pub fn wait_exit(&mut self, timeout: Duration) -> ExitStatus {
        let deadline = Instant::now() + timeout;
        loop {
            if let Some(status) = self.child.try_wait().expect("try_wait") {
                return status;
            }
            if Instant::now() > deadline {
                let _ = self.child.kill();
                return self.child.wait().expect("wait");
            }
            std::thread::sleep(Duration::from_millis(10));
        }
    }
}

/// Where a device's stderr goes: appended to the file `CRASH_DEVICE_LOG` names (with `RUST_LOG`,
/// its tracing output, to see why a run stalled), else nowhere.
fn device_stderr() -> Stdio {
    let Some(path) = std::env::var_os("CRASH_DEVICE_LOG") else {
        return Stdio::null();
    };
    match std::fs::OpenOptions::new().create(true).append(true).open(&path) {
        Ok(file) => Stdio::from(file),
        Err(e) => panic!("CRASH_DEVICE_LOG {}: {e}", std::path::Path::new(&path).display()),
    }
}
