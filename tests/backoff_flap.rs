//! Backoff that means it (docs/reliability.md, "Poison isolation"): the wait between connection
//! attempts starts again from its minimum only once a connection proved healthy (a PUBACK came, or
//! it held for one keep-alive), never on CONNACK alone. A broker that accepts CONNECT and drops
//! the connection at once used to be hammered about 13 times a second forever; now it is retried
//! less and less often.
//!
//! No timing assertion: the test counts the connections the proxy saw over whatever time the
//! window took, and checks the count against the most the backoff schedule allows in that time.

mod support;

use std::time::{Duration, Instant};

use support::device::{commit_orders, open_device, relay_config};
use support::{Broker, MqttProxy, Repeat, Subscriber, Trigger, WAIT};

/// The most connection attempts an exponential backoff from `min` doubling to `max`, each wait
/// at least half its ceiling (equal jitter), allows within `elapsed`: the first attempt at once,
/// then one after each wait.
fn most_attempts(min: Duration, max: Duration, elapsed: Duration) -> u64 {
    let mut attempts = 1;
    let mut spent = Duration::ZERO;
    let mut ceiling = min;
    loop {
        spent += ceiling / 2;
        if spent > elapsed {
            return attempts;
        }
        attempts += 1;
        ceiling = (ceiling * 2).min(max);
    }
}

#[test]
fn a_broker_that_accepts_and_drops_at_once_gets_exponential_backoff() {
    let broker = Broker::start().expect("broker");
    let proxy = MqttProxy::start(broker.addr()).expect("mqtt proxy");
    let sub = Subscriber::start(broker.addr(), "orders/#").expect("subscriber");
    proxy.drop_after(Trigger::ConnAck, Duration::ZERO, Repeat::Always);
    let dir = tempfile::tempdir().expect("tempdir");
    let outbox = open_device(dir.path());
    commit_orders(&outbox, &["a"], 5, 0);
    let (min, max) = (Duration::from_millis(100), Duration::from_secs(10));
    let config = relay_config(proxy.addr(), "flap").reconnect_backoff(min, max);

    let started = Instant::now();
    let relay = edge_outbox::Relay::start(&outbox, config).expect("relay");
    // Wait for the window: the proxy's own wait, on a count the backoff will not reach in it.
    let window = Duration::from_secs(3);
    proxy.wait_connections(1000, window);
    let (seen, elapsed) = (proxy.connacks(), started.elapsed());
    let bound = most_attempts(min, max, elapsed);
    eprintln!("{seen} connections in {elapsed:?}; the backoff allows at most {bound}");
    assert!(seen >= 2, "the relay keeps trying: {seen}");
    assert!(
        seen <= bound,
        "{seen} connections in {elapsed:?}: more than the {bound} an exponential backoff allows \
         (the backoff was reset on CONNACK)"
    );

    // Once the broker behaves, messages flow and the relay recovers.
    proxy.clear_drop_after();
    assert!(
        sub.wait_for(5, WAIT),
        "delivered once the broker keeps the connection"
    );
    relay.shutdown().expect("shutdown");
}

#[test]
fn the_bound_is_what_the_schedule_says() {
    let (min, max) = (Duration::from_millis(100), Duration::from_secs(1));
    assert_eq!(most_attempts(min, max, Duration::ZERO), 1);
    // Waits of at least 50, 100, 200, 400, 500, 500 ms: attempts at 0, 50, 150, 350, 750, 1250,
    // 1750 ms at the earliest.
    assert_eq!(most_attempts(min, max, Duration::from_millis(49)), 1);
    assert_eq!(most_attempts(min, max, Duration::from_millis(50)), 2);
    assert_eq!(most_attempts(min, max, Duration::from_millis(749)), 4);
    assert_eq!(most_attempts(min, max, Duration::from_millis(750)), 5);
    assert_eq!(most_attempts(min, max, Duration::from_millis(1750)), 7);
}
