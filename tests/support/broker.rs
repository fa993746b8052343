//! A real MQTT broker on 127.0.0.1, on a port picked at run time.
//!
//! Which broker: `EDGE_OUTBOX_BROKER=mosquitto` (required: an error if it is not installed),
//! `EDGE_OUTBOX_BROKER=rumqttd` (in-process), or unset: mosquitto when it is installed, rumqttd
//! otherwise. `EDGE_OUTBOX_MOSQUITTO=/path/to/mosquitto` overrides where mosquitto is looked for
//! (default: `PATH`, then `/usr/sbin`, `/usr/local/sbin`, where Debian and Homebrew put it).
//!
//! mosquitto runs as a child process with a generated config in its own temp dir (its log is
//! `broker.log_path()`, printed on drop when the test panicked) and can be killed, stopped and
//! restarted on the same port. rumqttd 0.20 has no shutdown: it runs on detached threads until the
//! test process exits, so it cannot be stopped or restarted (`supports_restart()` is false). To take
//! the broker "down" under rumqttd, put a [`Proxy`](super::Proxy) in front and `refuse` + `cut`.
//!
//! Both brokers take MQTT 3.1.1 and MQTT 5 clients on `addr()` (rumqttd through a small mux, see
//! [`Broker::addr`]), so a test's clients may speak either.

use std::collections::HashMap;
use std::fmt;
use std::fs;
use std::io::{self, Write as _};
use std::net::{Ipv4Addr, SocketAddr, SocketAddrV4, TcpListener, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::thread;
use std::time::{Duration, Instant};

/// The variable that picks the broker: `mosquitto`, `rumqttd`, or unset (mosquitto if installed).
pub const BROKER_ENV: &str = "EDGE_OUTBOX_BROKER";
/// Overrides the mosquitto executable.
pub const MOSQUITTO_ENV: &str = "EDGE_OUTBOX_MOSQUITTO";

/// How long a broker may take to accept TCP connections after it was started.
const READY_TIMEOUT: Duration = Duration::from_secs(10);
/// How long a graceful stop may take before the broker is killed.
const STOP_TIMEOUT: Duration = Duration::from_secs(5);
/// Attempts at binding a picked port (another process may take it between the probe and the bind).
const BIND_ATTEMPTS: usize = 5;

/// rumqttd's packet limit unless the builder sets one (mosquitto has none by default).
pub const RUMQTTD_DEFAULT_MAX_PACKET: usize = 1 << 20;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BrokerKind {
    Mosquitto,
    Rumqttd,
}

impl BrokerKind {
    /// The broker the environment asks for; see the module docs.
    pub fn from_env() -> io::Result<BrokerKind> {
        match std::env::var(BROKER_ENV) {
            Ok(v) if v.eq_ignore_ascii_case("mosquitto") => Ok(BrokerKind::Mosquitto),
            Ok(v) if v.eq_ignore_ascii_case("rumqttd") => Ok(BrokerKind::Rumqttd),
            Ok(v) if !v.is_empty() => Err(io::Error::new(
                io::ErrorKind::InvalidInput,
                format!("{BROKER_ENV}={v:?}: expected `mosquitto` or `rumqttd`"),
            )),
            _ if mosquitto_path().is_some() => Ok(BrokerKind::Mosquitto),
            _ => Ok(BrokerKind::Rumqttd),
        }
    }
}

impl fmt::Display for BrokerKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            BrokerKind::Mosquitto => "mosquitto",
            BrokerKind::Rumqttd => "rumqttd",
        })
    }
}

/// The mosquitto executable, if installed (see the module docs for where it is looked for).
pub fn mosquitto_path() -> Option<PathBuf> {
    if let Some(p) = std::env::var_os(MOSQUITTO_ENV).filter(|p| !p.is_empty()) {
        return Some(PathBuf::from(p));
    }
    let path = std::env::var_os("PATH").unwrap_or_default();
    std::env::split_paths(&path)
        .chain(["/usr/sbin", "/usr/local/sbin", "/opt/homebrew/sbin"].map(PathBuf::from))
        .map(|dir| dir.join("mosquitto"))
        .find(|p| p.is_file())
}

/// A TLS listener for mosquitto, in addition to the plain one (see [`super::Pki::listener`]).
#[derive(Debug, Clone)]
pub struct TlsListener {
    pub ca: PathBuf,
    pub cert: PathBuf,
    pub key: PathBuf,
    /// Refuse clients that present no certificate signed by `ca` (mutual TLS).
    pub require_client_cert: bool,
}

/// Options for [`Broker`]; `Broker::start()` is `Broker::builder().start()`.
#[derive(Debug, Clone, Default)]
pub struct BrokerBuilder {
    kind: Option<BrokerKind>,
    persistence: bool,
    tls: Option<TlsListener>,
    max_packet_size: Option<usize>,
    extra_config: Vec<String>,
    stock: bool,
}

impl BrokerBuilder {
    /// Forces a broker instead of reading `EDGE_OUTBOX_BROKER`.
    pub fn kind(mut self, kind: BrokerKind) -> Self {
        self.kind = Some(kind);
        self
    }

    /// mosquitto only: keep sessions and queued messages on disk across `restart()` (saved on a
    /// graceful stop and every second, so a `kill()` loses up to the last second of changes).
    /// rumqttd keeps sessions in memory anyway, but cannot restart.
    pub fn persistence(mut self, on: bool) -> Self {
        self.persistence = on;
        self
    }

    /// mosquitto only: also open a TLS listener (`tls_addr()`); the plain listener stays.
    /// With rumqttd, `start()` fails with `ErrorKind::Unsupported`.
    pub fn tls(mut self, listener: TlsListener) -> Self {
        self.tls = Some(listener);
        self
    }

    /// The broker's packet limit in bytes. mosquitto: `max_packet_size` (whole packet; default
    /// unlimited). rumqttd: `max_payload_size` (remaining length; default 1 MiB).
    pub fn max_packet_size(mut self, bytes: usize) -> Self {
        self.max_packet_size = Some(bytes);
        self
    }

    /// mosquitto only: a raw line appended to the generated config (global options go before the
    /// listeners, so they apply to all of them).
    pub fn mosquitto_option(mut self, line: impl Into<String>) -> Self {
        self.extra_config.push(line.into());
        self
    }

    /// mosquitto only: the broker as users deploy it, for benchmarks. The config holds only what
    /// running it here needs (a listener, anonymous access, a log file, `user root` as root), none
    /// of the test tuning (`max_queued_messages`, ...): `persistence`, `max_packet_size` and
    /// `mosquitto_option` are ignored, and `tls` is refused.
    pub fn stock_config(mut self, on: bool) -> Self {
        self.stock = on;
        self
    }

    pub fn start(self) -> io::Result<Broker> {
        let kind = match self.kind {
            Some(k) => k,
            None => BrokerKind::from_env()?,
        };
        if self.stock && self.tls.is_some() {
            return Err(io::Error::new(
                io::ErrorKind::Unsupported,
                "stock_config has no TLS listener",
            ));
        }
        let broker = match kind {
            BrokerKind::Mosquitto => Broker::start_mosquitto(self)?,
            BrokerKind::Rumqttd => {
                if self.tls.is_some() {
                    return Err(io::Error::new(
                        io::ErrorKind::Unsupported,
                        "TLS needs mosquitto (rumqttd is built without TLS here)",
                    ));
                }
                Broker::start_rumqttd(&self)?
            }
        };
        eprintln!("support: {}", broker.describe());
        Ok(broker)
    }
}

/// A running broker; see the module docs. Mosquitto is stopped (killed) on drop.
pub struct Broker {
    kind: BrokerKind,
    port: u16,
    tls_port: Option<u16>,
    mosquitto: Option<Mosquitto>,
    /// rumqttd's own MQTT 3.1.1 and MQTT 5 listeners; `addr()` is the mux in front of them.
    rumqttd_listeners: Option<(SocketAddr, SocketAddr)>,
    _mux: Option<ProtocolMux>,
}

struct Mosquitto {
    exe: PathBuf,
    dir: tempfile::TempDir,
    config: PathBuf,
    log: PathBuf,
    child: Option<Child>,
}

impl Broker {
    /// The broker chosen by `EDGE_OUTBOX_BROKER`, default options.
    pub fn start() -> io::Result<Broker> {
        Broker::builder().start()
    }

    pub fn builder() -> BrokerBuilder {
        BrokerBuilder::default()
    }

    pub fn kind(&self) -> BrokerKind {
        self.kind
    }

    /// Always `127.0.0.1`.
    pub fn host(&self) -> &'static str {
        "127.0.0.1"
    }

    pub fn port(&self) -> u16 {
        self.port
    }

    /// The plain MQTT listener, for clients of either protocol version (MQTT 3.1.1 and 5).
    /// mosquitto serves both on one port. rumqttd serves them on two: this is a
    /// [`ProtocolMux`](super::mux::ProtocolMux) in front of them that forwards each connection by
    /// its CONNECT's protocol level.
    pub fn addr(&self) -> SocketAddr {
        SocketAddr::V4(SocketAddrV4::new(Ipv4Addr::LOCALHOST, self.port))
    }

    /// rumqttd only: its own listeners, (MQTT 3.1.1, MQTT 5), without the mux.
    pub fn rumqttd_listeners(&self) -> Option<(SocketAddr, SocketAddr)> {
        self.rumqttd_listeners
    }

    /// The TLS listener, when the builder asked for one.
    pub fn tls_addr(&self) -> Option<SocketAddr> {
        self.tls_port
            .map(|p| SocketAddr::V4(SocketAddrV4::new(Ipv4Addr::LOCALHOST, p)))
    }

    /// Whether `kill`, `stop` and `restart` work (mosquitto only).
    pub fn supports_restart(&self) -> bool {
        self.mosquitto.is_some()
    }

    /// `true` (after printing `SKIPPED: <test>: ...`) when this broker cannot be stopped and
    /// restarted, so the caller returns early: `if broker.skip_unless_restartable("x") { return Ok(()) }`.
    pub fn skip_unless_restartable(&self, test: &str) -> bool {
        if self.supports_restart() {
            return false;
        }
        super::skip(
            test,
            &format!(
                "needs a broker that can be stopped and restarted; {} cannot \
                 (run with {BROKER_ENV}=mosquitto)",
                self.kind
            ),
        );
        true
    }

    /// Whether the broker process is alive (always true for rumqttd).
    pub fn is_running(&mut self) -> bool {
        match &mut self.mosquitto {
            None => true,
            Some(m) => m.child.as_mut().is_some_and(|c| matches!(c.try_wait(), Ok(None))),
        }
    }

    /// The broker's temp dir (mosquitto only): config, log, persistence.
    pub fn dir(&self) -> Option<&Path> {
        self.mosquitto.as_ref().map(|m| m.dir.path())
    }

    /// The broker's log file (mosquitto only).
    pub fn log_path(&self) -> Option<&Path> {
        self.mosquitto.as_ref().map(|m| m.log.as_path())
    }

    /// The log so far (mosquitto only; empty for rumqttd, which logs through `tracing`).
    pub fn log(&self) -> String {
        self.mosquitto
            .as_ref()
            .map(|m| fs::read_to_string(&m.log).unwrap_or_default())
            .unwrap_or_default()
    }

    /// SIGKILL: the broker dies at once, like a crash or a power cut (mosquitto only). Clients see
    /// their connections reset. Killing a stopped broker is a no-op.
    pub fn kill(&mut self) -> io::Result<()> {
        let m = self.mosquitto_mut("kill")?;
        if let Some(mut child) = m.child.take() {
            child.kill()?;
            child.wait()?;
        }
        Ok(())
    }

    /// SIGTERM and wait (mosquitto only): clients are disconnected and persistence is written.
    /// Killed if it takes longer than 5 s. Stopping a stopped broker is a no-op.
    pub fn stop(&mut self) -> io::Result<()> {
        let m = self.mosquitto_mut("stop")?;
        if let Some(mut child) = m.child.take() {
            let status = Command::new("kill")
                .arg("-TERM")
                .arg(child.id().to_string())
                .status();
            if !matches!(status, Ok(s) if s.success()) {
                child.kill()?;
                child.wait()?;
                return Ok(());
            }
            let deadline = Instant::now() + STOP_TIMEOUT;
            // A bounded poll: std has no wait with a timeout.
            while child.try_wait()?.is_none() {
                if Instant::now() >= deadline {
                    child.kill()?;
                    child.wait()?;
                    break;
                }
                thread::sleep(Duration::from_millis(10));
            }
        }
        Ok(())
    }

    /// Starts the broker again on the same port(s) (mosquitto only), after a graceful `stop()` if
    /// it is still running; returns once it accepts connections. With `persistence(true)`, persistent
    /// sessions and their queued messages survive.
    pub fn restart(&mut self) -> io::Result<()> {
        self.stop()?;
        let (port, tls_port) = (self.port, self.tls_port);
        let m = self.mosquitto_mut("restart")?;
        // The port is ours, but the old socket may linger for a moment, or another process may
        // have taken it: retry a few times, then report the log.
        let mut last = None;
        for attempt in 0..BIND_ATTEMPTS {
            if attempt > 0 {
                thread::sleep(Duration::from_millis(200));
            }
            match m.spawn_and_wait(port, tls_port) {
                Ok(()) => return Ok(()),
                Err(e) => last = Some(e),
            }
        }
        Err(last.unwrap_or_else(|| io::Error::other("restart failed")))
    }

    fn mosquitto_mut(&mut self, what: &str) -> io::Result<&mut Mosquitto> {
        let kind = self.kind;
        self.mosquitto.as_mut().ok_or_else(|| {
            io::Error::new(
                io::ErrorKind::Unsupported,
                format!("{what}: {kind} runs in-process and cannot be stopped or restarted"),
            )
        })
    }

    fn describe(&self) -> String {
        let mut s = format!("broker {} on {}", self.kind, self.addr());
        if let Some(t) = self.tls_addr() {
            s.push_str(&format!(", TLS on {t}"));
        }
        if let Some(d) = self.dir() {
            s.push_str(&format!(", dir {}", d.display()));
        }
        s
    }

    fn start_mosquitto(b: BrokerBuilder) -> io::Result<Broker> {
        let exe = mosquitto_path().ok_or_else(|| {
            io::Error::new(
                io::ErrorKind::NotFound,
                format!(
                    "mosquitto was asked for but is not installed (looked in PATH, /usr/sbin, \
                     /usr/local/sbin; set {MOSQUITTO_ENV} or install the `mosquitto` package)"
                ),
            )
        })?;
        let dir = tempfile::Builder::new()
            .prefix("edge-outbox-mosquitto-")
            .tempdir()?;
        let config = dir.path().join("mosquitto.conf");
        let log = dir.path().join("mosquitto.log");
        let mut m = Mosquitto {
            exe,
            config,
            log,
            dir,
            child: None,
        };
        let mut last = None;
        for _ in 0..BIND_ATTEMPTS {
            // Hold both probes at once so the two ports differ; close them before mosquitto binds.
            let probe = TcpListener::bind((Ipv4Addr::LOCALHOST, 0))?;
            let tls_probe = match b.tls {
                Some(_) => Some(TcpListener::bind((Ipv4Addr::LOCALHOST, 0))?),
                None => None,
            };
            let port = probe.local_addr()?.port();
            let tls_port = tls_probe
                .as_ref()
                .map(|p| p.local_addr())
                .transpose()?
                .map(|a| a.port());
            drop((probe, tls_probe));
            m.write_config(&b, port, tls_port)?;
            match m.spawn_and_wait(port, tls_port) {
                Ok(()) => {
                    return Ok(Broker {
                        kind: BrokerKind::Mosquitto,
                        port,
                        tls_port,
                        mosquitto: Some(m),
                        rumqttd_listeners: None,
                        _mux: None,
                    });
                }
                Err(e) => last = Some(e),
            }
        }
        Err(last.unwrap_or_else(|| io::Error::other("mosquitto did not start")))
    }

    fn start_rumqttd(b: &BrokerBuilder) -> io::Result<Broker> {
        let max_packet = b.max_packet_size.unwrap_or(RUMQTTD_DEFAULT_MAX_PACKET);
        let mut last = None;
        for _ in 0..BIND_ATTEMPTS {
            // Both probes held at once so the two ports differ.
            let (p4, p5) = (
                TcpListener::bind((Ipv4Addr::LOCALHOST, 0))?,
                TcpListener::bind((Ipv4Addr::LOCALHOST, 0))?,
            );
            let (port, port_v5) = (p4.local_addr()?.port(), p5.local_addr()?.port());
            drop((p4, p5));
            let addr = SocketAddr::V4(SocketAddrV4::new(Ipv4Addr::LOCALHOST, port));
            let addr_v5 = SocketAddr::V4(SocketAddrV4::new(Ipv4Addr::LOCALHOST, port_v5));
            let config = rumqttd_config(addr, Some(addr_v5), max_packet);
            // `start()` blocks for ever and has no shutdown: the thread is detached and lives until
            // the test process exits. If the bind fails, rumqttd only logs it and `start()` returns,
            // so a finished thread means "try another port".
            let handle = thread::Builder::new()
                .name(format!("rumqttd-{port}"))
                .spawn(move || {
                    if let Err(e) = rumqttd::Broker::new(config).start() {
                        eprintln!("support: rumqttd on port {port}: {e}");
                    }
                })?;
            let stopped = || {
                if handle.is_finished() {
                    Some("rumqttd stopped (bind failed?)".to_owned())
                } else {
                    None
                }
            };
            match wait_accepting(addr, stopped).and_then(|()| wait_accepting(addr_v5, stopped)) {
                Ok(()) => {
                    let mux = ProtocolMux::start(addr, addr_v5)?;
                    return Ok(Broker {
                        kind: BrokerKind::Rumqttd,
                        port: mux.addr().port(),
                        tls_port: None,
                        mosquitto: None,
                        rumqttd_listeners: Some((addr, addr_v5)),
                        _mux: Some(mux),
                    });
                }
                Err(e) => last = Some(e),
            }
        }
        Err(last.unwrap_or_else(|| io::Error::other("rumqttd did not start")))
    }
}

impl fmt::Debug for Broker {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.describe())
    }
}

impl Drop for Broker {
    fn drop(&mut self) {
        let Some(m) = &mut self.mosquitto else { return };
        if let Some(mut child) = m.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
        if thread::panicking() {
            let log = fs::read_to_string(&m.log).unwrap_or_default();
            let tail: Vec<&str> = log.lines().rev().take(60).collect();
            eprintln!("--- mosquitto log (last {} lines) ---", tail.len());
            for line in tail.iter().rev() {
                eprintln!("{line}");
            }
        }
    }
}

impl Mosquitto {
    fn write_config(&self, b: &BrokerBuilder, port: u16, tls_port: Option<u16>) -> io::Result<()> {
        let mut c = String::new();
        let dir = self.dir.path().display();
        // Run as root (CI containers), mosquitto switches to the `mosquitto` user, which cannot
        // write to our temp dir; `user root` keeps the current user.
        if running_as_root() {
            c.push_str("user root\n");
        }
        c.push_str(&format!("log_dest file {}\n", self.log.display()));
        if b.stock {
            c.push_str(&format!("allow_anonymous true\nlistener {port} 127.0.0.1\n"));
            let mut f = fs::File::create(&self.config)?;
            f.write_all(c.as_bytes())?;
            return f.sync_all();
        }
        c.push_str("log_type error\nlog_type warning\nlog_type notice\nlog_type information\n");
        c.push_str("connection_messages true\nlog_timestamp true\n");
        c.push_str("allow_anonymous true\n");
        // A checker must see everything the broker accepted: by default mosquitto drops QoS 1
        // messages for a subscriber that has more than 1000 queued, which would read as a loss.
        // A large number rather than 0 ("no limit"): mosquitto 2.0.16 to 2.0.21 mishandle 0
        // (dropping everything, or refusing publishes with QUOTA_EXCEEDED).
        c.push_str("max_queued_messages 10000000\nmax_queued_bytes 0\n");
        if b.persistence {
            c.push_str(&format!("persistence true\npersistence_location {dir}/\n"));
            c.push_str("autosave_interval 1\n");
        } else {
            c.push_str("persistence false\n");
        }
        if let Some(n) = b.max_packet_size {
            c.push_str(&format!("max_packet_size {n}\n"));
        }
        for line in &b.extra_config {
            c.push_str(line);
            c.push('\n');
        }
        c.push_str(&format!("\nlistener {port} 127.0.0.1\n"));
        if let (Some(tls), Some(tls_port)) = (&b.tls, tls_port) {
            c.push_str(&format!("\nlistener {tls_port} 127.0.0.1\n"));
            c.push_str(&format!("cafile {}\n", tls.ca.display()));
            c.push_str(&format!("certfile {}\n", tls.cert.display()));
            c.push_str(&format!("keyfile {}\n", tls.key.display()));
            c.push_str(&format!("require_certificate {}\n", tls.require_client_cert));
        }
        let mut f = fs::File::create(&self.config)?;
        f.write_all(c.as_bytes())?;
        f.sync_all()
    }

    fn spawn_and_wait(&mut self, port: u16, tls_port: Option<u16>) -> io::Result<()> {
        // Errors before the log file is open (bad config) go to stderr.
        let stderr = fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(self.dir.path().join("stderr.log"))?;
        let mut child = Command::new(&self.exe)
            .arg("-c")
            .arg(&self.config)
            .stdin(Stdio::null())
            .stdout(stderr.try_clone()?)
            .stderr(stderr)
            .spawn()
            .map_err(|e| io::Error::new(e.kind(), format!("spawning {}: {e}", self.exe.display())))?;
        let addr = SocketAddr::V4(SocketAddrV4::new(Ipv4Addr::LOCALHOST, port));
        let mut ready = wait_accepting(addr, || match child.try_wait() {
            Ok(Some(status)) => Some(format!("mosquitto exited: {status}")),
            Ok(None) => None,
            Err(e) => Some(format!("mosquitto: {e}")),
        });
        if let (Ok(()), Some(tls_port)) = (&ready, tls_port) {
            let tls_addr = SocketAddr::V4(SocketAddrV4::new(Ipv4Addr::LOCALHOST, tls_port));
            ready = wait_accepting(tls_addr, || None);
        }
        match ready {
            Ok(()) => {
                self.child = Some(child);
                Ok(())
            }
            Err(e) => {
                let _ = child.kill();
                let _ = child.wait();
                let stderr = fs::read_to_string(self.dir.path().join("stderr.log")).unwrap_or_default();
                let log = fs::read_to_string(&self.log).unwrap_or_default();
                Err(io::Error::new(
                    e.kind(),
                    format!("mosquitto on port {port}: {e}\n--- stderr ---\n{stderr}--- log ---\n{log}"),
                ))
            }
        }
    }
}

/// Waits until `addr` accepts a TCP connection; `failed` reports a dead broker so we stop early.
fn wait_accepting(addr: SocketAddr, mut failed: impl FnMut() -> Option<String>) -> io::Result<()> {
    let deadline = Instant::now() + READY_TIMEOUT;
    loop {
        if let Some(why) = failed() {
            return Err(io::Error::new(io::ErrorKind::AddrInUse, why));
        }
        if TcpStream::connect_timeout(&addr, Duration::from_millis(200)).is_ok() {
            return Ok(());
        }
        if Instant::now() >= deadline {
            return Err(io::Error::new(
                io::ErrorKind::TimedOut,
                format!("{addr} did not accept connections within {READY_TIMEOUT:?}"),
            ));
        }
        // A process starting up gives no other signal than its port opening.
        thread::sleep(Duration::from_millis(10));
    }
}

fn running_as_root() -> bool {
    // Effective uid is the second field of `Uid:` in /proc/self/status (Linux; elsewhere: not root).
    fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| {
            s.lines()
                .find_map(|l| l.strip_prefix("Uid:"))
                .and_then(|l| l.split_whitespace().nth(1).map(|uid| uid == "0"))
        })
        .unwrap_or(false)
}

use super::mux::ProtocolMux;

// The same rumqttd configuration as the demo's in-process broker: one piece serves both.
#[path = "../../src/bin/edge-outbox/demo/rumqttd_config.rs"]
mod rumqttd_config;
use rumqttd_config::rumqttd_config;
