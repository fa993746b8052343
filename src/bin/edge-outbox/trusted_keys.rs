//! `edge-outbox relay --trusted-key KEY_ID=FILE`: the keys a device requires its commands to be
//! signed by (feature `signed-commands`).

use std::path::Path;

use edge_outbox::TrustedKeys;

use crate::Result;
use crate::exit::CliError;

/// The keys of every `--trusted-key KEY_ID=FILE`, each file holding one Ed25519 public key as 64
/// hex digits (whitespace around it ignored); `None` when none was given.
pub fn parse(args: &[String]) -> Result<Option<TrustedKeys>> {
    if args.is_empty() {
        return Ok(None);
    }
    let mut keys = TrustedKeys::new();
    for arg in args {
        let (id, file) = arg.split_once('=').ok_or_else(|| {
            CliError::usage(format!(
                "--trusted-key {arg:?}: expected KEY_ID=FILE, e.g. cloud-2026=/etc/device/cloud-2026.pub"
            ))
        })?;
        if id.is_empty() {
            return Err(CliError::usage(format!(
                "--trusted-key {arg:?}: the key id is empty"
            )));
        }
        keys = keys.key(id, read_key(Path::new(file))?);
    }
    Ok(Some(keys))
}

fn read_key(file: &Path) -> Result<[u8; 32]> {
    let text = std::fs::read_to_string(file)
        .map_err(|e| CliError::usage(format!("--trusted-key: cannot read {}: {e}", file.display())))?;
    let hex = text.trim();
    let bad = || {
        CliError::usage(format!(
            "--trusted-key: {} does not hold an Ed25519 public key as 64 hex digits",
            file.display()
        ))
    };
    if hex.len() != 64 || !hex.is_ascii() {
        return Err(bad());
    }
    let mut key = [0u8; 32];
    for (i, byte) in key.iter_mut().enumerate() {
        *byte = u8::from_str_radix(&hex[2 * i..2 * i + 2], 16).map_err(|_| bad())?;
    }
    Ok(key)
}
