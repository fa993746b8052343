//! The schemas as the relay publishes them (retained, on the topic an operator names), so a cloud
//! consumer fetches the contract of what it receives: a CBOR array of maps, one per schema,
//! `{ "type": tstr, "version": uint, "topics": tstr, "cddl": tstr }` (docs/wire-format.md).

use serde::{Deserialize, Serialize};

use super::registry::EventSchema;
use crate::error::{Error, Result};

#[derive(Serialize, Deserialize)]
struct Published {
    #[serde(rename = "type")]
    event_type: String,
    version: u32,
    topics: String,
    cddl: String,
}

/// The encoded list.
pub(crate) fn encode<'s>(schemas: impl Iterator<Item = &'s EventSchema>) -> Result<Vec<u8>> {
    let list: Vec<Published> = schemas
        .map(|s| Published {
            event_type: s.event_type.clone(),
            version: s.version,
            topics: s.topic_filter.clone(),
            cddl: s.cddl.clone(),
        })
        .collect();
    crate::envelope::to_cbor(&list)
}

impl EventSchema {
    /// Decodes the schema list a relay publishes with
    /// [`RelayConfig::publish_schemas`](crate::RelayConfig::publish_schemas), for
    /// [`Consumer::schemas`](crate::consumer::Consumer::schemas).
    pub fn decode_published(bytes: &[u8]) -> Result<Vec<EventSchema>> {
        let list: Vec<Published> = ciborium::from_reader(bytes)
            .map_err(|e| Error::Decode(format!("not a published schema list: {e}")))?;
        Ok(list
            .into_iter()
            .map(|p| EventSchema::new(p.event_type, p.version, p.topics, p.cddl))
            .collect())
    }
}
