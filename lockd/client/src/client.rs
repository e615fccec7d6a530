//! [`Client`]: the `Lock` and `Cluster` RPCs with endpoint rotation, deadline-bounded retries and
//! typed errors.

use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use lockd_api::v1::cluster_client::ClusterClient;
use lockd_api::v1::lock_client::LockClient;
use lockd_api::v1::{
    AcquireRequest, DescribeRequest, DescribeResponse, ReleaseRequest, RenewRequest,
    RotateSigningKeyRequest, RotateSigningKeyResponse, SigningKeyInfo, SigningKeysRequest,
    StatusRequest, StatusResponse,
};
use lockd_fence::FencingToken;
use tokio::time::{Instant, sleep, timeout};
use tonic::Status;
use tonic::transport::Channel;

use crate::config::ClientConfig;
use crate::endpoints::Endpoints;
use crate::error::{
    AttemptFailure, Error, Op, classify, from_final_status, humanize, speaks_for_this_attempt_only,
};
use crate::guard::LeaseGuard;
use crate::lease::{Lease, LeaseId, abbreviate, default_safety_margin};
use crate::request_id::RequestId;
use crate::retry::{backoff, next_delay, remaining};

/// Membership admin calls (`member list | add | promote | remove`, `leader transfer`).
mod members;

/// The server's default ttl (docs/api.md, "Limits and policy"), assumed only if a reply leaves
/// `lease_ttl_ms` empty.
const SERVER_DEFAULT_TTL: Duration = Duration::from_millis(30_000);

/// Options of one `Acquire`. `Default` = server-default ttl, no waiting, the client's holder text,
/// a fresh request id, and a total time of `wait + ClientConfig::call_timeout`.
#[derive(Clone, Debug, Default)]
pub struct AcquireOptions {
    /// Lease ttl; `None` lets the server pick its default (30 s).
    pub ttl: Option<Duration>,
    /// How long to queue for a held resource; `None` or zero = fail with [`Error::Held`].
    pub wait: Option<Duration>,
    /// Free text shown by `Describe`; `None` = [`ClientConfig::holder`].
    pub holder: Option<String>,
    /// The idempotency key; `None` = a fresh random one. Pass the id of an earlier attempt whose
    /// outcome is unknown to learn it. With a given id the call can never end in
    /// [`Error::Unavailable`] ("nothing was done"), only in [`Error::OutcomeUnknown`], since the
    /// earlier call may have been granted; and a refusal that lockd decided before looking the id
    /// up is no answer for that earlier call either ([`Error::OutcomeUnknown`] too).
    ///
    /// lockd answers a repeated id with the original grant for 10 minutes, also after that grant
    /// expired, and this call cannot know when the grant was made. So a lease learnt with a given
    /// id is confirmed by a `Renew` before it is returned, and its local deadline counts from that
    /// renewal; a grant that is no longer current ends the call with [`Error::NotFound`]: nothing
    /// is held, acquire again with a new id.
    pub request_id: Option<RequestId>,
    /// Total time for the call including retries; `None` = `wait + call_timeout`.
    pub timeout: Option<Duration>,
}

impl AcquireOptions {
    /// Sets the lease ttl.
    pub fn ttl(mut self, ttl: Duration) -> Self {
        self.ttl = Some(ttl);
        self
    }
    /// Sets how long to queue for a held resource.
    pub fn wait(mut self, wait: Duration) -> Self {
        self.wait = Some(wait);
        self
    }
    /// Sets the holder text `Describe` shows.
    pub fn holder(mut self, holder: impl Into<String>) -> Self {
        self.holder = Some(holder.into());
        self
    }
    /// Reuses the request id of an earlier attempt, to learn its outcome.
    pub fn request_id(mut self, id: RequestId) -> Self {
        self.request_id = Some(id);
        self
    }
    /// Sets the total time for the call, retries included.
    pub fn timeout(mut self, timeout: Duration) -> Self {
        self.timeout = Some(timeout);
        self
    }
}

/// What a `Release` did ([`Client::release_outcome`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ReleaseOutcome {
    /// The lease was current and is released now.
    Released,
    /// The lease was not current (expired, released or superseded), and no earlier attempt of
    /// this call may have reached a node: this call released nothing.
    NotCurrent,
    /// The lease was not current when the answered attempt arrived, but an earlier attempt of
    /// this call went unanswered and may have released it: whether this call released it is
    /// unknown. Either way the lease is not held now.
    NotCurrentAfterRetry,
}

/// A successful `Renew`.
#[derive(Clone, Debug)]
pub struct Renewed {
    /// The lease's ttl after the renewal.
    pub ttl: Duration,
    /// When the answered attempt left this client: the new deadline counts from here.
    pub sent_at: Instant,
    /// Informative only, like [`Lease::expires_at_unix_ms`].
    pub expires_at_unix_ms: i64,
}

/// A lockd client. Cheap to clone: clones share the connections.
#[derive(Clone)]
pub struct Client {
    inner: Arc<Inner>,
}

struct Inner {
    endpoints: Endpoints,
    config: ClientConfig,
}

/// What one logical call needs to know to retry and to report.
struct CallCtx<'a> {
    op: Op,
    resource: Option<&'a str>,
    request_id: Option<&'a RequestId>,
    /// No attempt starts, and no attempt runs, past this instant.
    deadline: Instant,
    /// Longest one attempt may wait for its answer.
    attempt_timeout: Duration,
    /// An earlier call may already have sent this request (the caller passed the request id of
    /// an `OutcomeUnknown`): then no answer of this call can prove that nothing was done.
    sent_before: bool,
}

/// A reply and the send times the lease arithmetic needs.
struct Answered<T> {
    value: T,
    /// The earliest attempt that may have reached a node.
    first_sent: Instant,
    /// The attempt that was answered.
    sent: Instant,
}

/// Why a call ended without a reply.
enum Failed {
    /// A definite status, mapped by each RPC with its own context.
    Final(Status),
    /// Retries ran out of time.
    Exhausted(Error),
}

impl Client {
    /// A client with default settings. Nothing is connected until the first call.
    pub fn new<I, S>(endpoints: I) -> Result<Self, Error>
    where
        I: IntoIterator<Item = S>,
        S: Into<String>,
    {
        Self::with_config(ClientConfig::new(endpoints))
    }

    /// A client with the given settings; fails on an unusable endpoint, TLS setting or token. Nothing is connected until the first call.
    pub fn with_config(config: ClientConfig) -> Result<Self, Error> {
        // The token is written before the client could learn that the other end speaks no TLS:
        // over plaintext anyone on the path (or a spoofed endpoint) would read a long-lived
        // secret. lockd accepts tokens only with TLS on anyway.
        if config.bearer_token.is_some() && config.tls.is_none() {
            return Err(Error::BadToken {
                reason: "a bearer token is sent only over TLS: give the nodes' CA (--cacert)"
                    .to_owned(),
            });
        }
        let endpoints = Endpoints::parse(
            &config.endpoints,
            config.connect_timeout,
            config.tls.as_ref(),
        )?;
        Ok(Client {
            inner: Arc::new(Inner { endpoints, config }),
        })
    }

    /// The settings this client was made with.
    pub fn config(&self) -> &ClientConfig {
        &self.inner.config
    }

    /// `msg` as a request carrying the configured bearer token, if any.
    pub fn authed<T>(&self, msg: T) -> tonic::Request<T> {
        let mut req = tonic::Request::new(msg);
        if let Some(token) = &self.inner.config.bearer_token {
            req.metadata_mut().insert("authorization", token.header());
        }
        req
    }

    /// The margin subtracted from the deadline of a lease with this ttl: the configured one or
    /// [`default_safety_margin`], never more than half the ttl (so a renewal is always due before
    /// the deadline).
    pub fn safety_margin(&self, ttl: Duration) -> Duration {
        self.inner
            .config
            .safety_margin
            .unwrap_or_else(|| default_safety_margin(ttl))
            .min(ttl / 2)
    }

    /// Takes the lock on `resource` (waiting up to `opts.wait`), retrying transport errors and
    /// `UNAVAILABLE` with the same request id until the call's deadline.
    pub async fn acquire(&self, resource: &str, opts: AcquireOptions) -> Result<Lease, Error> {
        let started = Instant::now();
        check_resource(resource)?;
        let wait = opts.wait.unwrap_or_default();
        let request_id = opts.request_id.clone().unwrap_or_else(RequestId::random);
        let request = AcquireRequest {
            resource: resource.to_owned(),
            request_id: request_id.as_str().to_owned(),
            lease_ttl_ms: opts.ttl.map(millis).unwrap_or(0),
            wait_timeout_ms: millis(wait),
            holder: opts
                .holder
                .clone()
                .unwrap_or_else(|| self.inner.config.holder.clone()),
        };
        let budget = opts
            .timeout
            .unwrap_or(wait + self.inner.config.call_timeout);
        let ctx = CallCtx {
            op: Op::Acquire,
            resource: Some(resource),
            request_id: Some(&request_id),
            deadline: started + budget,
            // A waiting attempt legitimately takes up to `wait` before the server answers.
            attempt_timeout: wait + self.inner.config.attempt_timeout,
            sent_before: opts.request_id.is_some(),
        };
        let answered = self
            .call(&ctx, |channel| {
                let request = self.authed(request.clone());
                async move { LockClient::new(channel).acquire(request).await }
            })
            .await
            .map_err(|f| self.failed(f, &ctx, None, wait))?;
        let reply = answered.value;
        let lease_id = LeaseId::new(reply.lease_id);
        let token = FencingToken(reply.fencing_token);
        let (sent_at, ttl) = if ctx.sent_before {
            // A given id may repeat a call made long ago, and lockd answers it with the original
            // grant, expired or not: when that grant was made is unknown here, so its deadline
            // cannot be counted from this call. A Renew proves the lease current and starts its
            // time afresh (docs/clients.md, rule 3).
            let deadline = ctx
                .deadline
                .max(Instant::now() + self.inner.config.attempt_timeout);
            match self
                .renew_until(
                    resource,
                    &lease_id,
                    None,
                    deadline,
                    self.inner.config.attempt_timeout,
                )
                .await
            {
                Ok(r) => (r.sent_at, r.ttl),
                Err(Error::NotFound { lease, message, .. }) => {
                    return Err(Error::NotFound {
                        resource: resource.to_owned(),
                        lease,
                        message: format!(
                            "request id {} was granted token {token}, which is no longer current \
                             (expired or released since): nothing is held; acquire with a new \
                             request id ({message})",
                            abbreviate(request_id.as_str())
                        ),
                    });
                }
                Err(e) => {
                    return Err(granted_unconfirmed(
                        resource,
                        &request_id,
                        token,
                        "the renewal that confirms a repeated request id",
                        e,
                        started.elapsed(),
                    ));
                }
            }
        } else {
            (
                answered.first_sent,
                granted_ttl(reply.lease_ttl_ms, opts.ttl),
            )
        };
        Ok(Lease {
            resource: resource.to_owned(),
            lease_id,
            fencing_token: token,
            ttl,
            request_id,
            sent_at,
            expires_at_unix_ms: reply.expires_at_unix_ms,
            sequencer: reply.sequencer,
        })
    }

    /// Acquires and returns a [`LeaseGuard`] that renews the lease until it is released, dropped
    /// or lost. If the acquire took so long (waiting, retries) that less than half the ttl is left
    /// of its local deadline, the lease is renewed once before the guard is handed out, so a
    /// caller never starts work on a lease about to be declared lost.
    pub async fn lock(&self, resource: &str, opts: AcquireOptions) -> Result<LeaseGuard, Error> {
        let started = Instant::now();
        let budget = opts
            .timeout
            .unwrap_or(opts.wait.unwrap_or_default() + self.inner.config.call_timeout);
        let lease = self.acquire(resource, opts).await?;
        let margin = self.safety_margin(lease.ttl);
        let now = Instant::now();
        let (valid_from, ttl) = if lease.local_deadline(margin) < now + lease.ttl / 2 {
            // The renewal's own send time starts a fresh deadline; a renewal that succeeds proves the
            // lease was still current when it committed, even if the first deadline has passed.
            let deadline = (started + budget).max(now + self.inner.config.attempt_timeout);
            match self
                .renew_until(
                    resource,
                    &lease.lease_id,
                    None,
                    deadline,
                    self.inner.config.attempt_timeout,
                )
                .await
            {
                Ok(r) => (r.sent_at, r.ttl),
                Err(e) => {
                    // Nothing to release when the renewal proved the lease not current.
                    let released = if matches!(e, Error::NotFound { .. }) {
                        None
                    } else {
                        timeout(
                            self.inner.config.attempt_timeout,
                            self.release(resource, &lease.lease_id),
                        )
                        .await
                        .ok()
                        .and_then(Result::ok)
                    };
                    return Err(handout_renewal_failed(
                        &lease,
                        e,
                        released,
                        started.elapsed(),
                    ));
                }
            }
        } else {
            (lease.sent_at, lease.ttl)
        };
        Ok(LeaseGuard::start(
            self.clone(),
            lease,
            valid_from,
            ttl,
            margin,
        ))
    }

    /// Extends `lease_id` on `resource` by its ttl (or `ttl`), retrying until the call timeout.
    pub async fn renew(
        &self,
        resource: &str,
        lease_id: &LeaseId,
        ttl: Option<Duration>,
    ) -> Result<Renewed, Error> {
        let deadline = Instant::now() + self.inner.config.call_timeout;
        self.renew_until(
            resource,
            lease_id,
            ttl,
            deadline,
            self.inner.config.attempt_timeout,
        )
        .await
    }

    /// `Renew` with an explicit deadline and per-attempt limit: the guard bounds both by the
    /// lease's own deadline.
    pub(crate) async fn renew_until(
        &self,
        resource: &str,
        lease_id: &LeaseId,
        ttl: Option<Duration>,
        deadline: Instant,
        attempt_timeout: Duration,
    ) -> Result<Renewed, Error> {
        check_held_resource(resource)?;
        let request = RenewRequest {
            resource: resource.to_owned(),
            lease_id: lease_id.as_str().to_owned(),
            lease_ttl_ms: ttl.map(millis).unwrap_or(0),
        };
        let ctx = CallCtx {
            op: Op::Renew,
            resource: Some(resource),
            request_id: None,
            deadline,
            attempt_timeout,
            sent_before: false,
        };
        let answered = self
            .call(&ctx, |channel| {
                let request = self.authed(request.clone());
                async move { LockClient::new(channel).renew(request).await }
            })
            .await
            .map_err(|f| self.failed(f, &ctx, Some(lease_id), Duration::ZERO))?;
        Ok(Renewed {
            ttl: granted_ttl(answered.value.lease_ttl_ms, ttl),
            sent_at: answered.sent,
            expires_at_unix_ms: answered.value.expires_at_unix_ms,
        })
    }

    /// Gives up `lease_id`. `Ok(false)` when it was not the current lease (nothing released). A
    /// release retried after an unanswered attempt may also answer `false` because that earlier
    /// attempt released it: [`Client::release_outcome`] tells the two apart.
    pub async fn release(&self, resource: &str, lease_id: &LeaseId) -> Result<bool, Error> {
        Ok(self.release_outcome(resource, lease_id).await? == ReleaseOutcome::Released)
    }

    /// Gives up `lease_id`, saying whether an answer "not current" may follow an earlier attempt
    /// of this call that released it ([`ReleaseOutcome::NotCurrentAfterRetry`]).
    pub async fn release_outcome(
        &self,
        resource: &str,
        lease_id: &LeaseId,
    ) -> Result<ReleaseOutcome, Error> {
        check_held_resource(resource)?;
        let request = ReleaseRequest {
            resource: resource.to_owned(),
            lease_id: lease_id.as_str().to_owned(),
        };
        let ctx = CallCtx {
            op: Op::Release,
            resource: Some(resource),
            request_id: None,
            deadline: Instant::now() + self.inner.config.call_timeout,
            attempt_timeout: self.inner.config.attempt_timeout,
            sent_before: false,
        };
        let answered = self
            .call(&ctx, |channel| {
                let request = self.authed(request.clone());
                async move { LockClient::new(channel).release(request).await }
            })
            .await
            .map_err(|f| self.failed(f, &ctx, Some(lease_id), Duration::ZERO))?;
        Ok(if answered.value.released {
            ReleaseOutcome::Released
        } else if answered.first_sent < answered.sent {
            // An earlier attempt went unanswered and may have released the lease.
            ReleaseOutcome::NotCurrentAfterRetry
        } else {
            ReleaseOutcome::NotCurrent
        })
    }

    /// The linearizable state of `resource` (never its lease id).
    pub async fn describe(&self, resource: &str) -> Result<DescribeResponse, Error> {
        check_held_resource(resource)?;
        let request = DescribeRequest {
            resource: resource.to_owned(),
        };
        let ctx = CallCtx {
            op: Op::Describe,
            resource: Some(resource),
            request_id: None,
            deadline: Instant::now() + self.inner.config.call_timeout,
            attempt_timeout: self.inner.config.attempt_timeout,
            sent_before: false,
        };
        self.call(&ctx, |channel| {
            let request = self.authed(request.clone());
            async move { LockClient::new(channel).describe(request).await }
        })
        .await
        .map(|a| a.value)
        .map_err(|f| self.failed(f, &ctx, None, Duration::ZERO))
    }

    /// Status of the first node that answers (not necessarily the leader).
    pub async fn status(&self) -> Result<StatusResponse, Error> {
        let ctx = CallCtx {
            op: Op::Status,
            resource: None,
            request_id: None,
            deadline: Instant::now() + self.inner.config.call_timeout,
            attempt_timeout: self.inner.config.attempt_timeout,
            sent_before: false,
        };
        self.call(&ctx, |channel| {
            let request = self.authed(StatusRequest {});
            async move { ClusterClient::new(channel).status(request).await }
        })
        .await
        .map(|a| a.value)
        .map_err(|f| self.failed(f, &ctx, None, Duration::ZERO))
    }

    /// Admin: the public keys that verify sequencers (active and retired), oldest first, as the
    /// leader knows them after a linearizable read.
    pub async fn signing_keys(&self) -> Result<Vec<SigningKeyInfo>, Error> {
        let ctx = CallCtx {
            op: Op::SigningKeys,
            resource: None,
            request_id: None,
            deadline: Instant::now() + self.inner.config.call_timeout,
            attempt_timeout: self.inner.config.attempt_timeout,
            sent_before: false,
        };
        self.call(&ctx, |channel| async move {
            ClusterClient::new(channel)
                .signing_keys(SigningKeysRequest {})
                .await
        })
        .await
        .map(|a| a.value.keys)
        .map_err(|f| self.failed(f, &ctx, None, Duration::ZERO))
    }

    /// Admin: makes the leader commit a new signing key; the previous one is retired but still
    /// listed. Retry-safe: it names the key it saw active (from [`Client::signing_keys`]), so a
    /// retry of a rotation that applied returns that rotation instead of rotating twice.
    pub async fn rotate_signing_key(&self) -> Result<RotateSigningKeyResponse, Error> {
        let active = self
            .signing_keys()
            .await?
            .into_iter()
            .find(|k| k.active)
            .map(|k| k.key_id)
            .unwrap_or_default();
        let ctx = CallCtx {
            op: Op::RotateSigningKey,
            resource: None,
            request_id: None,
            deadline: Instant::now() + self.inner.config.call_timeout,
            attempt_timeout: self.inner.config.attempt_timeout,
            sent_before: false,
        };
        let request = RotateSigningKeyRequest {
            replaces_key_id: active,
        };
        self.call(&ctx, |channel| {
            let request = request.clone();
            async move {
                ClusterClient::new(channel)
                    .rotate_signing_key(request)
                    .await
            }
        })
        .await
        .map(|a| a.value)
        .map_err(|f| self.failed(f, &ctx, None, Duration::ZERO))
    }

    /// Runs `rpc` against the current endpoint until it answers, gives a final status, or the
    /// deadline passes; rotates to the next endpoint and backs off after every retryable failure.
    async fn call<T, F, Fut>(&self, ctx: &CallCtx<'_>, mut rpc: F) -> Result<Answered<T>, Failed>
    where
        F: FnMut(Channel) -> Fut,
        Fut: Future<Output = Result<tonic::Response<T>, Status>>,
    {
        let started = Instant::now();
        let endpoints = &self.inner.endpoints;
        let mut delays = backoff();
        let mut attempts = 0u32;
        let mut first_sent: Option<Instant> = None;
        let mut last_error = String::from("the deadline passed before any attempt");
        // Endpoints in a row whose TLS handshake refused this client's trust settings: once every
        // endpoint has, retrying until the deadline cannot help.
        let mut tls_refusals = 0usize;
        while Instant::now() < ctx.deadline {
            attempts += 1;
            let index = endpoints.current();
            let name = endpoints.name(index);
            // Connecting (TCP and HTTP/2 handshake) gets the connect timeout, not the attempt's:
            // a node that cannot even finish a handshake in that time is skipped.
            let connect_limit = self
                .inner
                .config
                .connect_timeout
                .min(remaining(Instant::now(), ctx.deadline));
            let failure = match timeout(connect_limit, endpoints.channel(index)).await {
                Err(_) => AttemptFailure::NotSent(format!(
                    "{name}: not connected within {}",
                    humanize(connect_limit)
                )),
                Ok(Err(e)) => {
                    let chain = error_chain(&e);
                    if is_certificate_refusal(&chain) {
                        tls_refusals += 1;
                    } else {
                        tls_refusals = 0;
                    }
                    AttemptFailure::NotSent(format!("{name}: cannot connect: {chain}"))
                }
                Ok(Ok(channel)) => {
                    let sent = Instant::now();
                    let limit = ctx.attempt_timeout.min(remaining(sent, ctx.deadline));
                    match timeout(limit, rpc(channel)).await {
                        Ok(Ok(reply)) => {
                            return Ok(Answered {
                                value: reply.into_inner(),
                                first_sent: first_sent.unwrap_or(sent),
                                sent,
                            });
                        }
                        Ok(Err(status)) => {
                            // Before this attempt's own send time is recorded: whether an
                            // *earlier* attempt (or an earlier call) may have reached a node.
                            let earlier = first_sent.is_some() || ctx.sent_before;
                            let failure = classify(ctx.op, status, name);
                            if let AttemptFailure::Final(status) = &failure
                                && earlier
                                && speaks_for_this_attempt_only(ctx.op, status)
                            {
                                return Err(Failed::Exhausted(Error::OutcomeUnknown {
                                    op: ctx.op,
                                    resource: ctx.resource.unwrap_or_default().to_owned(),
                                    request_id: ctx.request_id.cloned(),
                                    attempts,
                                    elapsed: started.elapsed(),
                                    last_error: format!(
                                        "an earlier attempt may have taken effect, and lockd \
                                         refused a later one before its state machine decided \
                                         the request, which says nothing about the earlier one: \
                                         {name}: {:?}: {}",
                                        status.code(),
                                        status.message()
                                    ),
                                }));
                            }
                            if !matches!(failure, AttemptFailure::NotSent(_)) {
                                first_sent.get_or_insert(sent);
                            }
                            failure
                        }
                        Err(_) => {
                            first_sent.get_or_insert(sent);
                            AttemptFailure::MaybeSent(format!(
                                "{name}: no answer within {}",
                                humanize(limit)
                            ))
                        }
                    }
                }
            };
            match failure {
                AttemptFailure::Final(status) => return Err(Failed::Final(status)),
                AttemptFailure::NotSent(message) | AttemptFailure::MaybeSent(message) => {
                    tracing::debug!(op = %ctx.op, attempt = attempts, error = %message, "retrying on the next endpoint");
                    last_error = message;
                    endpoints.invalidate(index);
                    endpoints.rotate_from(index);
                    if tls_refusals >= endpoints.len() {
                        break;
                    }
                }
            }
            match next_delay(&mut delays, Instant::now(), ctx.deadline) {
                Some(delay) => sleep(delay).await,
                None => break,
            }
        }
        let elapsed = started.elapsed();
        let resource = ctx.resource.map(str::to_owned);
        Err(Failed::Exhausted(
            if (first_sent.is_some() || ctx.sent_before) && ctx.op.mutates() {
                Error::OutcomeUnknown {
                    op: ctx.op,
                    resource: resource.unwrap_or_default(),
                    request_id: ctx.request_id.cloned(),
                    attempts,
                    elapsed,
                    last_error,
                }
            } else {
                Error::Unavailable {
                    op: ctx.op,
                    resource,
                    attempts,
                    elapsed,
                    last_error,
                }
            },
        ))
    }

    fn failed(
        &self,
        failed: Failed,
        ctx: &CallCtx<'_>,
        lease: Option<&LeaseId>,
        wait: Duration,
    ) -> Error {
        match failed {
            Failed::Exhausted(e) => e,
            Failed::Final(status) => from_final_status(
                ctx.op,
                status,
                ctx.resource.unwrap_or_default(),
                lease.map(LeaseId::as_str),
                wait,
            ),
        }
    }
}

mod snapshot;

/// The error of a granted lease that cannot be handed out because the renewal `what` describes
/// failed without proving it gone (`NOT_FOUND` does): it may still be held, until its ttl, so the
/// outcome is unknown and a repeat of the request id tells (docs/clients.md, rules 3 and 10).
fn granted_unconfirmed(
    resource: &str,
    request_id: &RequestId,
    token: FencingToken,
    what: &str,
    cause: Error,
    elapsed: Duration,
) -> Error {
    let attempts = match &cause {
        Error::Unavailable { attempts, .. } | Error::OutcomeUnknown { attempts, .. } => *attempts,
        _ => 1,
    };
    Error::OutcomeUnknown {
        op: Op::Acquire,
        resource: resource.to_owned(),
        request_id: Some(request_id.clone()),
        attempts,
        elapsed,
        last_error: format!(
            "granted token {token}, then {what} failed; the lease may still be held: {cause}"
        ),
    }
}

/// What `lock()` reports when the renewal before handing out the guard of `lease` failed with
/// `renewal`, and the release that followed answered `released` (`None`: it failed, or was not
/// tried). The lease was granted: only a renewal answered `NOT_FOUND` proves that nothing is
/// held. Any other failure (a transit bound's refusal, a policy that allows acquire but not
/// renew, a renewal whose own outcome is unknown) is "outcome unknown" for the Acquire, with its
/// request id, whatever the release answered: never the renewal's own "not granted" or "not
/// done" (docs/clients.md, rule 10).
fn handout_renewal_failed(
    lease: &Lease,
    renewal: Error,
    released: Option<bool>,
    elapsed: Duration,
) -> Error {
    let token = lease.fencing_token;
    match renewal {
        Error::NotFound {
            resource,
            lease: shown,
            message,
        } => Error::NotFound {
            resource,
            lease: shown,
            message: format!(
                "granted token {token}, which the renewal before handing out the guard found \
                 not current (expired since): nothing is held; acquire again ({message})"
            ),
        },
        e => {
            let after = match released {
                Some(true) => "it was released afterwards",
                Some(false) => "the release afterwards found it not current",
                None => "no release afterwards was answered, so the lease may still be held",
            };
            let attempts = match &e {
                Error::Unavailable { attempts, .. } | Error::OutcomeUnknown { attempts, .. } => {
                    *attempts
                }
                _ => 1,
            };
            Error::OutcomeUnknown {
                op: Op::Acquire,
                resource: lease.resource.clone(),
                request_id: Some(lease.request_id.clone()),
                attempts,
                elapsed,
                last_error: format!(
                    "granted token {token}, then the renewal before handing out the guard \
                     failed ({after}): {e}"
                ),
            }
        }
    }
}

/// Refuses to send a resource name the server would reject anyway, naming it.
fn check_resource(resource: &str) -> Result<(), Error> {
    lockd_fence::validate_resource(resource).map_err(|e| Error::InvalidArgument {
        message: e.to_string(),
    })
}

/// For Renew, Release and Describe: the server's rule for a name held already, which is laxer
/// (whitespace at either end allowed, so a lock acquired before that rule can still be released).
fn check_held_resource(resource: &str) -> Result<(), Error> {
    if resource.is_empty()
        || resource.len() > lockd_fence::RESOURCE_MAX_BYTES
        || resource.chars().any(char::is_control)
    {
        return Err(Error::InvalidArgument {
            message: format!(
                "resource {resource:?} must be 1 to {} bytes without control characters",
                lockd_fence::RESOURCE_MAX_BYTES
            ),
        });
    }
    Ok(())
}

/// Milliseconds for the wire, saturating (the server rejects absurd values with the value named).
fn millis(d: Duration) -> u64 {
    u64::try_from(d.as_millis()).unwrap_or(u64::MAX)
}

/// The ttl a reply granted; a reply without one means the requested ttl or the server default.
fn granted_ttl(reply_ms: u64, requested: Option<Duration>) -> Duration {
    if reply_ms > 0 {
        Duration::from_millis(reply_ms)
    } else {
        requested
            .filter(|d| !d.is_zero())
            .unwrap_or(SERVER_DEFAULT_TTL)
    }
}

/// `outer: inner: innermost`, since tonic's transport errors hide the cause in their sources.
/// Whether a connect error is a TLS handshake refused on certificates (rustls: the server's
/// certificate is not trusted or does not name the endpoint, or the server refused ours): the
/// same settings will fail the same way on a retry.
fn is_certificate_refusal(chain: &str) -> bool {
    chain.contains("invalid peer certificate")
        || chain.contains("received fatal alert: BadCertificate")
        || chain.contains("received fatal alert: UnknownCA")
        || chain.contains("received fatal alert: CertificateRequired")
}

fn error_chain(e: &(dyn std::error::Error + 'static)) -> String {
    let mut out = e.to_string();
    let mut source = e.source();
    while let Some(s) = source {
        let text = s.to_string();
        if !out.contains(&text) {
            out.push_str(": ");
            out.push_str(&text);
        }
        source = s.source();
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Goal (review "clients2" finding 4): once `lock()` was granted a lease, a failure of the
    /// renewal before handing it out never says "not granted" or "not done" (a transit bound's
    /// unmarked LIMIT_REACHED, a policy that allows acquire but not renew, a renewal whose own
    /// outcome is unknown): it is "outcome unknown" for the Acquire, with its request id, also
    /// when the release that follows fails. A renewal answered NOT_FOUND proves nothing is
    /// held, and says so naming the token.
    #[test]
    fn review_clients2_finding4_a_failed_handout_renewal_is_never_not_granted() {
        let request_id = RequestId::parse("0123456789abcdef0123456789abcdef").unwrap();
        let lease = Lease {
            resource: "orders/1".into(),
            lease_id: LeaseId::new("fedcba9876543210fedcba9876543210"),
            fencing_token: FencingToken(41),
            ttl: Duration::from_secs(2),
            request_id: request_id.clone(),
            sent_at: Instant::now(),
            expires_at_unix_ms: 0,
            sequencer: Vec::new(),
        };
        let renewals = || {
            [
                Error::LimitReached {
                    resource: "orders/1".into(),
                    message: "receiving_per_source_max".into(),
                },
                Error::PermissionDenied {
                    op: Op::Renew,
                    message: "token:ci may not renew \"orders/1\"".into(),
                },
                Error::OutcomeUnknown {
                    op: Op::Renew,
                    resource: "orders/1".into(),
                    request_id: None,
                    attempts: 3,
                    elapsed: Duration::from_secs(1),
                    last_error: "no answer".into(),
                },
                Error::Unavailable {
                    op: Op::Renew,
                    resource: Some("orders/1".into()),
                    attempts: 2,
                    elapsed: Duration::from_secs(1),
                    last_error: "no quorum".into(),
                },
            ]
        };
        for i in 0..renewals().len() {
            for released in [None, Some(false), Some(true)] {
                // `Error` is not Clone: a fresh one for every case.
                let renewal = renewals().into_iter().nth(i).unwrap();
                let shown = renewal.to_string();
                let e = handout_renewal_failed(&lease, renewal, released, Duration::ZERO);
                match &e {
                    Error::OutcomeUnknown {
                        op: Op::Acquire,
                        request_id: Some(id),
                        last_error,
                        ..
                    } => {
                        assert_eq!(id.as_str(), request_id.as_str());
                        assert!(
                            last_error.contains("token 41") && last_error.contains(&shown),
                            "{e}"
                        );
                    }
                    other => panic!("{shown} (released {released:?}) became {other:?}: {other}"),
                }
                assert!(!e.is_definitely_not_granted());
            }
        }
        let gone = Error::NotFound {
            resource: "orders/1".into(),
            lease: "fedcba98…".into(),
            message: "lockd: not current".into(),
        };
        let e = handout_renewal_failed(&lease, gone, None, Duration::ZERO);
        assert!(
            matches!(&e, Error::NotFound { .. })
                && e.to_string().contains("token 41")
                && e.to_string().contains("nothing is held"),
            "{e}"
        );
    }

    #[test]
    fn granted_ttl_prefers_the_reply() {
        assert_eq!(granted_ttl(5000, None), Duration::from_secs(5));
        assert_eq!(
            granted_ttl(0, Some(Duration::from_secs(2))),
            Duration::from_secs(2)
        );
        assert_eq!(granted_ttl(0, None), SERVER_DEFAULT_TTL);
    }

    #[test]
    fn margin_never_exceeds_half_the_ttl() {
        let mut config = ClientConfig::new(["127.0.0.1:1"]);
        config.safety_margin = Some(Duration::from_secs(100));
        let client = Client::with_config(config).unwrap();
        assert_eq!(
            client.safety_margin(Duration::from_secs(10)),
            Duration::from_secs(5)
        );
    }

    /// Against a port nobody listens on, every attempt fails to connect: the error says "not done",
    /// not "outcome unknown", and arrives by the deadline.
    #[tokio::test]
    async fn unreachable_endpoints_mean_not_done_within_the_deadline() {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = listener.local_addr().unwrap();
        drop(listener);
        let client = Client::new([addr.to_string()]).unwrap();
        let started = Instant::now();
        let err = client
            .acquire(
                "orders/1",
                AcquireOptions::default().timeout(Duration::from_millis(600)),
            )
            .await
            .unwrap_err();
        assert!(
            started.elapsed() < Duration::from_secs(2),
            "{:?}",
            started.elapsed()
        );
        assert!(
            matches!(err, Error::Unavailable { attempts, .. } if attempts >= 2),
            "{err:?}"
        );
        assert!(err.is_definitely_not_granted());
        assert!(err.to_string().contains(&addr.to_string()), "{err}");
    }

    /// A node that accepts the connection but never answers leaves the outcome unknown, and the
    /// error carries the request id to retry with.
    #[tokio::test]
    async fn silent_node_means_outcome_unknown_with_request_id() {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        // Accept and hold connections without speaking HTTP/2 back.
        let holder = tokio::spawn(async move {
            let mut held = Vec::new();
            while let Ok((socket, _)) = listener.accept().await {
                held.push(socket);
            }
        });
        let mut config = ClientConfig::new([addr.to_string()]);
        config.attempt_timeout = Duration::from_millis(200);
        config.connect_timeout = Duration::from_millis(200);
        let client = Client::with_config(config).unwrap();
        let id = RequestId::random();
        let err = client
            .acquire(
                "orders/1",
                AcquireOptions::default()
                    .request_id(id.clone())
                    .timeout(Duration::from_millis(900)),
            )
            .await
            .unwrap_err();
        holder.abort();
        match &err {
            Error::OutcomeUnknown { request_id, .. } => {
                assert_eq!(request_id.as_ref(), Some(&id));
            }
            other => panic!("expected OutcomeUnknown, got {other:?}"),
        }
        assert!(!err.is_definitely_not_granted());
        assert!(err.to_string().contains("orders/1"), "{err}");
    }

    #[tokio::test]
    async fn bad_resource_is_refused_before_sending() {
        let client = Client::new(["127.0.0.1:1"]).unwrap();
        let err = client
            .acquire("a\u{7}b", AcquireOptions::default())
            .await
            .unwrap_err();
        assert!(matches!(err, Error::InvalidArgument { .. }), "{err:?}");
        assert!(err.to_string().contains("a\\u{7}b"), "{err}");
    }
}
