//! docs/security.md names, for each defence, the test that shows it and the broken build that test
//! catches. Those names stay true: every test file it cites exists, every mutant it cites is one
//! `src/mutant.rs` defines, and every scenario mutant is cited there.

use std::path::Path;

use edge_outbox::mutant::{MUTANTS, SCENARIO_MUTANTS};

type TestResult = Result<(), Box<dyn std::error::Error>>;

#[test]
fn the_threat_model_cites_tests_and_mutants_that_exist() -> TestResult {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let page = std::fs::read_to_string(root.join("docs/security.md"))?;
    let mut cited = 0;
    for (at, _) in page.match_indices("`tests/") {
        let rest = &page[at + 1..];
        let file = &rest[..rest.find('`').ok_or("unclosed backtick")?];
        assert!(
            root.join(file).is_file(),
            "docs/security.md cites {file}, which does not exist"
        );
        cited += 1;
    }
    assert!(cited > 10, "only {cited} tests cited");
    let known = |name: &str| MUTANTS.contains(&name) || SCENARIO_MUTANTS.iter().any(|(m, _)| *m == name);
    for (at, _) in page.match_indices("mutant `") {
        let rest = &page[at + "mutant `".len()..];
        let name = &rest[..rest.find('`').ok_or("unclosed backtick")?];
        assert!(
            known(name),
            "docs/security.md cites mutant {name}, which src/mutant.rs lacks"
        );
    }
    // Every scenario mutant is documented: the security ones here, the others beside the crash
    // harness's in docs/reliability.md.
    let reliability = std::fs::read_to_string(root.join("docs/reliability.md"))?;
    for (name, _) in SCENARIO_MUTANTS {
        assert!(
            page.contains(&format!("`{name}`")) || reliability.contains(&format!("`{name}`")),
            "neither docs/security.md nor docs/reliability.md cites mutant {name}"
        );
    }
    Ok(())
}
