//! Validation of a `lockd.fence` value as the proxy records it.

use lockd_fence::Fence;

use crate::error::{self, ProxyError};
use crate::fence_sql::MAX_RECORDABLE_TOKEN;

/// Parses `<resource>:<token>` with lockd's rules, and checks the token fits the `bigint` column.
pub fn parse(value: &str) -> Result<Fence, ProxyError> {
    let fence: Fence = value.parse().map_err(|e| {
        ProxyError::error(error::BAD_FENCE, format!("invalid lockd.fence value {value:?}: {e}"))
            .with_hint("SET lockd.fence = '<resource>:<token>', with the fencing token lockd granted, e.g. 'orders:42'")
    })?;
    if fence.token.0 > MAX_RECORDABLE_TOKEN {
        return Err(ProxyError::error(
            error::BAD_FENCE,
            format!(
                "invalid lockd.fence value {value:?}: token {} exceeds {MAX_RECORDABLE_TOKEN}, the largest value of the bigint column lockd_fence.token",
                fence.token
            ),
        ));
    }
    Ok(fence)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rejects_tokens_the_column_cannot_hold() {
        assert!(parse("a:9223372036854775807").is_ok());
        let e = parse("a:9223372036854775808").unwrap_err();
        assert!(e.message.contains("9223372036854775808"), "{}", e.message);
        assert_eq!(parse("x").unwrap_err().code, "22023");
    }
}
