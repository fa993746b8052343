//! Behind an HTTP proxy: networks that let nothing out but through a proxy's CONNECT tunnel. The
//! stand-in (tests/support/proxy.rs, `Proxy::http_connect`) tunnels only to a broker name that
//! resolves nowhere but at the proxy, and only with the right basic authentication, so the broker
//! is reachable through the proxy or not at all.
//!
//! - Through the proxy, everything arrives, in order per key, across a kill of the proxy in the
//!   middle of the drain and its restart on the same port.
//! - A relay that does not use the proxy, or gives the wrong password, delivers nothing and keeps
//!   everything pending.
//! - A broker in the `no_proxy` list is reached directly.
//! - The command session, `send_command` and the cloud side's `subscribe` go through it too.
#![cfg(feature = "http-proxy")]

mod support;

use std::net::SocketAddr;
use std::time::Duration;

use edge_outbox::{Envelope, HttpProxy, MessageId, MqttConfig, Outbox, Relay, RelayConfig};
use support::device::{commit_orders, open_device};
use support::proxy::ConnectRule;
use support::{Broker, Proxy, Subscriber, WAIT, check, wait_until};

const KILL_AND_RESTART: &str = "everything_arrives_through_the_proxy_across_its_kill_and_restart";

type TestResult<T = ()> = Result<T, Box<dyn std::error::Error>>;

/// Resolves nowhere: only the proxy knows where this broker is.
const BROKER_NAME: &str = "broker.behind-proxy.invalid";
const USER: &str = "pump-17";
const PASSWORD: &str = "proxy-s3cret";

fn rule(broker: &Broker) -> ConnectRule {
    ConnectRule {
        target: format!("{BROKER_NAME}:{}", broker.addr().port()),
        basic_auth: Some((USER.into(), PASSWORD.into())),
    }
}

fn start_proxy(port: u16, broker: &Broker) -> std::io::Result<Proxy> {
    Proxy::http_connect(port, broker.addr(), rule(broker))
}

/// The broker by its name behind the proxy, with the suite's short timeouts.
fn mqtt(broker: &Broker, client_id: &str) -> MqttConfig {
    MqttConfig::new(BROKER_NAME, broker.addr().port())
        .client_id(client_id)
        .keep_alive(Duration::from_secs(5))
        .connect_timeout(Duration::from_secs(2))
}

fn through(proxy: &Proxy, password: &str) -> HttpProxy {
    HttpProxy::new("127.0.0.1", proxy.port()).basic_auth(USER, password)
}

/// Relay settings with the suite's fast reconnects.
fn tuned(mqtt: MqttConfig) -> RelayConfig {
    RelayConfig::new(mqtt).reconnect_backoff(Duration::from_millis(20), Duration::from_millis(250))
}

fn start_relay(outbox: &Outbox, mqtt: MqttConfig) -> edge_outbox::Result<Relay> {
    Relay::start(outbox, tuned(mqtt))
}

#[test]
fn everything_arrives_through_the_proxy_across_its_kill_and_restart() -> TestResult {
    let broker = Broker::start()?;
    let proxy = start_proxy(0, &broker)?;
    let port = proxy.port();
    let sub = Subscriber::start(broker.addr(), "orders/#")?;
    let device = tempfile::tempdir()?;
    let outbox = open_device(device.path());
    let relay = start_relay(
        &outbox,
        mqtt(&broker, "proxied-device").http_proxy(through(&proxy, PASSWORD)),
    )?;
    // The relay comes to the proxy, or fails to connect without it (the broker's name resolves
    // nowhere else).
    wait_until(|| proxy.accepted() > 0 || relay.status().is_ok_and(|s| s.last_error.is_some()));
    assert!(
        proxy.accepted() > 0,
        "nothing arrived through the proxy: the relay never came to it ({:?})",
        relay.status()
    );
    let (drained_some, written) = std::thread::scope(|s| {
        let writer = s.spawn(|| commit_orders(&outbox, &["a", "b", "c"], 600, 0));
        // Mid-drain: some delivered, the writer most likely still committing. The proxy is
        // killed: its listener and every tunnel close at once.
        let drained_some = check::wait_for_unique(&sub, 100, WAIT);
        drop(proxy);
        (drained_some, writer.join())
    });
    assert!(drained_some, "nothing arrived through the proxy");
    let mut committed = written.map_err(|_| "the writer panicked")?;
    assert!(
        wait_until(|| relay.status().is_ok_and(|s| !s.connected)),
        "the relay saw the proxy go"
    );
    // Written while the only way out is down.
    committed.extend(commit_orders(&outbox, &["a", "b", "c"], 60, 0));
    assert!(outbox.stats()?.pending_messages >= 60);
    let proxy = start_proxy(port, &broker)?;
    let delivery = check::wait_and_check(&sub, &committed, WAIT)?;
    assert_eq!(delivery.unique, committed.len(), "{delivery:?}");
    assert!(
        proxy.forwarded() >= 1,
        "the restarted proxy carried the rest: {proxy:?}"
    );
    assert_eq!(proxy.refused_connects(), (0, 0));
    assert!(
        support::device::wait_drained(&outbox, WAIT),
        "nothing left pending"
    );
    relay.shutdown()?;
    Ok(())
}

#[test]
fn a_relay_that_skips_the_proxy_or_fails_its_auth_delivers_nothing_and_keeps_everything() -> TestResult {
    let broker = Broker::start()?;
    let proxy = start_proxy(0, &broker)?;
    let sub = Subscriber::start(broker.addr(), "orders/#")?;

    // No proxy: the broker's name does not resolve here.
    let device = tempfile::tempdir()?;
    let direct = open_device(device.path());
    commit_orders(&direct, &["a"], 10, 0);
    let relay = start_relay(&direct, mqtt(&broker, "unproxied-device"))?;
    assert!(
        wait_until(|| relay.status().is_ok_and(|s| s.last_error.is_some())),
        "the relay says why it cannot connect"
    );
    assert!(!relay.status()?.connected);
    relay.shutdown()?;
    assert_eq!(
        direct.stats()?.pending_messages,
        10,
        "every message still pending"
    );

    // The proxy with the wrong password: 407, attempt after attempt.
    let device = tempfile::tempdir()?;
    let refused = open_device(device.path());
    commit_orders(&refused, &["b"], 5, 0);
    let relay = start_relay(
        &refused,
        mqtt(&broker, "wrong-password-device").http_proxy(through(&proxy, "wrong")),
    )?;
    assert!(
        wait_until(|| proxy.refused_connects().1 >= 2),
        "the proxy refuses the credentials, attempt after attempt"
    );
    let status = relay.status()?;
    assert!(!status.connected && status.last_error.is_some(), "{status:?}");
    assert!(
        !format!("{status:?}").contains("wrong"),
        "no password in the status: {status:?}"
    );
    relay.shutdown()?;
    assert_eq!(refused.stats()?.pending_messages, 5);
    assert_eq!(proxy.forwarded(), 0, "no tunnel was opened");
    assert!(sub.is_empty(), "nothing reached the broker");
    Ok(())
}

#[test]
fn a_broker_in_the_no_proxy_list_is_reached_directly() -> TestResult {
    let broker = Broker::start()?;
    let proxy = start_proxy(0, &broker)?;
    let sub = Subscriber::start(broker.addr(), "orders/#")?;
    let device = tempfile::tempdir()?;
    let outbox = open_device(device.path());
    let addr: SocketAddr = broker.addr();
    let mqtt = MqttConfig::new(addr.ip().to_string(), addr.port())
        .client_id("direct-device")
        .http_proxy(through(&proxy, PASSWORD).no_proxy("localhost, 127.0.0.1"));
    let relay = start_relay(&outbox, mqtt)?;
    let committed = commit_orders(&outbox, &["a", "b"], 20, 0);
    let delivery = check::wait_and_check(&sub, &committed, WAIT)?;
    assert_eq!(delivery.unique, committed.len(), "{delivery:?}");
    assert_eq!(proxy.accepted(), 0, "the proxy was not used: {proxy:?}");
    relay.shutdown()?;
    Ok(())
}

#[test]
fn commands_and_the_cloud_side_go_through_the_proxy_too() -> TestResult {
    let broker = Broker::start()?;
    let proxy = start_proxy(0, &broker)?;
    let device = tempfile::tempdir()?;
    let outbox = open_device(device.path());
    let relay = Relay::start(
        &outbox,
        tuned(mqtt(&broker, "commanded-device").http_proxy(through(&proxy, PASSWORD)))
            .commands("devices/commanded-device/commands/#"),
    )?;
    assert!(
        wait_until(|| relay.status().is_ok_and(|s| s.commands_connected)),
        "the command session subscribed through the proxy"
    );

    // The cloud side's subscriber, through the proxy as well.
    let (stop_tx, stop) = crossbeam_channel::bounded::<()>(0);
    let (got_tx, got) = crossbeam_channel::unbounded::<Vec<u8>>();
    let cloud = mqtt(&broker, "cloud-auditor").http_proxy(through(&proxy, PASSWORD));
    let subscriber = std::thread::spawn(move || {
        edge_outbox::subscribe(&cloud, &["orders/#".into()], false, &stop, |_topic, payload| {
            let _ = got_tx.send(payload.to_vec());
        })
    });
    assert!(
        wait_until(|| proxy.active() >= 3),
        "publisher, command session and cloud subscriber each hold a tunnel: {proxy:?}"
    );
    // Probes until the subscription stands (a tunnel is open before the SUBACK, and what is
    // published before it is not delivered), then five orders, in commit order.
    let deadline = std::time::Instant::now() + WAIT;
    loop {
        commit_orders(&outbox, &["probe"], 1, 0);
        if got.recv_timeout(Duration::from_millis(200)).is_ok() {
            break;
        }
        if std::time::Instant::now() > deadline {
            return Err("the cloud subscriber never got a probe through the proxy".into());
        }
    }
    let committed = commit_orders(&outbox, &["a"], 5, 0);
    let wanted: Vec<MessageId> = committed.iter().map(|(id, _)| *id).collect();
    let mut seen = Vec::new();
    while seen.len() < wanted.len() {
        let id = Envelope::decode(&got.recv_timeout(WAIT)?)?.id;
        if wanted.contains(&id) {
            seen.push(id);
        }
    }
    assert_eq!(
        seen, wanted,
        "the cloud subscriber got the orders, in commit order"
    );

    // A command from the cloud, sent through the proxy, lands in the device's inbox.
    let command = Envelope::command(MessageId::new_v7(), "commanded-device", &("set_rate", 12.5))?;
    edge_outbox::send_command(
        &mqtt(&broker, "ops-console").http_proxy(through(&proxy, PASSWORD)),
        "devices/commanded-device/commands/rate",
        &command,
        WAIT,
    )?;
    assert!(
        wait_until(|| outbox.stats().is_ok_and(|s| s.inbox_unapplied == 1)),
        "the command reached the inbox"
    );
    drop(stop_tx);
    subscriber.join().map_err(|_| "subscriber panicked")??;
    relay.shutdown()?;
    Ok(())
}

/// `edge-outbox relay --proxy URL`: the CLI's relay goes through the proxy, and its log never
/// shows the proxy's password (it warns that the process list does).
#[cfg(feature = "cli")]
#[test]
fn the_cli_relay_goes_through_the_proxy() -> TestResult {
    use std::io::Read as _;
    use std::process::{Command, Stdio};
    let broker = Broker::start()?;
    let proxy = start_proxy(0, &broker)?;
    let sub = Subscriber::start(broker.addr(), "orders/#")?;
    let device = tempfile::tempdir()?;
    let outbox = open_device(device.path());
    let db = device.path().join("device.db");
    let mut relay = support::ChildGuard::new(
        Command::new(env!("CARGO_BIN_EXE_edge-outbox"))
            .args(["relay", "--db"])
            .arg(&db)
            .args(["--client-id", "cli-proxied", "--broker"])
            .arg(format!("mqtt://{BROKER_NAME}:{}", broker.addr().port()))
            .arg("--proxy")
            .arg(format!("http://{USER}:{PASSWORD}@127.0.0.1:{}", proxy.port()))
            .env_remove("RUST_LOG")
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()?,
    );
    let committed = commit_orders(&outbox, &["a", "b"], 20, 0);
    let delivery = check::wait_and_check(&sub, &committed, WAIT)?;
    assert_eq!(delivery.unique, committed.len(), "{delivery:?}");
    assert!(proxy.forwarded() >= 1, "{proxy:?}");
    relay.kill_and_wait();
    let mut log = String::new();
    if let Some(mut stderr) = relay.stderr.take() {
        stderr.read_to_string(&mut log)?;
    }
    assert!(
        log.contains("127.0.0.1:"),
        "the start line names the proxy: {log}"
    );
    assert!(
        log.contains("--proxy is visible"),
        "the process-list warning: {log}"
    );
    assert!(!log.contains(PASSWORD), "the proxy's password in the log: {log}");
    Ok(())
}

/// A relay that ignores its proxy setting (mutant `proxy-ignored`) cannot reach the broker.
#[test]
fn a_relay_ignoring_the_proxy_is_caught() -> TestResult {
    if support::mutant::in_mutant_run() {
        return Ok(());
    }
    support::mutant::caught_by(
        "proxy-ignored",
        KILL_AND_RESTART,
        "nothing arrived through the proxy",
    )
}
