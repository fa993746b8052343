//! The list of scenario mutants stays honest: each one named in `SCENARIO_MUTANTS` is switched on
//! somewhere in `src/` and run by the test file the list names (the re-run that must fail). A
//! mutant added without its test, or a test renamed away from its mutant, fails here.

use std::path::Path;

use edge_outbox::mutant::SCENARIO_MUTANTS;

type TestResult = Result<(), Box<dyn std::error::Error>>;

/// Every `.rs` file under `dir`, concatenated.
fn sources(dir: &Path) -> std::io::Result<String> {
    let mut all = String::new();
    for entry in std::fs::read_dir(dir)? {
        let path = entry?.path();
        if path.is_dir() {
            all.push_str(&sources(&path)?);
        } else if path.extension().is_some_and(|e| e == "rs") {
            all.push_str(&std::fs::read_to_string(&path)?);
        }
    }
    Ok(all)
}

#[test]
fn each_scenario_mutant_is_switched_on_in_src_and_run_by_its_test() -> TestResult {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let src = sources(&root.join("src"))?;
    assert!(!SCENARIO_MUTANTS.is_empty());
    for (name, file) in SCENARIO_MUTANTS {
        assert!(
            src.contains(&format!("mutant::active(\"{name}\")")),
            "{name}: never switched on in src/"
        );
        let test = std::fs::read_to_string(root.join(file)).map_err(|e| format!("{file}: {e}"))?;
        assert!(
            (test.contains("support::mutant::caught(") || test.contains("support::mutant::caught_by("))
                && test.contains(&format!("\"{name}\"")),
            "{file} does not run mutant {name}"
        );
    }
    Ok(())
}
