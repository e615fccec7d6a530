/**
 * What the client and the lease share: the timing constants, argument checks, the backoff
 * schedule and the reading of gRPC statuses. "Rule N" refers to the numbered rules of
 * docs/clients.md.
 */

import { randomBytes } from 'node:crypto';
import { hostname } from 'node:os';
import grpc from '@grpc/grpc-js';

import {
  HeldError,
  InvalidArgumentError,
  LeaseNotCurrentError,
  LimitReachedError,
  type LockdError,
  OutcomeUnknownError,
  PermissionDeniedError,
  ProtocolError,
  UnauthenticatedError,
  UnavailableError,
  WaitTimedOutError,
} from './errors.js';
import type { StatusInfo } from './status.js';

const Code = grpc.status;

// Timing constants (rules 2, 5, 8, 9), the same as the Rust and Python clients'.
/** A node that cannot finish a connection handshake in 1 s is skipped. */
export const CONNECT_TIMEOUT_MS = 1_000;
/** lockd answers `UNAVAILABLE` within 5 s without quorum; 1 s of slack on top. */
export const ATTEMPT_TIMEOUT_MS = 6_000;
/** Rides out several elections and a node restart without hanging a caller forever. */
export const CALL_TIMEOUT_MS = 15_000;
export const SAFETY_MARGIN_MIN_MS = 250;
export const SAFETY_MARGIN_TTL_DIVISOR = 10;
export const RENEWALS_PER_TTL = 3;
export const RENEW_JITTER_DIVISOR = 4;
export const BACKOFF_MIN_MS = 50;
export const BACKOFF_MAX_MS = 1_000;
/** What lockd grants when `lease_ttl_ms` is 0. */
export const SERVER_DEFAULT_TTL_MS = 30_000;
// Argument bounds lockd enforces too (docs/api.md, "Limits and policy"): refusing locally names
// the value without a round trip.
export const RESOURCE_MAX_BYTES = 256;
export const REQUEST_ID_MAX_BYTES = 128;
export const HOLDER_MAX_BYTES = 256;

/** The monotonic clock every deadline is counted on (rule 1): milliseconds, never wall time. */
export const now = (): number => performance.now();

/** The calls that change state: an unanswered attempt of one leaves its outcome unknown. */
export const MUTATING: ReadonlySet<string> = new Set(['acquire', 'renew', 'release']);

// Unicode category Cc, which lockd refuses in resources, request ids and holders.
const CONTROL = /[\u0000-\u001f\u007f-\u009f]/;

function utf8Length(s: string): number {
  return Buffer.byteLength(s, 'utf8');
}

function quote(s: string): string {
  return JSON.stringify(s);
}

/** 1..=256 bytes of UTF-8 without control characters; what lockd would refuse anyway. */
export function checkResource(resource: unknown): asserts resource is string {
  if (typeof resource !== 'string') {
    throw new InvalidArgumentError(`bad resource ${String(resource)}: must be a string`);
  }
  const size = utf8Length(resource);
  if (size === 0 || size > RESOURCE_MAX_BYTES || CONTROL.test(resource) || !resource.isWellFormed()) {
    throw new InvalidArgumentError(
      `bad resource ${quote(resource)}: 1..=${RESOURCE_MAX_BYTES} bytes of UTF-8 without control characters`,
      { resource },
    );
  }
}

export function checkRequestId(requestId: string): void {
  const size = utf8Length(requestId);
  if (size === 0 || size > REQUEST_ID_MAX_BYTES || CONTROL.test(requestId) || !requestId.isWellFormed()) {
    throw new InvalidArgumentError(
      `bad requestId ${quote(requestId)}: 1..=${REQUEST_ID_MAX_BYTES} bytes without control characters`,
    );
  }
}

export function checkHolder(holder: string): void {
  if (utf8Length(holder) > HOLDER_MAX_BYTES || CONTROL.test(holder) || !holder.isWellFormed()) {
    throw new InvalidArgumentError(
      `bad holder ${quote(holder)}: 0..=${HOLDER_MAX_BYTES} bytes without control characters`,
    );
  }
}

/**
 * One unguessable id per logical acquire (rule 3): 128 bits from a CSPRNG, hex. A request id is a
 * credential: a retry with it returns the lease id.
 */
export function newRequestId(): string {
  return randomBytes(16).toString('hex');
}

export function defaultHolder(): string {
  return `${hostname() || 'unknown-host'}/pid-${process.pid}`;
}

/** A duration option in ms: undefined is 0 (the server's default / do not wait). */
export function checkMs(value: number | undefined, what: string): number {
  if (value === undefined) return 0;
  if (typeof value !== 'number' || !Number.isFinite(value) || value < 0) {
    throw new InvalidArgumentError(`${what} must be a finite number of milliseconds >= 0, got ${String(value)}`);
  }
  return Math.round(value);
}

/** The ttl the cluster granted, in ms (rule 7: a reply of 0 means the request's or the default). */
export function grantedTtlMs(replyMs: string | number, requestedMs: number | undefined): number {
  const granted = Number(replyMs);
  if (granted > 0) return granted;
  return requestedMs ? requestedMs : SERVER_DEFAULT_TTL_MS;
}

/** Rule 8: max(ttl / 10, 250 ms), never more than half the ttl. */
export function defaultSafetyMarginMs(ttlMs: number): number {
  return Math.min(Math.max(ttlMs / SAFETY_MARGIN_TTL_DIVISOR, SAFETY_MARGIN_MIN_MS), ttlMs / 2);
}

/**
 * Rule 5: 50 ms doubling to 1 s, each plus up to 100 % random jitter. Never ends: the call's
 * deadline, not a count, stops the retries.
 */
export function* backoff(): Generator<number, never, void> {
  let base = BACKOFF_MIN_MS;
  for (;;) {
    yield base + Math.random() * base;
    base = Math.min(base * 2, BACKOFF_MAX_MS);
  }
}

/** Rule 9: `interval` after the last successful send, shortened by up to a quarter. */
export function nextRenewal(lastSent: number, intervalMs: number): number {
  return lastSent + intervalMs - Math.random() * (intervalMs / RENEW_JITTER_DIVISOR);
}

export function humanize(ms: number): string {
  const whole = Math.floor(ms);
  if (whole < 1000) return `${whole}ms`;
  if (whole % 1000 === 0) return `${whole / 1000}s`;
  return `${(ms / 1000).toFixed(1)}s`;
}

/** Lease ids and request ids are credentials (rule 15): errors and logs show their first 8 characters. */
export function abbreviate(secret: string): string {
  return secret.length > 8 ? `${secret.slice(0, 8)}\u2026` : secret;
}

/**
 * The ErrorInfo metadata entry lockd puts on a refusal that its replicated state machine decided
 * for this request (after looking its request id up): only such a refusal speaks for every attempt
 * of the request (docs/api.md, "Status codes and reasons").
 */
export const DECIDED_BY_KEY = 'decided_by';
export const DECIDED_BY_STATE_MACHINE = 'state_machine';

export function decidedByStateMachine(s: StatusInfo): boolean {
  return s.reason !== undefined && s.metadata[DECIDED_BY_KEY] === DECIDED_BY_STATE_MACHINE;
}

/**
 * Rule 6: whether a final refusal of a state-changing call says nothing about earlier attempts of
 * it. lockd refuses some calls before it looks the request id up (bounds on parked waits and on
 * calls in transit, field checks and the authorization policy, which may differ between nodes
 * during a rollout); after an earlier attempt that may have arrived, such a refusal leaves the
 * outcome unknown. A Renew answered NOT_FOUND is final whatever came before: an earlier renewal
 * that succeeded could only have extended the current lease, so the lease is not current now.
 */
export function speaksForThisAttemptOnly(op: string, s: StatusInfo): boolean {
  if (!MUTATING.has(op) || decidedByStateMachine(s)) return false;
  return !(op === 'renew' && s.code === Code.NOT_FOUND);
}

export function refusedAfterMaybeSent(endpoint: string, s: StatusInfo): string {
  return `an earlier attempt may have taken effect, and lockd refused a later one before its state machine decided the request, which says nothing about the earlier one: ${describeStatus(endpoint, s)}`;
}

/**
 * Rule 3: a request id repeated by the caller returned grant `token`, and the Renew that confirms
 * it answered NOT_FOUND: that grant existed but is not current, so nothing is held.
 */
export function repeatNotCurrent(resource: string, requestId: string, token: bigint, cause: LockdError): LockdError {
  return new LeaseNotCurrentError(
    `acquire of ${quote(resource)}: request id ${abbreviate(requestId)} was granted token ${token}, which is no longer current (expired or released since): nothing is held; acquire with a new request id (${cause.message})`,
    { op: 'acquire', resource, code: cause.code, reason: cause.reason, metadata: { ...cause.metadata } },
  );
}

/**
 * Rules 3 and 10: a grant the client cannot hand out because the renewal `what` describes failed
 * without proving the lease gone: it may still be held, until its ttl.
 */
export function grantedUnconfirmed(
  resource: string,
  requestId: string,
  token: bigint,
  what: string,
  cause: LockdError,
): LockdError {
  const c = cause as Partial<{ attempts: number; elapsedMs: number }>;
  return new OutcomeUnknownError(
    `acquire of ${quote(resource)}: granted token ${token}, then ${what} failed; the lease may still be held (retry with request id ${abbreviate(requestId)}): ${cause.message}`,
    requestId,
    c.attempts ?? 0,
    c.elapsedMs ?? 0,
    { op: 'acquire', resource },
  );
}

/**
 * Rule 10: `lock()` was granted `token`, and the renewal before handing the lease out failed with
 * `cause`; the release after it answered `released` (undefined: failed or not tried). Only a
 * NOT_FOUND proves nothing is held. Any other failure (an unmarked transit bound, a policy that
 * allows acquire but not renew, the renewal's own unknown outcome) is outcome unknown for the
 * acquire with its request id, whatever the release answered: never "not granted".
 */
export function handoutRenewalFailed(
  resource: string,
  requestId: string,
  token: bigint,
  cause: LockdError,
  released: boolean | undefined,
): LockdError {
  if (cause instanceof LeaseNotCurrentError) {
    return new LeaseNotCurrentError(
      `acquire of ${quote(resource)}: granted token ${token}, which the renewal before handing out the lease found not current (expired since): nothing is held; acquire again (${cause.message})`,
      { op: 'acquire', resource, code: cause.code, reason: cause.reason, metadata: { ...cause.metadata } },
    );
  }
  const after =
    released === undefined
      ? 'no release afterwards was answered, so the lease may still be held'
      : released
        ? 'it was released afterwards'
        : 'the release afterwards found it not current';
  const c = cause as Partial<{ attempts: number; elapsedMs: number }>;
  return new OutcomeUnknownError(
    `acquire of ${quote(resource)}: granted token ${token}, then the renewal before handing out the lease failed (${after}; retry with request id ${abbreviate(requestId)}): ${cause.message}`,
    requestId,
    c.attempts ?? 0,
    c.elapsedMs ?? 0,
    { op: 'acquire', resource },
  );
}

// What one failed attempt means for the retry loop (rule 4).
/** Never reached a node, or lockd said nothing was done: retry, no effect. */
export const NOT_SENT = 'not_sent';
/** May have reached a node: retry, the outcome is unknown until an answer arrives. */
export const MAYBE_SENT = 'maybe_sent';
/** A definite answer: stop. */
export const FINAL = 'final';
export type AttemptKind = typeof NOT_SENT | typeof MAYBE_SENT | typeof FINAL;

/**
 * Rules 4 and 6: lockd says in its ErrorInfo whether the call may have taken effect; a status
 * without one did not come from lockd (a broken connection, a proxy, our own deadline) and proves
 * nothing.
 */
export function classify(op: string, s: StatusInfo): AttemptKind {
  if (s.code === Code.UNAVAILABLE) {
    return s.reason === 'NO_QUORUM' || s.reason === 'OVERLOADED' ? NOT_SENT : MAYBE_SENT;
  }
  if (
    s.reason === undefined &&
    (s.code === Code.DEADLINE_EXCEEDED ||
      s.code === Code.CANCELLED ||
      s.code === Code.UNKNOWN ||
      s.code === Code.INTERNAL)
  ) {
    return MAYBE_SENT;
  }
  // lockd's own INTERNAL says OUTCOME_UNKNOWN: retry with the same request id.
  if (
    s.reason === 'OUTCOME_UNKNOWN' &&
    (s.code === Code.CANCELLED || s.code === Code.UNKNOWN || s.code === Code.INTERNAL)
  ) {
    return MAYBE_SENT;
  }
  // Only a waiting Acquire has a deadline of its own; elsewhere this says nothing final.
  if (s.code === Code.DEADLINE_EXCEEDED && (op !== 'acquire' || s.reason !== 'WAIT_TIMEOUT')) {
    return MAYBE_SENT;
  }
  return FINAL;
}

/** Maps a final status of `op` to the caller's error (the table in errors.ts). */
export function finalError(
  op: string,
  s: StatusInfo,
  resource: string | undefined,
  leaseId: string | undefined,
  waitMs: number,
): LockdError {
  const fields = { op, resource, code: s.codeName, reason: s.reason, metadata: s.metadata };
  const what = resource !== undefined ? `${op} of ${quote(resource)}` : op;
  switch (s.code) {
    case Code.ABORTED:
      if (op === 'acquire') {
        return new HeldError(`${quote(resource ?? '')} is held by another lease (not granted): ${s.message}`, fields);
      }
      break;
    case Code.DEADLINE_EXCEEDED:
      if (op === 'acquire') {
        return new WaitTimedOutError(
          `waited ${humanize(waitMs)} for ${quote(resource ?? '')} without getting it (not granted): ${s.message}`,
          waitMs,
          fields,
        );
      }
      break;
    case Code.RESOURCE_EXHAUSTED:
      return new LimitReachedError(`${what}: limit reached (not granted): ${s.message}`, fields);
    case Code.INVALID_ARGUMENT:
      return new InvalidArgumentError(`${what}: invalid argument: ${s.message}`, fields);
    case Code.FAILED_PRECONDITION:
      if (s.reason === 'INVALID_FIELD') {
        return new InvalidArgumentError(`${what}: invalid argument: ${s.message}`, fields);
      }
      break;
    case Code.NOT_FOUND:
      return new LeaseNotCurrentError(
        `lease ${abbreviate(leaseId ?? '')} of ${quote(resource ?? '')} is not current (expired, released or superseded): ${s.message}`,
        fields,
      );
    case Code.PERMISSION_DENIED:
      return new PermissionDeniedError(`${what}: ${s.message}`, fields);
    case Code.UNAUTHENTICATED:
      return new UnauthenticatedError(`${what}: ${s.message}`, fields);
    default:
      break;
  }
  // Unknown for writes: an unexpected status says nothing about what was applied.
  return new ProtocolError(
    `${what}: unexpected reply ${s.codeName} from lockd: ${s.message}`,
    fields,
    MUTATING.has(op) ? 'unknown' : 'not_done',
  );
}

/** Rule 6: the error of a call whose retries ran out of time. */
export function exhaustedError(
  op: string,
  resource: string | undefined,
  requestId: string | undefined,
  maybeSent: boolean,
  attempts: number,
  elapsedMs: number,
  lastError: string,
): LockdError {
  if (maybeSent && MUTATING.has(op)) {
    // The id in full only as the error's `requestId`: it is a credential (rule 15).
    const retry = requestId ? ` (retry with request id ${abbreviate(requestId)})` : '';
    return new OutcomeUnknownError(
      `${op} of ${quote(resource ?? '')}: outcome unknown after ${attempts} attempt(s) in ${humanize(elapsedMs)}${retry}: ${lastError}`,
      requestId,
      attempts,
      elapsedMs,
      { op, resource },
    );
  }
  const of = resource !== undefined ? ` of ${quote(resource)}` : '';
  return new UnavailableError(
    `${op}${of}: no lockd node answered after ${attempts} attempt(s) in ${humanize(elapsedMs)} (not done): ${lastError}`,
    attempts,
    elapsedMs,
    { op, resource },
  );
}

export function describeStatus(endpoint: string, s: StatusInfo): string {
  const reason = s.reason ? ` (${s.reason})` : '';
  return `${endpoint}: ${s.codeName}${reason}: ${s.message}`;
}
