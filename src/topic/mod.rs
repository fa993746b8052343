//! The rules a topic name must follow to be published: one check for the write path, the relay
//! (rows written through the SQL contract) and configured topics.

mod filter;

pub(crate) use filter::{matches as filter_matches, validate as validate_filter};

use crate::error::{Error, Result};

/// MQTT encodes a topic's length in 16 bits.
pub(crate) const MAX_TOPIC_BYTES: usize = u16::MAX as usize;

/// Fails with [`Error::InvalidTopic`] unless `topic` can be published to: non-empty, at most
/// 65,535 bytes of UTF-8 (a `&str` already is UTF-8), no wildcard (`+`, `#`) and no NUL, and no
/// leading `$` unless `allow_dollar` (brokers reserve `$SYS/...` and friends, and refuse or drop
/// publishes there).
pub(crate) fn check(topic: &str, allow_dollar: bool) -> Result<()> {
    let why = if topic.is_empty() {
        "it is empty"
    } else if topic.len() > MAX_TOPIC_BYTES {
        "it is longer than 65,535 bytes, MQTT's limit"
    } else if topic.contains(['+', '#']) {
        "it contains a wildcard ('+' or '#'), which only subscriptions may use"
    } else if topic.contains('\0') {
        "it contains a NUL character"
    } else if topic.starts_with('$') && !allow_dollar {
        "it starts with '$', which brokers reserve (allow it with Limits::allow_dollar_topics)"
    } else {
        return Ok(());
    };
    Err(Error::InvalidTopic {
        topic: topic.to_owned(),
        why,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_rule_has_its_reason() {
        assert!(check("orders/placed", false).is_ok());
        assert!(check("$SYS/x", true).is_ok());
        for (topic, why) in [
            ("", "empty"),
            ("a/+/b", "wildcard"),
            ("a/#", "wildcard"),
            ("a\0b", "NUL"),
            ("$SYS/x", "reserve"),
        ] {
            let err = check(topic, false).expect_err(topic);
            assert!(err.to_string().contains(why), "{topic:?}: {err}");
        }
        let long = "t".repeat(MAX_TOPIC_BYTES + 1);
        let err = check(&long, false).expect_err("too long");
        assert!(err.to_string().contains("65,535"), "{err}");
        assert!(err.to_string().len() < 400, "a long topic is not repeated whole");
        assert!(check(&long[1..], false).is_ok());
    }
}
