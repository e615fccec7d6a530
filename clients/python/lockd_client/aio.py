"""The asyncio client (grpc.aio), with the semantics of the synchronous one:

    async with AsyncClient(["127.0.0.1:7001"]) as client:
        async with client.lock("orders/42", ttl=30, wait=10) as lease:
            lease.check()
            await write(token=lease.fencing_token)

``lease.lost`` is an ``asyncio.Event`` that fires when the lease can no longer be trusted; the
lease renews itself in a task every ttl/3 with jitter.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any, Callable, Generator, List, Optional, Sequence, Tuple, Union

import grpc
import grpc.aio

from . import _core as core
from . import errors as E
from ._pb import lockd_pb2 as pb
from ._pb import lockd_pb2_grpc as pb_grpc
from .client import Grant, Renewed

log = logging.getLogger("lockd_client")
# docs/clients.md, rule 1: every local time is on the monotonic clock.
_now = time.monotonic

_CONNECTED = grpc.ChannelConnectivity.READY
_FAILED = (grpc.ChannelConnectivity.TRANSIENT_FAILURE, grpc.ChannelConnectivity.SHUTDOWN)


# docs/clients.md, rule 2.
async def _wait_connected(channel: grpc.aio.Channel, limit: float) -> Optional[str]:
    async def until_settled() -> grpc.ChannelConnectivity:
        state = channel.get_state(try_to_connect=True)
        while state != _CONNECTED and state not in _FAILED:
            await channel.wait_for_state_change(state)
            state = channel.get_state(try_to_connect=True)
        return state

    try:
        state = await asyncio.wait_for(until_settled(), timeout=limit)
    except asyncio.TimeoutError:
        return "not connected within %s" % core.humanize(limit)
    return None if state == _CONNECTED else "cannot connect"


def _status_info(err: grpc.aio.AioRpcError) -> core.StatusInfo:
    st = core.status_from_trailers(err.trailing_metadata())
    if st is not None and st.code != err.code().value[0]:
        st = None  # a details trailer that disagrees with the status is not lockd's
    reason, metadata = core.error_info_from_status(st)
    return core.StatusInfo(err.code(), err.details() or "", reason, metadata)


class AsyncClient:
    """The asyncio lockd client; arguments as :class:`lockd_client.Client`. Create it inside the
    event loop that uses it."""

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
            if self._tls is None:
                raise E.InvalidArgument("a bearer token is sent only over TLS: give tls=TLS(ca=...)")
            if not token or not all(33 <= ord(c) <= 126 for c in token):
                raise E.InvalidArgument("a bearer token must be printable ASCII without spaces")
        self._metadata: Tuple[Tuple[str, str], ...] = (
            (("authorization", "Bearer " + token),) if token else ()
        )
        self._creds = self._tls.credentials() if self._tls else None
        self._targets = [core.parse_endpoint(e, self._tls is not None) for e in eps]
        self._channels: List[Optional[grpc.aio.Channel]] = [None] * len(self._targets)
        self._current = 0
        self.holder = holder or core.default_holder()
        self.connect_timeout = connect_timeout
        self.attempt_timeout = attempt_timeout
        self.call_timeout = call_timeout
        self._safety_margin = safety_margin

    async def close(self) -> None:
        channels, self._channels = self._channels, [None] * len(self._targets)
        for ch in channels:
            if ch is not None:
                await ch.close()

    async def __aenter__(self) -> "AsyncClient":
        return self

    async def __aexit__(self, *exc: Any) -> None:
        await self.close()

    def safety_margin(self, ttl: float) -> float:
        margin = self._safety_margin
        if margin is None:
            margin = core.default_safety_margin(ttl)
        return min(margin, ttl / 2)

    def _channel(self, index: int) -> grpc.aio.Channel:
        ch = self._channels[index]
        if ch is None:
            target = self._targets[index]
            ch = (
                grpc.aio.secure_channel(target, self._creds)
                if self._creds is not None
                else grpc.aio.insecure_channel(target)
            )
            self._channels[index] = ch
        return ch

    async def _invalidate(self, index: int, ch: grpc.aio.Channel) -> None:
        if self._channels[index] is ch:
            self._channels[index] = None
            await ch.close(grace=None)

    # docs/clients.md, rule 4.
    async def _call(
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
        """As ``Client._call``: rotate and back off after retryable failures until the deadline."""
        started = _now()
        delays = core.backoff()
        attempts = 0
        first_sent: Optional[float] = None
        last_error = "the deadline passed before any attempt"
        while _now() < deadline:
            attempts += 1
            index = self._current
            target = self._targets[index]
            channel = self._channel(index)
            why = await _wait_connected(channel, min(self.connect_timeout, max(deadline - _now(), 0.0)))
            if why is not None:
                last_error = "%s: %s" % (target, why)
            else:
                stub_cls = pb_grpc.LockStub if service == "Lock" else pb_grpc.ClusterStub
                rpc = getattr(stub_cls(channel), method)
                sent = _now()
                limit = max(min(attempt_timeout, deadline - sent), 0.001)
                try:
                    reply = await rpc(request, timeout=limit, metadata=self._metadata)
                    return reply, (first_sent if first_sent is not None else sent), sent
                except grpc.aio.AioRpcError as err:
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
                                core.refused_after_maybe_sent(target, info),
                            ) from None
                        raise core.final_error(op, info, resource, lease_id, wait) from None
                    if kind == core.MAYBE_SENT and first_sent is None:
                        first_sent = sent
                    last_error = core.describe_status(target, info)
            log.debug("%s attempt %d failed (%s), trying the next endpoint", op, attempts, last_error)
            await self._invalidate(index, channel)
            if self._current == index:
                self._current = (index + 1) % len(self._targets)
            delay = next(delays)
            if _now() + delay >= deadline:
                break
            await asyncio.sleep(delay)
        # A caller-given request id may have reached lockd in an earlier call of the caller's,
        # so this call never ends as "nothing done" (docs/clients.md, rule 6).
        maybe_sent = first_sent is not None or sent_before
        raise core.exhausted_error(
            op, resource, request_id, maybe_sent, attempts, _now() - started, last_error
        )

    async def acquire(
        self,
        resource: str,
        *,
        ttl: Optional[float] = None,
        wait: Optional[float] = None,
        holder: Optional[str] = None,
        request_id: Optional[str] = None,
        timeout: Optional[float] = None,
    ) -> Grant:
        """As :meth:`lockd_client.Client.acquire`."""
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
        reply, first_sent, _ = await self._call(
            "acquire",
            "Acquire",
            "Lock",
            request,
            deadline=started + budget,
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
                renewed = await self._renew_until(resource, reply.lease_id, None, deadline, self.attempt_timeout)
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

    async def renew(self, resource: str, lease_id: str, *, ttl: Optional[float] = None) -> Renewed:
        return await self._renew_until(
            resource, lease_id, ttl, _now() + self.call_timeout, self.attempt_timeout
        )

    async def _renew_until(
        self, resource: str, lease_id: str, ttl: Optional[float], deadline: float, attempt_timeout: float
    ) -> Renewed:
        core.check_resource(resource)
        request = pb.RenewRequest(resource=resource, lease_id=lease_id, lease_ttl_ms=core.to_ms(ttl, "ttl"))
        reply, _, sent = await self._call(
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

    async def release(self, resource: str, lease_id: str) -> bool:
        """Gives ``lease_id`` up. False when it was not the current lease; see
        :meth:`release_outcome` for which of the two "not current" answers it was."""
        return await self.release_outcome(resource, lease_id) is core.ReleaseOutcome.RELEASED

    async def release_outcome(self, resource: str, lease_id: str) -> core.ReleaseOutcome:
        """Gives ``lease_id`` up and says what happened (see :class:`ReleaseOutcome`)."""
        return await self._release_within(resource, lease_id, self.call_timeout)

    async def _release_within(self, resource: str, lease_id: str, seconds: float) -> core.ReleaseOutcome:
        core.check_resource(resource)
        reply, first_sent, sent = await self._call(
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

    async def describe(self, resource: str) -> "pb.DescribeResponse":
        core.check_resource(resource)
        reply, _, _ = await self._call(
            "describe",
            "Describe",
            "Lock",
            pb.DescribeRequest(resource=resource),
            deadline=_now() + self.call_timeout,
            attempt_timeout=self.attempt_timeout,
            resource=resource,
        )
        return reply

    async def status(self) -> "pb.StatusResponse":
        reply, _, _ = await self._call(
            "status",
            "Status",
            "Cluster",
            pb.StatusRequest(),
            deadline=_now() + self.call_timeout,
            attempt_timeout=self.attempt_timeout,
        )
        return reply

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
    ) -> "_LockCall":
        """``async with client.lock(...) as lease`` (released on exit), or
        ``lease = await client.lock(...)`` (then ``await lease.release()``)."""
        return _LockCall(self, resource, dict(ttl=ttl, wait=wait, holder=holder, request_id=request_id, timeout=timeout))

    async def _lock(self, resource: str, opts: dict) -> "AsyncLease":
        started = _now()
        budget = opts["timeout"] if opts["timeout"] is not None else (opts["wait"] or 0.0) + self.call_timeout
        grant = await self.acquire(resource, **opts)
        margin = self.safety_margin(grant.ttl)
        now = _now()
        valid_from, granted = grant.sent_at, grant.ttl
        if grant.local_deadline(margin) < now + grant.ttl / 2:
            deadline = max(started + budget, now + self.attempt_timeout)
            try:
                renewed = await self._renew_until(resource, grant.lease_id, None, deadline, self.attempt_timeout)
            except BaseException as e:
                released: Optional[bool] = None
                if not isinstance(e, E.LeaseNotCurrent):  # nothing to release then
                    try:
                        # Bounded by one attempt timeout (rule 10): the caller waits for
                        # an answer, and the lease expires after its ttl anyway.
                        released = (
                            await self._release_within(resource, grant.lease_id, self.attempt_timeout)
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
        return AsyncLease(self, grant, valid_from, granted, margin)


class _LockCall:
    def __init__(self, client: AsyncClient, resource: str, opts: dict) -> None:
        self._client, self._resource, self._opts = client, resource, opts
        self._lease: Optional[AsyncLease] = None

    def __await__(self) -> Generator[Any, None, "AsyncLease"]:
        return self._client._lock(self._resource, self._opts).__await__()

    async def __aenter__(self) -> "AsyncLease":
        self._lease = await self._client._lock(self._resource, self._opts)
        return self._lease

    async def __aexit__(self, *exc: Any) -> None:
        assert self._lease is not None
        await self._lease.__aexit__(*exc)


class AsyncLostSignal(asyncio.Event):
    """An ``asyncio.Event`` set, once and for good, when the lease can no longer be trusted;
    ``is_set()`` also compares the local deadline with the clock (see ``LostSignal``)."""

    def __init__(self, deadline: Callable[[], float]) -> None:
        super().__init__()
        self._deadline = deadline
        self.reason: Optional[str] = None
        self.message: Optional[str] = None

    def fire(self, reason: str, message: str) -> None:
        if self.reason is None:
            self.reason, self.message = reason, message
        super().set()

    def set(self) -> None:
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

    async def wait(self) -> bool:  # type: ignore[override]
        while not self.is_set():
            try:
                await asyncio.wait_for(super().wait(), timeout=max(self._deadline() - _now(), 0.0) + 0.001)
            except asyncio.TimeoutError:
                pass
        return True


class AsyncLease:
    """The asyncio counterpart of :class:`lockd_client.Lease`: renews in a task, ``lost`` is an
    :class:`AsyncLostSignal`, ``await release()`` (or leaving ``async with``) fires it and releases."""

    def __init__(self, client: AsyncClient, grant: Grant, valid_from: float, ttl: float, margin: float) -> None:
        self._client = client
        self.grant = grant
        self.margin = margin
        self._deadline = valid_from + max(ttl - margin, 0.0)
        self.lost = AsyncLostSignal(self.deadline)
        self.renewals = 0
        self._released = False
        self._task = asyncio.get_running_loop().create_task(self._renew_loop(valid_from, ttl))

    resource = property(lambda self: self.grant.resource)
    lease_id = property(lambda self: self.grant.lease_id)
    fencing_token = property(lambda self: self.grant.fencing_token)
    sequencer = property(lambda self: self.grant.sequencer)
    request_id = property(lambda self: self.grant.request_id)
    ttl = property(lambda self: self.grant.ttl)

    def deadline(self) -> float:
        return self._deadline

    @property
    def loss(self) -> Optional[str]:
        self.lost.is_set()
        return self.lost.reason

    def is_lost(self) -> bool:
        return self.lost.is_set()

    # docs/clients.md, rule 12.
    def check(self) -> None:
        if self.lost.is_set():
            raise E.LeaseLost(
                "lease of %r (token %d) lost: %s" % (self.resource, self.fencing_token, self.lost.message),
                loss=self.lost.reason or E.LOSS_RELEASED,
                resource=self.resource,
            )

    # docs/clients.md, rule 14.
    async def release(self) -> bool:
        """As ``Lease.release``: fires ``lost``, stops renewing, releases."""
        if self._released:
            return False
        self.lost.fire(E.LOSS_RELEASED, "lease released by its owner")
        self._task.cancel()
        released = await self._client.release(self.resource, self.lease_id)
        self._released = True
        return released

    async def __aenter__(self) -> "AsyncLease":
        return self

    async def __aexit__(self, *exc: Any) -> None:
        try:
            await self.release()
        except E.LockdError as e:
            log.warning("release of %r failed (it expires after its ttl): %s", self.resource, e)

    # docs/clients.md, rule 11.
    async def _renew_loop(self, last_sent: float, ttl: float) -> None:
        lost = self.lost
        try:
            while True:
                interval = ttl / core.RENEWALS_PER_TTL
                due = core.next_renewal(last_sent, interval)
                deadline = self._deadline
                await asyncio.sleep(max(min(due, deadline) - _now(), 0.0))
                if lost.is_set():
                    return
                if _now() < due:
                    continue
                attempt_timeout = min(interval, self._client.attempt_timeout)
                try:
                    # The lease's deadline bounds the renewal, so a hung call cannot outlive it.
                    renewed = await asyncio.wait_for(
                        self._client._renew_until(self.resource, self.lease_id, None, deadline, attempt_timeout),
                        timeout=max(deadline - _now(), 0.0) + 0.001,
                    )
                except asyncio.TimeoutError:
                    lost.fire(E.LOSS_DEADLINE_PASSED, "no renewal succeeded before the local deadline")
                    return
                except E.LeaseNotCurrent as e:
                    lost.fire(E.LOSS_NOT_CURRENT, "lease is not current any more: %s" % e)
                    return
                except (E.OutcomeUnknown, E.Unavailable) as e:
                    lost.fire(E.LOSS_DEADLINE_PASSED, "no renewal succeeded before the local deadline: %s" % e)
                    return
                except E.LockdError as e:
                    lost.fire(E.LOSS_RENEW_REFUSED, "renewal refused: %s" % e)
                    return
                if lost.is_set():
                    return
                self._deadline = max(self._deadline, renewed.sent_at + max(renewed.ttl - self.margin, 0.0))
                self.renewals += 1
                last_sent, ttl = renewed.sent_at, renewed.ttl
        except asyncio.CancelledError:
            raise
        except Exception as e:
            lost.fire(E.LOSS_RENEW_REFUSED, "renewal task failed: %r" % (e,))
            log.exception("lockd renewal task of %r failed", self.resource)
