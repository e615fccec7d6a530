"""The asyncio client: same calls, same errors, the lease renews in a task."""

from __future__ import annotations

import asyncio
import time

import pytest

import lockd_client
from lockd_client import AsyncClient

from conftest import unique


def run(coro):
    return asyncio.run(coro)


def test_async_lock_renews_and_releases(cluster):
    res = unique("py-async")

    async def main():
        async with AsyncClient(cluster.endpoints) as client:
            async with client.lock(res, ttl=1) as lease:
                assert isinstance(lease.lost, asyncio.Event)
                await asyncio.sleep(3.5)
                lease.check()
                assert lease.renewals >= 6, lease.renewals
                d = await client.describe(res)
                assert d.held and d.fencing_token == lease.fencing_token
                with pytest.raises(lockd_client.Held):
                    await client.acquire(res, ttl=1)
            assert lease.lost.is_set() and lease.loss == lockd_client.LOSS_RELEASED
            assert not (await client.describe(res)).held
            st = await client.status()
            assert st.leader_id in (1, 2, 3)

    run(main())


def test_async_errors_and_request_id(cluster):
    res = unique("py-async-err")

    async def main():
        async with AsyncClient(cluster.endpoints) as client:
            rid = "py-async-" + res.split("/")[1]
            a = await client.acquire(res, ttl=5, request_id=rid)
            b = await client.acquire(res, ttl=5, request_id=rid)
            assert (a.lease_id, a.fencing_token) == (b.lease_id, b.fencing_token)
            started = time.monotonic()
            with pytest.raises(lockd_client.WaitTimedOut) as e:
                await client.acquire(res, ttl=5, wait=1)
            assert e.value.reason == "WAIT_TIMEOUT" and time.monotonic() - started >= 0.9
            assert await client.release(res, a.lease_id)
            with pytest.raises(lockd_client.LeaseNotCurrent):
                await client.renew(res, a.lease_id)

    run(main())


def test_async_lost_fires_when_released_behind_its_back(cluster):
    res = unique("py-async-lost")

    async def main():
        async with AsyncClient(cluster.endpoints) as client:
            lease = await client.lock(res, ttl=1.5)
            await client.release(res, lease.lease_id)
            await asyncio.wait_for(lease.lost.wait(), 3)
            assert lease.loss == lockd_client.LOSS_NOT_CURRENT
            with pytest.raises(lockd_client.LeaseLost):
                lease.check()
            assert await lease.release() is False

    run(main())
