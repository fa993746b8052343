//! The status topic (`online`, and `offline` as the last will or on a clean stop) and broker
//! authentication with a username and password.

mod support;

use std::time::Duration;

use edge_outbox::{MqttConfig, Relay, RelayConfig};
use support::device::{commit_orders, open_device, relay_config};
use support::{Broker, BrokerKind, Proxy, Subscriber, WAIT, check};

const STATUS: &str = "devices/pump-17/status";

fn statuses(messages: &[support::Message]) -> Vec<String> {
    messages
        .iter()
        .filter(|m| m.topic == STATUS)
        .map(|m| String::from_utf8_lossy(&m.payload).into_owned())
        .collect()
}

#[test]
fn status_topic_says_online_then_offline_by_will_and_by_clean_stop() {
    let broker = Broker::start().expect("broker");
    let proxy = Proxy::start(broker.addr()).expect("proxy");
    let sub = Subscriber::start(broker.addr(), STATUS).expect("subscriber");
    let dir = tempfile::tempdir().expect("tempdir");
    let outbox = open_device(dir.path());
    let mqtt = relay_config(proxy.addr(), "pump-17")
        .mqtt()
        .clone()
        .status_topic(STATUS);
    let config =
        RelayConfig::new(mqtt).reconnect_backoff(Duration::from_millis(20), Duration::from_millis(200));
    let relay = Relay::start(&outbox, config).expect("relay");
    assert!(
        sub.wait_messages(WAIT, |m| statuses(m) == ["online"]),
        "{:?}",
        statuses(&sub.messages())
    );

    // The link dies without a DISCONNECT: the broker publishes the last will.
    proxy.cut();
    assert!(
        sub.wait_messages(WAIT, |m| statuses(m).starts_with(&[
            "online".into(),
            "offline".into(),
            "online".into()
        ])),
        "will then reconnect: {:?}",
        statuses(&sub.messages())
    );
    relay.shutdown().expect("shutdown");
    assert!(
        sub.wait_messages(WAIT, |m| statuses(m).last().map(String::as_str)
            == Some("offline")),
        "a clean stop says offline too: {:?}",
        statuses(&sub.messages())
    );

    // Retained: a late subscriber learns the device's state at once.
    let late = Subscriber::start(broker.addr(), STATUS).expect("late subscriber");
    assert!(late.wait_for(1, WAIT));
    let last = &late.messages()[0];
    assert!(last.retain && last.payload == b"offline", "{last:?}");
}

#[test]
fn username_and_password_are_required_and_checked() {
    let broker = Broker::builder()
        .user("pump-17", "s3cret")
        .start()
        .expect("broker");
    let sub = Subscriber::builder(broker.addr())
        .filter("orders/#")
        .credentials("pump-17", "s3cret")
        .start()
        .expect("subscriber");
    let mqtt = |password: &str| {
        MqttConfig::new("127.0.0.1", broker.port())
            .client_id(format!("pump-17-{password}"))
            .credentials("pump-17", password)
            .connect_timeout(Duration::from_secs(2))
    };

    let wrong_dir = tempfile::tempdir().expect("tempdir");
    let wrong = open_device(wrong_dir.path());
    commit_orders(&wrong, &["x"], 3, 0);
    let relay = Relay::start(&wrong, RelayConfig::new(mqtt("guess"))).expect("relay");
    let deadline = std::time::Instant::now() + WAIT;
    while relay.status().expect("status").last_error.is_none() && std::time::Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(10));
    }
    let status = relay.status().expect("status");
    assert!(!status.connected && status.connections == 0, "{status:?}");
    let error = status.last_error.unwrap_or_default();
    // mosquitto answers a bad login with a refusing CONNACK; rumqttd closes the connection.
    if broker.kind() == BrokerKind::Mosquitto {
        assert!(error.contains("refused"), "{error}");
    }
    relay.shutdown().expect("shutdown");
    assert_eq!(
        wrong.stats().expect("stats").pending_messages,
        3,
        "refused relays keep their rows"
    );

    let right_dir = tempfile::tempdir().expect("tempdir");
    let right = open_device(right_dir.path());
    let committed = commit_orders(&right, &["a"], 10, 0);
    let relay = Relay::start(&right, RelayConfig::new(mqtt("s3cret"))).expect("relay");
    check::wait_and_check(&sub, &committed, WAIT).expect("delivered with credentials");
    relay.shutdown().expect("shutdown");
}
