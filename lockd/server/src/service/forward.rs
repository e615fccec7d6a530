//! `lockd.raft.v1.Forward`, on the leader: the calls a follower forwards over one long-lived
//! stream (`crate::forwarder` sends them), served as if each had been forwarded alone.
//!
//! Each call is authorized again with the identity the sending node names and served by the
//! same code as a unary forwarded call ([`LockService::serve_streamed`]); replies go back on the
//! response stream in batches, in the order the calls finish. A forwarded call costs the leader
//! a decode and an encode on a stream that is already open, instead of an HTTP/2 stream of its
//! own (HEADERS, HPACK, trailers) and a pass through the gRPC stack.
//!
//! Bounds: at most [`IN_FLIGHT_MAX`] calls of one stream are served or wait to be sent back at
//! once; past that the stream is not read, so HTTP/2 flow control holds the sender back. A
//! message is at most [`MESSAGE_MAX_BYTES`].
//!
//! Only members send here: the Raft service's [`PeerAuth`] checks the caller when the stream
//! opens (on a plaintext loopback port: that it is a process of this node's user,
//! `crate::local_peer`), that it is of this cluster incarnation (the restore id), and again before every message with the membership and certificates current then (a
//! removed member, a certificate revoked by a reload or expired, is refused mid-stream: its calls
//! are answered UNAUTHENTICATED unserved, and the stream ends).
//!
//! [`PeerAuth`]: crate::service::raft::PeerAuth

use std::pin::Pin;
use std::sync::Arc;

use futures::Stream;
use tokio::sync::{OwnedSemaphorePermit, Semaphore, mpsc};
use tokio_util::sync::CancellationToken;
use tonic::service::interceptor::InterceptedService;
use tonic::{Request, Response, Status, Streaming};

use super::lock::LockService;
use super::raft::{PeerAuth, PeerCredentials, authenticated_member, pb};
use crate::node::NodeCtx;
use crate::raft::{peer_protocol, restore_id};

/// Calls of one stream served at once, as many as one connection may have unary calls open
/// (`node::STREAMS_PER_CONNECTION_MAX`); the proposer's queue holds 8,192 for all callers.
pub(crate) const IN_FLIGHT_MAX: usize = 1_024;
/// Largest message either way: a batch is cut at [`BATCH_BYTES_MAX`] plus one call, and a call
/// is a client request of at most 64 KiB.
pub(crate) const MESSAGE_MAX_BYTES: usize = 2 * 1024 * 1024;
/// A batch (of calls or of replies) is closed once its encoding passes this size.
pub(crate) const BATCH_BYTES_MAX: usize = 1024 * 1024;
/// Replies put into one message at most.
const REPLIES_PER_MESSAGE_MAX: usize = 1_024;

pub(crate) struct ForwardService {
    lock: Arc<LockService>,
    /// Checks the sender again before each message.
    auth: Arc<PeerAuth>,
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
            auth: auth.clone(),
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
        // A member of another cluster incarnation (founded apart on the same addresses, or
        // restored apart) forwards nothing here, as its Raft messages move nothing
        // (`INV-INCARNATION`). Every follower that opens this stream sends its id.
        let restore = &self.ctx.members.dial().restore;
        restore
            .check(&sender, restore_id::from_metadata(req.metadata()))
            .map_err(|why| {
                restore.log_mismatch(&why);
                super::errors::precondition("restore_id", why)
            })?;

        let credentials = PeerCredentials::of(&req);
        let mut inbound = req.into_inner();
        // A reply travels with its call's permit, so replies not yet sent back count too.
        let (replies_tx, replies_rx) = mpsc::unbounded_channel::<Answered>();
        let permits = Arc::new(Semaphore::new(IN_FLIGHT_MAX));
        let (lock, auth, shutdown, id) = (
            self.lock.clone(),
            self.auth.clone(),
            self.shutdown.clone(),
            self.ctx.id,
        );
        // Reads the calls and serves each in a task of its own; replies meet in `replies_tx`.
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
                let still = auth.identify_credentials(&credentials);
                if still != Ok(from) {
                    tracing::warn!(
                        node = id,
                        sender = ?from,
                        reason = ?still,
                        "lockd: ended a forward stream whose sender is no longer authenticated as a member"
                    );
                    for call in batch.calls {
                        let refused = super::errors::unauthenticated(
                            "forwarded call refused: the forwarding node is no longer \
                             authenticated as a member of this cluster; nothing was done",
                        );
                        let _ = replies_tx.send((status_reply(call.id, refused), None));
                    }
                    return;
                }
                for call in batch.calls {
                    let permit = tokio::select! {
                        _ = shutdown.cancelled() => return,
                        p = permits.clone().acquire_owned() => match p {
                            Ok(p) => p,
                            Err(_) => return,
                        },
                    };
                    let (lock, tx) = (lock.clone(), replies_tx.clone());
                    tokio::spawn(async move {
                        let reply = lock.serve_streamed(from, call).await;
                        let _ = tx.send((reply, Some(permit)));
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

/// A reply and the permit of its call, released when the reply is taken into a message.
type Answered = (pb::ForwardReply, Option<OwnedSemaphorePermit>);

/// A call's reply carrying `status`, as the client would receive it.
pub(crate) fn status_reply(id: u64, status: Status) -> pb::ForwardReply {
    pb::ForwardReply {
        id,
        result: Some(pb::forward_reply::Result::Status(pb::ForwardedStatus {
            code: status.code() as i32,
            message: status.message().to_owned(),
            details: status.details().to_vec(),
        })),
    }
}

/// The replies as they come, each message holding every reply that was ready when it was cut.
/// Ends when the node shuts down or when every call of the stream was answered and the sender
/// closed its side.
fn reply_batches(
    rx: mpsc::UnboundedReceiver<Answered>,
    shutdown: CancellationToken,
) -> impl Stream<Item = Result<pb::ForwardReplies, Status>> + Send {
    futures::stream::unfold((rx, shutdown), |(mut rx, shutdown)| async move {
        let (first, _permit) = tokio::select! {
            _ = shutdown.cancelled() => return None,
            r = rx.recv() => r?,
        };
        let mut bytes = prost::Message::encoded_len(&first);
        let mut replies = vec![first];
        while replies.len() < REPLIES_PER_MESSAGE_MAX && bytes < BATCH_BYTES_MAX {
            match rx.try_recv() {
                Ok((r, _permit)) => {
                    bytes += prost::Message::encoded_len(&r);
                    replies.push(r);
                }
                Err(_) => break,
            }
        }
        Some((Ok(pb::ForwardReplies { replies }), (rx, shutdown)))
    })
}
