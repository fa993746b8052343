//! Any bytes on any topic arriving as a command: `receive` stores, recognises a duplicate or
//! dead-letters with a reason; it never panics and never loses the bytes, except the oldest
//! refusal once refusals are at their cap, which is counted; and applying what was stored never
//! panics either. The corpus holds valid envelopes with ids
//! (`valid-envelope-*`), so mutations start from inputs that reach the apply path.
#![no_main]

use std::sync::OnceLock;

use edge_outbox::{Outbox, Received};
use libfuzzer_sys::fuzz_target;

fn store() -> &'static Outbox {
    static STORE: OnceLock<(tempfile::TempDir, Outbox)> = OnceLock::new();
    &STORE
        .get_or_init(|| {
            let dir = tempfile::tempdir().expect("tempdir");
            let options = edge_outbox::Options::new().synchronous(edge_outbox::Synchronous::Normal);
            let outbox = Outbox::open_with(dir.path().join("fuzz.db"), options).expect("open");
            (dir, outbox)
        })
        .1
}

fuzz_target!(|input: (String, Vec<u8>)| {
    let (topic, bytes) = input;
    let outbox = store();
    let before = outbox.stats().expect("stats");
    match outbox.receive(&topic, &bytes).expect("receive never fails on input") {
        Received::Stored(_) => {
            assert_eq!(outbox.stats().expect("stats").inbox_unapplied, before.inbox_unapplied + 1);
            // Claim, act (a payload that is not a u64 is rejected for good), record.
            let _ = outbox.apply_next_two_phase(
                |cmd| cmd.payload_as::<u64>(),
                |_tx, _cmd, _n| Ok::<_, edge_outbox::Error>(()),
            );
        }
        Received::Duplicate(_) => {}
        Received::DeadLettered { reason, .. } => {
            assert!(!reason.is_empty());
            // Kept, or kept in place of the oldest refusal once refusals are at their cap (an
            // eviction counted, never a silent drop).
            let after = outbox.stats().expect("stats");
            assert_eq!(
                after.dead_letters + after.refusals_evicted,
                before.dead_letters + before.refusals_evicted + 1
            );
        }
        _ => {}
    }
});
