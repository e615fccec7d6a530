//! What `/readyz` watches for the HTTP front end: the epoch store answers a cheap check and the
//! upstream accepts a TCP connection (run in the background by `lockd_service_kit::checks`).

use std::sync::Arc;

use fence_epoch_store::{EpochStore, StoreError};
use lockd_service_kit::checks::Check;

use crate::Upstream;

/// Names the store check in `/readyz` reasons.
pub const STORE_CHECK: &str = "epoch store";
/// Names the upstream check in `/readyz` reasons.
pub const UPSTREAM_CHECK: &str = "upstream";

/// The checks of a proxy forwarding to `upstream` with decisions from `store`.
pub fn checks(store: Arc<dyn EpochStore>, upstream: &Upstream) -> Vec<Check> {
    let store_check = Check::new(STORE_CHECK, move || {
        let store = store.clone();
        async move { store.check().await.map_err(|e| reason(&e)) }
    });
    vec![
        store_check,
        Check::tcp_connect(UPSTREAM_CHECK, upstream_addr(upstream)),
    ]
}

/// `host:port` of the upstream, with the scheme's port when the URL names none.
pub fn upstream_addr(upstream: &Upstream) -> String {
    let port =
        upstream
            .authority
            .port_u16()
            .unwrap_or(if upstream.scheme == http::uri::Scheme::HTTPS {
                443
            } else {
                80
            });
    format!("{}:{port}", upstream.authority.host())
}

/// A store error without the "epoch store" the check's name already says.
fn reason(e: &StoreError) -> String {
    match e {
        StoreError::Unavailable { store, detail } => format!("{store}: {detail}"),
        other => other.to_string(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn upstream_addr_defaults_the_port_by_scheme() {
        let addr = |url: &str| upstream_addr(&url.parse::<Upstream>().unwrap());
        assert_eq!(addr("http://127.0.0.1:9000/base"), "127.0.0.1:9000");
        assert_eq!(addr("http://storage.internal"), "storage.internal:80");
        assert_eq!(addr("https://storage.internal"), "storage.internal:443");
        assert_eq!(addr("http://[::1]:8080"), "[::1]:8080");
    }

    #[test]
    fn store_reasons_name_the_store_once() {
        let e = StoreError::Unavailable {
            store: "postgres://db:5432/fence".into(),
            detail: "checking: connection refused".into(),
        };
        assert_eq!(
            reason(&e),
            "postgres://db:5432/fence: checking: connection refused"
        );
    }
}
