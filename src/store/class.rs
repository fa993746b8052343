//! Message classes: defaults per topic filter for what a message may set itself (priority,
//! coalescing, eviction, lifetime), applied at enqueue, so telemetry can evict and coalesce while
//! alarms and command replies never do, without every call site saying so.

use std::time::Duration;

use crate::error::{Error, Result};
use crate::store::outbox::MAX_PRIORITY;

/// Defaults for the messages on the topics of one filter, set with
/// [`Limits::class`](crate::Limits::class). A message's own setting wins over its class.
///
/// ```
/// use std::time::Duration;
/// use edge_outbox::{Limits, MessageClass, OnFull};
/// let limits = Limits::new()
///     .max_pending_messages(100_000)
///     .on_full(OnFull::EvictOldest)
///     // Telemetry makes room, keeps only its latest values, and is worthless after an hour.
///     .class("telemetry/#", MessageClass::new().evictable(true).coalescing(true)
///         .expires_after(Duration::from_secs(3600)))
///     // Alarms go first and are never evicted.
///     .class("alarms/#", MessageClass::new().priority(3));
/// ```
#[derive(Debug, Clone, Default, PartialEq, Eq)]
#[must_use = "a builder: use the value it returns"]
pub struct MessageClass {
    pub(crate) priority: Option<u8>,
    pub(crate) coalescing: Option<bool>,
    pub(crate) evictable: Option<bool>,
    pub(crate) lifetime: Option<Duration>,
}

impl MessageClass {
    /// A class that changes nothing.
    pub fn new() -> Self {
        Self::default()
    }

    /// The priority lane ([`Message::priority`](crate::Message::priority)).
    pub fn priority(mut self, priority: u8) -> Self {
        self.priority = Some(priority);
        self
    }

    /// Latest-value coalescing ([`Message::coalescing`](crate::Message::coalescing)).
    pub fn coalescing(mut self, on: bool) -> Self {
        self.coalescing = Some(on);
        self
    }

    /// Evictable under [`OnFull::EvictOldest`](crate::OnFull::EvictOldest)
    /// ([`Message::evictable`](crate::Message::evictable)).
    pub fn evictable(mut self, on: bool) -> Self {
        self.evictable = Some(on);
        self
    }

    /// A lifetime ([`Message::expires_after`](crate::Message::expires_after)).
    pub fn expires_after(mut self, lifetime: Duration) -> Self {
        self.lifetime = Some(lifetime);
        self
    }

    pub(crate) fn validate(&self, filter: &str) -> Result<()> {
        crate::topic::validate_filter(filter)?;
        if let Some(p) = self.priority.filter(|&p| p > MAX_PRIORITY) {
            return Err(Error::InvalidConfig(format!(
                "message class {filter:?}: priority {p} is above the highest, {MAX_PRIORITY}"
            )));
        }
        Ok(())
    }
}

/// The class of `topic`: the first of `classes` whose filter matches it.
pub(crate) fn of<'c>(classes: &'c [(String, MessageClass)], topic: &str) -> Option<&'c MessageClass> {
    classes
        .iter()
        .find(|(filter, _)| crate::topic::filter_matches(filter, topic))
        .map(|(_, class)| class)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_first_matching_filter_is_the_class() {
        let classes = vec![
            ("alarms/#".to_owned(), MessageClass::new().priority(3)),
            ("+/door".to_owned(), MessageClass::new().priority(1)),
            ("telemetry/+".to_owned(), MessageClass::new().evictable(true)),
        ];
        assert_eq!(of(&classes, "alarms/door").and_then(|c| c.priority), Some(3));
        assert_eq!(of(&classes, "x/door").and_then(|c| c.priority), Some(1));
        assert_eq!(of(&classes, "telemetry/t1").and_then(|c| c.evictable), Some(true));
        assert!(of(&classes, "telemetry/t1/deep").is_none());
        assert!(of(&classes, "orders/1").is_none());
    }
}
