//! Log lines on stderr (tracing; `RUST_LOG` overrides the level), and the relay's live status
//! line when stderr is a terminal. A log line first erases the status line, which the relay
//! redraws on its next tick, so the two never interleave on one row; with `--progress`, a log
//! line is written above the drain bar instead.

use std::io::{self, IsTerminal as _, Write};
use std::sync::atomic::{AtomicBool, Ordering};

use tracing::level_filters::LevelFilter;
use tracing_subscriber::filter::Targets;
use tracing_subscriber::layer::SubscriberExt as _;
use tracing_subscriber::util::SubscriberInitExt as _;

use crate::progress;

/// A status line is on screen (no newline after it yet).
static LINE_SHOWN: AtomicBool = AtomicBool::new(false);
const ERASE_LINE: &[u8] = b"\r\x1b[2K";

/// Installs the subscriber: `RUST_LOG` (e.g. `debug` or `edge_outbox=debug,rumqttc=warn`) if set
/// and valid, else `default`.
pub fn init(default: LevelFilter) {
    // The demo's in-process broker logs every connection it sees close; that is not news here.
    let fallback = Targets::new()
        .with_default(default)
        .with_target("rumqttd", LevelFilter::OFF);
    let filter = match std::env::var("RUST_LOG") {
        Ok(spec) if !spec.trim().is_empty() => spec.parse::<Targets>().unwrap_or_else(|e| {
            let _ = writeln!(
                io::stderr(),
                "edge-outbox: warning: ignoring RUST_LOG={spec:?}: {e}"
            );
            fallback
        }),
        _ => fallback,
    };
    let layer = tracing_subscriber::fmt::layer()
        .with_writer(|| LogWriter)
        .with_ansi(io::stderr().is_terminal());
    // Fails only if a subscriber is already set, in which case that one logs.
    let _ = tracing_subscriber::registry().with(layer).with(filter).try_init();
}

/// Shows `line` in place of the previous status line.
pub fn show_line(line: &str) {
    let mut err = io::stderr().lock();
    let _ = err.write_all(ERASE_LINE);
    let _ = err.write_all(line.as_bytes());
    let _ = err.flush();
    LINE_SHOWN.store(true, Ordering::Relaxed);
}

/// Erases the status line, if one is shown.
pub fn clear_line() {
    let mut err = io::stderr().lock();
    if LINE_SHOWN.swap(false, Ordering::Relaxed) {
        let _ = err.write_all(ERASE_LINE);
        let _ = err.flush();
    }
}

/// stderr, erasing the status line before the first byte of a log record.
struct LogWriter;

impl Write for LogWriter {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        progress::above(|| {
            let mut err = io::stderr().lock();
            if LINE_SHOWN.swap(false, Ordering::Relaxed) {
                err.write_all(ERASE_LINE)?;
            }
            err.write_all(buf)?;
            Ok(buf.len())
        })
    }

    fn flush(&mut self) -> io::Result<()> {
        io::stderr().flush()
    }
}
