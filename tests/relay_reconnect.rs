//! Connection faults between the relay and the broker lose nothing: cuts in the middle of a
//! batch, a broker that is down while the device keeps committing, a stalled link at shutdown.

mod support;

use std::time::Duration;

use support::device::{commit_bulk, commit_orders, open_device, relay_config, wait_drained};
use support::{Broker, Proxy, Subscriber, WAIT, check};

#[test]
fn repeated_cuts_mid_batch_lose_nothing() {
    let broker = Broker::start().expect("broker");
    let proxy = Proxy::start(broker.addr()).expect("proxy");
    let sub = Subscriber::start(broker.addr(), "orders/#").expect("subscriber");
    let dir = tempfile::tempdir().expect("tempdir");
    let outbox = open_device(dir.path());
    let mut committed = Vec::new();
    let relay = edge_outbox::Relay::start(&outbox, relay_config(proxy.addr(), "cuts")).expect("relay");

    // rumqttd 0.20 drops QoS 1 messages for a subscriber that falls more than about 10,000
    // behind (measured), which the checker would read as a loss: keep its backlog smaller.
    let backlog = match broker.kind() {
        support::BrokerKind::Mosquitto => 4000,
        support::BrokerKind::Rumqttd => 800,
    };
    let mut cuts = 0;
    for round in 0..10 {
        // A backlog cut after ~20 KB of it went out: in the middle of the drain, with a full
        // window of unacknowledged messages on the wire.
        committed.extend(commit_bulk(&outbox, &["a", "b", "c"], backlog));
        let sent = proxy.bytes_to_broker();
        assert!(
            proxy.wait_bytes_to_broker(sent + 20_000, WAIT),
            "no traffic in round {round}"
        );
        proxy.cut();
        cuts += 1;
        committed.extend(commit_orders(&outbox, &["a", "d"], 20, 0));
    }
    // Ten backlogs drain after the last cut: under qemu (CI's aarch64 stage) that alone takes
    // close to WAIT, so the bound is longer here. It is only a bound: the wait ends when all
    // arrived.
    let delivery = check::wait_and_check(&sub, &committed, WAIT * 4).expect("nothing lost after cuts");
    assert!(wait_drained(&outbox, WAIT));
    let status = relay.status().expect("status");
    assert!(
        status.connections > cuts,
        "the relay reconnected after each cut: {status:?}"
    );
    eprintln!("cuts {cuts}: {delivery:?}, {} connections", status.connections);
    relay.shutdown().expect("shutdown");
}

#[test]
fn broker_unreachable_while_committing_then_the_backlog_drains() {
    let broker = Broker::start().expect("broker");
    let proxy = Proxy::start(broker.addr()).expect("proxy");
    let sub = Subscriber::start(broker.addr(), "orders/#").expect("subscriber");
    let dir = tempfile::tempdir().expect("tempdir");
    let outbox = open_device(dir.path());
    let relay = edge_outbox::Relay::start(&outbox, relay_config(proxy.addr(), "outage")).expect("relay");
    let mut committed = commit_orders(&outbox, &["a"], 10, 0);
    assert!(sub.wait_for(10, WAIT));

    proxy.refuse(true);
    proxy.cut();
    committed.extend(commit_orders(&outbox, &["a", "b"], 500, 0));
    assert!(
        !relay.status().expect("status").connected || outbox.stats().expect("stats").pending_messages > 0
    );
    assert!(
        outbox.stats().expect("stats").oldest_pending_age.is_some(),
        "lag is visible during the outage"
    );
    proxy.refuse(false);

    check::wait_and_check(&sub, &committed, WAIT).expect("backlog delivered");
    assert!(wait_drained(&outbox, WAIT));
    let status = relay.status().expect("status");
    // The outage was the last error while it lasted; once reconnected it cleared into the history.
    assert!(
        status.last_error.is_none(),
        "cleared once reconnected: {status:?}"
    );
    assert!(
        status.previous_error.is_some() && status.previous_error_span.is_some(),
        "the outage is visible in status: {status:?}"
    );
    relay.shutdown().expect("shutdown");
}

#[test]
fn broker_killed_and_restarted_mid_run() {
    let mut broker = Broker::builder().persistence(true).start().expect("broker");
    // The relay goes through a proxy, so it reconnects only after the checker has re-subscribed
    // on the restarted broker (a killed mosquitto may forget subscriptions since its last save;
    // rumqttd forgets them all).
    let proxy = Proxy::start(broker.addr()).expect("proxy");
    let sub = Subscriber::start(broker.addr(), "orders/#").expect("subscriber");
    let dir = tempfile::tempdir().expect("tempdir");
    let outbox = open_device(dir.path());
    let relay = edge_outbox::Relay::start(&outbox, relay_config(proxy.addr(), "restart")).expect("relay");
    let mut committed = commit_orders(&outbox, &["a", "b"], 1000, 0);
    broker.kill().expect("kill broker");
    proxy.refuse(true);
    committed.extend(commit_orders(&outbox, &["a", "b"], 200, 0));
    broker.restart().expect("restart broker");
    assert!(
        sub.wait_subscribed(2, WAIT),
        "checker re-subscribed after the restart"
    );
    proxy.refuse(false);
    committed.extend(commit_orders(&outbox, &["a", "b"], 200, 0));

    assert!(
        wait_drained(&outbox, WAIT),
        "backlog drained after the broker came back"
    );
    // What the broker had accepted but not yet delivered when it was killed is the broker's loss,
    // not the device's: the device's promise is that everything it had not seen acknowledged is
    // published again. So check everything committed from the kill on, all of it, in order.
    let from_kill: Vec<_> = committed[1000..].to_vec();
    let all_arrived = check::wait_for_ids(&sub, from_kill.iter().map(|(id, _)| *id), WAIT);
    assert!(
        all_arrived,
        "messages committed during or after the outage were lost"
    );
    let got = check::decode_all(&sub.messages());
    let after: Vec<_> = got
        .iter()
        .filter(|e| from_kill.iter().any(|(id, _)| *id == e.id))
        .cloned()
        .collect();
    check::check(&from_kill, &after).expect("order per key after the restart");
    let status = relay.status().expect("status");
    assert!(status.connections >= 2, "{status:?}");
    relay.shutdown().expect("shutdown");
}

#[test]
fn shutdown_with_a_stalled_link_is_bounded_and_keeps_unacked_rows() {
    let broker = Broker::start().expect("broker");
    let proxy = Proxy::start(broker.addr()).expect("proxy");
    let dir = tempfile::tempdir().expect("tempdir");
    let outbox = open_device(dir.path());
    let config = relay_config(proxy.addr(), "stall").shutdown_timeout(Duration::from_millis(300));
    let relay = edge_outbox::Relay::start(&outbox, config).expect("relay");
    commit_orders(&outbox, &["a"], 5, 0);
    assert!(wait_drained(&outbox, WAIT));
    proxy.stall();
    commit_orders(&outbox, &["a"], 50, 0);
    let started = std::time::Instant::now();
    relay.shutdown().expect("shutdown");
    // Bounded by the shutdown timeout plus the connect timeout, never hung on the stalled link.
    assert!(
        started.elapsed() < Duration::from_secs(10),
        "shutdown took {:?}",
        started.elapsed()
    );
    assert_eq!(
        outbox.stats().expect("stats").pending_messages,
        50,
        "unacknowledged rows stay queued"
    );
}
