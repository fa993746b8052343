//! One relay per database file: a second one is refused with a clear error, in this process or
//! another, and the file stays usable for readers and writers meanwhile.

mod support;

use support::Broker;
use support::device::{open_device, relay_config};

#[test]
fn a_second_relay_on_the_same_file_is_refused() {
    let broker = Broker::start().expect("broker");
    let dir = tempfile::tempdir().expect("tempdir");
    let outbox = open_device(dir.path());
    let first =
        edge_outbox::Relay::start(&outbox, relay_config(broker.addr(), "first")).expect("first relay");

    // Another handle on the same file, as a second process would open it.
    let other = edge_outbox::Outbox::open(outbox.path()).expect("second handle");
    let err = edge_outbox::Relay::start(&other, relay_config(broker.addr(), "second")).expect_err("refused");
    assert!(
        matches!(err, edge_outbox::Error::RelayAlreadyRunning { .. }),
        "{err}"
    );
    assert!(err.to_string().contains("one relay per file"), "{err}");

    // Writers are not blocked by the relay lock.
    other
        .transaction(|tx| tx.publish("t", "k", &1))
        .expect("write while a relay runs");

    first.shutdown().expect("shutdown");
    let again =
        edge_outbox::Relay::start(&other, relay_config(broker.addr(), "again")).expect("after shutdown");
    again.shutdown().expect("shutdown");
}
