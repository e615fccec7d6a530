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
//! What a caller learns, as for a unary forward, within its budget: the leader's answer; that
//! nothing was done (NO_QUORUM) if its call was never written to a stream (no room in the queue
//! in time, too little budget left when its turn came, a link that could not be opened because
//! the connection was refused, a leader without the service); otherwise (the stream broke, the
//! leader stopped, no answer in time) that the outcome is unknown.
//!
//! Bounds: a link has at most [`OPEN_MAX`] calls written and not yet answered (the leader serves
//! as many at once per stream); the rest wait in its queue of [`QUEUE_MAX`]. A call whose caller
//! gave up while it was queued is dropped unsent. The stream has a connection of its own, so a
//! full stream never holds up the unary forwards beside it.
//!
//! A link serves one leader at one address for at most [`LINK_MAX_AGE`]: then, or when another
//! node leads, calls go to a new link, and the old one closes its side and ends once its calls
//! are answered. The leader checks the sender again on every message as well.
//!
//! The stream is used only with a leader that announced peer protocol 3 or later
//! (`raft::peer_protocol`); an older leader (a rolling upgrade) gets unary forwards.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::sync::{mpsc, oneshot};
use tokio::time::Instant;
use tokio_stream::wrappers::UnboundedReceiverStream;
use tokio_util::sync::CancellationToken;
use tonic::{Code, Status};

use crate::members::Members;
use crate::raft::NodeId;
use crate::raft::peer_protocol::{self, PeerProtocols};
use crate::service::errors;
use crate::service::forward::{BATCH_BYTES_MAX, IN_FLIGHT_MAX, MESSAGE_MAX_BYTES};
use crate::service::raft::pb::{self, forward_client::ForwardClient};
use crate::tls::CLUSTER_ID_HEADER;

/// The first peer protocol version whose nodes serve the forward stream.
pub(crate) const STREAM_PROTOCOL: u32 = 3;
/// Calls waiting for their link's task at most; a caller past it waits for room, within its
/// budget.
const QUEUE_MAX: usize = 4_096;
/// Calls written to a link's stream and not yet answered, at most: the leader serves as many at
/// once per stream.
const OPEN_MAX: usize = IN_FLIGHT_MAX;
/// Calls put into one message at most.
const CALLS_PER_MESSAGE_MAX: usize = 1_024;
/// A link is replaced after this long, so no stream outlives the checks of its opening by much
/// (the leader checks every message too).
const LINK_MAX_AGE: Duration = Duration::from_secs(60);
/// Longest wait for the leader to accept a new stream.
const OPEN_TIMEOUT: Duration = Duration::from_secs(3);
/// After a leader answered that it has no forward stream (a downgrade), calls to it are
/// forwarded alone for this long.
const UNARY_AFTER_UNIMPLEMENTED: Duration = Duration::from_secs(60);

/// A call's answer from the leader, or why there is none.
pub(crate) type Answer = Result<pb::forward_reply::Result, Status>;

/// A call waiting for its link's task.
struct Queued {
    call: pb::ForwardedCall,
    /// The end of the caller's budget: the leader gets what is left of it when the call is
    /// written.
    deadline: Instant,
    answer: oneshot::Sender<Answer>,
}

/// One link's queue, the address it dials and when it was opened.
struct Link {
    queue: mpsc::Sender<Queued>,
    addr: String,
    opened: Instant,
}

/// The follower's links to the leader, one per leader it forwarded to (in practice one).
pub(crate) struct Forwarder {
    members: Arc<Members>,
    protocols: Arc<PeerProtocols>,
    shutdown: CancellationToken,
    links: Mutex<HashMap<NodeId, Link>>,
    /// Leaders that answered UNIMPLEMENTED, until when they get unary forwards.
    unary_until: Arc<Mutex<HashMap<NodeId, Instant>>>,
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
            unary_until: Arc::default(),
        }
    }

    /// Whether calls to `leader` go on the stream: it announced a version that serves it, and
    /// did not answer a stream with UNIMPLEMENTED lately.
    pub fn streams_to(&self, leader: NodeId) -> bool {
        let announced = self
            .protocols
            .of(leader)
            .is_some_and(|v| v >= STREAM_PROTOCOL);
        announced && {
            let mut unary = self.unary_until.lock().unwrap_or_else(|e| e.into_inner());
            match unary.get(&leader) {
                Some(until) if Instant::now() < *until => false,
                Some(_) => {
                    unary.remove(&leader);
                    true
                }
                None => true,
            }
        }
    }

    /// Forwards `call` to `leader` on its link and waits up to `timeout` in all for the answer.
    /// `Err` is a status of this node: a lockd status (NO_QUORUM: the call was never written)
    /// passes on as it is; any other the caller words as a failed forward (outcome unknown, or
    /// nothing done for a refused connection).
    pub async fn call(&self, leader: NodeId, call: pb::ForwardedCall, timeout: Duration) -> Answer {
        let deadline = Instant::now() + timeout;
        let (answer, rx) = oneshot::channel();
        let mut queued = Queued {
            call,
            deadline,
            answer,
        };
        // A link whose task ended (its stream broke) is replaced once.
        for _ in 0..2 {
            let link = self.link(leader)?;
            match tokio::time::timeout_at(deadline, link.send(queued)).await {
                Ok(Ok(())) => {
                    return match tokio::time::timeout_at(deadline, rx).await {
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
                Ok(Err(mpsc::error::SendError(back))) => {
                    queued = back;
                    let mut links = self.links.lock().unwrap_or_else(|e| e.into_inner());
                    if links.get(&leader).is_some_and(|l| l.queue.is_closed()) {
                        links.remove(&leader);
                    }
                }
                Err(_) => {
                    return Err(errors::no_quorum(format!(
                        "the queue of the forward stream to leader {leader} stayed full for {} ms; \
                         nothing was done, retry",
                        timeout.as_millis()
                    )));
                }
            }
        }
        Err(errors::no_quorum(format!(
            "no forward stream to leader {leader} could be opened; nothing was done, retry"
        )))
    }

    /// The queue of the link to `leader`, opened if there is none, or if the one there ended,
    /// dials an old address, or is older than [`LINK_MAX_AGE`]. Links to other nodes are
    /// dropped: each ends once its calls are answered.
    fn link(&self, leader: NodeId) -> Result<mpsc::Sender<Queued>, Status> {
        let Some((addr, client)) = self.members.forward_client(leader) else {
            return Err(errors::no_quorum(format!(
                "leader {leader} is not a member this node can dial; nothing was done, retry"
            )));
        };
        let mut links = self.links.lock().unwrap_or_else(|e| e.into_inner());
        links.retain(|node, link| {
            *node == leader
                && !link.queue.is_closed()
                && link.addr == addr
                && link.opened.elapsed() < LINK_MAX_AGE
        });
        if let Some(link) = links.get(&leader) {
            return Ok(link.queue.clone());
        }
        let (tx, rx) = mpsc::channel(QUEUE_MAX);
        let dial = self.members.dial();
        let mut md = tonic::metadata::MetadataMap::new();
        md.insert(CLUSTER_ID_HEADER, dial.cluster_id.clone());
        dial.restore.attach(&mut md);
        peer_protocol::attach(&mut md);
        tokio::spawn(
            LinkTask {
                leader,
                addr: addr.clone(),
                queue: rx,
                open: HashMap::new(),
                next_id: 0,
                unary_until: self.unary_until.clone(),
            }
            .run(
                client
                    .max_decoding_message_size(MESSAGE_MAX_BYTES)
                    .max_encoding_message_size(MESSAGE_MAX_BYTES),
                md,
                self.shutdown.clone(),
            ),
        );
        links.insert(
            leader,
            Link {
                queue: tx.clone(),
                addr,
                opened: Instant::now(),
            },
        );
        Ok(tx)
    }
}

/// The task of one link.
struct LinkTask {
    leader: NodeId,
    addr: String,
    queue: mpsc::Receiver<Queued>,
    /// Answers of the calls written to the stream, by call id.
    open: HashMap<u64, oneshot::Sender<Answer>>,
    next_id: u64,
    unary_until: Arc<Mutex<HashMap<NodeId, Instant>>>,
}

impl LinkTask {
    /// Opens the stream, writes the queued calls in batches, hands each reply to its caller.
    /// Ends when the stream ends (every call still open or queued learns it), or when the link
    /// was dropped and its last call is answered.
    async fn run(
        mut self,
        mut client: ForwardClient<tonic::transport::Channel>,
        metadata: tonic::metadata::MetadataMap,
        shutdown: CancellationToken,
    ) {
        let leader = self.leader;
        let (out, out_rx) = mpsc::unbounded_channel::<pb::ForwardBatch>();
        // The first calls go out with the stream's headers: the link is made for a call.
        if let Some(batch) = self.take_batch().await {
            let _ = out.send(batch);
        }
        let mut request = tonic::Request::new(UnboundedReceiverStream::new(out_rx));
        *request.metadata_mut() = metadata;
        let opened = tokio::select! {
            _ = shutdown.cancelled() => Err(Status::unavailable("this node is shutting down")),
            r = tokio::time::timeout(OPEN_TIMEOUT, client.calls(request)) => r.unwrap_or_else(|_| {
                Err(Status::deadline_exceeded(format!(
                    "leader {leader} did not accept a forward stream within {} ms",
                    OPEN_TIMEOUT.as_millis()
                )))
            }),
        };
        let mut inbound = match opened {
            Ok(response) => response.into_inner(),
            Err(status) if status.code() == Code::Unimplemented => {
                // A leader of an older release (a downgrade): it served nothing of this stream.
                tracing::warn!(leader, addr = %self.addr, "lockd: the leader has no forward stream; forwarding calls to it alone");
                self.unary_until
                    .lock()
                    .unwrap_or_else(|e| e.into_inner())
                    .insert(leader, Instant::now() + UNARY_AFTER_UNIMPLEMENTED);
                let nothing = || {
                    errors::no_quorum(format!(
                        "leader {leader} has no forward stream; nothing was done, retry"
                    ))
                };
                self.finish(nothing, nothing).await;
                return;
            }
            Err(status) => {
                tracing::debug!(leader, addr = %self.addr, error = %status, "lockd: cannot open a forward stream");
                // Kept as it is: a refused connection is how the caller tells that nothing was
                // done; anything else after the first calls were handed over may have reached
                // the leader.
                let unsent = || not_sent(leader);
                self.finish(|| status.clone(), unsent).await;
                return;
            }
        };
        let mut out = Some(out);
        loop {
            let room = self.open.len() < OPEN_MAX;
            tokio::select! {
                _ = shutdown.cancelled() => {
                    self.finish(|| Status::unavailable("this node is shutting down"), || not_sent(leader)).await;
                    return;
                }
                reply = inbound.message() => match reply {
                    Ok(Some(replies)) => {
                        for r in replies.replies {
                            if let Some(answer) = self.open.remove(&r.id) {
                                let _ = answer.send(r.result.ok_or_else(|| Status::internal(format!(
                                    "leader {leader} answered a forwarded call with nothing"
                                ))));
                            }
                        }
                        if out.is_none() && self.open.is_empty() {
                            return;
                        }
                    }
                    Ok(None) => {
                        self.finish(|| Status::unavailable(format!(
                            "leader {leader} closed the forward stream"
                        )), || not_sent(leader)).await;
                        return;
                    }
                    Err(status) => {
                        tracing::debug!(leader, addr = %self.addr, error = %status, "lockd: a forward stream broke");
                        self.finish(|| Status::unavailable(format!(
                            "the forward stream to leader {leader} broke: {}", status.message()
                        )), || not_sent(leader)).await;
                        return;
                    }
                },
                batch = self.take_batch(), if room && out.is_some() => match batch {
                    Some(batch) => {
                        let sent = out.as_ref().is_some_and(|o| o.send(batch).is_ok());
                        if !sent {
                            self.finish(|| Status::unavailable(format!(
                                "the forward stream to leader {leader} closed"
                            )), || not_sent(leader)).await;
                            return;
                        }
                    }
                    // Dropped for a newer link: close this side, answer what is open, then end.
                    None => {
                        out = None;
                        if self.open.is_empty() {
                            return;
                        }
                    }
                },
            }
        }
    }

    /// Waits for a queued call, then takes every call queued behind it, up to a message's bounds
    /// and [`OPEN_MAX`], numbering them and keeping their answers. A call whose caller gave up
    /// is dropped, and one with too little budget left is answered NO_QUORUM, both unsent.
    /// `None` once the queue is closed and empty.
    async fn take_batch(&mut self) -> Option<pb::ForwardBatch> {
        loop {
            let mut calls = Vec::new();
            let mut bytes = 0;
            let mut next = Some(self.queue.recv().await?);
            while let Some(q) = next.take() {
                let left = q.deadline.saturating_duration_since(Instant::now());
                if q.answer.is_closed() {
                    // The caller went away (its budget ran out): nothing to send.
                } else if left < crate::service::lock::FORWARD_MIN {
                    let _ = q.answer.send(Err(errors::no_quorum(format!(
                        "the call waited for its turn on the forward stream to leader {} until \
                         too little of its budget was left; nothing was done, retry",
                        self.leader
                    ))));
                } else {
                    let mut call = q.call;
                    call.id = self.next_id;
                    self.next_id += 1;
                    call.timeout_ms = u32::try_from(left.as_millis()).unwrap_or(u32::MAX);
                    bytes += prost::Message::encoded_len(&call);
                    self.open.insert(call.id, q.answer);
                    calls.push(call);
                }
                let full = calls.len() >= CALLS_PER_MESSAGE_MAX
                    || bytes >= BATCH_BYTES_MAX
                    || self.open.len() >= OPEN_MAX;
                if !full {
                    next = self.queue.try_recv().ok();
                }
            }
            // Everything taken was dropped or refused: wait for the next one.
            if !calls.is_empty() {
                return Some(pb::ForwardBatch { calls });
            }
        }
    }

    /// Answers every call written to the stream with `sent()`, and every queued one, never
    /// written, with `unsent()`; closes the queue (callers that got room before the close are
    /// answered too).
    async fn finish(&mut self, sent: impl Fn() -> Status, unsent: impl Fn() -> Status) {
        for (_, answer) in self.open.drain() {
            let _ = answer.send(Err(sent()));
        }
        self.queue.close();
        while let Some(q) = self.queue.recv().await {
            let _ = q.answer.send(Err(unsent()));
        }
    }
}

/// The answer of a queued call that was never written to the stream.
fn not_sent(leader: NodeId) -> Status {
    errors::no_quorum(format!(
        "the forward stream to leader {leader} ended before this call was sent; nothing was \
         done, retry"
    ))
}
