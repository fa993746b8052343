//! Paced replay (`RelayConfig::pace_messages`, `pace_bytes`): a backlog drains no faster than the
//! set rate. Only a lower bound on the time is asserted: a slow machine can only make it longer,
//! so the check cannot fail for want of speed, and a relay that ignores the pace fails it.

mod common;
mod support;

use std::time::{Duration, Instant};

use common::{TestResult, temp_db};
use edge_outbox::{Outbox, Relay};
use support::device::relay_config;
use support::{Broker, Subscriber, WAIT};

/// Commits `n` messages offline, starts a relay with `config`, and returns how long the
/// subscriber took from the first message to the last.
fn drain(
    n: u64,
    pace: impl FnOnce(edge_outbox::RelayConfig) -> edge_outbox::RelayConfig,
) -> TestResult<Duration> {
    let broker = Broker::start()?;
    let sub = Subscriber::start(broker.addr(), "pace/#")?;
    let (_dir, db) = temp_db()?;
    let outbox = Outbox::open(&db)?;
    outbox.transaction(|tx| {
        for i in 0..n {
            tx.publish("pace/t", "k", &i)?;
        }
        Ok::<_, edge_outbox::Error>(())
    })?;
    let _relay = Relay::start(&outbox, pace(relay_config(broker.addr(), "pace-device")))?;
    assert!(sub.wait_for(1, WAIT), "nothing arrived");
    let first = Instant::now();
    assert!(
        sub.wait_for(n as usize, WAIT),
        "only {} of {n} arrived",
        sub.len()
    );
    Ok(first.elapsed())
}

#[test]
fn a_message_pace_holds_a_backlog_to_its_rate() -> TestResult {
    // 150 messages at 100/s: at least 1.4 s after the first, less the bucket's tenth of a second.
    let took = drain(150, |c| c.pace_messages(100))?;
    assert!(
        took >= Duration::from_millis(1_300),
        "150 messages at 100/s took {took:?}"
    );
    Ok(())
}

#[test]
fn a_byte_pace_holds_a_backlog_to_its_rate() -> TestResult {
    // Each message is its envelope (about 70 bytes) and its topic: 200 of them are over 14,000
    // bytes, so at 7,000 bytes/s the drain takes at least about two seconds.
    let took = drain(200, |c| c.pace_bytes(7_000))?;
    assert!(
        took >= Duration::from_millis(1_500),
        "200 messages at 7,000 B/s took {took:?}"
    );
    Ok(())
}

#[test]
fn a_pace_of_zero_is_refused() -> TestResult {
    let (_dir, db) = temp_db()?;
    let outbox = Outbox::open(&db)?;
    let broker: std::net::SocketAddr = "127.0.0.1:9".parse()?;
    let err = Relay::start(&outbox, relay_config(broker, "pace-zero").pace_messages(0))
        .err()
        .ok_or("a relay with a pace of 0 started")?;
    assert!(matches!(err, edge_outbox::Error::InvalidConfig(_)), "{err}");
    Ok(())
}

/// The scenario above fails against the mutant that breaks it.
#[test]
#[cfg(feature = "mutants")]
fn the_scenario_catches_its_mutant() -> TestResult {
    support::mutant::caught_by(
        "pace-ignored",
        "a_message_pace_holds_a_backlog_to_its_rate",
        "150 messages at 100/s took",
    )
}
