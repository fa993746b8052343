//! What both benchmarks need: a wall-clock timestamp, a cheap deterministic generator, quantiles
//! and numeric settings from the environment.
//! `mod common;` from `benches/*.rs`; each benchmark adds the draws it needs with its own `impl`.

#![allow(dead_code, reason = "each benchmark uses a part")]

use std::time::{SystemTime, UNIX_EPOCH};

/// Milliseconds since the Unix epoch, as the crate stamps rows and envelopes.
pub fn now_ms() -> i64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as i64)
}

/// splitmix64: the cheapest way to random-looking numbers, reproducible from the seed.
pub struct Rng(pub u64);

impl Rng {
    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }
}

/// Linear-interpolated quantile `q` of `v` (not empty).
pub fn quantile(v: &[f64], q: f64) -> f64 {
    let mut v = v.to_vec();
    v.sort_by(f64::total_cmp);
    let pos = q * (v.len() - 1) as f64;
    let (lo, hi) = (pos.floor() as usize, pos.ceil() as usize);
    v[lo] + (v[hi] - v[lo]) * (pos - lo as f64)
}

/// The median of `v` (not empty).
pub fn median(v: &[f64]) -> f64 {
    quantile(v, 0.5)
}

/// Where the benchmark's databases go: `EDGE_OUTBOX_BENCH_DIR`, else Cargo's target tmp dir (a
/// real disk, not tmpfs, or FULL measures nothing); created if missing.
pub fn bench_dir() -> std::io::Result<std::path::PathBuf> {
    let base = match std::env::var_os("EDGE_OUTBOX_BENCH_DIR") {
        Some(dir) => std::path::PathBuf::from(dir),
        None => std::path::PathBuf::from(option_env!("CARGO_TARGET_TMPDIR").unwrap_or(".")),
    };
    std::fs::create_dir_all(&base)?;
    Ok(base)
}

/// A positive number from the environment variable `name`, or `default` when it is unset.
pub fn env_num(name: &str, default: f64) -> Result<f64, String> {
    match std::env::var(name) {
        Ok(s) => {
            let v: f64 = s.trim().parse().map_err(|e| format!("{name}={s:?}: {e}"))?;
            if v.is_finite() && v > 0.0 {
                Ok(v)
            } else {
                Err(format!("{name} must be a positive number, got {s:?}"))
            }
        }
        Err(_) => Ok(default),
    }
}

/// One timed operation: when it started, and how long it took in seconds.
#[derive(Clone, Copy, Debug)]
pub struct Sample {
    pub at: std::time::Instant,
    pub secs: f64,
}

/// The durations of `samples` that started within `[from, to]` (all of them without bounds).
pub fn latencies_within(
    samples: &[Sample],
    bounds: Option<(std::time::Instant, std::time::Instant)>,
) -> Vec<f64> {
    samples
        .iter()
        .filter(|s| bounds.is_none_or(|(from, to)| s.at >= from && s.at <= to))
        .map(|s| s.secs)
        .collect()
}

/// Runs `op` once per `pace` (at once when it fell behind) and times each run, until `count`
/// runs or until `stop` says so.
pub fn paced<E>(
    pace: std::time::Duration,
    count: Option<usize>,
    stop: impl Fn() -> bool,
    mut op: impl FnMut() -> Result<(), E>,
) -> Result<Vec<Sample>, E> {
    use std::time::Instant;
    let mut samples = Vec::new();
    let mut next = Instant::now();
    while count.is_none_or(|n| samples.len() < n) && !stop() {
        let started = Instant::now();
        op()?;
        samples.push(Sample {
            at: started,
            secs: started.elapsed().as_secs_f64(),
        });
        next += pace;
        match next.checked_duration_since(Instant::now()) {
            Some(wait) => std::thread::sleep(wait),
            None => next = Instant::now(),
        }
    }
    Ok(samples)
}
