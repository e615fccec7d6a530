//! The idempotency key of `Acquire`: one per logical attempt, reused by every retry of it.

use std::fmt;

use crate::error::Error;

/// Longest request id the server accepts (docs/api.md, "Limits and policy": 1..=128 bytes).
pub const REQUEST_ID_MAX_BYTES: usize = 128;
/// Random bytes in a generated id: 128 bits, out of reach of guessing (a retry with an id
/// returns its lease id, so an id is a credential).
pub const REQUEST_ID_RANDOM_BYTES: usize = 16;

/// Identifies one logical `Acquire`. Every retry of that attempt carries the same id, so the
/// cluster answers a retry with the original outcome (same lease, same token) instead of granting
/// a second lease or reporting the resource as held by ourselves.
///
/// Because a retry returns the original `lease_id`, whoever knows an id within its 10-minute
/// window can obtain the lease id and release or renew the lease: an id is a bearer credential
/// and must be unguessable, and is never printed in full (`Debug` and error messages show its
/// first [`crate::lease::LEASE_ID_SHOWN_CHARS`] characters, [`RequestId::as_str`] all of it). [`RequestId::random`] is; an id given to [`RequestId::parse`] must be
/// too (never a counter, a timestamp or a name derived from the resource).
#[derive(Clone, PartialEq, Eq, Hash)]
pub struct RequestId(String);

impl RequestId {
    /// A fresh random id: [`REQUEST_ID_RANDOM_BYTES`] bytes from a CSPRNG seeded by the OS, in
    /// hex, so nobody can guess it and two clients never pick the same id by chance.
    pub fn random() -> Self {
        let bytes: [u8; REQUEST_ID_RANDOM_BYTES] = rand::random();
        RequestId(bytes.iter().map(|b| format!("{b:02x}")).collect())
    }

    /// Takes a caller-chosen id, e.g. one persisted before a crash so that the restarted process can
    /// learn the outcome of its earlier attempt. It must be as unguessable as a random one (see
    /// the type's docs): take it from [`RequestId::random`] and store it.
    pub fn parse(id: impl Into<String>) -> Result<Self, Error> {
        let id = id.into();
        if id.is_empty() || id.len() > REQUEST_ID_MAX_BYTES {
            return Err(Error::InvalidArgument {
                message: format!(
                    "request id {id:?} must be 1 to {REQUEST_ID_MAX_BYTES} bytes, it has {}",
                    id.len()
                ),
            });
        }
        Ok(RequestId(id))
    }

    /// The id as sent.
    pub fn as_str(&self) -> &str {
        &self.0
    }
}

// No `Display`: like a lease id, a request id is a credential, and `to_string()` must not be the
// way to store one (it would store what a log may show). `as_str` gives all of it.
impl fmt::Debug for RequestId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "RequestId({})", crate::lease::abbreviate(&self.0))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Goal: generated ids carry at least 16 random bytes (a UUID v4 has only 122 random bits).
    /// Method: decode the hex; compare many ids.
    #[test]
    fn issue14_finding3_random_ids_carry_16_random_bytes() {
        let ids: std::collections::HashSet<String> = (0..1000)
            .map(|_| RequestId::random().as_str().to_owned())
            .collect();
        assert_eq!(ids.len(), 1000);
        for id in &ids {
            assert_eq!(id.len(), 2 * REQUEST_ID_RANDOM_BYTES, "{id}");
            assert!(id.bytes().all(|b| b.is_ascii_hexdigit()), "{id}");
        }
        // Every bit position takes both values across the sample: none is fixed, unlike the
        // version and variant bits of a UUID.
        let bits = |id: &String| u128::from_str_radix(id, 16).unwrap();
        let (ones, zeros) = ids
            .iter()
            .fold((0u128, 0u128), |(o, z), id| (o | bits(id), z | !bits(id)));
        assert_eq!((ones, zeros), (u128::MAX, u128::MAX));
    }

    /// Goal (review "clients" finding 4): a request id is shown like a lease id, and a `Lease`
    /// (which derives `Debug`) prints neither in full.
    #[test]
    fn review_clients_finding4_request_ids_are_shortened_in_debug() {
        let id = RequestId::parse("0123456789abcdef0123456789abcdef").unwrap();
        assert_eq!(format!("{id:?}"), "RequestId(01234567…)");
        assert_eq!(id.as_str(), "0123456789abcdef0123456789abcdef");
        let lease = crate::Lease {
            resource: "r".into(),
            lease_id: crate::LeaseId::new("fedcba9876543210fedcba9876543210"),
            fencing_token: lockd_fence::FencingToken(7),
            ttl: std::time::Duration::from_secs(2),
            request_id: id,
            sent_at: tokio::time::Instant::now(),
            expires_at_unix_ms: 0,
            sequencer: Vec::new(),
        };
        let debug = format!("{lease:?}");
        assert!(
            !debug.contains("89abcdef01") && !debug.contains("76543210fe"),
            "{debug}"
        );
    }

    #[test]
    fn parse_enforces_the_contract_bounds() {
        assert!(RequestId::parse("x").is_ok());
        assert!(RequestId::parse("x".repeat(REQUEST_ID_MAX_BYTES)).is_ok());
        let err = RequestId::parse("").unwrap_err();
        assert!(err.to_string().contains("\"\""), "{err}");
        let err = RequestId::parse("y".repeat(REQUEST_ID_MAX_BYTES + 1)).unwrap_err();
        assert!(err.to_string().contains("129"), "{err}");
    }
}
