"""The client follows the cluster when the leader dies, and a paused holder sees its loss before
it can write."""

from __future__ import annotations

import signal
import threading
import time

import lockd_client

from conftest import python_child, unique


def test_leader_kill_during_acquire(own_cluster):
    """An Acquire waiting at the leader when the leader is killed: the client retries on another
    node with the same request id, ends with one lease, and a retry of that id returns it."""
    cluster = own_cluster
    leader = cluster.leader()
    others = [i for i in (1, 2, 3) if i != leader]
    res = unique("py-failover")
    holder_client = cluster.client()
    held = holder_client.acquire(res, ttl=2)  # never renewed: expires while the waiter waits
    # The waiter talks to the leader first, so the kill breaks its call in flight.
    waiter = lockd_client.Client(
        [cluster.addr(leader)] + [cluster.addr(i) for i in others], call_timeout=15.0
    )
    rid = "py-failover-" + res.split("/")[1]
    out = {}

    def wait_for_it():
        try:
            out["grant"] = waiter.acquire(res, ttl=5, wait=8, request_id=rid, holder="waiter")
        except Exception as e:  # reported below
            out["error"] = e

    t = threading.Thread(target=wait_for_it)
    t.start()
    time.sleep(0.5)
    assert "error" not in out and "grant" not in out, out
    cluster.nodes[leader].kill()
    t.join(20)
    assert not t.is_alive()
    assert "error" not in out, out.get("error")
    grant = out["grant"]
    assert grant.fencing_token > held.fencing_token
    # The request id learns the same lease, from the new leader.
    again = waiter.acquire(res, ttl=5, wait=8, request_id=rid, holder="waiter")
    assert (again.lease_id, again.fencing_token) == (grant.lease_id, grant.fencing_token)
    d = waiter.describe(res)
    assert d.held and d.holder == "waiter" and d.fencing_token == grant.fencing_token
    assert waiter.release(res, grant.lease_id)
    waiter.close()
    holder_client.close()


def test_guard_survives_leader_kill(own_cluster):
    """Renewals move to the surviving nodes: the lease stays held across a leader kill."""
    cluster = own_cluster
    leader = cluster.leader()
    res = unique("py-renew-failover")
    c = lockd_client.Client([cluster.addr(leader)] + [cluster.addr(i) for i in (1, 2, 3) if i != leader])
    # ttl 6 s: the deadline (5.4 s) leaves room for an election (timeouts 0.6-1.2 s, longer on a
    # loaded machine) and retries; 4 s lost the lease once under load, rightly, in the Node suite.
    with c.lock(res, ttl=6) as lease:
        cluster.nodes[leader].kill()
        time.sleep(6.5)
        # Past its ttl: held only if renewals reached the new leader (the first one may wait for
        # the election, so one or two of them fit in 6.5 s).
        lease.check()
        assert lease.renewals >= 1
        assert c.describe(res).fencing_token == lease.fencing_token
    c.close()


CHILD = r"""
import collections, os, time
import lockd_client
client = lockd_client.Client(os.environ["ENDPOINTS"].split(","))
# ttl 2 s: a CPU-bound thread slows the renewal thread's GIL hand-offs; 1 s is too tight for
# that on some interpreters (then the signal fires early, which is safe but not this test).
lease = client.lock(os.environ["RESOURCE"], ttl=2)
print("token", lease.fencing_token, flush=True)
# A busy writer: check the signal, then "write". The time before and after each check is kept:
# the pause shows as the largest gap between two of these instants, and a write whose check
# began after the pause ended is a late write. (A pause inside a check or between a check and its
# write is the race only a fencing check at the storage can catch: not counted.)
checks = collections.deque(maxlen=200000)
writes = 0
while True:
    before = time.monotonic()
    lost = lease.lost.is_set()
    checks.append((before, time.monotonic(), not lost))
    if lost:
        break
    writes += 1
    if writes == 1000:
        print("writing", flush=True)
    if writes % 2000 == 0:
        time.sleep(0.001)  # real work waits on I/O now and then (the renewal thread needs the GIL)
instants = [t for b, a, _ in checks for t in (b, a)]
gap, end = max((instants[i + 1] - instants[i], instants[i + 1]) for i in range(len(instants) - 1))
late = sum(1 for b, _, wrote in checks if wrote and b >= end)
print("lost", lease.loss, "gap=%.3f" % gap, "late=%d" % late, flush=True)
print("why", writes, lease.lost.message, flush=True)
try:
    lease.check()
    print("check-passed", flush=True)
except lockd_client.LeaseLost as e:
    print("check-raised", e.loss, flush=True)
"""


def test_paused_holder_sees_lost_before_it_writes(cluster, client):
    """A busy holder SIGSTOPped past its ttl, resumed: no write starts after the pause (the
    signal compares the deadline with the clock itself, before the renewal thread runs), the
    signal says the deadline passed, and the new holder has a larger token."""
    res = unique("py-paused")
    child = python_child(CHILD, {"ENDPOINTS": ",".join(cluster.endpoints), "RESOURCE": res})
    try:
        first = child.stdout.readline().split()
        if not first or first[0] != "token":
            child.kill()
            raise AssertionError("child did not take the lock: %r %s" % (first, child.communicate()[1]))
        old_token = int(first[1])
        assert child.stdout.readline().strip() == "writing"
        child.send_signal(signal.SIGSTOP)
        # Another client takes the lock once the paused holder's lease expired.
        newer = client.acquire(res, ttl=5, wait=5)
        assert newer.fencing_token > old_token
        time.sleep(0.3)
        child.send_signal(signal.SIGCONT)
        out, err = child.communicate(timeout=10)
    finally:
        if child.poll() is None:
            child.send_signal(signal.SIGCONT)
            child.kill()
            child.wait(5)
    lines = out.splitlines()
    lost = [line.split() for line in lines if line.startswith("lost")]
    assert lost, (out, err)
    _, reason, gap, late = lost[0]
    assert float(gap.split("=")[1]) >= 2.0, "the pause did not show: %s\n%s" % (lost[0], out[-2000:])
    assert late == "late=0", "writes after the pause: %s" % lost[0]
    assert reason == lockd_client.LOSS_DEADLINE_PASSED, lost[0]
    assert "check-raised deadline_passed" in lines, (out, err)
    assert client.describe(res).fencing_token == newer.fencing_token
    client.release(res, newer.lease_id)
