//! A file's payload schemas, read without opening a store: for tools that check payloads and
//! pending rows outside a transaction (`edge-outbox schema check`), on a read-only connection.

use rusqlite::Connection;

use super::registry::{EventSchema, Registry};
use crate::error::Result;

/// The payload schemas recorded in a file (feature `schemas`), compiled.
///
/// ```
/// use edge_outbox::{EventSchema, Options, Outbox, Schemas};
/// # let dir = tempfile::tempdir()?;
/// # let path = dir.path().join("device.db");
/// let order = EventSchema::new("order.placed", 1, "orders/#", "order = { id: tstr }");
/// drop(Outbox::open_with(&path, Options::new().schema(order))?);
///
/// let conn = rusqlite::Connection::open(&path)?;
/// let schemas = Schemas::load(&conn)?;
/// assert_eq!(schemas.list().count(), 1);
/// let payload = edge_outbox::envelope::to_cbor(&std::collections::BTreeMap::from([("id", 7)]))?;
/// assert!(schemas.check("orders/placed", None, None, &payload).is_err());
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
#[derive(Debug)]
pub struct Schemas {
    registry: Registry,
}

impl Schemas {
    /// Reads and compiles the schemas of the file `conn` is on (it only reads).
    pub fn load(conn: &Connection) -> Result<Self> {
        Ok(Schemas {
            registry: super::table::load(conn, false)?,
        })
    }

    /// Every schema, in registration order.
    pub fn list(&self) -> impl Iterator<Item = &EventSchema> {
        self.registry.schemas.iter().map(|c| &c.def)
    }

    /// Checks a payload (one CBOR item) as a write to `topic` would be checked: against the
    /// schema its event type and headers (a CBOR map of text, as stored in `outbox.headers`) name,
    /// else the topic's. Fails with [`Error::SchemaViolation`](crate::Error::SchemaViolation).
    pub fn check(
        &self,
        topic: &str,
        event_type: Option<&str>,
        headers: Option<&[u8]>,
        payload: &[u8],
    ) -> Result<()> {
        super::check_and_stamp(&self.registry, topic, event_type, headers, payload).map(|_| ())
    }
}
