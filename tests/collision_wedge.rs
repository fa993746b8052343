//! The rumqttc collision wedge (docs/reliability.md, "The collision wedge"; rumqtt issue 1014).
//!
//! rumqttc 0.25 hands out packet ids 1..=window and reuses one as soon as it is acknowledged. When
//! the broker acknowledges out of order with the window full, the next publish wants an id still
//! in flight: rumqttc parks it (`state.collision`) and reads no further request until that id's
//! PUBACK frees it. If the connection drops first, `clean()` keeps the collision, the id is never
//! acknowledged on any later connection, and publishing stops for good: the relay connects, times
//! out on the collision after two keep-alives, reconnects, forever, while its status says
//! connected. Brokers that acknowledge out of order exist (cloud IoT hubs among them).
//!
//! The proxy holds back the first PUBACK (packet id 1) and lets the other nine of a window of ten
//! through, so rumqttc's next publish collides on id 1; half a second later it drops the
//! connection. Every later connection passes untouched. The relay must deliver everything.
//!
//! Against the relay before the fix (which kept one rumqttc client for its whole life) this test
//! fails: nothing after the first window arrives.

mod support;

use std::time::Duration;

use support::device::{commit_bulk, open_device, relay_config, wait_drained};
use support::{Broker, MqttProxy, Repeat, Subscriber, Trigger, WAIT, check};

#[test]
fn out_of_order_acks_with_a_full_window_then_a_drop_do_not_stop_publishing() {
    let broker = Broker::start().expect("broker");
    let proxy = MqttProxy::start(broker.addr()).expect("mqtt proxy");
    let sub = Subscriber::start(broker.addr(), "orders/#").expect("subscriber");
    let dir = tempfile::tempdir().expect("tempdir");
    let outbox = open_device(dir.path());
    let committed = commit_bulk(&outbox, &["a", "b", "c"], 300);

    proxy.hold_pubacks(1);
    proxy.drop_after(Trigger::PubAckHeld, Duration::from_millis(500), Repeat::Once);
    let config = relay_config(proxy.addr(), "collision").max_in_flight(10);
    let relay = edge_outbox::Relay::start(&outbox, config).expect("relay");

    assert!(proxy.wait_held(1, WAIT), "the first PUBACK was never held back");
    assert!(
        proxy.wait_connections(2, WAIT),
        "the relay did not reconnect after the drop"
    );
    let delivery = check::wait_and_check(&sub, &committed, WAIT)
        .expect("everything is delivered after the collision and the drop");
    assert!(wait_drained(&outbox, WAIT), "acknowledged rows are marked");
    let status = relay.status().expect("status");
    eprintln!(
        "{delivery:?}; {} connections, {} publishes through the proxy",
        status.connections,
        proxy.publishes()
    );
    relay.shutdown().expect("shutdown");
}
