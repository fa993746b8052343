//! Ports for the servers the tests start as child processes (brokers, RabbitMQ nodes), and the
//! check that the child, not someone else, is the one listening there.
//!
//! A port found free by binding port 0 lies in the kernel's ephemeral range. Between that probe
//! and the child's own bind, any test running at once may be handed the same port by its own
//! `bind(0)` (a proxy, a TLS front) or for an outgoing connection. The child then fails to bind
//! (rumqttd even keeps running without that listener), the readiness check connects to the other
//! socket, and the test talks to a stranger. So ports are drawn below the ephemeral range, where
//! the kernel never hands one out by itself, and [`owned_by`] confirms the child holds each one.

use std::collections::hash_map::RandomState;
use std::fs;
use std::hash::{BuildHasher, Hasher};
use std::io;
use std::net::{Ipv4Addr, TcpListener};

/// The lowest port drawn from; below it sit well-known services.
const LOWEST: u16 = 10_000;
/// Where the ephemeral range starts when the kernel does not say (Linux's default).
const DEFAULT_EPHEMERAL_START: u16 = 32_768;
/// Draws per port before giving up (a draw fails when the port is in use).
const DRAWS: usize = 200;

/// `n` distinct ports on 127.0.0.1 that were free a moment ago, below the ephemeral range.
pub fn reserve(n: usize) -> io::Result<Vec<u16>> {
    let end = ephemeral_start();
    if end <= LOWEST + 1_000 {
        return Err(io::Error::other(format!(
            "the ephemeral port range starts at {end}: no room below it for test servers"
        )));
    }
    let span = u64::from(end - LOWEST);
    // Held until all are drawn, so they are distinct.
    let mut held = Vec::with_capacity(n);
    for _ in 0..n {
        let listener = (0..DRAWS)
            .find_map(|_| {
                let port = LOWEST + u16::try_from(random() % span).unwrap_or(0);
                TcpListener::bind((Ipv4Addr::LOCALHOST, port)).ok()
            })
            .ok_or_else(|| io::Error::other(format!("no free port in {LOWEST}..{end}")))?;
        held.push(listener);
    }
    held.iter().map(|l| l.local_addr().map(|a| a.port())).collect()
}

/// Whether process `pid` holds the socket listening on `port` (Linux; elsewhere, where
/// `/proc/net/tcp` does not exist, it is taken on trust).
pub fn owned_by(pid: u32, port: u16) -> io::Result<bool> {
    let Ok(table) = fs::read_to_string("/proc/net/tcp") else {
        return Ok(true);
    };
    let Some(inode) = listening_inode(&table, port) else {
        return Ok(false);
    };
    let wanted = format!("socket:[{inode}]");
    for fd in fs::read_dir(format!("/proc/{pid}/fd"))? {
        let Ok(target) = fs::read_link(fd?.path()) else {
            continue;
        };
        if target.to_str() == Some(wanted.as_str()) {
            return Ok(true);
        }
    }
    Ok(false)
}

/// The inode of the socket listening on 127.0.0.1 (or any address) at `port`, from the text
/// of `/proc/net/tcp`: `sl local rem st ... inode`, addresses as `HEXIP:HEXPORT`, state `0A`
/// for LISTEN.
pub fn listening_inode(table: &str, port: u16) -> Option<String> {
    table.lines().skip(1).find_map(|line| {
        let fields: Vec<&str> = line.split_whitespace().collect();
        let (ip, hex_port) = fields.get(1)?.split_once(':')?;
        let listening = fields.get(3) == Some(&"0A");
        let ours = ip == "0100007F" || ip == "00000000";
        let same_port = u16::from_str_radix(hex_port, 16).ok() == Some(port);
        (listening && ours && same_port).then(|| fields.get(9).map(|s| (*s).to_owned()))?
    })
}

fn ephemeral_start() -> u16 {
    fs::read_to_string("/proc/sys/net/ipv4/ip_local_port_range")
        .ok()
        .and_then(|s| s.split_whitespace().next()?.parse().ok())
        .unwrap_or(DEFAULT_EPHEMERAL_START)
}

/// A fresh random number from the standard library's per-map random keys (no extra crate).
fn random() -> u64 {
    let mut h = RandomState::new().build_hasher();
    h.write_u64(0);
    h.finish()
}
