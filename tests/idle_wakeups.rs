//! An idle relay sleeps. After a change to the WAL file the publisher checks whether a commit
//! became visible, often at first and then less and less often for a second, then once a second
//! for half a minute (a commit whose sync stalls, `tests/slow_sync_found.rs`); many
//! changes never show as a commit it can see (its own writes, a rollback whose pages spilled into
//! the WAL, the tail of a commit that already showed), and each of those must cost a few dozen
//! wake-ups, not hundreds. Wake-ups are the publisher thread's context switches, from
//! `/proc/self/task` (Linux). This binary starts one relay (its mutant check runs the scenario
//! in a child process), so the thread counted is that relay's.

mod support;
#[path = "../benches/common/threads.rs"]
mod threads;

use std::time::Duration;

use support::device::{commit_orders, open_device, relay_config, wait_drained};
use support::{Broker, Subscriber, WAIT};

/// The publisher thread's name, as the kernel keeps it (15 bytes).
const PUBLISHER: &[&str] = &["edge-outbox-relay"];
/// The thread that turns the WAL file's changes into wake-ups: without it the relay only polls,
/// and an idle one would pass here without a recheck to count.
const WATCH: &[&str] = &["edge-outbox-watch"];
/// How long the idle relay is watched after each change: past the end of its fast rechecks (the
/// once-a-second tail after them adds a wake-up or two).
const WATCHED: Duration = Duration::from_millis(1_200);
/// Wake-ups allowed in that time. A relay that rechecks every few milliseconds for the whole
/// second wakes about two hundred times.
const MOST_WAKEUPS: u64 = 80;

/// The publisher thread's wake-ups in the `WATCHED` after `f` returns (not while it runs: a
/// writer's changes keep the rechecks at their fastest, which is not idle).
fn wakeups(f: impl FnOnce()) -> u64 {
    f();
    let before = threads::usage(PUBLISHER);
    std::thread::sleep(WATCHED);
    threads::usage(PUBLISHER).since(before).switches
}

#[test]
fn an_idle_relay_sleeps_after_a_delivery_and_after_a_change_that_never_commits() {
    let broker = Broker::start().expect("broker");
    let sub = Subscriber::start(broker.addr(), "orders/#").expect("subscriber");
    let dir = tempfile::tempdir().expect("tempdir");
    let outbox = open_device(dir.path());
    // No poll to speak of: the wake-ups counted are the watch's and the timers'.
    let config = relay_config(broker.addr(), "sleeper").poll_interval(Duration::from_secs(60));
    let relay = edge_outbox::Relay::start(&outbox, config).expect("relay");

    // After each delivery: the marker's commit, and sometimes a second watch event for its tail.
    let mut woke = Vec::new();
    for round in 1..=3 {
        commit_orders(&outbox, &["k"], 1, 0);
        assert!(sub.wait_for(round, WAIT), "round {round} not delivered");
        assert!(wait_drained(&outbox, WAIT), "round {round} not marked");
        assert_eq!(
            threads::usage_by_name(PUBLISHER).len(),
            1,
            "one publisher thread to count"
        );
        assert!(
            !threads::usage_by_name(WATCH).is_empty(),
            "the file watch is not running"
        );
        woke.push(wakeups(|| {}));
    }
    assert!(
        woke.iter().all(|&n| n <= MOST_WAKEUPS),
        "the idle relay woke {woke:?} times in the {WATCHED:?} after each of three deliveries"
    );

    // A foreign transaction whose pages spill into the WAL file, then rolls back: the file
    // changes, and no commit ever shows.
    let foreign = rusqlite::Connection::open(outbox.path()).expect("foreign connection");
    foreign
        .execute_batch("PRAGMA cache_size = 8; PRAGMA cache_spill = 1;")
        .expect("small cache");
    let wal = outbox.path().with_extension("db-wal");
    let wal_before = std::fs::metadata(&wal).map(|m| m.len()).unwrap_or(0);
    let spilled = wakeups(|| {
        foreign.execute_batch("BEGIN IMMEDIATE").expect("begin");
        let big = "x".repeat(3_000);
        for n in 0..400 {
            foreign
                .execute(
                    "INSERT INTO orders (n, key) VALUES (?1, ?2)",
                    rusqlite::params![1_000_000 + n, big],
                )
                .expect("insert");
        }
        foreign.execute_batch("ROLLBACK").expect("rollback");
    });
    let wal_after = std::fs::metadata(&wal).map(|m| m.len()).unwrap_or(0);
    assert!(
        wal_after > wal_before,
        "the rolled-back transaction did not write to the WAL file ({wal_before} -> {wal_after} bytes): the scenario tests nothing"
    );
    assert!(
        spilled <= MOST_WAKEUPS,
        "the idle relay woke {spilled} times in the {WATCHED:?} after a change that never commits"
    );
    eprintln!("wake-ups after deliveries {woke:?}, after a spilled rollback {spilled}");
    relay.shutdown().expect("shutdown");
}

/// The scenario above fails against the mutant that rechecks at a flat few milliseconds for the
/// whole second after every change.
#[test]
#[cfg(feature = "mutants")]
fn the_idle_scenario_catches_its_mutant() -> Result<(), Box<dyn std::error::Error>> {
    support::mutant::caught_by(
        "recheck-flat",
        "an_idle_relay_sleeps_after_a_delivery_and_after_a_change_that_never_commits",
        "the idle relay woke",
    )
}
