//! Named crash points for the crash-consistency tests, compiled in only with the `failpoints`
//! feature. A failpoint aborts the process (no destructors, no flushes), as a power cut to the
//! program would; the kernel still writes out what SQLite handed it, so this models a process
//! crash, not a machine one (see docs/reliability.md for the power-loss tests).
//!
//! `EDGE_OUTBOX_FAILPOINT=name` aborts at the first hit of `name`; `name:N` at the N-th;
//! `name:N:panic` panics the hitting thread instead (a bug in one relay thread, which the rest of
//! the process must notice); `name:N:hang` stops the hitting thread for good, alive and doing
//! nothing (a deadlock, or a system call that never returns: what a watchdog is for).

/// Every failpoint name, so a test can check it named one that exists.
pub const FAILPOINTS: &[&str] = &[
    // Hit by the crash harness's device itself, right after it has said a commit returned.
    "after-commit-returned",
    "after-publish-before-puback",
    "after-puback-before-mark",
    "mid-mark",
    "command-stored-before-ack",
    "command-acked",
    "effect-committed",
    "handler-mid-effect",
    "attempt-claimed",
    "relay-loop",
];

/// Aborts the process if `name` is the armed failpoint and this is the armed hit.
#[cfg(feature = "failpoints")]
pub fn hit(name: &str) {
    use std::sync::OnceLock;
    use std::sync::atomic::{AtomicU64, Ordering};
    static ARMED: OnceLock<Option<(String, u64, Option<String>)>> = OnceLock::new();
    static HITS: AtomicU64 = AtomicU64::new(0);
    let armed = ARMED.get_or_init(|| {
        let spec = std::env::var("EDGE_OUTBOX_FAILPOINT").ok()?;
        let mut parts = spec.split(':');
        let name = parts.next()?.to_owned();
        let nth: u64 = parts.next().and_then(|k| k.parse().ok()).unwrap_or(1);
        let action = parts.next().map(str::to_owned);
        Some((name, nth.max(1), action))
    });
    if let Some((armed, nth, action)) = armed
        && armed == name
        && HITS.fetch_add(1, Ordering::SeqCst) + 1 == *nth
    {
        match action.as_deref() {
            Some("panic") => {
                #[allow(clippy::panic, reason = "a panic is what this failpoint injects")]
                {
                    panic!("failpoint {name} hit");
                }
            }
            Some("hang") => {
                eprintln!("edge-outbox: failpoint {name} hit: this thread hangs");
                loop {
                    std::thread::park();
                }
            }
            _ => {}
        }
        eprintln!("edge-outbox: failpoint {name} hit: aborting");
        std::process::abort();
    }
}

/// Without the `failpoints` feature a failpoint compiles to nothing.
#[cfg(not(feature = "failpoints"))]
#[inline(always)]
pub fn hit(_name: &str) {}

/// Moves the wall clock edge-outbox reads in this process by `ms` (negative: back), as an NTP
/// step or an RTC-less board's first sync would (feature `failpoints`). Monotonic clocks, and
/// SQLite's own column defaults, are not moved.
#[cfg(feature = "failpoints")]
pub fn shift_wall_clock(ms: i64) {
    crate::time::shift::by(ms);
}
