//! Sequences the model found (shrunk), and a few written by hand for guarantees random sequences
//! reach too rarely: each runs on every `cargo test`, and each mutant named beside it fails it.

use super::sim::Answer;
use super::{Op, run};
use crate::mqtt::event::CauseKind;

/// `n` messages of topic `topic` (see `super::TOPICS`), key `key`, in lane 0.
fn messages(n: u8, topic: usize, key: u8, coalescing: bool, evictable: bool, lifetime_ms: Option<u32>) -> Op {
    Op::Write {
        n,
        lane: 0,
        topic,
        key,
        coalescing,
        evictable,
        lifetime_ms,
        rollback: false,
    }
}

/// A plain message.
fn write(topic: usize, key: u8) -> Op {
    messages(1, topic, key, false, false, None)
}

fn check(ops: &[Op], paced: bool) {
    if let Err(e) = run(ops, paced, true) {
        panic!("a regression sequence fails again: {e}");
    }
}

/// A row purged while it is on the wire is delivered: its notice is never published (mutant
/// `announce-unsettled`).
#[test]
fn a_row_purged_on_the_wire_is_not_announced() {
    check(
        &[
            write(0, 0),
            Op::Connect { receive_max: None },
            Op::Purge { topic: 0 },
        ],
        false,
    );
}

/// A row purged while the pace holds it back is not published (mutant `publish-removed`).
#[test]
fn a_row_purged_while_held_back_is_not_published() {
    let two = messages(2, 0, 0, false, false, None);
    check(
        &[two, Op::Connect { receive_max: None }, Op::Purge { topic: 0 }],
        true,
    );
}

/// A claimed row on the wire when the connection ends stays through eviction, and is published
/// again (mutant `remove-claimed`): six more evictable writes fill the store of six.
#[test]
fn a_claimed_row_unsettled_at_a_cut_is_not_evicted() {
    let latest = messages(1, 0, 0, true, true, None);
    let filler = |key| messages(1, 1, key, false, true, None);
    let mut ops = vec![
        latest,
        Op::Connect { receive_max: None },
        Op::Cut {
            arrived: true,
            kind: CauseKind::Lost,
        },
    ];
    ops.extend((0..7).map(|i| filler(i % 2)));
    check(&ops, false);
}

/// A publish the pace held back is checked for expiry again when its turn comes (mutant
/// `skip-expiry-held-back`).
#[test]
fn a_held_back_publish_that_expired_is_not_published() {
    let short = messages(2, 0, 0, false, false, Some(300));
    check(
        &[
            short,
            Op::Connect { receive_max: None },
            Op::Advance { ms: 1_500 },
        ],
        true,
    );
}

/// Resume from the oldest unacknowledged row after a cut (mutant `skip-resume`); a refused
/// notice is given up on and counted as the cloud will see it.
#[test]
fn a_cut_resumes_from_the_oldest_unacknowledged_row() {
    check(
        &[
            messages(3, 0, 0, false, false, None),
            Op::Connect { receive_max: None },
            Op::Answer { pick: 1 },
            Op::Cut {
                arrived: false,
                kind: CauseKind::Lost,
            },
            Op::NextAnswer {
                answer: Answer::Refuse,
            },
            Op::Purge { topic: 0 },
        ],
        false,
    );
}
