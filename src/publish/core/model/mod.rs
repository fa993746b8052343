//! The publishing core checked against a model: random sequences of application writes, network
//! events, relay restarts, clock jumps and store removals, run against the core with a real store
//! and a simulated broker, with the invariants checked after every step (see docs/model.md).
//!
//! `EDGE_OUTBOX_MODEL_CASES` sets the number of sequences (CI runs the default), and
//! `EDGE_OUTBOX_MODEL_SEED` the seed of a run to reproduce.

mod ledger;
mod regressions;
mod sim;

use std::time::Duration;

use proptest::collection::vec;
use proptest::prelude::*;
use proptest::test_runner::{Config, RngAlgorithm, TestCaseError, TestRng, TestRunner};

use self::ledger::Ledger;
use self::sim::{Answer, World};
use crate::mqtt::event::{Cause, CauseKind};
use crate::{Batching, Limits, Message, MqttConfig, OnFull, Options, RelayConfig};

/// Sequences run by `cargo test`.
const DEFAULT_CASES: u32 = 256;
/// Steps in one sequence, at most.
const MAX_STEPS: usize = 80;

/// Topics: `t/...` go alone, `b/...` are batched.
const TOPICS: [&str; 4] = ["t/0", "t/1", "b/0", "b/1"];

#[derive(Debug, Clone)]
enum Op {
    /// One transaction of `n` messages, all alike; rolled back with `rollback`.
    Write {
        n: u8,
        lane: u8,
        topic: usize,
        key: u8,
        coalescing: bool,
        evictable: bool,
        lifetime_ms: Option<u32>,
        rollback: bool,
    },
    Connect {
        receive_max: Option<u16>,
    },
    /// The broker answers one packet on the wire (PUBACKs may come back in any order).
    Answer {
        pick: usize,
    },
    /// The broker's answer to the next publish it receives.
    NextAnswer {
        answer: Answer,
    },
    Cut {
        arrived: bool,
        kind: CauseKind,
    },
    Advance {
        ms: u32,
    },
    /// The wall clock steps (NTP, an RTC-less board's first sync); the monotonic one does not.
    JumpWall {
        ms: i32,
    },
    Restart {
        arrived: bool,
    },
    LoseNext,
    RetryDeadLetter,
    Purge {
        topic: usize,
    },
    /// The application's handle removes what expired (its cleanup).
    StoreExpiry,
}

fn op() -> impl Strategy<Value = Op> {
    let write = (
        1u8..4,
        0u8..3,
        0..TOPICS.len(),
        0u8..2,
        any::<bool>(),
        any::<bool>(),
        prop::option::weighted(0.3, prop::sample::select(vec![1u32, 300, 2_000, 20_000])),
        prop::bool::weighted(0.1),
    )
        .prop_map(
            |(n, lane, topic, key, coalescing, evictable, lifetime_ms, rollback)| Op::Write {
                n,
                lane,
                topic,
                key,
                coalescing,
                evictable,
                lifetime_ms,
                rollback,
            },
        );
    let answer = prop_oneof![
        3 => Just(0usize),
        1 => any::<usize>(),
    ]
    .prop_map(|pick| Op::Answer { pick });
    let next_answer =
        prop_oneof![Just(Answer::Refuse), Just(Answer::Quota)].prop_map(|answer| Op::NextAnswer { answer });
    let kind = prop_oneof![
        Just(CauseKind::Lost),
        Just(CauseKind::NamesPacket),
        Just(CauseKind::Broker),
    ];
    prop_oneof![
        6 => write,
        2 => prop::option::of(1u16..4).prop_map(|receive_max| Op::Connect { receive_max }),
        8 => answer,
        1 => next_answer,
        2 => (any::<bool>(), kind).prop_map(|(arrived, kind)| Op::Cut { arrived, kind }),
        3 => prop::sample::select(vec![10u32, 250, 1_500, 12_000]).prop_map(|ms| Op::Advance { ms }),
        1 => prop::sample::select(vec![-30_000i32, -1_000, 1_000, 30_000]).prop_map(|ms| Op::JumpWall { ms }),
        1 => any::<bool>().prop_map(|arrived| Op::Restart { arrived }),
        1 => Just(Op::LoseNext),
        1 => Just(Op::RetryDeadLetter),
        1 => (0..TOPICS.len()).prop_map(|topic| Op::Purge { topic }),
        1 => Just(Op::StoreExpiry),
    ]
}

/// The relay as the model runs it: a small window and short timeouts; batching on `b/#` and a
/// pace where the sequence says so.
fn relay_config(paced: bool, batched: bool) -> RelayConfig {
    let mut config = RelayConfig::new(MqttConfig::new("127.0.0.1", 1883).client_id("model"))
        .max_in_flight(3)
        .ack_timeout(Duration::from_secs(5))
        .poison_disconnects(3);
    if batched {
        config = config.batch(
            "b/#",
            Batching::new().max_bytes(600).linger(Duration::from_millis(200)),
        );
    }
    if paced { config.pace_messages(4) } else { config }
}

fn options() -> Options {
    Options::new().limits(
        Limits::default()
            .max_pending_messages(6)
            .on_full(OnFull::EvictOldest),
    )
}

fn apply(world: &mut World, ledger: &mut Ledger, op: &Op) -> Result<(), TestCaseError> {
    match *op {
        Op::Write {
            n,
            lane,
            topic,
            key,
            coalescing,
            evictable,
            lifetime_ms,
            rollback,
        } => {
            let value = ledger.next_value();
            let message = |i: u8| {
                let m = Message::new(TOPICS[topic], format!("k{key}"), &(value, i))
                    .map(|m| m.priority(lane).coalescing(coalescing).evictable(evictable));
                match (m, lifetime_ms) {
                    (Ok(m), Some(ms)) => Ok(m.expires_after(Duration::from_millis(u64::from(ms)))),
                    (m, _) => m,
                }
            };
            let result = world.outbox.transaction(|tx| {
                for i in 0..n {
                    tx.send(&message(i)?)?;
                }
                if rollback {
                    return Err(WriteError::RolledBack);
                }
                Ok(())
            });
            match result {
                Ok(_) | Err(WriteError::RolledBack) => {}
                // A full store refuses the write: nothing is committed.
                Err(WriteError::Store(crate::Error::StorageFull { .. })) => {}
                Err(WriteError::Store(e)) => {
                    return Err(TestCaseError::fail(format!("a write failed: {e}")));
                }
            }
            world.core.on_change();
            world.drive();
        }
        Op::Connect { receive_max } => world.connect(receive_max),
        Op::Answer { pick } => world.answer(pick),
        Op::NextAnswer { answer } => world.broker.next_answer = Some(answer),
        Op::Cut { arrived, kind } => world.cut(arrived, &Cause::new(kind, "model: cut")),
        Op::Advance { ms } => world.advance(Duration::from_millis(u64::from(ms))),
        Op::JumpWall { ms } => {
            world.wall_shift = world.wall_shift.saturating_add(i64::from(ms));
            world.advance(Duration::ZERO);
        }
        Op::Restart { arrived } => world.restart(arrived),
        Op::LoseNext => world.broker.lose_next = true,
        Op::RetryDeadLetter => {
            if let Some(d) = world.outbox.dead_letters(1).map_err(fail)?.first() {
                match world.outbox.retry_dead_letter(d.dead_letter_id) {
                    // A coalescing message with a newer value of its key pending stays a dead
                    // letter: nothing changed, which the ledger checks like any other step.
                    Ok(()) | Err(crate::Error::RetryRefused { .. }) => {}
                    Err(e) => return Err(fail(e)),
                }
                world.core.on_change();
                world.drive();
            }
        }
        Op::StoreExpiry => {
            world.outbox.prune().map_err(fail)?;
            world.core.on_change();
            world.drive();
        }
        Op::Purge { topic } => {
            world.outbox.purge_pending(Some(TOPICS[topic])).map_err(fail)?;
            world.core.on_change();
            world.drive();
        }
    }
    ledger.take_in(world)
}

/// A write's error: the store's, or the rollback the sequence asked for.
enum WriteError {
    Store(crate::Error),
    RolledBack,
}

impl From<crate::Error> for WriteError {
    fn from(e: crate::Error) -> Self {
        WriteError::Store(e)
    }
}

fn fail(e: crate::Error) -> TestCaseError {
    TestCaseError::fail(e.to_string())
}

/// Runs one sequence, then drains: a connection that answers everything, until nothing is
/// pending; then every number is accounted for.
fn run(ops: &[Op], paced: bool, batched: bool) -> Result<(), TestCaseError> {
    let mut world = World::new(options(), relay_config(paced, batched));
    let mut ledger = Ledger::new();
    for (step, op) in ops.iter().enumerate() {
        apply(&mut world, &mut ledger, op)
            .and_then(|()| world.settle_timers().map_err(TestCaseError::fail))
            .and_then(|()| ledger.take_in(&world))
            .map_err(|e| TestCaseError::fail(format!("step {step} ({op:?}): {e}")))?;
    }
    ledger.drain(&mut world)?;
    ledger.check_accounted(&world)
}

fn cases() -> u32 {
    std::env::var("EDGE_OUTBOX_MODEL_CASES")
        .ok()
        .and_then(|n| n.parse().ok())
        .unwrap_or(DEFAULT_CASES)
}

fn runner() -> TestRunner {
    let config = Config {
        cases: cases(),
        failure_persistence: None,
        ..Config::default()
    };
    match std::env::var("EDGE_OUTBOX_MODEL_SEED") {
        Ok(seed) => {
            let mut bytes = [0u8; 32];
            for (i, b) in seed.bytes().take(32).enumerate() {
                bytes[i] = b;
            }
            TestRunner::new_with_rng(config, TestRng::from_seed(RngAlgorithm::ChaCha, &bytes))
        }
        Err(_) => TestRunner::new(config),
    }
}

#[test]
fn every_number_is_accounted_for_under_random_sequences() {
    let mut runner = runner();
    let result = runner.run(
        &(vec(op(), 1..MAX_STEPS), any::<bool>(), any::<bool>()),
        |(ops, paced, batched)| run(&ops, paced, batched),
    );
    if let Err(e) = result {
        panic!("the model found a sequence that breaks an invariant: {e}");
    }
}

/// Each of [`crate::mutant::MODEL_MUTANTS`] makes the model fail: this test binary runs its
/// model tests again with the mutant switched on, and they must fail on an invariant.
#[cfg(feature = "mutants")]
#[test]
fn the_model_catches_every_model_mutant() {
    if std::env::var_os("EDGE_OUTBOX_MUTANT").is_some_and(|m| !m.is_empty()) {
        return;
    }
    let exe = std::env::current_exe().expect("the test binary");
    for mutant in crate::mutant::MODEL_MUTANTS {
        let out = std::process::Command::new(&exe)
            .args(["publish::core::model::", "--test-threads=2"])
            .env("EDGE_OUTBOX_MUTANT", mutant)
            .env("EDGE_OUTBOX_MODEL_CASES", "400")
            .stdin(std::process::Stdio::null())
            .output()
            .expect("the test binary runs");
        let text = format!(
            "{}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
        assert!(
            !out.status.success()
                && (text.contains("the model found a sequence")
                    || text.contains("a regression sequence fails")),
            "mutant {mutant} survived the model:\n{text}"
        );
    }
}
