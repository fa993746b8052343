//! MQTT 5 topic aliases for the publishing session: a topic repeated on one connection is sent in
//! full once, then as a two-byte alias, which saves bytes on metered links (most devices publish
//! to a handful of topics).
//!
//! Aliases live as long as the connection: a new connection starts with none. The first topics
//! seen get aliases 1..=maximum (the broker's topic alias maximum from CONNACK); later ones go out
//! in full. Packets are written in the order they are submitted (a collision stops rumqttc from
//! reading further requests until the parked publish is sent), so the broker always learns an
//! alias before it sees it used.

use std::collections::HashMap;

#[derive(Debug, Default)]
pub(crate) struct Aliases {
    max: u16,
    by_topic: HashMap<String, u16>,
}

impl Aliases {
    /// No aliases: MQTT 3.1.1, or a broker that grants none.
    pub(crate) fn none() -> Self {
        Aliases::default()
    }

    /// Up to `max` aliases (the broker's topic alias maximum).
    pub(crate) fn up_to(max: u16) -> Self {
        Aliases {
            max,
            by_topic: HashMap::new(),
        }
    }

    /// The alias for `topic`: `Some((n, true))` if the broker knows it (send the alias only),
    /// `Some((n, false))` if it is assigned now (send topic and alias), `None` when all aliases
    /// are taken (send the topic).
    pub(crate) fn for_topic(&mut self, topic: &str) -> Option<(u16, bool)> {
        if let Some(&n) = self.by_topic.get(topic) {
            return Some((n, true));
        }
        let next = u16::try_from(self.by_topic.len() + 1).ok()?;
        if next > self.max {
            return None;
        }
        self.by_topic.insert(topic.to_owned(), next);
        Some((next, false))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn first_topics_get_aliases_up_to_the_maximum() {
        let mut a = Aliases::up_to(2);
        assert_eq!(a.for_topic("a"), Some((1, false)));
        assert_eq!(a.for_topic("a"), Some((1, true)));
        assert_eq!(a.for_topic("b"), Some((2, false)));
        assert_eq!(a.for_topic("c"), None);
        assert_eq!(a.for_topic("b"), Some((2, true)));
        assert_eq!(Aliases::none().for_topic("a"), None);
    }
}
