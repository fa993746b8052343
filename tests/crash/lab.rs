//! The orchestrator's bench: a broker, an optional proxy, the consumer, the device's database,
//! and the device itself as a child process that can be started, killed and restarted.

use std::io::{BufRead, BufReader};
use std::path::PathBuf;
use std::process::{Child, Command, ExitStatus, Stdio};
use std::time::{Duration, Instant};

use crossbeam_channel::Receiver;
use edge_outbox::{Envelope, MessageId};
use rumqttc::QoS;

use super::checker::{self, SentCommand, Verdict};
use super::device::{COMMAND_CLIENT_ID, COMMAND_FILTER, DeviceEnv};
use super::support::{Broker, Proxy, Subscriber, WAIT, publish_raw};

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
}

impl Lab {
    pub fn new(broker: Broker, via_proxy: bool, orders: u64) -> Lab {
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
            env: Vec::new(),
            commands: Vec::new(),
            next_command: 1,
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
            .stdout(Stdio::piped())
            .stderr(Stdio::null());
        for (k, v) in &self.env {
            cmd.env(k, v);
        }
        let mut child = cmd.spawn().expect("spawn device");
        let stdout = child.stdout.take().expect("device stdout");
        let (tx, rx) = crossbeam_channel::unbounded();
        std::thread::spawn(move || {
            for line in BufReader::new(stdout).lines().map_while(Result::ok) {
                if tx.send((Instant::now(), line)).is_err() {
                    break;
                }
            }
        });
        Device { child, lines: rx }
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
        let mut device = self.start(None);
        let done = device.wait_line("done", Duration::from_secs(120));
        let status = device.wait_exit(Duration::from_secs(20));
        assert!(
            done && status.success(),
            "{scenario}: the final device run did not finish cleanly ({status:?})"
        );
        let committed = self.committed_orders();
        let deadline = Instant::now() + WAIT;
        while Instant::now() < deadline {
            let got = self.received_orders();
            if committed.iter().all(|n| got.contains(n)) {
                break;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        checker::judge(scenario, faults, &self.db, &self.sub.messages(), &self.commands)
    }

    fn committed_orders(&self) -> Vec<i64> {
        let conn = rusqlite::Connection::open(&self.db).expect("db");
        let mut stmt = conn.prepare("SELECT n FROM orders").expect("prepare");
        stmt.query_map([], |r| r.get(0))
            .expect("query")
            .collect::<Result<_, _>>()
            .expect("rows")
    }

    fn received_orders(&self) -> std::collections::HashSet<i64> {
        self.sub
            .messages()
            .iter()
            .filter(|m| m.topic.starts_with("orders/"))
            .filter_map(|m| Envelope::decode(&m.payload).ok())
            .filter_map(|e| e.payload_as::<(i64, String, i64)>().ok().map(|(n, _, _)| n))
            .collect()
    }

    /// The highest order number committed so far.
    pub fn last_order(&self) -> u64 {
        self.committed_orders().into_iter().max().unwrap_or(0) as u64
    }
}

/// A running device process.
pub struct Device {
    child: Child,
    /// Protocol lines, with when they were read.
    lines: Receiver<(Instant, String)>,
}

impl Device {
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

    /// SIGKILL, by pid, and reap.
    pub fn kill(mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
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

impl Drop for Device {
    fn drop(&mut self) {
        if let Ok(None) = self.child.try_wait() {
            let _ = self.child.kill();
            let _ = self.child.wait();
        }
    }
}
