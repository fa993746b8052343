//! Encoded rows waiting for the window, one queue per priority lane: the highest non-empty lane
//! is served first, each lane in sequence order (see `Message::priority`).

use std::collections::VecDeque;

use super::rows::Ready;
use crate::store::MAX_PRIORITY;

/// One lane per priority, 0 to [`MAX_PRIORITY`].
pub(crate) const LANES: usize = MAX_PRIORITY as usize + 1;

#[derive(Default)]
pub(crate) struct Lanes {
    queues: [VecDeque<Ready>; LANES],
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
        let i = if lane < LANES { lane } else { 0 };
        &mut self.queues[i]
    }

    /// The next row to publish: the oldest of the highest non-empty lane, and its lane.
    pub(crate) fn pop(&mut self) -> Option<(usize, Ready)> {
        self.queues
            .iter_mut()
            .enumerate()
            .rev()
            .find_map(|(lane, q)| q.pop_front().map(|r| (lane, r)))
    }

    /// Puts back a row [`pop`](Self::pop) took, at the head of its lane.
    pub(crate) fn put_back(&mut self, lane: usize, row: Ready) {
        self.lane(lane).push_front(row);
    }
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
        }
    }

    #[test]
    fn the_highest_lane_goes_first_and_each_lane_in_order() {
        let mut lanes = Lanes::default();
        for (lane, seq) in [(0, 1), (0, 2), (3, 7), (1, 4), (3, 9), (1, 5)] {
            lanes.lane(lane).push_back(row(seq));
        }
        let order: Vec<i64> = std::iter::from_fn(|| lanes.pop().map(|(_, r)| r.seq)).collect();
        assert_eq!(order, vec![7, 9, 4, 5, 1, 2]);
        assert!(lanes.is_empty());
    }
}
