//! Forwarding a follower's calls to the leader over one long-lived stream (`lockd.raft.v1.Forward`,
//! served by `service::forward`).
//!
//! A call that does not wait for a lock (Acquire without `wait_timeout_ms`, Renew, Release) and
//! reaches a follower goes into the queue of the follower's link to the leader; the link's task
//! puts everything queued into one message and reads the replies as they come. Under load one
//! message carries many calls, and even a message of one call costs a DATA frame instead of an
//! HTTP/2 stream of its own. A waiting Acquire and Describe are forwarded one call at a time
//! (`service::lock`): a caller that goes away must end its wait on the leader, which dropping a
//! unary call does.
//!
//! What a caller learns, as for a unary forward: the leader's answer; or, if the link could not
//! be opened because the leader refused the connection, the transport error (nothing was done);
//! otherwise (the stream broke, the leader stopped, no answer within the call's budget) that the
//! outcome is unknown. A link serves one leader: when another node leads, calls go to a new link,
//! and the old one ends once its calls are answered.
//!
//! The stream is used only with a leader that announced peer protocol 3 or later
//! (`raft::peer_protocol`); an older leader (a rolling upgrade) gets unary forwards.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::sync::{mpsc, oneshot};
use tokio_stream::wrappers::ReceiverStream;
use tokio_util::sync::CancellationToken;
use tonic::Status;

use crate::members::Members;
use crate::raft::NodeId;
use crate::raft::peer_protocol::{self, PeerProtocols};
use crate::service::forward::{BATCH_BYTES_MAX, MESSAGE_MAX_BYTES};
use crate::service::raft::pb::{self, forward_client::ForwardClient};
use crate::tls::CLUSTER_ID_HEADER;

/// The first peer protocol version whose nodes serve the forward stream.
pub(crate) const STREAM_PROTOCOL: u32 = 3;
/// Calls waiting for their link's task at most; a caller past it waits for room.
const QUEUE_MAX: usize = 4_096;
/// Calls put into one message at most.
const CALLS_PER_MESSAGE_MAX: usize = 1_024;
/// Messages written but not yet taken by the HTTP/2 connection, per link.
const OUTBOUND_MESSAGES_MAX: usize = 16;

/// A call's answer from the leader, or why there is none.
pub(crate) type Answer = Result<pb::forward_reply::Result, Status>;

/// A call waiting for its link's task.
struct Queued {
    call: pb::ForwardedCall,
    answer: oneshot::Sender<Answer>,
}

/// The follower's links to the leader, one per leader it forwarded to (in practice one).
pub(crate) struct Forwarder {
    members: Arc<Members>,
    protocols: Arc<PeerProtocols>,
    shutdown: CancellationToken,
    links: Mutex<HashMap<NodeId, mpsc::Sender<Queued>>>,
}

impl Forwarder {
    pub fn new(
        members: Arc<Members>,
        protocols: Arc<PeerProtocols>,
        shutdown: CancellationToken,
    ) -> Self {
        Forwarder {
            members,
            protocols,
            shutdown,
            links: Mutex::new(HashMap::new()),
        }
    }

    /// Whether calls to `leader` go on the stream: it announced a version that serves it.
    pub fn streams_to(&self, leader: NodeId) -> bool {
        self.protocols
            .of(leader)
            .is_some_and(|v| v >= STREAM_PROTOCOL)
    }

    /// Forwards `call` to `leader` on its link and waits up to `timeout` for the answer.
    /// `Err` carries a status of this node, never one of the leader (those are answers): the
    /// caller words it as a failed forward.
    pub async fn call(
        &self,
        leader: NodeId,
        mut call: pb::ForwardedCall,
        timeout: Duration,
    ) -> Answer {
        call.timeout_ms = u32::try_from(timeout.as_millis()).unwrap_or(u32::MAX);
        let (answer, rx) = oneshot::channel();
        let mut queued = Queued { call, answer };
        // A link whose task ended (its stream broke) is replaced once.
        for _ in 0..2 {
            let link = self.link(leader)?;
            match link.send(queued).await {
                Ok(()) => {
                    return match tokio::time::timeout(timeout, rx).await {
                        Ok(Ok(answer)) => answer,
                        Ok(Err(_)) => Err(Status::unavailable(format!(
                            "the forward stream to leader {leader} ended before its answer"
                        ))),
                        Err(_) => Err(Status::deadline_exceeded(format!(
                            "no answer from leader {leader} within {} ms",
                            timeout.as_millis()
                        ))),
                    };
                }
                Err(mpsc::error::SendError(back)) => {
                    queued = back;
                    self.links
                        .lock()
                        .unwrap_or_else(|e| e.into_inner())
                        .remove(&leader);
                }
            }
        }
        // Not sent, so nothing was done.
        Err(crate::service::errors::no_quorum(format!(
            "no forward stream to leader {leader} could be opened; nothing was done, retry"
        )))
    }

    /// The queue of the link to `leader`, opened if there is none (or its task ended). Links to
    /// other nodes are dropped: they end once their calls are answered.
    fn link(&self, leader: NodeId) -> Result<mpsc::Sender<Queued>, Status> {
        let mut links = self.links.lock().unwrap_or_else(|e| e.into_inner());
        links.retain(|node, tx| *node == leader && !tx.is_closed());
        if let Some(tx) = links.get(&leader) {
            return Ok(tx.clone());
        }
        let Some((addr, client)) = self.members.forward_client(leader) else {
            return Err(crate::service::errors::no_quorum(format!(
                "leader {leader} is not a member this node can dial; nothing was done, retry"
            )));
        };
        let (tx, rx) = mpsc::channel(QUEUE_MAX);
        let dial = self.members.dial();
        let mut md = tonic::metadata::MetadataMap::new();
        md.insert(CLUSTER_ID_HEADER, dial.cluster_id.clone());
        dial.restore.attach(&mut md);
        peer_protocol::attach(&mut md);
        tokio::spawn(run_link(
            leader,
            addr,
            client
                .max_decoding_message_size(MESSAGE_MAX_BYTES)
                .max_encoding_message_size(MESSAGE_MAX_BYTES),
            md,
            rx,
            self.shutdown.clone(),
        ));
        links.insert(leader, tx.clone());
        Ok(tx)
    }
}

/// One link: opens the stream, writes the queued calls in batches, hands each reply to its
/// caller. Ends when the stream ends (every call still open learns it), or when the link was
/// dropped and its last call is answered.
async fn run_link(
    leader: NodeId,
    addr: String,
    mut client: ForwardClient<tonic::transport::Channel>,
    metadata: tonic::metadata::MetadataMap,
    mut queue: mpsc::Receiver<Queued>,
    shutdown: CancellationToken,
) {
    let (out, out_rx) = mpsc::channel::<pb::ForwardBatch>(OUTBOUND_MESSAGES_MAX);
    let mut open: HashMap<u64, oneshot::Sender<Answer>> = HashMap::new();
    let mut next_id: u64 = 0;
    // The first calls go out with the stream's headers: the link is made for a call.
    if let Some(batch) = take_batch(&mut queue, &mut open, &mut next_id).await {
        let _ = out.try_send(batch);
    }
    let mut request = tonic::Request::new(ReceiverStream::new(out_rx));
    *request.metadata_mut() = metadata;
    let opened = tokio::select! {
        _ = shutdown.cancelled() => Err(Status::unavailable("this node is shutting down")),
        r = client.calls(request) => r,
    };
    let mut inbound = match opened {
        Ok(response) => response.into_inner(),
        Err(status) => {
            tracing::debug!(leader, %addr, error = %status, "lockd: cannot open a forward stream");
            // Kept as is: a refused connection is how the caller tells that nothing was done.
            finish(&mut open, &mut queue, || status.clone());
            return;
        }
    };
    let mut queue_open = true;
    loop {
        tokio::select! {
            _ = shutdown.cancelled() => {
                finish(&mut open, &mut queue, || Status::unavailable("this node is shutting down"));
                return;
            }
            reply = inbound.message() => match reply {
                Ok(Some(replies)) => {
                    for r in replies.replies {
                        if let Some(answer) = open.remove(&r.id) {
                            let _ = answer.send(r.result.ok_or_else(|| Status::internal(format!(
                                "leader {leader} answered a forwarded call with nothing"
                            ))));
                        }
                    }
                    if !queue_open && open.is_empty() {
                        return;
                    }
                }
                Ok(None) => {
                    finish(&mut open, &mut queue, || Status::unavailable(format!(
                        "leader {leader} closed the forward stream"
                    )));
                    return;
                }
                Err(status) => {
                    tracing::debug!(leader, %addr, error = %status, "lockd: a forward stream broke");
                    finish(&mut open, &mut queue, || Status::unavailable(format!(
                        "the forward stream to leader {leader} broke: {}", status.message()
                    )));
                    return;
                }
            },
            batch = take_batch(&mut queue, &mut open, &mut next_id), if queue_open => match batch {
                Some(batch) => {
                    if out.send(batch).await.is_err() {
                        finish(&mut open, &mut queue, || Status::unavailable(format!(
                            "the forward stream to leader {leader} closed"
                        )));
                        return;
                    }
                }
                // Dropped for a link to another leader: answer what is open, then end.
                None => {
                    queue_open = false;
                    if open.is_empty() {
                        return;
                    }
                }
            },
        }
    }
}

/// Waits for a queued call, then takes every call queued behind it, up to a message's bounds,
/// numbering them and keeping their answers in `open`. `None` once the queue is closed and empty.
async fn take_batch(
    queue: &mut mpsc::Receiver<Queued>,
    open: &mut HashMap<u64, oneshot::Sender<Answer>>,
    next_id: &mut u64,
) -> Option<pb::ForwardBatch> {
    let mut next = Some(queue.recv().await?);
    let mut calls = Vec::new();
    let mut bytes = 0;
    while let Some(q) = next.take() {
        let mut call = q.call;
        call.id = *next_id;
        *next_id += 1;
        bytes += prost::Message::encoded_len(&call);
        open.insert(call.id, q.answer);
        calls.push(call);
        if calls.len() < CALLS_PER_MESSAGE_MAX && bytes < BATCH_BYTES_MAX {
            next = queue.try_recv().ok();
        }
    }
    Some(pb::ForwardBatch { calls })
}

/// Answers every open and queued call with `why`, and closes the queue.
fn finish(
    open: &mut HashMap<u64, oneshot::Sender<Answer>>,
    queue: &mut mpsc::Receiver<Queued>,
    why: impl Fn() -> Status,
) {
    for (_, answer) in open.drain() {
        let _ = answer.send(Err(why()));
    }
    queue.close();
    while let Ok(q) = queue.try_recv() {
        let _ = q.answer.send(Err(why()));
    }
}
