"""The synchronous client: the Lock and Cluster RPCs with endpoint rotation, deadline-bounded
retries, typed errors, and the lease guard (``with client.lock(...) as lease``).

Timing follows docs/client.md, "Timing model": every deadline counts from the time a request was
*sent*, on the monotonic clock, never from the reply or from the server's wall clock.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable, List, Optional, Sequence, Tuple, Union

import grpc
from grpc_status import rpc_status

from . import _core as core
from . import errors as E
from ._pb import lockd_pb2 as pb
from ._pb import lockd_pb2_grpc as pb_grpc

log = logging.getLogger("lockd_client")

# docs/clients.md, rule 1: every local time is on the monotonic clock.
_now = time.monotonic


@dataclass(frozen=True)
class Grant:
    """A lease as ``acquire`` returned it (no renewal: see :meth:`Client.lock` for that)."""

    resource: str
    #: The secret Renew and Release need. Never log it.
    lease_id: str
    #: Strictly greater than every token the cluster issued before: attach it to every write.
    fencing_token: int
    #: The ttl the cluster granted, in seconds.
    ttl: float
    #: The id every attempt carried; acquiring again with it returns this same lease.
    request_id: str
    #: When the first attempt that may have reached a node was sent (monotonic clock). The grant
    #: happened later, so the lease cannot expire before ``sent_at + ttl``. With a caller-given
    #: ``request_id`` (whose grant may be minutes old): the send time of the confirming renewal.
    sent_at: float
    #: The leader's wall-clock estimate of expiry. Informative only, never used for timing.
    expires_at_unix_ms: int
    #: The grant signed by the cluster's key (``Lock-Sequencer`` header in base64, ``lockd.fence``).
    sequencer: bytes

    def local_deadline(self, margin: float) -> float:
        return self.sent_at + max(self.ttl - margin, 0.0)

    def __repr__(self) -> str:  # never print the lease id in full
        return "Grant(resource=%r, lease_id=%r, fencing_token=%d, ttl=%s)" % (
            self.resource,
            core.abbreviate(self.lease_id),
            self.fencing_token,
            self.ttl,
        )


@dataclass(frozen=True)
class Renewed:
    ttl: float
    #: Send time of the answered attempt: the new deadline counts from here.
    sent_at: float
    expires_at_unix_ms: int


# docs/clients.md, rule 2.
class _Endpoint:
    def __init__(self, target: str, make: Callable[[str], grpc.Channel]) -> None:
        self.target = target
        self._make = make
        self._channel: Optional[grpc.Channel] = None
        self._lock = threading.Lock()

    def channel(self) -> grpc.Channel:
        with self._lock:
            if self._channel is None:
                self._channel = self._make(self.target)
            return self._channel

    def invalidate(self, channel: grpc.Channel) -> None:
        """Drops a channel that failed, so the next attempt connects afresh (grpc's own reconnect
        backoff would otherwise delay a node that came back)."""
        with self._lock:
            if self._channel is channel:
                self._channel = None
            else:
                return
        channel.close()

    def close(self) -> None:
        with self._lock:
            channel, self._channel = self._channel, None
        if channel is not None:
            channel.close()


# docs/clients.md, rule 2.
def _wait_connected(channel: grpc.Channel, limit: float) -> Optional[str]:
    """None once the channel is READY; otherwise why not. A connect that failed or timed out
    proves the request never left, so the attempt is "not sent".

    Watches the state on the calling thread through the core channel (grpcio is pinned) rather
    than with ``channel.subscribe``: that starts a polling thread per channel, which raises when
    the channel is closed under it and can hang interpreter exit on an unclosed client."""
    core_channel = getattr(channel, "_channel", None)
    if core_channel is None or not hasattr(core_channel, "watch_connectivity_state"):
        try:
            grpc.channel_ready_future(channel).result(timeout=limit)
            return None
        except grpc.FutureTimeoutError:
            return "not connected within %s" % core.humanize(limit)
    end = time.time() + limit  # the core takes an absolute wall-clock deadline for the watch
    raw = core_channel.check_connectivity_state(True)
    while True:
        state = _CONNECTIVITY.get(raw)
        if state == grpc.ChannelConnectivity.READY:
            return None
        if state in (grpc.ChannelConnectivity.TRANSIENT_FAILURE, grpc.ChannelConnectivity.SHUTDOWN):
            return "cannot connect"
        if time.time() >= end:
            return "not connected within %s" % core.humanize(limit)
        core_channel.watch_connectivity_state(raw, min(end, time.time() + 0.2))
        # IDLE again (e.g. after the idle timeout) needs another push to connect.
        raw = core_channel.check_connectivity_state(state == grpc.ChannelConnectivity.IDLE)


def _connectivity_map() -> dict:
    from grpc import _common

    return dict(_common.CYGRPC_CONNECTIVITY_STATE_TO_CHANNEL_CONNECTIVITY)


_CONNECTIVITY = _connectivity_map()


class Client:
    """A lockd client. Thread-safe; one instance can serve a whole process.

    ``endpoints``: ``host:port`` (or ``http://`` / ``https://``) of the nodes, as a list or a
    comma-separated string. Any node forwards to the leader; the list needs one live node.
    ``tls``: a :class:`TLS` (CA, optional client certificate and key) or ``True`` for the system
    roots. ``token``: a bearer token, sent as ``authorization: Bearer ...``, only over TLS.
    """

    def __init__(
        self,
        endpoints: Union[str, Sequence[str]],
        *,
        tls: Union[core.TLS, bool, None] = None,
        token: Optional[str] = None,
        holder: Optional[str] = None,
        connect_timeout: float = core.CONNECT_TIMEOUT,
        attempt_timeout: float = core.ATTEMPT_TIMEOUT,
        call_timeout: float = core.CALL_TIMEOUT,
        safety_margin: Optional[float] = None,
    ) -> None:
        eps = core.normalize_endpoints(endpoints)
        if tls is True:
            tls = core.TLS()
        self._tls: Optional[core.TLS] = tls or None
        if token is not None:
            # Over plaintext anyone on the path would read a long-lived secret.
            if self._tls is None:
                raise E.InvalidArgument("a bearer token is sent only over TLS: give tls=TLS(ca=...)")
            if not token or not all(33 <= ord(c) <= 126 for c in token):
                raise E.InvalidArgument("a bearer token must be printable ASCII without spaces")
        self._metadata: Tuple[Tuple[str, str], ...] = (
            (("authorization", "Bearer " + token),) if token else ()
        )
        creds = self._tls.credentials() if self._tls else None
        targets = [core.parse_endpoint(e, self._tls is not None) for e in eps]

        def make(target: str) -> grpc.Channel:
            if creds is not None:
                return grpc.secure_channel(target, creds)
            return grpc.insecure_channel(target)

        self._endpoints = [_Endpoint(t, make) for t in targets]
        self._current = 0
        self._rotate_lock = threading.Lock()
        self.holder = holder or core.default_holder()
        self.connect_timeout = connect_timeout
        self.attempt_timeout = attempt_timeout
        self.call_timeout = call_timeout
        self._safety_margin = safety_margin

    # -- plumbing -------------------------------------------------------------------------------

    def close(self) -> None:
        for ep in self._endpoints:
            ep.close()

    def __enter__(self) -> "Client":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    @property
    def endpoints(self) -> List[str]:
        return [e.target for e in self._endpoints]

    def safety_margin(self, ttl: float) -> float:
        margin = self._safety_margin
        if margin is None:
            margin = core.default_safety_margin(ttl)
        return min(margin, ttl / 2)

    # docs/clients.md, rule 4.
    def _call(
        self,
        op: str,
        method: str,
        service: str,
        request: Any,
        *,
        deadline: float,
        attempt_timeout: float,
        resource: Optional[str] = None,
        request_id: Optional[str] = None,
        lease_id: Optional[str] = None,
        wait: float = 0.0,
        sent_before: bool = False,
    ) -> Tuple[Any, float, float]:
        """Runs one RPC against the current endpoint until it answers, gives a final status, or the
        deadline passes; after a retryable failure rotates to the next endpoint and backs off.
        Returns (reply, send time of the first attempt that may have arrived, send time of the
        answered attempt)."""
        started = _now()
        delays = core.backoff()
        attempts = 0
        first_sent: Optional[float] = None
        last_error = "the deadline passed before any attempt"
        while _now() < deadline:
            attempts += 1
            with self._rotate_lock:
                index = self._current
            ep = self._endpoints[index]
            channel = ep.channel()
            why = _wait_connected(channel, min(self.connect_timeout, max(deadline - _now(), 0.0)))
            if why is not None:
                kind, last_error = core.NOT_SENT, "%s: %s" % (ep.target, why)
            else:
                stub_cls = pb_grpc.LockStub if service == "Lock" else pb_grpc.ClusterStub
                rpc = getattr(stub_cls(channel), method)
                sent = _now()
                limit = max(min(attempt_timeout, deadline - sent), 0.001)
                try:
                    reply = rpc(request, timeout=limit, metadata=self._metadata)
                    return reply, (first_sent if first_sent is not None else sent), sent
                except grpc.RpcError as err:
                    info = _status_info(err)
                    kind = core.classify(op, info)
                    if kind == core.FINAL:
                        # first_sent is set by maybe-sent attempts only: an earlier attempt.
                        earlier = first_sent is not None or sent_before
                        if earlier and core.speaks_for_this_attempt_only(op, info):
                            raise core.exhausted_error(
                                op,
                                resource,
                                request_id,
                                True,
                                attempts,
                                _now() - started,
                                core.refused_after_maybe_sent(ep.target, info),
                            ) from None
                        raise core.final_error(op, info, resource, lease_id, wait) from None
                    if kind == core.MAYBE_SENT and first_sent is None:
                        first_sent = sent
                    last_error = core.describe_status(ep.target, info)
            log.debug("%s attempt %d failed (%s), trying the next endpoint", op, attempts, last_error)
            ep.invalidate(channel)
            with self._rotate_lock:
                if self._current == index:
                    self._current = (index + 1) % len(self._endpoints)
            delay = next(delays)
            if _now() + delay >= deadline:
                break
            time.sleep(delay)
        # A caller-given request id may have reached lockd in an earlier call of the caller's,
        # so this call never ends as "nothing done" (docs/clients.md, rule 6).
        maybe_sent = first_sent is not None or sent_before
        raise core.exhausted_error(
            op, resource, request_id, maybe_sent, attempts, _now() - started, last_error
        )

    # -- the RPCs -------------------------------------------------------------------------------

    def acquire(
        self,
        resource: str,
        *,
        ttl: Optional[float] = None,
        wait: Optional[float] = None,
        holder: Optional[str] = None,
        request_id: Optional[str] = None,
        timeout: Optional[float] = None,
    ) -> Grant:
        """Takes the lock on ``resource`` (queueing up to ``wait`` seconds), retrying transport
        errors and ``UNAVAILABLE`` with the same request id until ``timeout`` (default ``wait`` +
        15 s). ``ttl`` in seconds (None: the server's 30 s). Does not renew: use :meth:`lock`.

        To learn the outcome of a call that raised :class:`OutcomeUnknown`, call again with its
        ``request_id`` and the same ttl, wait and holder."""
        started = _now()
        core.check_resource(resource)
        rid = request_id if request_id is not None else core.new_request_id()
        core.check_request_id(rid)
        wait_s = wait or 0.0
        request = pb.AcquireRequest(
            resource=resource,
            request_id=rid,
            lease_ttl_ms=core.to_ms(ttl, "ttl"),
            wait_timeout_ms=core.to_ms(wait, "wait"),
            holder=holder if holder is not None else self.holder,
        )
        budget = timeout if timeout is not None else wait_s + self.call_timeout
        reply, first_sent, _ = self._call(
            "acquire",
            "Acquire",
            "Lock",
            request,
            deadline=started + budget,
            # A waiting attempt legitimately takes up to `wait` before lockd answers.
            attempt_timeout=wait_s + self.attempt_timeout,
            resource=resource,
            request_id=rid,
            wait=wait_s,
            sent_before=request_id is not None,
        )
        sent_at, granted = first_sent, core.granted_ttl(reply.lease_ttl_ms, ttl)
        if request_id is not None:
            # docs/clients.md, rule 3: a caller-given id may repeat a call made long ago, and lockd
            # answers it with the original grant, expired or not; when that grant was made is
            # unknown here. A Renew proves the lease current and starts its time afresh.
            now = _now()
            deadline = max(started + budget, now + self.attempt_timeout)
            try:
                renewed = self._renew_until(resource, reply.lease_id, None, deadline, self.attempt_timeout)
            except E.LeaseNotCurrent as e:
                raise core.repeat_not_current(resource, rid, reply.fencing_token, e) from None
            except E.LockdError as e:
                raise core.granted_unconfirmed(
                    resource, rid, reply.fencing_token, "the renewal that confirms a repeated request id", e
                ) from None
            sent_at, granted = renewed.sent_at, renewed.ttl
        return Grant(
            resource=resource,
            lease_id=reply.lease_id,
            fencing_token=reply.fencing_token,
            ttl=granted,
            request_id=rid,
            sent_at=sent_at,
            expires_at_unix_ms=reply.expires_at_unix_ms,
            sequencer=bytes(reply.sequencer),
        )

    def renew(self, resource: str, lease_id: str, *, ttl: Optional[float] = None) -> Renewed:
        """Extends ``lease_id`` by its ttl (or ``ttl``). :class:`LeaseNotCurrent` if it is not
        the current lease."""
        return self._renew_until(resource, lease_id, ttl, _now() + self.call_timeout, self.attempt_timeout)

    def _renew_until(
        self,
        resource: str,
        lease_id: str,
        ttl: Optional[float],
        deadline: float,
        attempt_timeout: float,
    ) -> Renewed:
        core.check_resource(resource)
        request = pb.RenewRequest(resource=resource, lease_id=lease_id, lease_ttl_ms=core.to_ms(ttl, "ttl"))
        reply, _, sent = self._call(
            "renew",
            "Renew",
            "Lock",
            request,
            deadline=deadline,
            attempt_timeout=attempt_timeout,
            resource=resource,
            lease_id=lease_id,
        )
        return Renewed(core.granted_ttl(reply.lease_ttl_ms, ttl), sent, reply.expires_at_unix_ms)

    def release(self, resource: str, lease_id: str) -> bool:
        """Gives ``lease_id`` up. False when it was not the current lease (nothing released); a
        release retried after an unanswered attempt may also answer False because that attempt
        released it: :meth:`release_outcome` tells the two apart."""
        return self.release_outcome(resource, lease_id) is core.ReleaseOutcome.RELEASED

    def release_outcome(self, resource: str, lease_id: str) -> core.ReleaseOutcome:
        """Gives ``lease_id`` up and says what happened: ``RELEASED``, ``NOT_CURRENT`` (nothing
        released), or ``NOT_CURRENT_AFTER_RETRY`` (a retry found it not current after an attempt
        that went unanswered and may have released it; docs/clients.md, rule 14)."""
        return self._release_within(resource, lease_id, self.call_timeout)

    def _release_within(self, resource: str, lease_id: str, seconds: float) -> core.ReleaseOutcome:
        core.check_resource(resource)
        reply, first_sent, sent = self._call(
            "release",
            "Release",
            "Lock",
            pb.ReleaseRequest(resource=resource, lease_id=lease_id),
            deadline=_now() + seconds,
            attempt_timeout=self.attempt_timeout,
            resource=resource,
            lease_id=lease_id,
        )
        return core.release_outcome(bool(reply.released), first_sent, sent)

    def describe(self, resource: str) -> "pb.DescribeResponse":
        """The linearizable state of ``resource``: ``held``, ``holder``, ``fencing_token``,
        ``expires_at_unix_ms`` (informative), ``waiters``. Never the lease id."""
        core.check_resource(resource)
        reply, _, _ = self._call(
            "describe",
            "Describe",
            "Lock",
            pb.DescribeRequest(resource=resource),
            deadline=_now() + self.call_timeout,
            attempt_timeout=self.attempt_timeout,
            resource=resource,
        )
        return reply

    def status(self) -> "pb.StatusResponse":
        """Status of the first node that answers (not necessarily the leader)."""
        reply, _, _ = self._call(
            "status",
            "Status",
            "Cluster",
            pb.StatusRequest(),
            deadline=_now() + self.call_timeout,
            attempt_timeout=self.attempt_timeout,
        )
        return reply

    # -- the guard ------------------------------------------------------------------------------

    # docs/clients.md, rule 10.
    def lock(
        self,
        resource: str,
        *,
        ttl: Optional[float] = None,
        wait: Optional[float] = None,
        holder: Optional[str] = None,
        request_id: Optional[str] = None,
        timeout: Optional[float] = None,
    ) -> "Lease":
        """Acquires ``resource`` and returns a :class:`Lease` that renews itself in the background
        until released (``with`` block exit, :meth:`Lease.release`) or lost. If the acquire took so
        long that less than half the ttl is left before its local deadline, the lease is renewed
        once before it is handed out, so work never starts on a lease about to be declared lost."""
        started = _now()
        budget = timeout if timeout is not None else (wait or 0.0) + self.call_timeout
        grant = self.acquire(
            resource, ttl=ttl, wait=wait, holder=holder, request_id=request_id, timeout=timeout
        )
        margin = self.safety_margin(grant.ttl)
        now = _now()
        valid_from, granted = grant.sent_at, grant.ttl
        if grant.local_deadline(margin) < now + grant.ttl / 2:
            deadline = max(started + budget, now + self.attempt_timeout)
            try:
                renewed = self._renew_until(resource, grant.lease_id, None, deadline, self.attempt_timeout)
            except BaseException as e:
                released: Optional[bool] = None
                if not isinstance(e, E.LeaseNotCurrent):  # nothing to release then
                    try:
                        # Bounded by one attempt timeout (rule 10): the caller waits for
                        # an answer, and the lease expires after its ttl anyway.
                        released = (
                            self._release_within(resource, grant.lease_id, self.attempt_timeout)
                            is core.ReleaseOutcome.RELEASED
                        )
                    except E.LockdError:
                        pass  # it expires after its ttl
                if not isinstance(e, E.LockdError):
                    raise  # an interrupt or a cancellation, not an answer
                # The lease was granted: never report the renewal's "not done" (rule 10).
                raise core.handout_renewal_failed(
                    resource, grant.request_id, grant.fencing_token, e, released
                ) from None
            valid_from, granted = renewed.sent_at, renewed.ttl
        return Lease(self, grant, valid_from, granted, margin)


def _status_info(err: grpc.RpcError) -> core.StatusInfo:
    code = err.code() if hasattr(err, "code") else grpc.StatusCode.UNKNOWN
    message = (err.details() if hasattr(err, "details") else None) or str(err)
    try:
        st = rpc_status.from_call(err)  # type: ignore[arg-type]
    except (ValueError, AttributeError):
        st = None  # a details trailer that disagrees with the status is not lockd's
    reason, metadata = core.error_info_from_status(st)
    return core.StatusInfo(code, message, reason, metadata)


# docs/clients.md, rule 12.
class LostSignal(threading.Event):
    """A ``threading.Event`` that is set, once and for good, when the lease can no longer be
    trusted. ``is_set()`` and ``wait()`` also compare the local deadline with the clock, so code
    that runs right after a process pause sees the loss before the renewal thread had a chance to
    run."""

    def __init__(self, deadline: Callable[[], float]) -> None:
        super().__init__()
        self._deadline = deadline
        self._reason_lock = threading.Lock()
        self.reason: Optional[str] = None
        self.message: Optional[str] = None

    def fire(self, reason: str, message: str) -> None:
        with self._reason_lock:
            if self.reason is None:
                self.reason, self.message = reason, message
        super().set()

    def set(self) -> None:  # set by hand = released by its owner
        self.fire(E.LOSS_RELEASED, "lease released by its owner")

    def clear(self) -> None:
        raise RuntimeError("a lost lease is never found again: acquire a new one")

    def is_set(self) -> bool:
        if super().is_set():
            return True
        if _now() >= self._deadline():
            self.fire(
                E.LOSS_DEADLINE_PASSED,
                "no renewal succeeded before the local deadline; the lease may have expired",
            )
            return True
        return False

    isSet = is_set

    def wait(self, timeout: Optional[float] = None) -> bool:
        end = None if timeout is None else _now() + timeout
        while not self.is_set():
            now = _now()
            step = self._deadline() - now
            if end is not None:
                if now >= end:
                    return False
                step = min(step, end - now)
            super().wait(max(step, 0.0) + 0.001)
        return True


class Lease:
    """A held lease that renews itself every ttl/3 (with jitter) on a daemon thread.

    Use it as a context manager (``with client.lock(...) as lease:``): leaving the block fires
    ``lost`` (reason ``released``), stops renewing and releases. Before each protected write call
    :meth:`check` (or test ``lost.is_set()``) and send :attr:`fencing_token` with the write, so
    that the storage (or fence-proxy) refuses it should this process have been paused in between.
    The lease never re-acquires by itself: after a loss, call :meth:`Client.lock` again for a new
    lease with a larger token."""

    def __init__(self, client: Client, grant: Grant, valid_from: float, ttl: float, margin: float) -> None:
        self._client = client
        self.grant = grant
        self.margin = margin
        self._deadline = valid_from + max(ttl - margin, 0.0)
        self._deadline_lock = threading.Lock()
        self.lost = LostSignal(self.deadline)
        self.renewals = 0
        self._stop = threading.Event()
        self._released = False
        self._thread = threading.Thread(
            target=self._renew_loop,
            args=(valid_from, ttl),
            name="lockd-renew-%s" % grant.resource,
            daemon=True,
        )
        self._thread.start()

    resource = property(lambda self: self.grant.resource)
    lease_id = property(lambda self: self.grant.lease_id)
    fencing_token = property(lambda self: self.grant.fencing_token)
    sequencer = property(lambda self: self.grant.sequencer)
    request_id = property(lambda self: self.grant.request_id)
    ttl = property(lambda self: self.grant.ttl)

    def deadline(self) -> float:
        """The current local deadline on the monotonic clock (``time.monotonic()``)."""
        with self._deadline_lock:
            return self._deadline

    @property
    def loss(self) -> Optional[str]:
        """Why the lease was lost (``errors.LOSS_*``), once it is."""
        self.lost.is_set()
        return self.lost.reason

    def is_lost(self) -> bool:
        return self.lost.is_set()

    # docs/clients.md, rule 12.
    def check(self) -> None:
        """Returns while the lease is held; raises :class:`LeaseLost` once it may be gone."""
        if self.lost.is_set():
            raise E.LeaseLost(
                "lease of %r (token %d) lost: %s" % (self.resource, self.fencing_token, self.lost.message),
                loss=self.lost.reason or E.LOSS_RELEASED,
                resource=self.resource,
            )

    # docs/clients.md, rule 14.
    def release(self) -> bool:
        """Fires ``lost`` (so workers stop before the lock is given up), stops renewing and
        releases. False when the lease was no longer current, or already released by an earlier
        call; after a call that raised, another call tries again."""
        if self._released:
            return False
        self._stop.set()
        self.lost.fire(E.LOSS_RELEASED, "lease released by its owner")
        released = self._client.release(self.resource, self.lease_id)
        self._released = True
        return released

    def __enter__(self) -> "Lease":
        return self

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        try:
            self.release()
        except E.LockdError as e:
            # Not raised over the block's own outcome: an unreleased lease expires after its ttl.
            log.warning("release of %r failed (it expires after its ttl): %s", self.resource, e)

    def __repr__(self) -> str:
        return "Lease(resource=%r, fencing_token=%d, lost=%s)" % (
            self.resource,
            self.fencing_token,
            self.lost.is_set(),
        )

    # docs/clients.md, rule 11.
    def _renew_loop(self, last_sent: float, ttl: float) -> None:
        lost = self.lost
        try:
            while True:
                interval = ttl / core.RENEWALS_PER_TTL
                due = core.next_renewal(last_sent, interval)
                deadline = self.deadline()
                if self._stop.wait(max(min(due, deadline) - _now(), 0.0)):
                    return
                if lost.is_set():  # checks the deadline too
                    return
                if _now() < due:
                    continue
                # Each attempt may take at most one renewal interval, so a stuck node leaves time
                # to try the others before the deadline.
                attempt_timeout = min(interval, self._client.attempt_timeout)
                try:
                    renewed = self._client._renew_until(
                        self.resource, self.lease_id, None, deadline, attempt_timeout
                    )
                except E.LeaseNotCurrent as e:
                    lost.fire(E.LOSS_NOT_CURRENT, "lease is not current any more: %s" % e)
                    return
                except (E.OutcomeUnknown, E.Unavailable) as e:
                    lost.fire(E.LOSS_DEADLINE_PASSED, "no renewal succeeded before the local deadline: %s" % e)
                    return
                except E.LockdError as e:
                    lost.fire(E.LOSS_RENEW_REFUSED, "renewal refused: %s" % e)
                    return
                if self._stop.is_set():
                    return
                # A renewal answered after the deadline does not revive the lease.
                if lost.is_set():
                    return
                with self._deadline_lock:
                    self._deadline = max(self._deadline, renewed.sent_at + max(renewed.ttl - self.margin, 0.0))
                self.renewals += 1
                last_sent, ttl = renewed.sent_at, renewed.ttl
        except Exception as e:  # never die silently: a renewer that stopped must say so
            lost.fire(E.LOSS_RENEW_REFUSED, "renewal thread failed: %r" % (e,))
            log.exception("lockd renewal thread of %r failed", self.resource)
