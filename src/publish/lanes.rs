//! Encoded rows waiting for the window, one queue per priority lane: the highest non-empty lane
//! is served first (unless one is named to go first: probing's turns), each lane in sequence
//! order (see `Message::priority`).

use std::collections::VecDeque;

use super::rows::Ready;
use crate::store::MAX_PRIORITY;

/// One lane per priority, 0 to [`MAX_PRIORITY`].
pub(crate) const LANES: usize = MAX_PRIORITY as usize + 1;

#[derive(Default)]
pub(crate) struct Lanes {
    queues: [VecDeque<Ready>; LANES],
    /// A lane served before the higher ones while it holds rows (see [`Self::serve_first`]).
    first: Option<usize>,
}

impl Lanes {
    pub(crate) fn clear(&mut self) {
        self.queues.iter_mut().for_each(VecDeque::clear);
    }

    pub(crate) fn is_empty(&self) -> bool {
        self.queues.iter().all(VecDeque::is_empty)
    }

    /// The queue of lane `lane` (the lowest for anything above [`MAX_PRIORITY`]).
    pub(crate) fn lane(&mut self, lane: usize) -> &mut VecDeque<Ready> {
        &mut self.queues[index(lane)]
    }

    /// Serves `lane` first while it holds rows, whatever its priority (`None`: by priority).
    /// Probing does at the cut's turn, so that the rows a connection ended over are not kept
    /// waiting by newer rows of higher lanes for as long as those keep coming.
    pub(crate) fn serve_first(&mut self, lane: Option<usize>) {
        self.first = lane.filter(|&l| l < LANES);
    }

    /// The lane served first, if it holds rows.
    fn first(&self) -> Option<usize> {
        self.first.filter(|&l| !self.queues[l].is_empty())
    }

    /// The lane served next, its number and its queue: the highest non-empty lane, unless
    /// [`Self::serve_first`] named one that holds rows.
    pub(crate) fn front_lane(&mut self) -> Option<(usize, &mut VecDeque<Ready>)> {
        if let Some(lane) = self.first() {
            return Some((lane, &mut self.queues[lane]));
        }
        if crate::mutant::active("lanes-lowest-first") {
            return self.queues.iter_mut().enumerate().find(|(_, q)| !q.is_empty());
        }
        self.queues
            .iter_mut()
            .enumerate()
            .rev()
            .find(|(_, q)| !q.is_empty())
    }

    /// The queue of lane `lane`, to look at (the lowest for anything above [`MAX_PRIORITY`]).
    pub(crate) fn queue(&self, lane: usize) -> &VecDeque<Ready> {
        &self.queues[index(lane)]
    }

    /// The row served next.
    pub(crate) fn front(&self) -> Option<&Ready> {
        if let Some(lane) = self.first() {
            return self.queues[lane].front();
        }
        self.queues.iter().rev().find_map(VecDeque::front)
    }

    /// Takes the rows whose expiry (Unix ms) is at or before `now` into `expired`, from the head
    /// of the lane served next (one row goes next) or, with `whole`, from all of it (a batch may
    /// take any of them); whether there were any.
    pub(crate) fn drop_expired(&mut self, now: i64, whole: bool, expired: &mut Vec<i64>) -> bool {
        let Some((_, queue)) = self.front_lane() else {
            return false;
        };
        let is_expired = |r: &Ready| r.expires_at.is_some_and(|t| t <= now);
        if !whole {
            let before = expired.len();
            while queue.front().is_some_and(is_expired) {
                if let Some(row) = queue.pop_front() {
                    expired.push(row.seq);
                }
            }
            return expired.len() > before;
        }
        if !queue.iter().any(is_expired) {
            return false;
        }
        queue.retain(|r| {
            let gone = r.expires_at.is_some_and(|t| t <= now);
            if gone {
                expired.push(r.seq);
            }
            !gone
        });
        true
    }
}

/// The queue a lane number names: the lowest for anything above [`MAX_PRIORITY`].
fn index(lane: usize) -> usize {
    if lane < LANES { lane } else { 0 }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn row(seq: i64) -> Ready {
        Ready {
            seq,
            topic: "t".into(),
            envelope: Vec::new(),
            expires_at: None,
            routing: None,
        }
    }

    #[test]
    fn the_highest_lane_goes_first_and_each_lane_in_order() {
        let mut lanes = Lanes::default();
        for (lane, seq) in [(0, 1), (0, 2), (3, 7), (1, 4), (3, 9), (1, 5)] {
            lanes.lane(lane).push_back(row(seq));
        }
        let order: Vec<i64> = std::iter::from_fn(|| {
            let (_, queue) = lanes.front_lane()?;
            queue.pop_front().map(|r| r.seq)
        })
        .collect();
        assert_eq!(order, vec![7, 9, 4, 5, 1, 2]);
        assert!(lanes.is_empty());
    }

    #[test]
    fn expired_rows_leave_the_lane_served_next() {
        let mut lanes = Lanes::default();
        let mut r = row(5);
        r.expires_at = Some(100);
        lanes.lane(2).push_back(r);
        lanes.lane(2).push_back(row(6));
        lanes.lane(0).push_back(row(1));
        let mut expired = Vec::new();
        assert!(!lanes.drop_expired(99, false, &mut expired));
        assert!(lanes.drop_expired(100, false, &mut expired));
        assert_eq!(expired, vec![5]);
        assert_eq!(lanes.front().map(|r| r.seq), Some(6));
        // Behind the head: only a whole-lane check (for a batch) takes it.
        let mut r = row(7);
        r.expires_at = Some(100);
        lanes.lane(2).push_back(r);
        assert!(!lanes.drop_expired(100, false, &mut expired));
        assert!(lanes.drop_expired(100, true, &mut expired));
        assert_eq!(expired, vec![5, 7]);
    }
}
