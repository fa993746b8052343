//! The crate's one error type.

use std::fmt;
use std::path::PathBuf;

/// `Result` with [`Error`] as the default error type.
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// Where and why a payload breaks its schema: what [`Error::SchemaViolation`] carries.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct SchemaMismatch {
    /// The message's topic.
    pub topic: String,
    /// The schema checked against: event type and version (`order.placed v2`).
    pub schema: String,
    /// The schema's rule for the payload.
    pub rule: String,
    /// Where in the payload it fails: `$` is the payload, `$.items[2].qty` a field in it.
    pub path: String,
    /// What the schema expected there.
    pub reason: String,
}

/// Everything that can go wrong in edge-outbox.
///
/// Each variant says what failed and, in its message, what to do about it. The wrapped errors of
/// pre-1.0 crates (rusqlite, rumqttc, ciborium) are reachable through [`std::error::Error::source`].
/// rusqlite is part of this crate's API ([`Tx`](crate::Tx) derefs to its transaction, and
/// [`Outbox::with_connection`](crate::Outbox::with_connection) lends its connection), so the crate
/// re-exports it as [`edge_outbox::rusqlite`](crate::rusqlite): use that path and its version always
/// matches. A new rusqlite is a breaking release of this crate. rumqttc and ciborium types are not
/// part of the API.
#[derive(Debug)]
#[non_exhaustive]
pub enum Error {
    /// The outbox is at its configured limit of pending messages or bytes and nothing evictable
    /// was left to make room. The caller's whole transaction was rolled back.
    StorageFull {
        /// Which limit was hit, e.g. `"10000 pending messages"`.
        limit: String,
    },
    /// The disk (or SQLite's `max_page_count`) is full. The transaction was rolled back; what was
    /// committed before is intact. Writes succeed again once space is freed.
    DiskFull,
    /// The storage reported an I/O error (SQLite's "disk I/O error": a failing SD card or flash,
    /// a pulled USB disk). The transaction was rolled back; what was committed before is intact
    /// as far as the storage kept it. Writes succeed again once the storage does.
    DiskIo(rusqlite::Error),
    /// Another connection held the database lock for longer than the busy timeout.
    Busy,
    /// A message payload is larger than the configured maximum.
    PayloadTooLarge {
        /// Size of the encoded payload or envelope, in bytes.
        size: usize,
        /// The configured maximum, in bytes.
        max: usize,
    },
    /// A payload does not match the schema registered for its topic (feature `schemas`): the
    /// transaction fails and nothing of it is committed. Boxed: it is rare, and keeps the error
    /// small on every hot path.
    SchemaViolation(Box<SchemaMismatch>),
    /// A value could not be encoded to CBOR.
    Encode(String),
    /// Bytes could not be decoded (a malformed envelope, payload or command).
    Decode(String),
    /// The file was written by a newer version of edge-outbox; this version will not touch it.
    SchemaTooNew {
        /// The schema version found in the file.
        found: i64,
        /// The newest schema version this build understands.
        supported: i64,
    },
    /// The database file is damaged (SQLite reports corruption, or the integrity check fails).
    /// With [`Options::salvage_on_corruption`](crate::Options::salvage_on_corruption) (the
    /// default) opening salvages it instead; `edge-outbox doctor --salvage` does it by hand.
    Corrupt {
        /// The file.
        path: PathBuf,
        /// What the check or SQLite said.
        detail: String,
    },
    /// The file exists but is not an SQLite database.
    NotADatabase {
        /// The path that was opened.
        path: PathBuf,
    },
    /// The database file could not be written because it (or its directory) is read-only.
    ReadOnly {
        /// The path that was opened.
        path: PathBuf,
    },
    /// A relay is already running on this database file (in this or another process).
    RelayAlreadyRunning {
        /// The lock file that is held.
        lock_path: PathBuf,
    },
    /// A configuration value is invalid; the message names it.
    InvalidConfig(String),
    /// A topic name cannot be published to: empty, longer than 65,535 bytes, containing a
    /// wildcard (`+`, `#`) or NUL, or starting with `$` when that is not allowed.
    InvalidTopic {
        /// The topic as given.
        topic: String,
        /// Which rule it breaks.
        why: &'static str,
    },
    /// A dead letter, message or row named by id does not exist.
    NotFound(String),
    /// No data directory could be found for the application name (no home directory).
    NoDataDir,
    /// A background thread panicked. This is a bug in edge-outbox: please report it.
    Panicked(String),
    /// A command handler refused a command for good: it is marked rejected at once with this
    /// reason (counted apart from the dead letters: nothing for an operator to do), never
    /// retried, and the commands behind it run. Return it from a handler (see [`Error::reject`]);
    /// [`Command::payload_as`](crate::Command::payload_as) returns it for a payload that does not
    /// match the expected type, since decoding it again cannot succeed. With a reply
    /// ([`Error::with_reply`]), the reply is published in the transaction that records the
    /// rejection: once, and only if the rejection is recorded.
    #[non_exhaustive]
    CommandRejected {
        /// Why the command can never be applied.
        reason: String,
        /// What to publish with the rejection, to tell the sender ([`Error::with_reply`]).
        reply: Option<Box<crate::Message>>,
    },
    /// A write (or [`Outbox::apply_next`](crate::Outbox::apply_next)) was called from inside a
    /// command handler while the handler's transaction holds the database's write lock: it could
    /// only wait for itself. Write through the handler's [`Tx`](crate::Tx) instead.
    InsideCommandHandler {
        /// The operation called, e.g. `"Outbox::transaction"`.
        operation: &'static str,
    },
    /// [`Relay::shutdown`](crate::Relay::shutdown) gave up waiting for a command handler that
    /// did not return within the shutdown timeout. Its thread was left running; the attempt was
    /// counted before it started, so after a restart the command is retried (its effect commits
    /// at most once) or, after the maximum attempts, dead-lettered.
    HandlerStuck {
        /// The command the handler was applying.
        command: crate::MessageId,
        /// How long it had been running.
        running_for: std::time::Duration,
    },
    /// A dead letter was not put back: receiving it again refused it (a device that requires
    /// signed commands verifies a retried one like any delivery), or its command is already in
    /// the inbox. Nothing changed: it stays in the dead letters.
    RetryRefused {
        /// The dead letter, still there.
        dead_letter_id: i64,
        /// Why it was not put back.
        reason: String,
    },
    /// A file-system operation failed.
    Io {
        /// What was being done, e.g. `"creating /data/outbox.db"`.
        context: String,
        /// The underlying error.
        source: std::io::Error,
    },
    /// Any other SQLite error.
    Sqlite(rusqlite::Error),
}

impl Error {
    /// A permanent refusal for a command handler to return: the command is marked rejected at
    /// once with `reason` (not a dead letter) and never retried (see [`Error::CommandRejected`]).
    ///
    /// ```
    /// let e = edge_outbox::Error::reject("set_rate must be a number");
    /// assert!(matches!(e, edge_outbox::Error::CommandRejected { .. }));
    /// ```
    pub fn reject(reason: impl fmt::Display) -> Self {
        Error::CommandRejected {
            reason: reason.to_string(),
            reply: None,
        }
    }

    /// Gives a rejection ([`Error::reject`], or the one [`Command::payload_as`](crate::Command::payload_as)
    /// returns) a reply: a message published in the same transaction that records the rejection,
    /// so the sender learns of it exactly when the device does, once. The rejecting handler's own
    /// transaction rolls back, so this is the one way to answer a rejected command. Any other
    /// error is returned unchanged: a failure that will be retried has nothing to answer yet.
    ///
    /// A reply that cannot be published (over a limit, a bad topic) does not stop the rejection:
    /// it is recorded with the reason and why the reply was not sent.
    ///
    /// ```
    /// use edge_outbox::{ApplyOutcome, Envelope, Error, Message, MessageId, Outbox};
    ///
    /// # let dir = tempfile::tempdir().expect("temp dir");
    /// let outbox = Outbox::open(dir.path().join("device.db"))?;
    /// let id = MessageId::new_v7();
    /// outbox.receive("pumps/p1/set", &Envelope::command(id, "pump-1", &250)?.encode())?;
    ///
    /// let outcome = outbox.apply_next(|_tx, cmd| {
    ///     let rate: i64 = cmd.payload_as()?;
    ///     if rate > 100 {
    ///         let answer = Message::new("pumps/p1/replies", &cmd.key, &format!("{}: rate above 100", cmd.id))?;
    ///         return Err(Error::reject("rate above 100").with_reply(answer));
    ///     }
    ///     Ok(())
    /// })?;
    /// assert!(matches!(outcome, ApplyOutcome::Rejected { reply: Some(_), .. }));
    /// assert_eq!(outbox.stats()?.inbox_rejected, 1);
    /// assert_eq!(outbox.stats()?.dead_letters, 0);
    /// # Ok::<(), edge_outbox::Error>(())
    /// ```
    pub fn with_reply(self, reply: crate::Message) -> Self {
        match self {
            Error::CommandRejected { reason, .. } => Error::CommandRejected {
                reason,
                reply: Some(Box::new(reply)),
            },
            other => other,
        }
    }

    pub(crate) fn io(context: impl Into<String>, source: std::io::Error) -> Self {
        Error::Io {
            context: context.into(),
            source,
        }
    }
}

impl fmt::Display for Error {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Error::StorageFull { limit } => write!(
                f,
                "outbox storage limit reached ({limit}); the transaction was rolled back: \
                 let the relay drain, raise the limit, or mark messages evictable"
            ),
            Error::DiskFull => f.write_str(
                "database or disk is full; the transaction was rolled back and nothing committed \
                 was lost: free space and retry",
            ),
            Error::DiskIo(e) => write!(
                f,
                "the storage reported an I/O error ({e}); the transaction was rolled back: \
                 check the disk (dmesg), then retry"
            ),
            Error::Busy => f.write_str(
                "database is locked by another connection for longer than the busy timeout: \
                 retry, or raise the busy timeout",
            ),
            Error::PayloadTooLarge { size, max } => write!(
                f,
                "payload of {size} bytes exceeds the maximum of {max} bytes: \
                 send a smaller message or raise the limit (and the broker's)"
            ),
            Error::SchemaViolation(m) => write!(
                f,
                "payload for topic {:?} does not match schema {} (rule {}) at {}: {}",
                m.topic, m.schema, m.rule, m.path, m.reason
            ),
            Error::Encode(why) => write!(f, "cannot encode value as CBOR: {why}"),
            Error::Decode(why) => write!(f, "malformed input: {why}"),
            Error::SchemaTooNew { found, supported } => write!(
                f,
                "database schema version {found} was written by a newer edge-outbox \
                 (this build supports up to {supported}): upgrade edge-outbox"
            ),
            Error::Corrupt { path, detail } => write!(
                f,
                "{} is damaged: {detail}; `edge-outbox doctor --salvage` moves it aside and \
                 salvages what is readable into a fresh file (opening does it by default)",
                path.display()
            ),
            Error::NotADatabase { path } => write!(
                f,
                "{} is not an SQLite database (or is encrypted): check the path",
                path.display()
            ),
            Error::ReadOnly { path } => write!(
                f,
                "{} is read-only: edge-outbox needs write access to the file and its directory",
                path.display()
            ),
            Error::RelayAlreadyRunning { lock_path } => write!(
                f,
                "another relay is already running on this database (lock {} is held): \
                 run one relay per file",
                lock_path.display()
            ),
            Error::InvalidConfig(why) => write!(f, "invalid configuration: {why}"),
            Error::InvalidTopic { topic, why } => {
                // A topic can be 64 KiB long: show its start only.
                let shown: String = topic.chars().take(80).collect();
                let more = if shown.len() < topic.len() { "..." } else { "" };
                write!(f, "{shown:?}{more} is not a valid MQTT topic name: {why}")
            }
            Error::NotFound(what) => write!(f, "{what} not found"),
            Error::NoDataDir => {
                f.write_str("no data directory found for this user (is HOME set?): pass an explicit path")
            }
            Error::Panicked(thread) => write!(
                f,
                "thread {thread} panicked (a bug in edge-outbox: please report it)"
            ),
            Error::CommandRejected { reason, .. } => write!(
                f,
                "command rejected by its handler: {reason} (marked rejected, not retried)"
            ),
            Error::InsideCommandHandler { operation } => write!(
                f,
                "{operation} was called from inside a command handler, whose transaction holds the \
                 database's write lock: write through the handler's Tx, or do it after the handler"
            ),
            Error::HandlerStuck { command, running_for } => write!(
                f,
                "the command handler did not return within the shutdown timeout: it has been \
                 applying command {command} for {running_for:.1?}; its thread was left running \
                 (the attempt is counted: after a restart the command is retried or dead-lettered)"
            ),
            Error::RetryRefused {
                dead_letter_id,
                reason,
            } => write!(
                f,
                "dead letter {dead_letter_id} was not put back and stays in the dead letters: {reason}"
            ),
            Error::Io { context, source } => write!(f, "{context}: {source}"),
            Error::Sqlite(e) => write!(f, "database error: {e}"),
        }
    }
}

impl std::error::Error for Error {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        match self {
            Error::Io { source, .. } => Some(source),
            Error::Sqlite(e) | Error::DiskIo(e) => Some(e),
            _ => None,
        }
    }
}

impl From<rusqlite::Error> for Error {
    /// Classifies the SQLite failures a caller can act on; the rest stay [`Error::Sqlite`].
    fn from(e: rusqlite::Error) -> Self {
        use rusqlite::ErrorCode;
        match e.sqlite_error_code() {
            Some(ErrorCode::DiskFull) => Error::DiskFull,
            Some(ErrorCode::SystemIoFailure) => Error::DiskIo(e),
            Some(ErrorCode::DatabaseBusy | ErrorCode::DatabaseLocked) => Error::Busy,
            _ => Error::Sqlite(e),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn error_stays_small() {
        // Results flow through every hot path; keep the error at most a few words.
        assert!(
            std::mem::size_of::<Error>() <= 72,
            "{}",
            std::mem::size_of::<Error>()
        );
    }

    #[test]
    fn disk_full_is_classified() {
        let e = rusqlite::Error::SqliteFailure(rusqlite::ffi::Error::new(rusqlite::ffi::SQLITE_FULL), None);
        assert!(matches!(Error::from(e), Error::DiskFull));
    }

    #[test]
    fn error_is_send_sync() {
        fn check<T: Send + Sync + 'static>() {}
        check::<Error>();
    }
}
