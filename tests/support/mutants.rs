//! Tests of the tests for guarantees the crash harness does not exercise: a scenario test run
//! again as a child process with one mutant of `edge_outbox::mutant::TEST_MUTANTS` switched on
//! (feature `mutants`), which must fail, and fail on its own verdict.

use std::process::{Command, Stdio};

/// Runs the test `scenario` of this binary with mutant `mutant` on; `Ok` if it failed with
/// `verdict` in its output (what its assertion says), so that a failure in its setup does not
/// pass for a caught mutant.
pub fn caught_by(mutant: &str, scenario: &str, verdict: &str) -> Result<(), Box<dyn std::error::Error>> {
    if !edge_outbox::mutant::TEST_MUTANTS
        .iter()
        .any(|(name, _)| *name == mutant)
    {
        return Err(format!("{mutant} is not in edge_outbox::mutant::TEST_MUTANTS").into());
    }
    let out = Command::new(std::env::current_exe()?)
        .args(["--exact", scenario, "--test-threads=1"])
        .env("EDGE_OUTBOX_MUTANT", mutant)
        .stdin(Stdio::null())
        .output()?;
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    if !stdout.contains(&format!("test {scenario} ... ")) {
        return Err(format!("{scenario} did not run under mutant {mutant}:\n{stdout}\n{stderr}").into());
    }
    if out.status.success() {
        return Err(format!("mutant {mutant} survived {scenario}").into());
    }
    if !stdout.contains(verdict) && !stderr.contains(verdict) {
        return Err(format!(
            "{scenario} failed under mutant {mutant}, but not with {verdict:?}:\n{stdout}\n{stderr}"
        )
        .into());
    }
    Ok(())
}
