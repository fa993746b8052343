//! `LatestValues`: readings kept in memory, the newest of each key committed at an interval.
//!
//! - Through a real broker: what the cloud gets of a fast stream is, per key, a subsequence of
//!   what was set, in order, ending with the last value set; far fewer commits than readings.
//! - Bad input is refused by `set` itself, and nothing of it is kept.
//! - A commit the file refuses for the moment (another writer holds it past the busy timeout)
//!   loses nothing: the values stay pending, each replaced only by a newer one of its key, and
//!   the next commit carries them. A build that dropped them (mutant
//!   `latest-dropped-on-failure`) is caught.

mod support;

use std::collections::BTreeMap;
use std::time::Duration;

use edge_outbox::{Error, LatestValues, Options, Outbox, Published, Relay};
use support::device::relay_config_for;
use support::{Broker, Subscriber, WAIT};

type TestResult<T = ()> = Result<T, Box<dyn std::error::Error>>;

const TOPIC: &str = "plant/pump-17/pressure";
const BUSY: &str = "a_commit_the_file_is_too_busy_for_keeps_every_value";

#[test]
fn the_cloud_gets_the_latest_values_in_order_with_few_commits() -> TestResult {
    let broker = Broker::start()?;
    let sub = Subscriber::start(broker.addr(), "plant/#")?;
    let dir = tempfile::tempdir()?;
    let outbox = Outbox::open(dir.path().join("device.db"))?;
    let relay = Relay::start(&outbox, relay_config_for(&broker, "pump-17"))?;
    let latest = LatestValues::start(&outbox, Duration::from_millis(100))?;
    let readings = 300_u64;
    for i in 1..=readings {
        for key in ["a", "b"] {
            latest.set(TOPIC, key, &i)?;
        }
        std::thread::sleep(Duration::from_millis(2));
    }
    let stats = latest.stats();
    let closed = latest.close()?;
    let committed = stats.committed + closed as u64;
    assert!(
        committed < readings,
        "fewer values committed ({committed}) than set per key ({readings}): {stats:?}"
    );
    assert!(
        stats.replaced > 0,
        "readings replaced in memory, never written: {stats:?}"
    );
    let done = sub.wait_messages(WAIT, |got| {
        let last: Vec<u64> = got
            .iter()
            .filter_map(|m| match Published::decode(&m.payload).ok()? {
                Published::Message(e) => e.payload_as::<u64>().ok(),
                _ => None,
            })
            .collect();
        last.iter().filter(|&&v| v == readings).count() >= 2
    });
    relay.shutdown()?;
    assert!(done, "the last value of each key arrived");
    let mut by_key: BTreeMap<String, Vec<u64>> = BTreeMap::new();
    for m in sub.messages() {
        if let Published::Message(e) = Published::decode(&m.payload)? {
            by_key.entry(e.key.to_string()).or_default().push(e.payload_as()?);
        }
    }
    for (key, values) in &by_key {
        assert!(
            values.windows(2).all(|w| w[0] < w[1]),
            "{key}: in the order set, no value twice: {values:?}"
        );
        assert_eq!(
            values.last(),
            Some(&readings),
            "{key}: ends with the last value set"
        );
    }
    assert_eq!(by_key.len(), 2);
    Ok(())
}

#[test]
fn bad_input_is_refused_by_set_and_nothing_of_it_kept() -> TestResult {
    let dir = tempfile::tempdir()?;
    let outbox = Outbox::open(dir.path().join("device.db"))?;
    let latest = LatestValues::start(&outbox, Duration::from_secs(3600))?;
    let wildcard = latest
        .set("plant/+/pressure", "a", &1)
        .expect_err("a wildcard topic");
    assert!(matches!(wildcard, Error::InvalidTopic { .. }), "{wildcard:?}");
    let big = latest
        .set(TOPIC, "a", &vec![0_u8; 70 * 1024])
        .expect_err("above the payload limit");
    assert!(matches!(big, Error::PayloadTooLarge { .. }), "{big:?}");
    assert_eq!(latest.stats().pending, 0);
    let too_fast = LatestValues::start(&outbox, Duration::from_millis(1)).expect_err("1 ms");
    assert!(too_fast.to_string().contains("commit per reading"), "{too_fast}");
    latest.set(TOPIC, "a", &1)?;
    assert_eq!(latest.close()?, 1);
    assert_eq!(outbox.stats()?.pending_messages, 1);
    Ok(())
}

#[test]
fn a_commit_the_file_is_too_busy_for_keeps_every_value() -> TestResult {
    let dir = tempfile::tempdir()?;
    let path = dir.path().join("device.db");
    let outbox = Outbox::open_with(&path, Options::new().busy_timeout(Duration::from_millis(500)))?;
    let latest = LatestValues::start(&outbox, Duration::from_secs(3600))?;
    latest.set(TOPIC, "a", &1)?;
    latest.set(TOPIC, "b", &1)?;
    latest.set(TOPIC, "c", &1)?;
    // Another process holds the write lock past the busy timeout.
    let other = rusqlite::Connection::open(&path)?;
    other.execute_batch("BEGIN IMMEDIATE")?;
    // While that commit waits for the lock: a newer value of a, and a first one of d.
    let failed = std::thread::scope(|s| -> TestResult<Error> {
        let flushing = s.spawn(|| latest.flush());
        std::thread::sleep(Duration::from_millis(150));
        latest.set(TOPIC, "a", &2)?;
        latest.set(TOPIC, "d", &2)?;
        match flushing.join() {
            Ok(Err(e)) => Ok(e),
            Ok(Ok(n)) => Err(format!("the file was busy, yet {n} values were committed").into()),
            Err(_) => Err("the flush panicked".into()),
        }
    })?;
    assert!(latest.stats().last_error.is_some(), "{failed}");
    // After the failure, a newer value of c: it wins too.
    latest.set(TOPIC, "c", &3)?;
    other.execute_batch("COMMIT")?;
    let flushed = latest.flush()?;
    let pending: Vec<(String, Vec<u8>)> = outbox.with_connection(|c| {
        let mut stmt = c.prepare("SELECT key, payload FROM outbox ORDER BY key")?;
        let rows = stmt.query_map([], |r| Ok((r.get(0)?, r.get(1)?)))?;
        rows.collect::<Result<Vec<_>, _>>()
    })?;
    assert_eq!(
        pending,
        vec![
            ("a".to_owned(), vec![2]),
            ("b".to_owned(), vec![1]),
            ("c".to_owned(), vec![3]),
            ("d".to_owned(), vec![2])
        ],
        "the busy commit lost no value, and a newer value of a key won"
    );
    assert_eq!(flushed, 4, "every key committed once the file was free");
    assert_eq!(latest.stats().last_error, None);
    latest.close()?;
    Ok(())
}

#[test]
fn values_dropped_on_a_failed_commit_are_caught() -> TestResult {
    if support::mutant::in_mutant_run() {
        return Ok(());
    }
    support::mutant::caught_by("latest-dropped-on-failure", BUSY, "the busy commit lost no value")
}
