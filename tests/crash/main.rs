//! Crash, fault and bad-input harness: real processes, a real broker, real kills.
//!
//! `cargo test --features failpoints --test crash` runs every scenario and prints the report
//! table; `-- NAME` runs the scenarios whose name contains NAME. `CRASH_KILLS=1000` makes the
//! random-kill loop a soak; `CRASH_SEED` replays a run. With `--device` this binary is the
//! device under test instead (the scenarios start it that way).

#[path = "../support/mod.rs"]
mod support;

mod checker;
mod device;
mod lab;
mod scenarios;

use checker::Verdict;
use scenarios::Rng;

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    if args.iter().any(|a| a == "--device") {
        if let Err(e) = device::run() {
            eprintln!("device: {e}");
            std::process::exit(1);
        }
        return;
    }
    if std::env::var_os("RUST_LOG").is_some() {
        let _ = tracing_subscriber::fmt()
            .with_env_filter(tracing_subscriber::EnvFilter::from_default_env())
            .with_writer(std::io::stderr)
            .try_init();
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
    let mut run = |name: &str, f: &mut dyn FnMut(&mut Rng) -> Option<Verdict>| {
        if wanted(name) {
            let started = std::time::Instant::now();
            if let Some(v) = f(&mut rng) {
                println!("crash: {name} took {:.1?}: {}", started.elapsed(), summary(&v));
                verdicts.push(v);
            }
        }
    };
    for (point, nth) in [
        ("after-business-commit", 100),
        ("after-puback-before-mark", 100),
        // The first mark transaction: how many there are depends on how acks batch under load
        // (a loaded machine once marked all 400 rows in two).
        ("mid-mark", 1),
        ("command-stored-before-ack", 2),
        ("handler-mid-effect", 2),
        // The attempt is committed, the handler has not run: counted, then retried once.
        ("attempt-claimed", 2),
    ] {
        run(&format!("failpoint_{point}"), &mut |_| {
            Some(scenarios::failpoint(point, nth))
        });
    }
    run("random_kills", &mut |rng| {
        Some(scenarios::random_kills(kills, rng))
    });
    run("proxy_chaos", &mut |rng| Some(scenarios::proxy_chaos(rng)));
    run("broker_kills", &mut |rng| scenarios::broker_kills(rng));
    run("disk_full", &mut |_| Some(scenarios::disk_full()));

    checker::print_table(&verdicts);
    let failed: Vec<String> = verdicts
        .iter()
        .filter_map(|v| {
            let p = v.problems();
            (!p.is_empty()).then(|| format!("{}: {}", v.scenario, p.join(", ")))
        })
        .collect();
    if !failed.is_empty() {
        eprintln!("\ncrash: FAILED\n  {}", failed.join("\n  "));
        std::process::exit(1);
    }
    println!("\ncrash: ok, {} scenarios", verdicts.len());
}

fn summary(v: &Verdict) -> String {
    let problems = v.problems();
    if problems.is_empty() {
        format!(
            "ok ({} committed, {} duplicates, {} effects)",
            v.committed, v.duplicates, v.effects
        )
    } else {
        problems.join(", ")
    }
}
