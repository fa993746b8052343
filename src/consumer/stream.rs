//! One (source, epoch) stream: which sequence numbers are accounted for (delivered or announced
//! as removed), which are missing so far, and the order per key.
//!
//! Memory is the number of open missing ranges (bounded: past the bound the oldest is given up
//! on and counted as unexplained) plus the keys' last sequence numbers (bounded, forgotten
//! oldest first).
//!
//! Giving a range up leaves a horizon: below it the stream no longer knows which numbers were
//! accounted for and which were given up on, so a number that arrives there is neither new nor
//! seen but unknown, and a notice there is taken at its word. Ranges are given up lowest first and
//! new ones open above `high`, so every range still open lies above the horizon.

use std::collections::{BTreeMap, HashMap, VecDeque};
use std::time::{Duration, Instant};

/// What a message did to its stream.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Slot {
    /// A number not accounted for before: the next one, or one filling a missing range (`late`).
    New { late: bool },
    /// A number already accounted for.
    Seen,
    /// A number the stream cannot place: at or below the horizon and not missing (accounted
    /// for, or given up on), or before `base`.
    Unknown,
}

#[derive(Debug)]
pub(crate) struct Stream {
    /// The first number this consumer counts from.
    pub(crate) base: u64,
    /// Every number up to this one is delivered, announced or in `missing`.
    pub(crate) high: u64,
    /// Numbers below `high` not accounted for: first to (last, since when).
    missing: BTreeMap<u64, (u64, Instant)>,
    pub(crate) delivered: u64,
    pub(crate) duplicates: u64,
    pub(crate) late: u64,
    pub(crate) reordered: u64,
    /// Numbers announced as removed (and not delivered), by cause.
    pub(crate) announced: BTreeMap<String, u64>,
    /// Numbers given up on because too many ranges were open: counted as unexplained.
    pub(crate) forgotten: u64,
    /// The horizon: the highest number of a range given up on (`base - 1` while none was).
    pub(crate) horizon: u64,
    /// Numbers at or below the horizon that arrived (messages answered unknown, numbers of
    /// notices): each may be one given up on.
    pub(crate) unplaced: u64,
    keys: HashMap<String, u64>,
    key_order: VecDeque<String>,
    /// What changed in `missing` and `keys` since the state was last saved, in order; `None`
    /// for a consumer that is not saved (nothing is kept then).
    pub(crate) journal: Option<Vec<Change>>,
}

/// One change to a stream's open gaps or keys, for a saved consumer to write.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Change {
    /// A gap `first..=last`, missing since `since`, opened or reopened (after a split).
    Opened { first: u64, last: u64, since: Instant },
    /// The gap starting at `first` closed (or split: a reopen follows).
    Closed { first: u64 },
    /// `key`'s last number is now `seq`.
    Key { key: String, seq: u64 },
    /// `key` was forgotten (past the bound on keys).
    KeyForgotten { key: String },
}

/// A stream's counts and limits, as a saved consumer keeps them (gaps and keys apart).
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct SavedStream {
    pub base: u64,
    pub high: u64,
    pub horizon: u64,
    pub delivered: u64,
    pub duplicates: u64,
    pub late: u64,
    pub reordered: u64,
    pub forgotten: u64,
    pub unplaced: u64,
    pub announced: BTreeMap<String, u64>,
}

/// Bounds on one stream's memory.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Bounds {
    pub max_missing_ranges: usize,
    pub max_keys: usize,
}

impl Stream {
    /// A stream counted from `base` (the number expected first).
    pub(crate) fn new(base: u64) -> Self {
        Stream {
            base,
            high: base.saturating_sub(1),
            missing: BTreeMap::new(),
            delivered: 0,
            duplicates: 0,
            late: 0,
            reordered: 0,
            announced: BTreeMap::new(),
            forgotten: 0,
            horizon: base.saturating_sub(1),
            unplaced: 0,
            keys: HashMap::new(),
            key_order: VecDeque::new(),
            journal: None,
        }
    }

    /// A stream as it was saved; `keys` oldest first.
    pub(crate) fn restored(
        saved: SavedStream,
        gaps: impl IntoIterator<Item = (u64, u64, Instant)>,
        keys: impl IntoIterator<Item = (String, u64)>,
    ) -> Self {
        let mut s = Stream::new(saved.base);
        s.high = saved.high;
        s.horizon = saved.horizon;
        s.delivered = saved.delivered;
        s.duplicates = saved.duplicates;
        s.late = saved.late;
        s.reordered = saved.reordered;
        s.forgotten = saved.forgotten;
        s.unplaced = saved.unplaced;
        s.announced = saved.announced;
        s.missing = gaps.into_iter().map(|(f, l, since)| (f, (l, since))).collect();
        for (key, seq) in keys {
            s.keys.insert(key.clone(), seq);
            s.key_order.push_back(key);
        }
        s.journal = Some(Vec::new());
        s
    }

    /// The scalar part of the stream, as saved.
    pub(crate) fn saved(&self) -> SavedStream {
        SavedStream {
            base: self.base,
            high: self.high,
            horizon: self.horizon,
            delivered: self.delivered,
            duplicates: self.duplicates,
            late: self.late,
            reordered: self.reordered,
            forgotten: self.forgotten,
            unplaced: self.unplaced,
            announced: self.announced.clone(),
        }
    }

    fn record(&mut self, change: Change) {
        if let Some(journal) = &mut self.journal {
            journal.push(change);
        }
    }

    /// Accounts for number `seq`; `now` dates any range it opens.
    pub(crate) fn take(&mut self, seq: u64, now: Instant, bounds: Bounds) -> Slot {
        if seq > self.high {
            if seq > self.high + 1 {
                self.open(self.high + 1, seq - 1, now, bounds);
            }
            self.high = seq;
            return Slot::New { late: false };
        }
        if seq < self.base {
            // Before this consumer started counting: it cannot tell.
            return Slot::Unknown;
        }
        if self.fill(seq, seq) > 0 {
            Slot::New { late: true }
        } else if seq <= self.horizon && !crate::mutant::active("consumer-forgotten-seen") {
            Slot::Unknown
        } else {
            Slot::Seen
        }
    }

    /// Notes that `key`'s message `seq` was delivered; true if a later one of the key came first.
    pub(crate) fn key_order(&mut self, key: &str, seq: u64, bounds: Bounds) -> bool {
        match self.keys.get_mut(key) {
            Some(last) if *last > seq => true,
            Some(last) => {
                *last = seq;
                self.record(Change::Key {
                    key: key.to_owned(),
                    seq,
                });
                false
            }
            None => {
                self.keys.insert(key.to_owned(), seq);
                self.key_order.push_back(key.to_owned());
                self.record(Change::Key {
                    key: key.to_owned(),
                    seq,
                });
                while self.key_order.len() > bounds.max_keys {
                    if let Some(old) = self.key_order.pop_front() {
                        self.keys.remove(&old);
                        self.record(Change::KeyForgotten { key: old });
                    }
                }
                false
            }
        }
    }

    /// Notes that a message the stream could not place (`Slot::Unknown`) was taken as delivered.
    pub(crate) fn unplaced_message(&mut self, seq: u64) {
        // Before `base` is not below the horizon: no number given up on is there.
        if seq >= self.base {
            self.unplaced += 1;
        }
    }

    /// Accounts for `first..=last` as announced removed for `cause`; `fresh`: the notice was not
    /// seen before (its numbers at or below the horizon are counted only then).
    pub(crate) fn announce(
        &mut self,
        first: u64,
        last: u64,
        cause: &str,
        fresh: bool,
        now: Instant,
        bounds: Bounds,
    ) {
        let first = first.max(self.base);
        if last < first {
            return;
        }
        let mut count = 0;
        // At or below the horizon no range is open: what is announced there cannot be checked
        // against what arrived, and is taken at its word (a device announces only numbers it
        // did not publish).
        let below = last.min(self.horizon);
        if fresh && below >= first && !crate::mutant::active("consumer-forgotten-seen") {
            count += below - first + 1;
            self.unplaced += below - first + 1;
        }
        if last > self.high {
            let from = first.max(self.high + 1);
            if from > self.high + 1 {
                self.open(self.high + 1, from - 1, now, bounds);
            }
            count += last - from + 1;
            self.high = last;
        }
        if first <= self.high {
            count += self.fill(first, last.min(self.high));
        }
        if count > 0 {
            *self.announced.entry(cause.to_owned()).or_default() += count;
        }
    }

    /// Opens a missing range, giving up on the oldest ones past the bound.
    fn open(&mut self, first: u64, last: u64, now: Instant, bounds: Bounds) {
        self.missing.insert(first, (last, now));
        self.record(Change::Opened {
            first,
            last,
            since: now,
        });
        while self.missing.len() > bounds.max_missing_ranges.max(1) {
            if let Some((f, (l, _))) = self.missing.pop_first() {
                self.forgotten += l - f + 1;
                self.horizon = self.horizon.max(l);
                self.record(Change::Closed { first: f });
            }
        }
    }

    /// Removes `first..=last` from the missing ranges; returns how many numbers were missing.
    fn fill(&mut self, first: u64, last: u64) -> u64 {
        let mut filled = 0;
        // Ranges are disjoint and sorted, so walking back from the last one starting at or
        // before `last`, they overlap until one ends before `first`.
        let overlapping: Vec<u64> = self
            .missing
            .range(..=last)
            .rev()
            .take_while(|(_, (l, _))| *l >= first)
            .map(|(f, _)| *f)
            .collect();
        for f in overlapping {
            let Some((l, since)) = self.missing.remove(&f) else {
                continue;
            };
            let (lo, hi) = (f.max(first), l.min(last));
            filled += hi - lo + 1;
            self.record(Change::Closed { first: f });
            if f < lo {
                self.missing.insert(f, (lo - 1, since));
                self.record(Change::Opened {
                    first: f,
                    last: lo - 1,
                    since,
                });
            }
            if l > hi {
                self.missing.insert(hi + 1, (l, since));
                self.record(Change::Opened {
                    first: hi + 1,
                    last: l,
                    since,
                });
            }
        }
        filled
    }

    /// The ranges missing now that have been missing for at least `grace`.
    pub(crate) fn missing_for(&self, grace: Duration, now: Instant) -> Vec<(u64, u64)> {
        self.missing
            .iter()
            .filter(|(_, (_, since))| now.saturating_duration_since(*since) >= grace)
            .map(|(f, (l, _))| (*f, *l))
            .collect()
    }

    /// All numbers missing now.
    pub(crate) fn missing_count(&self) -> u64 {
        self.missing.iter().map(|(f, (l, _))| l - f + 1).sum()
    }

    /// The numbers given up on that are still unexplained, as far as the stream can tell: each
    /// number that arrived at or below the horizon is taken to be one of them.
    pub(crate) fn forgotten_unexplained(&self) -> u64 {
        self.forgotten.saturating_sub(self.unplaced)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const B: Bounds = Bounds {
        max_missing_ranges: 100,
        max_keys: 100,
    };

    fn ranges(s: &Stream) -> Vec<(u64, u64)> {
        s.missing_for(Duration::ZERO, Instant::now())
    }

    #[test]
    fn holes_open_fill_late_and_announced() {
        let now = Instant::now();
        let mut s = Stream::new(1);
        assert_eq!(s.take(1, now, B), Slot::New { late: false });
        assert_eq!(s.take(5, now, B), Slot::New { late: false });
        assert_eq!(ranges(&s), vec![(2, 4)]);
        assert_eq!(s.take(3, now, B), Slot::New { late: true });
        assert_eq!(ranges(&s), vec![(2, 2), (4, 4)]);
        assert_eq!(s.take(3, now, B), Slot::Seen);
        assert_eq!(s.take(5, now, B), Slot::Seen);
        s.announce(2, 2, "evicted", true, now, B);
        assert_eq!(ranges(&s), vec![(4, 4)]);
        // A notice ahead of the stream accounts for its range and opens what lies before it.
        s.announce(8, 9, "expired", true, now, B);
        assert_eq!(ranges(&s), vec![(4, 4), (6, 7)]);
        assert_eq!(s.high, 9);
        // A notice over numbers already delivered counts only the missing ones.
        s.announce(3, 7, "purged", true, now, B);
        assert_eq!(ranges(&s), vec![]);
        assert_eq!(s.announced.get("purged"), Some(&3));
        assert_eq!(s.announced.get("evicted"), Some(&1));
        assert_eq!(s.missing_count(), 0);
    }

    #[test]
    fn too_many_holes_give_up_the_oldest_as_unexplained() {
        let now = Instant::now();
        let bounds = Bounds {
            max_missing_ranges: 2,
            max_keys: 1,
        };
        let mut s = Stream::new(1);
        for seq in [2, 4, 6, 8] {
            s.take(seq, now, bounds);
        }
        assert_eq!(ranges(&s), vec![(5, 5), (7, 7)]);
        assert_eq!(s.forgotten, 2);
        assert_eq!(s.horizon, 3);
        // Below the horizon: 1 may have arrived or not, 2 did; neither is called seen.
        assert_eq!(s.take(2, now, bounds), Slot::Unknown);
        s.unplaced_message(2);
        assert_eq!(s.take(6, now, bounds), Slot::Seen);
        // A notice below it is counted once, and only when fresh.
        s.announce(1, 1, "evicted", true, now, bounds);
        s.announce(1, 1, "evicted", false, now, bounds);
        assert_eq!(s.announced.get("evicted"), Some(&1));
        assert_eq!((s.unplaced, s.forgotten_unexplained()), (2, 0));
    }

    #[test]
    fn a_key_reordered_is_noticed() {
        let mut s = Stream::new(1);
        assert!(!s.key_order("a", 5, B));
        assert!(s.key_order("a", 3, B));
        assert!(!s.key_order("b", 1, B));
    }
}
