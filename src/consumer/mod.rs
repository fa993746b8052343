//! The cloud side: proof that nothing a device committed went missing on the way.
//!
//! A relay numbers each device's messages 1, 2, 3, ... per (`src`, epoch), and publishes a gap
//! notice for every message the device removed before publishing it (evicted, expired,
//! dead-lettered, purged, lost to a damaged file). A [`Consumer`] fed every item of the stream
//! tells the service, for each one, whether it is new or a duplicate, and keeps a [`Report`]:
//! delivered, duplicates, gaps announced (with their cause), **unexplained gaps** (numbers that
//! neither arrived nor were announced: lost after the device handed them to the broker), and
//! messages that arrived after a later one of their key.
//!
//! It knows no MQTT: feed it decoded items from any client (or from a bridge into Kafka, or a
//! file), in the order they arrive. Memory is bounded: the ids of the last
//! [`dedupe_window`](Consumer::dedupe_window) messages, the open gaps of each stream, the last
//! number of each of the most recent keys. Where a bound leaves it unable to tell a first delivery
//! from a duplicate, it says so ([`Verdict::Unknown`]) rather than guess: a message is called a
//! duplicate only on proof (its id, or its number known to be accounted for).
//!
//! A consumer must see **every topic** a source publishes on: the numbering counts them all.
//!
//! ```
//! use edge_outbox::consumer::{Consumer, Verdict};
//! use edge_outbox::envelope::{Envelope, GapCause, GapNotice, Published};
//! use edge_outbox::MessageId;
//!
//! let message = |seq| Envelope {
//!     id: MessageId::new_v7(),
//!     source: "pump-17".into(),
//!     epoch: 42,
//!     seq,
//!     key: "pump-17".into(),
//!     created_ms: 0,
//!     event_type: None,
//!     headers: vec![],
//!     payload: edge_outbox::envelope::to_cbor(&seq).expect("cbor").into(),
//! };
//! let mut consumer = Consumer::new().from_start(true);
//! let first = message(1);
//! assert!(matches!(consumer.observe(&Published::Message(first.clone())), Verdict::New { .. }));
//! assert_eq!(consumer.observe(&Published::Message(first)), Verdict::Duplicate);
//! // Message 2 was evicted on the device, which says so; message 4 is lost, silently.
//! consumer.observe(&Published::Gap(GapNotice::new("pump-17", 42, 2, 2, GapCause::Evicted)));
//! consumer.observe(&Published::Message(message(3)));
//! consumer.observe(&Published::Message(message(5)));
//!
//! let report = consumer.report();
//! assert_eq!(report.totals.delivered, 3);
//! assert_eq!(report.totals.announced, 1);
//! assert_eq!(report.streams[0].unexplained, vec![(4, 4)]);
//! ```

mod durable;
mod saved;
mod schemas;
mod stream;
mod window;

pub use durable::DurableConsumer;
pub use schemas::SchemaFinding;

use std::collections::{BTreeMap, HashMap, HashSet};
use std::fmt;
use std::time::{Duration, Instant};

use self::stream::{Bounds, Slot, Stream};
use self::window::IdWindow;
use crate::envelope::{Envelope, Published};
use crate::error::Result;

/// What [`Consumer::observe`] says about one item.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum Verdict {
    /// A message not seen before: process it.
    New {
        /// It arrived after a later message of its source (it fills a gap).
        late: bool,
        /// It arrived after a later message of its key: the key's order was broken on the way.
        reordered: bool,
    },
    /// A message already seen (same id, or same source, epoch and sequence number): skip it.
    Duplicate,
    /// A message whose number is outside what the consumer remembers, and whose id is not among
    /// the recent ones: it cannot tell a first delivery from a duplicate. Process it, with the
    /// service's own deduplication on `id` (an [`Outbox::receive`](crate::Outbox::receive) inbox,
    /// a unique key) deciding; the consumer never calls a message a duplicate without proof.
    ///
    /// Two cases: a number below the first one a late-joining consumer counted from (see
    /// [`Consumer::from_start`]), and a number at or below a stream's *horizon*, the highest
    /// number of a gap given up on because more than [`max_gaps`](Consumer::max_gaps) were open
    /// (a long drain of a higher priority lane opens one per message). It is counted as delivered,
    /// and in [`StreamReport::unplaced`].
    Unknown,
    /// A gap notice: the sender removed these numbers before publishing them.
    Announced,
}

/// Feeds on decoded stream items and keeps count. See the [module docs](self).
#[derive(Debug)]
pub struct Consumer {
    window: IdWindow,
    from_start: bool,
    bounds: Bounds,
    streams: HashMap<(String, u64), Stream>,
    /// Sources seen, by name: a new epoch of a known source counts from 1.
    sources: HashSet<String>,
    /// Messages without an epoch (version 1 envelopes): deduplicated by id only.
    unnumbered: Totals,
    #[cfg(feature = "schemas")]
    schemas: Option<schemas::Checker>,
    /// Messages delivered whose payload breaks its schema: counted, the newest kept.
    schema_violations: u64,
    findings: std::collections::VecDeque<SchemaFinding>,
    /// Streams changed since the state was last saved; `None` for a consumer that is not saved.
    unsaved: Option<HashSet<(String, u64)>>,
}

impl Default for Consumer {
    fn default() -> Self {
        Self::new()
    }
}

impl Consumer {
    /// A consumer with the defaults: a dedupe window of 100,000 ids, at most 10,000 open gaps and
    /// 10,000 keys per stream, counting each source from the first number it sees.
    pub fn new() -> Self {
        Consumer {
            window: IdWindow::new(100_000),
            from_start: false,
            bounds: Bounds {
                max_missing_ranges: 10_000,
                max_keys: 10_000,
            },
            streams: HashMap::new(),
            sources: HashSet::new(),
            unnumbered: Totals::default(),
            #[cfg(feature = "schemas")]
            schemas: None,
            schema_violations: 0,
            findings: std::collections::VecDeque::new(),
            unsaved: None,
        }
    }

    /// Starts keeping what changes, for [`saved`] to write: the consumer is a durable one's.
    fn keep_changes(&mut self) {
        self.window.unsaved.get_or_insert_with(Vec::new);
        self.unsaved.get_or_insert_with(HashSet::new);
        for stream in self.streams.values_mut() {
            stream.journal.get_or_insert_with(Vec::new);
        }
    }

    /// Forgets everything observed, keeping the settings (and whether changes are kept).
    fn forget_state(&mut self) {
        self.window = self.window.emptied();
        self.streams.clear();
        self.sources.clear();
        self.unnumbered = Totals::default();
        self.schema_violations = 0;
        self.findings.clear();
        if let Some(unsaved) = &mut self.unsaved {
            unsaved.clear();
        }
    }

    /// Checks each message delivered (not its duplicates) against these payload schemas (feature
    /// `schemas`), the same ones the device registered: a message whose event type and
    /// `schema-version` header name a schema its payload breaks is counted in
    /// [`Totals::schema_violations`] and listed in [`Report::schema_findings`]. Its verdict is
    /// unchanged: whether to process it is the service's call ([`check_schema`](Self::check_schema)
    /// says why it fails). Fails with [`Error::InvalidConfig`](crate::Error::InvalidConfig) if
    /// a schema is not valid CDDL or a version is not a compatible change of the one below it.
    #[cfg(feature = "schemas")]
    pub fn schemas(mut self, schemas: &[crate::payload_schema::EventSchema]) -> Result<Self> {
        self.schemas = Some(schemas::Checker::new(schemas)?);
        Ok(self)
    }

    /// Why `env`'s payload breaks its schema, if it does (feature `schemas`; `Ok` without
    /// [`schemas`](Self::schemas) or for a message that names no registered event type).
    #[cfg(feature = "schemas")]
    pub fn check_schema(&self, env: &Envelope<'_>) -> std::result::Result<(), String> {
        self.schemas.as_ref().map_or(Ok(()), |c| c.check(env))
    }

    /// Counts and keeps a delivered message that breaks its schema.
    fn check_delivered(&mut self, env: &Envelope<'_>) {
        #[cfg(feature = "schemas")]
        if let Err(reason) = self.check_schema(env)
            && !crate::mutant::active("consumer-schema-unchecked")
        {
            self.schema_violations += 1;
            if self.findings.len() == schemas::KEPT {
                self.findings.pop_front();
            }
            self.findings.push_back(SchemaFinding {
                source: env.source.to_string(),
                epoch: env.epoch,
                seq: env.seq,
                reason,
            });
        }
        #[cfg(not(feature = "schemas"))]
        let _ = env;
    }

    /// How many recent message ids are kept to recognise duplicates (default 100,000). The
    /// numbering catches any duplicate of a relayed message whatever the window; the ids catch a
    /// message published again under a new number (a dead letter retried) and messages without
    /// an epoch.
    pub fn dedupe_window(mut self, ids: usize) -> Self {
        self.window = IdWindow::new(ids);
        self
    }

    /// Whether a source seen for the first time should have started at 1 (default false: a
    /// consumer that joins late counts from the first number it sees). Turn on for a consumer
    /// that is there from each device's first message (a field test): then numbers before the
    /// first one seen are missing too. A new epoch of a source already seen always counts from 1.
    ///
    /// A consumer that joins late cannot account for the numbers below its first one: a message
    /// there is answered [`Verdict::Unknown`], and a loss there is never reported. With priority
    /// lanes the first number seen is often a higher lane's, above a lower lane's backlog still to
    /// come; lowering the start as that backlog arrives would report as lost what was delivered
    /// before the consumer joined. A service that must see every loss keeps its consumer from the
    /// start (and its state across restarts).
    pub fn from_start(mut self, on: bool) -> Self {
        self.from_start = on;
        self
    }

    /// Most open gaps kept per stream (default 10,000); past it the oldest is given up on and
    /// counted as unexplained ([`StreamReport::forgotten`]). Below the highest number given up
    /// on, the consumer no longer knows which numbers arrived: a message there whose id is not
    /// recent is answered [`Verdict::Unknown`], and a gap notice there is counted as announced.
    pub fn max_gaps(mut self, ranges: usize) -> Self {
        self.bounds.max_missing_ranges = ranges.max(1);
        self
    }

    /// Most keys whose order is followed per stream (default 10,000), forgotten oldest first.
    pub fn max_keys(mut self, keys: usize) -> Self {
        self.bounds.max_keys = keys;
        self
    }

    /// Decodes `bytes` (a relay's MQTT payload) and observes it. A batch is an error here: use
    /// [`observe_all`](Self::observe_all), which takes every kind of payload.
    pub fn observe_bytes(&mut self, bytes: &[u8]) -> Result<(Published, Verdict)> {
        let item = Published::decode(bytes)?;
        let verdict = self.observe(&item);
        Ok((item, verdict))
    }

    /// Decodes `bytes` (a relay's MQTT payload: one envelope, one gap notice, or a batch of
    /// messages) and observes every item in it, in order: a batch counts exactly as its
    /// messages published one by one would (see [`Published::decode_all`]).
    pub fn observe_all(&mut self, bytes: &[u8]) -> Result<Vec<(Published, Verdict)>> {
        let items = Published::decode_all(bytes)?;
        Ok(items
            .into_iter()
            .map(|item| {
                let verdict = self.observe(&item);
                (item, verdict)
            })
            .collect())
    }

    /// Observes one item of the stream, in arrival order.
    pub fn observe(&mut self, item: &Published) -> Verdict {
        let now = Instant::now();
        match item {
            Published::Message(env) => {
                let verdict = self.message(env, now);
                if matches!(verdict, Verdict::New { .. } | Verdict::Unknown) {
                    self.check_delivered(env);
                }
                verdict
            }
            Published::Gap(gap) => {
                let bounds = self.bounds;
                // A notice arrives again with the same id: its numbers at or below a stream's
                // horizon, which cannot be checked against what arrived, count only once.
                let fresh = self.window.insert(gap.id);
                let stream = self.stream(&gap.source, gap.epoch, gap.first);
                stream.announce(gap.first, gap.last, gap.cause.as_str(), fresh, now, bounds);
                Verdict::Announced
            }
        }
    }

    fn message(&mut self, env: &Envelope<'_>, now: Instant) -> Verdict {
        let fresh_id = !self.window.contains(&env.id);
        if env.epoch == 0 {
            if !fresh_id {
                self.unnumbered.duplicates += 1;
                return Verdict::Duplicate;
            }
            self.window.insert(env.id);
            self.unnumbered.delivered += 1;
            return Verdict::New {
                late: false,
                reordered: false,
            };
        }
        let bounds = self.bounds;
        let stream = self.stream(&env.source, env.epoch, env.seq);
        match stream.take(env.seq, now, bounds) {
            Slot::Seen => {
                stream.duplicates += 1;
                Verdict::Duplicate
            }
            // Same id under a new number: a message published again (a dead letter retried); or
            // a number the stream cannot place, which the id proves a duplicate.
            Slot::New { .. } | Slot::Unknown if !fresh_id => {
                stream.duplicates += 1;
                Verdict::Duplicate
            }
            Slot::Unknown => {
                // Delivered, as far as anyone can tell; its key's order is not followed (it may
                // be an old message again, which would look reordered).
                stream.delivered += 1;
                stream.unplaced_message(env.seq);
                self.window.insert(env.id);
                Verdict::Unknown
            }
            Slot::New { late } => {
                stream.delivered += 1;
                if late {
                    stream.late += 1;
                }
                let reordered = stream.key_order(&env.key, env.seq, bounds);
                if reordered {
                    stream.reordered += 1;
                }
                self.window.insert(env.id);
                Verdict::New { late, reordered }
            }
        }
    }

    fn stream(&mut self, source: &str, epoch: u64, first_seen: u64) -> &mut Stream {
        let known_source = self.sources.contains(source);
        let from_start = self.from_start;
        if !known_source {
            self.sources.insert(source.to_owned());
        }
        let saved = self.unsaved.is_some();
        if let Some(unsaved) = &mut self.unsaved
            && !unsaved.contains(&(source.to_owned(), epoch))
        {
            unsaved.insert((source.to_owned(), epoch));
        }
        self.streams.entry((source.to_owned(), epoch)).or_insert_with(|| {
            // Every epoch starts at 1: a new epoch of a source already seen has no excuse.
            let base = if from_start || known_source {
                1
            } else {
                first_seen.max(1)
            };
            let mut stream = Stream::new(base);
            if saved {
                stream.journal = Some(Vec::new());
            }
            stream
        })
    }

    /// The counts so far; a gap still open counts as unexplained (see
    /// [`report_after`](Self::report_after) for a grace period).
    pub fn report(&self) -> Report {
        self.report_after(Duration::ZERO)
    }

    /// The counts so far, where only gaps open for at least `grace` count as unexplained: a live
    /// consumer gives late messages and notices (after a reconnect on either side) time to
    /// arrive.
    pub fn report_after(&self, grace: Duration) -> Report {
        let now = Instant::now();
        let mut streams: Vec<StreamReport> = self
            .streams
            .iter()
            .map(|((source, epoch), s)| StreamReport {
                source: source.clone(),
                epoch: *epoch,
                first: s.base,
                last: s.high,
                delivered: s.delivered,
                duplicates: s.duplicates,
                late: s.late,
                reordered: s.reordered,
                announced: s.announced.values().sum(),
                announced_by_cause: s.announced.clone(),
                unexplained: s.missing_for(grace, now),
                forgotten: s.forgotten,
                unplaced: s.unplaced,
                forgotten_unexplained: s.forgotten_unexplained(),
                open: s.missing_count(),
            })
            .collect();
        streams.sort_by(|a, b| (&a.source, a.epoch).cmp(&(&b.source, b.epoch)));
        let mut totals = self.unnumbered.clone();
        for s in &streams {
            totals.delivered += s.delivered;
            totals.duplicates += s.duplicates;
            totals.late += s.late;
            totals.reordered += s.reordered;
            totals.announced += s.announced;
            totals.unexplained += s.unexplained_count();
        }
        totals.schema_violations = self.schema_violations;
        Report {
            streams,
            totals,
            schema_findings: self.findings.iter().cloned().collect(),
        }
    }
}

/// Counts over every stream.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct Totals {
    /// Messages delivered once (duplicates not counted; [`Verdict::Unknown`] ones counted).
    pub delivered: u64,
    /// Duplicates recognised and skipped.
    pub duplicates: u64,
    /// Messages that arrived after a later one of their source.
    pub late: u64,
    /// Messages that arrived after a later one of their key.
    pub reordered: u64,
    /// Numbers announced as removed by their sender.
    pub announced: u64,
    /// Numbers neither delivered nor announced (past the grace period).
    pub unexplained: u64,
    /// Messages delivered whose payload breaks its schema ([`Consumer::schemas`]).
    pub schema_violations: u64,
}

/// What one (source, epoch) stream looked like.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct StreamReport {
    /// The sender (`src`).
    pub source: String,
    /// Its epoch (`ep`).
    pub epoch: u64,
    /// The first number counted.
    pub first: u64,
    /// The highest number seen (delivered or announced).
    pub last: u64,
    /// Messages delivered once (with those answered [`Verdict::Unknown`]).
    pub delivered: u64,
    /// Duplicates skipped.
    pub duplicates: u64,
    /// Messages that filled a gap.
    pub late: u64,
    /// Messages that arrived after a later message of their key.
    pub reordered: u64,
    /// Numbers announced as removed.
    pub announced: u64,
    /// The same, by cause (`evicted`, `expired`, `dead-lettered`, `purged`, `unrecoverable`, `coalesced`).
    pub announced_by_cause: BTreeMap<String, u64>,
    /// Ranges `(first, last)` neither delivered nor announced, missing for at least the grace
    /// period: lost after the sender handed them to the broker.
    pub unexplained: Vec<(u64, u64)>,
    /// Numbers given up on because too many gaps were open ([`Consumer::max_gaps`]): missing
    /// then.
    pub forgotten: u64,
    /// Numbers at or below the highest one given up on that arrived since, in messages
    /// ([`Verdict::Unknown`]) or gap notices: the consumer cannot tell which numbers they were,
    /// so each is taken to explain one number given up on.
    pub unplaced: u64,
    /// The numbers given up on less those unplaced (at least 0): counted as unexplained. An
    /// estimate: an old message arriving again after its id left the dedupe window would lower
    /// it.
    pub forgotten_unexplained: u64,
    /// Numbers missing right now, grace or not.
    pub open: u64,
}

impl StreamReport {
    /// How many numbers are unexplained: the ranges, and the numbers given up on that nothing
    /// arrived for since ([`forgotten_unexplained`](Self::forgotten_unexplained)).
    pub fn unexplained_count(&self) -> u64 {
        self.forgotten_unexplained + self.unexplained.iter().map(|(f, l)| l - f + 1).sum::<u64>()
    }
}

/// The consumer's counts: per stream, and in total.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct Report {
    /// One entry per (source, epoch), by source then epoch.
    pub streams: Vec<StreamReport>,
    /// Over all of them (and messages without an epoch).
    pub totals: Totals,
    /// The most recent messages that break their schema, oldest first.
    pub schema_findings: Vec<SchemaFinding>,
}

impl fmt::Display for Report {
    /// A table, one line per stream, then the totals.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        writeln!(
            f,
            "{:<24} {:>20} {:>10} {:>9} {:>6} {:>6} {:>9} {:>11}  causes / unexplained ranges",
            "SOURCE", "EPOCH", "DELIVERED", "DUPLICATE", "LATE", "REORD", "ANNOUNCED", "UNEXPLAINED"
        )?;
        for s in &self.streams {
            let causes: Vec<String> = s
                .announced_by_cause
                .iter()
                .map(|(c, n)| format!("{c}:{n}"))
                .collect();
            let ranges: Vec<String> = s
                .unexplained
                .iter()
                .take(4)
                .map(|(a, b)| if a == b { a.to_string() } else { format!("{a}-{b}") })
                .collect();
            let more = if s.unexplained.len() > 4 { " ..." } else { "" };
            writeln!(
                f,
                "{:<24} {:>20} {:>10} {:>9} {:>6} {:>6} {:>9} {:>11}  {} {}{more}",
                s.source,
                s.epoch,
                s.delivered,
                s.duplicates,
                s.late,
                s.reordered,
                s.announced,
                s.unexplained_count(),
                causes.join(","),
                ranges.join(","),
            )?;
        }
        let t = &self.totals;
        writeln!(
            f,
            "{:<24} {:>20} {:>10} {:>9} {:>6} {:>6} {:>9} {:>11}",
            "total", "", t.delivered, t.duplicates, t.late, t.reordered, t.announced, t.unexplained
        )?;
        if t.schema_violations > 0 {
            writeln!(
                f,
                "{} delivered messages break their schema; the newest:",
                t.schema_violations
            )?;
            for s in self.schema_findings.iter().rev().take(4) {
                writeln!(f, "  {} epoch {} #{}: {}", s.source, s.epoch, s.seq, s.reason)?;
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::MessageId;
    use crate::envelope::{GapCause, GapNotice};

    fn msg(source: &str, epoch: u64, seq: u64, key: &str) -> Envelope<'static> {
        Envelope {
            id: MessageId::new_v7(),
            source: source.to_owned().into(),
            epoch,
            seq,
            key: key.to_owned().into(),
            created_ms: 0,
            event_type: None,
            headers: vec![],
            payload: vec![0xf6].into(),
        }
    }

    #[test]
    fn a_late_joiner_counts_from_the_first_number_it_sees_and_new_epochs_from_one() {
        let mut c = Consumer::new();
        c.observe(&Published::Message(msg("a", 1, 500, "k")));
        c.observe(&Published::Message(msg("a", 1, 501, "k")));
        // Before its first number: it cannot tell whether the service had it.
        assert_eq!(
            c.observe(&Published::Message(msg("a", 1, 499, "k"))),
            Verdict::Unknown
        );
        // The device was restored: a new epoch must start at 1, so 1..=2 are missing.
        c.observe(&Published::Message(msg("a", 2, 3, "k")));
        let r = c.report();
        assert_eq!(r.streams[0].unexplained, vec![]);
        assert_eq!(r.streams[1].unexplained, vec![(1, 2)]);
        assert_eq!(r.totals.delivered, 4);
    }

    #[test]
    fn the_same_id_under_a_new_number_is_a_duplicate_and_fills_its_slot() {
        let mut c = Consumer::new().from_start(true);
        let m = msg("a", 1, 1, "k");
        assert_eq!(
            c.observe(&Published::Message(m.clone())),
            Verdict::New {
                late: false,
                reordered: false
            }
        );
        // Dead-lettered as 2, announced, retried as 3 with the same id (it had been delivered).
        c.observe(&Published::Gap(GapNotice::new(
            "a",
            1,
            2,
            2,
            GapCause::DeadLettered,
        )));
        let retried = Envelope { seq: 3, ..m };
        assert_eq!(c.observe(&Published::Message(retried)), Verdict::Duplicate);
        let r = c.report();
        assert_eq!(
            (r.totals.delivered, r.totals.duplicates, r.totals.announced),
            (1, 1, 1)
        );
        assert_eq!(r.totals.unexplained, 0);
    }

    #[test]
    fn a_broken_key_order_is_reported() {
        let mut c = Consumer::new().from_start(true);
        c.observe(&Published::Message(msg("a", 1, 2, "k")));
        let v = c.observe(&Published::Message(msg("a", 1, 1, "k")));
        assert_eq!(
            v,
            Verdict::New {
                late: true,
                reordered: true
            }
        );
        let r = c.report();
        assert_eq!(
            (r.totals.late, r.totals.reordered, r.totals.unexplained),
            (1, 1, 0)
        );
        assert!(r.to_string().contains("total"));
    }

    #[test]
    fn a_grace_period_keeps_fresh_gaps_out_of_the_unexplained() {
        let mut c = Consumer::new().from_start(true);
        c.observe(&Published::Message(msg("a", 1, 2, "k")));
        assert_eq!(c.report_after(Duration::from_secs(3600)).totals.unexplained, 0);
        assert_eq!(c.report().totals.unexplained, 1);
    }
}
