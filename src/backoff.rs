//! Capped, jittered exponential backoff for reconnects: fast first retries for a blip, at most
//! one attempt per cap when a service stays away, and jitter so several relays don't retry in
//! lockstep.

use rand::Rng;
use std::time::Duration;

#[derive(Debug, Clone)]
pub(crate) struct Backoff {
    next: Duration,
    min: Duration,
    max: Duration,
}

impl Backoff {
    pub(crate) fn new(min: Duration, max: Duration) -> Self {
        Backoff {
            next: min,
            min,
            max,
        }
    }

    /// The broker and database default: 100 ms doubling to 30 s. (The relay's loops use it;
    /// the consumer kit paces itself with its own bounds.)
    #[cfg(feature = "relay")]
    pub(crate) fn standard() -> Self {
        Self::new(Duration::from_millis(100), Duration::from_secs(30))
    }

    /// The next delay: uniformly jittered between half and all of the current step.
    pub(crate) fn next_delay(&mut self) -> Duration {
        let step = self.next;
        self.next = (self.next * 2).min(self.max);
        let half = step / 2;
        let jitter = rand::rng().random_range(0..=half.as_micros() as u64);
        half + Duration::from_micros(jitter)
    }

    pub(crate) fn reset(&mut self) {
        self.next = self.min;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn grows_to_the_cap_with_jitter_inside_the_step() {
        let mut b = Backoff::new(Duration::from_millis(100), Duration::from_secs(1));
        let d: Vec<_> = (0..8).map(|_| b.next_delay()).collect();
        assert!(d[0] >= Duration::from_millis(50) && d[0] <= Duration::from_millis(100));
        assert!(d[7] >= Duration::from_millis(500) && d[7] <= Duration::from_secs(1));
        b.reset();
        assert!(b.next_delay() <= Duration::from_millis(100));
    }
}
