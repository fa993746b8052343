//! A device for relay tests: a store with a business table, and a relay config tuned for tests
//! (short backoff and keep-alive so cuts are noticed quickly).

use std::net::SocketAddr;
use std::time::Duration;

use edge_outbox::{MessageId, MqttConfig, Outbox, RelayConfig};

/// Relay settings for tests: fast reconnects, a short keep-alive and connect timeout.
pub fn relay_config(addr: SocketAddr, client_id: &str) -> RelayConfig {
    tuned(mqtt_config(addr, client_id))
}

/// [`relay_config`] for `broker` and the suite's MQTT 3.1.1 subscribers: rumqttd 0.20's 3.1.1
/// listener crashes on a publish carrying MQTT 5 properties, so against it the relay sends no
/// message expiry interval (`MqttConfig::message_expiry`). Other brokers get [`relay_config`].
pub fn relay_config_for(broker: &super::Broker, client_id: &str) -> RelayConfig {
    let rumqttd = broker.kind() == super::BrokerKind::Rumqttd;
    tuned(mqtt_config(broker.addr(), client_id).message_expiry(!rumqttd))
}

fn mqtt_config(addr: SocketAddr, client_id: &str) -> MqttConfig {
    MqttConfig::new(addr.ip().to_string(), addr.port())
        .client_id(client_id)
        .keep_alive(Duration::from_secs(5))
        .connect_timeout(Duration::from_secs(2))
}

fn tuned(mqtt: MqttConfig) -> RelayConfig {
    RelayConfig::new(mqtt).reconnect_backoff(Duration::from_millis(20), Duration::from_millis(250))
}

/// Opens a store in `dir` with an `orders` business table.
pub fn open_device(dir: &std::path::Path) -> Outbox {
    let outbox = Outbox::open(dir.join("device.db")).expect("open store");
    outbox
        .with_connection(|c| {
            c.execute_batch("CREATE TABLE IF NOT EXISTS orders (n INTEGER PRIMARY KEY, key TEXT NOT NULL)")
        })
        .expect("business table");
    outbox
}

/// Commits `n` orders, each with its message, round-robin over `keys`; `rollback_every` > 0 also
/// attempts (and rolls back) every that-many-th order. Returns the committed (id, key) pairs in
/// commit order.
pub fn commit_orders(
    outbox: &Outbox,
    keys: &[&str],
    n: usize,
    rollback_every: usize,
) -> Vec<(MessageId, String)> {
    let mut committed = Vec::with_capacity(n);
    for i in 0..n {
        let key = keys[i % keys.len()];
        let ids = outbox
            .transaction(|tx| {
                tx.execute("INSERT INTO orders (key) VALUES (?1)", [key])?;
                tx.publish(&format!("orders/{key}"), key, &(i as u64, key))?;
                Ok::<_, edge_outbox::Error>(())
            })
            .expect("commit order")
            .ids;
        committed.push((ids[0], key.to_owned()));
        if rollback_every > 0 && i % rollback_every == 0 {
            let r = outbox.transaction(|tx| {
                tx.execute("INSERT INTO orders (key) VALUES (?1)", [key])?;
                tx.publish(&format!("orders/{key}"), key, &"rolled back")?;
                Err::<(), _>(edge_outbox::Error::InvalidConfig("declined".into()))
            });
            assert!(r.is_err());
        }
    }
    committed
}

/// Waits until the store has no pending messages; false on timeout.
pub fn wait_drained(outbox: &Outbox, timeout: Duration) -> bool {
    let deadline = std::time::Instant::now() + timeout;
    while std::time::Instant::now() < deadline {
        if outbox.stats().map(|s| s.pending_messages == 0).unwrap_or(false) {
            return true;
        }
        std::thread::sleep(Duration::from_millis(5));
    }
    false
}

/// Commits `n` orders and their messages in one transaction, round-robin over `keys` (fast
/// backlogs); returns the committed (id, key) pairs in commit order.
pub fn commit_bulk(outbox: &Outbox, keys: &[&str], n: usize) -> Vec<(MessageId, String)> {
    outbox
        .transaction(|tx| {
            let mut committed = Vec::with_capacity(n);
            for i in 0..n {
                let key = keys[i % keys.len()];
                tx.execute("INSERT INTO orders (key) VALUES (?1)", [key])?;
                let id = tx.publish(&format!("orders/{key}"), key, &(i as u64, key))?;
                committed.push((id, key.to_owned()));
            }
            Ok::<_, edge_outbox::Error>(committed)
        })
        .expect("commit bulk")
        .value
}
