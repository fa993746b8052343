//! Every committed message reaches a real subscriber, decodable, in commit order per key, and
//! nothing is published for a rolled-back transaction.

mod support;

use support::device::{commit_orders, open_device, relay_config, wait_drained};
use support::{Broker, Subscriber, WAIT, check};

#[test]
fn committed_messages_arrive_in_order_per_key_and_rollbacks_never_do() {
    let broker = Broker::start().expect("broker");
    let sub = Subscriber::start(broker.addr(), "orders/#").expect("subscriber");
    let dir = tempfile::tempdir().expect("tempdir");
    let outbox = open_device(dir.path());

    // Half the backlog is committed before the relay starts (offline), half while it runs.
    let mut committed = commit_orders(&outbox, &["a", "b", "c"], 300, 7);
    let relay = edge_outbox::Relay::start(&outbox, relay_config(broker.addr(), "e2e")).expect("relay");
    committed.extend(commit_orders(&outbox, &["a", "b", "c", "d"], 300, 11));

    let delivery = check::wait_and_check(&sub, &committed, WAIT).expect("delivery");
    assert_eq!(delivery.unique, 600);
    assert!(wait_drained(&outbox, WAIT), "acknowledged rows are removed");

    let status = relay.status().expect("status");
    assert!(status.connected);
    assert_eq!(status.acknowledged, status.published, "{status:?}");
    assert!(status.acknowledged >= 600);
    assert_eq!(status.store.pending_messages, 0);

    // The envelope carries what was committed.
    let env = &check::decode_all(&sub.messages())[0];
    assert_eq!(env.source, "e2e");
    let (n, key): (u64, String) = env.payload_as().expect("payload");
    assert_eq!((n, key.as_str()), (0, "a"));
    relay.shutdown().expect("clean shutdown");
}

#[test]
fn an_idle_relay_publishes_a_new_commit_without_waiting_for_a_poll() {
    let broker = Broker::start().expect("broker");
    let sub = Subscriber::start(broker.addr(), "orders/#").expect("subscriber");
    let dir = tempfile::tempdir().expect("tempdir");
    let outbox = open_device(dir.path());
    // A poll interval far longer than the wait below: only the in-process wake-up can deliver.
    let config = relay_config(broker.addr(), "wake").poll_interval(std::time::Duration::from_secs(60));
    let relay = edge_outbox::Relay::start(&outbox, config).expect("relay");
    for round in 1..=3 {
        let committed = commit_orders(&outbox, &["k"], 1, 0);
        assert!(sub.wait_for(round, WAIT), "round {round} not delivered");
        let got = check::decode_all(&sub.messages());
        assert_eq!(got.last().map(|e| e.id), Some(committed[0].0));
    }
    relay.shutdown().expect("shutdown");
}

/// The relay drops the wake-ups of commits that brought nothing to read (its own marks); a
/// commit by another process, after the relay went idle, still reaches it through the watch.
#[test]
fn an_idle_relay_publishes_a_row_another_connection_commits() {
    let broker = Broker::start().expect("broker");
    let sub = Subscriber::start(broker.addr(), "orders/#").expect("subscriber");
    let dir = tempfile::tempdir().expect("tempdir");
    let outbox = open_device(dir.path());
    // A poll interval far longer than the wait below: only the watch can deliver.
    let config = relay_config(broker.addr(), "idle").poll_interval(std::time::Duration::from_secs(60));
    let relay = edge_outbox::Relay::start(&outbox, config).expect("relay");
    // Published, acknowledged and marked: the relay has read to the end and waits.
    commit_orders(&outbox, &["k"], 1, 0);
    assert!(sub.wait_for(1, WAIT), "the first row not delivered");
    assert!(wait_drained(&outbox, WAIT), "the first row not marked");
    let conn = rusqlite::Connection::open(outbox.path()).expect("foreign connection");
    conn.execute(
        "INSERT INTO outbox (topic, key, payload) VALUES ('orders/foreign', 'k', ?1)",
        [edge_outbox::envelope::to_cbor(&"from elsewhere").expect("cbor")],
    )
    .expect("insert");
    assert!(
        sub.wait_for(2, std::time::Duration::from_secs(10)),
        "a row another connection committed was never published"
    );
    relay.shutdown().expect("shutdown");
}

/// The scenario above fails against the mutant that breaks it.
#[test]
#[cfg(feature = "mutants")]
fn the_idle_scenario_catches_its_mutant() -> Result<(), Box<dyn std::error::Error>> {
    support::mutant::caught_by(
        "foreign-rows-unseen",
        "an_idle_relay_publishes_a_row_another_connection_commits",
        "never published",
    )
}

#[test]
fn rows_written_by_another_connection_are_noticed_by_polling() {
    let broker = Broker::start().expect("broker");
    let sub = Subscriber::start(broker.addr(), "foreign/#").expect("subscriber");
    let dir = tempfile::tempdir().expect("tempdir");
    let outbox = open_device(dir.path());
    let relay = edge_outbox::Relay::start(&outbox, relay_config(broker.addr(), "poll")).expect("relay");
    // A plain rusqlite connection, as another process would write through the SQL contract.
    let conn = rusqlite::Connection::open(outbox.path()).expect("foreign connection");
    conn.execute(
        "INSERT INTO outbox (topic, key, payload) VALUES ('foreign/t', 'x', ?1)",
        [edge_outbox::envelope::to_cbor(&"from elsewhere").expect("cbor")],
    )
    .expect("insert");
    conn.execute(
        "INSERT INTO outbox (topic, key, payload) VALUES ('foreign/t', 'x', 'plain text')",
        [],
    )
    .expect("insert text");
    assert!(sub.wait_for(2, WAIT), "foreign rows not published");
    let got = check::decode_all(&sub.messages());
    assert_eq!(
        got[0].payload_as::<String>().expect("cbor payload"),
        "from elsewhere"
    );
    assert_eq!(got[1].payload_as::<String>().expect("text payload"), "plain text");
    assert_eq!(got[0].id.as_bytes().len(), 16);
    relay.shutdown().expect("shutdown");
}

#[test]
fn rows_that_can_never_be_published_are_dead_lettered_and_do_not_block_the_rest() {
    let broker = Broker::start().expect("broker");
    let sub = Subscriber::start(broker.addr(), "bad/#").expect("subscriber");
    let dir = tempfile::tempdir().expect("tempdir");
    let outbox = open_device(dir.path());
    let conn = rusqlite::Connection::open(outbox.path()).expect("foreign connection");
    let big = edge_outbox::envelope::to_cbor(&serde_bytes_like(4096)).expect("cbor");
    conn.execute_batch("BEGIN").expect("begin");
    conn.execute(
        "INSERT INTO outbox (topic, key, payload) VALUES ('bad/t', 'k', x'ff')",
        [],
    )
    .expect("not cbor");
    conn.execute(
        "INSERT INTO outbox (topic, key, payload) VALUES ('bad/t', 'k', ?1)",
        [&big],
    )
    .expect("too big");
    conn.execute(
        "INSERT INTO outbox (topic, key, payload) VALUES ('bad/#', 'k', x'01')",
        [],
    )
    .expect("wildcard");
    conn.execute(
        "INSERT INTO outbox (topic, key, payload) VALUES ('bad/t', 'k', x'02')",
        [],
    )
    .expect("good");
    conn.execute_batch("COMMIT").expect("commit");

    let mut config = relay_config(broker.addr(), "dl");
    config = edge_outbox::RelayConfig::new(config.mqtt().clone().max_packet_size(1024));
    let relay = edge_outbox::Relay::start(&outbox, config).expect("relay");
    assert!(
        sub.wait_for(1, WAIT),
        "the good row behind the bad ones was not published"
    );
    assert_eq!(
        check::decode_all(&sub.messages())[0]
            .payload_as::<u8>()
            .expect("payload"),
        2
    );
    assert!(wait_drained(&outbox, WAIT));
    let dead = outbox.dead_letters(10).expect("dead letters");
    assert_eq!(dead.len(), 3, "{dead:#?}");
    assert!(dead[0].reason.contains("CBOR"), "{}", dead[0].reason);
    assert!(dead[1].reason.contains("limit"), "{}", dead[1].reason);
    assert!(dead[2].reason.contains("topic"), "{}", dead[2].reason);
    assert_eq!(relay.status().expect("status").dead_lettered, 3);
    relay.shutdown().expect("shutdown");
}

fn serde_bytes_like(n: usize) -> Vec<u64> {
    (0..n as u64).map(|i| i * 1_000_003).collect()
}

#[test]
fn a_window_wider_and_narrower_than_rumqttcs_default_delivers_everything_in_order() {
    let broker = Broker::start().expect("broker");
    let sub = Subscriber::start(broker.addr(), "orders/#").expect("subscriber");
    for (i, window) in [1usize, 7, 300].into_iter().enumerate() {
        let dir = tempfile::tempdir().expect("tempdir");
        let outbox = open_device(dir.path());
        let committed = support::device::commit_bulk(&outbox, &["a", "b"], 1000);
        let config = relay_config(broker.addr(), &format!("window-{i}")).max_in_flight(window);
        let relay = edge_outbox::Relay::start(&outbox, config).expect("relay");
        check::wait_and_check(&sub, &committed, WAIT).unwrap_or_else(|e| panic!("window {window}: {e}"));
        assert!(wait_drained(&outbox, WAIT), "window {window} drained");
        relay.shutdown().expect("shutdown");
        sub.take();
    }
}
