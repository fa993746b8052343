//! The consumer's side of "nothing lost, nothing phantom, order per key": decode what a
//! subscriber received and compare it with what the device committed.

use std::collections::{HashMap, HashSet};

use edge_outbox::{Envelope, MessageId, Published};

use super::subscriber::Message;

/// What a delivery check found.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct Delivery {
    /// Envelopes received, duplicates included.
    pub received: usize,
    /// Distinct message ids received.
    pub unique: usize,
    /// `received - unique`: resends, which at-least-once allows.
    pub duplicates: usize,
}

/// Decodes every message as envelopes (a batch unpacked in order), skipping gap notices; a
/// malformed one fails the test.
pub fn decode_all(messages: &[Message]) -> Vec<Envelope<'static>> {
    messages
        .iter()
        .flat_map(|m| {
            Published::decode_all(&m.payload)
                .unwrap_or_else(|e| panic!("undecodable envelope on {}: {e}", m.topic))
                .into_iter()
                .filter_map(|item| match item {
                    Published::Message(env) => Some(env),
                    Published::Gap(_) => None,
                    other => panic!("unexpected item on {}: {other:?}", m.topic),
                })
                .collect::<Vec<_>>()
        })
        .collect()
}

/// Checks `received` against `committed` (message id and key, in commit order):
/// - every committed message arrived at least once (nothing lost);
/// - nothing arrived that was not committed (nothing phantom);
/// - per key, the first arrivals are in commit order (order kept after dedupe).
pub fn check(committed: &[(MessageId, String)], received: &[Envelope<'_>]) -> Result<Delivery, String> {
    let expected: HashSet<MessageId> = committed.iter().map(|(id, _)| *id).collect();
    let mut seen = HashSet::new();
    let mut first_order: HashMap<&str, Vec<MessageId>> = HashMap::new();
    for env in received {
        if !expected.contains(&env.id) {
            return Err(format!(
                "phantom message {} (key {:?}, seq {})",
                env.id, env.key, env.seq
            ));
        }
        if seen.insert(env.id) {
            first_order.entry(env.key.as_ref()).or_default().push(env.id);
        }
    }
    let lost: Vec<_> = committed.iter().filter(|(id, _)| !seen.contains(id)).collect();
    if !lost.is_empty() {
        return Err(format!(
            "{} of {} committed messages lost, first {:?}",
            lost.len(),
            committed.len(),
            lost[0]
        ));
    }
    let mut want: HashMap<&str, Vec<MessageId>> = HashMap::new();
    for (id, key) in committed {
        want.entry(key.as_str()).or_default().push(*id);
    }
    for (key, ids) in &want {
        let got = first_order.get(key).map(Vec::as_slice).unwrap_or_default();
        if got != ids.as_slice() {
            let at = got
                .iter()
                .zip(ids)
                .position(|(a, b)| a != b)
                .unwrap_or(got.len().min(ids.len()));
            return Err(format!(
                "key {key:?}: order differs from commit order at position {at}"
            ));
        }
    }
    Ok(Delivery {
        received: received.len(),
        unique: seen.len(),
        duplicates: received.len() - seen.len(),
    })
}

/// Waits until every committed id arrived (or the timeout), then checks.
pub fn wait_and_check(
    sub: &super::Subscriber,
    committed: &[(MessageId, String)],
    timeout: std::time::Duration,
) -> Result<Delivery, String> {
    wait_for_ids(sub, committed.iter().map(|(id, _)| *id), timeout);
    check(committed, &decode_all(&sub.messages()))
}

/// Waits until every id in `ids` arrived at least once; false on timeout.
pub fn wait_for_ids(
    sub: &super::Subscriber,
    ids: impl IntoIterator<Item = MessageId>,
    timeout: std::time::Duration,
) -> bool {
    let mut missing: HashSet<MessageId> = ids.into_iter().collect();
    wait_on_new_ids(sub, timeout, |new| {
        for id in new {
            missing.remove(&id);
        }
        missing.is_empty()
    })
}

/// Waits until at least `n` distinct message ids arrived; false on timeout.
pub fn wait_for_unique(sub: &super::Subscriber, n: usize, timeout: std::time::Duration) -> bool {
    let mut seen = HashSet::new();
    wait_on_new_ids(sub, timeout, |new| {
        seen.extend(new);
        seen.len() >= n
    })
}

/// Waits until `done` holds, handing it on each wake-up only the ids of envelopes that arrived
/// since the last one (undecodable payloads are skipped here; `check` reports them).
///
/// The predicate runs with the subscriber's lock held, so re-decoding every message on every
/// wake-up (quadratic) stalls the subscriber's own thread: with 40,000 messages in a debug build,
/// delivery fell behind by more than the whole timeout.
fn wait_on_new_ids(
    sub: &super::Subscriber,
    timeout: std::time::Duration,
    mut done: impl FnMut(&mut dyn Iterator<Item = MessageId>) -> bool,
) -> bool {
    let mut decoded = 0;
    sub.wait_messages(timeout, |msgs| {
        let mut new = msgs[decoded..]
            .iter()
            .flat_map(|m| Published::decode_all(&m.payload).unwrap_or_default())
            .filter_map(|item| match item {
                Published::Message(e) => Some(e.id),
                _ => None,
            });
        decoded = msgs.len();
        done(&mut new)
    })
}
