//! A granted lease and the arithmetic of its local deadline.
//!
//! The cluster decides when a lease expires, on the leader's clock, starting no earlier than the
//! moment the leader received the request. The client cannot read that clock, but it knows when it
//! sent the request: the lease cannot expire before `send time + ttl` (clock-rate differences
//! aside). So the client treats the lease as valid until `send time + ttl − safety margin` on its
//! own monotonic clock, and never uses `expires_at_unix_ms`, which would mix two wall clocks.

use std::fmt;
use std::time::Duration;

use lockd_fence::FencingToken;
use tokio::time::Instant;

use crate::config::{SAFETY_MARGIN_MIN, SAFETY_MARGIN_TTL_DIVISOR};
use crate::request_id::RequestId;

/// Number of leading characters of a lease id shown in messages and `Debug`: enough to tell two
/// leases apart in a log, far too few to guess the rest (lease ids are secrets: whoever knows one can
/// renew or release the lease).
pub const LEASE_ID_SHOWN_CHARS: usize = 8;

/// The unguessable id of one lease, needed for `Renew` and `Release`. `Debug` shows only its start.
#[derive(Clone, PartialEq, Eq, Hash)]
pub struct LeaseId(String);

impl LeaseId {
    /// Wraps a lease id the cluster issued (e.g. one given to `lockctl renew`).
    pub fn new(id: impl Into<String>) -> Self {
        LeaseId(id.into())
    }

    /// The full id, e.g. to print it for `lockctl renew`.
    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl fmt::Debug for LeaseId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "LeaseId({})", abbreviate(&self.0))
    }
}

/// `0123abcd…` for messages: the first [`LEASE_ID_SHOWN_CHARS`] characters.
pub fn abbreviate(lease_id: &str) -> String {
    match lease_id.char_indices().nth(LEASE_ID_SHOWN_CHARS) {
        Some((cut, _)) => format!("{}…", &lease_id[..cut]),
        None => lease_id.to_owned(),
    }
}

/// The margin subtracted from a lease's deadline when the caller sets none:
/// max(ttl / 10, 250 ms), but never more than half the ttl.
pub fn default_safety_margin(ttl: Duration) -> Duration {
    (ttl / SAFETY_MARGIN_TTL_DIVISOR)
        .max(SAFETY_MARGIN_MIN)
        .min(ttl / 2)
}

/// The local deadline of a lease whose latest grant or renewal was sent at `sent_at`.
pub fn local_deadline(sent_at: Instant, ttl: Duration, margin: Duration) -> Instant {
    sent_at + ttl.saturating_sub(margin)
}

/// A lease as `Acquire` returned it.
#[derive(Clone, Debug)]
pub struct Lease {
    /// The locked resource, as sent.
    pub resource: String,
    /// The secret that `Renew` and `Release` need.
    pub lease_id: LeaseId,
    /// Strictly greater than every token the cluster issued before; attach it to every write.
    pub fencing_token: FencingToken,
    /// The ttl the cluster granted (the server's default when the request said 0).
    pub ttl: Duration,
    /// The id every attempt of this `Acquire` carried; retrying with it returns this same lease.
    pub request_id: RequestId,
    /// When the first attempt of the `Acquire` left this client. The grant happened after it, so
    /// the lease cannot expire before `sent_at + ttl`. The *first* attempt, not the one that was
    /// answered: a retry may return a grant that an earlier attempt caused. With a request id
    /// the caller gave (a repeat of an earlier call, whose grant may be minutes old), the send
    /// time of the `Renew` that confirmed the grant, and `ttl` is that renewal's.
    pub sent_at: Instant,
    /// The leader's wall-clock estimate of expiry. Informative only: never used for timing.
    pub expires_at_unix_ms: i64,
    /// The grant signed by the cluster's key (lockd-fence sequencer bytes): send it to stores
    /// that verify sequencers (`Lock-Sequencer` header in base64, `lockd.fence`). Empty only
    /// from a lockd without signed sequencers.
    pub sequencer: Vec<u8>,
}

impl Lease {
    /// `sent_at + ttl − margin`: until then the lease is ours, unless the server says otherwise.
    pub fn local_deadline(&self, margin: Duration) -> Instant {
        local_deadline(self.sent_at, self.ttl, margin)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn margin_is_a_tenth_of_the_ttl_with_a_floor_and_a_cap() {
        assert_eq!(
            default_safety_margin(Duration::from_secs(30)),
            Duration::from_secs(3)
        );
        assert_eq!(
            default_safety_margin(Duration::from_secs(1)),
            SAFETY_MARGIN_MIN
        );
        assert_eq!(
            default_safety_margin(Duration::from_millis(400)),
            Duration::from_millis(200)
        );
    }

    #[test]
    fn deadline_counts_from_the_send_time() {
        let sent = Instant::now();
        let ttl = Duration::from_secs(10);
        let margin = default_safety_margin(ttl);
        assert_eq!(
            local_deadline(sent, ttl, margin),
            sent + Duration::from_secs(9)
        );
        // A margin larger than the ttl leaves a deadline at the send time, never before it.
        assert_eq!(local_deadline(sent, ttl, ttl * 2), sent);
    }

    #[test]
    fn lease_ids_are_abbreviated() {
        let id = LeaseId::new("0123456789abcdef");
        assert_eq!(format!("{id:?}"), "LeaseId(01234567…)");
        assert_eq!(abbreviate("abc"), "abc");
        assert_eq!(id.as_str(), "0123456789abcdef");
    }
}
