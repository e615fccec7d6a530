//! Exponential backoff with jitter, bounded by a deadline rather than by a number of attempts.

use std::time::Duration;

use backon::{BackoffBuilder, ExponentialBuilder};
use tokio::time::Instant;

/// First retry delay. Short, because the first retry usually goes to another node, which can
/// forward at once.
pub const BACKOFF_MIN: Duration = Duration::from_millis(50);

/// Longest delay between two attempts: long enough not to hammer a cluster that is electing a
/// leader, short enough to notice a new leader within about a second.
pub const BACKOFF_MAX: Duration = Duration::from_secs(1);

/// Growth factor of the delay between attempts.
pub const BACKOFF_FACTOR: f32 = 2.0;

/// Delays between attempts of one logical call: BACKOFF_MIN doubling up to BACKOFF_MAX, each plus
/// a random jitter of up to the delay itself, so that clients failed over together spread out.
/// Never ends: the caller's deadline, not a count, stops the retries.
pub fn backoff() -> impl Iterator<Item = Duration> + Send {
    ExponentialBuilder::default()
        .with_min_delay(BACKOFF_MIN)
        .with_max_delay(BACKOFF_MAX)
        .with_factor(BACKOFF_FACTOR)
        .with_jitter()
        .without_max_times()
        .build()
}

/// The delay before the next attempt, or `None` when sleeping it would leave no time for an
/// attempt before `deadline`.
pub fn next_delay(
    backoff: &mut impl Iterator<Item = Duration>,
    now: Instant,
    deadline: Instant,
) -> Option<Duration> {
    let delay = backoff.next()?;
    if now + delay >= deadline {
        return None;
    }
    Some(delay)
}

/// Time left until `deadline`, zero once it has passed.
pub fn remaining(now: Instant, deadline: Instant) -> Duration {
    deadline.saturating_duration_since(now)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn backoff_grows_with_jitter_and_is_capped() {
        let delays: Vec<Duration> = backoff().take(12).collect();
        assert_eq!(delays.len(), 12, "backoff must not run out on its own");
        // Each delay is the base delay plus up to 100 % jitter.
        let mut base = BACKOFF_MIN;
        for d in &delays {
            assert!(
                *d >= base && *d <= base * 2,
                "{d:?} outside [{base:?}, {:?}]",
                base * 2
            );
            base = (base * 2).min(BACKOFF_MAX);
        }
        assert!(delays.iter().all(|d| *d <= BACKOFF_MAX * 2));
    }

    #[test]
    fn jitter_differs_between_clients() {
        // Two independent sequences of 8 jittered delays being identical has negligible probability.
        let a: Vec<Duration> = backoff().take(8).collect();
        let b: Vec<Duration> = backoff().take(8).collect();
        assert_ne!(a, b);
    }

    #[test]
    fn next_delay_stops_at_the_deadline() {
        let now = Instant::now();
        let mut b = backoff();
        assert!(next_delay(&mut b, now, now + Duration::from_secs(10)).is_some());
        let mut b = backoff();
        assert_eq!(
            next_delay(&mut b, now, now + Duration::from_millis(40)),
            None
        );
        assert_eq!(next_delay(&mut b, now, now), None);
        assert_eq!(remaining(now + Duration::from_secs(1), now), Duration::ZERO);
        assert_eq!(
            remaining(now, now + Duration::from_secs(1)),
            Duration::from_secs(1)
        );
    }
}
