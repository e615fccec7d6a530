//! openraft type configuration, the network between nodes, the vote gate of a node that
//! rejoins with an empty data dir, the restore id that keeps restored clusters apart, and the
//! peer protocol version that lets two releases run side by side.

pub(crate) mod network;
pub(crate) mod peer_protocol;
pub(crate) mod restore_id;
pub(crate) mod vote_gate;

use lockd_core::{Batch, Outcome};
use serde::{Deserialize, Serialize};

/// What a committed batch answers: one outcome per command, in order.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct BatchResponse(pub Vec<Outcome>);

openraft::declare_raft_types!(
    /// lockd's Raft: entries carry command batches; node ids are the `--id` numbers.
    pub TypeConfig:
        D = Batch,
        R = BatchResponse,
        NodeId = u64,
        Node = openraft::BasicNode,
        Entry = openraft::Entry<TypeConfig>,
        // A file, not a buffer: a snapshot is sent and received in chunks without holding it
        // in memory (see storage/snapshot_data.rs).
        SnapshotData = crate::storage::snapshot_data::SnapshotData,
        AsyncRuntime = openraft::TokioRuntime,
);

/// A node's `--id`.
pub type NodeId = u64;
/// The openraft handle of a node.
pub type Raft = openraft::Raft<TypeConfig>;
/// A log position: the term of its leader and its index.
pub type LogId = openraft::LogId<NodeId>;
/// A storage failure as openraft reports it.
pub type StorageError = openraft::StorageError<NodeId>;
