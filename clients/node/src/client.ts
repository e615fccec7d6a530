/**
 * The client: the Lock and Cluster RPCs with endpoint rotation, deadline-bounded retries that
 * reuse one request id, typed errors, and `lock()`, which hands out a self-renewing {@link Lease}.
 * "Rule N" refers to the numbered rules of docs/clients.md.
 */

import { readFileSync } from 'node:fs';
import { inspect } from 'node:util';
import grpc from '@grpc/grpc-js';
import type { MethodDefinition } from '@grpc/proto-loader';

import {
  abbreviate,
  ATTEMPT_TIMEOUT_MS,
  backoff,
  CALL_TIMEOUT_MS,
  checkHolder,
  checkMs,
  checkRequestId,
  checkResource,
  classify,
  CONNECT_TIMEOUT_MS,
  defaultHolder,
  defaultSafetyMarginMs,
  describeStatus,
  exhaustedError,
  FINAL,
  finalError,
  grantedTtlMs,
  grantedUnconfirmed,
  handoutRenewalFailed,
  humanize,
  MAYBE_SENT,
  newRequestId,
  now,
  refusedAfterMaybeSent,
  repeatNotCurrent,
  speaksForThisAttemptOnly,
} from './core.js';
import { InvalidArgumentError, LeaseNotCurrentError, LockdError } from './errors.js';
import { Lease, type LeaseOwner } from './lease.js';
import { methods } from './proto.js';
import { statusInfo } from './status.js';

/** TLS towards lockd: PEM contents (a Buffer) or file paths (a string). */
export interface TlsOptions {
  /** The CA of the nodes' certificates; the system roots when omitted. */
  ca?: Buffer | string;
  /** A client certificate and its key, for a certificate identity; both or neither. */
  cert?: Buffer | string;
  key?: Buffer | string;
}

export interface ClientOptions {
  /** `host:port` (or `http://` / `https://`) of the nodes, as a list or a comma-separated string.
   * Any node forwards to the leader; the list needs one live node. */
  endpoints: string | readonly string[];
  /** TLS settings, or `true` for TLS with the system roots. */
  tls?: TlsOptions | boolean;
  /** A bearer token, sent as `authorization: Bearer ...`; refused without TLS. */
  token?: string;
  /** Free text shown by `describe` (default `<hostname>/pid-<pid>`). */
  holder?: string;
  /** Longest a connection handshake may take before the next node is tried (1 s). */
  connectTimeoutMs?: number;
  /** Longest one attempt may wait for its answer (6 s; a waiting acquire adds its wait). */
  attemptTimeoutMs?: number;
  /** Total time of one call with its retries (15 s; an acquire adds its wait). */
  callTimeoutMs?: number;
  /** Subtracted from each lease's deadline (default max(ttl/10, 250 ms), at most ttl/2). */
  safetyMarginMs?: number;
}

export interface AcquireOptions {
  /** Lease ttl in ms (default: the server's, 30 s). */
  ttlMs?: number;
  /** Queue this long for a held resource (default: do not wait). */
  waitMs?: number;
  /** Free text shown by `describe` (default: the client's). */
  holder?: string;
  /** The id every attempt carries; pass the one of an {@link OutcomeUnknownError} to learn its
   * outcome (with the same ttl, wait and holder). Default: a fresh random id. */
  requestId?: string;
  /** Total time of the call with its retries (default `waitMs` + the client's call timeout). */
  timeoutMs?: number;
}

/** A lease as `acquire` returned it. It is not renewed: see {@link Client.lock} for that. */
export class Grant {
  constructor(
    readonly resource: string,
    /** The secret Renew and Release need. Never log it. */
    readonly leaseId: string,
    /** Strictly greater than every token the cluster issued before: attach it to every write. */
    readonly fencingToken: bigint,
    /** The ttl the cluster granted, in ms. */
    readonly ttlMs: number,
    /** The id every attempt carried; acquiring again with it returns this same lease. */
    readonly requestId: string,
    /** When the first attempt that may have reached a node was sent (`performance.now()`). The
     * grant happened later, so the lease cannot expire before `sentAt + ttlMs` (rule 7). With a
     * caller-given `requestId` (whose grant may be minutes old): the confirming renewal's (rule 3a). */
    readonly sentAt: number,
    /** The leader's wall-clock estimate of expiry. Informative only, never used for timing. */
    readonly expiresAtUnixMs: number,
    /** The grant signed by the cluster's key (`Lock-Sequencer` header in base64, `lockd.fence`). */
    readonly sequencer: Buffer,
  ) {
    Object.freeze(this);
  }

  /** The monotonic instant until which this grant may be trusted (rule 7). */
  localDeadline(marginMs: number): number {
    return this.sentAt + Math.max(this.ttlMs - marginMs, 0);
  }

  /** Rule 15: the lease id abbreviated. */
  [inspect.custom](): string {
    return `Grant { resource: ${JSON.stringify(this.resource)}, leaseId: '${abbreviate(this.leaseId)}', fencingToken: ${this.fencingToken}n, ttlMs: ${this.ttlMs} }`;
  }

  /** Without the lease id, which is a secret. */
  toJSON(): Record<string, unknown> {
    return { resource: this.resource, fencingToken: this.fencingToken.toString(), ttlMs: this.ttlMs };
  }
}

/** What a renewal returned. */
/**
 * What a release did (rule 14): `released`; `not_current` at the first attempt that reached
 * lockd (this call released nothing); `not_current_after_retry`, answered to a retry after an
 * attempt that went unanswered and may have released it (whether this call released the lease is
 * unknown; it is not held either way).
 */
export type ReleaseOutcome = 'released' | 'not_current' | 'not_current_after_retry';

export interface Renewed {
  ttlMs: number;
  /** Send time of the answered attempt: the new deadline counts from here (rule 9). */
  sentAt: number;
  expiresAtUnixMs: number;
}

/** `describe`: the linearizable state of one resource. Never the lease id. */
export interface Description {
  held: boolean;
  holder: string;
  fencingToken: bigint;
  /** The leader's wall clock; informative only. */
  expiresAtUnixMs: number;
  waiters: number;
}

export interface HotResource {
  resource: string;
  acquires: number;
  waiters: number;
}

/** `status`: the answering node's view of the cluster. */
export interface ClusterStatus {
  nodeId: number;
  /** 0 when no leader is known. */
  leaderId: number;
  term: number;
  commitIndex: number;
  appliedIndex: number;
  members: { id: number; address: string }[];
  activeLocks: number;
  waiters: number;
  role: string;
  lag: number;
  hotByAcquires: HotResource[];
  hotByWaiters: HotResource[];
}

// Channel settings. Each endpoint gets a subchannel of its own (not grpc-js's process-wide pool),
// so that dropping a failed channel really reconnects instead of inheriting the old backoff.
// grpc-js's own retries are off: the loop below is the one retry policy (rule 2).
const CHANNEL_OPTIONS: grpc.ChannelOptions = {
  'grpc.use_local_subchannel_pool': 1,
  'grpc.enable_retries': 0,
  'grpc.service_config_disable_resolution': 1,
  'grpc.initial_reconnect_backoff_ms': 100,
  'grpc.max_reconnect_backoff_ms': 1_000,
};

/** A reply and the send times the lease arithmetic needs. */
interface Answered<T> {
  value: T;
  /** The earliest attempt that may have reached a node. */
  firstSent: number;
  /** The attempt that was answered. */
  sent: number;
}

/** What one logical call needs to know to retry and to report. */
interface CallCtx {
  op: string;
  /** No attempt starts, and none runs, past this monotonic instant. */
  deadline: number;
  /** Longest one attempt may wait for its answer. */
  attemptTimeoutMs: number;
  resource?: string;
  requestId?: string;
  leaseId?: string;
  waitMs?: number;
  /** An earlier call may already have sent this request (the caller passed the request id of an
   * OutcomeUnknownError): then no answer of this call can prove that nothing was done (rule 6). */
  sentBefore?: boolean;
}

function parseEndpoint(endpoint: string, tls: boolean): string {
  let target = endpoint.trim();
  for (const scheme of ['http://', 'https://']) {
    if (target.startsWith(scheme)) {
      if (scheme === 'http://' && tls) {
        throw new InvalidArgumentError(`bad endpoint ${JSON.stringify(endpoint)}: http:// with TLS on`);
      }
      if (scheme === 'https://' && !tls) {
        throw new InvalidArgumentError(`bad endpoint ${JSON.stringify(endpoint)}: https:// needs the tls option`);
      }
      target = target.slice(scheme.length);
    }
  }
  target = target.replace(/\/+$/, '');
  const colon = target.lastIndexOf(':');
  const host = target.slice(0, Math.max(colon, 0));
  const port = target.slice(colon + 1);
  if (colon <= 0 || !host || !/^\d+$/.test(port) || Number(port) < 1 || Number(port) > 65535 || target.includes('/')) {
    throw new InvalidArgumentError(`bad endpoint ${JSON.stringify(endpoint)}: expected host:port`);
  }
  return target;
}

function pem(value: Buffer | string | undefined, what: string): Buffer | null {
  if (value === undefined) return null;
  if (Buffer.isBuffer(value)) return value;
  try {
    return readFileSync(value);
  } catch (e) {
    throw new InvalidArgumentError(`TLS ${what} ${JSON.stringify(value)}: ${(e as Error).message}`);
  }
}

/** One node: its channel, made when first needed and dropped after a failure. */
class Endpoint {
  #client: grpc.Client | undefined;

  constructor(
    readonly target: string,
    private readonly make: (target: string) => grpc.Client,
  ) {}

  client(): grpc.Client {
    this.#client ??= this.make(this.target);
    return this.#client;
  }

  /** Drops a channel that failed, so the next attempt connects afresh. */
  invalidate(client: grpc.Client): void {
    if (this.#client === client) {
      this.#client = undefined;
      client.close();
    }
  }

  close(): void {
    this.#client?.close();
    this.#client = undefined;
  }
}

/**
 * Resolves once the channel is READY, or with why not (rule 2: a connect that failed or timed out
 * proves the request never left, so the attempt is "not sent").
 */
function waitConnected(channel: ReturnType<grpc.Client['getChannel']>, limitMs: number): Promise<string | undefined> {
  const { READY, TRANSIENT_FAILURE, SHUTDOWN } = grpc.connectivityState;
  const end = now() + limitMs;
  return new Promise((resolve) => {
    const check = (): void => {
      const state = channel.getConnectivityState(true);
      if (state === READY) return resolve(undefined);
      if (state === TRANSIENT_FAILURE || state === SHUTDOWN) return resolve('cannot connect');
      const left = end - now();
      if (left <= 0) return resolve(`not connected within ${humanize(limitMs)}`);
      channel.watchConnectivityState(state, Date.now() + left, (err) => {
        if (err) resolve(`not connected within ${humanize(limitMs)}`);
        else check();
      });
    };
    check();
  });
}

function unary<Req, Res>(
  client: grpc.Client,
  def: MethodDefinition<Req, Res>,
  request: Req,
  metadata: grpc.Metadata,
  limitMs: number,
): Promise<Res> {
  return new Promise((resolve, reject) => {
    client.makeUnaryRequest(
      def.path,
      def.requestSerialize,
      def.responseDeserialize,
      request,
      metadata,
      // grpc-js turns the deadline into a timer at once (and tells the server in grpc-timeout),
      // so the wall clock is read only here, not during the wait.
      { deadline: Date.now() + limitMs },
      (err, value) => (err ? reject(err) : resolve(value as Res)),
    );
  });
}

function sleep(ms: number): Promise<void> {
  return new Promise((resolve) => setTimeout(resolve, ms));
}

function isServiceError(e: unknown): e is grpc.ServiceError {
  return e instanceof Error && typeof (e as Partial<grpc.ServiceError>).code === 'number' && 'metadata' in e;
}

/**
 * A lockd client. One instance can serve a whole process; `close()` it (or `using`) when done.
 *
 * ```ts
 * const client = new Client({ endpoints: ['10.0.0.1:7001', '10.0.0.2:7001', '10.0.0.3:7001'] });
 * await using lease = await client.lock('orders/42', { ttlMs: 30_000, waitMs: 10_000 });
 * lease.check();                                  // throws LeaseLostError once it may be gone
 * await write({ token: lease.fencingToken, signal: lease.signal });
 * ```
 */
export class Client {
  readonly holder: string;
  readonly connectTimeoutMs: number;
  readonly attemptTimeoutMs: number;
  readonly callTimeoutMs: number;
  readonly #safetyMarginMs: number | undefined;
  readonly #endpoints: Endpoint[];
  readonly #token: string | undefined;
  #current = 0;

  constructor(options: ClientOptions) {
    if (options === null || typeof options !== 'object') {
      throw new InvalidArgumentError('new Client({ endpoints }): options must be an object');
    }
    const list =
      typeof options.endpoints === 'string'
        ? options.endpoints.split(',').filter((e) => e.trim())
        : [...(options.endpoints ?? [])];
    if (list.length === 0) throw new InvalidArgumentError('no endpoints given');
    const tls: TlsOptions | undefined = options.tls === true ? {} : options.tls || undefined;
    if (options.token !== undefined) {
      // Over plaintext anyone on the path would read a long-lived secret.
      if (tls === undefined) throw new InvalidArgumentError('a bearer token is sent only over TLS: give tls: { ca }');
      if (!/^[\x21-\x7e]+$/.test(options.token)) {
        throw new InvalidArgumentError('a bearer token must be printable ASCII without spaces');
      }
    }
    this.#token = options.token;
    let creds: grpc.ChannelCredentials;
    if (tls !== undefined) {
      if ((tls.cert === undefined) !== (tls.key === undefined)) {
        throw new InvalidArgumentError('TLS: cert and key go together');
      }
      creds = grpc.credentials.createSsl(pem(tls.ca, 'ca'), pem(tls.key, 'key'), pem(tls.cert, 'cert'));
    } else {
      creds = grpc.credentials.createInsecure();
    }
    const targets = list.map((e) => parseEndpoint(e, tls !== undefined));
    this.#endpoints = targets.map((t) => new Endpoint(t, (target) => new grpc.Client(target, creds, CHANNEL_OPTIONS)));
    this.holder = options.holder ?? defaultHolder();
    checkHolder(this.holder);
    this.connectTimeoutMs = checkMs(options.connectTimeoutMs ?? CONNECT_TIMEOUT_MS, 'connectTimeoutMs');
    this.attemptTimeoutMs = checkMs(options.attemptTimeoutMs ?? ATTEMPT_TIMEOUT_MS, 'attemptTimeoutMs');
    this.callTimeoutMs = checkMs(options.callTimeoutMs ?? CALL_TIMEOUT_MS, 'callTimeoutMs');
    this.#safetyMarginMs =
      options.safetyMarginMs === undefined ? undefined : checkMs(options.safetyMarginMs, 'safetyMarginMs');
  }

  /** The endpoints as `host:port`, in rotation order. */
  get endpoints(): string[] {
    return this.#endpoints.map((e) => e.target);
  }

  /** Closes every channel. Leases still held stop being renewed and expire after their ttl. */
  close(): void {
    for (const ep of this.#endpoints) ep.close();
  }

  [Symbol.dispose](): void {
    this.close();
  }

  /** Rule 8: the configured margin or max(ttl/10, 250 ms), never more than half the ttl. */
  safetyMarginMs(ttlMs: number): number {
    return Math.min(this.#safetyMarginMs ?? defaultSafetyMarginMs(ttlMs), ttlMs / 2);
  }

  #metadata(): grpc.Metadata {
    const md = new grpc.Metadata();
    if (this.#token !== undefined) md.set('authorization', `Bearer ${this.#token}`);
    return md;
  }

  /**
   * Runs one RPC against the current endpoint until it answers, gives a final status, or the
   * deadline passes; after a retryable failure rotates to the next endpoint and backs off (rules
   * 4 and 5). Every attempt sends the same request, so an acquire keeps its request id (rule 3).
   */
  async #call<Req, Res>(def: MethodDefinition<Req, Res>, request: Req, ctx: CallCtx): Promise<Answered<Res>> {
    const started = now();
    const delays = backoff();
    let attempts = 0;
    let firstSent: number | undefined;
    let lastError = 'the deadline passed before any attempt';
    while (now() < ctx.deadline) {
      attempts += 1;
      const index = this.#current;
      const ep = this.#endpoints[index]!;
      const client = ep.client();
      const why = await waitConnected(client.getChannel(), Math.min(this.connectTimeoutMs, Math.max(ctx.deadline - now(), 0)));
      if (why !== undefined) {
        lastError = `${ep.target}: ${why}`;
      } else {
        const sent = now();
        const limit = Math.max(Math.min(ctx.attemptTimeoutMs, ctx.deadline - sent), 1);
        try {
          const value = await unary(client, def, request, this.#metadata(), limit);
          return { value, firstSent: firstSent ?? sent, sent };
        } catch (e) {
          if (!isServiceError(e)) throw e;
          const info = statusInfo(e);
          const kind = classify(ctx.op, info);
          if (kind === FINAL) {
            // firstSent is set by maybe-sent attempts only: an earlier attempt (rule 6).
            const earlier = firstSent !== undefined || ctx.sentBefore === true;
            if (earlier && speaksForThisAttemptOnly(ctx.op, info)) {
              throw exhaustedError(
                ctx.op,
                ctx.resource,
                ctx.requestId,
                true,
                attempts,
                now() - started,
                refusedAfterMaybeSent(ep.target, info),
              );
            }
            throw finalError(ctx.op, info, ctx.resource, ctx.leaseId, ctx.waitMs ?? 0);
          }
          // Not-sent and maybe-sent attempts both retry; only a maybe-sent one makes the outcome
          // unknown and starts the lease's time (rule 7).
          if (kind === MAYBE_SENT) firstSent ??= sent;
          lastError =
            info.code === grpc.status.DEADLINE_EXCEEDED && info.reason === undefined
              ? `${ep.target}: no answer within ${humanize(limit)}`
              : describeStatus(ep.target, info);
        }
      }
      ep.invalidate(client);
      // Leader following (rule 4): the next node forwards to whichever node leads now.
      if (this.#current === index) this.#current = (index + 1) % this.#endpoints.length;
      const delay = delays.next().value;
      if (now() + delay >= ctx.deadline) break;
      await sleep(delay);
    }
    throw exhaustedError(
      ctx.op,
      ctx.resource,
      ctx.requestId,
      firstSent !== undefined || ctx.sentBefore === true,
      attempts,
      now() - started,
      lastError,
    );
  }

  /**
   * Takes the lock on `resource` (queueing up to `waitMs`), retrying transport errors and
   * `UNAVAILABLE` with the same request id until `timeoutMs` (default `waitMs` + 15 s). Does not
   * renew: use {@link Client.lock} for that.
   */
  async acquire(resource: string, options: AcquireOptions = {}): Promise<Grant> {
    const started = now();
    checkResource(resource);
    const requestId = options.requestId ?? newRequestId();
    checkRequestId(requestId);
    const ttlMs = checkMs(options.ttlMs, 'ttlMs');
    const waitMs = checkMs(options.waitMs, 'waitMs');
    const holder = options.holder ?? this.holder;
    checkHolder(holder);
    const budget = options.timeoutMs !== undefined ? checkMs(options.timeoutMs, 'timeoutMs') : waitMs + this.callTimeoutMs;
    const answered = await this.#call(
      methods.acquire,
      { resource, requestId, leaseTtlMs: ttlMs, waitTimeoutMs: waitMs, holder },
      {
        op: 'acquire',
        deadline: started + budget,
        // A waiting attempt legitimately takes up to `wait` before lockd answers.
        attemptTimeoutMs: waitMs + this.attemptTimeoutMs,
        resource,
        requestId,
        waitMs,
        sentBefore: options.requestId !== undefined,
      },
    );
    const reply = answered.value;
    const token = BigInt(reply.fencingToken);
    let sentAt = answered.firstSent;
    let granted = grantedTtlMs(reply.leaseTtlMs, ttlMs || undefined);
    if (options.requestId !== undefined) {
      // Rule 3: a caller-given id may repeat a call made long ago, and lockd answers it with the
      // original grant, expired or not; when that grant was made is unknown here. A Renew proves
      // the lease current and starts its time afresh.
      const t = now();
      const deadline = Math.max(started + budget, t + this.attemptTimeoutMs);
      try {
        const renewed = await this.#renewUntil(resource, reply.leaseId, undefined, deadline, this.attemptTimeoutMs);
        sentAt = renewed.sentAt;
        granted = renewed.ttlMs;
      } catch (e) {
        if (e instanceof LeaseNotCurrentError) throw repeatNotCurrent(resource, requestId, token, e);
        if (e instanceof LockdError) {
          throw grantedUnconfirmed(resource, requestId, token, 'the renewal that confirms a repeated request id', e);
        }
        throw e;
      }
    }
    return new Grant(
      resource,
      reply.leaseId,
      token,
      granted,
      requestId,
      sentAt,
      Number(reply.expiresAtUnixMs),
      Buffer.from(reply.sequencer),
    );
  }

  /** Extends `leaseId` by its ttl (or `ttlMs`). {@link LeaseNotCurrentError} if it is not current. */
  renew(resource: string, leaseId: string, options: { ttlMs?: number } = {}): Promise<Renewed> {
    return this.#renewUntil(resource, leaseId, options.ttlMs, now() + this.callTimeoutMs, this.attemptTimeoutMs);
  }

  async #renewUntil(
    resource: string,
    leaseId: string,
    ttlMs: number | undefined,
    deadline: number,
    attemptTimeoutMs: number,
  ): Promise<Renewed> {
    checkResource(resource);
    const ttl = checkMs(ttlMs, 'ttlMs');
    const answered = await this.#call(
      methods.renew,
      { resource, leaseId, leaseTtlMs: ttl },
      { op: 'renew', deadline, attemptTimeoutMs, resource, leaseId },
    );
    return {
      ttlMs: grantedTtlMs(answered.value.leaseTtlMs, ttl || undefined),
      sentAt: answered.sent,
      expiresAtUnixMs: Number(answered.value.expiresAtUnixMs),
    };
  }

  /**
   * Gives `leaseId` up. False when it was not the current lease (nothing released); a release
   * retried after an unanswered attempt may also answer false because that attempt released it:
   * {@link Client.releaseOutcome} tells the two apart.
   */
  async release(resource: string, leaseId: string): Promise<boolean> {
    return (await this.releaseOutcome(resource, leaseId)) === 'released';
  }

  /**
   * Gives `leaseId` up and says what happened: `released`, `not_current` (nothing released), or
   * `not_current_after_retry` (a retry found it not current after an attempt that went
   * unanswered and may have released it; rule 14).
   */
  releaseOutcome(resource: string, leaseId: string): Promise<ReleaseOutcome> {
    return this.#releaseUntil(resource, leaseId, now() + this.callTimeoutMs);
  }

  async #releaseUntil(resource: string, leaseId: string, deadline: number): Promise<ReleaseOutcome> {
    checkResource(resource);
    const answered = await this.#call(
      methods.release,
      { resource, leaseId },
      { op: 'release', deadline, attemptTimeoutMs: this.attemptTimeoutMs, resource, leaseId },
    );
    if (answered.value.released) return 'released';
    // firstSent is earlier than sent only after an unanswered attempt, which may have released it.
    return answered.firstSent < answered.sent ? 'not_current_after_retry' : 'not_current';
  }

  /** The linearizable state of `resource`. Never the lease id. */
  async describe(resource: string): Promise<Description> {
    checkResource(resource);
    const { value } = await this.#call(
      methods.describe,
      { resource },
      { op: 'describe', deadline: now() + this.callTimeoutMs, attemptTimeoutMs: this.attemptTimeoutMs, resource },
    );
    return {
      held: value.held,
      holder: value.holder,
      fencingToken: BigInt(value.fencingToken),
      expiresAtUnixMs: Number(value.expiresAtUnixMs),
      waiters: value.waiters,
    };
  }

  /** Status of the first node that answers (not necessarily the leader). */
  async status(): Promise<ClusterStatus> {
    const { value } = await this.#call(
      methods.status,
      {},
      { op: 'status', deadline: now() + this.callTimeoutMs, attemptTimeoutMs: this.attemptTimeoutMs },
    );
    const hot = (list: typeof value.hotByAcquires): HotResource[] =>
      list.map((h) => ({ resource: h.resource, acquires: Number(h.acquires), waiters: h.waiters }));
    return {
      nodeId: Number(value.nodeId),
      leaderId: Number(value.leaderId),
      term: Number(value.term),
      commitIndex: Number(value.commitIndex),
      appliedIndex: Number(value.appliedIndex),
      members: value.members.map((m) => ({ id: Number(m.id), address: m.address })),
      activeLocks: Number(value.activeLocks),
      waiters: Number(value.waiters),
      role: value.role,
      lag: Number(value.lag),
      hotByAcquires: hot(value.hotByAcquires),
      hotByWaiters: hot(value.hotByWaiters),
    };
  }

  /**
   * Acquires `resource` and returns a {@link Lease} that renews itself until it is released
   * (`release()`, the end of an `await using` block) or lost. If the acquire took so long that
   * less than half the ttl is left before its local deadline, the lease is renewed once before it
   * is handed out, so work never starts on a lease about to be declared lost (rule 10).
   */
  async lock(resource: string, options: AcquireOptions = {}): Promise<Lease> {
    const started = now();
    const budget = options.timeoutMs ?? (options.waitMs ?? 0) + this.callTimeoutMs;
    const grant = await this.acquire(resource, options);
    const margin = this.safetyMarginMs(grant.ttlMs);
    const t = now();
    let validFrom = grant.sentAt;
    let ttlMs = grant.ttlMs;
    if (grant.localDeadline(margin) < t + grant.ttlMs / 2) {
      const deadline = Math.max(started + budget, t + this.attemptTimeoutMs);
      try {
        const renewed = await this.#renewUntil(resource, grant.leaseId, undefined, deadline, this.attemptTimeoutMs);
        validFrom = renewed.sentAt;
        ttlMs = renewed.ttlMs;
      } catch (e) {
        let released: boolean | undefined;
        // Nothing to release when the renewal proved the lease not current.
        if (!(e instanceof LeaseNotCurrentError)) {
          try {
            released = (await this.#releaseUntil(resource, grant.leaseId, now() + this.attemptTimeoutMs)) === 'released';
          } catch {
            // It expires after its ttl.
          }
        }
        // The lease was granted: never report the renewal's "not done" (rule 10).
        if (e instanceof LockdError) {
          throw handoutRenewalFailed(resource, grant.requestId, grant.fencingToken, e, released);
        }
        throw e;
      }
    }
    const owner: LeaseOwner = {
      attemptTimeoutMs: this.attemptTimeoutMs,
      renewUntil: (deadline, attemptTimeoutMs) =>
        this.#renewUntil(resource, grant.leaseId, undefined, deadline, attemptTimeoutMs),
      release: () => this.release(resource, grant.leaseId),
    };
    return new Lease(owner, grant, validFrom, ttlMs, margin);
  }

  /**
   * `lock()`, then `fn(lease)`, then release, also when `fn` throws: for code that cannot use
   * `await using` (plain JavaScript on Node 20). The result is `fn`'s.
   */
  async withLock<T>(resource: string, options: AcquireOptions, fn: (lease: Lease) => Promise<T> | T): Promise<T> {
    const lease = await this.lock(resource, options);
    try {
      return await fn(lease);
    } finally {
      await lease[Symbol.asyncDispose]();
    }
  }
}
