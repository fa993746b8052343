//! Paced replay: a token bucket on messages and bytes per second, so that draining a long
//! outage's backlog does not saturate a metered link (`RelayConfig::pace`).
//!
//! The bucket holds a tenth of a second's worth (at least one message, and at least the message
//! at hand): enough to keep the window busy between refills, too little to send a visible burst
//! after an idle spell.

use std::time::{Duration, Instant};

pub(crate) use crate::relay_config::PaceRates as Rates;

/// What fraction of a second's rate the bucket can hold.
const BURST_SECONDS: f64 = 0.1;

#[derive(Debug)]
pub(crate) struct Pacer {
    rates: Rates,
    /// The rates as floats: messages, bytes per second.
    per_second: (Option<f64>, Option<f64>),
    messages: f64,
    bytes: f64,
    refilled: Instant,
}

impl Pacer {
    pub(crate) fn new(rates: Rates) -> Self {
        let mut p = Pacer {
            rates,
            per_second: (rates.messages.map(f64::from), rates.bytes.map(|b| b as f64)),
            messages: 0.0,
            bytes: 0.0,
            refilled: Instant::now(),
        };
        p.messages = p.message_capacity();
        p.bytes = p.byte_capacity(0);
        p
    }

    fn message_capacity(&self) -> f64 {
        self.per_second
            .0
            .map_or(f64::INFINITY, |r| (r * BURST_SECONDS).max(1.0))
    }

    fn byte_capacity(&self, size: usize) -> f64 {
        self.per_second
            .1
            .map_or(f64::INFINITY, |r| (r * BURST_SECONDS).max(size as f64))
    }

    fn refill(&mut self, now: Instant, size: usize) {
        let elapsed = now.saturating_duration_since(self.refilled).as_secs_f64();
        self.refilled = now;
        if let Some(r) = self.per_second.0 {
            self.messages = (self.messages + r * elapsed).min(self.message_capacity());
        }
        if let Some(r) = self.per_second.1 {
            self.bytes = (self.bytes + r * elapsed).min(self.byte_capacity(size));
        }
    }

    /// Takes the tokens for one message of `size` bytes, or says when they will be there.
    pub(crate) fn take(&mut self, size: usize, now: Instant) -> Result<(), Instant> {
        if self.rates.is_off() || crate::mutant::active("pace-ignored") {
            return Ok(());
        }
        self.refill(now, size);
        let mut wait: f64 = 0.0;
        if let Some(r) = self.per_second.0
            && self.messages < 1.0
        {
            wait = wait.max((1.0 - self.messages) / r);
        }
        if let Some(r) = self.per_second.1
            && self.bytes < size as f64
        {
            wait = wait.max((size as f64 - self.bytes) / r);
        }
        if wait > 0.0 {
            return Err(now + Duration::from_secs_f64(wait.min(3600.0)));
        }
        if self.rates.messages.is_some() {
            self.messages -= 1.0;
        }
        if self.rates.bytes.is_some() {
            self.bytes -= size as f64;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// How many messages of `size` the bucket lets through in `secs` simulated seconds, taking
    /// each as soon as it is allowed.
    fn sent_in(rates: Rates, size: usize, secs: f64) -> usize {
        let start = Instant::now();
        let mut p = Pacer::new(rates);
        p.refilled = start;
        let end = start + Duration::from_secs_f64(secs);
        let (mut now, mut sent) = (start, 0);
        while now < end {
            match p.take(size, now) {
                Ok(()) => sent += 1,
                Err(at) => now = at,
            }
        }
        sent
    }

    #[test]
    fn the_message_rate_holds_over_time() {
        let rates = Rates {
            messages: Some(200),
            bytes: None,
        };
        let sent = sent_in(rates, 100, 10.0);
        // The rate times the time, plus the bucket's initial fill.
        assert!((2000..=2021).contains(&sent), "{sent}");
    }

    #[test]
    fn the_byte_rate_holds_and_a_message_above_the_burst_still_goes() {
        let rates = Rates {
            messages: None,
            bytes: Some(10_000),
        };
        let small = sent_in(rates, 100, 10.0);
        assert!((1000..=1011).contains(&small), "{small}");
        // 5,000 bytes is above a tenth of a second's 1,000: it goes, once the time is paid.
        let big = sent_in(rates, 5_000, 10.0);
        assert!((19..=21).contains(&big), "{big}");
    }

    #[test]
    fn no_rates_means_no_waiting() {
        let mut p = Pacer::new(Rates::default());
        for _ in 0..10_000 {
            assert!(p.take(1_000_000, Instant::now()).is_ok());
        }
    }
}
