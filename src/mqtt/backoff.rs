//! Exponential backoff with jitter between connection attempts.

use std::time::{Duration, SystemTime, UNIX_EPOCH};

/// Doubles from `min` to `max`; each wait is drawn uniformly from its upper half ("equal
/// jitter"), so a fleet that lost its broker at once does not reconnect in lockstep.
#[derive(Debug, Clone)]
pub(crate) struct Backoff {
    min: Duration,
    max: Duration,
    failures: u32,
    rng: u64,
}

impl Backoff {
    pub(crate) fn new(min: Duration, max: Duration) -> Self {
        let seed = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos() as u64)
            ^ u64::from(std::process::id()).rotate_left(32);
        Backoff {
            min,
            max: max.max(min),
            failures: 0,
            rng: seed | 1,
        }
    }

    /// The wait before the next attempt.
    pub(crate) fn next_delay(&mut self) -> Duration {
        let ceiling = self
            .min
            .saturating_mul(1u32 << self.failures.min(20))
            .min(self.max);
        self.failures = self.failures.saturating_add(1);
        let half = ceiling / 2;
        half + half.mul_f64(self.unit())
    }

    /// A successful connection: the next failure waits `min` again.
    pub(crate) fn reset(&mut self) {
        self.failures = 0;
    }

    /// xorshift64*: jitter needs spread, not secrecy.
    fn unit(&mut self) -> f64 {
        self.rng ^= self.rng >> 12;
        self.rng ^= self.rng << 25;
        self.rng ^= self.rng >> 27;
        (self.rng.wrapping_mul(0x2545_f491_4f6c_dd1d) >> 11) as f64 / (1u64 << 53) as f64
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn grows_to_the_cap_within_jitter_bounds_and_resets() {
        let (min, max) = (Duration::from_millis(100), Duration::from_secs(2));
        let mut b = Backoff::new(min, max);
        let mut ceiling = min;
        for _ in 0..10 {
            let d = b.next_delay();
            assert!(
                d >= ceiling / 2 && d <= ceiling,
                "{d:?} outside [{:?}, {ceiling:?}]",
                ceiling / 2
            );
            ceiling = (ceiling * 2).min(max);
        }
        b.reset();
        assert!(b.next_delay() <= min);
    }

    #[test]
    fn jitter_spreads() {
        let mut b = Backoff::new(Duration::from_secs(1), Duration::from_secs(1));
        let draws: std::collections::HashSet<_> = (0..20).map(|_| b.next_delay()).collect();
        assert!(draws.len() > 10);
    }

    #[test]
    fn a_relay_at_its_default_cap_tries_again_within_10_s() {
        let config = crate::RelayConfig::new(crate::MqttConfig::new("127.0.0.1", 1883));
        let mut b = Backoff::new(config.backoff_min, config.backoff_max);
        let waits: Vec<Duration> = (0..40).map(|_| b.next_delay()).collect();
        let longest = waits.iter().max().copied().unwrap_or_default();
        assert!(longest <= Duration::from_secs(10), "{longest:?}");
        assert!(
            longest >= Duration::from_secs(5),
            "the cap is reached: {longest:?}"
        );
    }
}
