//! The idempotency key of `Acquire`: one per logical attempt, reused by every retry of it.

use std::fmt;

use crate::error::Error;

/// Longest request id the server accepts (CONTRACT.md: 1..=128 bytes).
pub const REQUEST_ID_MAX_BYTES: usize = 128;

/// Identifies one logical `Acquire`. Every retry of that attempt carries the same id, so the
/// cluster answers a retry with the original outcome (same lease, same token) instead of granting
/// a second lease or reporting the resource as held by ourselves.
#[derive(Clone, PartialEq, Eq, Hash)]
pub struct RequestId(String);

impl RequestId {
    /// A fresh random id: a UUID v4, whose 122 random bits come from the OS, so two clients never
    /// pick the same id by chance.
    pub fn random() -> Self {
        RequestId(uuid::Uuid::new_v4().to_string())
    }

    /// Takes a caller-chosen id, e.g. one persisted before a crash so that the restarted process can
    /// learn the outcome of its earlier attempt.
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

    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl fmt::Display for RequestId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl fmt::Debug for RequestId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "RequestId({:?})", self.0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn random_ids_are_distinct_uuids() {
        let a = RequestId::random();
        let b = RequestId::random();
        assert_ne!(a, b);
        assert_eq!(a.as_str().len(), 36, "{a}");
        assert_eq!(
            uuid::Uuid::parse_str(a.as_str()).unwrap().get_version_num(),
            4
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
