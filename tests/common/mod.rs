//! Helpers shared by the scenario tests: a store in its own temp dir, applying commands while
//! waiting for backoff. (The broker, proxy, Python and crash harnesses live in `tests/support/`.)

#![allow(
    dead_code,
    reason = "each test binary uses a different subset of these helpers"
)]

use std::path::PathBuf;
use std::time::{Duration, Instant};

use edge_outbox::{ApplyOutcome, Envelope, MessageId, Outbox};

/// What every test returns: any error fails it with its message.
pub type TestResult<T = ()> = Result<T, Box<dyn std::error::Error>>;

/// A fresh directory (deleted on drop) and the path of a database file inside it, not yet created.
pub fn temp_db() -> TestResult<(tempfile::TempDir, PathBuf)> {
    let dir = tempfile::Builder::new().prefix("edge-outbox-test").tempdir()?;
    let path = dir.path().join("device.db");
    Ok((dir, path))
}

/// Runs `sql` on a handle's connection and returns the single integer it selects.
pub fn query_i64(outbox: &Outbox, sql: &str) -> TestResult<i64> {
    Ok(outbox.with_connection(|c| c.query_row(sql, [], |r| r.get(0)))?)
}

/// An encoded command envelope carrying `payload` (any serialisable value) under `key`.
pub fn command_bytes<T: serde::Serialize>(id: MessageId, key: &str, payload: &T) -> TestResult<Vec<u8>> {
    Ok(Envelope {
        id,
        source: "cloud".into(),
        epoch: 0,
        seq: 1,
        key: key.into(),
        created_ms: 1_700_000_000_000,
        event_type: Some("Credit.v1".into()),
        headers: vec![("trace-id".into(), "t-1".into())],
        payload: edge_outbox::envelope::to_cbor(payload)?.into(),
    }
    .encode())
}

/// Calls `apply_next` until it returns something other than an idle store waiting on a backoff,
/// sleeping exactly until the backing-off command is due (never a guessed delay). Gives up after
/// 30 s so a store that never becomes due fails the test instead of hanging it.
pub fn apply_when_due<E, F>(outbox: &Outbox, mut handler: F) -> TestResult<ApplyOutcome>
where
    F: FnMut(&mut edge_outbox::Tx<'_>, &edge_outbox::Command) -> Result<(), E>,
    E: std::fmt::Display + 'static,
{
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        match outbox.apply_next(&mut handler)? {
            ApplyOutcome::Idle { next_due: Some(wait) } => {
                if Instant::now() > deadline {
                    return Err(format!("a command was still not due after 30 s (next_due {wait:?})").into());
                }
                std::thread::sleep(wait.max(Duration::from_millis(1)));
            }
            outcome => return Ok(outcome),
        }
    }
}

/// Unix milliseconds now.
pub fn now_ms() -> i64 {
    let since = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap_or_default();
    i64::try_from(since.as_millis()).unwrap_or(i64::MAX)
}

/// Lower-case hex of `bytes`.
pub fn to_hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

/// Bytes from hex (surrounding whitespace ignored).
pub fn from_hex(hex: &str) -> TestResult<Vec<u8>> {
    let hex = hex.trim();
    if !hex.len().is_multiple_of(2) {
        return Err(format!("odd-length hex {hex:?}").into());
    }
    (0..hex.len())
        .step_by(2)
        .map(|i| Ok(u8::from_str_radix(&hex[i..i + 2], 16)?))
        .collect()
}

/// Runs `body` on a thread of its own and waits at most `limit` for it: a test whose broken
/// build would deadlock (a mutex, a lock waited on by its own holder) fails instead of hanging
/// the suite. A body still running at the limit is left behind, and the test fails.
pub fn within<F>(limit: Duration, body: F) -> TestResult
where
    F: FnOnce() -> TestResult + Send + 'static,
{
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        // The error as text: a boxed error need not cross threads.
        let _ = tx.send(body().map_err(|e| e.to_string()));
    });
    match rx.recv_timeout(limit) {
        Ok(result) => result.map_err(Into::into),
        Err(std::sync::mpsc::RecvTimeoutError::Timeout) => {
            Err(format!("still running after {limit:?}: a deadlock?").into())
        }
        // The body panicked: its message is already printed.
        Err(std::sync::mpsc::RecvTimeoutError::Disconnected) => Err("the test body panicked".into()),
    }
}
