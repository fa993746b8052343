//! Crash, fault and bad-input harness: real processes, a real broker, real kills.
//!
//! `cargo test --all-features --test crash` runs every scenario, prints the report table, and
//! then runs itself against every mutant (`src/mutant.rs`): each must make it fail, or the
//! harness has a hole. `-- NAME` runs the scenarios whose name contains NAME; `--fail-fast` stops
//! at the first scenario with a problem (the default under `EDGE_OUTBOX_MUTANT`).
//! `CRASH_KILLS=1000` makes the random-kill loop a soak; `CRASH_SEED` replays a run;
//! `CRASH_TABLE=path` also writes the table as Markdown (docs/reliability.md's);
//! `CRASH_DEVICE_LOG=path` with `RUST_LOG` appends the devices' logs to a file. With `--device`
//! or `--writer` this binary is a device or a foreign writer under test instead (the scenarios
//! start it that way).

#[path = "../support/mod.rs"]
mod support;

mod checker;
mod device;
mod lab;
mod mutants;
mod scenarios;
mod writer;

use checker::Verdict;
use scenarios::Rng;

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    if std::env::var_os("RUST_LOG").is_some() {
        let _ = tracing_subscriber::fmt()
            .with_env_filter(tracing_subscriber::EnvFilter::from_default_env())
            .with_writer(std::io::stderr)
            .try_init();
    }
    if args.iter().any(|a| a == "--device") {
        lifeline();
        if let Err(e) = device::run() {
            eprintln!("device: {e}");
            std::process::exit(1);
        }
        return;
    }
    if args.iter().any(|a| a == "--writer") {
        lifeline();
        if let Err(e) = writer::run() {
            eprintln!("writer: {e}");
            std::process::exit(1);
        }
        return;
    }
    let mutant = std::env::var("EDGE_OUTBOX_MUTANT").ok().filter(|m| !m.is_empty());
    let fail_fast = mutant.is_some() || args.iter().any(|a| a == "--fail-fast");
    if let Some(m) = &mutant {
        println!("crash: MUTANT {m}: this run must fail");
    }
    // Flags from the test runner (e.g. --nocapture) are ignored; other words filter scenarios.
    let filters: Vec<&str> = args
        .iter()
        .filter(|a| !a.starts_with('-'))
        .map(String::as_str)
        .collect();
    let wanted = |name: &str| filters.is_empty() || filters.iter().any(|f| name.contains(f));
    let kills: usize = std::env::var("CRASH_KILLS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(100);
    let mut rng = Rng::from_env();

    let mut verdicts: Vec<Verdict> = Vec::new();
    let mut run = |name: &str, f: &mut dyn FnMut(&mut Rng) -> Verdict| {
        if !wanted(name) {
            return;
        }
        let started = std::time::Instant::now();
        let v = f(&mut rng);
        println!("crash: {name} took {:.1?}: {}", started.elapsed(), summary(&v));
        let failed = !v.problems().is_empty();
        verdicts.push(v);
        if failed && fail_fast {
            finish(&verdicts, &[]);
        }
    };
    // Cheapest first: under a mutant, the first scenario that catches it ends the run.
    for keep_sent in [false, true] {
        for (point, nth) in [
            ("after-commit-returned", 100),
            ("after-publish-before-puback", 100),
            ("after-puback-before-mark", 100),
            // The first mark transaction: how many there are depends on how acks batch under load
            // (a loaded machine once marked all 400 rows in two).
            ("mid-mark", 1),
            // The first burst's commit: the commands that arrive together are stored in one
            // transaction, and how many arrive together depends on timing.
            ("command-stored-before-ack", 1),
            // Events, not lines of code: the ack on the wire, the effect's commit returned.
            ("command-acked", 2),
            ("effect-committed", 2),
            ("handler-mid-effect", 2),
            // The attempt is committed, the handler has not run: counted, then retried once.
            ("attempt-claimed", 2),
        ] {
            run(&format!("failpoint_{point}"), &mut |_| {
                scenarios::failpoint(point, nth, keep_sent)
            });
        }
    }
    // Batches of about 20 orders: a few PUBACKs in, the crash falls on a batch's.
    for (point, nth) in [
        ("after-publish-before-puback", 3),
        ("after-puback-before-mark", 3),
        ("mid-mark", 1),
    ] {
        run(&format!("failpoint_batched_{point}"), &mut |_| {
            scenarios::failpoint_batched(point, nth)
        });
    }
    // One session for publishing and commands: the crash points where the two meet.
    for (point, nth) in [
        ("after-publish-before-puback", 100),
        ("after-puback-before-mark", 100),
        ("command-stored-before-ack", 1),
        ("command-acked", 2),
    ] {
        run(&format!("failpoint_single_session_{point}"), &mut |_| {
            scenarios::failpoint_single_session(point, nth)
        });
    }
    run("proxy_chaos", &mut scenarios::proxy_chaos);
    run("cuts_in_lanes_batched", &mut scenarios::cuts_in_lanes_batched);
    run("random_kills", &mut |rng| scenarios::random_kills(kills, rng));
    run("random_kills_in_lanes", &mut |rng| {
        scenarios::random_kills_in_lanes(kills / 2, rng)
    });
    run("random_kills_batched", &mut |rng| {
        scenarios::random_kills_batched(kills / 2, rng)
    });
    run("random_kills_single_session", &mut |rng| {
        scenarios::random_kills_single_session(kills / 4, rng)
    });
    run("foreign_writers", &mut |rng| {
        scenarios::foreign_writers(kills / 5, rng)
    });
    run("broker_kills", &mut scenarios::broker_kills);
    run("disk_full", &mut |_| scenarios::disk_full());
    let outcomes = if mutant.is_none() && wanted("mutants") {
        mutants::run_all()
    } else {
        Vec::new()
    };
    if mutant.is_none() && std::env::var("CRASH_MUTANT_MATRIX").is_ok_and(|v| v == "1") {
        let matrix = mutants::matrix(&SCENARIO_GROUPS);
        println!("\n{matrix}");
        if let Ok(path) = std::env::var("CRASH_TABLE")
            && let Err(e) = write_block(std::path::Path::new(&path), "mutant-matrix", &matrix)
        {
            eprintln!("crash: writing {path}: {e}");
            std::process::exit(1);
        }
    }
    finish(&verdicts, &outcomes);
}

/// The scenarios by family, as `CRASH_MUTANT_MATRIX` runs them one at a time.
const SCENARIO_GROUPS: [&str; 7] = [
    "failpoint",
    "proxy_chaos",
    "cuts_in_lanes",
    "random_kills",
    "foreign_writers",
    "broker_kills",
    "disk_full",
];

/// A device or writer lives as long as the orchestrator: the orchestrator holds the other end of
/// its stdin, which closes when it exits, however it exits (a SIGTERM to the test run, a panic).
/// A `finish <commands>` line on it asks a device to stop committing and drain, with that many
/// commands applied (`device::FINISH`).
fn lifeline() {
    std::thread::spawn(|| {
        use std::io::BufRead;
        for line in std::io::stdin().lock().lines().map_while(Result::ok) {
            if let Some(commands) = line.strip_prefix("finish ").and_then(|c| c.parse().ok()) {
                device::FINISH.store(commands, std::sync::atomic::Ordering::Relaxed);
            }
        }
        std::process::exit(3);
    });
}

/// Prints the table (and writes it where `CRASH_TABLE` says) and exits: 1 if any scenario found
/// a problem or any mutant survived.
fn finish(verdicts: &[Verdict], outcomes: &[mutants::Outcome]) -> ! {
    println!();
    print!("{}", checker::table(verdicts, false));
    if let Ok(path) = std::env::var("CRASH_TABLE")
        && let Err(e) = write_tables(std::path::Path::new(&path), verdicts, outcomes)
    {
        eprintln!("crash: writing {path}: {e}");
        std::process::exit(1);
    }
    let failed: Vec<String> = verdicts
        .iter()
        .filter_map(|v| {
            let p = v.problems();
            (!p.is_empty()).then(|| format!("{}: {}", v.scenario, p.join(", ")))
        })
        .collect();
    let survivors: Vec<&str> = outcomes
        .iter()
        .filter(|o| o.caught_by.is_none())
        .map(|o| o.mutant)
        .collect();
    if !failed.is_empty() || !survivors.is_empty() {
        eprintln!("\ncrash: FAILED\n  {}", failed.join("\n  "));
        if !survivors.is_empty() {
            eprintln!("  mutants the harness did not catch: {}", survivors.join(", "));
        }
        std::process::exit(1);
    }
    println!(
        "\ncrash: ok, {} scenarios, {} mutants caught",
        verdicts.len(),
        outcomes.len()
    );
    std::process::exit(0);
}

/// Writes the Markdown tables to `path` (see `write_block`).
fn write_tables(
    path: &std::path::Path,
    verdicts: &[Verdict],
    outcomes: &[mutants::Outcome],
) -> std::io::Result<()> {
    let broker = support::BrokerKind::from_env().map_or_else(|e| e.to_string(), |k| k.to_string());
    let seed = scenarios::SEED.get().copied().unwrap_or(0);
    let command = format!(
        "`CRASH_TABLE={} cargo test --all-features --test crash`",
        path.display()
    );
    let scenarios = format!(
        "Against {broker}, seed {seed}, written by {command}:\n\n{}",
        checker::table(verdicts, true)
    );
    write_block(path, "crash-table", &scenarios)?;
    if !outcomes.is_empty() {
        let mutants = format!(
            "The same run, against each mutant:\n\n{}",
            mutants::table(outcomes)
        );
        write_block(path, "mutant-table", &mutants)?;
    }
    Ok(())
}

/// Writes `block` into `path` between its `<!-- name -->` and `<!-- /name -->` lines if the file
/// has them (docs/reliability.md does), else appends it.
fn write_block(path: &std::path::Path, name: &str, block: &str) -> std::io::Result<()> {
    let text = std::fs::read_to_string(path).unwrap_or_default();
    let (begin, end) = (format!("<!-- {name} -->"), format!("<!-- /{name} -->"));
    let new = match (text.find(&begin), text.find(&end)) {
        (Some(b), Some(e)) if b < e => format!("{}{begin}\n{block}{}", &text[..b], &text[e..]),
        _ => format!("{text}{block}\n"),
    };
    std::fs::write(path, new)
}

fn summary(v: &Verdict) -> String {
    let problems = v.problems();
    if problems.is_empty() {
        let announced = if v.announced > 0 {
            format!(", {} announced removed", v.announced)
        } else {
            String::new()
        };
        format!(
            "ok ({} committed, {} duplicates, {} effects{announced})",
            v.committed, v.duplicates, v.effects
        )
    } else {
        problems.join(", ")
    }
}
