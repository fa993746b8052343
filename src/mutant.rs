//! Deliberately broken builds, to prove the tests catch what they claim to (feature `mutants`;
//! never in production). `EDGE_OUTBOX_MUTANT=<name>` switches one on; each breaks one guarantee,
//! and `cargo test --all-features --test crash` must fail with it (its own last scenario runs the
//! harness against each and fails if one survives). See docs/reliability.md.
//!
//! Without the feature, [`active`] is a constant `false` and every mutant compiles away.

/// Every mutant name.
pub const MUTANTS: &[&str] = &[
    // Rows are marked when handed to the MQTT client, not on their PUBACK.
    "mark-before-puback",
    // After a reconnect, publishing resumes after the last row sent, not at the oldest
    // unacknowledged one.
    "skip-resume",
    // A command is acknowledged to the broker before its inbox row commits.
    "ack-before-commit",
    // The apply step ignores the `applied_at IS NULL` guard.
    "double-apply",
    // Rows of a key are published out of commit order.
    "reorder",
    // Coalescing rows are published without being claimed, so a newer value replaces one that is
    // on the wire (it is delivered and announced coalesced).
    "skip-claim",
];

/// Mutants of guarantees that the crash harness's scenarios do not exercise, each with the
/// regression test (`tests/<file>.rs`) that must fail with it switched on; that file runs its
/// scenario again under the mutant and fails if it survives. They are not in [`MUTANTS`]: the
/// crash harness is not expected to catch them.
pub const TEST_MUTANTS: &[(&str, &str)] = &[
    // A publish packed and held back by the pace goes out without its expiry checked again.
    ("skip-expiry-held-back", "expiry_held_back"),
    // Salvage records a lost range in one gap row, ignored when a gap row has its first number.
    ("salvage-gap-ignored", "salvage_gap_collision"),
    // A salvage's unrecoverable range covers numbers kept as acknowledged in `outbox_sent`.
    ("salvage-covers-sent", "salvage_sent_numbers"),
    // A salvage that renumbers the pending messages (the epochs unreadable) copies the gap rows
    // with their old numbers, which then name renumbered messages.
    ("salvage-renumbered-gaps-kept", "salvage_unreadable_epochs"),
    // The consumer takes a number at or below its horizon (a gap given up on past `max_gaps`) as
    // seen, and ignores a notice there.
    ("consumer-forgotten-seen", "consumer_bounds"),
    // Opening a store skips the check of its counter against what was published from its path,
    // so a backup restored in place keeps its epoch.
    ("skip-published-check", "epochs_restored_in_place"),
    // Eviction at a storage limit and the store's expiry remove rows the relay has claimed.
    ("remove-claimed", "claimed_rows_kept"),
];

/// The scenarios that can see mutant `name`, when only some can (a filter on scenario names);
/// `None`: all of them run.
pub fn scenarios_for(name: &str) -> Option<&'static str> {
    match name {
        "skip-claim" => Some("lanes"),
        _ => None,
    }
}

/// Whether the mutant `name` is switched on.
#[cfg(feature = "mutants")]
pub fn active(name: &str) -> bool {
    use std::sync::OnceLock;
    static ACTIVE: OnceLock<Option<String>> = OnceLock::new();
    ACTIVE
        .get_or_init(|| std::env::var("EDGE_OUTBOX_MUTANT").ok().filter(|m| !m.is_empty()))
        .as_deref()
        == Some(name)
}

/// Without the `mutants` feature nothing is broken.
#[cfg(not(feature = "mutants"))]
#[inline(always)]
pub const fn active(_name: &str) -> bool {
    false
}
