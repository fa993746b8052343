//! The test harness itself works: broker, proxy, subscriber, TLS, against whichever broker
//! `EDGE_OUTBOX_BROKER` selects (mosquitto if installed, rumqttd otherwise).

mod support;

use std::time::Duration;

use support::subscriber::QoS;
use support::{Broker, BrokerKind, Pki, Proxy, Subscriber, WAIT, publish_raw, publish_raw_many};

type Result<T = (), E = Box<dyn std::error::Error>> = std::result::Result<T, E>;

/// A short wait for "nothing happens": only used where the expected outcome is an absence.
const QUIET: Duration = Duration::from_millis(300);

fn payloads(sub: &Subscriber) -> Vec<String> {
    sub.payloads()
        .into_iter()
        .map(|p| String::from_utf8_lossy(&p).into_owned())
        .collect()
}

#[test]
fn publish_through_proxy_survives_cut_stall_refuse_and_half_open() -> Result {
    // Room for the 8 MiB publish at the end (rumqttd's default limit is 1 MiB).
    let broker = Broker::builder().max_packet_size(16 << 20).start()?;
    let proxy = Proxy::start(broker.addr())?;
    let sub = Subscriber::start(broker.addr(), "smoke/proxy/#")?;
    // A plain client (no subscription) publishing through the proxy; keep-alive 1 s so that a
    // half-open connection is noticed quickly.
    let client = Subscriber::builder(proxy.addr())
        .keep_alive(Duration::from_secs(1))
        .start()?;
    assert!(
        client.wait_connected(1, WAIT),
        "client never connected: {:?}",
        client.last_error()
    );
    assert_eq!(proxy.forwarded(), 1);

    client.publish("smoke/proxy/a", "1", QoS::AtLeastOnce)?;
    assert!(client.wait_pubacks(1, WAIT));
    assert!(sub.wait_for(1, WAIT));
    assert_eq!(sub.messages()[0].topic, "smoke/proxy/a");
    assert_eq!(sub.messages()[0].payload, b"1");

    // Cut: the client reconnects through a new proxied connection.
    proxy.cut();
    assert!(proxy.wait_forwarded(2, WAIT), "no reconnect after cut");
    assert!(
        client.wait_connected(2, WAIT),
        "no ConnAck after cut: {:?}",
        client.last_error()
    );
    client.publish("smoke/proxy/a", "2", QoS::AtLeastOnce)?;
    assert!(client.wait_pubacks(2, WAIT));
    assert!(sub.wait_for(2, WAIT));

    // Stall: nothing moves, the connection stays; resume delivers what was held.
    proxy.stall();
    let (up, down) = (proxy.bytes_to_broker(), proxy.bytes_to_client());
    assert!(up > 0 && down > 0);
    client.publish("smoke/proxy/a", "3", QoS::AtLeastOnce)?;
    assert!(!sub.wait_for(3, QUIET), "delivered through a stalled proxy");
    assert_eq!(client.pubacks(), 2);
    assert_eq!((proxy.bytes_to_broker(), proxy.bytes_to_client()), (up, down));
    proxy.resume();
    assert!(client.wait_pubacks(3, WAIT));
    assert!(sub.wait_for(3, WAIT));
    assert_eq!(proxy.forwarded(), 2, "stall must not reconnect");

    // Refuse + cut: the broker looks down; connections are accepted and closed, none forwarded.
    proxy.refuse(true);
    proxy.cut();
    let accepted = proxy.accepted();
    assert!(proxy.wait_accepted(accepted + 2, WAIT), "client did not retry");
    assert_eq!(client.connacks(), 2, "connected through a refusing proxy");
    assert_eq!(proxy.forwarded(), 2);
    proxy.refuse(false);
    assert!(proxy.wait_forwarded(3, WAIT));
    assert!(
        client.wait_connected(3, WAIT),
        "no reconnect after refuse: {:?}",
        client.last_error()
    );

    // Half-open: no FIN, no RST; the client notices through its keep-alive and reconnects.
    let errors = client.errors();
    proxy.half_open();
    assert!(
        client.wait_errors(errors + 1, Duration::from_secs(10)),
        "half-open never noticed"
    );
    assert!(
        client.wait_connected(4, WAIT),
        "no reconnect after half-open: {:?}",
        client.last_error()
    );
    assert!(proxy.forwarded() >= 4);
    client.publish("smoke/proxy/a", "4", QoS::AtLeastOnce)?;
    assert!(sub.wait_messages(WAIT, |m| m.iter().any(|m| m.payload == b"4")));

    assert_eq!(payloads(&sub), ["1", "2", "3", "4"]);

    // Cut in the middle of a large transfer (the client's socket buffers hold far less than 8 MiB).
    let before = proxy.bytes_to_broker();
    let forwarded = proxy.forwarded();
    client.publish("smoke/proxy/big", vec![0u8; 8 << 20], QoS::AtLeastOnce)?;
    assert!(proxy.wait_bytes_to_broker(before + 100_000, WAIT));
    proxy.cut();
    // Usually far less than 8 MiB has gone through; not asserted, the scheduler decides.
    eprintln!(
        "cut after {} of {} bytes",
        proxy.bytes_to_broker() - before,
        8 << 20
    );
    assert!(
        proxy.wait_forwarded(forwarded + 1, WAIT),
        "no reconnect after a cut mid-transfer"
    );
    client.stop();
    assert!(
        proxy.wait_active(0, WAIT),
        "proxy kept {} connections",
        proxy.active()
    );
    Ok(())
}

#[test]
fn publish_raw_reaches_subscriber() -> Result {
    let broker = Broker::start()?;
    let sub = Subscriber::start(broker.addr(), "smoke/raw/+")?;
    publish_raw(
        broker.addr(),
        "smoke/raw/one",
        b"\x00\xffbinary",
        QoS::AtLeastOnce,
    )?;
    publish_raw_many(
        broker.addr(),
        &[("smoke/raw/two", b"b"), ("smoke/raw/three", b"c")],
        QoS::AtLeastOnce,
    )?;
    publish_raw(broker.addr(), "smoke/raw/zero", b"d", QoS::AtMostOnce)?;
    assert!(sub.wait_for(4, WAIT), "got {:?}", sub.messages());
    let m = sub.messages();
    assert_eq!(m[0].payload, b"\x00\xffbinary");
    assert_eq!(
        m.iter().map(|m| m.topic.as_str()).collect::<Vec<_>>(),
        [
            "smoke/raw/one",
            "smoke/raw/two",
            "smoke/raw/three",
            "smoke/raw/zero"
        ]
    );
    // A big payload (the broker limit is at least 1 MiB on both brokers).
    let big = vec![7u8; 512 * 1024];
    publish_raw(broker.addr(), "smoke/raw/big", &big, QoS::AtLeastOnce)?;
    assert!(sub.wait_for(5, WAIT));
    assert_eq!(sub.messages()[4].payload, big);
    Ok(())
}

#[test]
fn publish_raw_fails_when_nothing_listens() -> Result {
    let broker = Broker::start()?;
    let proxy = Proxy::start(broker.addr())?;
    proxy.refuse(true);
    assert!(publish_raw(proxy.addr(), "smoke/none", b"x", QoS::AtLeastOnce).is_err());
    // A connection closed by the other end is retried, a bounded number of times, then it fails.
    assert_eq!(proxy.accepted(), 1 + u64::from(support::subscriber::RAW_RECLOSES));
    Ok(())
}

#[test]
fn persistent_session_queues_while_offline() -> Result {
    let broker = Broker::start()?;
    let id = "smoke-persistent";
    let sub = Subscriber::builder(broker.addr())
        .filter("smoke/persist/#")
        .client_id(id)
        .clean_session(false)
        .start()?;
    sub.stop();
    publish_raw(broker.addr(), "smoke/persist/x", b"queued", QoS::AtLeastOnce)?;
    let sub = Subscriber::builder(broker.addr())
        .filter("smoke/persist/#")
        .client_id(id)
        .clean_session(false)
        .start()?;
    assert!(
        sub.wait_for(1, WAIT),
        "{} did not keep the queued message",
        broker.kind()
    );
    assert_eq!(sub.messages()[0].payload, b"queued");
    Ok(())
}

#[test]
fn broker_kill_and_restart() -> Result {
    let mut broker = Broker::builder().persistence(true).start()?;
    let port = broker.port();
    let proxy = Proxy::start(broker.addr())?;
    let client = Subscriber::builder(proxy.addr()).start()?;
    assert!(client.wait_connected(1, WAIT));
    // Crash: the client loses its connection, keeps retrying, and reconnects on the same port.
    broker.kill()?;
    assert!(!broker.is_running());
    assert!(client.wait_errors(1, WAIT));
    broker.restart()?;
    assert!(broker.is_running());
    assert_eq!(broker.port(), port);
    assert!(
        client.wait_connected(2, WAIT),
        "no reconnect after kill: {:?}",
        client.last_error()
    );

    Ok(())
}

/// A message queued for an offline persistent session survives a graceful restart. rumqttd keeps
/// sessions in memory only, so this runs on mosquitto whichever broker the suite runs on.
#[test]
#[cfg_attr(
    eo_skip_mosquitto,
    ignore = "needs mosquitto: none installed, or EDGE_OUTBOX_SKIP=mosquitto (the build warning says which)"
)]
fn a_graceful_restart_keeps_a_persistent_sessions_queue() -> Result {
    let mut broker = Broker::builder()
        .kind(BrokerKind::Mosquitto)
        .persistence(true)
        .start()?;
    assert!(broker.keeps_sessions());
    let addr = broker.addr();
    let persistent = || {
        Subscriber::builder(addr)
            .filter("smoke/restart/#")
            .client_id("smoke-restart")
            .clean_session(false)
    };
    persistent().start()?.stop();
    publish_raw(addr, "smoke/restart/q", b"kept", QoS::AtLeastOnce)?;
    broker.restart()?;
    let sub = persistent().start()?;
    assert!(
        sub.wait_for(1, WAIT),
        "queued message lost across restart:\n{}",
        broker.log()
    );
    assert_eq!(sub.messages()[0].payload, b"kept");
    Ok(())
}

#[test]
fn tls_listener_with_generated_certificates() -> Result {
    let dir = tempfile::tempdir()?;
    let pki = Pki::generate(&dir.path().join("good"), "good")?;
    let other = Pki::generate(&dir.path().join("other"), "other")?;
    let broker = Broker::builder().tls(pki.listener(true)).start()?;
    let tls_addr = broker.tls_addr_v311().ok_or("no TLS listener")?;

    // Mutual TLS, host 127.0.0.1 checked against the IP SAN.
    let sub = Subscriber::builder(tls_addr)
        .filter("smoke/tls/#")
        .transport(pki.client_transport()?)
        .start()?;
    publish_raw(broker.addr(), "smoke/tls/a", b"over tls", QoS::AtLeastOnce)?;
    assert!(sub.wait_for(1, WAIT));

    // `localhost` matches the DNS SAN.
    let by_name = Subscriber::builder(tls_addr)
        .host("localhost")
        .filter("smoke/tls/#")
        .transport(pki.client_transport()?)
        .start()?;
    drop(by_name);

    // A client trusting another CA refuses the server; one without a certificate is refused.
    let wrong_ca = Subscriber::builder(tls_addr)
        .transport(other.client_transport()?)
        .spawn()?;
    assert!(wrong_ca.wait_errors(1, WAIT));
    assert_eq!(wrong_ca.connacks(), 0);
    let err = wrong_ca.last_error().unwrap_or_default();
    assert!(
        err.to_lowercase().contains("cert") || err.contains("Tls"),
        "{err}"
    );
    let no_cert = Subscriber::builder(tls_addr)
        .transport(pki.server_only_transport()?)
        .spawn()?;
    assert!(no_cert.wait_errors(1, WAIT));
    assert_eq!(no_cert.connacks(), 0);
    eprintln!(
        "wrong CA: {err}\nno client certificate: {:?}",
        no_cert.last_error()
    );
    Ok(())
}

#[test]
fn proxy_semantics_over_plain_tcp() -> Result {
    use std::io::{ErrorKind, Read, Write};
    use std::net::{TcpListener, TcpStream};

    let upstream = TcpListener::bind("127.0.0.1:0")?;
    let proxy = Proxy::start(upstream.local_addr()?)?;
    let read_n = |s: &mut TcpStream, n: usize| -> std::io::Result<Vec<u8>> {
        let mut buf = vec![0; n];
        s.read_exact(&mut buf)?;
        Ok(buf)
    };
    // Nothing arrives within QUIET, and the socket is not closed either.
    let silent = |s: &mut TcpStream| -> bool {
        s.set_read_timeout(Some(QUIET)).expect("timeout");
        let r = s.read(&mut [0; 16]);
        s.set_read_timeout(None).expect("timeout");
        matches!(r, Err(e) if matches!(e.kind(), ErrorKind::WouldBlock | ErrorKind::TimedOut))
    };
    let eof = |s: &mut TcpStream| matches!(s.read(&mut [0; 16]), Ok(0) | Err(_));

    let mut c = TcpStream::connect(proxy.addr())?;
    let (mut u, _) = upstream.accept()?;
    c.write_all(b"abc")?;
    assert_eq!(read_n(&mut u, 3)?, b"abc");
    u.write_all(b"xyz")?;
    assert_eq!(read_n(&mut c, 3)?, b"xyz");

    // Stall holds bytes both ways, resume delivers them in order.
    proxy.stall();
    c.write_all(b"123")?;
    u.write_all(b"789")?;
    assert!(silent(&mut u) && silent(&mut c));
    proxy.resume();
    assert_eq!(read_n(&mut u, 3)?, b"123");
    assert_eq!(read_n(&mut c, 3)?, b"789");
    assert_eq!((proxy.bytes_to_broker(), proxy.bytes_to_client()), (6, 6));

    // Half-open: bytes vanish, and neither side is told, even when the broker side closes.
    proxy.half_open();
    c.write_all(b"lost")?;
    u.write_all(b"lost")?;
    assert!(silent(&mut u) && silent(&mut c));
    drop(u);
    assert!(silent(&mut c), "the client learned about the closed broker side");
    assert_eq!(proxy.active(), 1);
    drop(c);
    assert!(proxy.wait_active(0, WAIT));

    // Cut: both sides see the connection end.
    let mut c = TcpStream::connect(proxy.addr())?;
    let (mut u, _) = upstream.accept()?;
    assert!(proxy.wait_active(1, WAIT));
    proxy.cut();
    assert!(eof(&mut c) && eof(&mut u));
    assert!(proxy.wait_active(0, WAIT));

    // Refuse: accepted, closed, never forwarded.
    proxy.refuse(true);
    let mut c = TcpStream::connect(proxy.addr())?;
    assert!(eof(&mut c));
    upstream.set_nonblocking(true)?;
    assert!(
        upstream.accept().is_err(),
        "a refused connection reached the broker"
    );
    assert_eq!((proxy.accepted(), proxy.forwarded()), (3, 2));
    upstream.set_nonblocking(false)?;
    proxy.refuse(false);

    // Dropping the proxy with a stalled, busy connection returns promptly and closes it.
    let mut c = TcpStream::connect(proxy.addr())?;
    let (mut u, _) = upstream.accept()?;
    proxy.stall();
    c.write_all(&[1; 4096])?;
    let started = std::time::Instant::now();
    drop(proxy);
    assert!(
        started.elapsed() < Duration::from_secs(2),
        "drop took {:?}",
        started.elapsed()
    );
    assert!(eof(&mut c) && eof(&mut u));
    Ok(())
}

#[test]
fn reserved_ports_lie_below_the_ephemeral_range_and_their_holder_is_found() -> Result {
    let ephemeral_start: u16 = std::fs::read_to_string("/proc/sys/net/ipv4/ip_local_port_range")?
        .split_whitespace()
        .next()
        .ok_or("empty port range")?
        .parse()?;
    let ports = support::ports::reserve(3)?;
    assert_eq!(ports.len(), 3);
    let mut distinct = ports.clone();
    distinct.sort_unstable();
    distinct.dedup();
    assert_eq!(distinct.len(), 3, "{ports:?}");
    assert!(ports.iter().all(|p| *p < ephemeral_start), "{ports:?}");
    let listener = std::net::TcpListener::bind(("127.0.0.1", ports[0]))?;
    assert!(support::ports::owned_by(std::process::id(), ports[0])?);
    // Another process (init) does not hold it, and nobody holds a port nobody listens on.
    assert!(!support::ports::owned_by(1, ports[0]).unwrap_or(false));
    assert!(!support::ports::owned_by(std::process::id(), ports[1])?);
    drop(listener);
    Ok(())
}

#[test]
fn the_listening_socket_of_a_port_is_read_from_the_kernel_table() {
    let table = "  sl  local_address rem_address   st tx_queue rx_queue tr tm->when retrnsmt   uid  timeout inode\n\
        0: 0100007F:2710 00000000:0000 0A 00000000:00000000 00:00000000 00000000     0        0 111 1\n\
        1: 0100007F:2710 0100007F:9C40 01 00000000:00000000 00:00000000 00000000     0        0 222 1\n\
        2: 0100007F:2711 00000000:0000 0A 00000000:00000000 00:00000000 00000000     0        0 333 1\n";
    assert_eq!(
        support::ports::listening_inode(table, 10_000).as_deref(),
        Some("111")
    );
    assert_eq!(
        support::ports::listening_inode(table, 10_001).as_deref(),
        Some("333")
    );
    assert_eq!(support::ports::listening_inode(table, 10_002), None);
}
