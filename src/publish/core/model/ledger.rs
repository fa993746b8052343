//! The model's reference: every number the device committed, what the broker forwarded, what
//! it lost, and what a cloud consumer concluded from what it got; the invariants are checked
//! against it.

use std::collections::{BTreeMap, BTreeSet, HashMap};

use proptest::test_runner::TestCaseError;

use super::sim::World;
use crate::MessageId;
use crate::consumer::{Consumer, Verdict};
use crate::envelope::Published;

/// What the model knows of a committed row.
struct Row {
    id: MessageId,
    /// Coalescing rows are claimed before they are published: nothing but a purge removes them
    /// after that.
    coalescing: bool,
    lane: u8,
    key: String,
    expires_at: Option<i64>,
}

#[derive(Default)]
pub(super) struct Ledger {
    values: u64,
    rows: BTreeMap<u64, Row>,
    /// Numbers forwarded to subscribers, and how often; and the ids forwarded.
    delivered: BTreeMap<u64, u32>,
    delivered_ids: std::collections::HashSet<MessageId>,
    /// Numbers a forwarded gap notice covers.
    announced: BTreeSet<u64>,
    /// Numbers the broker acknowledged and lost, or whose gap notice it refused for good.
    lost: BTreeSet<u64>,
    /// Numbers on the wire when a connection ended: delivered or not, nobody on the device can
    /// know, so a later removal announces a number the cloud may hold (see docs/model.md).
    unsettled: BTreeSet<u64>,
    unsettled_seen: usize,
    /// Unsettled numbers announced by a removal that may take them: any removal of a row that
    /// was never claimed; of a claimed one, anything but replacement and eviction.
    excused: BTreeSet<u64>,
    /// Numbers the broker refused, for now (quota) or for good with the PUBACK lost in a cut:
    /// published again after what it accepted behind them, exempt from the order check.
    postponed: BTreeSet<u64>,
    postponed_seen: usize,
    /// By (lane, key): the highest number delivered so far.
    order: HashMap<(u8, String), u64>,
    /// A consumer with the default bounds, and one past its bounds at once.
    consumer: Consumer,
    tight: Consumer,
    forwarded_seen: usize,
    lost_seen: usize,
    refused_seen: usize,
    written_seen: usize,
}

fn fail(why: String) -> TestCaseError {
    TestCaseError::fail(why)
}

impl Ledger {
    pub fn new() -> Ledger {
        Ledger {
            consumer: Consumer::new().from_start(true),
            tight: Consumer::new().from_start(true).max_gaps(2),
            ..Ledger::default()
        }
    }

    /// A fresh payload value, so no two messages are alike.
    pub fn next_value(&mut self) -> u64 {
        self.values += 1;
        self.values
    }

    /// Takes in what happened in one step, and checks the invariants that hold at every step.
    pub fn take_in(&mut self, world: &World) -> Result<(), TestCaseError> {
        self.learn_rows(world)?;
        for (payload, at) in &world.written[self.written_seen..] {
            for item in decode(payload)? {
                if let Published::Message(m) = item
                    && let Some(row) = self.rows.get(&m.seq)
                    && row.expires_at.is_some_and(|t| t <= *at)
                {
                    return Err(fail(format!(
                        "message {} was published at {at}, after its expiry at {:?}",
                        m.seq, row.expires_at
                    )));
                }
            }
        }
        self.written_seen = world.written.len();
        for item in since(&world.broker.lost, &mut self.lost_seen)? {
            match item {
                Published::Message(m) => self.lost.extend([m.seq]),
                Published::Gap(g) => self.lost.extend(g.first..=g.last),
            }
        }
        let refused = since(&world.broker.refused, &mut self.refused_seen)?;
        sort(refused, &mut self.postponed, &mut self.lost);
        // A notice on the wire when connections end may be given up on as poison (said in the
        // log and the status): then the cloud sees an unexplained gap, which the consumer check
        // below counts exactly.
        let unsettled = since(&world.broker.unsettled, &mut self.unsettled_seen)?;
        sort(unsettled, &mut self.unsettled, &mut self.lost);
        for item in since(&world.broker.postponed, &mut self.postponed_seen)? {
            if let Published::Message(m) = item {
                self.postponed.insert(m.seq);
            }
        }
        let forwarded: Vec<Vec<u8>> = world.broker.forwarded[self.forwarded_seen..].to_vec();
        self.forwarded_seen = world.broker.forwarded.len();
        for payload in forwarded {
            self.observe(&payload)?;
        }
        Ok(())
    }

    /// Rows committed since the last step, read from the file (a row replaced in its own
    /// transaction is never seen: its number is only ever announced).
    fn learn_rows(&mut self, world: &World) -> Result<(), TestCaseError> {
        let after = self.rows.last_key_value().map_or(0, |(&k, _)| k);
        let after = i64::try_from(after).unwrap_or(i64::MAX);
        let mut stmt = world
            .conn
            .prepare("SELECT seq, id, priority, key, expires_at, coalescing FROM outbox WHERE seq > ?1 ORDER BY seq")
            .map_err(|e| fail(e.to_string()))?;
        let found = stmt
            .query_map([after], |r| {
                Ok((
                    r.get::<_, i64>(0)?,
                    r.get::<_, Vec<u8>>(1)?,
                    r.get::<_, u8>(2)?,
                    r.get::<_, String>(3)?,
                    r.get::<_, Option<i64>>(4)?,
                    r.get::<_, bool>(5)?,
                ))
            })
            .map_err(|e| fail(e.to_string()))?;
        for row in found {
            let (seq, id, lane, key, expires_at, coalescing) = row.map_err(|e| fail(e.to_string()))?;
            let id = MessageId::from_bytes(id.try_into().map_err(|_| fail("an id of 16 bytes".into()))?);
            self.rows.insert(
                u64::try_from(seq).unwrap_or(0),
                Row {
                    id,
                    coalescing,
                    lane,
                    key,
                    expires_at,
                },
            );
        }
        Ok(())
    }

    /// One payload forwarded to subscribers: every item in it, as a cloud consumer sees it.
    fn observe(&mut self, payload: &[u8]) -> Result<(), TestCaseError> {
        let verdicts = self
            .consumer
            .observe_all(payload)
            .map_err(|e| fail(format!("the consumer cannot read a forwarded payload: {e}")))?;
        let tight_verdicts = self
            .tight
            .observe_all(payload)
            .map_err(|e| fail(format!("the consumer cannot read a forwarded payload: {e}")))?;
        for ((item, verdict), (_, tight_verdict)) in verdicts.into_iter().zip(tight_verdicts) {
            match item {
                Published::Message(m) => {
                    let n = m.seq;
                    let seen = self.delivered.entry(n).or_insert(0);
                    *seen += 1;
                    // A dead letter published again keeps its id under a new number: the
                    // consumer rightly calls it a duplicate when the first one got through.
                    let first = *seen == 1 && self.delivered_ids.insert(m.id);
                    if let Some(row) = self.rows.get(&n)
                        && row.id != m.id
                    {
                        return Err(fail(format!(
                            "number {n} was published with another message's id"
                        )));
                    }
                    if first && self.announced.contains(&n) {
                        return Err(fail(format!(
                            "number {n} was announced as removed, then delivered"
                        )));
                    }
                    if first && verdict == Verdict::Duplicate {
                        return Err(fail(format!(
                            "the consumer called the first delivery of {n} a duplicate"
                        )));
                    }
                    if first && tight_verdict == Verdict::Duplicate {
                        return Err(fail(format!(
                            "past its bounds, the consumer called the first delivery of {n} a duplicate"
                        )));
                    }
                    if !first && verdict != Verdict::Duplicate {
                        return Err(fail(format!(
                            "the consumer took a repeat of {n} for new: {verdict:?}"
                        )));
                    }
                    if first && let Some(row) = self.rows.get(&n) {
                        let last = self.order.entry((row.lane, row.key.clone())).or_insert(0);
                        if n < *last && !self.postponed.contains(&n) && !self.lost.contains(&n) {
                            return Err(fail(format!(
                                "key {} in lane {} was published out of commit order: {n} after {last}",
                                row.key, row.lane
                            )));
                        }
                        *last = n;
                    }
                }
                Published::Gap(g) => {
                    for n in g.first..=g.last {
                        let claimed = self.rows.get(&n).is_some_and(|r| r.coalescing);
                        // A claimed row is never replaced or evicted: only a purge, the relay's own
                        // expiry (it is never published late) or its poison isolation (the broker
                        // may have taken it before each cut) remove it.
                        let excused = self.unsettled.contains(&n)
                            && (!claimed
                                || !matches!(
                                    g.cause,
                                    crate::envelope::GapCause::Coalesced | crate::envelope::GapCause::Evicted
                                ));
                        if excused {
                            self.excused.insert(n);
                        }
                        if self.delivered.contains_key(&n) && !excused {
                            return Err(fail(format!(
                                "number {n} was delivered, then announced as removed ({:?})",
                                g.cause
                            )));
                        }
                        self.announced.insert(n);
                    }
                }
            }
        }
        Ok(())
    }

    /// Connects and answers everything until nothing is pending; then once more after one last
    /// message, which brackets every number before it.
    pub fn drain(&mut self, world: &mut World) -> Result<(), TestCaseError> {
        world.broker.lose_next = false;
        world.broker.next_answer = None;
        self.settle(world)?;
        let last = crate::Message::new("t/0", "end", &0u8).map_err(|e| fail(e.to_string()))?;
        world
            .outbox
            .transaction(|tx| tx.send(&last).map(|_| ()))
            .map_err(|e| fail(format!("the last write failed: {e}")))?;
        world.core.on_change();
        self.settle(world)
    }

    fn settle(&mut self, world: &mut World) -> Result<(), TestCaseError> {
        for _ in 0..2_000 {
            world.connect(None);
            while !world.broker.on_wire.is_empty() {
                world.answer(0);
            }
            world.advance(std::time::Duration::from_millis(300));
            self.take_in(world)?;
            if pending(world)? == 0 && world.core.in_flight() == 0 {
                return Ok(());
            }
        }
        Err(fail(format!(
            "the outbox did not drain against a broker that answers everything: {} rows and gaps pending",
            pending(world)?
        )))
    }

    /// At the end: every number committed is delivered or announced, never both, never neither
    /// (unless the broker lost it); and the consumer reports exactly the broker's losses.
    pub fn check_accounted(&self, world: &World) -> Result<(), TestCaseError> {
        let high: i64 = world
            .conn
            .query_row("SELECT seq FROM sqlite_sequence WHERE name = 'outbox'", [], |r| {
                r.get(0)
            })
            .map_err(|e| fail(e.to_string()))?;
        for n in 1..=u64::try_from(high).unwrap_or(0) {
            let delivered = self.delivered.contains_key(&n);
            let announced = self.announced.contains(&n);
            let lost = self.lost.contains(&n);
            if delivered && announced && !self.excused.contains(&n) {
                return Err(fail(format!("number {n} was both delivered and announced")));
            }
            if !delivered && !announced && !lost {
                return Err(fail(format!("number {n} was neither delivered nor announced")));
            }
        }
        let report = self.consumer.report();
        let lost_unrecovered: BTreeSet<u64> = self
            .lost
            .iter()
            .copied()
            .filter(|n| !self.delivered.contains_key(n) && !self.announced.contains(n))
            .collect();
        if report.totals.unexplained != lost_unrecovered.len() as u64 {
            return Err(fail(format!(
                "the consumer reports {} unexplained numbers, the broker lost {:?}:\n{report}",
                report.totals.unexplained, lost_unrecovered
            )));
        }
        Ok(())
    }
}

/// Rows and gap rows still in the file.
fn pending(world: &World) -> Result<i64, TestCaseError> {
    world
        .conn
        .query_row(
            "SELECT (SELECT count(*) FROM outbox) + (SELECT count(*) FROM outbox_gaps)",
            [],
            |r| r.get(0),
        )
        .map_err(|e| fail(e.to_string()))
}

/// The items of the payloads `list` gained since `seen`, which moves to its end.
/// Messages' numbers into `messages`, notices' ranges into `notices`.
fn sort(items: Vec<Published>, messages: &mut BTreeSet<u64>, notices: &mut BTreeSet<u64>) {
    for item in items {
        match item {
            Published::Message(m) => {
                messages.insert(m.seq);
            }
            Published::Gap(g) => notices.extend(g.first..=g.last),
        }
    }
}

fn since(list: &[Vec<u8>], seen: &mut usize) -> Result<Vec<Published>, TestCaseError> {
    let mut items = Vec::new();
    for payload in list.get(*seen..).unwrap_or_default() {
        items.extend(decode(payload)?);
    }
    *seen = list.len();
    Ok(items)
}

fn decode(payload: &[u8]) -> Result<Vec<Published>, TestCaseError> {
    Published::decode_all(payload).map_err(|e| fail(format!("an unreadable payload was published: {e}")))
}
