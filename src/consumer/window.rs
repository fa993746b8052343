//! A bounded set of recently seen message ids: the `capacity` most recent, forgotten oldest first.

use std::collections::{HashSet, VecDeque};

use crate::envelope::MessageId;

#[derive(Debug)]
pub(crate) struct IdWindow {
    capacity: usize,
    set: HashSet<MessageId>,
    order: VecDeque<MessageId>,
    /// Ids remembered since the window was last saved, oldest first; `None` for a window that is
    /// not saved.
    pub(crate) unsaved: Option<Vec<MessageId>>,
}

impl IdWindow {
    pub(crate) fn new(capacity: usize) -> Self {
        IdWindow {
            capacity,
            set: HashSet::new(),
            order: VecDeque::new(),
            unsaved: None,
        }
    }

    pub(crate) fn capacity(&self) -> usize {
        self.capacity
    }

    /// The same capacity, empty.
    pub(crate) fn emptied(&self) -> Self {
        let mut w = IdWindow::new(self.capacity);
        w.unsaved = self.unsaved.as_ref().map(|_| Vec::new());
        w
    }

    /// Remembers `ids` (oldest first) as already saved.
    pub(crate) fn restore(&mut self, ids: impl IntoIterator<Item = MessageId>) {
        let unsaved = self.unsaved.take();
        for id in ids {
            self.insert(id);
        }
        self.unsaved = unsaved;
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
        if let Some(unsaved) = &mut self.unsaved {
            unsaved.push(id);
        }
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
