//! `edge-outbox demo` prints the first article's table from real processes: the dual-write rows
//! show the real failure, the outbox rows the real fix.
#![cfg(feature = "demo")]

use std::process::Command;

#[test]
fn the_demo_shows_the_dual_write_failures_and_the_outbox_fix() {
    let out = Command::new(env!("CARGO_BIN_EXE_edge-outbox"))
        .args(["demo", "--json"])
        .output()
        .expect("run the demo");
    assert!(
        out.status.success(),
        "demo failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let rows: serde_json::Value = serde_json::from_slice(&out.stdout).expect("JSON table");
    let row = |i: usize| {
        let r = &rows[i];
        (
            r["orders"].as_i64(),
            r["published"].as_i64(),
            r["delivered"].as_i64(),
            r["charges"].as_i64(),
        )
    };
    let some = |o, p, d, c| (Some(o), Some(p), Some(d), Some(c));
    // An order nobody hears about; a charge for an order that does not exist.
    assert_eq!(row(0), some(1, 0, 0, 0), "{rows}");
    assert_eq!(row(1), some(0, 1, 1, 1), "{rows}");
    // The relay crash publishes twice: two charges without dedupe, one with the inbox,
    // and still one after the broker redelivers everything.
    assert_eq!(row(2), some(1, 2, 2, 2), "{rows}");
    assert_eq!(row(3), some(1, 2, 2, 1), "{rows}");
    assert_eq!(row(4), some(1, 2, 4, 1), "{rows}");
}
