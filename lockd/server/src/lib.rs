//! The lockd daemon: the lock table of `lockd-core`, replicated by openraft, persisted in redb and
//! served over gRPC.
//!
//! It does not decide lock semantics (that is `lockd-core`, pure and deterministic) and it does
//! not define the wire format (that is `lockd-api`).
//!
//! # Layout
//! - [`auth`]: who calls (certificate, token, forwarding node) and what the policy lets them do.
//! - [`config`]: flags and tuning of a node.
//! - [`node`]: wiring of one node and its background tasks (reaper, leadership watcher).
//! - [`raft`]: openraft type configuration and the peer network.
//! - `members`: the other members, from the Raft membership, and channels to them.
//! - [`storage`]: the redb log store and the state machine with its snapshots.
//! - [`receiving`]: what a call may hold while it arrives (bytes per source, time).
//! - [`local_peer`]: on a plaintext loopback port, internal services for this user's processes only.
//! - [`connections`], [`flow_watch`]: what a connection may hold (places, time to speak, answers
//!   and bytes its client does not take, the HTTP/2 windows it grants).
//! - `proposer`: group commit of client commands into Raft entries.
//! - `forwarder`: a follower's calls to the leader, many per message on one stream.
//! - `waiters`: calls parked until the log grants them.
//! - [`parked`]: the places of parked waiting calls, per source address and per node.
//! - `signing`: signing grants with the replicated sequencer key, and installing it.
//! - [`service`]: the gRPC services and the status-code table.
//! - `observe`: metrics and health endpoints.
//! - `clock`: the leader's stamp clock.
//! - [`dev`]: `lockd dev`, three nodes in one process.
//! - [`backup`]: the backup file (`Cluster.SaveSnapshot`, `lockctl snapshot save`) and
//!   `lockd restore`, which seeds a new cluster from it.
//!
//! The modules named without a link are internal to the crate.

pub mod auth;
pub mod backup;
pub(crate) mod clock;
pub mod config;
pub mod connections;
pub mod dev;
/// The HTTP/2 window watch, shared with fence-proxy's HTTP front end.
pub use lockd_service_kit::flow_watch;
pub(crate) mod forwarder;
pub mod local_peer;
pub(crate) mod members;
pub mod node;
pub(crate) mod observe;
pub mod parked;
pub(crate) mod proposer;
pub mod raft;
pub(crate) mod read_barrier;
pub mod receiving;
pub(crate) mod resolve;
pub mod service;
pub(crate) mod signing;
pub mod storage;
pub mod tls;
pub(crate) mod waiters;

/// Resolves when the process receives SIGINT or SIGTERM.
pub async fn shutdown_signal() {
    use tokio::signal::unix::{SignalKind, signal};
    let mut term = signal(SignalKind::terminate()).expect("installing SIGTERM handler");
    tokio::select! {
        _ = tokio::signal::ctrl_c() => {}
        _ = term.recv() => {}
    }
}
