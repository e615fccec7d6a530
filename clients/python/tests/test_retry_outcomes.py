"""What the client concludes from a repeated request id and from answers after a retry (review
"clients", findings 1 to 4): a grant learnt by repeating a request id is confirmed before it is
handed out; a refusal that speaks for one attempt only does not say "not granted" once an
earlier attempt may have been granted; a lease granted and then not renewed is not "not done";
request ids are shown shortened."""

from __future__ import annotations

import asyncio
import time
from concurrent import futures
from typing import Callable, Dict, List, Optional

import grpc
import pytest
from google.protobuf import any_pb2
from google.rpc import error_details_pb2, status_pb2
from grpc_status import rpc_status

import lockd_client
from lockd_client import AsyncClient, Client
from lockd_client._core import new_request_id
from lockd_client._pb import lockd_pb2 as pb

from conftest import unique


# --- finding 1: a repeated request id, against a real cluster ----------------------------------


def test_review_clients_finding1_repeat_after_expiry_says_nothing_is_held(client):
    """A request id repeated after its grant expired: lockd answers with the old grant (its
    dedup record), but nothing is held. Both acquire and lock say so, naming the token."""
    res = unique("py-repeat-expired")
    rid = new_request_id()
    first = client.acquire(res, ttl=1, request_id=rid)
    time.sleep(1.6)
    assert not client.describe(res).held
    for call in (client.acquire, client.lock):
        with pytest.raises(lockd_client.LeaseNotCurrent) as e:
            call(res, ttl=1, request_id=rid)
        text = str(e.value)
        assert str(first.fencing_token) in text and "new request id" in text, text
        assert e.value.definitely_not_done
        assert rid not in text, "the request id is a credential: " + text

    async def main():
        async with AsyncClient(client.endpoints) as ac:
            with pytest.raises(lockd_client.LeaseNotCurrent):
                await ac.acquire(res, ttl=1, request_id=rid)
            with pytest.raises(lockd_client.LeaseNotCurrent):
                await ac.lock(res, ttl=1, request_id=rid)

    asyncio.run(main())


def test_review_clients_finding1_repeat_is_confirmed_before_handing_out(client, cluster):
    """lock() with the request id of a grant made 85 % of a ttl ago: the lease must not be handed
    out on a deadline counted from the repeat. B tries to take the resource for a ttl and a
    quarter; it must never be granted while A's lease says it is held."""
    res = unique("py-repeat-live")
    rid = new_request_id()
    ttl = 2.0
    first = client.acquire(res, ttl=ttl, request_id=rid)
    time.sleep(ttl * 0.85)
    lease = client.lock(res, ttl=ttl, request_id=rid)
    try:
        assert lease.fencing_token == first.fencing_token
        b = cluster.client()
        until = time.monotonic() + ttl * 1.25
        while time.monotonic() < until:
            try:
                got = b.acquire(res, ttl=ttl)
            except lockd_client.Held:
                time.sleep(0.05)
                continue
            assert lease.lost.is_set(), (
                "B was granted token %d while A's lease of token %d still claims it"
                % (got.fencing_token, first.fencing_token)
            )
            break
        assert not lease.lost.is_set(), lease.lost.message
        b.close()
    finally:
        lease.release()


# --- a fake lockd.v1.Lock answering as told ----------------------------------------------------


def _status(code: grpc.StatusCode, message: str, reason: str, metadata: Dict[str, str]) -> grpc.Status:
    detail = any_pb2.Any()
    detail.Pack(error_details_pb2.ErrorInfo(reason=reason, domain="lockd", metadata=metadata))
    return rpc_status.to_status(status_pb2.Status(code=code.value[0], message=message, details=[detail]))


class _Fake:
    """Acquire, Renew and Release answered by the functions given: each gets the attempt's number
    (0 for the first; for Acquire counted per request id, so that several clients can share one
    fake) and the context, and returns a reply or aborts."""

    def __init__(self, **handlers: Callable) -> None:
        self.calls: Dict[str, List[str]] = {"Acquire": [], "Renew": [], "Release": []}
        types = {"Acquire": pb.AcquireRequest, "Renew": pb.RenewRequest, "Release": pb.ReleaseRequest}

        def method(name: str, fn: Callable):
            def handle(request, context):
                rid = getattr(request, "request_id", "")
                n = self.calls[name].count(rid)
                self.calls[name].append(rid)
                return fn(n, context)

            return grpc.unary_unary_rpc_method_handler(handle, request_deserializer=types[name].FromString,
                                                       response_serializer=lambda m: m.SerializeToString())

        handler = grpc.method_handlers_generic_handler(
            "lockd.v1.Lock", {name: method(name, fn) for name, fn in handlers.items()}
        )
        self.server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
        self.server.add_generic_rpc_handlers((handler,))
        self.port = self.server.add_insecure_port("127.0.0.1:0")
        self.server.start()
        self.endpoint = "127.0.0.1:%d" % self.port

    def stop(self) -> None:
        self.server.stop(0)


def _hang_then_refuse(metadata: Dict[str, str]) -> Callable:
    """The first attempt gets no answer in time (it may have been granted); every later one is
    refused RESOURCE_EXHAUSTED / WAITERS_EXHAUSTED with `metadata`."""

    def acquire(n, context):
        if n == 0:
            time.sleep(1.5)
            context.abort(grpc.StatusCode.UNAVAILABLE, "too late")
        context.abort_with_status(
            _status(grpc.StatusCode.RESOURCE_EXHAUSTED, "lockd: waits_per_source_max", "WAITERS_EXHAUSTED", metadata)
        )

    return acquire


UNMARKED = {"limit": "waits_per_source_max"}
MARKED = {"limit": "waiters_per_resource_max", "decided_by": "state_machine"}


def _both_clients(endpoint: str, call: Callable[[object], object]):
    """Runs `call` with a sync and an async client (attempt timeout 0.4 s) and returns both
    errors."""
    errs = []
    c = Client([endpoint], call_timeout=3.0, attempt_timeout=0.4)
    try:
        with pytest.raises(lockd_client.LockdError) as e:
            call(c)
        errs.append(e.value)
    finally:
        c.close()

    async def main():
        async with AsyncClient([endpoint], call_timeout=3.0, attempt_timeout=0.4) as ac:
            with pytest.raises(lockd_client.LockdError) as e:
                r = call(ac)
                await r
            errs.append(e.value)

    asyncio.run(main())
    return errs


@pytest.mark.parametrize("metadata,expected", [(UNMARKED, lockd_client.OutcomeUnknown), (MARKED, lockd_client.LimitReached)])
def test_review_clients_finding2_a_refusal_after_a_maybe_sent_attempt(metadata, expected):
    """Attempt 1 is unanswered, attempt 2 refused: a refusal the state machine did not decide
    (no `decided_by`) speaks for attempt 2 only, so the outcome is unknown; one it decided is the
    request's outcome."""
    fake = _Fake(Acquire=_hang_then_refuse(metadata))
    try:
        errs = _both_clients(fake.endpoint, lambda c: c.acquire("orders/1", wait=0.1))
        for e in errs:
            assert type(e) is expected, repr(e)
            if expected is lockd_client.OutcomeUnknown:
                assert e.request_id in fake.calls["Acquire"]
                assert not e.definitely_not_done
                assert "RESOURCE_EXHAUSTED" in str(e), str(e)
            else:
                assert e.definitely_not_done
        assert len(set(fake.calls["Acquire"])) == 2, "one request id per call"
    finally:
        fake.stop()


def test_review_clients_finding2_a_first_refusal_and_a_caller_given_id():
    """A refusal of the first attempt of a call with a fresh request id is that request's answer,
    marked or not; with a request id the caller gave (sent before, maybe) an unmarked refusal
    leaves the outcome unknown."""

    def refuse(n, context):
        context.abort_with_status(
            _status(grpc.StatusCode.PERMISSION_DENIED, "lockd: denied", "PERMISSION_DENIED", {})
        )

    fake = _Fake(Acquire=refuse)
    try:
        for e in _both_clients(fake.endpoint, lambda c: c.acquire("orders/1")):
            assert type(e) is lockd_client.PermissionDenied, repr(e)
        for e in _both_clients(fake.endpoint, lambda c: c.acquire("orders/1", request_id="given-0123456789")):
            assert type(e) is lockd_client.OutcomeUnknown, repr(e)
            assert e.request_id == "given-0123456789"
    finally:
        fake.stop()


def test_review_clients_finding2_deadline_exceeded_without_wait_timeout_is_retried():
    """DEADLINE_EXCEEDED on Acquire without lockd's WAIT_TIMEOUT (a proxy's) is not "waited
    without getting it"."""

    def acquire(n, context):
        context.abort(grpc.StatusCode.DEADLINE_EXCEEDED, "proxy: upstream timeout")

    fake = _Fake(Acquire=acquire)
    try:
        for e in _both_clients(fake.endpoint, lambda c: c.acquire("orders/1", wait=0.1)):
            assert type(e) is lockd_client.OutcomeUnknown, repr(e)
        assert len(fake.calls["Acquire"]) >= 4, "retried"
    finally:
        fake.stop()


# --- finding 3: granted, then the renewal before handing out fails -----------------------------


def test_review_clients_finding3_granted_then_renewal_unavailable_is_outcome_unknown():
    """lock(): the acquire is granted so late that the lease is renewed before it is handed out;
    Renew and Release are refused NO_QUORUM (not sent). The lease was granted and may still be
    held: the error is OutcomeUnknown with the request id, never "not done"."""

    def acquire(n, context):
        time.sleep(0.7)
        return pb.AcquireResponse(lease_id="ab" * 16, fencing_token=5, lease_ttl_ms=1000)

    def no_quorum(n, context):
        context.abort_with_status(_status(grpc.StatusCode.UNAVAILABLE, "lockd: no leader", "NO_QUORUM", {}))

    fake = _Fake(Acquire=acquire, Renew=no_quorum, Release=no_quorum)
    try:
        c = Client([fake.endpoint], call_timeout=1.5, attempt_timeout=1.0)
        with pytest.raises(lockd_client.LockdError) as e:
            c.lock("orders/1", ttl=1)
        c.close()

        async def main():
            async with AsyncClient([fake.endpoint], call_timeout=1.5, attempt_timeout=1.0) as ac:
                with pytest.raises(lockd_client.LockdError) as ae:
                    await ac.lock("orders/1", ttl=1)
                return ae.value

        for err in (e.value, asyncio.run(main())):
            assert type(err) is lockd_client.OutcomeUnknown, repr(err)
            assert not err.definitely_not_done
            assert err.request_id in fake.calls["Acquire"]
        assert fake.calls["Renew"] and fake.calls["Release"]
    finally:
        fake.stop()


# --- finding 4: request ids are shown shortened ------------------------------------------------


def test_review_clients_finding4_request_ids_are_shortened_in_messages_and_reprs():
    def unavailable(n, context):
        context.abort(grpc.StatusCode.UNAVAILABLE, "lockd: maybe")

    fake = _Fake(Acquire=unavailable)
    rid = new_request_id()
    try:
        for e in _both_clients(fake.endpoint, lambda c: c.acquire("orders/1", request_id=rid)):
            assert type(e) is lockd_client.OutcomeUnknown, repr(e)
            assert e.request_id == rid, "the full id stays available to retry with"
            assert rid not in str(e) and rid not in repr(e), str(e)
            assert rid[:8] in str(e), str(e)
    finally:
        fake.stop()
    g = lockd_client.Grant(
        resource="r", lease_id="x" * 32, fencing_token=7, ttl=5.0, request_id=rid,
        sent_at=0.0, expires_at_unix_ms=0, sequencer=b"",
    )
    assert rid not in repr(g) and rid not in str(g)


# --- review "clients2" finding 4: any failed renewal before handing out -------------------------


def _abort(code: grpc.StatusCode, reason: Optional[str], metadata: Dict[str, str]) -> Callable:
    def handle(n, context):
        if reason is None:
            context.abort(code, "proxy: connection reset")  # no ErrorInfo: maybe sent
        context.abort_with_status(_status(code, "lockd: %s" % reason, reason, metadata))

    return handle


_RENEWALS = {
    "limit_in_transit": _abort(grpc.StatusCode.RESOURCE_EXHAUSTED, "LIMIT_REACHED", {"limit": "receiving_per_source_max"}),
    "renew_denied": _abort(grpc.StatusCode.PERMISSION_DENIED, "PERMISSION_DENIED", {}),
    "renew_outcome_unknown": _abort(grpc.StatusCode.UNAVAILABLE, None, {}),
}
_RELEASES = {
    "released": lambda n, context: pb.ReleaseResponse(released=True),
    "release_fails": _abort(grpc.StatusCode.UNAVAILABLE, "NO_QUORUM", {}),
}


def _lock_both(endpoint: str) -> List[lockd_client.LockdError]:
    """lock("orders/1", ttl=1) with a sync and an async client; both errors."""
    c = Client([endpoint], call_timeout=1.5, attempt_timeout=1.0)
    try:
        with pytest.raises(lockd_client.LockdError) as e:
            c.lock("orders/1", ttl=1)
    finally:
        c.close()

    async def main():
        async with AsyncClient([endpoint], call_timeout=1.5, attempt_timeout=1.0) as ac:
            with pytest.raises(lockd_client.LockdError) as ae:
                await ac.lock("orders/1", ttl=1)
            return ae.value

    return [e.value, asyncio.run(main())]


def _late_grant(n, context):
    time.sleep(0.7)  # so late that lock() renews before handing the lease out
    return pb.AcquireResponse(lease_id="ab" * 16, fencing_token=41, lease_ttl_ms=1000)


@pytest.mark.parametrize("release", sorted(_RELEASES))
@pytest.mark.parametrize("renewal", sorted(_RENEWALS))
def test_review_clients2_finding4_a_failed_handout_renewal_is_never_not_done(renewal, release):
    """lock() was granted token 41; the renewal before handing it out fails in a way that proves
    nothing (an unmarked transit bound, a policy that allows acquire but not renew, a renewal
    whose own outcome is unknown). Whatever the release answers after, the error is
    OutcomeUnknown for the acquire with its request id, never "not granted" / "not done"."""
    fake = _Fake(Acquire=_late_grant, Renew=_RENEWALS[renewal], Release=_RELEASES[release])
    try:
        for err in _lock_both(fake.endpoint):
            assert type(err) is lockd_client.OutcomeUnknown, repr(err)
            assert err.op == "acquire", repr(err)
            assert err.request_id in fake.calls["Acquire"], repr(err)
            assert not err.definitely_not_done
            assert "41" in str(err), str(err)
        assert fake.calls["Renew"] and fake.calls["Release"]
    finally:
        fake.stop()


def test_review_clients2_finding4_a_handout_renewal_not_found_says_nothing_is_held():
    """The renewal before handing out answers NOT_FOUND: nothing is held, and the error says so
    naming the token (LeaseNotCurrent), without a release."""
    not_found = _abort(grpc.StatusCode.NOT_FOUND, "LEASE_NOT_CURRENT", {"decided_by": "state_machine"})
    fake = _Fake(Acquire=_late_grant, Renew=not_found, Release=_RELEASES["released"])
    try:
        for err in _lock_both(fake.endpoint):
            assert type(err) is lockd_client.LeaseNotCurrent, repr(err)
            assert "41" in str(err) and "nothing is held" in str(err), str(err)
            assert err.definitely_not_done
        assert not fake.calls["Release"]
    finally:
        fake.stop()


# --- review "clients2" finding 6: release says which "not current" it is -------------------------


def _grant(n, context):
    return pb.AcquireResponse(lease_id="ab" * 16, fencing_token=7, lease_ttl_ms=5000)


@pytest.mark.parametrize(
    "first_unanswered,released,expected",
    [
        (False, True, "released"),
        (False, False, "not_current"),
        (True, False, "not_current_after_retry"),
        (True, True, "released"),
    ],
)
def test_review_clients2_finding6_release_outcome_tells_not_current_apart(first_unanswered, released, expected):
    """release_outcome: released; not current at the first attempt that reached lockd; or not
    current after an attempt that went unanswered, which may have released it (rule 14). release()
    stays a bool."""

    def release(n, context):
        if first_unanswered and n == 0:
            time.sleep(0.6)  # past the attempt timeout: maybe sent
            context.abort(grpc.StatusCode.UNAVAILABLE, "too late")
        return pb.ReleaseResponse(released=released)

    fake = _Fake(Release=release)
    try:
        c = Client([fake.endpoint], call_timeout=3.0, attempt_timeout=0.4)
        try:
            outcome = c.release_outcome("orders/1", "ab" * 16)
            assert outcome == expected and outcome is lockd_client.ReleaseOutcome(expected), outcome
            fake.calls["Release"].clear()
            assert c.release("orders/1", "ab" * 16) is released
        finally:
            c.close()

        async def main():
            fake.calls["Release"].clear()
            async with AsyncClient([fake.endpoint], call_timeout=3.0, attempt_timeout=0.4) as ac:
                return await ac.release_outcome("orders/1", "ab" * 16)

        assert asyncio.run(main()) == expected
    finally:
        fake.stop()


# --- review of the fixes: lockd's own INTERNAL with OUTCOME_UNKNOWN -------------------------------


def test_review_clients2_internal_with_outcome_unknown_is_maybe_sent():
    """lockd answers INTERNAL with reason OUTCOME_UNKNOWN when it cannot tell what happened
    (docs/api.md: retry with the same request id). That is "maybe sent", so an Acquire ends with
    its request id, never as a protocol error without one."""
    from lockd_client._core import MAYBE_SENT, FINAL, StatusInfo, classify

    for code in (grpc.StatusCode.INTERNAL, grpc.StatusCode.UNKNOWN, grpc.StatusCode.CANCELLED):
        lockd_unknown = StatusInfo(code, "lockd: internal", "OUTCOME_UNKNOWN", {})
        assert classify("acquire", lockd_unknown) == MAYBE_SENT
        no_error_info = StatusInfo(code, "a proxy's", None, {})
        assert classify("acquire", no_error_info) == MAYBE_SENT
    other = StatusInfo(grpc.StatusCode.INTERNAL, "lockd: bad", "INVALID_FIELD", {})
    assert classify("acquire", other) == FINAL
