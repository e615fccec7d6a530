"""Acquire, renew, release, describe and status against a real three-node cluster, and the errors
a caller branches on."""

from __future__ import annotations

import threading
import time
from concurrent import futures

import grpc
import pytest
from google.protobuf import any_pb2
from google.rpc import error_details_pb2, status_pb2
from grpc_status import rpc_status

import lockd_client
from lockd_client import Client

from conftest import free_port, unique


def test_acquire_renew_release_describe(client, cluster):
    res = unique("py-basic")
    grant = client.acquire(res, ttl=5, holder="py-test/basic")
    assert grant.fencing_token > 0 and grant.lease_id and grant.ttl == 5.0
    assert grant.sequencer, "lockd signs every grant"
    d = client.describe(res)
    assert d.held and d.holder == "py-test/basic" and d.fencing_token == grant.fencing_token
    assert grant.lease_id not in repr(grant) and grant.lease_id not in str(d)

    renewed = client.renew(res, grant.lease_id, ttl=7)
    assert renewed.ttl == 7.0 and renewed.sent_at >= grant.sent_at

    with pytest.raises(lockd_client.Held) as held:
        client.acquire(res, ttl=5)
    assert held.value.reason == "LOCK_HELD" and held.value.code == "ABORTED"
    assert held.value.definitely_not_done and res in str(held.value)

    assert client.release(res, grant.lease_id) is True
    assert client.release(res, grant.lease_id) is False
    assert not client.describe(res).held
    with pytest.raises(lockd_client.LeaseNotCurrent) as nf:
        client.renew(res, grant.lease_id)
    assert nf.value.reason == "LEASE_NOT_CURRENT"
    assert lockd_client.NotFound is lockd_client.LeaseNotCurrent

    again = client.acquire(res, ttl=5)
    assert again.fencing_token > grant.fencing_token
    client.release(res, again.lease_id)

    st = client.status()
    assert st.leader_id in (1, 2, 3) and len(st.members) == 3


def test_same_request_id_returns_the_same_lease(client):
    """A reply lost on the way back is learnt by repeating the request id: the same lease and
    token, not a second lease and not "held" by ourselves."""
    res = unique("py-retry")
    rid = lockd_client._core.new_request_id()
    first = client.acquire(res, ttl=5, request_id=rid, holder="h")
    second = client.acquire(res, ttl=5, request_id=rid, holder="h")
    assert (second.lease_id, second.fencing_token) == (first.lease_id, first.fencing_token)
    # The same id with other arguments is refused, naming the field.
    with pytest.raises(lockd_client.InvalidArgument) as bad:
        client.acquire(res, ttl=6, request_id=rid, holder="h")
    assert bad.value.reason == "INVALID_FIELD" and bad.value.code == "INVALID_ARGUMENT"
    # Another request id is another caller: held.
    with pytest.raises(lockd_client.Held):
        client.acquire(res, ttl=5, holder="h")
    client.release(res, first.lease_id)


def test_wait_queues_and_times_out(client):
    res = unique("py-wait")
    holder = client.acquire(res, ttl=5)
    started = time.monotonic()
    with pytest.raises(lockd_client.WaitTimedOut) as to:
        client.acquire(res, ttl=5, wait=1.0)
    took = time.monotonic() - started
    assert 0.9 <= took < 4, took
    assert to.value.reason == "WAIT_TIMEOUT" and to.value.definitely_not_done

    # A waiter gets the lock in the same commit that releases it.
    got = {}

    def waiter():
        got["grant"] = client.acquire(res, ttl=5, wait=10)

    t = threading.Thread(target=waiter)
    t.start()
    time.sleep(0.5)
    assert client.describe(res).waiters == 1
    client.release(res, holder.lease_id)
    t.join(10)
    assert got["grant"].fencing_token > holder.fencing_token
    client.release(res, got["grant"].lease_id)


def test_bad_arguments_are_refused_before_sending(client):
    for bad in ["", "a\x07b", "x" * 257]:
        with pytest.raises(lockd_client.InvalidArgument) as e:
            client.acquire(bad)
        assert repr(bad)[:20].strip("'") in str(e.value) or bad == ""
    with pytest.raises(lockd_client.InvalidArgument) as e:
        client.acquire(unique("py-bad"), ttl=0.5)  # below the 1 s policy floor: lockd says so
    assert e.value.reason == "INVALID_FIELD" and e.value.metadata.get("field") == "lease_ttl_ms"
    with pytest.raises(lockd_client.InvalidArgument):
        Client(["nohostport"])
    with pytest.raises(lockd_client.InvalidArgument):
        Client(["127.0.0.1:7001"], token="secret")  # never over plaintext


def test_guard_renews_past_three_ttls(client):
    res = unique("py-guard")
    with client.lock(res, ttl=1) as lease:
        token = lease.fencing_token
        time.sleep(3.5)
        lease.check()
        assert not lease.lost.is_set()
        assert lease.renewals >= 6, lease.renewals
        d = client.describe(res)
        assert d.held and d.fencing_token == token
        with pytest.raises(lockd_client.Held):
            client.acquire(res, ttl=1)
    # Leaving the block fired the signal (workers stop) and released.
    assert lease.lost.is_set() and lease.loss == lockd_client.LOSS_RELEASED
    with pytest.raises(lockd_client.LeaseLost):
        lease.check()
    assert not client.describe(res).held


def test_guard_fires_not_current_when_released_behind_its_back(client):
    res = unique("py-behind")
    lease = client.lock(res, ttl=1.5)
    assert isinstance(lease.lost, threading.Event)
    client.release(res, lease.lease_id)
    assert lease.lost.wait(3), "lost did not fire after the lease was released behind its back"
    assert lease.loss == lockd_client.LOSS_NOT_CURRENT
    renewals = lease.renewals
    time.sleep(1.0)
    assert lease.renewals == renewals, "a lost lease must never renew again"
    assert lease.release() is False


def test_unreachable_endpoints_mean_not_done():
    port = free_port("127.0.0.1")
    c = Client(["127.0.0.1:%d" % port], call_timeout=0.8)
    started = time.monotonic()
    with pytest.raises(lockd_client.Unavailable) as e:
        c.acquire(unique("py-down"))
    assert time.monotonic() - started < 3
    assert e.value.attempts >= 2 and e.value.definitely_not_done
    assert str(port) in str(e.value)


def _error_info(reason: str) -> any_pb2.Any:
    detail = any_pb2.Any()
    detail.Pack(error_details_pb2.ErrorInfo(reason=reason, domain="lockd"))
    return detail


class _FakeLock:
    """A gRPC server that answers Acquire as told: hang, or a status with or without ErrorInfo."""

    def __init__(self, mode: str) -> None:
        self.calls = 0
        self.request_ids = []

        def acquire(request, context):
            self.calls += 1
            self.request_ids.append(request.request_id)
            if mode == "hang":
                time.sleep(3)
                context.abort(grpc.StatusCode.UNAVAILABLE, "too late")
            if mode == "no_quorum":
                context.abort_with_status(
                    rpc_status.to_status(status_pb2.Status(code=14, message="lockd: no quorum", details=[_error_info("NO_QUORUM")]))
                )
            # UNAVAILABLE without lockd's ErrorInfo: not from lockd, proves nothing.
            context.abort(grpc.StatusCode.UNAVAILABLE, "lockd: nothing was done (says the message)")

        handler = grpc.method_handlers_generic_handler(
            "lockd.v1.Lock",
            {"Acquire": grpc.unary_unary_rpc_method_handler(acquire, request_deserializer=_pb().AcquireRequest.FromString)},
        )
        self.server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
        self.server.add_generic_rpc_handlers((handler,))
        self.port = self.server.add_insecure_port("127.0.0.1:0")
        self.server.start()

    def stop(self):
        self.server.stop(0)


def _pb():
    from lockd_client._pb import lockd_pb2

    return lockd_pb2


@pytest.mark.parametrize(
    "mode,expected",
    [("hang", lockd_client.OutcomeUnknown), ("plain", lockd_client.OutcomeUnknown), ("no_quorum", lockd_client.OutcomeUnknown)],
)
def test_outcome_is_read_from_the_reason(mode, expected):
    fake = _FakeLock(mode)
    try:
        c = Client(["127.0.0.1:%d" % fake.port], call_timeout=1.2, attempt_timeout=0.4)
        rid = "py-fixed-request-id"
        with pytest.raises(lockd_client.LockdError) as e:
            c.acquire("orders/1", request_id=rid)
        assert type(e.value) is expected, e.value
        assert fake.calls >= 2, "retried"
        assert set(fake.request_ids) == {rid}, "every retry carries the same request id"
        if expected is lockd_client.OutcomeUnknown:
            # The full id on the error, its first 8 characters in the message (a credential).
            assert e.value.request_id == rid and rid not in str(e.value) and rid[:8] in str(e.value)
            assert not e.value.definitely_not_done
        else:
            assert e.value.definitely_not_done
        c.close()
    finally:
        fake.stop()


def test_no_quorum_with_a_fresh_request_id_is_not_done():
    """NO_QUORUM on every attempt of a call whose request id the client made: nothing was done.
    (With a caller-given id the same answers leave the outcome unknown: the caller may have sent
    that id before, see test_outcome_is_read_from_the_reason.)"""
    fake = _FakeLock("no_quorum")
    try:
        c = Client(["127.0.0.1:%d" % fake.port], call_timeout=1.2, attempt_timeout=0.4)
        with pytest.raises(lockd_client.Unavailable) as e:
            c.acquire("orders/1")
        assert e.value.definitely_not_done
        assert fake.calls >= 2, "retried"
        c.close()
    finally:
        fake.stop()


def test_fence_values_and_headers():
    from lockd_client import fence_headers, fence_options, fence_value

    g = lockd_client.Grant(
        resource="a b/c", lease_id="x" * 32, fencing_token=7, ttl=5.0, request_id="r",
        sent_at=0.0, expires_at_unix_ms=0, sequencer=b"\x01\x02",
    )
    assert fence_value(g) == "a b/c:7"
    assert fence_value(g, signed=True) == "a b/c:AQI="
    assert fence_options(g) == "-c lockd.fence=a\\ b/c:7"  # libpq splits options at spaces
    assert fence_headers(g) == {"Lock-Resource": "a b/c", "Fencing-Token": "7", "Lock-Sequencer": "AQI="}
    unsigned = lockd_client.Grant(**{**g.__dict__, "sequencer": b""})
    assert "Lock-Sequencer" not in fence_headers(unsigned)
    with pytest.raises(ValueError):
        fence_value(unsigned, signed=True)


def test_tls(tls_cluster):
    """Over TLS with the cluster's CA. A client that does not trust it (system roots) or speaks
    plaintext never gets a request through, and knows that nothing was done."""
    res = unique("py-tls")
    with tls_cluster.client() as c:
        with c.lock(res, ttl=2) as lease:
            assert c.describe(res).fencing_token == lease.fencing_token
    untrusting = Client(tls_cluster.endpoints, tls=True, call_timeout=1.0)
    with pytest.raises(lockd_client.Unavailable):
        untrusting.describe(res)
    untrusting.close()
    plain = Client(tls_cluster.endpoints, call_timeout=1.0)
    with pytest.raises(lockd_client.Unavailable):
        plain.acquire(res)
    plain.close()
    with pytest.raises(lockd_client.InvalidArgument):
        Client(["https://%s" % tls_cluster.addr(1)])  # https:// needs tls=
