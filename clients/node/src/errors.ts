/**
 * The errors a caller branches on. Whether a call may have taken effect is read from the reason in
 * lockd's `google.rpc.ErrorInfo` (domain `lockd`), never from a message (docs/clients.md, rule 6).
 *
 * | status from lockd | error | outcome |
 * |---|---|---|
 * | `ABORTED` (`LOCK_HELD`) | {@link HeldError} | not granted |
 * | `DEADLINE_EXCEEDED` (`WAIT_TIMEOUT`) | {@link WaitTimedOutError} | not granted |
 * | `RESOURCE_EXHAUSTED` (`WAITERS_EXHAUSTED`, `LIMIT_REACHED`) | {@link LimitReachedError} | not granted |
 * | `INVALID_ARGUMENT` (`INVALID_FIELD`), or refused before sending | {@link InvalidArgumentError} | not done |
 * | `NOT_FOUND` (`LEASE_NOT_CURRENT`) | {@link LeaseNotCurrentError} | not renewed |
 * | `PERMISSION_DENIED` | {@link PermissionDeniedError} | not done |
 * | `UNAUTHENTICATED` | {@link UnauthenticatedError} | not done |
 * | no node reachable, or `UNAVAILABLE` with `NO_QUORUM` / `OVERLOADED` only | {@link UnavailableError} | not done |
 * | an attempt may have arrived and none was answered in time | {@link OutcomeUnknownError} | **unknown** |
 * | anything else | {@link ProtocolError} | unknown for writes |
 */

/** `not_done`: the cluster certainly did not do what the call asked. `unknown`: it may have. */
export type Outcome = 'not_done' | 'unknown';

/** Why a lease stopped being usable (`Lease.loss`). */
export type LossReason =
  /** A renewal answered `NOT_FOUND`: the lease is gone (expired, released, superseded). */
  | 'not_current'
  /** The local deadline passed without a successful renewal: the lease may be gone. */
  | 'deadline_passed'
  /** A renewal was refused for another definite reason (permission, bad argument...). */
  | 'renew_refused'
  /** Its owner released it (`release()`, leaving an `await using` block). */
  | 'released';

export interface ErrorFields {
  /** The call: `acquire`, `renew`, `release`, `describe`, `status`. */
  op?: string;
  resource?: string;
  /** The gRPC status code name (`ABORTED`...) when a node answered. */
  code?: string;
  /** The reason of lockd's ErrorInfo (`LOCK_HELD`...). */
  reason?: string;
  /** The metadata of lockd's ErrorInfo (`field`, `limit`, `resource`...). */
  metadata?: Record<string, string>;
  cause?: unknown;
}

/** Base of every error of this package. */
export class LockdError extends Error {
  readonly op: string;
  readonly resource: string | undefined;
  readonly code: string | undefined;
  readonly reason: string | undefined;
  readonly metadata: Readonly<Record<string, string>>;
  /** Whether the call may have taken effect. */
  readonly outcome: Outcome;

  constructor(message: string, fields: ErrorFields = {}, outcome: Outcome = 'not_done') {
    super(message, fields.cause === undefined ? undefined : { cause: fields.cause });
    this.name = new.target.name;
    this.op = fields.op ?? '';
    this.resource = fields.resource;
    this.code = fields.code;
    this.reason = fields.reason;
    this.metadata = Object.freeze({ ...(fields.metadata ?? {}) });
    this.outcome = outcome;
  }

  /** True when the cluster certainly did not do what the call asked. */
  get definitelyNotDone(): boolean {
    return this.outcome === 'not_done';
  }
}

/** `ABORTED`: another lease holds the resource and the call did not wait. Not granted. */
export class HeldError extends LockdError {}

/** `DEADLINE_EXCEEDED`: waited `waitMs` without getting the lock. Not granted. */
export class WaitTimedOutError extends LockdError {
  constructor(
    message: string,
    readonly waitMs: number,
    fields: ErrorFields = {},
  ) {
    super(message, fields);
  }
}

/** `RESOURCE_EXHAUSTED`: a waiter or table limit (`metadata.limit`). Not granted. */
export class LimitReachedError extends LockdError {}

/** `INVALID_ARGUMENT` from lockd (`metadata.field`), or refused before sending. Not done. */
export class InvalidArgumentError extends LockdError {}

/** `NOT_FOUND`: the lease is not the current lease (expired, released, superseded). */
export class LeaseNotCurrentError extends LockdError {}

/** `PERMISSION_DENIED`: the authorization policy refused this identity. Not done. */
export class PermissionDeniedError extends LockdError {}

/** `UNAUTHENTICATED`: the cluster did not accept this client's credentials. Not done. */
export class UnauthenticatedError extends LockdError {}

/**
 * No node could serve the call before its deadline, and nothing was done: every attempt failed to
 * connect or was answered `UNAVAILABLE` with `NO_QUORUM` / `OVERLOADED`, or the call only reads.
 */
export class UnavailableError extends LockdError {
  constructor(
    message: string,
    readonly attempts: number,
    readonly elapsedMs: number,
    fields: ErrorFields = {},
  ) {
    super(message, fields);
  }
}

/**
 * An attempt may have reached a node but no answer arrived before the deadline: the call may or
 * may not have taken effect. For `acquire`, call it again with `requestId` (and the same ttl,
 * wait and holder) to learn the outcome; a lease nobody learns of expires after its ttl.
 */
export class OutcomeUnknownError extends LockdError {
  // A private field behind a getter: `inspect()` and `JSON.stringify` of the error leave it out,
  // since a request id is a credential (docs/clients.md, rule 15); the message shows its start.
  readonly #requestId: string | undefined;

  constructor(
    message: string,
    requestId: string | undefined,
    readonly attempts: number,
    readonly elapsedMs: number,
    fields: ErrorFields = {},
  ) {
    super(message, fields, 'unknown');
    this.#requestId = requestId;
  }

  /** The request id to repeat the `acquire` with (same ttl, wait and holder), in full. */
  get requestId(): string | undefined {
    return this.#requestId;
  }
}

/**
 * A status the contract does not give for this call (`INTERNAL`, `UNIMPLEMENTED`...). Its outcome
 * is unknown for the calls that change state.
 */
export class ProtocolError extends LockdError {
  constructor(message: string, fields: ErrorFields = {}, outcome: Outcome = 'unknown') {
    super(message, fields, outcome);
  }
}

/** Thrown by `Lease.check()` (and the reason of `Lease.signal`) once the lease may be gone. */
export class LeaseLostError extends LockdError {
  constructor(
    message: string,
    readonly loss: LossReason,
    fields: ErrorFields = {},
  ) {
    super(message, fields);
  }
}
