//! Python for the interoperability tests: an interpreter that can `import cbor2` and
//! `prometheus_client` (the metrics test parses the crate's output with it), provisioned the way
//! cargo provisions crates. The `python3` on PATH is used when it has both; otherwise a
//! virtualenv under the target dir (`target/tmp/python-venv`) is made once, with both from the
//! package index, and reused by every later run.
//!
//! Tests that need Python are ignored at build time where there is no `python3` at all (see
//! build.rs). Where there is one, failing to provision `cbor2` fails the test with the reason;
//! `EDGE_OUTBOX_SKIP=python` skips these tests on purpose, say on a machine without the index.

use std::fs::File;
use std::io;
use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use std::sync::OnceLock;

/// The versions the interoperability scripts are tested with.
const CBOR2: &str = "cbor2==5.6.5";
const PROMETHEUS_CLIENT: &str = "prometheus_client==0.26.0";

/// An interpreter with `cbor2` and `prometheus_client`; panics with what went wrong when none can
/// be had.
pub fn python() -> PathBuf {
    static PYTHON: OnceLock<Result<PathBuf, String>> = OnceLock::new();
    PYTHON
        .get_or_init(|| provision().map_err(|e| e.to_string()))
        .clone()
        .unwrap_or_else(|e| {
            panic!(
                "no Python with cbor2 and prometheus_client: {e} (EDGE_OUTBOX_SKIP=python ignores the \
                 tests that need it)"
            )
        })
}

/// Runs `script` (a path from the crate root) with `args`; returns its stdout, or an error with
/// its stderr when it fails.
pub fn run_script(script: &str, args: &[&str]) -> io::Result<String> {
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join(script);
    let out = Command::new(python()).arg(&path).args(args).output()?;
    let stderr = String::from_utf8_lossy(&out.stderr);
    if !out.status.success() {
        return Err(io::Error::other(format!(
            "{script} failed ({}):\n{stderr}",
            out.status
        )));
    }
    if !stderr.trim().is_empty() {
        eprintln!("{script} stderr:\n{stderr}");
    }
    String::from_utf8(out.stdout).map_err(|e| io::Error::other(format!("{script}: {e}")))
}

fn provision() -> io::Result<PathBuf> {
    let system = PathBuf::from("python3");
    if has_modules(&system) {
        return Ok(system);
    }
    let venv = Path::new(env!("CARGO_TARGET_TMPDIR")).join("python-venv");
    std::fs::create_dir_all(env!("CARGO_TARGET_TMPDIR"))?;
    // Test binaries run one after another, but tests within one run in parallel threads, and a
    // developer may run two suites at once: one provisions, the others wait and reuse it.
    let lock = File::create(venv.with_extension("lock"))?;
    lock.lock()?;
    let python = venv.join("bin/python3");
    if has_modules(&python) {
        return Ok(python);
    }
    eprintln!(
        "support: python3 lacks cbor2 or prometheus_client; making {} with {CBOR2} and {PROMETHEUS_CLIENT}",
        venv.display()
    );
    checked(
        Command::new(&system)
            .arg("-m")
            .arg("venv")
            .arg("--clear")
            .arg(&venv)
            .output(),
        "python3 -m venv (Debian: apt install python3-venv)",
    )?;
    checked(
        Command::new(&python)
            .args([
                "-m",
                "pip",
                "install",
                "--quiet",
                "--disable-pip-version-check",
                CBOR2,
                PROMETHEUS_CLIENT,
            ])
            .output(),
        &format!("pip install {CBOR2} {PROMETHEUS_CLIENT} into {}", venv.display()),
    )?;
    if !has_modules(&python) {
        return Err(io::Error::other(format!(
            "{} still cannot import cbor2 and prometheus_client",
            python.display()
        )));
    }
    Ok(python)
}

fn has_modules(python: &Path) -> bool {
    Command::new(python)
        .args(["-c", "import cbor2, prometheus_client"])
        .output()
        .is_ok_and(|o| o.status.success())
}

fn checked(out: io::Result<Output>, what: &str) -> io::Result<()> {
    let out = out.map_err(|e| io::Error::new(e.kind(), format!("{what}: {e}")))?;
    if out.status.success() {
        return Ok(());
    }
    Err(io::Error::other(format!(
        "{what}: {}\n{}",
        out.status,
        String::from_utf8_lossy(&out.stderr)
    )))
}
