"""What the sync and the asyncio client share: settings, argument checks, the backoff schedule and
the reading of gRPC statuses.
The algorithm is the Rust client's, described in docs/client.md."""

from __future__ import annotations

import enum
import os
import random
import secrets
import socket
import unicodedata
from dataclasses import dataclass
from typing import Dict, Iterator, List, Optional, Sequence, Tuple, Union

import grpc
from google.rpc import error_details_pb2, status_pb2

from . import errors as E

# Timing constants, as in lockd/client/src/config.rs.
CONNECT_TIMEOUT = 1.0  # a node that cannot finish a handshake in 1 s is skipped
ATTEMPT_TIMEOUT = 6.0  # lockd answers UNAVAILABLE within 5 s without quorum; +1 s slack
CALL_TIMEOUT = 15.0  # rides out several elections and a restart
SAFETY_MARGIN_MIN = 0.25
SAFETY_MARGIN_TTL_DIVISOR = 10
RENEWALS_PER_TTL = 3
RENEW_JITTER_DIVISOR = 4
BACKOFF_MIN = 0.05
BACKOFF_MAX = 1.0
SERVER_DEFAULT_TTL = 30.0
RESOURCE_MAX_BYTES = 256
REQUEST_ID_MAX_BYTES = 128
DOMAIN = "lockd"
STATUS_DETAILS_KEY = "grpc-status-details-bin"
# The ErrorInfo metadata entry lockd puts on a refusal that its replicated state machine decided
# for this request (after looking its request id up): only such a refusal speaks for every
# attempt of the request (docs/api.md, "Status codes and reasons").
DECIDED_BY_KEY = "decided_by"
DECIDED_BY_STATE_MACHINE = "state_machine"

# The Acquire/Renew/Release RPCs change state: an unanswered attempt leaves the outcome unknown.
MUTATING = {"acquire", "renew", "release"}


@dataclass(frozen=True)
class TLS:
    """TLS towards lockd: the CA of the nodes' certificates and, for a client-certificate
    identity, this client's certificate and key (PEM bytes or file paths)."""

    ca: Union[bytes, str, None] = None
    cert: Union[bytes, str, None] = None
    key: Union[bytes, str, None] = None

    def credentials(self) -> grpc.ChannelCredentials:
        if (self.cert is None) != (self.key is None):
            raise E.InvalidArgument("TLS: cert and key go together")
        return grpc.ssl_channel_credentials(
            root_certificates=_pem(self.ca, "ca"),
            private_key=_pem(self.key, "key"),
            certificate_chain=_pem(self.cert, "cert"),
        )


def _pem(value: Union[bytes, str, None], what: str) -> Optional[bytes]:
    if value is None or isinstance(value, bytes):
        return value
    try:
        with open(value, "rb") as f:
            return f.read()
    except OSError as e:
        raise E.InvalidArgument("TLS %s %r: %s" % (what, value, e)) from e


def parse_endpoint(endpoint: str, tls: bool) -> str:
    """``host:port``, ``http://host:port`` or ``https://host:port`` -> ``host:port``."""
    target = endpoint.strip()
    for scheme in ("http://", "https://"):
        if target.startswith(scheme):
            if scheme == "http://" and tls:
                raise E.InvalidArgument("bad endpoint %r: http:// with TLS on" % endpoint)
            if scheme == "https://" and not tls:
                raise E.InvalidArgument("bad endpoint %r: https:// needs tls=TLS(...)" % endpoint)
            target = target[len(scheme) :]
    target = target.rstrip("/")
    host, sep, port = target.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536 or "/" in target:
        raise E.InvalidArgument("bad endpoint %r: expected host:port" % endpoint)
    return target


def normalize_endpoints(endpoints: Union[str, Sequence[str]]) -> List[str]:
    if isinstance(endpoints, str):
        endpoints = [e for e in endpoints.split(",") if e.strip()]
    if not endpoints:
        raise E.InvalidArgument("no endpoints given")
    return list(endpoints)


def check_resource(resource: str) -> None:
    """Refuses a resource lockd would reject anyway: 1..=256 bytes of UTF-8 without control
    characters."""
    if not isinstance(resource, str):
        raise E.InvalidArgument("resource must be a str, got %r" % (resource,))
    size = len(resource.encode("utf-8", "surrogatepass"))
    if size == 0 or size > RESOURCE_MAX_BYTES or any(
        unicodedata.category(c) == "Cc" for c in resource
    ):
        raise E.InvalidArgument(
            "bad resource %r: 1..=%d bytes of UTF-8 without control characters"
            % (resource, RESOURCE_MAX_BYTES),
            resource=resource,
        )


def check_request_id(request_id: str) -> None:
    size = len(request_id.encode("utf-8", "surrogatepass"))
    if size == 0 or size > REQUEST_ID_MAX_BYTES or any(
        unicodedata.category(c) == "Cc" for c in request_id
    ):
        raise E.InvalidArgument(
            "bad request_id %r: 1..=%d bytes without control characters"
            % (request_id, REQUEST_ID_MAX_BYTES)
        )


# docs/clients.md, rule 3.
def new_request_id() -> str:
    """One unguessable id per logical Acquire (128 bits from a CSPRNG, hex). A request id
    is a credential: a retry with it returns the lease id."""
    return secrets.token_hex(16)


def default_holder() -> str:
    return "%s/pid-%d" % (socket.gethostname() or "unknown-host", os.getpid())


def to_ms(seconds: Optional[float], what: str) -> int:
    if seconds is None:
        return 0
    if seconds < 0:
        raise E.InvalidArgument("%s must not be negative, got %r" % (what, seconds))
    return int(round(seconds * 1000))


def granted_ttl(reply_ms: int, requested: Optional[float]) -> float:
    if reply_ms > 0:
        return reply_ms / 1000.0
    return requested if requested else SERVER_DEFAULT_TTL


# docs/clients.md, rule 8.
def default_safety_margin(ttl: float) -> float:
    """docs/client.md "The margin": max(ttl / 10, 250 ms), never more than half the ttl."""
    return min(max(ttl / SAFETY_MARGIN_TTL_DIVISOR, SAFETY_MARGIN_MIN), ttl / 2)


# docs/clients.md, rule 5.
def backoff() -> Iterator[float]:
    """50 ms doubling to 1 s, each plus up to 100 % random jitter. Never ends: the call's
    deadline, not a count, stops the retries."""
    base = BACKOFF_MIN
    while True:
        yield base + random.random() * base
        base = min(base * 2, BACKOFF_MAX)


# docs/clients.md, rule 9.
def next_renewal(last_sent: float, interval: float) -> float:
    """`interval` after the last successful send, shortened by up to a quarter."""
    return last_sent + interval - random.random() * (interval / RENEW_JITTER_DIVISOR)


def humanize(seconds: float) -> str:
    ms = int(seconds * 1000)
    if ms < 1000:
        return "%dms" % ms
    if ms % 1000 == 0:
        return "%ds" % (ms // 1000)
    return "%.1fs" % seconds


def abbreviate(secret: str) -> str:
    """A lease id or request id for messages: both are credentials (docs/clients.md, rule 15),
    so only the first 8 characters are shown."""
    return secret[:8] + "\u2026" if len(secret) > 8 else secret


# --- reading statuses -------------------------------------------------------------------------


@dataclass
class StatusInfo:
    code: grpc.StatusCode
    message: str
    reason: Optional[str]  # None: no ErrorInfo of domain lockd (the status did not come from lockd)
    metadata: Dict[str, str]


def error_info_from_status(st: Optional[status_pb2.Status]) -> Tuple[Optional[str], Dict[str, str]]:
    if st is None:
        return None, {}
    for detail in st.details:
        if detail.Is(error_details_pb2.ErrorInfo.DESCRIPTOR):
            info = error_details_pb2.ErrorInfo()
            detail.Unpack(info)
            if info.domain == DOMAIN:
                return info.reason, dict(info.metadata)
    return None, {}


def status_from_trailers(trailers) -> Optional[status_pb2.Status]:
    for key, value in trailers or ():
        if key == STATUS_DETAILS_KEY:
            try:
                return status_pb2.Status.FromString(value)
            except Exception:  # a malformed trailer proves nothing; treat as "not from lockd"
                return None
    return None


# What one failed attempt means for the retry loop.
NOT_SENT = "not_sent"  # never reached a node, or lockd said nothing was done: retry, no effect
MAYBE_SENT = "maybe_sent"  # may have reached a node: retry, outcome unknown until answered
FINAL = "final"  # a definite answer: stop


# docs/clients.md, rule 4.
def classify(op: str, s: StatusInfo) -> str:
    """lockd says in its ErrorInfo whether the call may have taken effect; a status
    without one did not come from lockd (a broken connection, a proxy, our own deadline) and
    proves nothing."""
    code = s.code
    if code == grpc.StatusCode.UNAVAILABLE:
        if s.reason in ("NO_QUORUM", "OVERLOADED"):
            return NOT_SENT
        return MAYBE_SENT
    if s.reason is None and code in (
        grpc.StatusCode.DEADLINE_EXCEEDED,
        grpc.StatusCode.CANCELLED,
        grpc.StatusCode.UNKNOWN,
        grpc.StatusCode.INTERNAL,
    ):
        return MAYBE_SENT
    # lockd's own INTERNAL says OUTCOME_UNKNOWN: retry with the same request id.
    if s.reason == "OUTCOME_UNKNOWN" and code in (
        grpc.StatusCode.CANCELLED,
        grpc.StatusCode.UNKNOWN,
        grpc.StatusCode.INTERNAL,
    ):
        return MAYBE_SENT
    if code == grpc.StatusCode.DEADLINE_EXCEEDED and s.reason != "WAIT_TIMEOUT":
        return MAYBE_SENT
    return FINAL


def decided_by_state_machine(s: StatusInfo) -> bool:
    return s.reason is not None and s.metadata.get(DECIDED_BY_KEY) == DECIDED_BY_STATE_MACHINE


# docs/clients.md, rule 6.
def speaks_for_this_attempt_only(op: str, s: StatusInfo) -> bool:
    """Whether a final refusal of a state-changing call says nothing about earlier attempts of it:
    lockd refuses some calls before it looks the request id up (bounds on parked waits and on
    calls in transit, field checks and the authorization policy, which may differ between nodes
    during a rollout). After an earlier attempt that may have arrived, such a refusal leaves the
    outcome unknown. A Renew answered NOT_FOUND is final whatever came before: an earlier renewal
    that succeeded could only have extended the current lease, so the lease is not current now."""
    if op not in MUTATING or decided_by_state_machine(s):
        return False
    return not (op == "renew" and s.code == grpc.StatusCode.NOT_FOUND)


def refused_after_maybe_sent(endpoint: str, s: StatusInfo) -> str:
    return (
        "an earlier attempt may have taken effect, and lockd refused a later one before its state "
        "machine decided the request, which says nothing about the earlier one: %s"
        % describe_status(endpoint, s)
    )


# docs/clients.md, rule 6.
def final_error(
    op: str, s: StatusInfo, resource: Optional[str], lease_id: Optional[str], wait: float
) -> E.LockdError:
    """Maps a final status of `op` to the caller's exception (the table in errors.py)."""
    C = grpc.StatusCode
    kw = dict(op=op, resource=resource, code=s.code.name, reason=s.reason, metadata=s.metadata)
    what = "%s of %r" % (op, resource) if resource is not None else op
    if s.code == C.ABORTED and op == "acquire":
        return E.Held("%r is held by another lease (not granted): %s" % (resource, s.message), **kw)
    if s.code == C.DEADLINE_EXCEEDED and op == "acquire":
        return E.WaitTimedOut(
            "waited %s for %r without getting it (not granted): %s"
            % (humanize(wait), resource, s.message),
            wait=wait,
            **kw,
        )
    if s.code == C.RESOURCE_EXHAUSTED:
        return E.LimitReached("%s: limit reached (not granted): %s" % (what, s.message), **kw)
    if s.code == C.INVALID_ARGUMENT or (
        s.code == C.FAILED_PRECONDITION and s.reason == "INVALID_FIELD"
    ):
        return E.InvalidArgument("%s: invalid argument: %s" % (what, s.message), **kw)
    if s.code == C.NOT_FOUND:
        return E.LeaseNotCurrent(
            "lease %s of %r is not current (expired, released or superseded): %s"
            % (abbreviate(lease_id or ""), resource, s.message),
            **kw,
        )
    if s.code == C.PERMISSION_DENIED:
        return E.PermissionDenied("%s: %s" % (what, s.message), **kw)
    if s.code == C.UNAUTHENTICATED:
        return E.Unauthenticated("%s: %s" % (what, s.message), **kw)
    return E.ProtocolError(
        "%s: unexpected reply %s from lockd: %s" % (what, s.code.name, s.message),
        outcome=E.UNKNOWN if op in MUTATING else E.NOT_DONE,
        **kw,
    )


# docs/clients.md, rule 6.
def exhausted_error(
    op: str,
    resource: Optional[str],
    request_id: Optional[str],
    maybe_sent: bool,
    attempts: int,
    elapsed: float,
    last_error: str,
) -> E.LockdError:
    """The error of a call whose retries ran out of time ."""
    if maybe_sent and op in MUTATING:
        # The id in full only as the error's `request_id`: it is a credential (rule 15).
        retry = " (retry with request id %s)" % abbreviate(request_id) if request_id else ""
        return E.OutcomeUnknown(
            "%s of %r: outcome unknown after %d attempt(s) in %s%s: %s"
            % (op, resource, attempts, humanize(elapsed), retry, last_error),
            op=op,
            resource=resource,
            request_id=request_id,
            attempts=attempts,
            elapsed=elapsed,
        )
    of = " of %r" % resource if resource is not None else ""
    return E.Unavailable(
        "%s%s: no lockd node answered after %d attempt(s) in %s (not done): %s"
        % (op, of, attempts, humanize(elapsed), last_error),
        op=op,
        resource=resource,
        attempts=attempts,
        elapsed=elapsed,
    )


# docs/clients.md, rule 3.
def repeat_not_current(resource: str, request_id: str, token: int, cause: E.LockdError) -> E.LockdError:
    """A request id repeated by the caller returned grant `token`, and the Renew that confirms it
    answered NOT_FOUND: that grant existed but is not current, so nothing is held."""
    return E.LeaseNotCurrent(
        "acquire of %r: request id %s was granted token %d, which is no longer current (expired "
        "or released since): nothing is held; acquire with a new request id (%s)"
        % (resource, abbreviate(request_id), token, cause),
        op="acquire",
        resource=resource,
        code=cause.code,
        reason=cause.reason,
        metadata=cause.metadata,
    )


# docs/clients.md, rules 3 and 10.
def granted_unconfirmed(
    resource: str, request_id: str, token: int, what: str, cause: E.LockdError
) -> E.LockdError:
    """A grant (token `token`) the client cannot hand out because the renewal `what` describes
    failed without proving the lease gone: it may still be held, until its ttl."""
    return E.OutcomeUnknown(
        "acquire of %r: granted token %d, then %s failed; the lease may still be held (retry "
        "with request id %s): %s" % (resource, token, what, abbreviate(request_id), cause),
        op="acquire",
        resource=resource,
        request_id=request_id,
        attempts=getattr(cause, "attempts", 0),
        elapsed=getattr(cause, "elapsed", 0.0),
    )


# docs/clients.md, rule 10.
def handout_renewal_failed(
    resource: str, request_id: str, token: int, cause: E.LockdError, released: Optional[bool]
) -> E.LockdError:
    """lock() was granted `token`, and the renewal before handing the lease out failed with
    `cause`; the release after it answered `released` (None: failed or not tried). Only a
    NOT_FOUND proves nothing is held. Any other failure (an unmarked transit bound, a policy that
    allows acquire but not renew, the renewal's own unknown outcome) is OutcomeUnknown for the
    acquire with its request id, whatever the release answered: never "not granted"."""
    if isinstance(cause, E.LeaseNotCurrent):
        return E.LeaseNotCurrent(
            "acquire of %r: granted token %d, which the renewal before handing out the lease found "
            "not current (expired since): nothing is held; acquire again (%s)" % (resource, token, cause),
            op="acquire",
            resource=resource,
            code=cause.code,
            reason=cause.reason,
            metadata=cause.metadata,
        )
    after = {
        True: "it was released afterwards",
        False: "the release afterwards found it not current",
        None: "no release afterwards was answered, so the lease may still be held",
    }[released]
    return E.OutcomeUnknown(
        "acquire of %r: granted token %d, then the renewal before handing out the lease failed (%s; "
        "retry with request id %s): %s" % (resource, token, after, abbreviate(request_id), cause),
        op="acquire",
        resource=resource,
        request_id=request_id,
        attempts=getattr(cause, "attempts", 0),
        elapsed=getattr(cause, "elapsed", 0.0),
    )


# docs/clients.md, rule 14.
class ReleaseOutcome(str, enum.Enum):
    """What a release did. A str, so it compares equal to its value."""

    RELEASED = "released"
    """The lease was current and is released."""
    NOT_CURRENT = "not_current"
    """Not current at the first attempt that reached lockd: this call released nothing."""
    NOT_CURRENT_AFTER_RETRY = "not_current_after_retry"
    """Not current now, answered to a retry after an attempt that went unanswered and may have
    released it: whether this call released the lease is unknown (it is not held either way)."""


def release_outcome(released: bool, first_sent: float, sent: float) -> ReleaseOutcome:
    """The outcome of a Release answered `released` by the attempt sent at `sent`, whose call's
    first maybe-sent attempt left at `first_sent`."""
    if released:
        return ReleaseOutcome.RELEASED
    # An earlier attempt went unanswered and may have released the lease.
    return ReleaseOutcome.NOT_CURRENT_AFTER_RETRY if first_sent < sent else ReleaseOutcome.NOT_CURRENT


def describe_status(endpoint: str, s: StatusInfo) -> str:
    reason = " (%s)" % s.reason if s.reason else ""
    return "%s: %s%s: %s" % (endpoint, s.code.name, reason, s.message)
