//! gRPC services: the public `lockd.v1.Lock` and `lockd.v1.Cluster`, and the internal
//! replication service. `errors` is the one table from outcome to status code.

pub(crate) mod cluster;
pub(crate) mod errors;
pub(crate) mod forward;
pub(crate) mod lock;
pub(crate) mod membership;
pub mod raft;
pub(crate) mod snapshot;
