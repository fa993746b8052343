//! Log lines on stderr (tracing; `RUST_LOG` overrides the level), as text or, for log shippers,
//! one JSON object per line (`--log-format json`), and the relay's live status line when stderr
//! is a terminal. A log line first erases the status line, which the relay
//! redraws on its next tick, so the two never interleave on one row; with `--progress`, a log
//! line is written above the drain bar instead.

use std::io::{self, IsTerminal as _, Write};
use std::sync::OnceLock;
use std::sync::atomic::{AtomicBool, Ordering};

use serde_json::{Map, Value};
use tracing::field::{Field, Visit};
use tracing::level_filters::LevelFilter;
use tracing::{Event, Subscriber};
use tracing_subscriber::filter::Targets;
use tracing_subscriber::layer::{Context, Layer, SubscriberExt as _};
use tracing_subscriber::registry::Registry;
use tracing_subscriber::reload;
use tracing_subscriber::util::SubscriberInitExt as _;

use crate::{output, progress};

/// How log lines are written.
#[derive(
    Debug, Clone, Copy, PartialEq, Eq, Default, clap::ValueEnum, serde::Deserialize, serde::Serialize,
)]
#[serde(rename_all = "lowercase")]
pub enum LogFormat {
    /// Human-readable lines.
    #[default]
    Text,
    /// One JSON object per line: `timestamp` (RFC 3339, UTC), `level`, `target`, `message` and
    /// `fields` (the event's other fields).
    Json,
}

/// The least severe lines written (`RUST_LOG`, when set and valid, overrides it).
#[derive(
    Debug, Clone, Copy, PartialEq, Eq, Default, clap::ValueEnum, serde::Deserialize, serde::Serialize,
)]
#[serde(rename_all = "lowercase")]
pub enum LogLevel {
    /// Nothing.
    Off,
    Error,
    Warn,
    /// Start, connections, stop, and what an operator acts on.
    #[default]
    Info,
    Debug,
    Trace,
}

impl From<LogLevel> for LevelFilter {
    fn from(level: LogLevel) -> Self {
        match level {
            LogLevel::Off => LevelFilter::OFF,
            LogLevel::Error => LevelFilter::ERROR,
            LogLevel::Warn => LevelFilter::WARN,
            LogLevel::Info => LevelFilter::INFO,
            LogLevel::Debug => LevelFilter::DEBUG,
            LogLevel::Trace => LevelFilter::TRACE,
        }
    }
}

/// A status line is on screen (no newline after it yet).
static LINE_SHOWN: AtomicBool = AtomicBool::new(false);
const ERASE_LINE: &[u8] = b"\r\x1b[2K";

/// Installs the subscriber: `RUST_LOG` (e.g. `debug` or `edge_outbox=debug,rumqttc=warn`) if set
/// and valid, else `default`.
pub fn init(default: LevelFilter) {
    init_as(default, LogFormat::Text);
}

/// The installed filter, which a reload's new `log-level` replaces (unless RUST_LOG set it).
static FILTER: OnceLock<(reload::Handle<Targets, Registry>, bool)> = OnceLock::new();

/// The filter of a level: the demo's in-process broker logs every connection it sees close,
/// which is not news here.
fn level_filter(level: LevelFilter) -> Targets {
    Targets::new()
        .with_default(level)
        .with_target("rumqttd", LevelFilter::OFF)
}

/// [`init`], in `format`.
pub fn init_as(default: LevelFilter, format: LogFormat) {
    let fallback = level_filter(default);
    let (filter, from_env) = match std::env::var("RUST_LOG") {
        Ok(spec) if !spec.trim().is_empty() => match spec.parse::<Targets>() {
            Ok(filter) => (filter, true),
            Err(e) => {
                let _ = writeln!(
                    io::stderr(),
                    "edge-outbox: warning: ignoring RUST_LOG={spec:?}: {e}"
                );
                (fallback, false)
            }
        },
        _ => (fallback, false),
    };
    let (filter, handle) = reload::Layer::new(filter);
    let text = (format == LogFormat::Text).then(|| {
        tracing_subscriber::fmt::layer()
            .with_writer(|| LogWriter)
            .with_ansi(io::stderr().is_terminal())
    });
    let json = (format == LogFormat::Json).then_some(JsonLines);
    // Fails only if a subscriber is already set, in which case that one logs.
    if tracing_subscriber::registry()
        .with(filter)
        .with(text)
        .with(json)
        .try_init()
        .is_ok()
    {
        let _ = FILTER.set((handle, from_env));
    }
}

/// Replaces the level set at [`init_as`]. `Ok(false)`: RUST_LOG chose the filter, and it
/// stays.
pub fn set_level(level: LevelFilter) -> Result<bool, String> {
    match FILTER.get() {
        None => Err("no log subscriber of ours is installed".to_owned()),
        Some((_, true)) => Ok(false),
        Some((handle, false)) => handle
            .reload(level_filter(level))
            .map(|()| true)
            .map_err(|e| e.to_string()),
    }
}

/// Writes each event as one JSON object on one line. serde_json escapes what the fields hold
/// (newlines included), so a field can never break a line in two or forge another record.
struct JsonLines;

impl<S: Subscriber> Layer<S> for JsonLines {
    fn on_event(&self, event: &Event<'_>, _ctx: Context<'_, S>) {
        let mut fields = JsonFields::default();
        event.record(&mut fields);
        let meta = event.metadata();
        let mut record = Map::new();
        record.insert("timestamp".into(), output::timestamp(output::now_ms()).into());
        record.insert("level".into(), meta.level().as_str().into());
        record.insert("target".into(), meta.target().into());
        record.insert("message".into(), fields.message.unwrap_or_default().into());
        record.insert("fields".into(), Value::Object(fields.others));
        let mut line = Value::Object(record).to_string();
        line.push('\n');
        let _ = LogWriter.write_all(line.as_bytes());
    }
}

/// An event's fields: its message apart, the others by name with their JSON types.
#[derive(Default)]
struct JsonFields {
    message: Option<String>,
    others: Map<String, Value>,
}

impl JsonFields {
    fn put(&mut self, field: &Field, value: Value) {
        if field.name() == "message" {
            self.message = Some(match value {
                Value::String(s) => s,
                other => other.to_string(),
            });
        } else {
            self.others.insert(field.name().to_owned(), value);
        }
    }
}

impl Visit for JsonFields {
    fn record_debug(&mut self, field: &Field, value: &dyn std::fmt::Debug) {
        self.put(field, Value::String(format!("{value:?}")));
    }
    fn record_str(&mut self, field: &Field, value: &str) {
        self.put(field, Value::String(value.to_owned()));
    }
    fn record_i64(&mut self, field: &Field, value: i64) {
        self.put(field, value.into());
    }
    fn record_u64(&mut self, field: &Field, value: u64) {
        self.put(field, value.into());
    }
    fn record_bool(&mut self, field: &Field, value: bool) {
        self.put(field, value.into());
    }
    fn record_f64(&mut self, field: &Field, value: f64) {
        self.put(field, value.into());
    }
    fn record_error(&mut self, field: &Field, value: &(dyn std::error::Error + 'static)) {
        self.put(field, Value::String(value.to_string()));
    }
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
