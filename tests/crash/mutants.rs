//! Tests of the tests: the harness run against each deliberately broken build (`src/mutant.rs`).
//! A mutant the harness does not catch is a hole in the harness, and fails this run.

use std::process::{Command, Stdio};
use std::time::Instant;

use edge_outbox::mutant::MUTANTS;

use super::support::ChildGuard;

/// A mutant may make a run hang somewhere the scenarios' own bounds do not reach: a run past
/// this is killed and counts as not caught.
const RUN_LIMIT: std::time::Duration = std::time::Duration::from_secs(600);

/// What a mutant run printed, and how it ended (`None`: killed at the limit).
struct Output {
    status: Option<std::process::ExitStatus>,
    stdout: Vec<u8>,
    stderr: Vec<u8>,
}

fn wait_bounded(mut child: ChildGuard, limit: std::time::Duration) -> Output {
    use std::io::Read;
    let read = |pipe: Option<Box<dyn Read + Send>>| {
        std::thread::spawn(move || {
            let mut buf = Vec::new();
            if let Some(mut p) = pipe {
                let _ = p.read_to_end(&mut buf);
            }
            buf
        })
    };
    let stdout = read(child.stdout.take().map(|p| Box::new(p) as Box<dyn Read + Send>));
    let stderr = read(child.stderr.take().map(|p| Box::new(p) as Box<dyn Read + Send>));
    let deadline = Instant::now() + limit;
    let status = loop {
        if let Ok(Some(status)) = child.try_wait() {
            break Some(status);
        }
        if Instant::now() >= deadline {
            child.kill_and_wait();
            break None;
        }
        std::thread::sleep(std::time::Duration::from_millis(50));
    };
    Output {
        status,
        stdout: stdout.join().unwrap_or_default(),
        stderr: stderr.join().unwrap_or_default(),
    }
}

/// How the harness fared against one mutant.
pub struct Outcome {
    pub mutant: &'static str,
    /// What failed the run (the scenario and its problems); `None`: the mutant survived.
    pub caught_by: Option<String>,
    pub seconds: f64,
}

/// Runs this binary once per mutant, with `EDGE_OUTBOX_MUTANT` set.
pub fn run_all() -> Vec<Outcome> {
    MUTANTS
        .iter()
        .map(|&m| run_one(m, edge_outbox::mutant::scenarios_for(m), true))
        .collect()
}

/// Every mutant against every group of scenarios, each run on its own (`CRASH_MUTANT_MATRIX=1`):
/// which scenarios can see which breach. Not part of the normal run (about 30 runs); its table
/// goes to docs/reliability.md.
pub fn matrix(groups: &[&str]) -> String {
    let mut out = format!(
        "| mutant | {} |\n|---|{}\n",
        groups.join(" | "),
        "---|".repeat(groups.len())
    );
    for &mutant in MUTANTS {
        let cells: Vec<String> = groups
            .iter()
            .map(|g| match run_one(mutant, Some(g), false).caught_by {
                Some(_) => "caught".to_owned(),
                None => "—".to_owned(),
            })
            .collect();
        out.push_str(&format!("| `{mutant}` | {} |\n", cells.join(" | ")));
    }
    out
}

/// Runs this binary with `mutant` switched on (only the scenarios matching `filter`, if given).
fn run_one(mutant: &'static str, filter: Option<&str>, report: bool) -> Outcome {
    let started = Instant::now();
    let mut cmd = Command::new(std::env::current_exe().expect("own path"));
    cmd.args(filter)
        .env("EDGE_OUTBOX_MUTANT", mutant)
        // Its table is not the one to publish.
        .env_remove("CRASH_TABLE")
        .env_remove("CRASH_MUTANT_MATRIX")
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    let child = cmd.spawn().expect("run the harness against a mutant");
    let out = wait_bounded(ChildGuard::new(child), RUN_LIMIT);
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    let seconds = started.elapsed().as_secs_f64();
    let scope = filter.map_or(String::new(), |f| format!(" in {f}"));
    if out.status.is_some_and(|s| s.success()) {
        if report {
            println!("crash: mutant {mutant} SURVIVED{scope} ({seconds:.1}s)");
        }
        return Outcome {
            mutant,
            caught_by: None,
            seconds,
        };
    }
    // Caught means judged: a scenario's verdict found the breach. A run that ended in a panic
    // (an assertion of the harness, a bug in it) proves nothing about the mutant.
    let caught_by = stderr
        .lines()
        .skip_while(|l| !l.starts_with("crash: FAILED"))
        .nth(1)
        .map(|l| l.trim().to_owned());
    let Some(caught_by) = caught_by else {
        let panic = stderr
            .lines()
            .skip_while(|l| !l.contains("panicked at"))
            .nth(1)
            .unwrap_or("(no reason printed)");
        println!(
            "crash: mutant {mutant}{scope} NOT CAUGHT: the run failed without a verdict ({:?}): {panic}",
            out.status
        );
        return Outcome {
            mutant,
            caught_by: None,
            seconds,
        };
    };
    if report {
        let last = stdout
            .lines()
            .rev()
            .find(|l| l.starts_with("crash: "))
            .unwrap_or("");
        println!("crash: mutant {mutant} caught ({seconds:.1}s): {caught_by}\n       last: {last}");
    }
    Outcome {
        mutant,
        caught_by: Some(caught_by),
        seconds,
    }
}

/// The outcomes as a Markdown table.
pub fn table(outcomes: &[Outcome]) -> String {
    let mut out = String::from("| mutant | result | seconds |\n|---|---|---|\n");
    for o in outcomes {
        let result = o.caught_by.as_deref().map_or("**not caught**".to_owned(), |why| {
            format!("caught: {}", why.replace('|', "/"))
        });
        out.push_str(&format!("| `{}` | {result} | {:.0} |\n", o.mutant, o.seconds));
    }
    out
}
