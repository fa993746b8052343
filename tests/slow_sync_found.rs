//! A commit whose sync stalls (a flash chip busy with other writers' I/O) still reaches an idle
//! relay through its file watch: the watch sees the commit's WAL frames written, and the commit
//! shows only once the sync returns, seconds later. The relay keeps checking for that long, so the
//! row is published without waiting for the poll interval.

mod support;

use std::time::{Duration, Instant};

use support::device::{commit_orders, open_device, relay_config, wait_drained};
use support::powercut::{Fault, PowerCutFs};
use support::{Broker, Subscriber, WAIT};

/// Longer than the watch's first, fast second of checks.
const STALL: Duration = Duration::from_secs(3);

/// Syncs stall while this lives.
struct Stalled<'a>(&'a PowerCutFs);

impl<'a> Stalled<'a> {
    fn new(fs: &'a PowerCutFs) -> Self {
        fs.set_fault(Some(Fault::SlowSync(STALL)));
        Stalled(fs)
    }
}

impl Drop for Stalled<'_> {
    fn drop(&mut self) {
        self.0.set_fault(None);
    }
}

#[test]
#[cfg_attr(
    eo_skip_fuse,
    ignore = "needs FUSE: /dev/fuse, and root or fusermount3 (the build warning says why)"
)]
fn an_idle_relay_publishes_a_foreign_commit_whose_sync_stalled() {
    let fs = PowerCutFs::mount().expect("mount");
    let broker = Broker::start().expect("broker");
    let sub = Subscriber::start(broker.addr(), "orders/#").expect("subscriber");
    let outbox = open_device(fs.path());
    // A poll interval far longer than the wait below: only the watch can deliver.
    let config = relay_config(broker.addr(), "stalled-sync").poll_interval(Duration::from_secs(60));
    let relay = edge_outbox::Relay::start(&outbox, config).expect("relay");
    commit_orders(&outbox, &["k"], 1, 0);
    assert!(sub.wait_for(1, WAIT), "the first row not delivered");
    assert!(wait_drained(&outbox, WAIT), "the first row not marked");

    let conn = rusqlite::Connection::open(outbox.path()).expect("foreign connection");
    conn.execute_batch("PRAGMA synchronous = FULL")
        .expect("synchronous");
    let started = Instant::now();
    let committed = {
        // Cleared however the insert ends: a slow sync left on would stall every teardown sync.
        let _stalled = Stalled::new(&fs);
        conn.execute(
            "INSERT INTO outbox (topic, key, payload) VALUES ('orders/foreign', 'k', ?1)",
            [edge_outbox::envelope::to_cbor(&"from elsewhere").expect("cbor")],
        )
        .expect("insert");
        started.elapsed()
    };
    assert!(
        committed >= STALL,
        "the commit took {committed:?}: its sync did not stall, so the scenario tests nothing"
    );
    assert!(
        sub.wait_for(2, Duration::from_secs(10)),
        "a foreign commit whose sync stalled for {committed:?} was never published"
    );
    eprintln!(
        "commit returned after {committed:?}, published {:?} later",
        started.elapsed() - committed
    );
    relay.shutdown().expect("shutdown");
}

/// The scenario above fails against the mutant that breaks it.
#[test]
#[cfg(feature = "mutants")]
#[cfg_attr(
    eo_skip_fuse,
    ignore = "needs FUSE: /dev/fuse, and root or fusermount3 (the build warning says why)"
)]
fn the_stalled_sync_scenario_catches_its_mutant() -> Result<(), Box<dyn std::error::Error>> {
    support::mutant::caught_by(
        "recheck-no-tail",
        "an_idle_relay_publishes_a_foreign_commit_whose_sync_stalled",
        "was never published",
    )
}
