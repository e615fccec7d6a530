//! Who may do what: the trust boundary of the replication port, TLS towards clients and
//! certificate reload, and identity and authorization of clients (tenants, bearer tokens,
//! forwarded identities, the policy).
//!
//! # Layout
//! - `connections`: what silent connections can hold on a node's port.
//! - `requests`: what calls that never finish arriving can hold.
//! - `windows`: what a client's HTTP/2 windows and unread socket can make a node hold.
//! - `replication`: forged Raft messages are refused and change nothing; the plaintext mode's checks.
//! - `loopback`: a plaintext loopback port serves its internal services to its own user only.
//! - `dev`: `lockd dev` stays on loopback and keeps admin calls to its own user, with TLS too.
//! - `transport`: `lockctl` over TLS, certificate reload under load.
//! - `authz`: tenants, request ids, bearer tokens, forwarded identities and the policy's checks.

#![allow(
    clippy::unwrap_used,
    reason = "test code: a failed unwrap is a failed test, with its message"
)]

mod authz;
mod connections;
#[cfg(target_os = "linux")]
mod dev;
#[cfg(target_os = "linux")]
mod loopback;
mod replication;
mod requests;
mod transport;
mod windows;
