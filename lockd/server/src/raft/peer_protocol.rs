//! The peer protocol version: which forms of Raft messages, log entries and snapshots a node
//! reads and writes, announced on every message so that nodes of two releases can run side by
//! side during a rolling upgrade (docs/operations.md, "Rolling upgrades").
//!
//! Every Raft message and reply, `CurrentVote` included, carries [`HEADER`] with the highest
//! version its sender speaks. A message without it comes from a node of protocol 1: lockd from
//! commit 736cb38 (entries of `AcquireV2`) up to the commit that added the header. Builds older
//! than 736cb38 send no header either but cannot read today's entries; they are outside the
//! supported skew and must not run in a mixed cluster (README, Upgrading).
//!
//! The rules every change of a format follows:
//! - This build reads and writes every version from [`OLDEST`] to [`CURRENT`]. A node refuses
//!   a message whose sender announces a version below [`OLDEST`] (FAILED_PRECONDITION naming
//!   both), so a node two releases behind fails loudly instead of misreading what it receives.
//!   A higher version than [`CURRENT`] is accepted: a newer node writes only forms that every
//!   member reads (next rule), which is what makes the skew of one release safe.
//! - A new form of an entry, message or snapshot gets a new [`CURRENT`] and is written only once
//!   every member of the configuration has announced that version ([`PeerProtocols::cluster`]);
//!   until then the node writes the older form, which the newer nodes keep reading.
//! - [`OLDEST`] rises to the previous [`CURRENT`] one release later, when the older forms'
//!   writers go.
//!
//! Version 2 changes no encoding: it is the first to announce itself. Version 3 changes none
//! either: its nodes serve the forward stream (`lockd.raft.v1.Forward`), which a follower uses
//! only with a leader that announced 3 or later (`crate::forwarder`); with an older leader it
//! forwards one call at a time, as before. Version 4 changes none either: its nodes send their
//! restore id (`raft::restore_id`) and their version on every call they forward, unary calls
//! included ([`FORWARDS_RESTORE_ID`]), so a leader that has a restore id refuses a forwarded call
//! without one from a member of version 4 or later. What each node last
//! announced is exported as `lockd_peer_protocol{peer}`, and the version every member speaks as
//! `lockd_cluster_peer_protocol`: an upgrade is complete when the leader's reads [`CURRENT`]
//! (a follower hears only from the leader and counts the other followers as [`OLDEST`]).

use std::collections::HashMap;
use std::sync::Mutex;
use std::time::{Duration, Instant};

use tonic::metadata::MetadataMap;

use super::NodeId;

/// gRPC metadata of every Raft message and reply: the sender's highest peer protocol version.
pub(crate) const HEADER: &str = "lockd-peer-protocol";

/// The version this build writes when every member speaks it.
pub const CURRENT: u32 = 4;

/// The first version whose nodes send their restore id on every call they forward, unary calls
/// included. Nodes of version 3 send it on the forward stream, but on unary forwards only the
/// builds since commit b4d725d do: a version-3 call without it may come from a member in the
/// middle of a rolling upgrade, and is taken.
pub const FORWARDS_RESTORE_ID: u32 = 4;

/// The oldest version this build reads and writes; members below it are refused.
pub const OLDEST: u32 = 1;

/// The version of a sender that announces none (lockd before the header).
const UNANNOUNCED: u32 = 1;

/// Adds this node's version to outgoing metadata.
pub(crate) fn attach(md: &mut MetadataMap) {
    md.insert(HEADER, tonic::metadata::MetadataValue::from(CURRENT));
}

/// The version a message or reply announces: [`UNANNOUNCED`] without the header. A header that
/// is not a number is refused with the value.
pub(crate) fn announced(md: &MetadataMap) -> Result<u32, String> {
    let Some(value) = md.get(HEADER) else {
        return Ok(UNANNOUNCED);
    };
    value
        .to_str()
        .ok()
        .and_then(|v| v.parse::<u32>().ok())
        .filter(|v| *v >= 1)
        .ok_or_else(|| {
            format!("lockd: peer protocol version {value:?} in {HEADER} is not a number from 1 up")
        })
}

/// Whether this build works with a member that announced `theirs`; the error names both
/// versions and what to do.
pub(crate) fn check(peer: &str, theirs: u32) -> Result<(), String> {
    supported(peer, theirs, OLDEST)
}

fn supported(peer: &str, theirs: u32, oldest: u32) -> Result<(), String> {
    if theirs >= oldest {
        return Ok(());
    }
    Err(format!(
        "peer protocol mismatch: {peer} speaks peer protocol {theirs}, this lockd speaks \
         {oldest} to {CURRENT}: upgrade {peer} to a release of protocol {oldest} or later \
         first (one release at a time, docs/operations.md, Rolling upgrades)"
    ))
}

/// At most one refusal per this interval reaches the log (a refused member retries every
/// heartbeat).
const LOG_EVERY: Duration = Duration::from_secs(10);

/// The versions the members of this node's cluster last announced.
#[derive(Debug, Default)]
pub struct PeerProtocols {
    seen: Mutex<HashMap<NodeId, u32>>,
    last_logged: Mutex<Option<Instant>>,
}

impl PeerProtocols {
    /// Logs a refusal (this node's of a member, or a member's of this node), at most once per
    /// [`LOG_EVERY`].
    pub(crate) fn log_refusal(&self, why: &str) {
        let mut last = self.last_logged.lock().expect("peer protocol log lock");
        if last.is_none_or(|t| t.elapsed() >= LOG_EVERY) {
            *last = Some(Instant::now());
            tracing::warn!("{why}");
        }
    }

    /// Records what `peer` announced on a message or reply that passed [`check`].
    pub(crate) fn record(&self, peer: NodeId, version: u32) {
        self.seen
            .lock()
            .expect("peer protocol lock")
            .insert(peer, version);
    }

    /// What `peer` last announced, if this node heard from it since it started.
    pub fn of(&self, peer: NodeId) -> Option<u32> {
        self.seen
            .lock()
            .expect("peer protocol lock")
            .get(&peer)
            .copied()
    }

    /// The version every one of `members` speaks: the lowest announced, where a member not
    /// heard from counts as [`OLDEST`] (it may run the oldest release this build works with).
    /// `self_id` speaks [`CURRENT`].
    pub fn cluster(&self, self_id: NodeId, members: impl IntoIterator<Item = NodeId>) -> u32 {
        let seen = self.seen.lock().expect("peer protocol lock");
        members
            .into_iter()
            .map(|id| {
                if id == self_id {
                    CURRENT
                } else {
                    seen.get(&id).copied().unwrap_or(OLDEST).min(CURRENT)
                }
            })
            .min()
            .unwrap_or(CURRENT)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_message_without_the_header_is_of_protocol_1() {
        assert_eq!(announced(&MetadataMap::new()), Ok(1));
    }

    #[test]
    fn the_announced_version_round_trips_and_garbage_is_refused_with_the_value() {
        let mut md = MetadataMap::new();
        attach(&mut md);
        assert_eq!(announced(&md), Ok(CURRENT));
        md.insert(HEADER, "two".parse().unwrap());
        let e = announced(&md).unwrap_err();
        assert!(e.contains("\"two\"") && e.contains(HEADER), "{e}");
        md.insert(HEADER, "0".parse().unwrap());
        assert!(announced(&md).is_err());
    }

    #[test]
    fn members_below_the_oldest_version_are_refused_newer_ones_are_not() {
        assert!(supported("node 2", 1, 1).is_ok());
        assert!(supported("node 2", CURRENT + 1, 1).is_ok());
        let e = supported("node 2", 1, 2).unwrap_err();
        assert!(
            e.contains("node 2 speaks peer protocol 1") && e.contains("2 to"),
            "{e}"
        );
    }

    #[test]
    fn the_cluster_speaks_what_its_oldest_member_announced() {
        let p = PeerProtocols::default();
        // Not heard from: counted as the oldest supported.
        assert_eq!(p.cluster(1, [1, 2, 3]), OLDEST);
        p.record(2, CURRENT);
        p.record(3, 1);
        assert_eq!(p.cluster(1, [1, 2, 3]), 1);
        p.record(3, CURRENT);
        assert_eq!(p.cluster(1, [1, 2, 3]), CURRENT);
        // A newer member does not raise the cluster above what this build writes.
        p.record(3, CURRENT + 1);
        assert_eq!(p.cluster(1, [1, 2, 3]), CURRENT);
        assert_eq!(p.of(3), Some(CURRENT + 1));
        assert_eq!(p.of(4), None);
    }
}
