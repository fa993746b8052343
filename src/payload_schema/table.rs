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
            Compiled::new(def.clone())?;
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
                    tx.execute(
                        "INSERT INTO edge_outbox_schemas (event_type, version, topic_filter, cddl) VALUES (?1, ?2, ?3, ?4)",
                        params![def.event_type, def.version, def.topic_filter, def.cddl],
                    )?;
                }
            }
        }
        // Every version against the one below it, whatever order they were registered in (a v2
        // given before its v1, or between a v1 and a v3 already in the file).
        let registry = load(&tx, strict)?;
        check_chain(&registry)?;
        tx.commit()?;
        return Ok(registry);
    }
    load(conn, strict)
}

/// Each event type's versions, in version order, each a compatible change of the one below it.
fn check_chain(registry: &Registry) -> Result<()> {
    let mut by_type: Vec<&Compiled> = registry.schemas.iter().collect();
    by_type.sort_by(|a, b| (&a.def.event_type, a.def.version).cmp(&(&b.def.event_type, b.def.version)));
    for pair in by_type.windows(2) {
        let [previous, next] = pair else { continue };
        if previous.def.event_type != next.def.event_type {
            continue;
        }
        if previous.def.version == next.def.version {
            return Err(Error::InvalidConfig(format!(
                "schema {} is given twice",
                next.def.name()
            )));
        }
        compatible(previous, next)?;
    }
    Ok(())
}

/// The file's schemas read again if another handle registered some since `current` was loaded
/// (rows are only ever added, so their count tells); `None` when nothing changed. A relay that
/// runs for months would otherwise refuse every message of a version registered after it started.
pub(crate) fn reloaded(conn: &Connection, current: &Registry) -> Option<Registry> {
    if crate::mutant::active("schemas-read-once") {
        return None;
    }
    // Cached: the relay asks before every read.
    let rows: i64 = conn
        .prepare_cached("SELECT count(*) FROM edge_outbox_schemas")
        .and_then(|mut stmt| stmt.query_row([], |r| r.get(0)))
        .ok()?;
    if usize::try_from(rows).ok() == Some(current.schemas.len()) {
        return None;
    }
    match load(conn, current.strict) {
        Ok(registry) => {
            tracing::info!(
                schemas = registry.schemas.len(),
                "payload schemas read again: new ones were registered"
            );
            Some(registry)
        }
        Err(e) => {
            tracing::warn!(error = %e, "the payload schemas registered since could not be read; checking with the earlier ones");
            None
        }
    }
}

/// Every schema in the file, in registration order.
pub(crate) fn load(conn: &Connection, strict: bool) -> Result<Registry> {
    // A file from before schemas (version 8), read by a tool that does not migrate it.
    let exists: bool = conn.query_row(
        "SELECT EXISTS (SELECT 1 FROM sqlite_schema WHERE type = 'table' AND name = 'edge_outbox_schemas')",
        [],
        |r| r.get(0),
    )?;
    if !exists {
        return Ok(Registry {
            schemas: Vec::new(),
            strict,
        });
    }
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
    let schemas = defs
        .iter()
        .cloned()
        .map(Compiled::new)
        .collect::<Result<Vec<_>>>()?;
    let registry = Registry {
        schemas,
        strict: false,
    };
    check_chain(&registry)?;
    Ok(registry)
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
