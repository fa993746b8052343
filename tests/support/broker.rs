//! A real MQTT broker on 127.0.0.1, on a port picked at run time, in a process of its own.
//!
//! Which broker: `EDGE_OUTBOX_BROKER=mosquitto` (required: an error if it is not installed),
//! `EDGE_OUTBOX_BROKER=rumqttd`, or unset: mosquitto when it is installed, rumqttd otherwise.
//! `EDGE_OUTBOX_MOSQUITTO=/path/to/mosquitto` overrides where mosquitto is looked for (default:
//! `PATH`, then `/usr/sbin`, `/usr/local/sbin`, where Debian and Homebrew put it).
//!
//! Both run as child processes with their own temp dir (the log is `broker.log_path()`, printed on
//! drop when the test panicked), and both can be killed, stopped and restarted on the same ports.
//! mosquitto with a generated config; rumqttd as `edge-outbox broker` (a hidden command of this
//! crate's CLI, built by `cargo test --all-features`), which exits when its stdin closes, so it
//! dies with the test process however that ends. mosquitto has no such lifeline of its own: a
//! watcher (`sh`) beside it waits on a pipe from the test process and kills it when that pipe
//! closes, so a test binary that is SIGKILLed leaves no broker behind either. Differences a
//! test must allow for:
//! rumqttd keeps sessions in memory only ([`Broker::keeps_sessions`]), and its TLS listener is
//! mutual TLS only.
//!
//! Both take MQTT 3.1.1 and MQTT 5 clients on `addr()`. rumqttd serves the two versions on
//! separate listeners, so its `addr()` is a [`ProtocolMux`] in this process that forwards each
//! connection by its CONNECT's protocol level; the mux outlives kills and restarts. TLS cannot be
//! routed that way: [`Broker::tls_addr_v311`] and [`Broker::tls_addr_v5`] name the listener for
//! each version (one and the same with mosquitto).
use std::fmt;
use std::fs;
use std::io::{self, Write as _};
use std::net::{Ipv4Addr, SocketAddr, SocketAddrV4, TcpListener, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::thread;
use std::time::{Duration, Instant};

use super::child::ChildGuard;
use super::mux::ProtocolMux;
use super::ports;

/// The variable that picks the broker: `mosquitto`, `rumqttd`, or unset (mosquitto if installed).
pub const BROKER_ENV: &str = "EDGE_OUTBOX_BROKER";
/// Overrides the mosquitto executable.
pub const MOSQUITTO_ENV: &str = "EDGE_OUTBOX_MOSQUITTO";
/// A file to which each test binary that starts the broker `EDGE_OUTBOX_BROKER` chooses appends
/// its name. `.ci/run` sets it on the mosquitto pass and runs only those binaries on the rumqttd
/// pass: the others test the same code whichever broker is chosen.
pub const BROKER_USERS_ENV: &str = "EDGE_OUTBOX_BROKER_USERS";

/// How long a broker may take to accept TCP connections after it was started.
const READY_TIMEOUT: Duration = Duration::from_secs(10);
/// How long a graceful stop may take before the broker is killed.
const STOP_TIMEOUT: Duration = Duration::from_secs(5);
/// Attempts at binding picked ports (another test may draw the same one between the probe and
/// the bind).
const BIND_ATTEMPTS: usize = 5;

/// rumqttd's packet limit unless the builder sets one (mosquitto has none by default).
pub const RUMQTTD_DEFAULT_MAX_PACKET: usize = 1 << 20;

/// The CLI that hosts rumqttd (`edge-outbox broker`), when this test build has it.
const CLI: Option<&str> = option_env!("CARGO_BIN_EXE_edge-outbox");

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

/// A TLS listener, in addition to the plain one (see [`super::Pki::listener`]).
#[derive(Debug, Clone)]
pub struct TlsListener {
    pub ca: PathBuf,
    pub cert: PathBuf,
    pub key: PathBuf,
    /// Refuse clients that present no certificate signed by `ca` (mutual TLS). rumqttd only
    /// offers mutual TLS: `false` is refused with `ErrorKind::Unsupported` there.
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
    users: Vec<(String, String)>,
    websocket: bool,
}

impl BrokerBuilder {
    /// Require a login from every client, and accept this username and password (call again for
    /// more users). mosquitto: a password file made with `mosquitto_passwd` and
    /// `allow_anonymous false`; rumqttd: its static login table.
    pub fn user(mut self, user: &str, password: &str) -> Self {
        self.users.push((user.to_owned(), password.to_owned()));
        self
    }

    /// Forces a broker instead of reading `EDGE_OUTBOX_BROKER`.
    pub fn kind(mut self, kind: BrokerKind) -> Self {
        self.kind = Some(kind);
        self
    }

    /// mosquitto only: keep sessions and queued messages on disk across `restart()` (saved on a
    /// graceful stop and every second, so a `kill()` loses up to the last second of changes).
    /// rumqttd keeps sessions in memory only: they do not survive a restart, whatever this says
    /// ([`Broker::keeps_sessions`]).
    pub fn persistence(mut self, on: bool) -> Self {
        self.persistence = on;
        self
    }

    /// Also open a plain MQTT-over-WebSockets listener (`ws_addr()`). mosquitto: `protocol
    /// websockets`, which a mosquitto built without libwebsockets cannot start (Debian's 2.0.11 is
    /// one: see [`Broker::with_websockets`]); rumqttd: its WebSocket listener, MQTT 3.1.1 only.
    pub fn websocket(mut self, on: bool) -> Self {
        self.websocket = on;
        self
    }

    /// Also open a TLS listener (`tls_addr()`); the plain listener stays.
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
            None => {
                record_broker_user()?;
                BrokerKind::from_env()?
            }
        };
        if self.stock && self.tls.is_some() {
            return Err(io::Error::new(
                io::ErrorKind::Unsupported,
                "stock_config has no TLS listener",
            ));
        }
        if kind == BrokerKind::Rumqttd && self.tls.as_ref().is_some_and(|t| !t.require_client_cert) {
            return Err(io::Error::new(
                io::ErrorKind::Unsupported,
                "rumqttd's TLS listener is mutual TLS only (built with verify-client-cert)",
            ));
        }
        let broker = Broker::spawn(kind, self)?;
        eprintln!("support: {}", broker.describe());
        Ok(broker)
    }
}

/// A running broker process; see the module docs. Killed on drop.
pub struct Broker {
    kind: BrokerKind,
    ports: Ports,
    /// rumqttd: one address for both protocol versions, in front of its two plain listeners.
    mux: Option<ProtocolMux>,
    persistence: bool,
    process: BrokerProcess,
}

/// The broker process's listeners. mosquitto serves both protocol versions on each; rumqttd needs
/// one listener per version (`*_v5`).
#[derive(Debug, Clone, Copy)]
struct Ports {
    plain: u16,
    plain_v5: Option<u16>,
    tls: Option<u16>,
    tls_v5: Option<u16>,
    ws: Option<u16>,
}

impl Ports {
    fn all(&self) -> impl Iterator<Item = u16> {
        [Some(self.plain), self.plain_v5, self.tls, self.tls_v5, self.ws]
            .into_iter()
            .flatten()
    }
}

/// The broker's process and what it takes to start it again.
struct BrokerProcess {
    kind: BrokerKind,
    exe: PathBuf,
    builder: BrokerBuilder,
    dir: tempfile::TempDir,
    /// mosquitto's log file; rumqttd logs to its stderr, kept in `stderr.log`.
    log: PathBuf,
    /// mosquitto's watcher (see the module docs). Before `child`: it is dropped, killed, first,
    /// so it can never kill a pid that was reaped and reused.
    lifeline: Option<ChildGuard>,
    child: Option<ChildGuard>,
}

impl Broker {
    /// A broker with a WebSocket listener (`ws_addr()`): the one `EDGE_OUTBOX_BROKER` chooses,
    /// or rumqttd where that is a mosquitto built without WebSocket support (it cannot start
    /// the listener), said on stderr. Not a skip: rumqttd's listener is a real one.
    pub fn with_websockets() -> io::Result<Broker> {
        let builder = Broker::builder().websocket(true);
        match builder.clone().start() {
            Err(e) if BrokerKind::from_env()? == BrokerKind::Mosquitto => {
                let first = e.to_string().lines().next().unwrap_or_default().to_owned();
                eprintln!(
                    "support: mosquitto could not open a WebSocket listener ({first}); rumqttd's instead"
                );
                builder.kind(BrokerKind::Rumqttd).start()
            }
            other => other,
        }
    }

    /// The WebSocket listener (see [`BrokerBuilder::websocket`]).
    pub fn ws_addr(&self) -> Option<SocketAddr> {
        self.ports.ws.map(loopback)
    }

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
        self.addr().port()
    }

    /// The plain MQTT listener, for clients of either protocol version.
    pub fn addr(&self) -> SocketAddr {
        self.mux
            .as_ref()
            .map_or(loopback(self.ports.plain), ProtocolMux::addr)
    }

    /// The TLS listener for MQTT 3.1.1 clients (the test harness's own clients), when the builder
    /// asked for one.
    pub fn tls_addr_v311(&self) -> Option<SocketAddr> {
        self.ports.tls.map(loopback)
    }

    /// The TLS listener for MQTT 5 clients (the relay's default), when the builder asked for one.
    pub fn tls_addr_v5(&self) -> Option<SocketAddr> {
        self.ports.tls_v5.or(self.ports.tls).map(loopback)
    }

    /// Whether sessions and the messages queued for them survive `kill`/`stop` + `restart`
    /// (mosquitto with `persistence(true)`; never rumqttd). A test that kills a broker which does
    /// not keep them must expect what it had queued to be gone.
    pub fn keeps_sessions(&self) -> bool {
        self.kind == BrokerKind::Mosquitto && self.persistence
    }

    /// Whether the broker process is alive.
    pub fn is_running(&mut self) -> bool {
        self.process
            .child
            .as_mut()
            .is_some_and(|c| matches!(c.try_wait(), Ok(None)))
    }

    /// The broker's pid, while it runs.
    pub fn pid(&self) -> Option<u32> {
        self.process.child.as_ref().map(|c| c.id())
    }

    /// The broker's temp dir: config, logs, persistence.
    pub fn dir(&self) -> &Path {
        self.process.dir.path()
    }

    /// The broker's log file.
    pub fn log_path(&self) -> &Path {
        &self.process.log
    }

    /// The log so far.
    pub fn log(&self) -> String {
        fs::read_to_string(&self.process.log).unwrap_or_default()
    }

    /// SIGKILL: the broker dies at once, like a crash or a power cut. Clients see their
    /// connections reset. Killing a stopped broker is a no-op.
    pub fn kill(&mut self) -> io::Result<()> {
        drop(self.process.lifeline.take());
        if let Some(mut child) = self.process.child.take() {
            child.kill()?;
            child.wait()?;
        }
        Ok(())
    }

    /// A graceful stop, waited for: mosquitto gets SIGTERM (it disconnects its clients and writes
    /// its persistence); rumqttd sees its stdin close and exits. Killed if it takes longer than
    /// 5 s. Stopping a stopped broker is a no-op.
    pub fn stop(&mut self) -> io::Result<()> {
        drop(self.process.lifeline.take());
        let Some(mut child) = self.process.child.take() else {
            return Ok(());
        };
        let asked = match self.kind {
            BrokerKind::Mosquitto => Command::new("kill")
                .arg("-TERM")
                .arg(child.id().to_string())
                .status()
                .is_ok_and(|s| s.success()),
            BrokerKind::Rumqttd => {
                drop(child.stdin.take());
                true
            }
        };
        if asked {
            let deadline = Instant::now() + STOP_TIMEOUT;
            // A bounded poll: std has no wait with a timeout.
            while child.try_wait()?.is_none() && Instant::now() < deadline {
                thread::sleep(Duration::from_millis(10));
            }
        }
        child.kill_and_wait();
        Ok(())
    }

    /// Starts the broker again on the same port(s), after a graceful `stop()` if it is still
    /// running; returns once it accepts connections. See [`Broker::keeps_sessions`].
    pub fn restart(&mut self) -> io::Result<()> {
        self.stop()?;
        let ports = self.ports;
        // The port is ours, but the old socket may linger for a moment, or another process may
        // have taken it: retry a few times, then report the log.
        let mut last = None;
        for attempt in 0..BIND_ATTEMPTS {
            if attempt > 0 {
                thread::sleep(Duration::from_millis(200));
            }
            match self.process.spawn_and_wait(&ports) {
                Ok(()) => return Ok(()),
                Err(e) => last = Some(e),
            }
        }
        Err(last.unwrap_or_else(|| io::Error::other("restart failed")))
    }

    fn describe(&self) -> String {
        let mut s = format!("broker {} on {}", self.kind, self.addr());
        if let Some(t) = self.tls_addr_v311() {
            s.push_str(&format!(", TLS on {t}"));
        }
        if let Some(pid) = self.pid() {
            s.push_str(&format!(", pid {pid}"));
        }
        s.push_str(&format!(", dir {}", self.dir().display()));
        s
    }

    fn spawn(kind: BrokerKind, b: BrokerBuilder) -> io::Result<Broker> {
        let exe = match kind {
            BrokerKind::Mosquitto => mosquitto_path().ok_or_else(|| {
                io::Error::new(
                    io::ErrorKind::NotFound,
                    format!(
                        "mosquitto was asked for but is not installed (looked in PATH, /usr/sbin, \
                         /usr/local/sbin; set {MOSQUITTO_ENV} or install the `mosquitto` package)"
                    ),
                )
            })?,
            BrokerKind::Rumqttd => CLI.map(PathBuf::from).ok_or_else(|| {
                io::Error::new(
                    io::ErrorKind::NotFound,
                    "rumqttd runs as `edge-outbox broker`, which this test build lacks: build the \
                     tests with the CLI (`cargo test --all-features`, or `--features demo`)",
                )
            })?,
        };
        let dir = tempfile::Builder::new()
            .prefix(&format!("edge-outbox-{kind}-"))
            .tempdir()?;
        let log = dir.path().join(match kind {
            BrokerKind::Mosquitto => "mosquitto.log",
            BrokerKind::Rumqttd => "stderr.log",
        });
        let persistence = b.persistence;
        let mut process = BrokerProcess {
            kind,
            exe,
            builder: b,
            dir,
            log,
            lifeline: None,
            child: None,
        };
        let mut last = None;
        for _ in 0..BIND_ATTEMPTS {
            let tls = process.builder.tls.is_some();
            let two = kind == BrokerKind::Rumqttd;
            let ports = pick_ports([true, two, tls, tls && two, process.builder.websocket])?;
            let ports = Ports {
                plain: ports[0].unwrap_or_default(),
                plain_v5: ports[1],
                tls: ports[2],
                tls_v5: ports[3],
                ws: ports[4],
            };
            match kind {
                BrokerKind::Mosquitto => process.write_mosquitto_config(&ports)?,
                BrokerKind::Rumqttd => process.write_rumqttd_passwords()?,
            }
            match process.spawn_and_wait(&ports) {
                Ok(()) => {
                    let mux = match ports.plain_v5 {
                        Some(v5) => Some(ProtocolMux::start(loopback(ports.plain), loopback(v5))?),
                        None => None,
                    };
                    return Ok(Broker {
                        kind,
                        ports,
                        mux,
                        persistence,
                        process,
                    });
                }
                Err(e) => last = Some(e),
            }
        }
        Err(last.unwrap_or_else(|| io::Error::other(format!("{kind} did not start"))))
    }
}

impl fmt::Debug for Broker {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.describe())
    }
}

impl Drop for Broker {
    fn drop(&mut self) {
        drop(self.process.lifeline.take());
        if let Some(mut child) = self.process.child.take() {
            child.kill_and_wait();
        }
        if thread::panicking() {
            let log = self.log();
            let tail: Vec<&str> = log.lines().rev().take(60).collect();
            eprintln!("--- {} log (last {} lines) ---", self.kind, tail.len());
            for line in tail.iter().rev() {
                eprintln!("{line}");
            }
        }
    }
}

impl BrokerProcess {
    fn write_mosquitto_config(&self, ports: &Ports) -> io::Result<()> {
        let (port, tls_port) = (ports.plain, ports.tls);
        let b = &self.builder;
        let config = self.dir.path().join("mosquitto.conf");
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
            return write_synced(&config, &c);
        }
        c.push_str("log_type error\nlog_type warning\nlog_type notice\nlog_type information\n");
        c.push_str("connection_messages true\nlog_timestamp true\n");
        if b.users.is_empty() {
            c.push_str("allow_anonymous true\n");
        } else {
            let file = self.dir.path().join("passwords");
            for (i, (user, password)) in b.users.iter().enumerate() {
                let mut cmd = Command::new("mosquitto_passwd");
                cmd.arg("-b");
                if i == 0 {
                    cmd.arg("-c");
                }
                let made = cmd.arg(&file).args([user, password]).status()?;
                if !made.success() {
                    return Err(io::Error::other(format!("mosquitto_passwd failed: {made}")));
                }
            }
            c.push_str(&format!(
                "allow_anonymous false\npassword_file {}\n",
                file.display()
            ));
        }
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
        if let Some(ws) = ports.ws {
            c.push_str(&format!("\nlistener {ws} 127.0.0.1\nprotocol websockets\n"));
        }
        if let (Some(tls), Some(tls_port)) = (&b.tls, tls_port) {
            c.push_str(&format!("\nlistener {tls_port} 127.0.0.1\n"));
            c.push_str(&format!("cafile {}\n", tls.ca.display()));
            c.push_str(&format!("certfile {}\n", tls.cert.display()));
            c.push_str(&format!("keyfile {}\n", tls.key.display()));
            c.push_str(&format!("require_certificate {}\n", tls.require_client_cert));
        }
        write_synced(&config, &c)
    }

    fn write_rumqttd_passwords(&self) -> io::Result<()> {
        if self.builder.users.is_empty() {
            return Ok(());
        }
        let lines: String = self
            .builder
            .users
            .iter()
            .map(|(user, password)| format!("{user}:{password}\n"))
            .collect();
        write_synced(&self.dir.path().join("passwords"), &lines)
    }

    fn command(&self, ports: &Ports) -> Command {
        let mut cmd = Command::new(&self.exe);
        match self.kind {
            BrokerKind::Mosquitto => {
                cmd.arg("-c").arg(self.dir.path().join("mosquitto.conf"));
                cmd.stdin(Stdio::null());
            }
            BrokerKind::Rumqttd => {
                let b = &self.builder;
                cmd.arg("broker")
                    .arg("--listen")
                    .arg(loopback(ports.plain).to_string())
                    .arg("--max-packet")
                    .arg(
                        b.max_packet_size
                            .unwrap_or(RUMQTTD_DEFAULT_MAX_PACKET)
                            .to_string(),
                    );
                if !b.users.is_empty() {
                    cmd.arg("--passwords").arg(self.dir.path().join("passwords"));
                }
                if let Some(v5) = ports.plain_v5 {
                    cmd.arg("--listen-v5").arg(loopback(v5).to_string());
                }
                if let Some(v5) = ports.tls_v5 {
                    cmd.arg("--tls-listen-v5").arg(loopback(v5).to_string());
                }
                if let Some(ws) = ports.ws {
                    cmd.arg("--ws-listen").arg(loopback(ws).to_string());
                }
                if let (Some(tls), Some(tls_port)) = (&b.tls, ports.tls) {
                    cmd.arg("--tls-listen")
                        .arg(loopback(tls_port).to_string())
                        .arg("--tls-cert")
                        .arg(&tls.cert)
                        .arg("--tls-key")
                        .arg(&tls.key)
                        .arg("--tls-ca")
                        .arg(&tls.ca);
                }
                // Its lifeline: it exits when this pipe closes (see the module docs).
                cmd.stdin(Stdio::piped());
            }
        }
        cmd
    }

    fn spawn_and_wait(&mut self, ports: &Ports) -> io::Result<()> {
        let port = ports.plain;
        // mosquitto writes errors before its log file is open (bad config) here; rumqttd, all.
        let stderr_path = self.dir.path().join("stderr.log");
        let stderr = fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&stderr_path)?;
        let child = self
            .command(ports)
            .stdout(stderr.try_clone()?)
            .stderr(stderr)
            .spawn()
            .map_err(|e| io::Error::new(e.kind(), format!("spawning {}: {e}", self.exe.display())))?;
        let mut child = ChildGuard::new(child);
        let kind = self.kind;
        let mut ready = Ok(());
        for p in ports.all() {
            ready = ready.and_then(|()| {
                wait_accepting(loopback(p), || match child.try_wait() {
                    Ok(Some(status)) => Some(format!("{kind} exited: {status}")),
                    Ok(None) => None,
                    Err(e) => Some(format!("{kind}: {e}")),
                })?;
                // Accepting is not enough: another process may hold the port.
                if ports::owned_by(child.id(), p)? {
                    Ok(())
                } else {
                    Err(io::Error::new(
                        io::ErrorKind::AddrInUse,
                        format!("port {p} accepts, but {kind} does not hold it"),
                    ))
                }
            });
        }
        match ready {
            Ok(()) => {
                if kind == BrokerKind::Mosquitto {
                    self.lifeline = Some(lifeline(child.id())?);
                }
                self.child = Some(child);
                Ok(())
            }
            Err(e) => {
                child.kill_and_wait();
                let stderr = fs::read_to_string(&stderr_path).unwrap_or_default();
                let log = fs::read_to_string(&self.log).unwrap_or_default();
                Err(io::Error::new(
                    e.kind(),
                    format!("{kind} on port {port}: {e}\n--- stderr ---\n{stderr}--- log ---\n{log}"),
                ))
            }
        }
    }
}

/// A watcher that kills `pid` (SIGKILL) once its stdin reaches end of file: when this process
/// ends, however it ends, the pipe's write end held here closes.
/// Appends this test binary's name (`crash` for `target/debug/deps/crash-0123abcd`) to the file
/// `EDGE_OUTBOX_BROKER_USERS` names, if set.
fn record_broker_user() -> io::Result<()> {
    let Some(file) = std::env::var_os(BROKER_USERS_ENV) else {
        return Ok(());
    };
    let exe = std::env::current_exe()?;
    let stem = exe.file_stem().and_then(|s| s.to_str()).unwrap_or_default();
    let name = stem.rsplit_once('-').map_or(stem, |(name, _hash)| name);
    let mut out = fs::OpenOptions::new().create(true).append(true).open(file)?;
    // One write: appends of one write each do not interleave between the tests running at once.
    out.write_all(format!("{name}\n").as_bytes())
}

fn lifeline(pid: u32) -> io::Result<ChildGuard> {
    let child = Command::new("sh")
        .arg("-c")
        .arg(format!("read _ignored; kill -9 {pid}"))
        .stdin(Stdio::piped())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()?;
    Ok(ChildGuard::new(child))
}

/// Free loopback ports, one per `true`, all different: the probes are held together, then
/// closed for the broker to bind (another process may take one meanwhile: the caller retries).
fn pick_ports<const N: usize>(wanted: [bool; N]) -> io::Result<[Option<u16>; N]> {
    let mut drawn = ports::reserve(wanted.iter().filter(|w| **w).count())?.into_iter();
    Ok(wanted.map(|want| if want { drawn.next() } else { None }))
}

fn loopback(port: u16) -> SocketAddr {
    SocketAddr::V4(SocketAddrV4::new(Ipv4Addr::LOCALHOST, port))
}

fn write_synced(path: &Path, text: &str) -> io::Result<()> {
    let mut f = fs::File::create(path)?;
    f.write_all(text.as_bytes())?;
    f.sync_all()
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
