//! Refused deliveries logged at a bounded rate: anyone who can publish on the command topic can
//! make thousands a second, and a log line each would fill the log (and the disk it is on) in
//! place of the dead letters. Every refusal is still counted and kept within the dead letters'
//! bounds; only the log lines are sampled.

use std::sync::{Mutex, PoisonError};
use std::time::{Duration, Instant};

/// Lines logged per window, and the window.
const BURST: u32 = 10;
const WINDOW: Duration = Duration::from_secs(60);

struct Window {
    started: Instant,
    logged: u32,
    unlogged: u64,
}

static STATE: Mutex<Option<Window>> = Mutex::new(None);

/// Whether to log this refusal: `Some(n)` with the number of refusals left unlogged since the
/// previous line, or `None` to stay quiet.
pub(crate) fn admit() -> Option<u64> {
    admit_at(
        &mut STATE.lock().unwrap_or_else(PoisonError::into_inner),
        Instant::now(),
    )
}

fn admit_at(state: &mut Option<Window>, now: Instant) -> Option<u64> {
    let window = state.get_or_insert(Window {
        started: now,
        logged: 0,
        unlogged: 0,
    });
    if now.duration_since(window.started) >= WINDOW {
        let unlogged = window.unlogged;
        *window = Window {
            started: now,
            logged: 1,
            unlogged: 0,
        };
        return Some(unlogged);
    }
    if window.logged < BURST {
        window.logged += 1;
        let unlogged = window.unlogged;
        window.unlogged = 0;
        return Some(unlogged);
    }
    window.unlogged += 1;
    None
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_burst_is_logged_then_counted_until_the_next_window() {
        let mut state = None;
        let t0 = Instant::now();
        for _ in 0..BURST {
            assert_eq!(admit_at(&mut state, t0), Some(0));
        }
        for _ in 0..5 {
            assert_eq!(admit_at(&mut state, t0), None);
        }
        assert_eq!(
            admit_at(&mut state, t0 + WINDOW),
            Some(5),
            "the next line says how many were not"
        );
        assert_eq!(admit_at(&mut state, t0 + WINDOW), Some(0));
    }
}
