//! Checks of client input at the edge. Each error names the field and the offending value, and
//! its text is what the client sees after `lockd: `.

use crate::limits::*;
use crate::types::{LeaseId, ResourceName};

/// A request field that breaks the policy.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("invalid {field}: {reason}")]
pub struct InvalidArgument {
    /// The request field at fault, as the API names it.
    pub field: &'static str,
    /// What is wrong with its value.
    pub reason: String,
}

fn invalid(field: &'static str, reason: String) -> InvalidArgument {
    InvalidArgument { field, reason }
}

/// The name of a resource to acquire: what [`held_resource`] accepts, and no whitespace at either
/// end. A header parser (RFC 9110's optional whitespace, `str.strip()`) drops it, so `"orders/42 "`
/// would be a lock of its own that an upstream checking `Lock-Resource` reads as `orders/42`.
pub fn resource(name: &str) -> Result<ResourceName, InvalidArgument> {
    let checked = held_resource(name)?;
    if name.starts_with(char::is_whitespace) || name.ends_with(char::is_whitespace) {
        return Err(invalid(
            "resource",
            format!("{name:?} starts or ends with whitespace"),
        ));
    }
    Ok(checked)
}

/// The name of a resource already held or looked at (Renew, Release, Describe): 1..=256 bytes of
/// UTF-8 without control characters. Laxer than [`resource`] so that a lock acquired before the
/// whitespace rule can still be released.
pub fn held_resource(name: &str) -> Result<ResourceName, InvalidArgument> {
    if name.is_empty() {
        return Err(invalid("resource", "must not be empty".into()));
    }
    if name.len() > RESOURCE_MAX_BYTES {
        return Err(invalid(
            "resource",
            format!(
                "{} bytes starting {:?}: at most {RESOURCE_MAX_BYTES} bytes",
                name.len(),
                name.chars().take(32).collect::<String>()
            ),
        ));
    }
    if let Some(c) = name.chars().find(|c| c.is_control()) {
        return Err(invalid(
            "resource",
            format!("{name:?} contains control character {c:?}"),
        ));
    }
    Ok(ResourceName::new_unchecked(name.to_owned()))
}

/// 1..=128 bytes.
pub fn request_id(id: &str) -> Result<(), InvalidArgument> {
    if id.is_empty() {
        return Err(invalid(
            "request_id",
            "is required (1 to 128 bytes, one per logical acquire attempt)".into(),
        ));
    }
    if id.len() > REQUEST_ID_MAX_BYTES {
        return Err(invalid(
            "request_id",
            format!("{} bytes: at most {REQUEST_ID_MAX_BYTES}", id.len()),
        ));
    }
    // With an authorization policy lockd scopes ids as `\u{1}<identity>\u{1}<id>`: an id with
    // control characters could pose as another identity's scoped id (one planted before the
    // policy was turned on, say) or forge an identity in the audit log.
    if id.chars().any(char::is_control) {
        return Err(invalid(
            "request_id",
            format!("{id:?} contains control characters"),
        ));
    }
    Ok(())
}

/// 0 means the default; otherwise 1,000..=300,000 ms.
pub fn lease_ttl_ms(ttl: u64) -> Result<u64, InvalidArgument> {
    if ttl == 0 {
        return Ok(LEASE_TTL_DEFAULT_MS);
    }
    if !(LEASE_TTL_MIN_MS..=LEASE_TTL_MAX_MS).contains(&ttl) {
        return Err(invalid(
            "lease_ttl_ms",
            format!(
                "{ttl} is outside {LEASE_TTL_MIN_MS}..={LEASE_TTL_MAX_MS} (0 means {LEASE_TTL_DEFAULT_MS})"
            ),
        ));
    }
    Ok(ttl)
}

/// 0 means do not wait; at most 300,000 ms.
pub fn wait_timeout_ms(wait: u64) -> Result<u64, InvalidArgument> {
    if wait > WAIT_TIMEOUT_MAX_MS {
        return Err(invalid(
            "wait_timeout_ms",
            format!("{wait} is above the maximum {WAIT_TIMEOUT_MAX_MS}"),
        ));
    }
    Ok(wait)
}

/// Free text, at most 256 bytes, no control characters (it ends up in logs).
pub fn holder(holder: &str) -> Result<(), InvalidArgument> {
    if holder.len() > HOLDER_MAX_BYTES {
        return Err(invalid(
            "holder",
            format!("{} bytes: at most {HOLDER_MAX_BYTES}", holder.len()),
        ));
    }
    if holder.chars().any(char::is_control) {
        return Err(invalid(
            "holder",
            format!("{holder:?} contains control characters"),
        ));
    }
    Ok(())
}

/// 32 hex digits.
pub fn lease_id(id: &str) -> Result<LeaseId, InvalidArgument> {
    if id.is_empty() {
        return Err(invalid("lease_id", "is required".into()));
    }
    id.parse()
        .map_err(|e: crate::types::BadLeaseId| invalid("lease_id", e.to_string()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn errors_name_field_and_value() {
        let e = resource("").unwrap_err();
        assert_eq!(e.field, "resource");
        let e = resource("a\u{1}b").unwrap_err();
        assert!(
            e.to_string().contains("resource") && e.to_string().contains("a\\u{1}b"),
            "{e}"
        );
        assert!(resource(&"x".repeat(257)).is_err());
        assert!(resource(&"x".repeat(256)).is_ok());
        assert!(resource("team/ünïcode").is_ok());
        // Whitespace at an end: refused for a new lock, accepted for one held already.
        for edged in ["orders/42 ", " orders/42", "orders/42\u{a0}"] {
            let e = resource(edged).unwrap_err();
            assert!(e.to_string().contains("whitespace"), "{e}");
            assert!(held_resource(edged).is_ok(), "{edged:?}");
        }
        assert!(resource("orders/ 42").is_ok());
        let e = lease_ttl_ms(999).unwrap_err();
        assert!(
            e.to_string().contains("lease_ttl_ms") && e.to_string().contains("999"),
            "{e}"
        );
        assert_eq!(lease_ttl_ms(0), Ok(LEASE_TTL_DEFAULT_MS));
        assert!(lease_ttl_ms(300_001).is_err());
        assert!(
            wait_timeout_ms(300_001)
                .unwrap_err()
                .to_string()
                .contains("300001")
        );
        assert_eq!(request_id("").unwrap_err().field, "request_id");
        assert!(request_id(&"r".repeat(129)).is_err());
        assert!(request_id("\u{1}cert:ops\u{1}job-1").is_err());
        assert!(request_id("tab\there").is_err());
        assert!(request_id("3f2a-ü-job").is_ok());
        assert_eq!(lease_id("nope").unwrap_err().field, "lease_id");
    }
}
