"""The zombie story end to end: a holder whose lease expired (paused, partitioned) writes with
its old token after a newer holder wrote; fence-proxy refuses it (HTTP 412, Postgres 55P03)."""

from __future__ import annotations

import asyncio
import base64
import os
import subprocess
import sys
import tempfile
import time

import httpx
import pytest
import requests

import lockd_client
from lockd_client import FenceAuth, fence_headers

from conftest import PACKAGE_DIR, PG_URL, Proc, binary, free_port, random_loopback_ip, unique, wait_tcp


def _expire(client, grant):
    """Waits until the cluster lets `grant` expire (its ttl after the send time, plus slack)."""
    time.sleep(max(grant.sent_at + grant.ttl + 0.3 - time.monotonic(), 0.0))


def test_http_zombie_write_is_refused(client, http_proxy):
    res = unique("py-zombie")
    url = http_proxy.url + "/" + res
    # A takes the lock and writes.
    a = client.lock(res, ttl=1)
    r = requests.put(url, data="from A", auth=FenceAuth(a))
    assert r.status_code == 200, r.text
    up = http_proxy.upstream.writes()[-1]
    assert up["headers"]["lock-resource"] == res and up["headers"]["fencing-token"] == str(a.fencing_token)
    assert base64.b64decode(up["headers"]["lock-sequencer"]) == a.sequencer

    # A pauses (here: stops renewing) past its ttl; B gets the lock with a larger token and writes.
    a_headers = fence_headers(a)  # what the paused A had computed before its pause
    a._stop.set()
    _expire(client, a.grant)
    with client.lock(res, ttl=5, wait=5) as b:
        assert b.fencing_token > a.fencing_token
        with httpx.Client() as hx:
            r = hx.put(url, content="from B", auth=FenceAuth(b))
            assert r.status_code == 200, r.text

        # A resumes and writes with its old token: refused by the proxy, never reaches upstream.
        before = len(http_proxy.upstream.writes())
        r = requests.put(url, data="from A, stale", headers=a_headers)
        assert r.status_code == 412, r.text
        assert r.headers["Fence-Proxy-Error"] == "stale-fencing-token"
        body = r.json()
        assert body["token"] == a.fencing_token and body["highest"] == b.fencing_token
        assert len(http_proxy.upstream.writes()) == before
        # With the helper, A does not even send: its lease is known lost.
        with pytest.raises(lockd_client.LeaseLost):
            requests.put(url, data="from A again", auth=FenceAuth(a))
        assert [w["body"] for w in http_proxy.upstream.writes()] == ["from A", "from B"]


def test_example_takes_a_lock_and_writes_through_the_proxy(cluster, http_proxy):
    example = PACKAGE_DIR / "examples" / "fenced_write.py"
    assert len(example.read_text().strip().splitlines()) <= 12
    env = dict(os.environ, LOCKD_ENDPOINTS=",".join(cluster.endpoints), FENCE_PROXY_URL=http_proxy.url)
    done = subprocess.run(
        [sys.executable, str(example)], env=env, capture_output=True, text=True, timeout=30, cwd=tempfile.gettempdir()
    )
    assert done.returncode == 0, done.stderr
    assert "written with fencing token" in done.stdout
    token = done.stdout.split()[-1]
    writes = http_proxy.upstream.writes()
    assert writes and writes[-1]["path"] == "/orders/42" and writes[-1]["headers"]["fencing-token"] == token
    with cluster.client() as c:
        assert not c.describe("orders/42").held, "the example releases on exit"


PG_FENCE_TABLE = "public.lockd_fence_pyclient"


@pytest.fixture
def pg_proxy(tmp_path):
    psycopg = pytest.importorskip("psycopg")
    try:
        psycopg.connect(PG_URL, connect_timeout=3).close()
    except psycopg.OperationalError as e:
        pytest.skip("Postgres at %s: %s" % (PG_URL, e))
    # A fence table of this suite's own, so that its guard never replaces the one other suites
    # installed for public.lockd_fence (init is CREATE OR REPLACE).
    init = subprocess.run(
        [binary("fence-proxy"), "postgres", "init", "--upstream", PG_URL, "--fence-table", PG_FENCE_TABLE],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert init.returncode == 0, init.stderr
    ip = random_loopback_ip()
    port = free_port(ip)
    proc = None
    try:
        proc = Proc(
            "fence-proxy-pg",
            [binary("fence-proxy"), "postgres", "--listen", "%s:%d" % (ip, port), "--upstream", PG_URL]
            + ["--fence-table", PG_FENCE_TABLE],
            tmp_path,
        )
        wait_tcp(ip, port, proc)
        yield "postgres://postgres@%s:%d/test" % (ip, port)
    finally:
        if proc is not None:
            proc.stop()


def test_postgres_zombie_write_is_refused(client, pg_proxy):
    import psycopg

    from lockd_client import aset_fence, fence_options, reset_fence, set_fence

    table = "py_orders_%s" % os.urandom(4).hex()
    res = unique("py-pg")
    with psycopg.connect(PG_URL, autocommit=True) as direct:
        direct.execute("CREATE TABLE %s (id serial primary key, by text not null)" % table)
    try:
        a = client.lock(res, ttl=1)
        a_conn = psycopg.connect(pg_proxy)
        set_fence(a_conn, a)
        with a_conn.transaction():
            a_conn.execute("INSERT INTO %s (by) VALUES ('A')" % table)

        a._stop.set()  # A pauses past its ttl
        _expire(client, a.grant)
        with client.lock(res, ttl=5, wait=5) as b:
            # B fences at connection start-up instead of with SET.
            with psycopg.connect(pg_proxy, options=fence_options(b), autocommit=True) as b_conn:
                b_conn.execute("INSERT INTO %s (by) VALUES ('B')" % table)
            # And from asyncio, with SET.
            async def async_write():
                aconn = await psycopg.AsyncConnection.connect(pg_proxy)
                try:
                    await aset_fence(aconn, b)
                    async with aconn.transaction():
                        await aconn.execute("INSERT INTO %s (by) VALUES ('B, async')" % table)
                finally:
                    await aconn.close()

            asyncio.run(async_write())
            # A resumes: its transaction is refused and nothing of it is applied.
            with pytest.raises(psycopg.Error) as refused:
                with a_conn.transaction():
                    a_conn.execute("INSERT INTO %s (by) VALUES ('A, stale')" % table)
            assert refused.value.sqlstate == "55P03", refused.value
            assert res in str(refused.value)
            # The session stays usable once its fence is cleared; with the helper A cannot set
            # its lost lease's fence again.
            with pytest.raises(psycopg.Error):
                a_conn.execute("SELECT 1")
            a_conn.rollback()
            reset_fence(a_conn)
            assert a_conn.execute("SELECT 1").fetchone() == (1,)
            a_conn.rollback()
            with pytest.raises(lockd_client.LeaseLost):
                set_fence(a_conn, a)
        a_conn.close()
        with psycopg.connect(PG_URL) as direct:
            rows = [r[0] for r in direct.execute("SELECT by FROM %s ORDER BY id" % table)]
        assert rows == ["A", "B", "B, async"]
        with psycopg.connect(PG_URL) as direct:
            token = direct.execute("SELECT token FROM %s WHERE resource = %%s" % PG_FENCE_TABLE, (res,)).fetchone()
        assert token == (b.fencing_token,)
    finally:
        with psycopg.connect(PG_URL, autocommit=True) as direct:
            direct.execute("DROP TABLE IF EXISTS %s" % table)


def test_http_signed_sequencer_through_verifying_proxy(cluster, client, tmp_path):
    """With --verify-key the proxy takes only sequencers the cluster signed: FenceAuth sends the
    lease's, a bare token is refused, and an older holder's sequencer is stale."""
    from conftest import Upstream

    res = unique("py-signed")
    a = client.acquire(res, ttl=1)  # the first grant makes the cluster's signing key if none
    keys = tmp_path / "keys"
    export = subprocess.run(
        [binary("lockctl"), "--endpoints", ",".join(cluster.endpoints), "keys", "export", str(keys)],
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert export.returncode == 0, export.stderr
    pems = sorted(keys.glob("*.pub.pem"))
    assert pems, export.stdout
    ip = random_loopback_ip()
    upstream = Upstream(ip)
    port = free_port(ip)
    args = [binary("fence-proxy"), "http", "--listen", "%s:%d" % (ip, port), "--upstream", upstream.url]
    args += ["--store", "redb:%s" % (tmp_path / "epochs.redb")]
    for pem in pems:
        args += ["--verify-key", str(pem)]
    proc = Proc("fence-proxy-http-verify", args, tmp_path)
    try:
        wait_tcp(ip, port, proc)
        url = "http://%s:%d/%s" % (ip, port, res)
        a_headers = fence_headers(a)
        assert requests.put(url, data="A", headers=a_headers).status_code == 200
        bare = {"Lock-Resource": res, "Fencing-Token": str(a.fencing_token + 1000)}
        r = requests.put(url, data="forged", headers=bare)
        assert r.status_code == 403 and r.headers["Fence-Proxy-Error"] == "sequencer-required", r.text
        _expire(client, a)
        with client.lock(res, ttl=5, wait=5) as b:
            assert requests.put(url, data="B", auth=FenceAuth(b)).status_code == 200
            r = requests.put(url, data="A, stale", headers=a_headers)
            assert r.status_code == 412 and r.headers["Fence-Proxy-Error"] == "stale-fencing-token", r.text
        assert [w["body"] for w in upstream.writes()] == ["A", "B"]
    finally:
        proc.stop()
        upstream.stop()
