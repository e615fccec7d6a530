"""The errors a caller branches on, and the one table that maps gRPC statuses onto them.

Whether a call may have taken effect is read from the reason in lockd's ``google.rpc.ErrorInfo``
(domain ``lockd``), never from a message (docs/client.md, "Typed errors").

| status from lockd | exception | outcome |
|---|---|---|
| ``ABORTED`` (``LOCK_HELD``) | :class:`Held` | not granted |
| ``DEADLINE_EXCEEDED`` (``WAIT_TIMEOUT``) | :class:`WaitTimedOut` | not granted |
| ``RESOURCE_EXHAUSTED`` | :class:`LimitReached` | not granted |
| ``INVALID_ARGUMENT``, or refused before sending | :class:`InvalidArgument` | not done |
| ``NOT_FOUND`` (``LEASE_NOT_CURRENT``) | :class:`LeaseNotCurrent` (alias ``NotFound``) | not renewed |
| ``PERMISSION_DENIED`` | :class:`PermissionDenied` | not done |
| ``UNAUTHENTICATED`` | :class:`Unauthenticated` | not done |
| no node reachable, or ``UNAVAILABLE`` with ``NO_QUORUM`` / ``OVERLOADED`` only | :class:`Unavailable` | not done |
| an attempt may have arrived and none was answered in time | :class:`OutcomeUnknown` | **unknown** |
| anything else | :class:`ProtocolError` | unknown for writes |
"""

from __future__ import annotations

from typing import Dict, Optional

NOT_DONE = "not_done"
UNKNOWN = "unknown"


class LockdError(Exception):
    """Base of every error of this package.

    ``code`` is the gRPC status code name (``"ABORTED"``...) when a node answered, ``reason`` and
    ``metadata`` come from lockd's ErrorInfo. ``outcome`` is ``"not_done"`` or ``"unknown"``.
    """

    outcome: str = NOT_DONE

    def __init__(
        self,
        message: str,
        *,
        op: str = "",
        resource: Optional[str] = None,
        code: Optional[str] = None,
        reason: Optional[str] = None,
        metadata: Optional[Dict[str, str]] = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.op = op
        self.resource = resource
        self.code = code
        self.reason = reason
        self.metadata = dict(metadata or {})

    @property
    def definitely_not_done(self) -> bool:
        """True when the cluster certainly did not do what the call asked."""
        return self.outcome == NOT_DONE


class Held(LockdError):
    """``ABORTED``: another lease holds the resource and the call did not wait. Not granted."""


class WaitTimedOut(LockdError):
    """``DEADLINE_EXCEEDED``: waited ``wait`` seconds without getting the lock. Not granted."""

    def __init__(self, message: str, *, wait: float = 0.0, **kw) -> None:
        super().__init__(message, **kw)
        self.wait = wait


class LimitReached(LockdError):
    """``RESOURCE_EXHAUSTED``: a waiter or table limit (``metadata["limit"]``). Not granted."""


class InvalidArgument(LockdError, ValueError):
    """``INVALID_ARGUMENT`` from lockd (``metadata["field"]``), or refused before sending."""


class LeaseNotCurrent(LockdError):
    """``NOT_FOUND``: the lease is not the current lease (expired, released, superseded)."""


NotFound = LeaseNotCurrent


class PermissionDenied(LockdError):
    """``PERMISSION_DENIED``: the authorization policy refused this identity. Not done."""


class Unauthenticated(LockdError):
    """``UNAUTHENTICATED``: the cluster did not accept this client's credentials. Not done."""


class Unavailable(LockdError):
    """No node could serve the call before its deadline, and nothing was done: every attempt
    failed to connect or was answered ``UNAVAILABLE`` with ``NO_QUORUM`` / ``OVERLOADED``, or the
    call only reads."""

    def __init__(self, message: str, *, attempts: int = 0, elapsed: float = 0.0, **kw) -> None:
        super().__init__(message, **kw)
        self.attempts = attempts
        self.elapsed = elapsed


class OutcomeUnknown(LockdError):
    """An attempt may have reached a node but no answer arrived before the deadline: the call may
    or may not have taken effect. For ``acquire``, call it again with ``request_id`` (and the same
    ttl, wait and holder) to learn the outcome; an unlearnt lease expires after its ttl."""

    outcome = UNKNOWN

    def __init__(
        self,
        message: str,
        *,
        request_id: Optional[str] = None,
        attempts: int = 0,
        elapsed: float = 0.0,
        **kw,
    ) -> None:
        super().__init__(message, **kw)
        self.request_id = request_id
        self.attempts = attempts
        self.elapsed = elapsed


class ProtocolError(LockdError):
    """A status the contract does not give for this call (``INTERNAL``, ``UNIMPLEMENTED``...)."""

    def __init__(self, message: str, *, outcome: str = UNKNOWN, **kw) -> None:
        super().__init__(message, **kw)
        self.outcome = outcome


class LeaseLost(LockdError):
    """Raised by ``Lease.check()`` once the lease may be gone; ``loss`` says why."""

    def __init__(self, message: str, *, loss: str, **kw) -> None:
        super().__init__(message, **kw)
        self.loss = loss


# Why a lease stopped being usable (``Lease.loss``), as in the Rust client's LossReason.
LOSS_NOT_CURRENT = "not_current"
LOSS_DEADLINE_PASSED = "deadline_passed"
LOSS_RENEW_REFUSED = "renew_refused"
LOSS_RELEASED = "released"
