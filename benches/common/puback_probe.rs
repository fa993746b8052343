//! When the relay's connection thread receives each PUBACK, read from the crate's own
//! `mqtt event` trace (one per rumqttc event, target `edge_outbox::mqtt::client`), so the relay
//! bench can time commit return -> PUBACK without reaching into the crate.
//!
//! `#[path = "common/puback_probe.rs"] mod puback_probe;` then `puback_probe::install()` once.
//! Every other trace callsite is told once that nobody listens (as with no subscriber); the
//! relay's per-event callsite asks the probe each time, which disarmed costs a check of its
//! target and an atomic load.

#![allow(dead_code, reason = "each benchmark uses a part")]

use std::fmt::Debug;
use std::sync::Mutex;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Instant;

use tracing::field::{Field, Visit};
use tracing::subscriber::Interest;
use tracing::{Event, Level, Metadata, Subscriber};
use tracing_subscriber::layer::{Context, Layer};
use tracing_subscriber::prelude::*;

const TARGET: &str = "edge_outbox::mqtt::client";

static ARMED: AtomicBool = AtomicBool::new(false);
static SEEN: Mutex<Vec<Instant>> = Mutex::new(Vec::new());

/// Installs the probe as this process's subscriber. Fails if another one was installed first.
/// Not `try_init`: that would also route the `log` records of rumqttc (all sides of the bench)
/// into `tracing`, and make them cost something.
pub fn install() -> Result<(), String> {
    tracing::subscriber::set_global_default(tracing_subscriber::registry().with(Probe))
        .map_err(|e| format!("puback probe: {e}"))
}

/// Starts (or stops) recording PUBACKs; starting forgets those recorded before.
pub fn arm(on: bool) {
    take();
    ARMED.store(on, Ordering::SeqCst);
}

/// The PUBACKs seen since the last call, in order of arrival.
pub fn take() -> Vec<Instant> {
    std::mem::take(&mut *SEEN.lock().unwrap_or_else(|e| e.into_inner()))
}

struct Probe;

fn ours(m: &Metadata<'_>) -> bool {
    m.target() == TARGET && *m.level() == Level::TRACE && m.is_event()
}

impl<S: Subscriber> Layer<S> for Probe {
    fn register_callsite(&self, m: &'static Metadata<'static>) -> Interest {
        if ours(m) {
            Interest::sometimes()
        } else {
            Interest::never()
        }
    }

    fn enabled(&self, m: &Metadata<'_>, _: Context<'_, S>) -> bool {
        ours(m) && ARMED.load(Ordering::Relaxed)
    }

    fn on_event(&self, event: &Event<'_>, _: Context<'_, S>) {
        let at = Instant::now();
        let mut v = IsPubAck(false);
        event.record(&mut v);
        if v.0 {
            SEEN.lock().unwrap_or_else(|e| e.into_inner()).push(at);
        }
    }
}

/// Whether the event's `event` field is an incoming PUBACK (rumqttc's `Debug` of its event:
/// `Incoming(PubAck(..))` under both protocols).
struct IsPubAck(bool);

impl Visit for IsPubAck {
    fn record_debug(&mut self, field: &Field, value: &dyn Debug) {
        if field.name() == "event" {
            self.0 = format!("{value:?}").starts_with("Incoming(PubAck(");
        }
    }
}
