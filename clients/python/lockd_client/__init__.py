"""lockd_client: the Python client of lockd.

    from lockd_client import Client

    client = Client(["10.0.0.1:7001", "10.0.0.2:7001", "10.0.0.3:7001"])
    with client.lock("orders/42", ttl=30, wait=10) as lease:
        lease.check()                      # raises LeaseLost once the lease may be gone
        write(token=lease.fencing_token)   # every write carries the token
    # leaving the block fires lease.lost, stops renewing and releases

Semantics (retries with one request id, endpoint rotation, deadlines from send time, renewal at
ttl/3 with jitter, the lost signal) are those of the Rust client: docs/client.md.
"""

from ._core import TLS, ReleaseOutcome
from .aio import AsyncClient, AsyncLease, AsyncLostSignal
from .client import Client, Grant, Lease, LostSignal, Renewed
from .errors import (
    LOSS_DEADLINE_PASSED,
    LOSS_NOT_CURRENT,
    LOSS_RELEASED,
    LOSS_RENEW_REFUSED,
    Held,
    InvalidArgument,
    LeaseLost,
    LeaseNotCurrent,
    LimitReached,
    LockdError,
    NotFound,
    OutcomeUnknown,
    PermissionDenied,
    ProtocolError,
    Unauthenticated,
    Unavailable,
    WaitTimedOut,
)
from .fence import FenceAuth, aset_fence, fence_headers, fence_options, fence_value, reset_fence, set_fence

__all__ = [
    "TLS",
    "Client",
    "AsyncClient",
    "Lease",
    "AsyncLease",
    "LostSignal",
    "AsyncLostSignal",
    "Grant",
    "Renewed",
    "ReleaseOutcome",
    "LockdError",
    "Held",
    "WaitTimedOut",
    "LimitReached",
    "InvalidArgument",
    "LeaseNotCurrent",
    "NotFound",
    "PermissionDenied",
    "Unauthenticated",
    "Unavailable",
    "OutcomeUnknown",
    "ProtocolError",
    "LeaseLost",
    "LOSS_NOT_CURRENT",
    "LOSS_DEADLINE_PASSED",
    "LOSS_RENEW_REFUSED",
    "LOSS_RELEASED",
    "FenceAuth",
    "fence_headers",
    "fence_value",
    "fence_options",
    "set_fence",
    "aset_fence",
    "reset_fence",
]
