//! The cloud side of payload schemas (feature `schemas`): what arrives is checked against the
//! same contract the device checked it with where it was written.

#[cfg(feature = "schemas")]
use crate::envelope::Envelope;
#[cfg(feature = "schemas")]
use crate::error::Result;
#[cfg(feature = "schemas")]
use crate::payload_schema::{EventSchema, Registry};

/// Most violations a [`Consumer`](super::Consumer) keeps for its report, newest last.
#[cfg(feature = "schemas")]
pub(super) const KEPT: usize = 100;

/// A message whose payload breaks its schema.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct SchemaFinding {
    /// The message's source.
    pub source: String,
    /// Its epoch.
    pub epoch: u64,
    /// Its number in the epoch.
    pub seq: u64,
    /// Which schema, field and rule it breaks.
    pub reason: String,
}

/// Schemas compiled for checking envelopes.
#[cfg(feature = "schemas")]
pub(super) struct Checker {
    registry: Registry,
}

#[cfg(feature = "schemas")]
impl Checker {
    pub fn new(schemas: &[EventSchema]) -> Result<Self> {
        Ok(Checker {
            registry: crate::payload_schema::compile_all(schemas)?,
        })
    }

    /// Checks a message that names its event type (one without a type names no contract); `Err`
    /// says which schema, field and rule it breaks.
    pub fn check(&self, env: &Envelope<'_>) -> std::result::Result<(), String> {
        let Some(event_type) = env.event_type.as_deref() else {
            return Ok(());
        };
        let version = crate::payload_schema::version_of(&env.headers);
        // The topic is not in the envelope: the type selects the schema.
        self.registry
            .check(None, Some(event_type), version, &env.payload)
            .map(|_| ())
            .map_err(|v| v.to_string())
    }
}

#[cfg(feature = "schemas")]
impl std::fmt::Debug for Checker {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        self.registry.fmt(f)
    }
}
