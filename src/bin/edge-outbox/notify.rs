//! The service manager's notification protocol (systemd's `sd_notify`): one datagram per state
//! change to the socket named by `NOTIFY_SOCKET`. Written out here rather than taken from a
//! crate: it is one `sendto` on a Unix datagram socket, which the standard library does without
//! unsafe code, and the relay's binary budget has no room for what it does not need.
//!
//! - `READY=1` once the relay holds its lock and has the database open;
//! - `STATUS=...`, the one-line state, as it changes;
//! - `WATCHDOG=1` every half of `WATCHDOG_USEC`, only while the publishing thread keeps going
//!   round its loop ([`edge_outbox::Status::publisher_heartbeat_age`] below `WATCHDOG_USEC`, or
//!   below [`IDLE_PASS`] if that is longer), so a wedged relay stops pinging and the service
//!   manager restarts it;
//! - `STOPPING=1` when a signal asks the relay to stop.
//!
//! Without `NOTIFY_SOCKET` (not started by a service manager with `Type=notify`) nothing is sent.

use std::os::unix::net::{SocketAddr, UnixDatagram};
use std::time::{Duration, Instant};

use edge_outbox::Status;

/// The longest an idle, healthy publishing thread may take between passes of its loop (it waits
/// at most 2 s with the file watched), with room: a heartbeat younger than this is alive, however
/// short the watchdog interval.
const IDLE_PASS: Duration = Duration::from_secs(3);

/// Where notifications go, and the watchdog's interval when the service manager asked for one.
pub struct Notifier {
    socket: Option<(UnixDatagram, SocketAddr)>,
    watchdog: Option<Duration>,
    last_ping: Option<Instant>,
    last_warned: Option<Instant>,
    last_status: String,
    started: Instant,
}

impl Notifier {
    /// Reads `NOTIFY_SOCKET`, `WATCHDOG_USEC` and `WATCHDOG_PID` (the watchdog is ours only if
    /// that pid, when given, is this process). A socket that cannot be used is logged once and
    /// ignored: the relay's work does not depend on it.
    pub fn from_env() -> Notifier {
        let watchdog = std::env::var("WATCHDOG_USEC")
            .ok()
            .and_then(|usec| usec.trim().parse::<u64>().ok())
            .filter(|usec| *usec > 0)
            .filter(|_| {
                std::env::var("WATCHDOG_PID")
                    .ok()
                    .and_then(|pid| pid.trim().parse::<u32>().ok())
                    .is_none_or(|pid| pid == std::process::id())
            })
            .map(Duration::from_micros);
        let socket = std::env::var_os("NOTIFY_SOCKET").and_then(|path| match open(&path) {
            Ok(socket) => Some(socket),
            Err(e) => {
                tracing::warn!(target: "edge_outbox::cli", socket = ?path, error = %e, "NOTIFY_SOCKET cannot be used: no service manager notifications");
                None
            }
        });
        Notifier {
            watchdog: watchdog.filter(|_| socket.is_some()),
            socket,
            last_ping: None,
            last_warned: None,
            last_status: String::new(),
            started: Instant::now(),
        }
    }

    /// How often [`Notifier::tick`] must run for the watchdog: half its interval, if there is one.
    pub fn tick_every(&self) -> Option<Duration> {
        self.watchdog.map(|w| w / 2)
    }

    /// `READY=1`, with the first status line.
    pub fn ready(&mut self, status: &str) {
        self.last_status = status.to_owned();
        self.send(&format!("READY=1\nSTATUS={}", one_line(status)));
    }

    /// `RELOADING=1`, until the next [`Notifier::ready`]. (`MONOTONIC_USEC`, which only
    /// `Type=notify-reload` units need, is left out: the shipped unit is `Type=notify` with an
    /// `ExecReload`.)
    pub fn reloading(&self) {
        self.send("RELOADING=1\nSTATUS=reloading its settings");
    }

    /// `STOPPING=1`.
    pub fn stopping(&self) {
        self.send("STOPPING=1\nSTATUS=stopping");
    }

    /// The status line when it changed, and `WATCHDOG=1` when one is due and the publishing
    /// thread is alive.
    pub fn tick(&mut self, status: &Status, line: &str) {
        if line != self.last_status {
            self.last_status = line.to_owned();
            self.send(&format!("STATUS={}", one_line(line)));
        }
        let Some(watchdog) = self.watchdog else {
            return;
        };
        if self.last_ping.is_some_and(|at| at.elapsed() < watchdog / 2) {
            return;
        }
        let alive_within = watchdog.max(IDLE_PASS);
        let alive = match status.publisher_heartbeat_age {
            Some(age) => age < alive_within,
            None => false,
        };
        // Not yet round its loop once: starting, not wedged, until the same allowance passes.
        let starting = status.publisher_heartbeat_age.is_none() && self.started.elapsed() < alive_within;
        // The mutant pings whatever the publishing thread does.
        match status.publisher_heartbeat_age {
            _ if alive || edge_outbox::mutant::active("watchdog-ignores-heartbeat") => {
                self.last_ping = Some(Instant::now());
                self.send("WATCHDOG=1");
            }
            _ if starting => {}
            age => {
                // Said once per interval while pings are withheld: the service manager restarts
                // the relay when the interval runs out.
                if self.last_warned.is_none_or(|at| at.elapsed() >= watchdog) {
                    self.last_warned = Some(Instant::now());
                    tracing::error!(target: "edge_outbox::cli", heartbeat_age = ?age, "the publishing thread has stopped going round its loop: withholding the watchdog ping");
                }
            }
        }
    }

    fn send(&self, message: &str) {
        if let Some((socket, addr)) = &self.socket
            && let Err(e) = socket.send_to_addr(message.as_bytes(), addr)
        {
            tracing::debug!(target: "edge_outbox::cli", error = %e, "could not notify the service manager");
        }
    }
}

/// `line` with control characters (a newline in an error message) as spaces: a notification is
/// `KEY=value` lines, and a status must not add keys of its own (`WATCHDOG=1`).
fn one_line(line: &str) -> String {
    line.chars()
        .map(|c| if c.is_control() { ' ' } else { c })
        .collect()
}

/// An unbound datagram socket and the service manager's address: a path, or (Linux) an abstract
/// name written with a leading `@`.
fn open(path: &std::ffi::OsStr) -> std::io::Result<(UnixDatagram, SocketAddr)> {
    use std::os::unix::ffi::OsStrExt as _;
    let bytes = path.as_bytes();
    let addr = match bytes.split_first() {
        #[cfg(target_os = "linux")]
        Some((b'@', name)) => {
            use std::os::linux::net::SocketAddrExt as _;
            SocketAddr::from_abstract_name(name)?
        }
        _ => SocketAddr::from_pathname(path)?,
    };
    Ok((UnixDatagram::unbound()?, addr))
}
