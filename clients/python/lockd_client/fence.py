"""Carrying a lease's fence to storage behind fence-proxy (docs/fence-proxy.md,
docs/fence-proxy-postgres.md).

HTTP: ``FenceAuth(lease)`` works as ``auth=`` for both requests and httpx; it checks the lease
before every request (raising :class:`LeaseLost` instead of sending a write on a lost lease) and
adds ``Lock-Resource``, ``Fencing-Token`` and ``Lock-Sequencer`` (base64, when the cluster signs
grants). Postgres: ``set_fence(conn, lease)`` runs ``SET lockd.fence = '<resource>:<token>'`` on a
psycopg connection; ``fence_options(lease)`` gives the ``options`` of a new connection instead.

The local check cannot help a process paused between it and the write: only the proxy's fencing
check catches that, which is why every write carries the token.
"""

from __future__ import annotations

import base64
from typing import Any, Dict, Protocol


class _HasFence(Protocol):
    resource: str
    fencing_token: int
    sequencer: bytes

    def check(self) -> None: ...


HEADER_RESOURCE = "Lock-Resource"
HEADER_TOKEN = "Fencing-Token"
HEADER_SEQUENCER = "Lock-Sequencer"


def fence_headers(lease: _HasFence) -> Dict[str, str]:
    """The fence-proxy headers of ``lease`` (no check: see :class:`FenceAuth` for that)."""
    headers = {HEADER_RESOURCE: lease.resource, HEADER_TOKEN: str(lease.fencing_token)}
    if lease.sequencer:
        headers[HEADER_SEQUENCER] = base64.b64encode(lease.sequencer).decode("ascii")
    return headers


# docs/clients.md, rule 13.
class FenceAuth:
    """``auth=FenceAuth(lease)`` for requests and httpx (both call it with the outgoing request):
    raises :class:`lockd_client.LeaseLost` once the lease may be gone, else adds the headers."""

    def __init__(self, lease: _HasFence) -> None:
        self.lease = lease

    def __call__(self, request: Any) -> Any:
        self.lease.check()
        request.headers.update(fence_headers(self.lease))
        return request


def fence_value(lease: _HasFence, signed: bool = False) -> str:
    """``<resource>:<token>``, or with ``signed`` ``<resource>:<sequencer base64>`` for a proxy
    started with ``--verify-key``."""
    if signed:
        if not lease.sequencer:
            raise ValueError("lease of %r carries no sequencer (lockd without signing)" % lease.resource)
        return "%s:%s" % (lease.resource, base64.b64encode(lease.sequencer).decode("ascii"))
    return "%s:%d" % (lease.resource, lease.fencing_token)


def fence_options(lease: _HasFence, signed: bool = False) -> str:
    """The libpq ``options`` that set the fence at connection start-up:
    ``psycopg.connect(url, options=fence_options(lease))``."""
    value = fence_value(lease, signed).replace("\\", "\\\\").replace(" ", "\\ ")
    return "-c lockd.fence=" + value


def _set_statement(lease: _HasFence, signed: bool) -> Any:
    from psycopg import sql  # optional dependency: pip install lockd-client[psycopg]

    return sql.SQL("SET lockd.fence = {}").format(sql.Literal(fence_value(lease, signed)))


# docs/clients.md, rule 13.
def set_fence(conn: Any, lease: _HasFence, signed: bool = False) -> None:
    """Sets the session's fence on a psycopg (3) connection after checking the lease. Outside a
    transaction, so that it stays set for the session: a connection not in autocommit mode gets
    the SET committed on its own."""
    lease.check()
    if conn.info.transaction_status != 0:  # pq.TransactionStatus.IDLE
        raise ValueError("set_fence: the connection is inside a transaction; commit or roll back first")
    conn.execute(_set_statement(lease, signed))
    if not conn.autocommit:
        conn.commit()


async def aset_fence(conn: Any, lease: _HasFence, signed: bool = False) -> None:
    """:func:`set_fence` for ``psycopg.AsyncConnection``."""
    lease.check()
    if conn.info.transaction_status != 0:
        raise ValueError("aset_fence: the connection is inside a transaction; commit or roll back first")
    await conn.execute(_set_statement(lease, signed))
    if not conn.autocommit:
        await conn.commit()


def reset_fence(conn: Any) -> None:
    """``RESET lockd.fence``: later transactions of the session carry no fence."""
    conn.execute("RESET lockd.fence")
    if not conn.autocommit:
        conn.commit()
