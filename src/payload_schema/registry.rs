//! The schemas one handle checks with: compiled once when the store opens.

use cddl_cat::context::BasicContext;
use cddl_cat::flatten::flatten;
use cddl_cat::parser::parse_cddl;

use crate::error::{Error, Result};

/// The header that names the schema version a message was written against (the event type is
/// the envelope's `type`).
pub(crate) const VERSION_HEADER: &str = "schema-version";

/// A payload schema: the CDDL an event type's payload must match at one version, and the topics
/// (an MQTT filter) it is published on. The first rule of the CDDL is the payload's.
///
/// ```
/// let v1 = edge_outbox::EventSchema::new(
///     "order.placed",
///     1,
///     "orders/#",
///     "order = { id: tstr, total: uint }",
/// );
/// let outbox = edge_outbox::Outbox::open_with(
///     tempfile::tempdir()?.path().join("device.db"),
///     edge_outbox::Options::new().schema(v1),
/// )?;
/// let refused = outbox.transaction(|tx| tx.publish("orders/placed", "o-1", &("o-1", 40)));
/// assert!(matches!(refused, Err(edge_outbox::Error::SchemaViolation(_))));
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct EventSchema {
    pub(crate) event_type: String,
    pub(crate) version: u32,
    pub(crate) topic_filter: String,
    pub(crate) cddl: String,
}

impl EventSchema {
    /// The schema of `event_type` at `version` (from 1), for topics matching `topic_filter`.
    pub fn new(
        event_type: impl Into<String>,
        version: u32,
        topic_filter: impl Into<String>,
        cddl: impl Into<String>,
    ) -> Self {
        EventSchema {
            event_type: event_type.into(),
            version,
            topic_filter: topic_filter.into(),
            cddl: cddl.into(),
        }
    }

    /// The event type.
    pub fn event_type(&self) -> &str {
        &self.event_type
    }

    /// The version.
    pub fn version(&self) -> u32 {
        self.version
    }

    /// The topic filter.
    pub fn topic_filter(&self) -> &str {
        &self.topic_filter
    }

    /// The CDDL text.
    pub fn cddl(&self) -> &str {
        &self.cddl
    }

    pub(crate) fn name(&self) -> String {
        format!("{} v{}", self.event_type, self.version)
    }
}

/// One schema, parsed.
pub(crate) struct Compiled {
    pub def: EventSchema,
    pub root: String,
    pub rules: BasicContext,
}

impl Compiled {
    pub fn new(def: EventSchema) -> Result<Self> {
        let bad = |why: String| Error::InvalidConfig(format!("schema {}: {why}", def.name()));
        if def.event_type.is_empty() || def.version == 0 {
            return Err(bad("an event type must be named and versions start at 1".into()));
        }
        crate::topic::validate_filter(&def.topic_filter)?;
        super::nesting::check(&def.cddl).map_err(bad)?;
        let ast = parse_cddl(&def.cddl).map_err(|e| bad(format!("not valid CDDL: {e}")))?;
        let root = ast
            .rules
            .first()
            .map(|r| r.name.clone())
            .ok_or_else(|| bad("the CDDL defines no rule".into()))?;
        let rules = flatten(&ast).map_err(|e| bad(format!("not valid CDDL: {e}")))?;
        Ok(Compiled {
            def,
            root,
            rules: BasicContext::new(rules),
        })
    }
}

/// Every schema of a file, in registration order.
#[derive(Default)]
pub(crate) struct Registry {
    pub schemas: Vec<Compiled>,
    /// Refuse a topic no schema covers.
    pub strict: bool,
}

/// What a payload failed.
pub(crate) struct Violation {
    pub schema: String,
    pub rule: String,
    pub path: String,
    pub reason: String,
}

impl Registry {
    /// Whether `topic` needs checking at all.
    pub fn is_empty(&self) -> bool {
        self.schemas.is_empty() && !self.strict
    }

    /// The schema a message on `topic` is checked against, among those whose filter matches it
    /// (all of them when the topic is not known: a consumer checks envelopes): the one its type
    /// and version name, else the newest version of its type, else of the first type registered
    /// for the topic. `Err`: it names a type not registered for its topic, or a version of its
    /// type that is not registered; either would let a writer step around the topic's schema.
    pub fn select(
        &self,
        topic: Option<&str>,
        event_type: Option<&str>,
        version: Option<u32>,
    ) -> std::result::Result<Option<&Compiled>, String> {
        let covers =
            |c: &&Compiled| topic.is_none_or(|t| crate::topic::filter_matches(&c.def.topic_filter, t));
        let Some(first) = self.schemas.iter().find(covers) else {
            return Ok(None);
        };
        let event_type = match (event_type, topic) {
            (Some(t), _) if self.schemas.iter().filter(covers).any(|c| c.def.event_type == t) => t,
            // A consumer: a type it has no schema for names no contract it knows.
            (Some(_), None) => return Ok(None),
            (Some(t), Some(topic)) => {
                return Err(format!(
                    "event type {t} is not registered for topic {topic:?} (a schema for {} is)",
                    first.def.event_type
                ));
            }
            (None, _) => first.def.event_type.as_str(),
        };
        let versions = || {
            self.schemas
                .iter()
                .filter(covers)
                .filter(move |c| c.def.event_type == event_type)
        };
        match version {
            None => Ok(versions().max_by_key(|c| c.def.version)),
            Some(v) => match versions().find(|c| c.def.version == v) {
                Some(c) => Ok(Some(c)),
                None => Err(format!(
                    "{event_type} has no registered version {v} for this topic"
                )),
            },
        }
    }

    /// Checks one CBOR payload for `topic`; `Ok(None)` when no schema covers it (and not strict),
    /// else the schema it matched.
    pub fn check(
        &self,
        topic: Option<&str>,
        event_type: Option<&str>,
        version: Option<u32>,
        payload: &[u8],
    ) -> std::result::Result<Option<&Compiled>, Violation> {
        let selected = self
            .select(topic, event_type, version)
            .map_err(|reason| Violation {
                schema: event_type.unwrap_or("none").to_owned(),
                rule: "none".into(),
                path: "$".into(),
                reason,
            })?;
        let Some(schema) = selected else {
            if self.strict {
                return Err(Violation {
                    schema: "none".into(),
                    rule: "none".into(),
                    path: "$".into(),
                    reason: format!(
                        "no schema is registered for topic {:?} and schemas are strict",
                        topic.unwrap_or_default()
                    ),
                });
            }
            return Ok(None);
        };
        super::path::check(schema, payload).map(|()| Some(schema))
    }
}

impl Violation {
    pub fn into_error(self, topic: &str) -> Error {
        Error::SchemaViolation(Box::new(crate::error::SchemaMismatch {
            topic: topic.to_owned(),
            schema: self.schema,
            rule: self.rule,
            path: self.path,
            reason: self.reason,
        }))
    }
}

impl std::fmt::Display for Violation {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "payload does not match schema {} (rule {}) at {}: {}",
            self.schema, self.rule, self.path, self.reason
        )
    }
}

impl PartialEq for Registry {
    fn eq(&self, other: &Self) -> bool {
        self.strict == other.strict
            && self.schemas.len() == other.schemas.len()
            && self
                .schemas
                .iter()
                .zip(&other.schemas)
                .all(|(a, b)| a.def == b.def)
    }
}

impl Eq for Registry {}

impl std::fmt::Debug for Registry {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Registry")
            .field(
                "schemas",
                &self.schemas.iter().map(|c| c.def.name()).collect::<Vec<_>>(),
            )
            .field("strict", &self.strict)
            .finish()
    }
}
