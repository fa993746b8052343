//! What both benchmarks need: a wall-clock timestamp and a cheap deterministic generator.
//! `mod common;` from `benches/*.rs`; each benchmark adds the draws it needs with its own `impl`.

use std::time::{SystemTime, UNIX_EPOCH};

/// Milliseconds since the Unix epoch, as the crate stamps rows and envelopes.
pub fn now_ms() -> i64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as i64)
}

/// splitmix64: the cheapest way to random-looking numbers, reproducible from the seed.
pub struct Rng(pub u64);

impl Rng {
    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }
}
