//! Every response the proxy makes itself: one table from refusal to HTTP status,
//! `Fence-Proxy-Error` reason and RFC 9457 problem body. Nothing is forwarded for any of them, except that
//! `UpstreamError`/`UpstreamTimeout` report a forward that failed.

use bytes::Bytes;
use http::{HeaderValue, Response, StatusCode};
use http_body_util::{BodyExt, Full};
use lockd_fence::{FENCE_PROXY_ERROR_HEADER, FencingToken};

use crate::exchange::BoxError;
use crate::proxy::ProxyBody;

/// RFC 9457's media type for problem details.
pub const PROBLEM_CONTENT_TYPE: &str = "application/problem+json";
/// `type` of a refusal: this prefix and the `Fence-Proxy-Error` reason.
pub const PROBLEM_TYPE_PREFIX: &str = "urn:lockd:problem:";

/// Why the proxy answered a request itself.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Refusal {
    /// 412: the token is lower than the highest accepted for the resource.
    Stale {
        /// The write's `Lock-Resource`.
        resource: String,
        /// The write's `Fencing-Token`.
        token: FencingToken,
        /// The highest token accepted for the resource.
        highest: FencingToken,
    },
    /// 428: a write without `Lock-Resource` or `Fencing-Token`.
    FenceRequired {
        /// The write's `Lock-Resource`, when it had a valid one.
        resource: Option<String>,
        /// The write's `Fencing-Token`, when it had a valid one.
        token: Option<FencingToken>,
        /// Which header(s) are missing.
        missing: String,
    },
    /// 400: a fence header that is repeated, not UTF-8, or not valid.
    BadFence {
        /// The write's `Lock-Resource`, when it had a valid one.
        resource: Option<String>,
        /// The write's `Fencing-Token`, when it had a valid one.
        token: Option<FencingToken>,
        /// What went wrong, for the problem body.
        detail: String,
    },
    /// 403: a `Lock-Sequencer` that does not verify: forged, altered, signed by a key the proxy
    /// was not given, for another resource, disagreeing with `Fencing-Token`, or malformed.
    BadSequencer {
        /// The write's `Lock-Resource`, when it had a valid one.
        resource: Option<String>,
        /// The write's `Fencing-Token`, when it had a valid one.
        token: Option<FencingToken>,
        /// What went wrong, for the problem body.
        detail: String,
    },
    /// 403: a plain `Fencing-Token` without a `Lock-Sequencer`, while verify keys are given and
    /// `--allow-unsigned` is not.
    SequencerRequired {
        /// The write's `Lock-Resource`, when it had a valid one.
        resource: Option<String>,
        /// The write's `Fencing-Token`, when it had a valid one.
        token: Option<FencingToken>,
    },
    /// 503: the epoch store could not decide; the proxy fails closed.
    StoreUnavailable {
        /// The write's `Lock-Resource`.
        resource: String,
        /// The write's `Fencing-Token`.
        token: FencingToken,
        /// What went wrong, for the problem body.
        detail: String,
    },
    /// 503: another write of the resource (or a quarantine) held it past `--lock-wait`.
    /// Listed in docs/api.md beside the others; why it exists: docs/fence-proxy.md, "Errors".
    ResourceBusy {
        /// The write's `Lock-Resource`.
        resource: String,
        /// The write's `Fencing-Token`.
        token: FencingToken,
        /// What went wrong, for the problem body.
        detail: String,
    },
    /// 507: a write of a resource the epoch store has no record of, while it records
    /// `--max-resources` of them. Writes of recorded resources go on.
    ResourceLimit {
        /// The write's `Lock-Resource`.
        resource: String,
        /// The write's `Fencing-Token`.
        token: FencingToken,
        /// The store's message, naming the limit.
        detail: String,
    },
    /// 501: a `Transfer-Encoding` other than `chunked` alone (`gzip, chunked`): the proxy
    /// decodes only chunks, so the upstream would get the still-coded bytes as the body.
    UnsupportedTransferCoding {
        /// The header's value(s), as sent.
        coding: String,
    },
    /// 502: the upstream could not be reached or broke the connection.
    UpstreamError {
        /// The write's `Lock-Resource`, when it had a valid one.
        resource: Option<String>,
        /// The write's `Fencing-Token`, when it had a valid one.
        token: Option<FencingToken>,
        /// What went wrong, for the problem body.
        detail: String,
        /// Whether the request may have reached the upstream.
        maybe_applied: bool,
    },
    /// 504: the upstream did not answer within `--upstream-timeout`.
    UpstreamTimeout {
        /// The write's `Lock-Resource`, when it had a valid one.
        resource: Option<String>,
        /// The write's `Fencing-Token`, when it had a valid one.
        token: Option<FencingToken>,
        /// The `--upstream-timeout`, in ms.
        timeout_ms: u64,
    },
}

/// Seconds a client is told to wait after `resource-busy` or `store-unavailable`.
const RETRY_AFTER_SECONDS: &str = "1";

impl Refusal {
    /// The HTTP status the refusal is answered with.
    pub fn status(&self) -> StatusCode {
        match self {
            Refusal::Stale { .. } => StatusCode::PRECONDITION_FAILED,
            Refusal::FenceRequired { .. } => StatusCode::PRECONDITION_REQUIRED,
            Refusal::BadFence { .. } => StatusCode::BAD_REQUEST,
            Refusal::BadSequencer { .. } | Refusal::SequencerRequired { .. } => {
                StatusCode::FORBIDDEN
            }
            Refusal::StoreUnavailable { .. } | Refusal::ResourceBusy { .. } => {
                StatusCode::SERVICE_UNAVAILABLE
            }
            Refusal::ResourceLimit { .. } => StatusCode::INSUFFICIENT_STORAGE,
            Refusal::UnsupportedTransferCoding { .. } => StatusCode::NOT_IMPLEMENTED,
            Refusal::UpstreamError { .. } => StatusCode::BAD_GATEWAY,
            Refusal::UpstreamTimeout { .. } => StatusCode::GATEWAY_TIMEOUT,
        }
    }

    /// The `Fence-Proxy-Error` value, also the `result` label of `fence_proxy_requests_total`.
    pub fn reason(&self) -> &'static str {
        match self {
            Refusal::Stale { .. } => "stale-fencing-token",
            Refusal::FenceRequired { .. } => "fence-required",
            Refusal::BadFence { .. } => "bad-fence",
            Refusal::BadSequencer { .. } => "bad-sequencer",
            Refusal::SequencerRequired { .. } => "sequencer-required",
            Refusal::StoreUnavailable { .. } => "store-unavailable",
            Refusal::ResourceBusy { .. } => "resource-busy",
            Refusal::ResourceLimit { .. } => "resource-limit",
            Refusal::UnsupportedTransferCoding { .. } => "unsupported-transfer-coding",
            Refusal::UpstreamError { .. } => "upstream-error",
            Refusal::UpstreamTimeout { .. } => "upstream-timeout",
        }
    }

    /// The RFC 9457 `title`: the same for every occurrence of the reason.
    pub fn title(&self) -> &'static str {
        match self {
            Refusal::Stale { .. } => "Stale fencing token",
            Refusal::FenceRequired { .. } => "Fence required",
            Refusal::BadFence { .. } => "Bad fence",
            Refusal::BadSequencer { .. } => "Bad sequencer",
            Refusal::SequencerRequired { .. } => "Sequencer required",
            Refusal::StoreUnavailable { .. } => "Epoch store unavailable",
            Refusal::ResourceBusy { .. } => "Resource busy",
            Refusal::ResourceLimit { .. } => "Resource limit reached",
            Refusal::UnsupportedTransferCoding { .. } => "Unsupported transfer coding",
            Refusal::UpstreamError { .. } => "Upstream error",
            Refusal::UpstreamTimeout { .. } => "Upstream timeout",
        }
    }

    /// One sentence for people, naming the values.
    pub fn message(&self) -> String {
        match self {
            Refusal::Stale {
                resource,
                token,
                highest,
            } => format!(
                "fence-proxy: stale fencing token {token} for {resource:?}: highest accepted is {highest}; not forwarded"
            ),
            Refusal::FenceRequired { missing, .. } => format!(
                "fence-proxy: a write needs the Lock-Resource and Fencing-Token (or Lock-Sequencer) headers; missing {missing}; not forwarded"
            ),
            Refusal::BadSequencer {
                resource, detail, ..
            } => format!(
                "fence-proxy: Lock-Sequencer refused for {}: {detail}; not forwarded",
                resource
                    .as_deref()
                    .map_or_else(|| "?".to_owned(), |r| format!("{r:?}"))
            ),
            Refusal::SequencerRequired { resource, token } => format!(
                "fence-proxy: plain fencing token{} for {} without a Lock-Sequencer: this proxy accepts only tokens signed by lockd (--verify-key without --allow-unsigned); not forwarded",
                token.map(|t| format!(" {t}")).unwrap_or_default(),
                resource
                    .as_deref()
                    .map_or_else(|| "?".to_owned(), |r| format!("{r:?}"))
            ),
            Refusal::BadFence { detail, .. } => {
                format!("fence-proxy: bad fence: {detail}; not forwarded")
            }
            Refusal::StoreUnavailable {
                resource,
                token,
                detail,
            } => format!(
                "fence-proxy: cannot check token {token} for {resource:?}: {detail}; not forwarded, retry later"
            ),
            Refusal::ResourceBusy { detail, .. } => {
                format!("fence-proxy: {detail}; not forwarded, retry later")
            }
            Refusal::ResourceLimit { detail, .. } => {
                format!("fence-proxy: {detail}; not forwarded")
            }
            Refusal::UnsupportedTransferCoding { coding } => format!(
                "fence-proxy: Transfer-Encoding {coding:?} is not supported (only chunked); not forwarded"
            ),
            Refusal::UpstreamError {
                detail,
                maybe_applied,
                ..
            } => {
                if *maybe_applied {
                    format!(
                        "fence-proxy: upstream failed after the request was sent: {detail}; it may have been applied"
                    )
                } else {
                    format!(
                        "fence-proxy: upstream unreachable: {detail}; the request was not delivered"
                    )
                }
            }
            Refusal::UpstreamTimeout { timeout_ms, .. } => format!(
                "fence-proxy: upstream did not answer within {timeout_ms} ms; the request may still be applied"
            ),
        }
    }

    fn fields(&self) -> (Option<&str>, Option<FencingToken>, Option<FencingToken>) {
        match self {
            Refusal::Stale {
                resource,
                token,
                highest,
            } => (Some(resource), Some(*token), Some(*highest)),
            Refusal::StoreUnavailable {
                resource, token, ..
            }
            | Refusal::ResourceBusy {
                resource, token, ..
            }
            | Refusal::ResourceLimit {
                resource, token, ..
            } => (Some(resource), Some(*token), None),
            Refusal::FenceRequired {
                resource, token, ..
            }
            | Refusal::BadFence {
                resource, token, ..
            }
            | Refusal::BadSequencer {
                resource, token, ..
            }
            | Refusal::SequencerRequired { resource, token }
            | Refusal::UpstreamError {
                resource, token, ..
            }
            | Refusal::UpstreamTimeout {
                resource, token, ..
            } => (resource.as_deref(), *token, None),
            Refusal::UnsupportedTransferCoding { .. } => (None, None, None),
        }
    }

    /// An RFC 9457 problem: `type` (`urn:lockd:problem:<reason>`), `title`, `status` and
    /// `detail`, with the extension members `error` (the reason), `resource`, `token` and
    /// `highest` (present only where known) and `message` (the same text as `detail`).
    pub fn json(&self) -> serde_json::Value {
        let (resource, token, highest) = self.fields();
        let mut body = serde_json::Map::new();
        body.insert(
            "type".into(),
            format!("{PROBLEM_TYPE_PREFIX}{}", self.reason()).into(),
        );
        body.insert("title".into(), self.title().into());
        body.insert("status".into(), self.status().as_u16().into());
        body.insert("detail".into(), self.message().into());
        body.insert("error".into(), self.reason().into());
        if let Some(r) = resource {
            body.insert("resource".into(), r.into());
        }
        if let Some(t) = token {
            body.insert("token".into(), t.0.into());
        }
        if let Some(h) = highest {
            body.insert("highest".into(), h.0.into());
        }
        body.insert("message".into(), self.message().into());
        serde_json::Value::Object(body)
    }

    /// The refusal as an HTTP response: its status, a problem+json body and the `Fence-Proxy-Error` header.
    pub fn into_response(self) -> Response<ProxyBody> {
        let body = Full::new(Bytes::from(self.json().to_string()))
            .map_err(|never| -> BoxError { match never {} })
            .boxed();
        let mut response = Response::new(body);
        *response.status_mut() = self.status();
        let headers = response.headers_mut();
        headers.insert(
            FENCE_PROXY_ERROR_HEADER,
            HeaderValue::from_static(self.reason()),
        );
        headers.insert(
            http::header::CONTENT_TYPE,
            HeaderValue::from_static(PROBLEM_CONTENT_TYPE),
        );
        if self.status() == StatusCode::SERVICE_UNAVAILABLE {
            headers.insert(
                http::header::RETRY_AFTER,
                HeaderValue::from_static(RETRY_AFTER_SECONDS),
            );
        }
        response
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stale_body_carries_numbers() {
        let r = Refusal::Stale {
            resource: "orders/42".into(),
            token: FencingToken(41),
            highest: FencingToken(42),
        };
        let j = r.json();
        assert_eq!(j["error"], "stale-fencing-token");
        assert_eq!(j["resource"], "orders/42");
        assert_eq!(j["token"], 41);
        assert_eq!(j["highest"], 42);
        assert_eq!(j["type"], "urn:lockd:problem:stale-fencing-token");
        assert_eq!(j["title"], "Stale fencing token");
        assert_eq!(j["status"], 412);
        assert_eq!(j["detail"], r.message());
        assert!(r.message().contains("41") && r.message().contains("\"orders/42\""));
        let resp = r.into_response();
        assert_eq!(resp.status(), 412);
        assert_eq!(
            resp.headers()[FENCE_PROXY_ERROR_HEADER],
            "stale-fencing-token"
        );
        assert_eq!(
            resp.headers()[http::header::CONTENT_TYPE],
            "application/problem+json"
        );
    }
}
