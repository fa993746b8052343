//! A bounded set of recently seen message ids: the `capacity` most recent, forgotten oldest first.

use std::collections::{HashSet, VecDeque};

use crate::envelope::MessageId;

#[derive(Debug)]
pub(crate) struct IdWindow {
    capacity: usize,
    set: HashSet<MessageId>,
    order: VecDeque<MessageId>,
}

impl IdWindow {
    pub(crate) fn new(capacity: usize) -> Self {
        IdWindow {
            capacity,
            set: HashSet::new(),
            order: VecDeque::new(),
        }
    }

    /// Remembers `id`; false if it was already remembered.
    pub(crate) fn insert(&mut self, id: MessageId) -> bool {
        if self.capacity == 0 {
            return true;
        }
        if !self.set.insert(id) {
            return false;
        }
        self.order.push_back(id);
        while self.order.len() > self.capacity {
            if let Some(old) = self.order.pop_front() {
                self.set.remove(&old);
            }
        }
        true
    }

    pub(crate) fn contains(&self, id: &MessageId) -> bool {
        self.set.contains(id)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn forgets_the_oldest_beyond_capacity() {
        let mut w = IdWindow::new(2);
        let ids: Vec<MessageId> = (0u8..3).map(|i| MessageId::from_bytes([i; 16])).collect();
        assert!(w.insert(ids[0]));
        assert!(!w.insert(ids[0]));
        assert!(w.insert(ids[1]));
        assert!(w.insert(ids[2]));
        assert!(!w.contains(&ids[0]));
        assert!(w.contains(&ids[2]));
        assert_eq!(w.order.len(), 2);
    }
}
