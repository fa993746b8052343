//! A salvage keeps the application's virtual tables. The CLI's SQLite is built without FTS and
//! R*Tree (`.cargo/config.toml`), so it cannot create such a table again through its module; it
//! copies the shadow tables, where the rows are, and keeps the table's definition as written.
//! Python's SQLite, which has both modules, then finds every row again. FTS5 keeps part of its
//! index in `WITHOUT ROWID` tables, which have no rowid to copy by; so does the application's
//! `settings` table here.
//!
//! Mutant: `salvage-virtual-table-recreated` (the table created again through its module, as
//! before), caught here: the creation fails and the full-text table is gone.

mod common;
mod support;

use common::{TestResult, temp_db};
use edge_outbox::{Options, Outbox};
use support::python::run_script;

const SCRIPT: &str = "tests/python/salvage_virtual_tables.py";

#[test]
#[cfg_attr(
    eo_skip_python,
    ignore = "needs python3: none on PATH, or EDGE_OUTBOX_SKIP=python (the build warning says which)"
)]
fn virtual_tables_survive_a_salvage() -> TestResult {
    let (_dir, db) = temp_db()?;
    Outbox::open(&db)?.transaction(|tx| tx.publish("notes/new", "pump-3", &"vibrates"))?;
    let path = db.to_str().ok_or("temp path is not UTF-8")?;
    run_script(SCRIPT, &["create", path])?;
    let before = run_script(SCRIPT, &["check", path])?;
    assert!(
        before.contains("notes matching pump: pump 3 vibrates; pump 9 is quiet"),
        "{before}"
    );

    let salvaged = Outbox::salvage(&db, &Options::default())?;
    let failed: Vec<_> = salvaged.tables.iter().filter(|t| t.failed.is_some()).collect();
    assert!(failed.is_empty(), "tables the salvage could not copy: {failed:?}");
    assert_eq!(salvaged.pending_messages, 1);

    let after = run_script(SCRIPT, &["check", path])
        .map_err(|e| format!("virtual tables lost in the salvage: {e}"))?;
    assert_eq!(after, before, "the virtual tables' rows changed in the salvage");
    assert!(after.contains("zones inside 10..20: 10"), "{after}");
    assert!(after.contains("rtree check: ok"), "{after}");
    assert!(after.contains("settings: (50, 1225)"), "{after}");
    assert!(after.contains("integrity: ok"), "{after}");
    // The store opens the salvaged file, modules or not.
    assert_eq!(Outbox::open(&db)?.stats()?.pending_messages, 1);
    Ok(())
}

/// The scenario above fails against the mutant that creates the tables through their modules.
#[test]
#[cfg(feature = "mutants")]
fn the_scenario_catches_its_mutant() -> TestResult {
    support::mutant::caught_by(
        "salvage-virtual-table-recreated",
        "virtual_tables_survive_a_salvage",
        "tables the salvage could not copy",
    )
}
