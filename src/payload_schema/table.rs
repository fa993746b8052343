//! The registry in the file: `edge_outbox_schemas`, one row per event type and version.

use rusqlite::{Connection, OptionalExtension, TransactionBehavior, params};

use super::compat;
use super::registry::{Compiled, EventSchema, Registry};
use crate::error::{Error, Result};

/// Registers `defs` (a version already in the file must be the same, byte for byte) and returns
/// every schema of the file, compiled. A new version that is not a compatible change of the
/// version before it is refused, and nothing is registered.
pub(crate) fn adopt_on_open(conn: &mut Connection, defs: &[EventSchema], strict: bool) -> Result<Registry> {
    if !defs.is_empty() {
        let tx = conn.transaction_with_behavior(TransactionBehavior::Immediate)?;
        for def in defs {
            let compiled = Compiled::new(def.clone())?;
            let stored: Option<(String, String)> = tx
                .query_row(
                    "SELECT topic_filter, cddl FROM edge_outbox_schemas WHERE event_type = ?1 AND version = ?2",
                    params![def.event_type, def.version],
                    |r| Ok((r.get(0)?, r.get(1)?)),
                )
                .optional()?;
            match stored {
                Some((filter, cddl)) if filter == def.topic_filter && cddl == def.cddl => {}
                Some(_) => {
                    return Err(Error::InvalidConfig(format!(
                        "schema {} is already registered in this file with another definition: a \
                         version never changes once registered, so register the change as version {}",
                        def.name(),
                        def.version.saturating_add(1)
                    )));
                }
                None => {
                    if let Some(previous) = previous_version(&tx, def)? {
                        compatible(&previous, &compiled)?;
                    }
                    tx.execute(
                        "INSERT INTO edge_outbox_schemas (event_type, version, topic_filter, cddl) VALUES (?1, ?2, ?3, ?4)",
                        params![def.event_type, def.version, def.topic_filter, def.cddl],
                    )?;
                }
            }
        }
        tx.commit()?;
    }
    load(conn, strict)
}

/// Every schema in the file, in registration order.
pub(crate) fn load(conn: &Connection, strict: bool) -> Result<Registry> {
    let mut stmt = conn
        .prepare("SELECT event_type, version, topic_filter, cddl FROM edge_outbox_schemas ORDER BY rowid")?;
    let defs = stmt
        .query_map([], |r| {
            Ok(EventSchema {
                event_type: r.get(0)?,
                version: r.get(1)?,
                topic_filter: r.get(2)?,
                cddl: r.get(3)?,
            })
        })?
        .collect::<rusqlite::Result<Vec<_>>>()?;
    let schemas = defs.into_iter().map(Compiled::new).collect::<Result<Vec<_>>>()?;
    Ok(Registry { schemas, strict })
}

/// `defs` compiled, without a file: each version checked against the one below it, as
/// registering them in order would.
pub(crate) fn compile_all(defs: &[EventSchema]) -> Result<Registry> {
    let mut schemas: Vec<Compiled> = Vec::with_capacity(defs.len());
    let mut sorted: Vec<&EventSchema> = defs.iter().collect();
    sorted.sort_by(|a, b| (&a.event_type, a.version).cmp(&(&b.event_type, b.version)));
    for def in sorted {
        let compiled = Compiled::new(def.clone())?;
        if let Some(previous) = schemas.last().filter(|p| p.def.event_type == def.event_type) {
            if previous.def.version == def.version {
                return Err(Error::InvalidConfig(format!(
                    "schema {} is given twice",
                    def.name()
                )));
            }
            compatible(previous, &compiled)?;
        }
        schemas.push(compiled);
    }
    Ok(Registry {
        schemas,
        strict: false,
    })
}

/// Refuses `new` unless it is a compatible change of `previous`, saying why.
fn compatible(previous: &Compiled, new: &Compiled) -> Result<()> {
    compat::check(previous, new).map_err(|why| {
        Error::InvalidConfig(format!(
            "schema {} is not a compatible change of {}: {why}",
            new.def.name(),
            previous.def.name()
        ))
    })
}

/// The highest registered version of `def`'s event type below `def`'s.
fn previous_version(conn: &Connection, def: &EventSchema) -> Result<Option<Compiled>> {
    conn.query_row(
        "SELECT event_type, version, topic_filter, cddl FROM edge_outbox_schemas
         WHERE event_type = ?1 AND version < ?2 ORDER BY version DESC LIMIT 1",
        params![def.event_type, def.version],
        |r| {
            Ok(EventSchema {
                event_type: r.get(0)?,
                version: r.get(1)?,
                topic_filter: r.get(2)?,
                cddl: r.get(3)?,
            })
        },
    )
    .optional()?
    .map(Compiled::new)
    .transpose()
}
