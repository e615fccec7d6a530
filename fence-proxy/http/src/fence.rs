//! Reading the fence of a write from its `Lock-Resource` and `Fencing-Token` headers.

use http::HeaderMap;
use lockd_fence::{FENCING_TOKEN_HEADER, Fence, FencingToken, LOCK_RESOURCE_HEADER};

use crate::Refusal;

/// Reads both headers. Either one missing: 428. Repeated, not UTF-8, or not valid: 400.
pub fn read_fence(headers: &HeaderMap) -> Result<Fence, Refusal> {
    let resource = single(headers, LOCK_RESOURCE_HEADER)?;
    let token = single(headers, FENCING_TOKEN_HEADER)?;
    let (resource, token) = match (resource, token) {
        (Some(r), Some(t)) => (r, t),
        (r, t) => {
            let missing = match (&r, &t) {
                (None, None) => format!("{LOCK_RESOURCE_HEADER} and {FENCING_TOKEN_HEADER}"),
                (None, _) => LOCK_RESOURCE_HEADER.to_owned(),
                _ => FENCING_TOKEN_HEADER.to_owned(),
            };
            return Err(Refusal::FenceRequired {
                resource: r,
                token: t.and_then(|t| t.parse::<FencingToken>().ok()),
                missing,
            });
        }
    };
    let token_value = token.parse::<FencingToken>();
    if let Err(e) = lockd_fence::validate_resource(&resource) {
        return Err(Refusal::BadFence {
            resource: None,
            token: token_value.ok(),
            detail: format!("{LOCK_RESOURCE_HEADER}: {e}"),
        });
    }
    match token_value {
        Ok(token) => Ok(Fence { resource, token }),
        Err(e) => Err(Refusal::BadFence {
            resource: Some(resource),
            token: None,
            detail: format!("{FENCING_TOKEN_HEADER}: {e}"),
        }),
    }
}

/// The one value of header `name` as UTF-8, `None` when absent.
fn single(headers: &HeaderMap, name: &'static str) -> Result<Option<String>, Refusal> {
    let mut values = headers.get_all(name).iter();
    let Some(value) = values.next() else {
        return Ok(None);
    };
    let extra = values.count();
    if extra > 0 {
        return Err(Refusal::BadFence {
            resource: None,
            token: None,
            detail: format!("header {name} appears {} times, expected once", extra + 1),
        });
    }
    match std::str::from_utf8(value.as_bytes()) {
        Ok(s) => Ok(Some(s.to_owned())),
        Err(_) => Err(Refusal::BadFence {
            resource: None,
            token: None,
            detail: format!("header {name} is not UTF-8: {value:?}"),
        }),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn headers(pairs: &[(&'static str, &str)]) -> HeaderMap {
        let mut h = HeaderMap::new();
        for (k, v) in pairs {
            h.append(*k, v.parse().unwrap());
        }
        h
    }

    #[test]
    fn reads_and_refuses() {
        let f = read_fence(&headers(&[
            ("lock-resource", "orders/1"),
            ("fencing-token", "42"),
        ]))
        .unwrap();
        assert_eq!((f.resource.as_str(), f.token.0), ("orders/1", 42));

        let r = read_fence(&headers(&[])).unwrap_err();
        assert_eq!(r.reason(), "fence-required");
        let r = read_fence(&headers(&[("lock-resource", "orders/1")])).unwrap_err();
        assert_eq!(r.reason(), "fence-required");
        assert!(r.message().contains("Fencing-Token"), "{}", r.message());

        for bad in [
            vec![("lock-resource", "orders/1"), ("fencing-token", "-1")],
            vec![("lock-resource", "orders/1"), ("fencing-token", "4 2")],
            vec![("lock-resource", ""), ("fencing-token", "1")],
            vec![
                ("lock-resource", "a"),
                ("lock-resource", "b"),
                ("fencing-token", "1"),
            ],
        ] {
            let r = read_fence(&headers(&bad)).unwrap_err();
            assert_eq!(r.reason(), "bad-fence", "{bad:?}: {}", r.message());
        }
    }
}
