//! The HTTP front end of fence-proxy: a reverse proxy that forwards a write to the upstream only
//! when its fencing token is not lower than the highest accepted for its resource, and keeps the
//! writes of one resource in token order at the upstream.
//!
//! It does not speak HTTP upgrades (WebSocket) or decide anything about tokens itself: the epoch
//! store (`fence-epoch-store`) decides, and orders the writes of one resource by token.
//!
//! # Layout
//! - [`args`]: [`Args`], the command-line flags of `fence-proxy http`.
//! - [`proxy`]: [`Proxy`], the request handler (fence check, forward, permit release).
//! - [`exchange`]: [`exchange::TrackedBody`], following a write's bodies to their end so that
//!   the permit is released only then.
//! - [`refusal`]: [`Refusal`], the table from each refusal to status, reason and JSON body.
//! - [`fence`]: reading `Lock-Resource`, `Fencing-Token` and `Lock-Sequencer` from a request.
//! - [`binding`]: [`ResourceBinding`], `--bind-resource`: whether the resource must name the path.
//! - [`verify`]: [`Verification`], the verify keys and whether plain tokens still pass.
//! - [`metrics`]: metric names shared with the Postgres front end.
//! - [`ready`]: what `/readyz` watches (the epoch store and the upstream).
//! - [`server`]: accepting connections, graceful shutdown, [`serve`], [`run`] and
//!   [`run_with_reload`] (certificates read again on demand).
//! - [`tls`]: TLS on the listener, the client allow-list, and the https upstream connector.
//! - [`upstream`]: [`upstream::UpstreamPool`], the read path's upstream connections, driven by
//!   the task that forwards each read.

pub mod args;
pub mod binding;
pub mod exchange;
pub mod fence;
pub mod metrics;
mod per_client;
pub mod proxy;
pub mod ready;
pub mod refusal;
pub mod server;
pub mod tls;
pub mod upstream;
pub mod verify;

pub use args::{Args, Upstream};
pub use binding::ResourceBinding;
pub use proxy::{Proxy, ProxyConfig};
pub use refusal::Refusal;
pub use server::{run, run_with_reload, serve};
pub use verify::Verification;
