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

/// A publish with a lifetime is not queued behind the broker's receive maximum, where it would be
/// written after its expiry once a PUBACK frees a slot (mutant `queue-expiring`). With a
/// receive maximum of one and a window of three, the second row would be queued.
#[test]
fn a_publish_with_a_lifetime_waits_for_a_slot_on_the_wire() {
    check(
        &[
            write(0, 0),
            messages(1, 0, 1, false, false, Some(300)),
            Op::Connect { receive_max: Some(1) },
            Op::Advance { ms: 1_500 },
            Op::Answer { pick: 0 },
        ],
        false,
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

/// While the broker stays over quota, each pause is longer than the last, although the answer to
/// a message written before the refusal comes during the pause and accepts it (mutant
/// `quota-cleared-by-earlier`: that answer resets the backoff, and the second pause is as short
/// as the first). Written by hand: the model's ledger checks what is delivered, not how long the
/// relay waits.
#[test]
fn a_quota_pause_grows_while_the_broker_stays_over_quota() {
    use std::time::Duration;

    use super::sim::World;
    use crate::Message;

    // The pause waits between half the backoff's ceiling and all of it: the first in [0.5, 1) s,
    // a second after a reset too, and one that doubled in [1, 2) s.
    let config =
        super::relay_config(false, false).reconnect_backoff(Duration::from_secs(1), Duration::from_secs(60));
    let mut world = World::new(super::options(), config);
    world
        .outbox
        .transaction(|tx| {
            for i in 0..2 {
                tx.send(&Message::new(super::TOPICS[0], format!("k{i}"), &i)?)?;
            }
            Ok::<_, crate::Error>(())
        })
        .expect("two messages");
    world.core.on_change();
    world.drive();
    world.connect(None);
    let mut pauses = Vec::new();
    for round in 0..2 {
        // The oldest message on the wire is refused for now.
        world.broker.next_answer = Some(Answer::Quota);
        world.answer(0);
        let (until, _) = world.core.paused_until.clone().expect("paused by the quota");
        let pause = until.duration_since(world.now);
        pauses.push(pause);
        if round == 0 {
            // The other message, written before the refusal, is accepted during the pause.
            world.answer(0);
            assert!(world.core.paused_until.is_some(), "still paused");
        }
        // The pause ends: the connection is renewed and the refused message published again.
        world.advance(pause + Duration::from_millis(1));
        world.connect(None);
    }
    assert!(
        pauses[1] >= Duration::from_secs(1),
        "the second quota pause did not grow: {pauses:?}"
    );
}

/// A store holding one plain message, the relay not connected yet.
fn world_with_one_message() -> super::sim::World {
    let mut world = super::sim::World::new(super::options(), super::relay_config(false, false));
    world
        .outbox
        .transaction(|tx| tx.send(&crate::Message::new(super::TOPICS[0], "k", &1)?))
        .expect("a message");
    world.core.on_change();
    world.drive();
    world
}

/// Just longer than a connection's quiet start while a message is suspected.
fn past_quiet_start() -> std::time::Duration {
    super::super::verdicts::CHOKE_WINDOW + std::time::Duration::from_millis(1)
}

/// `times` ack timeouts of the oldest message on the wire, each renewing the connection, and
/// each followed by a new connection whose quiet start holds, so the message is published again.
fn time_out_and_reconnect(world: &mut super::sim::World, times: usize) {
    for _ in 0..times {
        world.advance(std::time::Duration::from_secs(6));
        world.connect(None);
        world.advance(past_quiet_start());
    }
}

/// A connection that just ended: no reason given, as a broker closing does.
fn dropped() -> crate::mqtt::event::Cause {
    crate::mqtt::event::Cause::new(CauseKind::Lost, "model: the connection dropped")
}

/// Poison isolation against two brokers at once: one that closes over the message (a strike
/// each time its quiet start held) interleaved with one that ends every connection during its
/// quiet start (the next broker of a failover list, flapping) still isolates it; a flapping
/// broker alone clears the suspicion after two such ends in a row, so it never isolates an
/// innocent message (mutant `suspect-written-at-once`, which has no quiet start, fails it).
#[test]
fn poison_is_isolated_through_a_flapping_broker_and_a_flapping_broker_alone_isolates_nothing() {
    use std::time::Duration;

    let (quiet, lost) = (past_quiet_start(), dropped());

    // Closes over it at once (strike), then a flapping broker ends a quiet start, in turn.
    let mut world = world_with_one_message();
    world.connect(None);
    world.cut(false, &lost);
    for _ in 0..2 {
        world.connect(None);
        world.cut(false, &lost);
        world.connect(None);
        world.advance(quiet);
        assert_eq!(world.core.in_flight(), 1, "published once the quiet start held");
        world.cut(false, &lost);
    }
    let dead = world.outbox.dead_letters(10).expect("dead letters");
    assert_eq!(dead.len(), 1, "isolated after three strikes: {dead:#?}");

    // Only a flapping broker: every connection ends soon after it starts.
    let mut world = world_with_one_message();
    for _ in 0..12 {
        world.connect(None);
        world.advance(Duration::from_millis(300));
        world.cut(false, &lost);
    }
    assert!(
        world.outbox.dead_letters(10).expect("dead letters").is_empty(),
        "a flapping broker isolated the message"
    );
    // The suspicion was cleared, not kept forever: the next connection publishes at once.
    world.connect(None);
    assert!(
        world.core.suspect.is_none() && world.core.in_flight() == 1,
        "a suspect kept the connection quiet"
    );
}

/// What a connection whose quiet start held says of a suspect when it ends with no strike: with
/// the row gone from the outbox (purged), nothing, and the suspicion is cleared rather than
/// keeping every later connection quiet; with the row on the wire but dropped too late to blame
/// it, the strikes are kept.
#[test]
fn a_held_connection_clears_a_gone_suspect_and_keeps_one_it_cannot_judge() {
    use std::time::Duration;

    let (quiet, lost) = (past_quiet_start(), dropped());
    let struck = || {
        let mut world = world_with_one_message();
        world.connect(None);
        world.cut(false, &lost);
        assert!(world.core.suspect.is_some(), "a strike");
        world
    };

    // Gone: purged while the relay was disconnected.
    let mut world = struck();
    world.outbox.purge_pending(None).expect("purge");
    world.core.on_change();
    world.connect(None);
    world.advance(quiet);
    // The purge's gap notice is what goes out: acknowledged, then the connection ends.
    world.answer(0);
    assert_eq!(world.core.in_flight(), 0, "nothing left in flight");
    world.cut(false, &lost);
    assert!(
        world.core.suspect.is_none(),
        "a suspect whose row is gone was kept"
    );
    world.connect(None);
    assert!(
        world.core.quiet_until.is_none(),
        "the next connection is quiet for nothing"
    );

    // On the wire, but the drop came long after it was written: no evidence either way.
    let mut world = struck();
    world.connect(None);
    world.advance(quiet);
    assert_eq!(world.core.in_flight(), 1, "published once the quiet start held");
    world.advance(Duration::from_secs(3));
    world.cut(false, &lost);
    assert!(
        world.core.suspect.as_ref().is_some_and(|x| x.strikes == 1),
        "the strike was lost over a drop that blames nothing"
    );
}

/// A store holding plain messages in lane 0, one per topic of `topics`, the relay not connected;
/// no limit on pending messages (the model's store holds six).
fn world_with_messages(topics: &[usize]) -> super::sim::World {
    let mut world = super::sim::World::new(crate::Options::new(), super::relay_config(false, false));
    world
        .outbox
        .transaction(|tx| {
            for (i, &topic) in topics.iter().enumerate() {
                tx.send(&crate::Message::new(super::TOPICS[topic], format!("k{i}"), &i)?)?;
            }
            Ok::<_, crate::Error>(())
        })
        .expect("messages");
    world.core.on_change();
    world.drive();
    world
}

/// A panic in the words `the_model_catches_every_model_mutant` looks for.
fn fails_again(what: &str) -> ! {
    panic!("a regression sequence fails again: {what}")
}

/// After a connection ends with a window on the wire, the rows it left unjudged are published one
/// at a time until each was answered, taking turns with an alarm written since: the first answer
/// does not reopen the window (mutant `probe-ends-at-any-answer`). A row of the cut that left the
/// outbox meanwhile does not keep the window at one.
#[test]
fn probing_ends_once_every_row_of_the_cut_was_answered() {
    let lost = dropped();

    let mut world = world_with_messages(&[0, 0]);
    world.connect(None);
    assert_eq!(world.core.in_flight(), 2, "both rows on the wire");
    world.cut(false, &lost);
    assert!(world.core.probing(), "probing after a window was cut");
    write_alarm(&mut world, 0);
    world.connect(None);
    // The cut's two rows and the alarm, one at a time.
    for answered in 0..3 {
        if world.core.in_flight() != 1 {
            fails_again(&format!(
                "after {answered} answers, with rows of the cut unanswered, {} rows are on the wire",
                world.core.in_flight()
            ));
        }
        world.answer(0);
    }
    assert!(
        !world.core.probing(),
        "probing ended with the cut's rows answered"
    );

    // The newest row of the cut is purged while the relay is away: the oldest one's answer ends
    // probing.
    let mut world = world_with_messages(&[0, 1]);
    world.connect(None);
    world.cut(false, &lost);
    world.outbox.purge_pending(Some(super::TOPICS[1])).expect("purge");
    world.core.on_change();
    world.connect(None);
    world.answer(0);
    assert!(
        !world.core.probing(),
        "a purged row of the cut kept the window at one"
    );
}

/// Answers the oldest packet on the wire until probing ends, at most `most` times; how many it
/// took.
fn answer_until_probed(world: &mut super::sim::World, most: usize) -> usize {
    for n in 0..=most {
        if !world.core.probing() {
            return n;
        }
        world.answer(0);
    }
    fails_again(&format!(
        "still publishing one at a time after {most} answers, the cut's rows answered: {:?} left",
        world.core.probe
    ))
}

/// Probing covers the cut's own rows, not every row numbered below the newest of them: an alarm
/// on the wire at the cut (numbered above the lane-0 backlog behind it) and a gap notice (its
/// token numbered above every row) each leave the window at one only until the cut's rows were
/// answered; then the backlog goes out a full window at a time.
#[test]
fn probing_covers_the_cut_rows_not_every_row_numbered_below_them() {
    let lost = dropped();

    // Rows 1 to 3 on the wire; row 1 answered, row 4 follows; the alarm takes row 2's place.
    let mut world = world_with_messages(&[0; 10]);
    world.connect(None);
    world.answer(0);
    write_alarm(&mut world, 0);
    world.answer(0);
    assert!(
        world.core.in_flight() == 3 && !world.core.upper_lanes.is_empty(),
        "the alarm on the wire with two rows of lane 0"
    );
    world.cut(false, &lost);
    world.connect(None);
    let took = answer_until_probed(&mut world, 3);
    assert_eq!(took, 3, "the cut's three rows, one at a time");
    assert_eq!(
        world.core.in_flight(),
        3,
        "the backlog goes out a full window at a time"
    );

    // Row 2 purged before the relay connects: its notice goes out between rows 1 and 3.
    let mut world = world_with_messages(&[0, 1, 0, 0, 0, 0, 0, 0]);
    world.outbox.purge_pending(Some(super::TOPICS[1])).expect("purge");
    world.core.on_change();
    world.connect(None);
    world.cut(false, &lost);
    world.connect(None);
    answer_until_probed(&mut world, 3);
    assert_eq!(
        world.core.in_flight(),
        3,
        "the backlog goes out a full window at a time"
    );
}

/// The keys of the publishes written since the `from`-th (`notice` for a gap notice).
fn keys_written(world: &super::sim::World, from: usize) -> Vec<String> {
    world.written[from..]
        .iter()
        .map(|(bytes, _)| match crate::Published::decode(bytes) {
            Ok(crate::Published::Message(m)) => m.key.into_owned(),
            _ => "notice".to_owned(),
        })
        .collect()
}

/// Writes one message in the highest lane (an alarm) and tells the core.
fn write_alarm(world: &mut super::sim::World, n: u32) {
    world
        .outbox
        .transaction(|tx| {
            tx.send(
                &crate::Message::new(super::TOPICS[1], format!("alarm-{n}"), &n)?
                    .priority(crate::store::MAX_PRIORITY),
            )
        })
        .expect("the alarm is written");
    world.core.on_change();
    world.drive();
}

/// While probing, the cut's rows and newer rows of higher lanes take turns: with an alarm written
/// every round trip, the cut's rows of lane 0 are still answered within two round trips each, and
/// the alarms wait one each (mutant `probe-served-by-priority`: the alarms always go first, and
/// the window stays at one while they keep coming; mutant `probe-without-turns`: the cut goes
/// first, and an alarm waits behind all of it). A gap notice ahead of the cut takes the cut's
/// turn. And alarms cut on the wire are probed in their own lane: lane 0 read to its end says
/// nothing of them.
#[test]
fn probing_takes_turns_with_alarms_and_probes_alarms_in_their_lane() {
    let lost = dropped();

    let mut world = world_with_messages(&[0; 3]);
    world.connect(None);
    world.cut(false, &lost);
    let from = world.written.len();
    world.connect(None);
    for n in 0..6 {
        write_alarm(&mut world, n);
        world.answer(0);
    }
    let order = keys_written(&world, from);
    if order.get(..5) != Some(&["k0", "alarm-0", "k1", "alarm-1", "k2"].map(String::from)[..]) {
        fails_again(&format!("the cut and the alarms did not take turns: {order:?}"));
    }
    if world.core.probing() {
        fails_again(&format!(
            "after six answers with an alarm written before each, the cut's rows {:?} still wait",
            world.core.probe
        ));
    }

    // A gap notice at the head of lane 0 (row 1 purged before the relay connected) takes the
    // cut's turn: the alarm goes after it, not after the cut's rows too.
    let mut world = world_with_messages(&[1, 0, 0, 0]);
    world.outbox.purge_pending(Some(super::TOPICS[1])).expect("purge");
    world.core.on_change();
    world.connect(None);
    world.cut(false, &lost);
    write_alarm(&mut world, 0);
    let from = world.written.len();
    world.connect(None);
    world.answer(0);
    world.answer(0);
    let order = keys_written(&world, from);
    if !order
        .get(..2)
        .is_some_and(|first| first.contains(&"alarm-0".to_owned()))
    {
        fails_again(&format!(
            "the alarm waited behind the notice and the cut: {order:?}"
        ));
    }

    // Three alarms on the wire when the connection ends.
    let mut world = world_with_messages(&[0]);
    world.connect(None);
    world.answer(0);
    for n in 0..3 {
        write_alarm(&mut world, n);
    }
    assert_eq!(world.core.in_flight(), 3, "three alarms on the wire");
    world.cut(false, &lost);
    world.connect(None);
    if world.core.in_flight() != 1 {
        fails_again(&format!(
            "{} of the alarms a connection ended over went out together",
            world.core.in_flight()
        ));
    }
}

/// A broker that answers an older message after a newer one was written, then answers nothing
/// more (out of disk, say): the newer one's ack timeouts renew the connection and blame it for
/// nothing, however often they come. Only a message written after it and answered is evidence
/// against it (mutant `answered-at-any-ack`, which takes any PUBACK read after the write as
/// evidence, dead-letters the innocent message after three timeouts).
#[test]
fn a_broker_that_stops_answering_blames_no_message_it_answered_nothing_after() {
    use std::time::Duration;

    let mut world = world_with_messages(&[0]);
    world.connect(None);
    assert_eq!(world.core.in_flight(), 1, "the first message on the wire");
    world.advance(Duration::from_millis(10));
    world
        .outbox
        .transaction(|tx| tx.send(&crate::Message::new(super::TOPICS[1], "later", &1)?))
        .expect("a second message");
    world.core.on_change();
    world.drive();
    assert_eq!(world.core.in_flight(), 2, "the second written after the first");
    world.advance(Duration::from_millis(10));
    // The first is answered after the second was written; then the broker goes silent.
    world.answer(0);
    assert_eq!(world.core.in_flight(), 1);
    time_out_and_reconnect(&mut world, 4);
    let dead = world.outbox.dead_letters(10).expect("dead letters");
    if !dead.is_empty() {
        fails_again(&format!(
            "a message the broker answered nothing after was dead-lettered: {dead:#?}"
        ));
    }
    assert_eq!(
        world.outbox.stats().expect("stats").pending_messages,
        1,
        "the unanswered message stays pending"
    );
}

/// A broker that passes over one of two messages handed over in one burst (one clock reading
/// for both) and answers the other: the passed-over one is struck at each ack timeout and set
/// aside, since a message written after it was answered. Which was written later is known by the
/// order of writes, not their times (mutant `answered-by-write-time` never strikes it, and
/// publishes it again at every timeout for ever).
#[test]
fn a_message_passed_over_in_a_burst_that_read_one_clock_is_set_aside() {
    let mut world = world_with_messages(&[0, 1]);
    world.connect(None);
    assert_eq!(
        world.core.in_flight(),
        2,
        "both on the wire, written at one instant"
    );
    // The second is answered; the first never is.
    world.answer(1);
    assert_eq!(world.core.in_flight(), 1);
    time_out_and_reconnect(&mut world, 6);
    let dead = world.outbox.dead_letters(10).expect("dead letters");
    if dead.len() != 1 {
        fails_again(&format!(
            "the passed-over message was not set aside after six ack timeouts: {dead:#?}"
        ));
    }
    assert_eq!(
        world.outbox.stats().expect("stats").pending_messages,
        0,
        "the answered message marked, the passed-over one set aside"
    );
}
