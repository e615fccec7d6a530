//! The fencing-token format that lockd issues and fence-proxy enforces.
//!
//! It holds only the value types and their parsing, no I/O: the proxy and the adapters depend on
//! this crate, not on lockd's server, so they need nothing but the token format.
//!
//! # Layout
//! - [`FencingToken`]: the strictly increasing number lockd attaches to every grant.
//! - [`Fence`]: a resource name together with a token, as carried by `SET lockd.fence`.
//! - header names of the HTTP front end.
//! - [`sequencer`]: tokens signed by the cluster's Ed25519 key, verified offline by a store.

pub mod sequencer;

use std::fmt;
use std::str::FromStr;

/// HTTP header naming the protected resource of a write.
pub const LOCK_RESOURCE_HEADER: &str = "Lock-Resource";
/// HTTP header carrying the decimal fencing token of a write.
pub const FENCING_TOKEN_HEADER: &str = "Fencing-Token";
/// HTTP header carrying a signed sequencer in base64 ([`sequencer`]).
pub const LOCK_SEQUENCER_HEADER: &str = "Lock-Sequencer";
/// HTTP header that marks a response made by fence-proxy itself, with the reason.
pub const FENCE_PROXY_ERROR_HEADER: &str = "Fence-Proxy-Error";

/// Longest resource name lockd accepts; the proxy applies the same bound.
pub const RESOURCE_MAX_BYTES: usize = 256;

/// A fencing token: strictly greater than every token lockd issued before, for any resource.
///
/// A protected store accepts a write only when its token is at least the highest it accepted for
/// that resource.
#[derive(
    Clone,
    Copy,
    Debug,
    PartialEq,
    Eq,
    PartialOrd,
    Ord,
    Hash,
    Default,
    serde::Serialize,
    serde::Deserialize,
)]
#[serde(transparent)]
pub struct FencingToken(pub u64);

impl fmt::Display for FencingToken {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}", self.0)
    }
}

/// Why a token or fence value was rejected.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum FenceParseError {
    /// The token is not plain decimal digits within u64.
    #[error("fencing token {0:?} is not a decimal number from 0 to 18446744073709551615")]
    BadToken(String),
    /// The fence has no `:` between resource and token.
    #[error("fence {0:?} must look like <resource>:<token>")]
    MissingSeparator(String),
    /// The resource name breaks lockd's naming policy.
    #[error(
        "resource {0:?} must be 1 to 256 bytes without control characters and without \
         whitespace at either end"
    )]
    BadResource(String),
}

impl FromStr for FencingToken {
    type Err = FenceParseError;

    /// Accepts plain decimal digits only: no sign, no spaces, no leading `+`, so that two spellings
    /// of one token never exist.
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        if s.is_empty() || !s.bytes().all(|b| b.is_ascii_digit()) {
            return Err(FenceParseError::BadToken(s.to_owned()));
        }
        s.parse::<u64>()
            .map(FencingToken)
            .map_err(|_| FenceParseError::BadToken(s.to_owned()))
    }
}

/// Checks a resource name against lockd's policy: 1..=256 bytes of UTF-8 without control
/// characters and without whitespace at either end (a header parser drops it, so `"orders/42 "`
/// would be fenced apart from the `orders/42` an upstream reads).
pub fn validate_resource(resource: &str) -> Result<(), FenceParseError> {
    if resource.is_empty()
        || resource.len() > RESOURCE_MAX_BYTES
        || resource.chars().any(char::is_control)
        || resource.starts_with(char::is_whitespace)
        || resource.ends_with(char::is_whitespace)
    {
        return Err(FenceParseError::BadResource(resource.to_owned()));
    }
    Ok(())
}

/// A resource and the token a session presents for it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Fence {
    /// The locked resource.
    pub resource: String,
    /// The token the session's lease was granted.
    pub token: FencingToken,
}

impl FromStr for Fence {
    type Err = FenceParseError;

    /// Parses `<resource>:<token>`; the token is the digits after the last `:`, so resource names
    /// may themselves contain colons.
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let (resource, token) = s
            .rsplit_once(':')
            .ok_or_else(|| FenceParseError::MissingSeparator(s.to_owned()))?;
        validate_resource(resource)?;
        Ok(Fence {
            resource: resource.to_owned(),
            token: token.parse()?,
        })
    }
}

impl fmt::Display for Fence {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}:{}", self.resource, self.token)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn token_accepts_only_plain_digits() {
        assert_eq!("42".parse::<FencingToken>(), Ok(FencingToken(42)));
        for bad in ["", "-1", "+1", " 1", "1.0", "0x10", "18446744073709551616"] {
            assert!(bad.parse::<FencingToken>().is_err(), "{bad:?} was accepted");
        }
    }

    #[test]
    fn fence_splits_at_the_last_colon() {
        let f: Fence = "orders:eu:42".parse().unwrap();
        assert_eq!(f.resource, "orders:eu");
        assert_eq!(f.token, FencingToken(42));
        assert_eq!(f.to_string(), "orders:eu:42");
    }

    #[test]
    fn fence_rejects_bad_values_naming_them() {
        let err = "orders".parse::<Fence>().unwrap_err();
        assert!(err.to_string().contains("\"orders\""), "{err}");
        assert!(":42".parse::<Fence>().is_err());
        assert!("a\u{7}b:1".parse::<Fence>().is_err());
        assert!("orders:x".parse::<Fence>().is_err());
        let long = format!("{}:1", "r".repeat(257));
        assert!(long.parse::<Fence>().is_err());
    }

    /// A header parser drops whitespace at a value's ends: "orders/42 " must not be a fence of
    /// its own that an upstream reads as `orders/42`.
    #[test]
    fn resources_with_whitespace_at_an_end_are_refused() {
        for bad in [
            "orders/42 ",
            " orders/42",
            "orders/42\u{a0}",
            "\u{3000}orders/42",
        ] {
            let err = validate_resource(bad).unwrap_err();
            assert!(err.to_string().contains("whitespace"), "{err}");
            assert!(format!("{bad}:7").parse::<Fence>().is_err(), "{bad:?}");
        }
        assert!(validate_resource("orders/ 42").is_ok());
    }
}
