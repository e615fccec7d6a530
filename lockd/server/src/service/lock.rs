//! `lockd.v1.Lock`: validates at the edge, forwards to the leader, proposes through the
//! proposer, and maps outcomes to replies.
//!
//! Request flow: client → any node → (forwarded once, marked with `lockd-forwarded-by`) → leader
//! → proposer batch → Raft commit on a quorum → apply on the leader → reply. A waiting Acquire
//! then parks on the wait registry until an applied event names its request.

use std::sync::Arc;
use std::time::{Duration, Instant};

use lockd_api::v1::lock_client::LockClient;
use lockd_api::v1::lock_server::Lock;
use lockd_api::v1::{
    AcquireRequest, AcquireResponse, DescribeRequest, DescribeResponse, ReleaseRequest,
    ReleaseResponse, RenewRequest, RenewResponse,
};
use lockd_core::types::shown_request_id;
use lockd_core::{Command, EndWaitReason, Grant, LeaseId, Outcome, ResourceName, validate};
use openraft::ServerState;
use rand::RngExt;
use tonic::transport::Channel;
use tonic::{Request, Response, Status};

use super::errors::{self, Decided};
use super::raft::pb;
use crate::auth::{Caller, Operation, Resourced};
use crate::members::{WaitConnection, WaitPoolRefused};
use crate::node::NodeCtx;
use crate::observe::metrics::Op;
use crate::proposer::{ProposeError, Ticket};
use crate::raft::NodeId;
use crate::waiters::{CallArgs, WaitEnd};

/// How long a call waits for a leader to be known before answering UNAVAILABLE.
const LEADER_WAIT: Duration = Duration::from_secs(2);
/// Everything a call that does not wait for a lock may take on the node the client called: finding
/// the leader, forwarding, committing. docs/api.md promises UNAVAILABLE within 5 s; 0.5 s is left
/// for the network and scheduling. Waiting for a leader and then forwarding share this budget:
/// before they shared it, a forward got a fresh 4.5 s after up to 2 s of waiting.
const CALL_BUDGET: Duration = Duration::from_millis(4_500);
/// Shortest forward worth starting: with less budget left the answer is UNAVAILABLE at once.
pub(crate) const FORWARD_MIN: Duration = Duration::from_millis(50);
/// Grace after a waiter's own deadline before its call proposes the timeout itself; normally the
/// leader's reaper times it out first.
const WAIT_BACKSTOP: Duration = Duration::from_secs(1);
/// Deadline of a linearizable read (a heartbeat round to a quorum).
const READ_TIMEOUT: Duration = Duration::from_secs(3);

pub struct LockService {
    ctx: Arc<NodeCtx>,
}

impl LockService {
    pub fn new(ctx: Arc<NodeCtx>) -> Self {
        LockService { ctx }
    }
}

/// Where a call is served.
enum Route {
    Local,
    Forward(NodeId),
}

impl LockService {
    /// Finds the leader, waiting up to [`LEADER_WAIT`] for one to be elected. A call that was
    /// already forwarded is never forwarded again.
    async fn route(
        &self,
        forwarded: bool,
        call_deadline: tokio::time::Instant,
    ) -> Result<Route, Status> {
        let deadline = (tokio::time::Instant::now() + LEADER_WAIT).min(call_deadline);
        let mut rx = self.ctx.raft.metrics();
        loop {
            let (state, leader, term) = {
                let m = rx.borrow_and_update();
                (m.state, m.current_leader, m.current_term)
            };
            match leader {
                Some(l) if l == self.ctx.id && state == ServerState::Leader => {
                    return Ok(Route::Local);
                }
                Some(l) if l != self.ctx.id && !forwarded && self.ctx.members.contains(l) => {
                    return Ok(Route::Forward(l));
                }
                Some(l) if l != self.ctx.id && forwarded => {
                    return Err(errors::no_quorum(format!(
                        "node {} received a forwarded call but the leader is node {l} (term {term}); retry",
                        self.ctx.id
                    )));
                }
                _ => {}
            }
            if tokio::time::timeout_at(deadline, rx.changed())
                .await
                .is_err()
            {
                return Err(errors::no_quorum(format!(
                    "node {} knows no leader after {} ms (term {term}): no quorum; nothing was done, retry",
                    self.ctx.id,
                    LEADER_WAIT.min(CALL_BUDGET).as_millis()
                )));
            }
        }
    }

    /// The Lock service of member `id`; `None` if it left the membership meanwhile.
    fn peer(&self, id: NodeId) -> Option<(String, LockClient<Channel>)> {
        self.ctx.members.lock_client(id)
    }

    /// The call as forwarded to the leader: marked with this node and the caller it acts for.
    fn forward_request<T>(&self, msg: T, timeout: Duration, caller: &Caller) -> Request<T> {
        let mut req = Request::new(msg);
        self.ctx.auth.mark_forwarded(self.ctx.id, caller, &mut req);
        req.set_timeout(timeout);
        req
    }

    fn forward_error(&self, leader: NodeId, addr: &str, status: Status) -> Status {
        // Statuses from the leader are its answer; transport failures are not.
        if errors::is_from_lockd(&status) {
            return status;
        }
        let msg = format!(
            "forwarding from node {} to leader {leader} at {addr} failed ({}: {})",
            self.ctx.id,
            status.code(),
            status.message()
        );
        errors::forward_failed(msg, &status)
    }

    /// The call's first proposal: if it fails, nothing of the call is in the log yet, so an
    /// overload refusal may say "nothing was done".
    async fn propose(&self, cmd: Command) -> Result<Outcome, Status> {
        self.ctx
            .proposer
            .propose(cmd)
            .await
            .map_err(|e| errors::propose_failed(self.ctx.id, e))
    }

    /// A later proposal of a call whose first one committed (a waiter's EndWaitAttempt): even an
    /// overload refusal of this one leaves the call's outcome unknown, since the first proposal
    /// may still grant.
    async fn propose_after_commit(&self, cmd: Command) -> Result<Outcome, Status> {
        self.ctx.proposer.propose(cmd).await.map_err(|e| {
            errors::outcome_unknown(format!(
                "node {}: {e} while ending a wait; the acquire is in the log and may still be \
                 granted, retry with the same request_id",
                self.ctx.id
            ))
        })
    }

    fn record<T>(&self, op: Op, forwarded: bool, started: Instant, result: &Result<T, Status>) {
        // A forwarded call is counted once, by the node the client called.
        if !forwarded {
            self.ctx
                .metrics
                .request(op, errors::outcome_label(result), started.elapsed());
        }
    }

    // ---- Acquire ----

    /// Acquire on the leader, with the request id scoped to the caller (see
    /// [`auth::Auth::scope_request_id`]); messages show the start of the client's own id
    /// ([`shown_request_id`]: a request id is a credential).
    async fn acquire_local(
        &self,
        mut req: AcquireRequest,
        caller: Caller,
    ) -> Result<AcquireResponse, Status> {
        validate::request_id(&req.request_id)
            .map_err(|e| errors::invalid_field("request_id", e))?;
        req.request_id = self.ctx.auth.scope_request_id(&caller, &req.request_id);
        self.acquire_scoped(req).await
    }

    async fn acquire_scoped(&self, req: AcquireRequest) -> Result<AcquireResponse, Status> {
        let resource =
            validate::resource(&req.resource).map_err(|e| errors::invalid_field("resource", e))?;
        let ttl = validate::lease_ttl_ms(req.lease_ttl_ms)
            .map_err(|e| errors::invalid_field("lease_ttl_ms", e))?;
        let wait = validate::wait_timeout_ms(req.wait_timeout_ms)
            .map_err(|e| errors::invalid_field("wait_timeout_ms", e))?;
        validate::holder(&req.holder).map_err(|e| errors::invalid_field("holder", e))?;

        // Registered before proposing, so a grant that applies at once is not missed.
        let registration = (wait > 0).then(|| {
            let args = CallArgs {
                lease_ttl_ms: ttl,
                wait_timeout_ms: wait,
                holder: req.holder.clone(),
            };
            self.ctx.waits.register(&req.request_id, &resource, args)
        });
        let lease_id = LeaseId(rand::rng().random::<u128>());
        let ticket = Arc::new(Ticket::default());
        // Armed before proposing: a caller that leaves while the Acquire is in flight must not
        // leave a live waiter behind, granted a lease nobody receives. The Acquire is queued in
        // the proposer before the first await, so the cancel follows it in the log; a cancel of
        // an attempt that did not queue (granted, refused, or replaced by a retry) ends nothing,
        // and one that was never cut into a batch needs none (its ticket says so).
        let mut guard = WaitGuard {
            ctx: self.ctx.clone(),
            resource: resource.clone(),
            request_id: req.request_id.clone(),
            attempt: lease_id,
            registration: registration.as_ref().map(|(id, _)| *id),
            ticket: ticket.clone(),
            armed: wait > 0,
        };
        let proposed = self
            .ctx
            .proposer
            .propose_ticketed(
                Command::AcquireV2 {
                    resource: resource.clone(),
                    request_id: req.request_id.clone(),
                    lease_ttl_ms: ttl,
                    wait_timeout_ms: wait,
                    holder: req.holder.clone(),
                    lease_id,
                },
                ticket,
            )
            .await;
        let outcome = match proposed {
            Ok(outcome) => outcome,
            Err(e) => {
                // Overloaded: nothing was proposed. Unknown: the Acquire may still queue with
                // no call to answer, so the cancel stays, unless this node no longer leads (the
                // cancel could not commit here; as in `wait_for_grant`, the place is kept for a
                // retry on the new leader).
                guard.armed &=
                    matches!(e, ProposeError::Unknown(_)) && *self.ctx.is_leader.borrow();
                return Err(errors::propose_failed(self.ctx.id, e));
            }
        };
        guard.armed &= matches!(outcome, Outcome::Queued { .. });
        match outcome {
            Outcome::Granted(g) => self.signed_reply(&resource, g).await,
            Outcome::Held { holder } => Err(errors::held(resource.as_str(), &holder)),
            // Held and WaitTimedOut are recorded under the request id, so they are its outcome
            // for every attempt; InvalidArgument is this call's (a reused id); all three are
            // marked (see `errors::DECIDED`). The table's bounds are not recorded, not marked.
            Outcome::WaitTimedOut => Err(errors::wait_timed_out(
                resource.as_str(),
                wait,
                Decided::ByStateMachine,
            )),
            Outcome::InvalidArgument(msg) => Err(errors::decided_invalid(msg)),
            Outcome::Exhausted(limit, msg) => {
                self.ctx.metrics.with(|| {
                    metrics::counter!("lockd_acquire_refusals_total", "limit" => limit.name())
                        .increment(1)
                });
                Err(errors::exhausted(limit, msg))
            }
            Outcome::Queued { .. } => {
                let (_, rx) = registration.expect("queued only when waiting");
                self.wait_for_grant(&mut guard, rx, wait).await
            }
            other => Err(errors::internal(format!(
                "unexpected outcome {other:?} for Acquire"
            ))),
        }
    }

    /// Parks until the log grants or times out this waiter. Leaving early (the caller went away)
    /// drops the guard, which proposes the waiter's removal.
    async fn wait_for_grant(
        &self,
        guard: &mut WaitGuard,
        mut rx: tokio::sync::oneshot::Receiver<WaitEnd>,
        wait_ms: u64,
    ) -> Result<AcquireResponse, Status> {
        let backstop = tokio::time::sleep(Duration::from_millis(wait_ms) + WAIT_BACKSTOP);
        tokio::pin!(backstop);
        // Changes only when this node gains or loses leadership, so parked calls are not woken
        // by every commit.
        let mut leader = self.ctx.is_leader.subscribe();
        // A subscription takes the current value as seen: a step-down between the Acquire's
        // apply and here would otherwise go unnoticed, and the call would wait on a follower,
        // where its cancel cannot be proposed (review of 41ff66d, L1).
        let mut stepped_down = !*leader.borrow_and_update();
        loop {
            if stepped_down {
                // The queue is replicated: the place is kept for a retry on the new leader.
                guard.armed = false;
                return Err(errors::outcome_unknown(format!(
                    "node {} stopped being the leader while request_id {} waited; retry with the same request_id to keep its place",
                    self.ctx.id,
                    shown_request_id(&guard.request_id)
                )));
            }
            tokio::select! {
                end = &mut rx => {
                    let end = match end {
                        Ok(end) if *end.resource() == guard.resource => end,
                        // Never answered, let alone signed for this resource: the registry
                        // wakes a call only for its own resource, so this is a bug. The call
                        // leaves without its answer (its attempt is cancelled as such).
                        Ok(end) => {
                            tracing::error!(
                                resource = %guard.resource,
                                decided_on = %end.resource(),
                                "lockd: a waiting call was woken by another resource's event; \
                                 not answered with it"
                            );
                            return Err(errors::outcome_unknown(format!(
                                "node {}: request_id {} was woken for another resource than \
                                 {:?}; retry with the same request_id",
                                self.ctx.id,
                                shown_request_id(&guard.request_id),
                                guard.resource
                            )));
                        }
                        // The registry ends every call's wait with an end, unless it is gone
                        // (the node is shutting down).
                        Err(_) => {
                            return Err(errors::outcome_unknown(format!(
                                "node {} stopped waiting for request_id {} without an answer \
                                 from the log; retry with the same request_id",
                                self.ctx.id,
                                shown_request_id(&guard.request_id)
                            )));
                        }
                    };
                    guard.armed = false;
                    return match end {
                        WaitEnd::Granted(_, g) => self.signed_reply(&guard.resource, g).await,
                        WaitEnd::TimedOut(_) => Err(errors::wait_timed_out(guard.resource.as_str(), wait_ms, Decided::ByStateMachine)),
                    };
                }
                _ = &mut backstop => {
                    guard.armed = false;
                    let outcome = self.propose_after_commit(Command::EndWaitAttempt {
                        resource: guard.resource.clone(),
                        request_id: guard.request_id.clone(),
                        reason: EndWaitReason::TimedOut,
                        attempt: guard.attempt,
                    }).await?;
                    return match outcome {
                        // The table answers a request it already decided from its record, which
                        // does not name the resource: sign only a lease this resource holds
                        // (tokens come from one counter, so the token names the lease).
                        Outcome::Granted(g) if !self.holds(&guard.resource, g.fencing_token) => {
                            Err(errors::outcome_unknown(format!(
                                "node {}: request_id {} was decided, but not as a lease {:?} holds now; retry with the same request_id",
                                self.ctx.id,
                                shown_request_id(&guard.request_id),
                                guard.resource
                            )))
                        }
                        Outcome::Granted(g) => self.signed_reply(&guard.resource, g).await,
                        // Also when a retry had replaced this attempt (the table then ends
                        // nothing and that retry may still be granted): not the request's outcome.
                        _ => Err(errors::wait_timed_out(guard.resource.as_str(), wait_ms, Decided::ByThisNode)),
                    };
                }
                changed = leader.changed() => {
                    stepped_down = changed.is_err() || !*leader.borrow_and_update();
                }
            }
        }
    }

    /// Whether `resource` is held, in this node's applied table, by the lease of `token`.
    fn holds(&self, resource: &ResourceName, token: lockd_core::FencingToken) -> bool {
        let view = self.applied_view(resource);
        view.held && view.fencing_token == token
    }

    /// What this node's applied table shows of `resource` (linearizable only after a read
    /// barrier or a commit of this node's).
    fn applied_view(&self, resource: &ResourceName) -> lockd_core::ResourceView {
        self.ctx
            .sm
            .read()
            .expect("state lock")
            .table
            .describe(resource)
    }

    /// The reply to a grant, with its sequencer signed by the cluster's active key. A grant is
    /// never answered unsigned: without a key (a new cluster's first moments) the call says the
    /// outcome is known to the log and asks for a retry with the same request_id.
    async fn signed_reply(
        &self,
        resource: &ResourceName,
        g: Grant,
    ) -> Result<AcquireResponse, Status> {
        let Some(key) = self.ctx.signer.active_or_wait(&self.ctx.sm).await else {
            return Err(errors::outcome_unknown(format!(
                "node {}: {resource:?} was granted but the cluster has no sequencer signing key \
                 committed yet (waited {} ms); retry with the same request_id",
                self.ctx.id,
                crate::signing::KEY_WAIT.as_millis()
            )));
        };
        let mut reply = grant_reply(g);
        reply.sequencer = key.sign(resource.as_str(), g.fencing_token, g.expires_at_ms);
        Ok(reply)
    }

    async fn describe_local(&self, req: DescribeRequest) -> Result<DescribeResponse, Status> {
        let resource = validate::held_resource(&req.resource)
            .map_err(|e| errors::invalid_field("resource", e))?;
        match tokio::time::timeout(READ_TIMEOUT, self.ctx.reads.confirm()).await {
            Ok(Ok(_)) => {}
            Ok(Err(e @ crate::read_barrier::ReadRefused::Overloaded)) => {
                return Err(errors::overloaded(format!(
                    "node {}: {e}; nothing was done, retry later",
                    self.ctx.id
                )));
            }
            Ok(Err(e)) => {
                return Err(errors::no_quorum(format!(
                    "node {} cannot serve a linearizable read: {e}",
                    self.ctx.id
                )));
            }
            Err(_) => {
                return Err(errors::no_quorum(format!(
                    "node {} could not confirm leadership with a quorum within {} ms",
                    self.ctx.id,
                    READ_TIMEOUT.as_millis()
                )));
            }
        }
        let view = self.applied_view(&resource);
        Ok(DescribeResponse {
            held: view.held,
            holder: view.holder,
            fencing_token: view.fencing_token.0,
            expires_at_unix_ms: view.expires_at_ms,
            waiters: view.waiters,
        })
    }
}

/// The operation the authorization policy knows `op` as.
fn operation(op: Op) -> Operation {
    match op {
        Op::Acquire => Operation::Acquire,
        Op::Renew => Operation::Renew,
        Op::Release => Operation::Release,
        Op::Describe => Operation::Describe,
    }
}

/// What is left of the call's budget for a forward, if enough to start one.
fn forward_timeout(deadline: tokio::time::Instant) -> Option<Duration> {
    Some(deadline.saturating_duration_since(tokio::time::Instant::now()))
        .filter(|d| *d >= FORWARD_MIN)
}

fn grant_reply(g: Grant) -> AcquireResponse {
    AcquireResponse {
        lease_id: g.lease_id.to_string(),
        fencing_token: g.fencing_token.0,
        expires_at_unix_ms: g.expires_at_ms,
        lease_ttl_ms: g.lease_ttl_ms,
        sequencer: Vec::new(),
    }
}

/// Removes a waiter from the queue when its call ends without an answer from the log (the
/// caller cancelled or disconnected), also while its Acquire is still in flight; but not while
/// another call of the same request waits on this node (see [`crate::waiters::WaitRegistry`]).
struct WaitGuard {
    ctx: Arc<NodeCtx>,
    resource: ResourceName,
    request_id: String,
    /// The lease id drawn for this call: its EndWait applies only while this call's attempt is
    /// the current one (a retry with the same request_id replaces it).
    attempt: LeaseId,
    /// The call's registration in the wait registry; `None` for a call that does not wait.
    registration: Option<u64>,
    /// Whether the call's Acquire was cut into a batch; withdrawn when the guard drops, so that
    /// an Acquire never proposed needs no cancel.
    ticket: Arc<Ticket>,
    /// Whether the call leaves without its answer when the guard drops: from before the Acquire
    /// is proposed until the call has its answer, or has no queued waiter to end.
    armed: bool,
}

impl Drop for WaitGuard {
    fn drop(&mut self) {
        let Some(id) = self.registration else {
            return;
        };
        // Withdrawn first, so that an Acquire not cut yet never will be.
        let left = (self.armed && !self.ticket.withdraw()).then_some(self.attempt);
        let cancels = self
            .ctx
            .waits
            .leave(&self.request_id, &self.resource, id, left);
        for attempt in cancels {
            let ctx = self.ctx.clone();
            let cmd = Command::EndWaitAttempt {
                resource: self.resource.clone(),
                request_id: self.request_id.clone(),
                reason: EndWaitReason::Cancelled,
                attempt,
            };
            tokio::spawn(async move {
                if let Err(e) = ctx.proposer.propose(cmd).await {
                    ctx.waits.log_cancel_failure(&e);
                }
            });
        }
    }
}

impl LockService {
    async fn renew_local(&self, r: RenewRequest) -> Result<RenewResponse, Status> {
        let resource = validate::held_resource(&r.resource)
            .map_err(|e| errors::invalid_field("resource", e))?;
        let lease_id =
            validate::lease_id(&r.lease_id).map_err(|e| errors::invalid_field("lease_id", e))?;
        let ttl = if r.lease_ttl_ms == 0 {
            0
        } else {
            validate::lease_ttl_ms(r.lease_ttl_ms)
                .map_err(|e| errors::invalid_field("lease_ttl_ms", e))?
        };
        let cmd = Command::Renew {
            resource: resource.clone(),
            lease_id,
            lease_ttl_ms: ttl,
        };
        match self.propose(cmd).await? {
            Outcome::Renewed {
                expires_at_ms,
                lease_ttl_ms,
            } => Ok(RenewResponse {
                expires_at_unix_ms: expires_at_ms,
                lease_ttl_ms,
            }),
            Outcome::NotFound => Err(errors::not_found(resource.as_str())),
            other => Err(errors::internal(format!(
                "unexpected outcome {other:?} for Renew"
            ))),
        }
    }

    async fn release_local(&self, r: ReleaseRequest) -> Result<ReleaseResponse, Status> {
        let resource = validate::held_resource(&r.resource)
            .map_err(|e| errors::invalid_field("resource", e))?;
        let lease_id =
            validate::lease_id(&r.lease_id).map_err(|e| errors::invalid_field("lease_id", e))?;
        match self
            .propose(Command::Release { resource, lease_id })
            .await?
        {
            Outcome::Released(released) => Ok(ReleaseResponse { released }),
            other => Err(errors::internal(format!(
                "unexpected outcome {other:?} for Release"
            ))),
        }
    }

    /// The shape every Lock call shares: serve locally on the leader or forward once to it, all
    /// within `budget` from arrival, then count the answer once, on the node the client called.
    /// The caller is authorized first, on this node (refusals are counted in
    /// `lockd_auth_denied_total`, not as requests); a forwarded call again on the leader.
    ///
    /// A call that `parks` (a waiting Acquire) first takes a place among the node's parked waits
    /// (`crate::parked`), held until it returns, and is forwarded on the connections for waits
    /// ([`crate::members::Members::wait_client`]), so that it never holds a stream of the
    /// connection the other forwarded calls take.
    async fn serve<Req, Resp, LocalFut, FwdFut>(
        &self,
        op: Op,
        req: Request<Req>,
        budget: Duration,
        parks: bool,
        local: impl FnOnce(Req, Caller) -> LocalFut,
        forward: impl FnOnce(LockClient<Channel>, Request<Req>) -> FwdFut,
    ) -> Result<Response<Resp>, Status>
    where
        Req: Resourced + Streamable<Response = Resp>,
        LocalFut: Future<Output = Result<Resp, Status>>,
        FwdFut: Future<Output = Result<Response<Resp>, Status>>,
    {
        let started = Instant::now();
        let caller =
            self.ctx
                .auth
                .authorize(&req, operation(op), Some(req.get_ref().resource()))?;
        let forwarded = caller.forwarded;
        let place = if parks {
            let source = req.remote_addr().map(|a| a.ip());
            match self.ctx.parked.admit(forwarded, source) {
                Ok(place) => place,
                Err((limit, status)) => {
                    self.count_refusal(limit);
                    let result = Err(status);
                    self.record(op, forwarded, started, &result);
                    return result;
                }
            }
        } else {
            None
        };
        let deadline = tokio::time::Instant::now() + budget;
        let result = match self.route(forwarded, deadline).await {
            Ok(Route::Local) => {
                self.within(deadline, budget, local(req.into_inner(), caller))
                    .await
            }
            Ok(Route::Forward(leader)) => {
                match (forward_timeout(deadline), self.target(leader, parks)) {
                    (_, Some((addr, Err(refused)))) => {
                        Err(self.wait_pool_refused(leader, &addr, refused))
                    }
                    (Some(timeout), Some((addr, Ok((client, _on_connection))))) => {
                        let msg = req.into_inner();
                        let streamed = if self.ctx.forwarder.streams_to(leader) {
                            msg.streamed()
                        } else {
                            Err(msg)
                        };
                        let answer = match streamed {
                            Ok(call) => {
                                self.ctx.metrics.forwarded(true);
                                let call = pb::ForwardedCall {
                                    id: 0,
                                    timeout_ms: 0,
                                    identity: caller.identity.as_deref().map(str::to_owned),
                                    call: Some(call),
                                };
                                self.ctx
                                    .forwarder
                                    .call(leader, call, timeout)
                                    .await
                                    .and_then(Req::answer)
                            }
                            Err(msg) => {
                                self.ctx.metrics.forwarded(false);
                                let fwd = self.forward_request(msg, timeout, &caller);
                                forward(client, fwd).await.map(Response::into_inner)
                            }
                        };
                        answer.map_err(|s| self.forward_error(leader, &addr, s))
                    }
                    (_, None) => Err(errors::no_quorum(format!(
                        "node {} found leader {leader}, which is no longer a member; nothing was done, retry",
                        self.ctx.id
                    ))),
                    (None, _) => Err(errors::no_quorum(format!(
                        "node {} found leader {leader} too late to forward within {} ms; nothing was done, retry",
                        self.ctx.id,
                        budget.as_millis()
                    ))),
                }
            }
            Err(s) => Err(s),
        };
        drop(place);
        self.record(op, forwarded, started, &result);
        result.map(Response::new)
    }

    /// Where a call to `leader` goes: a waiting Acquire (`parks`) on a place of the connections
    /// for waits, any other call on the connection for calls; with the leader's address.
    fn target(
        &self,
        leader: NodeId,
        parks: bool,
    ) -> Option<(String, Result<Target, WaitPoolRefused>)> {
        if parks {
            self.ctx
                .members
                .wait_client(leader)
                .map(|(addr, taken)| (addr, taken.map(|w| (w.client.clone(), Some(w)))))
        } else {
            self.peer(leader)
                .map(|(addr, client)| (addr, Ok((client, None))))
        }
    }

    /// A waiting Acquire that found no place on the connections to the leader: refused at once
    /// (queued, it would wait behind the others for its whole wait).
    fn wait_pool_refused(&self, leader: NodeId, addr: &str, refused: WaitPoolRefused) -> Status {
        match refused {
            WaitPoolRefused::Full {
                connections,
                per_connection,
            } => {
                self.count_refusal(LIMIT_WAIT_CONNECTIONS);
                errors::waits_exhausted(
                    LIMIT_WAIT_CONNECTIONS,
                    format!(
                        "node {} already forwards {} waiting Acquires to leader {leader} at \
                         {addr} on {connections} connections, the most it opens for waits \
                         (--waits-max / {per_connection}); nothing was done, retry later",
                        self.ctx.id,
                        connections * per_connection,
                    ),
                )
            }
            WaitPoolRefused::Dial(why) => errors::no_quorum(format!(
                "node {} cannot dial leader {leader} at {addr}: {why}; nothing was done, retry",
                self.ctx.id
            )),
        }
    }

    /// Counts a refusal by a bound on waits in `lockd_acquire_refusals_total{limit}`.
    fn count_refusal(&self, limit: &'static str) {
        self.ctx.metrics.with(|| {
            metrics::counter!("lockd_acquire_refusals_total", "limit" => limit).increment(1)
        });
    }
}

/// A forwarded call's client, and the place of a waiting Acquire on its connection (given back
/// when the call returns).
type Target = (LockClient<Channel>, Option<WaitConnection>);

/// The `limit` of a waiting Acquire refused for want of a place on the connections to the
/// leader (ErrorInfo metadata, `lockd_acquire_refusals_total{limit}`).
const LIMIT_WAIT_CONNECTIONS: &str = "wait_connections_max";

impl LockService {
    /// The local part of a call, within what is left of its budget.
    async fn within<Resp>(
        &self,
        deadline: tokio::time::Instant,
        budget: Duration,
        local: impl Future<Output = Result<Resp, Status>>,
    ) -> Result<Resp, Status> {
        match tokio::time::timeout_at(deadline, local).await {
            Ok(r) => r,
            Err(_) => Err(errors::outcome_unknown(format!(
                "node {} found no answer within {} ms; outcome unknown, retry with the same request_id",
                self.ctx.id,
                budget.as_millis()
            ))),
        }
    }

    /// A call of a forward stream (`service::forward`), on the leader: authorized again for the
    /// identity the sending node names, then served here as a unary forwarded call is (never
    /// forwarded again: a node that is not the leader refuses it), within the budget the
    /// sending node had left, capped at this node's own.
    pub(crate) async fn serve_streamed(
        &self,
        from: Option<NodeId>,
        call: pb::ForwardedCall,
    ) -> pb::ForwardReply {
        use pb::forward_reply::Result as Reply;
        use pb::forwarded_call::Call;
        // At most what a unary forward of the same call gets (see `Lock::acquire`).
        let budget = Duration::from_millis(call.timeout_ms.into()).min(CALL_BUDGET + WAIT_BACKSTOP);
        let identity = call.identity.as_deref();
        let result = match call.call {
            Some(Call::Acquire(r)) if r.wait_timeout_ms == 0 => self
                .streamed(Op::Acquire, from, identity, r, budget, |r, c| {
                    self.acquire_local(r, c)
                })
                .await
                .map(Reply::Acquire),
            Some(Call::Acquire(_)) => Err(errors::invalid_field(
                "wait_timeout_ms",
                "a waiting Acquire is forwarded as a call of its own, not on a forward stream",
            )),
            Some(Call::Renew(r)) => self
                .streamed(Op::Renew, from, identity, r, budget, |r, _| {
                    self.renew_local(r)
                })
                .await
                .map(Reply::Renew),
            Some(Call::Release(r)) => self
                .streamed(Op::Release, from, identity, r, budget, |r, _| {
                    self.release_local(r)
                })
                .await
                .map(Reply::Release),
            None => Err(errors::invalid(
                "a forwarded call carries no request this node knows",
            )),
        };
        match result {
            Ok(reply) => pb::ForwardReply {
                id: call.id,
                result: Some(reply),
            },
            Err(status) => super::forward::status_reply(call.id, status),
        }
    }

    async fn streamed<Req: Resourced, Resp, Fut>(
        &self,
        op: Op,
        from: Option<NodeId>,
        identity: Option<&str>,
        req: Req,
        budget: Duration,
        local: impl FnOnce(Req, Caller) -> Fut,
    ) -> Result<Resp, Status>
    where
        Fut: Future<Output = Result<Resp, Status>>,
    {
        let caller = self.ctx.auth.authorize_forwarded(
            from,
            identity,
            operation(op),
            Some(req.resource()),
        )?;
        let deadline = tokio::time::Instant::now() + budget;
        match self.route(true, deadline).await? {
            Route::Local => self.within(deadline, budget, local(req, caller)).await,
            Route::Forward(leader) => Err(errors::internal(format!(
                "node {} would forward a forwarded call again (to {leader})",
                self.ctx.id
            ))),
        }
    }
}

/// How a request travels on a forward stream (`crate::forwarder`), if it does.
pub(crate) trait Streamable: Sized {
    type Response;
    /// The request as a call of a forward stream, or itself back if it is forwarded alone.
    fn streamed(self) -> Result<pb::forwarded_call::Call, Self>;
    /// The leader's answer as this request's response or status.
    fn answer(result: pb::forward_reply::Result) -> Result<Self::Response, Status>;
}

/// A status the leader sent back on a forward stream, as the client would have received it.
fn forwarded_status(s: pb::ForwardedStatus) -> Status {
    Status::with_details(tonic::Code::from_i32(s.code), s.message, s.details.into())
}

macro_rules! streamable {
    ($req:ty, $resp:ty, $variant:ident, $streams:expr) => {
        impl Streamable for $req {
            type Response = $resp;
            fn streamed(self) -> Result<pb::forwarded_call::Call, Self> {
                let streams: fn(&Self) -> bool = $streams;
                if streams(&self) {
                    Ok(pb::forwarded_call::Call::$variant(self))
                } else {
                    Err(self)
                }
            }
            fn answer(result: pb::forward_reply::Result) -> Result<$resp, Status> {
                match result {
                    pb::forward_reply::Result::$variant(r) => Ok(r),
                    pb::forward_reply::Result::Status(s) => Err(forwarded_status(s)),
                    other => Err(errors::internal(format!(
                        "the leader answered a forwarded {} with {other:?}",
                        stringify!($variant)
                    ))),
                }
            }
        }
    };
}

// A waiting Acquire is forwarded alone: if its caller goes away, dropping the unary call ends
// the wait on the leader (its `WaitGuard`).
streamable!(AcquireRequest, AcquireResponse, Acquire, |r| r
    .wait_timeout_ms
    == 0);
streamable!(RenewRequest, RenewResponse, Renew, |_| true);
streamable!(ReleaseRequest, ReleaseResponse, Release, |_| true);

/// Describe needs a linearizable read per call on the leader; it is forwarded alone.
impl Streamable for DescribeRequest {
    type Response = DescribeResponse;
    fn streamed(self) -> Result<pb::forwarded_call::Call, Self> {
        Err(self)
    }
    fn answer(result: pb::forward_reply::Result) -> Result<DescribeResponse, Status> {
        Err(errors::internal(format!(
            "the leader answered a Describe that was not sent on a forward stream: {result:?}"
        )))
    }
}

#[tonic::async_trait]
impl Lock for LockService {
    async fn acquire(
        &self,
        req: Request<AcquireRequest>,
    ) -> Result<Response<AcquireResponse>, Status> {
        // A forwarded waiting call may take its whole wait.
        let wait = Duration::from_millis(
            req.get_ref()
                .wait_timeout_ms
                .min(lockd_core::limits::WAIT_TIMEOUT_MAX_MS),
        );
        let parks = req.get_ref().wait_timeout_ms > 0;
        self.serve(
            Op::Acquire,
            req,
            CALL_BUDGET + wait + WAIT_BACKSTOP,
            parks,
            |r, c| self.acquire_local(r, c),
            |mut c, r| async move { c.acquire(r).await },
        )
        .await
    }

    async fn renew(&self, req: Request<RenewRequest>) -> Result<Response<RenewResponse>, Status> {
        self.serve(
            Op::Renew,
            req,
            CALL_BUDGET,
            false,
            |r, _| self.renew_local(r),
            |mut c, r| async move { c.renew(r).await },
        )
        .await
    }

    async fn release(
        &self,
        req: Request<ReleaseRequest>,
    ) -> Result<Response<ReleaseResponse>, Status> {
        self.serve(
            Op::Release,
            req,
            CALL_BUDGET,
            false,
            |r, _| self.release_local(r),
            |mut c, r| async move { c.release(r).await },
        )
        .await
    }

    async fn describe(
        &self,
        req: Request<DescribeRequest>,
    ) -> Result<Response<DescribeResponse>, Status> {
        self.serve(
            Op::Describe,
            req,
            CALL_BUDGET,
            false,
            |r, _| self.describe_local(r),
            |mut c, r| async move { c.describe(r).await },
        )
        .await
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Goal: a call that waits for a leader and is then forwarded still answers within the 5 s of
    /// docs/api.md. Method: a call that arrived almost a full leader wait ago takes the forward
    /// deadline it would get now, and the two are added up; on main the forward always got 4.5 s of
    /// its own after up to 2 s of waiting, 6.5 s in all.
    #[test]
    fn issue14_finding8c_leader_wait_and_forward_share_one_budget() {
        let contract = Duration::from_secs(5);
        let waited = LEADER_WAIT - Duration::from_millis(1);
        let now = tokio::time::Instant::now();
        let deadline = now - waited + CALL_BUDGET;
        let forward = forward_timeout(deadline).expect("budget left for a forward");
        let worst = waited + forward;
        assert!(worst <= CALL_BUDGET && CALL_BUDGET < contract, "{worst:?}");
        // Past the budget no forward starts: the answer is UNAVAILABLE at once.
        assert_eq!(forward_timeout(now - Duration::from_millis(1)), None);
    }
}
