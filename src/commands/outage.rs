//! Logging a command session that is down: one WARN when it drops, then a summary instead of a
//! line per failed attempt (at the default reconnect backoff that would be several a second).

use std::time::{Duration, Instant};

/// How often a session that stays down is summarised at WARN.
const SUMMARY_EVERY: Duration = Duration::from_secs(300);

#[derive(Debug, Default)]
pub(crate) struct Outage {
    /// When the session went down, if it is down.
    since: Option<Instant>,
    failed_attempts: u64,
    last_summary: Option<Instant>,
}

impl Outage {
    /// The session connected: says how long it was down, if it was.
    pub(crate) fn on_connected(&mut self) {
        if let Some(since) = self.since.take() {
            tracing::info!(
                down_for = ?since.elapsed(),
                failed_attempts = self.failed_attempts,
                "command session reconnected"
            );
        }
        self.failed_attempts = 0;
        self.last_summary = None;
    }

    /// A connection or an attempt failed.
    pub(crate) fn on_disconnected(&mut self, error: &str) {
        let now = Instant::now();
        match self.since {
            None => {
                self.since = Some(now);
                self.last_summary = Some(now);
                tracing::warn!(%error, "command session disconnected; reconnecting");
            }
            Some(since) => {
                self.failed_attempts += 1;
                if self
                    .last_summary
                    .is_none_or(|t| now.duration_since(t) >= SUMMARY_EVERY)
                {
                    self.last_summary = Some(now);
                    tracing::warn!(
                        %error,
                        down_for = ?since.elapsed(),
                        failed_attempts = self.failed_attempts,
                        "command session still disconnected"
                    );
                } else {
                    tracing::debug!(%error, "command session connection attempt failed");
                }
            }
        }
    }
}
