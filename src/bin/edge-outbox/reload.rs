//! What a reload (SIGHUP) of `edge-outbox relay --config FILE` changes: the file re-read under the
//! same command line, compared setting by setting with what runs.
//!
//! A reload is applied by stopping the relay's threads cleanly and starting them again with the
//! new settings, in the same process, holding the same open database. That is the path every
//! restart already takes, which loses nothing (rows are marked only on PUBACK, and the new session
//! resumes from the oldest unacknowledged row), so pacing, expiry rules, batching, the broker
//! list, TLS files, certificates and credentials all change the same way, and the password and
//! certificate files are read again even when no setting names a new one. It costs a reconnect.
//!
//! Settings that name the store or the device's identity (the database, its busy timeout, the
//! client id, the source, trusted keys) and the log format need a new process: a WARN line names
//! each one that changed, and the running value stays.

use std::path::Path;

use edge_outbox::RelayConfig;
use toml::{Table, Value};

use crate::relay::{self, RelayArgs};
use crate::{Global, Result, config_file, db};

/// Re-reads the relay's settings: the config file under the command line's options.
pub type Reread<'a> = &'a dyn Fn() -> Result<(Global, RelayArgs)>;

/// Keys whose change needs a new process.
const NEEDS_RESTART: [&str; 7] = [
    "db",
    "busy-timeout",
    "client-id",
    "src",
    "trusted-key",
    "log-format",
    "app",
];

/// A reload that can be applied: the new settings, and what changed.
pub struct Plan {
    /// The settings to run with, restart-only ones as they were.
    pub args: RelayArgs,
    /// The relay's configuration built from them (files read, everything checked).
    pub config: RelayConfig,
    /// `key: old -> new`, one per setting that changed and will be applied.
    pub changes: Vec<String>,
}

/// The plan for a SIGHUP, or `None` (logged) when nothing is to be applied: no config file, a
/// file that no longer loads, or settings that no longer check.
pub fn plan(reread: Option<Reread<'_>>, global: &Global, db: &Path, running: &RelayArgs) -> Option<Plan> {
    let Some(reread) = reread else {
        tracing::warn!(target: "edge_outbox::cli", "SIGHUP: the relay runs without --config, so there is nothing to re-read; the running settings stay");
        return None;
    };
    let refused = |e: &dyn std::fmt::Display| {
        tracing::error!(target: "edge_outbox::cli", error = %e, "reload refused: the running settings stay");
    };
    let (new_global, mut args) = match reread() {
        Ok(read) => read,
        Err(e) => {
            refused(&e);
            return None;
        }
    };
    let new_db = db::path(&new_global).unwrap_or_else(|_| db.to_path_buf());
    let old = table(running, db, global.busy_timeout);
    let new = table(&args, &new_db, new_global.busy_timeout);
    let mut changes = Vec::new();
    for key in old.keys().chain(new.keys().filter(|k| !old.contains_key(*k))) {
        let (was, now) = (shown(old.get(key)), shown(new.get(key)));
        if was == now {
            continue;
        }
        if NEEDS_RESTART.contains(&key.as_str()) {
            tracing::warn!(target: "edge_outbox::cli", key = %key, running = %was, file = %now, "reload: this setting needs a restart; the running value stays");
        } else {
            changes.push(format!("{key}: {was} -> {now}"));
        }
    }
    keep_identity(&mut args, running);
    match relay::config(&args) {
        Ok(config) => Some(Plan {
            args,
            config,
            changes,
        }),
        Err(e) => {
            refused(&e);
            None
        }
    }
}

/// The settings as the config file would write them, secrets redacted.
fn table(args: &RelayArgs, db: &Path, busy_timeout: u64) -> Table {
    Table::try_from(config_file::effective(args, db, busy_timeout)).unwrap_or_default()
}

fn shown(value: Option<&Value>) -> String {
    value.map_or_else(|| "(unset)".to_owned(), Value::to_string)
}

/// The restart-only settings of `args` put back to the running ones.
fn keep_identity(args: &mut RelayArgs, running: &RelayArgs) {
    args.client_id.clone_from(&running.client_id);
    args.src.clone_from(&running.src);
    args.log_format = running.log_format;
    #[cfg(feature = "signed-commands")]
    args.trusted_key.clone_from(&running.trusted_key);
}
