//! [`Client::save_snapshot`]: the admin call that streams a backup from the leader.

use lockd_api::v1::cluster_client::ClusterClient;
use lockd_api::v1::{SaveSnapshotRequest, SaveSnapshotResponse};
use tokio::time::Instant;

use super::{CallCtx, Client};
use crate::error::{Error, Op};

impl Client {
    /// Admin: starts a backup of the state machine on the leader (any node forwards) and returns
    /// its stream: the bytes of the backup file in order, then one message with the summary
    /// (size, SHA-256, last applied index, last fencing token). Retries until a node starts the
    /// stream, within the call timeout; a stream that fails later must be started again (the
    /// caller owns what it has written so far).
    pub async fn save_snapshot(&self) -> Result<tonic::Streaming<SaveSnapshotResponse>, Error> {
        let ctx = CallCtx {
            op: Op::SaveSnapshot,
            resource: None,
            request_id: None,
            deadline: Instant::now() + self.inner.config.call_timeout,
            attempt_timeout: self.inner.config.attempt_timeout,
            sent_before: false,
        };
        self.call(&ctx, |channel| {
            let request = self.authed(SaveSnapshotRequest {});
            async move { ClusterClient::new(channel).save_snapshot(request).await }
        })
        .await
        .map(|a| a.value)
        .map_err(|f| self.failed(f, &ctx, None, std::time::Duration::ZERO))
    }
}
