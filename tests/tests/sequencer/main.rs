//! Signed sequencers: lockd signs every grant with the cluster's replicated Ed25519 key
//! (server side), and fence-proxy with `--verify-key` accepts a write only with a sequencer that
//! verifies offline (proxy side).
//!
//! # Layout
//! - `server`: sequencers from real three-node clusters, across failover, snapshots, restarts and
//!   key rotation.
//! - `proxy`: both front ends of fence-proxy verifying sequencers.

#![allow(
    clippy::unwrap_used,
    reason = "test code: a failed unwrap is a failed test, with its message"
)]

mod proxy;
mod server;
