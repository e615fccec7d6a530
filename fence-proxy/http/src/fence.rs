//! Reading the fence of a write from its `Lock-Resource`, `Fencing-Token` and `Lock-Sequencer`
//! headers.

use http::HeaderMap;
use lockd_fence::{
    FENCING_TOKEN_HEADER, Fence, FencingToken, LOCK_RESOURCE_HEADER, LOCK_SEQUENCER_HEADER,
    sequencer,
};

use crate::Refusal;
use crate::verify::Verification;

/// Reads the fence of a write. Without verify keys, `Lock-Resource` and `Fencing-Token` as before
/// (`Lock-Sequencer` is not looked at). With them, a `Lock-Sequencer` that verifies for
/// `Lock-Resource` gives the token (a `Fencing-Token` sent beside it must agree); a plain token
/// alone passes only under `--allow-unsigned`. Missing headers: 428; repeated, not UTF-8 or not
/// valid: 400; a sequencer that does not verify or a plain token where one is required: 403.
pub fn read_fence(
    headers: &HeaderMap,
    verification: Option<&Verification>,
) -> Result<Fence, Refusal> {
    refuse_fence_named_hop_by_hop(headers)?;
    refuse_underscore_spellings(headers)?;
    let Some(v) = verification else {
        return read_plain(headers);
    };
    let Some(text) = single(headers, LOCK_SEQUENCER_HEADER)? else {
        if v.allow_unsigned {
            return read_plain(headers);
        }
        let resource = single(headers, LOCK_RESOURCE_HEADER)?;
        return match single(headers, FENCING_TOKEN_HEADER)? {
            Some(token) => Err(Refusal::SequencerRequired {
                resource,
                token: token.parse().ok(),
            }),
            None => Err(Refusal::FenceRequired {
                missing: match &resource {
                    None => format!("{LOCK_RESOURCE_HEADER} and {LOCK_SEQUENCER_HEADER}"),
                    Some(_) => LOCK_SEQUENCER_HEADER.to_owned(),
                },
                resource,
                token: None,
            }),
        };
    };
    let Some(resource) = single(headers, LOCK_RESOURCE_HEADER)? else {
        return Err(Refusal::FenceRequired {
            resource: None,
            token: None,
            missing: LOCK_RESOURCE_HEADER.to_owned(),
        });
    };
    if let Err(e) = lockd_fence::validate_resource(&resource) {
        return Err(Refusal::BadFence {
            resource: None,
            token: None,
            detail: format!("{LOCK_RESOURCE_HEADER}: {e}"),
        });
    }
    let claimed = match single(headers, FENCING_TOKEN_HEADER)? {
        None => None,
        Some(t) => match t.parse::<FencingToken>() {
            Ok(t) => Some(t),
            Err(e) => {
                return Err(Refusal::BadFence {
                    resource: Some(resource),
                    token: None,
                    detail: format!("{FENCING_TOKEN_HEADER}: {e}"),
                });
            }
        },
    };
    let verified = sequencer::decode_text(&text)
        .and_then(|bytes| v.keys.verify_for(&bytes, &resource, claimed));
    match verified {
        Ok(seq) => Ok(Fence {
            resource,
            token: seq.token,
        }),
        Err(e) => Err(Refusal::BadSequencer {
            resource: Some(resource),
            token: claimed,
            detail: e.to_string(),
        }),
    }
}

/// `Lock-Resource` and `Fencing-Token`. Either one missing: 428. Repeated, not UTF-8, or not
/// valid: 400.
fn read_plain(headers: &HeaderMap) -> Result<Fence, Refusal> {
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

/// A fence header named in `Connection` would be removed as hop-by-hop before the write goes
/// upstream, which then gets it unfenced (and cannot check `Fencing-Token` itself): refused, 400.
fn refuse_fence_named_hop_by_hop(headers: &HeaderMap) -> Result<(), Refusal> {
    let named = headers
        .get_all(http::header::CONNECTION)
        .iter()
        .flat_map(|v| v.as_bytes().split(|b| *b == b','))
        .map(<[u8]>::trim_ascii);
    for name in named {
        for fence_header in [
            LOCK_RESOURCE_HEADER,
            FENCING_TOKEN_HEADER,
            LOCK_SEQUENCER_HEADER,
        ] {
            if name.eq_ignore_ascii_case(fence_header.as_bytes()) {
                return Err(Refusal::BadFence {
                    resource: None,
                    token: None,
                    detail: format!(
                        "the Connection header names {fence_header}, which would then not reach \
                         the upstream: fence headers are end-to-end"
                    ),
                });
            }
        }
    }
    Ok(())
}

/// Whether header `name`, read as CGI, WSGI and Rack servers read it (`_` as `-`, any case),
/// is `canonical`: `Fencing_Token` and `Fencing-Token` are one variable (`HTTP_FENCING_TOKEN`)
/// there.
pub(crate) fn reads_as(name: &str, canonical: &str) -> bool {
    name.len() == canonical.len()
        && name.bytes().zip(canonical.bytes()).all(|(a, b)| {
            let a = if a == b'_' { b'-' } else { a };
            a.eq_ignore_ascii_case(&b)
        })
}

/// A header that such a server reads as a fence header, spelled with `_`, would reach the
/// upstream beside the fence the proxy checked (`Fencing_Token: 999` after `Fencing-Token: 42`),
/// and the upstream might read it instead: refused, 400.
fn refuse_underscore_spellings(headers: &HeaderMap) -> Result<(), Refusal> {
    for name in headers.keys().map(http::HeaderName::as_str) {
        if !name.contains('_') {
            continue;
        }
        for fence_header in [
            LOCK_RESOURCE_HEADER,
            FENCING_TOKEN_HEADER,
            LOCK_SEQUENCER_HEADER,
        ] {
            if reads_as(name, fence_header) {
                return Err(Refusal::BadFence {
                    resource: None,
                    token: None,
                    detail: format!(
                        "header {name:?} reads as {fence_header} to servers that take '_' for \
                         '-' (CGI, WSGI, Rack): send the fence only as {fence_header}"
                    ),
                });
            }
        }
    }
    Ok(())
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

    #[test]
    fn underscore_spellings_of_fence_headers_are_refused() {
        assert!(reads_as("fencing_token", "Fencing-Token"));
        assert!(reads_as("Lock_Resource", "Lock-Resource"));
        assert!(!reads_as("fencing_tokens", "Fencing-Token"));
        assert!(!reads_as("x_request_id", "Fencing-Token"));
        let mut h = HeaderMap::new();
        h.insert("lock-resource", "r".parse().unwrap());
        h.insert("fencing-token", "42".parse().unwrap());
        assert!(read_fence(&h, None).is_ok());
        h.insert("x_other", "1".parse().unwrap());
        assert!(read_fence(&h, None).is_ok());
        h.insert("fencing_token", "999".parse().unwrap());
        let err = read_fence(&h, None).unwrap_err();
        assert_eq!(err.reason(), "bad-fence");
    }

    fn headers(pairs: &[(&'static str, &str)]) -> HeaderMap {
        let mut h = HeaderMap::new();
        for (k, v) in pairs {
            h.append(*k, v.parse().unwrap());
        }
        h
    }

    #[test]
    fn reads_and_refuses() {
        let f = read_fence(
            &headers(&[("lock-resource", "orders/1"), ("fencing-token", "42")]),
            None,
        )
        .unwrap();
        assert_eq!((f.resource.as_str(), f.token.0), ("orders/1", 42));

        let r = read_fence(&headers(&[]), None).unwrap_err();
        assert_eq!(r.reason(), "fence-required");
        let r = read_fence(&headers(&[("lock-resource", "orders/1")]), None).unwrap_err();
        assert_eq!(r.reason(), "fence-required");
        assert!(r.message().contains("Fencing-Token"), "{}", r.message());

        for bad in [
            vec![
                ("lock-resource", "orders/1"),
                ("fencing-token", "1"),
                ("connection", "keep-alive, Fencing-Token"),
            ],
            vec![
                ("lock-resource", "orders/1"),
                ("fencing-token", "1"),
                ("connection", "keep-alive"),
                ("connection", "\tLock-Resource\t"),
            ],
            vec![("lock-resource", "orders/1"), ("fencing-token", "-1")],
            vec![("lock-resource", "orders/1"), ("fencing-token", "4 2")],
            vec![("lock-resource", ""), ("fencing-token", "1")],
            vec![
                ("lock-resource", "a"),
                ("lock-resource", "b"),
                ("fencing-token", "1"),
            ],
        ] {
            let r = read_fence(&headers(&bad), None).unwrap_err();
            assert_eq!(r.reason(), "bad-fence", "{bad:?}: {}", r.message());
        }
    }

    fn signed() -> (lockd_fence::sequencer::SigningKey, Verification) {
        let k = lockd_fence::sequencer::SigningKey::generate();
        let v = Verification {
            keys: lockd_fence::sequencer::VerifyKeys::new([k.public_key()]),
            allow_unsigned: false,
        };
        (k, v)
    }

    #[test]
    fn sequencer_gives_the_token_and_must_agree_with_a_plain_one() {
        let (k, v) = signed();
        let seq = sequencer::encode_text(&k.sign("orders/1", FencingToken(42), 0));
        let f = read_fence(
            &headers(&[("lock-resource", "orders/1"), ("lock-sequencer", &seq)]),
            Some(&v),
        )
        .unwrap();
        assert_eq!((f.resource.as_str(), f.token.0), ("orders/1", 42));
        let f = read_fence(
            &headers(&[
                ("lock-resource", "orders/1"),
                ("lock-sequencer", &seq),
                ("fencing-token", "42"),
            ]),
            Some(&v),
        )
        .unwrap();
        assert_eq!(f.token.0, 42);
        for bad in [
            vec![
                ("lock-resource", "orders/1"),
                ("lock-sequencer", seq.as_str()),
                ("fencing-token", "43"),
            ],
            vec![
                ("lock-resource", "orders/2"),
                ("lock-sequencer", seq.as_str()),
            ],
            vec![
                ("lock-resource", "orders/1"),
                ("lock-sequencer", "bm90IGEgc2VxdWVuY2Vy"),
            ],
            vec![("lock-resource", "orders/1"), ("lock-sequencer", "!!")],
        ] {
            let r = read_fence(&headers(&bad), Some(&v)).unwrap_err();
            assert_eq!(r.reason(), "bad-sequencer", "{bad:?}: {}", r.message());
            assert_eq!(r.status(), 403);
        }
    }

    #[test]
    fn plain_tokens_need_allow_unsigned_once_keys_are_given() {
        let (_, mut v) = signed();
        let plain = headers(&[("lock-resource", "orders/1"), ("fencing-token", "42")]);
        let r = read_fence(&plain, Some(&v)).unwrap_err();
        assert_eq!(r.reason(), "sequencer-required");
        assert_eq!(r.status(), 403);
        let r = read_fence(&headers(&[("lock-resource", "orders/1")]), Some(&v)).unwrap_err();
        assert_eq!(r.reason(), "fence-required");
        assert!(r.message().contains("Lock-Sequencer"), "{}", r.message());
        v.allow_unsigned = true;
        assert_eq!(read_fence(&plain, Some(&v)).unwrap().token.0, 42);
    }
}
