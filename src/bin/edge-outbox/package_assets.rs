//! `edge-outbox package-assets DIR` (feature `package-assets`): the man pages and shell
//! completions the .deb packages install, generated from the command line's own definitions so
//! that they describe exactly the options this build takes.
//!
//! It is read before clap parses, and is no subcommand of `Cli`: the pages and completions then
//! describe the packaged binary's commands and nothing else (the generators list hidden
//! subcommands too).
//!
//! Run it from a build with the same features as the packaged binary (`cli` and this one): a
//! command that only another feature adds would otherwise be documented but missing.

use std::fs;
use std::path::{Path, PathBuf};
use std::process::ExitCode;

use clap::Command;
use clap_complete::Shell;

use crate::Result;
use crate::exit::CliError;

/// The shells whose completion directories Debian's packages of them read, with the file name
/// each expects.
const SHELLS: [(Shell, &str); 3] = [
    (Shell::Bash, "edge-outbox"),
    (Shell::Zsh, "_edge-outbox"),
    (Shell::Fish, "edge-outbox.fish"),
];

/// `Some(exit code)` if the command line is `package-assets DIR`, after writing the assets.
pub fn intercept(command: Command) -> Option<ExitCode> {
    let mut args = std::env::args_os().skip(1);
    if args.next()? != "package-assets" {
        return None;
    }
    let result = match (args.next(), args.next()) {
        (Some(dir), None) => run(command, &PathBuf::from(dir)),
        _ => Err(CliError::usage("usage: edge-outbox package-assets DIR")),
    };
    Some(match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => e.report(),
    })
}

/// Writes `DIR/man/edge-outbox*.1` (one page per visible command, as `git` has) and
/// `DIR/completions/{bash,zsh,fish}/NAME`.
fn run(command: Command, dir: &Path) -> Result<()> {
    let failed = |what: &str, path: &Path, e: std::io::Error| {
        CliError::runtime(format!("package-assets: {what} {}: {e}", path.display()))
    };
    let man = dir.join("man");
    fs::create_dir_all(&man).map_err(|e| failed("cannot create", &man, e))?;
    clap_mangen::generate_to(command.clone(), &man).map_err(|e| failed("cannot write into", &man, e))?;
    for (shell, name) in SHELLS {
        let folder = dir.join("completions").join(shell.to_string());
        fs::create_dir_all(&folder).map_err(|e| failed("cannot create", &folder, e))?;
        let path = folder.join(name);
        let mut file = fs::File::create(&path).map_err(|e| failed("cannot create", &path, e))?;
        clap_complete::generate(shell, &mut command.clone(), "edge-outbox", &mut file);
    }
    Ok(())
}
