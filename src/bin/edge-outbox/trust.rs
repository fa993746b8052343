//! `edge-outbox trusted-keys set --trusted-key KEY_ID=FILE... | clear`: the explicit, logged change
//! of the keys a device requires its commands to be signed by (feature `signed-commands`), for
//! devices whose application is not written in Rust. `status` shows the current keys.

use clap::Subcommand;
use serde_json::json;

use crate::exit::CliError;
use crate::{Global, Result, db, output};

#[derive(Debug, Subcommand)]
pub enum TrustCommand {
    /// Require commands signed by exactly these keys from now on (replacing the ones the file
    /// trusted: key rotation), for every handle on the file. Logged.
    Set {
        /// KEY_ID=FILE, the file holding the Ed25519 public key as 64 hex digits (repeatable).
        #[arg(long = "trusted-key", value_name = "KEY_ID=FILE", required = true)]
        trusted_key: Vec<String>,
    },
    /// Stop requiring signed commands: anyone who can publish on the command topic can then
    /// command the device. Logged.
    Clear,
}

pub fn run(global: &Global, command: &TrustCommand) -> Result<()> {
    let path = db::path(global)?;
    match command {
        TrustCommand::Set { trusted_key } => {
            let keys = crate::trusted_keys::parse(trusted_key)?
                .ok_or_else(|| CliError::usage("trusted-keys set needs at least one --trusted-key"))?;
            let ids: Vec<String> = keys.key_ids().map(str::to_owned).collect();
            db::open_write(global, &path)?.require_signed_commands(keys)?;
            if global.json {
                output::print_json(&json!({ "required": true, "keys": ids }))
            } else {
                output::print(&format!(
                    "commands must now be signed by one of [{}]\n",
                    ids.join(", ")
                ))
            }
        }
        TrustCommand::Clear => {
            db::open_write(global, &path)?.stop_requiring_signed_commands()?;
            if global.json {
                output::print_json(&json!({ "required": false }))
            } else {
                output::print("commands are no longer required to be signed\n")
            }
        }
    }
}
