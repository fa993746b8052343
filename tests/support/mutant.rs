//! Tests of the tests outside the crash harness (`edge_outbox::mutant::SCENARIO_MUTANTS`): this
//! test binary run again with one mutant switched on, its scenario expected to fail.

use std::process::{Command, Stdio};

/// Whether the scenario test `test` of this binary fails with `mutant` switched on (through
/// `EDGE_OUTBOX_MUTANT`, which child processes it starts, the CLI included, inherit).
pub fn caught(test: &str, mutant: &str) -> std::io::Result<bool> {
    let out = Command::new(std::env::current_exe()?)
        .args(["--exact", test, "--test-threads=1"])
        .env("EDGE_OUTBOX_MUTANT", mutant)
        .stdin(Stdio::null())
        .output()?;
    let stdout = String::from_utf8_lossy(&out.stdout);
    // Ran the one test and it failed: not a filter that matched nothing.
    Ok(!out.status.success() && stdout.contains("1 failed"))
}

/// In the child run of [`caught`]: the tests that start it do nothing there.
pub fn in_mutant_run() -> bool {
    std::env::var_os("EDGE_OUTBOX_MUTANT").is_some_and(|m| !m.is_empty())
}
