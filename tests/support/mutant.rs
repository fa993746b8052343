//! Tests of the tests outside the crash harness (`edge_outbox::mutant::SCENARIO_MUTANTS`): this
//! test binary run again with one mutant switched on, its scenario expected to fail.

use std::process::{Command, Output, Stdio};

/// Runs the test `test` of this binary alone, with `mutant` switched on (through
/// `EDGE_OUTBOX_MUTANT`, which child processes it starts, the CLI included, inherit).
fn run_with(test: &str, mutant: &str) -> std::io::Result<Output> {
    Command::new(std::env::current_exe()?)
        .args(["--exact", test, "--test-threads=1"])
        .env("EDGE_OUTBOX_MUTANT", mutant)
        .stdin(Stdio::null())
        .output()
}

/// Whether the scenario test `test` of this binary fails with `mutant` switched on.
pub fn caught(test: &str, mutant: &str) -> std::io::Result<bool> {
    let out = run_with(test, mutant)?;
    let stdout = String::from_utf8_lossy(&out.stdout);
    // Ran the one test and it failed: not a filter that matched nothing.
    Ok(!out.status.success() && stdout.contains("1 failed"))
}

/// `Ok` if the scenario test `scenario` fails with `mutant` on, with `verdict` in its output
/// (what its assertion says), so that a failure in its setup does not pass for a caught mutant.
pub fn caught_by(mutant: &str, scenario: &str, verdict: &str) -> Result<(), Box<dyn std::error::Error>> {
    if !edge_outbox::mutant::SCENARIO_MUTANTS
        .iter()
        .any(|(name, _)| *name == mutant)
    {
        return Err(format!("{mutant} is not in edge_outbox::mutant::SCENARIO_MUTANTS").into());
    }
    let out = run_with(scenario, mutant)?;
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

/// In the child run of [`caught`]: the tests that start it do nothing there.
pub fn in_mutant_run() -> bool {
    std::env::var_os("EDGE_OUTBOX_MUTANT").is_some_and(|m| !m.is_empty())
}
