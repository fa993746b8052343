//! `edge-outbox package-assets DIR`: the packages' man pages and shell completions cover every
//! command and option the binary takes, and nothing it does not.
//!
//! Broken generators these catch: pages for the top-level command only (no page per subcommand,
//! or none for nested ones such as `dead-letters list`), completions or pages missing an option,
//! and the generator command documenting itself.

use std::collections::BTreeSet;
use std::path::Path;
use std::process::Command;

const BIN: &str = env!("CARGO_BIN_EXE_edge-outbox");

type TestResult = Result<(), Box<dyn std::error::Error>>;

/// `edge-outbox PATH... --help`.
fn help(path: &[&str]) -> Result<String, Box<dyn std::error::Error>> {
    let out = Command::new(BIN).args(path).arg("--help").output()?;
    assert!(out.status.success(), "{path:?} --help failed");
    Ok(String::from_utf8(out.stdout)?)
}

/// The subcommands a help text lists under "Commands:", without `help`.
fn subcommands(help: &str) -> Vec<String> {
    help.lines()
        .skip_while(|line| *line != "Commands:")
        .skip(1)
        .take_while(|line| line.starts_with("  "))
        .filter_map(|line| line.split_whitespace().next())
        .filter(|name| *name != "help")
        .map(str::to_owned)
        .collect()
}

/// The long options a help text lists (`--name`), without `--help` and `--version`.
fn long_options(help: &str) -> BTreeSet<String> {
    help.split(|c: char| !(c.is_ascii_alphanumeric() || c == '-'))
        .filter(|word| word.starts_with("--") && word.len() > 2)
        .filter(|word| !["--help", "--version"].contains(word))
        .map(str::to_owned)
        .collect()
}

/// Every command path the binary has: `[]`, `["relay"]`, `["dead-letters", "list"]`, ...
fn command_paths() -> Result<Vec<Vec<String>>, Box<dyn std::error::Error>> {
    let mut paths = vec![Vec::new()];
    let mut next = 0;
    while next < paths.len() {
        let path: Vec<String> = paths[next].clone();
        let words: Vec<&str> = path.iter().map(String::as_str).collect();
        for sub in subcommands(&help(&words)?) {
            let mut child = path.clone();
            child.push(sub);
            paths.push(child);
        }
        next += 1;
    }
    Ok(paths)
}

fn generate(dir: &Path) -> TestResult {
    let out = Command::new(BIN).arg("package-assets").arg(dir).output()?;
    assert!(
        out.status.success(),
        "package-assets failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    Ok(())
}

#[test]
fn a_man_page_per_command_naming_each_of_its_options() -> TestResult {
    let dir = tempfile::tempdir()?;
    generate(dir.path())?;
    let paths = command_paths()?;
    assert!(
        paths.iter().any(|p| p.len() == 2),
        "nested commands found: {paths:?}"
    );
    let mut expected = BTreeSet::new();
    for path in &paths {
        let name = std::iter::once("edge-outbox".to_owned())
            .chain(path.iter().cloned())
            .collect::<Vec<_>>()
            .join("-");
        let page_path = dir.path().join("man").join(format!("{name}.1"));
        let page = std::fs::read_to_string(&page_path)
            .map_err(|e| format!("no page {}: {e}", page_path.display()))?;
        let words: Vec<&str> = path.iter().map(String::as_str).collect();
        for option in long_options(&help(&words)?) {
            // roff escapes each hyphen.
            let roff = option.replace('-', "\\-");
            assert!(page.contains(&roff), "{name}.1 does not name {option}");
        }
        expected.insert(format!("{name}.1"));
    }
    let written: BTreeSet<String> = std::fs::read_dir(dir.path().join("man"))?
        .map(|entry| entry.map(|e| e.file_name().to_string_lossy().into_owned()))
        .collect::<Result<_, _>>()?;
    assert_eq!(written, expected, "one page per command, and no other");
    Ok(())
}

#[test]
fn completions_for_bash_zsh_and_fish_know_every_relay_option() -> TestResult {
    let dir = tempfile::tempdir()?;
    generate(dir.path())?;
    let options = long_options(&help(&["relay"])?);
    assert!(
        options.contains("--config") && options.len() > 20,
        "relay options read: {options:?}"
    );
    for file in ["bash/edge-outbox", "zsh/_edge-outbox", "fish/edge-outbox.fish"] {
        let text = std::fs::read_to_string(dir.path().join("completions").join(file))?;
        for option in &options {
            // fish names a long option without its dashes (`-l max-in-flight`).
            let bare = option.trim_start_matches('-');
            assert!(
                text.contains(option.as_str())
                    || (file.ends_with(".fish") && text.contains(&format!("-l {bare}"))),
                "{file} does not complete {option}"
            );
        }
        assert!(
            !text.contains("package-assets"),
            "{file} completes the generator itself"
        );
    }
    let bash = Command::new("bash")
        .arg("-n")
        .arg(dir.path().join("completions/bash/edge-outbox"))
        .status()?;
    assert!(bash.success(), "the bash completion is not valid bash");
    Ok(())
}

#[test]
fn a_bad_command_line_is_a_usage_error() -> TestResult {
    let none = Command::new(BIN).arg("package-assets").output()?;
    assert_eq!(none.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&none.stderr).contains("usage: edge-outbox package-assets DIR"));
    let two = Command::new(BIN).args(["package-assets", "a", "b"]).output()?;
    assert_eq!(two.status.code(), Some(2));
    Ok(())
}
