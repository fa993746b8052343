//! Checking a topic filter before subscribing with it (the relay's command session, a cloud-side
//! subscriber), so a bad one is an [`Error::InvalidConfig`] at start rather than a refused
//! subscription later.

use crate::error::{Error, Result};

/// MQTT's limit on a topic filter: a two-byte length prefix.
const MAX_FILTER_BYTES: usize = 65_535;

/// Checks `filter` against MQTT's rules (3.1.1 §4.7, 5.0 §4.7): not empty, at most 65,535 bytes
/// of UTF-8, no NUL or other control character, `+` only as a whole level, `#` only as the whole
/// last level.
pub(crate) fn validate(filter: &str) -> Result<()> {
    let bad = |why: String| Err(Error::InvalidConfig(format!("topic filter {filter:?}: {why}")));
    if filter.is_empty() {
        return bad("it is empty".into());
    }
    if filter.len() > MAX_FILTER_BYTES {
        return bad(format!(
            "it is {} bytes long; MQTT allows {MAX_FILTER_BYTES}",
            filter.len()
        ));
    }
    if let Some(c) = filter.chars().find(|c| c.is_control()) {
        return bad(format!("it contains the control character {:?}", c));
    }
    let levels: Vec<&str> = filter.split('/').collect();
    for (i, level) in levels.iter().enumerate() {
        if level.contains('#') && (*level != "#" || i + 1 != levels.len()) {
            return bad(format!(
                "'#' must be a whole level and the last one (e.g. \"devices/d1/commands/#\"), not {level:?}"
            ));
        }
        if level.contains('+') && *level != "+" {
            return bad(format!(
                "'+' must be a whole level (e.g. \"devices/+/commands\"), not {level:?}"
            ));
        }
    }
    Ok(())
}

/// Whether `topic` matches the (valid) `filter`: `+` is one whole level, `#` the rest (the parent
/// level included), and a wildcard in the first level does not match a topic starting with `$`.
pub(crate) fn matches(filter: &str, topic: &str) -> bool {
    if topic.starts_with('$') && (filter.starts_with('+') || filter.starts_with('#')) {
        return false;
    }
    let mut levels = topic.split('/');
    for f in filter.split('/') {
        if f == "#" {
            return true;
        }
        match levels.next() {
            Some(t) if f == "+" || f == t => {}
            _ => return false,
        }
    }
    levels.next().is_none()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn matching_follows_the_mqtt_rules() {
        for (filter, topic, want) in [
            ("a/b", "a/b", true),
            ("a/b", "a/c", false),
            ("a/+", "a/b", true),
            ("a/+", "a/b/c", false),
            ("a/+", "a", false),
            ("a/#", "a", true),
            ("a/#", "a/b/c", true),
            ("#", "a/b", true),
            ("#", "$SYS/x", false),
            ("+/x", "$SYS/x", false),
            ("$SYS/#", "$SYS/x", true),
            ("a/b", "a/b/c", false),
            ("a/+/c", "a//c", true),
        ] {
            assert_eq!(matches(filter, topic), want, "{filter} {topic}");
        }
    }

    #[test]
    fn accepts_valid_filters() {
        for ok in [
            "a",
            "#",
            "+",
            "a/#",
            "a/+/b",
            "+/+",
            "/a",
            "a/",
            "$share/g/a/#",
            "ä/ö",
        ] {
            validate(ok).unwrap_or_else(|e| panic!("{ok:?}: {e}"));
        }
    }

    #[test]
    fn refuses_invalid_filters_with_the_rule() {
        for (bad, says) in [
            ("", "empty"),
            ("a#", "'#'"),
            ("a/#/b", "'#'"),
            ("#/a", "'#'"),
            ("a+", "'+'"),
            ("a/b+/c", "'+'"),
            ("a\0b", "control"),
            ("a\nb", "control"),
        ] {
            let e = validate(bad).expect_err(bad);
            assert!(
                matches!(&e, Error::InvalidConfig(m) if m.contains(says)),
                "{bad:?}: {e}"
            );
        }
        let long = "a".repeat(MAX_FILTER_BYTES + 1);
        assert!(validate(&long).is_err());
        assert!(validate(&"a".repeat(MAX_FILTER_BYTES)).is_ok());
    }
}
