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

#[cfg(test)]
mod tests {
    use std::io::Write;
    use std::sync::{Arc, Mutex};

    use super::*;

    /// Collects formatted log lines.
    #[derive(Clone, Default)]
    struct Lines(Arc<Mutex<Vec<u8>>>);

    impl Write for Lines {
        fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
            self.0.lock().expect("lines").extend_from_slice(buf);
            Ok(buf.len())
        }
        fn flush(&mut self) -> std::io::Result<()> {
            Ok(())
        }
    }

    #[test]
    fn a_session_that_stays_down_warns_once_then_summarises() {
        let lines = Lines::default();
        let writer = lines.clone();
        let subscriber = tracing_subscriber::fmt()
            .with_max_level(tracing::Level::INFO)
            .with_ansi(false)
            .with_writer(move || writer.clone())
            .finish();
        tracing::subscriber::with_default(subscriber, || {
            let mut outage = Outage::default();
            outage.on_connected();
            for _ in 0..20 {
                outage.on_disconnected("connection refused");
            }
            outage.on_connected();
            outage.on_disconnected("connection reset");
        });
        let text = String::from_utf8(lines.0.lock().expect("lines").clone()).expect("utf-8");
        let warns: Vec<&str> = text.lines().filter(|l| l.contains("WARN")).collect();
        assert_eq!(warns.len(), 2, "one per outage:\n{text}");
        assert!(warns[0].contains("command session disconnected"), "{text}");
        let reconnected: Vec<&str> = text.lines().filter(|l| l.contains("reconnected")).collect();
        assert_eq!(reconnected.len(), 1, "{text}");
        assert!(reconnected[0].contains("failed_attempts=19"), "{text}");
    }
}
