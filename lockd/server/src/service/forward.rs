//! `lockd.raft.v1.Forward`, on the leader: the calls a follower forwards over one long-lived
//! stream (`crate::forwarder` sends them), served as if each had been forwarded alone.
//!
//! Each call is authorized again with the identity the sending node names and served by the
//! same code as a unary forwarded call ([`LockService::serve_streamed`]); replies go back on the
//! response stream in batches, in the order the calls finish. A forwarded call costs the leader
//! a decode and an encode on a stream that is already open, instead of an HTTP/2 stream of its
//! own (HEADERS, HPACK, trailers) and a pass through the gRPC stack.
//!
//! Bounds: at most [`IN_FLIGHT_MAX`] calls of one stream are served at once; past that the
//! stream is not read, so HTTP/2 flow control holds the sender back. A message is at most
//! [`MESSAGE_MAX_BYTES`]. Only members send here (the Raft service's [`PeerAuth`]).
//!
//! [`PeerAuth`]: crate::service::raft::PeerAuth

use std::pin::Pin;
use std::sync::Arc;

use futures::Stream;
use tokio::sync::{Semaphore, mpsc};
use tokio_util::sync::CancellationToken;
use tonic::service::interceptor::InterceptedService;
use tonic::{Request, Response, Status, Streaming};

use super::lock::LockService;
use super::raft::{PeerAuth, authenticated_member, pb};
use crate::node::NodeCtx;
use crate::raft::peer_protocol;

/// Calls of one stream served at once (the proposer's queue is 8,192 commands for all callers).
pub(crate) const IN_FLIGHT_MAX: usize = 4_096;
/// Largest message either way: a batch is cut at [`BATCH_BYTES_MAX`] plus one call, and a call
/// is a client request of at most 64 KiB.
pub(crate) const MESSAGE_MAX_BYTES: usize = 2 * 1024 * 1024;
/// A batch (of calls or of replies) is closed once its encoding passes this size.
pub(crate) const BATCH_BYTES_MAX: usize = 1024 * 1024;
/// Replies put into one message at most.
const REPLIES_PER_MESSAGE_MAX: usize = 1_024;

pub(crate) struct ForwardService {
    lock: Arc<LockService>,
    ctx: Arc<NodeCtx>,
    /// The node's shutdown: open streams end with it, so that a graceful stop is not held up by a
    /// follower's stream, which never ends by itself.
    shutdown: CancellationToken,
}

impl ForwardService {
    pub fn server(
        ctx: Arc<NodeCtx>,
        auth: Arc<PeerAuth>,
        shutdown: CancellationToken,
    ) -> InterceptedService<
        pb::forward_server::ForwardServer<Self>,
        impl tonic::service::Interceptor + Clone,
    > {
        let server = pb::forward_server::ForwardServer::new(ForwardService {
            lock: Arc::new(LockService::new(ctx.clone())),
            ctx,
            shutdown,
        })
        .max_decoding_message_size(MESSAGE_MAX_BYTES)
        .max_encoding_message_size(MESSAGE_MAX_BYTES);
        InterceptedService::new(server, move |req| auth.intercept(req))
    }
}

type ReplyStream = Pin<Box<dyn Stream<Item = Result<pb::ForwardReplies, Status>> + Send>>;

#[tonic::async_trait]
impl pb::forward_server::Forward for ForwardService {
    type CallsStream = ReplyStream;

    async fn calls(
        &self,
        req: Request<Streaming<pb::ForwardBatch>>,
    ) -> Result<Response<ReplyStream>, Status> {
        let from = authenticated_member(&req)?;
        let version = peer_protocol::announced(req.metadata())
            .map_err(|why| super::errors::precondition("peer_protocol", why))?;
        let sender = from.map_or_else(|| "the sending node".to_owned(), |n| format!("node {n}"));
        peer_protocol::check(&sender, version)
            .map_err(|why| super::errors::precondition("peer_protocol", why))?;

        let mut inbound = req.into_inner();
        let (replies_tx, replies_rx) = mpsc::unbounded_channel::<pb::ForwardReply>();
        let permits = Arc::new(Semaphore::new(IN_FLIGHT_MAX));
        let (lock, shutdown, id) = (self.lock.clone(), self.shutdown.clone(), self.ctx.id);
        // Reads the calls and serves each in a task of its own; replies meet in `replies_tx`.
        // The channel is unbounded, but what is in it is bounded by the permits: a reply is sent
        // by a task that still holds one.
        tokio::spawn(async move {
            loop {
                let batch = tokio::select! {
                    _ = shutdown.cancelled() => return,
                    m = inbound.message() => m,
                };
                let batch = match batch {
                    Ok(Some(b)) => b,
                    Ok(None) => return,
                    Err(e) => {
                        tracing::debug!(node = id, error = %e, "lockd: a forward stream ended");
                        return;
                    }
                };
                for call in batch.calls {
                    let Ok(permit) = permits.clone().acquire_owned().await else {
                        return;
                    };
                    let (lock, tx) = (lock.clone(), replies_tx.clone());
                    tokio::spawn(async move {
                        let reply = lock.serve_streamed(from, call).await;
                        let _ = tx.send(reply);
                        drop(permit);
                    });
                }
            }
        });
        Ok(Response::new(Box::pin(reply_batches(
            replies_rx,
            self.shutdown.clone(),
        ))))
    }
}

/// The replies as they come, each message holding every reply that was ready when it was cut.
/// Ends when the node shuts down or when every call of the stream was answered and the sender
/// closed its side.
fn reply_batches(
    rx: mpsc::UnboundedReceiver<pb::ForwardReply>,
    shutdown: CancellationToken,
) -> impl Stream<Item = Result<pb::ForwardReplies, Status>> + Send {
    futures::stream::unfold((rx, shutdown), |(mut rx, shutdown)| async move {
        let first = tokio::select! {
            _ = shutdown.cancelled() => return None,
            r = rx.recv() => r?,
        };
        let mut bytes = prost::Message::encoded_len(&first);
        let mut replies = vec![first];
        while replies.len() < REPLIES_PER_MESSAGE_MAX && bytes < BATCH_BYTES_MAX {
            match rx.try_recv() {
                Ok(r) => {
                    bytes += prost::Message::encoded_len(&r);
                    replies.push(r);
                }
                Err(_) => break,
            }
        }
        Some((Ok(pb::ForwardReplies { replies }), (rx, shutdown)))
    })
}
