//! Which of the test suite's outside parts this machine lacks, decided once, when the crate is
//! built: each missing part sets a `cfg` that marks the tests needing it `#[ignore = "why"]`, so
//! `cargo test` reports them as ignored, with the reason, in its normal output (and its summary
//! counts them), instead of letting them pass without having run.
//!
//! - `eo_skip_python`: no `python3` on PATH (the interoperability tests; the `cbor2` module they
//!   import is provisioned by the tests themselves, see tests/support/python.rs);
//! - `eo_skip_fuse`: no FUSE (`/dev/fuse`, and root or `fusermount3`), for the power-cut file system;
//! - `eo_skip_mount`: not root, so no tmpfs can be mounted (the read-only file system test);
//! - `eo_skip_mosquitto`: no mosquitto (PATH, /usr/sbin, /usr/local/sbin), for the few tests that
//!   need what only it has (ACL files, size limits); every other test runs on rumqttd as well.
//! - `eo_skip_rabbitmq`: no RabbitMQ server (Debian's `rabbitmq-server` package, with its `epmd`),
//!   for the broker-cluster test.
//!
//! `EDGE_OUTBOX_SKIP=python,fuse,mount,mosquitto,rabbitmq` skips parts on purpose (say, a machine with no package
//! index to fetch `cbor2` from). `EDGE_OUTBOX_REQUIRE_ALL=1` (CI) makes any missing or skipped
//! part a build error that names it. Only file-system probes run here: nothing is spawned or
//! fetched. After installing a missing part, `touch build.rs` (or `cargo clean -p edge-outbox`)
//! makes cargo look again.
//!
//! The probes run only in a build with the `failpoints` feature, the test suite's (`cargo test
//! --all-features`): an application that depends on this crate never enables it, so its builds,
//! cross builds included, run no probe and print nothing from here. A test run without that
//! feature ignores nothing: a test whose part is missing fails, naming it.

use std::path::{Path, PathBuf};

/// Every cfg a missing part can set.
const CFGS: [&str; 5] = [
    "eo_skip_python",
    "eo_skip_fuse",
    "eo_skip_mount",
    "eo_skip_mosquitto",
    "eo_skip_rabbitmq",
];

struct Part {
    /// The name `EDGE_OUTBOX_SKIP` uses.
    name: &'static str,
    cfg: &'static str,
    /// Why it is missing, if it is.
    missing: Option<String>,
}

fn main() {
    println!("cargo::rerun-if-changed=build.rs");
    for var in [
        "EDGE_OUTBOX_SKIP",
        "EDGE_OUTBOX_REQUIRE_ALL",
        "EDGE_OUTBOX_MOSQUITTO",
        "PATH",
    ] {
        println!("cargo::rerun-if-env-changed={var}");
    }
    for cfg in CFGS {
        println!("cargo::rustc-check-cfg=cfg({cfg})");
    }
    if std::env::var_os("CARGO_FEATURE_FAILPOINTS").is_none() {
        return;
    }
    let parts = [
        Part {
            name: "python",
            cfg: "eo_skip_python",
            missing: find_in_path("python3")
                .is_none()
                .then(|| "no python3 on PATH".to_owned()),
        },
        Part {
            name: "fuse",
            cfg: "eo_skip_fuse",
            missing: fuse_missing(),
        },
        Part {
            name: "mosquitto",
            cfg: "eo_skip_mosquitto",
            missing: mosquitto_missing(),
        },
        Part {
            name: "rabbitmq",
            cfg: "eo_skip_rabbitmq",
            missing: rabbitmq_missing(),
        },
        Part {
            name: "mount",
            cfg: "eo_skip_mount",
            missing: (!is_root()).then(|| "not root: no tmpfs can be mounted".to_owned()),
        },
    ];
    let asked: Vec<String> = std::env::var("EDGE_OUTBOX_SKIP")
        .unwrap_or_default()
        .split(',')
        .map(|s| s.trim().to_owned())
        .filter(|s| !s.is_empty())
        .collect();
    let require_all = std::env::var("EDGE_OUTBOX_REQUIRE_ALL").is_ok_and(|v| v == "1");
    let mut skipped = Vec::new();
    for part in &parts {
        let why = part.missing.clone().or_else(|| {
            asked
                .iter()
                .any(|a| a == part.name)
                .then(|| "EDGE_OUTBOX_SKIP names it".to_owned())
        });
        if let Some(why) = why {
            println!("cargo::rustc-cfg={}", part.cfg);
            println!("cargo::warning=tests needing `{}` are ignored: {why}", part.name);
            skipped.push(format!("{}: {why}", part.name));
        }
    }
    if require_all && !skipped.is_empty() {
        eprintln!(
            "EDGE_OUTBOX_REQUIRE_ALL=1, and tests would be ignored for lack of: {}",
            skipped.join("; ")
        );
        std::process::exit(1);
    }
}

fn fuse_missing() -> Option<String> {
    if !cfg!(target_os = "linux") {
        return Some("the power-cut file system needs Linux FUSE".into());
    }
    if !Path::new("/dev/fuse").exists() {
        return Some("/dev/fuse does not exist (no FUSE in this kernel or container)".into());
    }
    if !is_root() && find_in_path("fusermount3").is_none() && find_in_path("fusermount").is_none() {
        return Some("not root and no fusermount3 (Debian package fuse3) to mount as a user".into());
    }
    None
}

fn mosquitto_missing() -> Option<String> {
    // The same places tests/support/broker.rs looks.
    if std::env::var_os("EDGE_OUTBOX_MOSQUITTO").is_some_and(|p| !p.is_empty()) {
        return None;
    }
    let found = find_in_path("mosquitto").is_some()
        || ["/usr/sbin", "/usr/local/sbin", "/opt/homebrew/sbin"]
            .iter()
            .any(|d| Path::new(d).join("mosquitto").is_file());
    (!found).then(|| "mosquitto is not installed".to_owned())
}

fn rabbitmq_missing() -> Option<String> {
    // The paths tests/support/rabbit.rs starts.
    ["/usr/lib/rabbitmq/bin/rabbitmq-server", "/usr/bin/epmd"]
        .iter()
        .find(|p| !Path::new(p).is_file())
        .map(|p| format!("{p} is missing (Debian package rabbitmq-server)"))
}

fn is_root() -> bool {
    // Effective uid is the second field of `Uid:` in /proc/self/status (Linux; elsewhere: not root).
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| {
            s.lines()
                .find_map(|l| l.strip_prefix("Uid:"))
                .and_then(|l| l.split_whitespace().nth(1).map(|uid| uid == "0"))
        })
        .unwrap_or(false)
}

fn find_in_path(name: &str) -> Option<PathBuf> {
    let path = std::env::var_os("PATH")?;
    std::env::split_paths(&path)
        .map(|d| d.join(name))
        .find(|p| p.is_file())
}
