//! `edge-outbox relay --progress`: a bar on stderr while a backlog drains (rows left, rate, ETA),
//! drawn by indicatif only when stderr is a terminal. Log lines go above it (see `above`), so the
//! two never share a row.

use std::fmt;
use std::sync::{Mutex, PoisonError};

use indicatif::{ProgressBar, ProgressDrawTarget, ProgressState, ProgressStyle};

use edge_outbox::Status;

/// Rows acknowledged since the relay started, out of those plus the rows still pending: the bar's
/// length grows as the application commits more, and its end is always "0 left". (A row acked
/// and not yet marked counts on both sides for a moment.)
const TEMPLATE: &str = "{msg} [{bar:25}] {pos}/{len} acked | {left} left | {per_sec} | ETA {eta}";

/// The bar on screen, for log lines to step over.
static SHOWN: Mutex<Option<ProgressBar>> = Mutex::new(None);

/// The relay's drain bar.
pub struct DrainBar {
    bar: ProgressBar,
}

impl DrainBar {
    /// A bar on stderr. indicatif hides it when stderr is not a terminal (or TERM is unset or
    /// `dumb`), so nothing but the caller's check decides less than that.
    pub fn stderr() -> Self {
        let bar = ProgressBar::with_draw_target(Some(0), ProgressDrawTarget::stderr());
        // The template is a constant: a broken one is a bug, shown as indicatif's default bar
        // rather than an error.
        if let Ok(style) = ProgressStyle::with_template(TEMPLATE) {
            bar.set_style(style.with_key("left", left));
        }
        *SHOWN.lock().unwrap_or_else(PoisonError::into_inner) = Some(bar.clone());
        DrainBar { bar }
    }

    /// Redraws from a status snapshot; `link` says where the relay stands with its broker.
    pub fn update(&self, link: String, s: &Status) {
        self.bar.set_message(link);
        self.bar.set_length(s.acknowledged + s.store.pending_messages);
        self.bar.set_position(s.acknowledged);
    }
}

impl Drop for DrainBar {
    fn drop(&mut self) {
        *SHOWN.lock().unwrap_or_else(PoisonError::into_inner) = None;
        self.bar.finish_and_clear();
    }
}

/// Runs `write` (a log line) with the bar, if one is shown, taken off the screen meanwhile.
pub fn above<R>(write: impl FnOnce() -> R) -> R {
    let shown = SHOWN.lock().unwrap_or_else(PoisonError::into_inner).clone();
    match shown {
        Some(bar) => bar.suspend(write),
        None => write(),
    }
}

/// The template's `{left}`: rows still pending.
fn left(state: &ProgressState, w: &mut dyn fmt::Write) {
    let left = state.len().unwrap_or(0).saturating_sub(state.pos());
    let _ = write!(w, "{left}");
}
