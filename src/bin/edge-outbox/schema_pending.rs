//! The pending rows `edge-outbox schema check` finds breaking their schema, read as the relay
//! reads them (a TEXT payload is published as a CBOR text string).

use rusqlite::Connection;
use rusqlite::types::ValueRef;

use crate::Result;

/// (seq, topic, reason) of each pending row that breaks its schema, in sequence order.
pub fn failing(conn: &Connection, schemas: &edge_outbox::Schemas) -> Result<Vec<(i64, String, String)>> {
    let mut stmt =
        conn.prepare("SELECT seq, topic, event_type, headers, payload FROM outbox ORDER BY seq")?;
    let mut rows = stmt.query([])?;
    let mut bad = Vec::new();
    while let Some(row) = rows.next()? {
        let seq: i64 = row.get(0)?;
        let topic: String = row.get(1)?;
        let event_type: Option<String> = row.get(2).ok();
        let headers: Option<Vec<u8>> = row.get(3).ok();
        let text;
        let payload: &[u8] = match row.get_ref(4)? {
            ValueRef::Blob(b) => b,
            ValueRef::Text(t) => {
                text = edge_outbox::envelope::to_cbor(&String::from_utf8_lossy(t))?;
                &text
            }
            _ => {
                bad.push((seq, topic, "payload is neither a CBOR blob nor text".into()));
                continue;
            }
        };
        if let Err(e) = schemas.check(&topic, event_type.as_deref(), headers.as_deref(), payload) {
            bad.push((seq, topic, e.to_string()));
        }
    }
    Ok(bad)
}
