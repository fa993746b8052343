//! `edge-outbox broker` (hidden): rumqttd on loopback, as a process of its own, so that it can be
//! killed and restarted like any broker. The test suite runs it where mosquitto is absent.
//!
//! It lives as long as its parent: it exits when its stdin reaches end of file, which happens when
//! the parent closes the pipe or dies, however it dies. A test that panics or is killed leaves no
//! broker behind.

use std::collections::HashMap;
use std::io::Read;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::time::Duration;

use super::rumqttd_config::{Listeners, TlsListeners, rumqttd_config};
use crate::Result;
use crate::exit::CliError;

/// Where to listen. rumqttd keeps sessions in memory only: a restarted broker has forgotten them.
#[derive(Debug, clap::Args)]
pub struct BrokerArgs {
    /// The plain MQTT 3.1.1 listener (loopback addresses only).
    #[arg(long, value_name = "ADDR")]
    listen: SocketAddr,
    /// A plain MQTT 5 listener as well (rumqttd serves the versions on separate listeners).
    #[arg(long, value_name = "ADDR")]
    listen_v5: Option<SocketAddr>,
    /// Largest packet accepted (remaining length), in bytes.
    #[arg(long, value_name = "BYTES", default_value_t = 1 << 20)]
    max_packet: usize,
    /// A mutual-TLS MQTT 3.1.1 listener as well: clients must present a certificate signed by
    /// --tls-ca.
    #[arg(long, value_name = "ADDR", requires_all = ["tls_cert", "tls_key", "tls_ca"])]
    tls_listen: Option<SocketAddr>,
    /// A mutual-TLS MQTT 5 listener (with --tls-listen).
    #[arg(long, value_name = "ADDR", requires = "tls_listen")]
    tls_listen_v5: Option<SocketAddr>,
    /// The server certificate chain (PEM).
    #[arg(long, value_name = "PATH")]
    tls_cert: Option<PathBuf>,
    /// The server key (PEM).
    #[arg(long, value_name = "PATH")]
    tls_key: Option<PathBuf>,
    /// The CA that signs client certificates (PEM).
    #[arg(long, value_name = "PATH")]
    tls_ca: Option<PathBuf>,
    /// An MQTT 3.1.1 WebSocket listener as well (subprotocol `mqtt`).
    #[arg(long, value_name = "ADDR")]
    ws_listen: Option<SocketAddr>,
    /// Require a username and password: one `user:password` per line of this file.
    #[arg(long, value_name = "PATH")]
    passwords: Option<PathBuf>,
}

pub fn run(args: &BrokerArgs) -> Result<()> {
    let all = [
        args.listen_v5,
        args.tls_listen,
        args.tls_listen_v5,
        args.ws_listen,
    ];
    for addr in std::iter::once(args.listen).chain(all.into_iter().flatten()) {
        if !addr.ip().is_loopback() {
            return Err(CliError::usage(format!(
                "{addr}: the test broker listens on loopback addresses only"
            )));
        }
    }
    let tls = match (args.tls_listen, &args.tls_cert, &args.tls_key, &args.tls_ca) {
        (Some(v311), Some(cert), Some(key), Some(ca)) => Some(TlsListeners {
            listen: Listeners {
                v311,
                v5: args.tls_listen_v5,
            },
            cert,
            key,
            ca,
        }),
        _ => None,
    };
    let passwords = args.passwords.as_deref().map(read_passwords).transpose()?;
    let plain = Listeners {
        v311: args.listen,
        v5: args.listen_v5,
    };
    let config = rumqttd_config(plain, args.max_packet, tls.as_ref(), args.ws_listen, passwords);
    let broker = std::thread::Builder::new()
        .name("rumqttd".into())
        .spawn(move || rumqttd::Broker::new(config).start().map_err(|e| e.to_string()))
        .map_err(|e| CliError::runtime(format!("starting rumqttd: {e}")))?;
    let (eof_tx, eof_rx) = crossbeam_channel::bounded::<()>(1);
    std::thread::Builder::new()
        .name("stdin".into())
        .spawn(move || {
            // Nothing is ever written to stdin: this returns when the parent is gone.
            let _ = std::io::stdin().read_to_end(&mut Vec::new());
            let _ = eof_tx.send(());
        })
        .map_err(|e| CliError::runtime(format!("watching stdin: {e}")))?;
    loop {
        if eof_rx.recv_timeout(Duration::from_millis(100)).is_ok() {
            return Ok(());
        }
        // rumqttd logs a failed bind and returns from `start`: the broker is not there.
        if broker.is_finished() {
            let why = match broker.join() {
                Ok(Err(e)) => e,
                _ => "it stopped (a listener could not bind?)".to_owned(),
            };
            return Err(CliError::runtime(format!("rumqttd: {why}")));
        }
    }
}

/// `user:password` lines; blank lines are skipped.
fn read_passwords(path: &Path) -> Result<HashMap<String, String>> {
    let text = std::fs::read_to_string(path)
        .map_err(|e| CliError::usage(format!("reading {}: {e}", path.display())))?;
    text.lines()
        .filter(|l| !l.trim().is_empty())
        .map(|l| {
            l.split_once(':')
                .map(|(u, p)| (u.to_owned(), p.to_owned()))
                .ok_or_else(|| CliError::usage(format!("{}: expected user:password lines", path.display())))
        })
        .collect()
}
