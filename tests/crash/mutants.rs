//! Tests of the tests: the harness run against each deliberately broken build (`src/mutant.rs`).
//! A mutant the harness does not catch is a hole in the harness, and fails this run.

use std::process::{Command, Stdio};
use std::time::Instant;

use edge_outbox::mutant::MUTANTS;

/// Runs this binary once per mutant, with `EDGE_OUTBOX_MUTANT` set; returns the mutants whose run
/// passed.
pub fn run_all() -> Vec<String> {
    let mut survivors = Vec::new();
    for &mutant in MUTANTS {
        let started = Instant::now();
        let out = Command::new(std::env::current_exe().expect("own path"))
            .env("EDGE_OUTBOX_MUTANT", mutant)
            // A mutant may well make a run hang somewhere; the scenarios' own bounds end it.
            .stdin(Stdio::null())
            .output()
            .expect("run the harness against a mutant");
        let stdout = String::from_utf8_lossy(&out.stdout);
        let stderr = String::from_utf8_lossy(&out.stderr);
        if out.status.success() {
            println!("crash: mutant {mutant} SURVIVED ({:.1?})", started.elapsed());
            survivors.push(mutant.to_owned());
            continue;
        }
        // What caught it: the scenario that failed, or the assertion that stopped the run.
        let after = |marker: &str| {
            stderr
                .lines()
                .skip_while(|l| !l.contains(marker))
                .nth(1)
                .map(str::trim)
        };
        let caught_by = after("crash: FAILED")
            .or_else(|| after("panicked at"))
            .unwrap_or("(no reason printed)")
            .to_owned();
        let last = stdout
            .lines()
            .rev()
            .find(|l| l.starts_with("crash: "))
            .unwrap_or("");
        println!(
            "crash: mutant {mutant} caught ({:.1?}): {caught_by}\n       last: {last}",
            started.elapsed()
        );
    }
    survivors
}
