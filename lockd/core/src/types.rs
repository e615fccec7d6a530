//! Newtypes for values that must never be mixed up.

use std::fmt;
use std::str::FromStr;

use serde::{Deserialize, Serialize};

/// The secret that proves a client holds a lease: 128 random bits from the leader's CSPRNG,
/// written as 32 lowercase hex digits. The table never derives one; it only stores what the
/// leader put in the command, so every replica stores the same id.
#[derive(Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub struct LeaseId(pub u128);

impl fmt::Display for LeaseId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{:032x}", self.0)
    }
}

/// Lease ids are secrets: debug output shows only a prefix, so logs never leak a usable id.
impl fmt::Debug for LeaseId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "LeaseId({:08x}…)", (self.0 >> 96) as u32)
    }
}

/// A lease id string that is not 32 hex digits.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("lease_id {0:?} is not 32 hex digits")]
pub struct BadLeaseId(pub String);

impl FromStr for LeaseId {
    type Err = BadLeaseId;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        if s.len() != 32 || !s.bytes().all(|b| b.is_ascii_hexdigit()) {
            return Err(BadLeaseId(s.to_owned()));
        }
        u128::from_str_radix(s, 16)
            .map(LeaseId)
            .map_err(|_| BadLeaseId(s.to_owned()))
    }
}

/// A request_id reduced to a fixed 128-bit key (xxh3-128), so a dedup record costs 16 bytes of
/// key instead of up to 128. The hash is stable across platforms and versions of the crate, so
/// replicas and snapshots agree; an accidental collision has probability about n²/2¹²⁹.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub struct RequestKey(pub u128);

impl RequestKey {
    /// The key of `request_id`.
    pub fn of(request_id: &str) -> Self {
        RequestKey(xxhash_rust::xxh3::xxh3_128(request_id.as_bytes()))
    }
}

/// How many characters of a request id messages show (as of a lease id, and as the clients do):
/// a request id is a credential, since repeating the Acquire with it returns the lease id.
pub const REQUEST_ID_SHOWN_CHARS: usize = 8;

/// The mark around the identity of a request id the server scoped to its caller:
/// `\u{1}<identity>\u{1}<the client's id>` (the dedup window is keyed by the scoped id, so that
/// one identity cannot learn another's outcome by reusing its id).
pub const REQUEST_ID_SCOPE_MARK: char = '\u{1}';

/// The identity and the client's own id of a scoped request id (see [`REQUEST_ID_SCOPE_MARK`]);
/// `(None, id)` for an id that is not scoped.
pub fn split_scoped_request_id(id: &str) -> (Option<&str>, &str) {
    id.strip_prefix(REQUEST_ID_SCOPE_MARK)
        .and_then(|rest| rest.split_once(REQUEST_ID_SCOPE_MARK))
        .map(|(identity, original)| (Some(identity), original))
        .unwrap_or((None, id))
}

/// A request id for messages and logs: the first [`REQUEST_ID_SHOWN_CHARS`] characters of the
/// client's own id (without a scope), then `…`, quoted; an id that short shown whole.
pub fn shown_request_id(id: &str) -> String {
    let (_, own) = split_scoped_request_id(id);
    match own.char_indices().nth(REQUEST_ID_SHOWN_CHARS) {
        Some((cut, _)) => format!("{:?}", format!("{}…", &own[..cut])),
        None => format!("{own:?}"),
    }
}

/// A validated resource name: 1..=256 bytes of UTF-8 without control characters (checked once,
/// at the edge, by [`crate::validate`]).
#[derive(Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub struct ResourceName(String);

impl ResourceName {
    /// Wraps a name that [`crate::validate::resource`] accepted.
    pub fn new_unchecked(name: String) -> Self {
        ResourceName(name)
    }

    /// The name as given.
    pub fn as_str(&self) -> &str {
        &self.0
    }

    /// The tenant: the part before the first `/` (the whole name when it has none). Waiter
    /// limits count per tenant so one team cannot fill every queue.
    pub fn tenant(&self) -> &str {
        self.0.split('/').next().unwrap_or(&self.0)
    }
}

impl fmt::Display for ResourceName {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lease_id_round_trips_and_rejects_junk() {
        let id = LeaseId(0x0123_4567_89ab_cdef_0011_2233_4455_6677);
        assert_eq!(id.to_string().parse::<LeaseId>(), Ok(id));
        assert_eq!(id.to_string().len(), 32);
        assert!("xyz".parse::<LeaseId>().is_err());
        assert!(format!("{}0", id).parse::<LeaseId>().is_err());
        assert!(!format!("{id:?}").contains(&id.to_string()));
    }

    #[test]
    fn tenant_is_the_prefix_before_the_first_slash() {
        assert_eq!(
            ResourceName::new_unchecked("team/a/b".into()).tenant(),
            "team"
        );
        assert_eq!(
            ResourceName::new_unchecked("plain".into()).tenant(),
            "plain"
        );
    }
}
