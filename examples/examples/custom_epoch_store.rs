//! An epoch store of your own, plugged into fence-proxy's HTTP front end.
//!
//! The store here keeps tokens in memory (so it forgets them on restart: a real one must record
//! them durably before `admit` returns). It reuses `Slots`, the per-resource grant table with
//! quarantine that the bundled stores use, so that it keeps the ordering guarantee. It takes the
//! simplest grant, `Slots::lock`, which is exclusive: one forward per resource at a time, and a
//! quarantine after a forward whose outcome is unknown. (The redb store takes `Slots::share`
//! instead, so that writes carrying the same token are forwarded side by side.)
//!
//! The program starts a tiny upstream, serves the proxy with this store, sends three writes and
//! prints what happened to each. Run it with
//! `cargo run -p lockd-examples --example custom_epoch_store`.

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::Bytes;
use fence_epoch_store::{
    Admission, EpochStore, ForwardOutcome, Permit, PermitRelease, SlotGuard, Slots, StoreError,
};
use fence_proxy_http::{ProxyConfig, ResourceBinding, Upstream};
use futures::future::BoxFuture;
use http_body_util::{BodyExt, Full};
use hyper_util::client::legacy::Client;
use hyper_util::rt::{TokioExecutor, TokioIo};
use lockd_fence::FencingToken;
use tokio_util::sync::CancellationToken;

/// How long a write waits for another write of the same resource.
const LOCK_WAIT: Duration = Duration::from_secs(5);
/// How long a resource stays closed after a forward whose outcome is unknown.
const QUARANTINE: Duration = Duration::from_secs(5);
/// How long the upstream may take with a write (the proxy's `upstream_timeout` below).
const UPSTREAM_TIMEOUT: Duration = Duration::from_secs(5);

/// The highest token per resource, in memory.
#[derive(Default)]
struct MemoryStore {
    highest: Mutex<BTreeMap<String, FencingToken>>,
    slots: Slots,
}

impl EpochStore for MemoryStore {
    fn admit<'a>(
        &'a self,
        resource: &'a str,
        token: FencingToken,
    ) -> BoxFuture<'a, Result<Admission, StoreError>> {
        Box::pin(async move {
            // 1. Exclusive use of the resource for the whole forward (`Slots::lock`; the redb
            //    store shares it among writes of one token with `Slots::share`).
            let guard = self.slots.lock(resource, LOCK_WAIT).await?;
            // 2. Check and record (a durable store commits here, before returning).
            // Poisoned only if a holder panicked; holders only look up and insert.
            let mut highest = self.highest.lock().expect("no holder of `highest` panics");
            let current = highest.get(resource).copied().unwrap_or_default();
            if token < current {
                return Ok(Admission::Stale { highest: current });
            }
            highest.insert(resource.to_owned(), token);
            // 3. Hand out a permit that holds the guard until the forward's outcome is known.
            Ok(Admission::Accepted(Permit::new(
                resource,
                token,
                MemoryPermit {
                    guard,
                    released: false,
                },
            )))
        })
    }

    fn kind(&self) -> &'static str {
        "memory"
    }
}

struct MemoryPermit {
    guard: SlotGuard,
    /// Set by `release`: a permit dropped without it (its write was cut off, say at shutdown,
    /// where nothing spawned for it runs) must keep the resource closed all the same.
    released: bool,
}

impl PermitRelease for MemoryPermit {
    fn release(
        mut self: Box<Self>,
        outcome: ForwardOutcome,
    ) -> BoxFuture<'static, Result<(), StoreError>> {
        if outcome == ForwardOutcome::Unknown {
            self.guard.quarantine(QUARANTINE);
        }
        self.released = true;
        drop(self);
        Box::pin(async { Ok(()) })
    }
}

impl Drop for MemoryPermit {
    fn drop(&mut self) {
        // Its write may have been sent an instant before: wait out its forward too.
        if !self.released {
            self.guard.quarantine(UPSTREAM_TIMEOUT + QUARANTINE);
        }
    }
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let shutdown = CancellationToken::new();

    // A stand-in for the storage that cannot check tokens: it answers 200 to everything.
    let upstream = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    let upstream_addr = upstream.local_addr()?;
    tokio::spawn(async move {
        while let Ok((stream, _)) = upstream.accept().await {
            let service = hyper::service::service_fn(|_req| async {
                Ok::<_, std::convert::Infallible>(hyper::Response::new(Full::new(Bytes::from(
                    "stored\n",
                ))))
            });
            tokio::spawn(
                hyper::server::conn::http1::Builder::new()
                    .serve_connection(TokioIo::new(stream), service),
            );
        }
    });

    // The proxy, with our store.
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    let proxy_addr = listener.local_addr()?;
    let config = ProxyConfig {
        upstream: format!("http://{upstream_addr}")
            .parse::<Upstream>()
            .map_err(anyhow::Error::msg)?,
        upstream_timeout: UPSTREAM_TIMEOUT,
        verification: None,
        resource_binding: ResourceBinding::Off,
        // Every request with a body closes its upstream connection (the safe default).
        reuse_after_body: false,
    };
    let store: Arc<dyn EpochStore> = Arc::new(MemoryStore::default());
    let server = tokio::spawn(fence_proxy_http::serve(
        listener,
        store,
        config,
        64,
        shutdown.clone(),
    ));

    let client = Client::builder(TokioExecutor::new()).build_http::<Full<Bytes>>();
    let mut statuses = Vec::new();
    for token in ["7", "8", "7"] {
        let request = hyper::Request::put(format!("http://{proxy_addr}/orders/42"))
            .header("Lock-Resource", "orders/42")
            .header("Fencing-Token", token)
            .body(Full::new(Bytes::from("payload")))?;
        let response = client.request(request).await?;
        let status = response.status().as_u16();
        let reason = response
            .headers()
            .get("fence-proxy-error")
            .map(|v| v.to_str().unwrap_or("?").to_owned());
        let body = response.into_body().collect().await?.to_bytes();
        println!(
            "PUT token {token}: {status} {} {}",
            reason.unwrap_or_default(),
            String::from_utf8_lossy(&body).trim()
        );
        statuses.push(status);
    }
    shutdown.cancel();
    server.await??;
    anyhow::ensure!(
        statuses == [200, 200, 412],
        "expected 200, 200, 412, got {statuses:?}"
    );
    Ok(())
}
