//! Any bytes on any topic arriving as a command: `receive` stores, recognises a duplicate or
//! dead-letters with a reason; it never panics and never loses the bytes; and applying what was
//! stored never panics either.
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
            let _ = outbox.apply_next(|_tx, cmd| cmd.payload_as::<u64>().map(drop));
        }
        Received::Duplicate(_) => {}
        Received::DeadLettered { reason, .. } => {
            assert!(!reason.is_empty());
            assert_eq!(outbox.stats().expect("stats").dead_letters, before.dead_letters + 1);
        }
        _ => {}
    }
});
