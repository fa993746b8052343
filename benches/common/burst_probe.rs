//! How many commands each of the command intake's transactions stored, read from the crate's own
//! debug event for it (target `edge_outbox::commands::session`, field `commands`), so the command
//! bench can give its hand-written floor the same bursts without reaching into the crate.
//!
//! `#[path = "common/burst_probe.rs"] mod burst_probe;` then `burst_probe::install()` once (it
//! also prints the crate's log on stderr when `RUST_LOG` is set).

#![allow(dead_code, reason = "each benchmark uses a part")]

use std::sync::Mutex;
use std::time::Instant;

use tracing::field::{Field, Visit};
use tracing::{Event, Level, Metadata, Subscriber};
use tracing_subscriber::layer::{Context, Layer};
use tracing_subscriber::prelude::*;

const TARGET: &str = "edge_outbox::commands::session";

static BURSTS: Mutex<Vec<(Instant, u64)>> = Mutex::new(Vec::new());

/// Installs the probe (and, with `RUST_LOG`, a log printer) as this process's subscriber. Each
/// has its own filter: the probe sees the one event it counts and silences nothing else.
pub fn install() -> Result<(), String> {
    let log = std::env::var_os("RUST_LOG").is_some().then(|| {
        tracing_subscriber::fmt::layer()
            .with_writer(std::io::stderr)
            .with_filter(tracing_subscriber::EnvFilter::from_default_env())
    });
    let probe = Probe.with_filter(tracing_subscriber::filter::filter_fn(ours));
    tracing::subscriber::set_global_default(tracing_subscriber::registry().with(probe).with(log))
        .map_err(|e| format!("burst probe: {e}"))
}

/// How many commands the bursts stored since the last [`take`] held.
pub fn stored() -> u64 {
    BURSTS
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .iter()
        .map(|b| b.1)
        .sum()
}

/// The bursts stored since the last call, in order: when each was reported, and its size.
pub fn take() -> Vec<(Instant, u64)> {
    std::mem::take(&mut *BURSTS.lock().unwrap_or_else(|e| e.into_inner()))
}

struct Probe;

/// Decided once per callsite: only debug events of the intake that carry a `commands` field (not
/// the one per command stored, which would cost the intake a dispatch each).
fn ours(m: &Metadata<'_>) -> bool {
    m.target() == TARGET
        && *m.level() == Level::DEBUG
        && m.is_event()
        && m.fields().field("commands").is_some()
}

impl<S: Subscriber> Layer<S> for Probe {
    fn on_event(&self, event: &Event<'_>, _: Context<'_, S>) {
        let at = Instant::now();
        let mut v = Burst::default();
        event.record(&mut v);
        if let (true, Some(n)) = (v.is_burst, v.commands) {
            BURSTS.lock().unwrap_or_else(|e| e.into_inner()).push((at, n));
        }
    }
}

#[derive(Default)]
struct Burst {
    is_burst: bool,
    commands: Option<u64>,
}

impl Visit for Burst {
    fn record_u64(&mut self, field: &Field, value: u64) {
        if field.name() == "commands" {
            self.commands = Some(value);
        }
    }

    fn record_i64(&mut self, field: &Field, value: i64) {
        if field.name() == "commands" {
            self.commands = u64::try_from(value).ok();
        }
    }

    fn record_debug(&mut self, field: &Field, value: &dyn std::fmt::Debug) {
        if field.name() == "message" {
            self.is_burst = format!("{value:?}").starts_with("stored a burst of commands");
        }
    }
}
