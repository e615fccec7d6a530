//! Generated types and gRPC stubs of the public lockd API, package `lockd.v1`.
//!
//! This crate has no server logic and pulls in neither openraft nor redb, so clients, the proxy and
//! the adapters can depend on it cheaply.
//!
//! # Layout
//! - [`v1`]: messages and the `Lock` / `Cluster` clients and servers generated from
//!   `proto/lockd/v1/lockd.proto`.

/// The `lockd.v1` package.
pub mod v1 {
    tonic::include_proto!("lockd.v1");
}

/// gRPC metadata key a node sets when it forwards a client call to the leader, so the receiver
/// never forwards it again (no forwarding loops during leader changes).
pub const FORWARDED_HEADER: &str = "lockd-forwarded-by";
