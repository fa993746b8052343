//! `edge-outbox config check FILE [RELAY OPTIONS]`: checks a relay config file as `relay --config`
//! would (its keys, then the broker URLs, TLS, password and key files they name) and prints the
//! settings the relay would run with, every default written out and secrets redacted. Opens no
//! database and no connection.

use std::io::Write as _;

use crate::config_file;
use crate::exit::CliError;
use crate::relay::{self, RelayArgs};
use crate::{Global, Result, db, output};

pub fn run(global: &Global, args: &RelayArgs) -> Result<()> {
    let _checked = relay::config(args)?;
    #[cfg(feature = "signed-commands")]
    crate::trusted_keys::parse(&args.trusted_key)?;
    let path = db::path(global)?;
    let settings = config_file::effective(args, &path, global.busy_timeout);
    if global.json {
        let value = serde_json::to_value(&settings)
            .map_err(|e| CliError::runtime(format!("formatting the settings: {e}")))?;
        return output::print_json(&value);
    }
    let text =
        toml::to_string(&settings).map_err(|e| CliError::runtime(format!("formatting the settings: {e}")))?;
    let mut out = std::io::stdout().lock();
    writeln!(out, "# the relay's effective settings (secrets redacted)")
        .and_then(|()| out.write_all(text.as_bytes()))
        .map_err(|e| CliError::output(&e))
}
