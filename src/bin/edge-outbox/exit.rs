//! Failures, their one-line messages and their exit codes (listed in `--help` and
//! docs/operations.md: keep the three in step).

use std::fmt;
use std::io::Write as _;
use std::process::ExitCode;

/// What kind of failure, which is what a script can act on.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Code {
    /// 1: I/O, a relay thread failed, an unexpected database error.
    Runtime = 1,
    /// 2: bad arguments, broker URL, TLS or password files.
    Usage = 2,
    /// 3: no such file, not a database, locked, read-only, schema too new.
    Database = 3,
    /// 4: another relay holds the database's relay lock.
    RelayRunning = 4,
    /// 5: the dead letter named does not exist.
    NotFound = 5,
    /// 6: `consume --fail-on-gap` found messages missing without a gap notice.
    UnexplainedGaps = 6,
    /// 7: `schema check` found a payload that breaks its schema.
    SchemaViolation = 7,
}

/// A failure to report: a code and a message saying what failed and what to do.
#[derive(Debug)]
pub struct CliError {
    code: Code,
    message: String,
    /// stdout was closed by the reader (`edge-outbox pending | head`): not worth a message.
    quiet: bool,
}

impl CliError {
    pub fn new(code: Code, message: impl Into<String>) -> Self {
        CliError {
            code,
            message: message.into(),
            quiet: false,
        }
    }

    pub fn usage(message: impl Into<String>) -> Self {
        Self::new(Code::Usage, message)
    }

    pub fn database(message: impl Into<String>) -> Self {
        Self::new(Code::Database, message)
    }

    pub fn runtime(message: impl Into<String>) -> Self {
        Self::new(Code::Runtime, message)
    }

    /// Writing to stdout failed. A closed pipe ends the command quietly, with success: the
    /// reader has what it wanted.
    pub fn output(e: &std::io::Error) -> Self {
        CliError {
            code: Code::Runtime,
            message: format!("writing output: {e}"),
            quiet: e.kind() == std::io::ErrorKind::BrokenPipe,
        }
    }

    pub fn code(&self) -> Code {
        self.code
    }

    /// Prints the message as one line on stderr and returns the exit code.
    pub fn report(&self) -> ExitCode {
        if self.quiet {
            return ExitCode::SUCCESS;
        }
        // One line, whatever the wrapped error put in it.
        let line = self.message.replace(['\n', '\r'], " ");
        let _ = writeln!(std::io::stderr().lock(), "edge-outbox: error: {line}");
        ExitCode::from(self.code as u8)
    }
}

impl fmt::Display for CliError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.message)
    }
}

impl From<edge_outbox::Error> for CliError {
    fn from(e: edge_outbox::Error) -> Self {
        use edge_outbox::Error as E;
        let code = match &e {
            E::RelayAlreadyRunning { .. } => Code::RelayRunning,
            E::SchemaViolation(_) => Code::SchemaViolation,
            E::NotFound(_) => Code::NotFound,
            E::InvalidConfig(_) | E::InvalidTopic { .. } => Code::Usage,
            E::NotADatabase { .. }
            | E::Corrupt { .. }
            | E::SchemaTooNew { .. }
            | E::Busy
            | E::ReadOnly { .. }
            | E::DiskFull
            | E::StorageFull { .. }
            | E::NoDataDir => Code::Database,
            _ => Code::Runtime,
        };
        CliError::new(code, e.to_string())
    }
}

impl From<rusqlite::Error> for CliError {
    fn from(e: rusqlite::Error) -> Self {
        edge_outbox::Error::from(e).into()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn library_errors_get_their_documented_codes() {
        let lock = edge_outbox::Error::RelayAlreadyRunning {
            lock_path: "x.db.relay-lock".into(),
        };
        assert_eq!(CliError::from(lock).code(), Code::RelayRunning);
        assert_eq!(CliError::from(edge_outbox::Error::Busy).code(), Code::Database);
        let url = edge_outbox::MqttConfig::from_url("http://x");
        assert!(matches!(url.map_err(CliError::from), Err(e) if e.code() == Code::Usage));
        assert_eq!(
            CliError::from(edge_outbox::Error::NotFound("dead letter 9".into())).code(),
            Code::NotFound
        );
    }
}
