/**
 * A held lease that renews itself every ttl/3 (with jitter) and says when it can no longer be
 * trusted: `signal` (an AbortSignal), `lost`, `check()`. "Rule N" refers to docs/clients.md.
 */

import { inspect } from 'node:util';

import type { Grant, Renewed } from './client.js';
import { humanize, nextRenewal, now, RENEWALS_PER_TTL } from './core.js';
import {
  LeaseLostError,
  LeaseNotCurrentError,
  LockdError,
  type LossReason,
  OutcomeUnknownError,
  UnavailableError,
} from './errors.js';

/** What a lease needs of its client. */
export interface LeaseOwner {
  attemptTimeoutMs: number;
  /** Renew with every attempt ending by `deadline`, each at most `attemptTimeoutMs`. */
  renewUntil(deadline: number, attemptTimeoutMs: number): Promise<Renewed>;
  release(): Promise<boolean>;
}

/**
 * A lease that renews itself in the background until released or lost. It never re-acquires on
 * its own: after a loss, call `client.lock()` again for a new lease with a larger token.
 *
 * Before each protected write call {@link Lease.check} (or test {@link Lease.lost}) and send
 * {@link Lease.fencingToken} with the write, so that the storage (or fence-proxy) refuses it
 * should this process have been paused in between.
 */
export class Lease implements AsyncDisposable {
  readonly grant: Grant;
  /** Subtracted from every deadline (rule 8). */
  readonly marginMs: number;
  /** Renewals that succeeded. */
  renewals = 0;

  readonly #owner: LeaseOwner;
  readonly #controller = new AbortController();
  /** The monotonic instant until which the lease may be trusted; only ever moves forward. */
  #deadline: number;
  #loss: LossReason | undefined;
  #lossMessage = '';
  #stopped = false;
  #released = false;
  #wake: (() => void) | undefined;
  #deadlineTimer: NodeJS.Timeout | undefined;

  constructor(owner: LeaseOwner, grant: Grant, validFrom: number, ttlMs: number, marginMs: number) {
    this.#owner = owner;
    this.grant = grant;
    this.marginMs = marginMs;
    this.#deadline = validFrom + Math.max(ttlMs - marginMs, 0);
    this.#armDeadline();
    void this.#renewLoop(validFrom, ttlMs);
  }

  get resource(): string {
    return this.grant.resource;
  }
  /** The secret that renews and releases this lease. Never log it. */
  get leaseId(): string {
    return this.grant.leaseId;
  }
  /** Attach to every write; the storage refuses tokens lower than one it has seen. */
  get fencingToken(): bigint {
    return this.grant.fencingToken;
  }
  /** The grant signed by the cluster (`Lock-Sequencer` in base64; `lockd.fence` when signed). */
  get sequencer(): Buffer {
    return this.grant.sequencer;
  }
  get requestId(): string {
    return this.grant.requestId;
  }
  get ttlMs(): number {
    return this.grant.ttlMs;
  }

  /** The current local deadline on the monotonic clock (`performance.now()`). */
  deadline(): number {
    return this.#deadline;
  }

  /**
   * Aborted, once and for good, when the lease can no longer be trusted; its `reason` is a
   * {@link LeaseLostError}. Pass it to work that must stop (fetch, streams, timers). Right after
   * a process pause the signal fires only when the event loop runs its timers: before a write,
   * use {@link Lease.check} or {@link Lease.lost}, which compare the deadline with the clock.
   */
  get signal(): AbortSignal {
    return this.#controller.signal;
  }

  /**
   * True once the lease may be gone. Also compares the local deadline with the clock (rule 12),
   * so code that runs right after a process pause sees the loss before any timer has run.
   */
  get lost(): boolean {
    if (this.#loss !== undefined) return true;
    if (now() >= this.#deadline) {
      this.#fire('deadline_passed', 'no renewal succeeded before the local deadline; the lease may have expired');
      return true;
    }
    return false;
  }

  /** Why the lease was lost, once it is. */
  get loss(): LossReason | undefined {
    void this.lost;
    return this.#loss;
  }

  /** Returns while the lease is held; throws {@link LeaseLostError} once it may be gone. */
  check(): void {
    if (this.lost) throw this.#controller.signal.reason as LeaseLostError;
  }

  /**
   * Rule 14: fires the signal (so workers stop before the lock is given up), stops renewing and
   * releases. False when the lease was no longer current, or already released by an earlier
   * call; after a call that threw, another call tries again.
   */
  async release(): Promise<boolean> {
    if (this.#released) return false;
    this.#stop();
    this.#fire('released', 'lease released by its owner');
    const released = await this.#owner.release();
    this.#released = true;
    return released;
  }

  /**
   * The end of an `await using` block: release. A failed release is not thrown over the block's
   * own outcome (the lease expires after its ttl); it is reported as a process warning.
   */
  async [Symbol.asyncDispose](): Promise<void> {
    try {
      await this.release();
    } catch (e) {
      if (!(e instanceof LockdError)) throw e;
      process.emitWarning(`lockd: release of ${JSON.stringify(this.resource)} failed (it expires after its ttl): ${e.message}`, {
        code: 'LOCKD_RELEASE_FAILED',
      });
    }
  }

  [inspect.custom](): string {
    return `Lease { resource: ${JSON.stringify(this.resource)}, fencingToken: ${this.fencingToken}n, lost: ${this.lost} }`;
  }

  /** Rule 12: the loss is final; the first reason is kept. */
  #fire(reason: LossReason, message: string): void {
    if (this.#loss !== undefined) return;
    this.#loss = reason;
    this.#lossMessage = message;
    clearTimeout(this.#deadlineTimer);
    this.#controller.abort(
      new LeaseLostError(
        `lease of ${JSON.stringify(this.resource)} (token ${this.fencingToken}) lost: ${this.#lossMessage}`,
        reason,
        { resource: this.resource },
      ),
    );
  }

  #stop(): void {
    this.#stopped = true;
    clearTimeout(this.#deadlineTimer);
    this.#wake?.();
  }

  /** Fires the signal when the deadline passes, should no renewal move it first. */
  #armDeadline(): void {
    clearTimeout(this.#deadlineTimer);
    if (this.#loss !== undefined || this.#stopped) return;
    const left = this.#deadline - now();
    // Timers neither keep the process alive (an abandoned lease just expires) nor fire early:
    // `lost` re-arms for what is left if the timer ran ahead of performance.now().
    this.#deadlineTimer = setTimeout(() => {
      if (!this.lost) this.#armDeadline();
    }, Math.max(Math.ceil(left), 0));
    this.#deadlineTimer.unref();
  }

  /** Sleeps until `ms` have passed or the lease is stopped. */
  #sleep(ms: number): Promise<void> {
    return new Promise((resolve) => {
      const timer = setTimeout(done, Math.max(ms, 0));
      timer.unref();
      this.#wake = done;
      function done(): void {
        clearTimeout(timer);
        resolve();
      }
    });
  }

  /** Rules 9 and 11: renew every ttl/3 after the last successful send, until stopped or lost. */
  async #renewLoop(lastSent: number, ttlMs: number): Promise<void> {
    try {
      for (;;) {
        const interval = ttlMs / RENEWALS_PER_TTL;
        const due = nextRenewal(lastSent, interval);
        const deadline = this.#deadline;
        await this.#sleep(Math.min(due, deadline) - now());
        if (this.#stopped || this.lost) return; // `lost` checks the deadline too
        if (now() < due) continue;
        // Each attempt may take at most one renewal interval, so a stuck node leaves time to try
        // the others before the deadline.
        const attemptTimeout = Math.min(interval, this.#owner.attemptTimeoutMs);
        let renewed: Renewed;
        try {
          renewed = await this.#owner.renewUntil(deadline, attemptTimeout);
        } catch (e) {
          if (e instanceof LeaseNotCurrentError) {
            this.#fire('not_current', `lease is not current any more: ${e.message}`);
          } else if (e instanceof OutcomeUnknownError || e instanceof UnavailableError) {
            this.#fire('deadline_passed', `no renewal succeeded before the local deadline: ${e.message}`);
          } else if (e instanceof LockdError) {
            this.#fire('renew_refused', `renewal refused: ${e.message}`);
          } else {
            throw e;
          }
          return;
        }
        // A renewal answered after the deadline does not revive the lease.
        if (this.#stopped || this.lost) return;
        this.#deadline = Math.max(this.#deadline, renewed.sentAt + Math.max(renewed.ttlMs - this.marginMs, 0));
        this.#armDeadline();
        this.renewals += 1;
        lastSent = renewed.sentAt;
        ttlMs = renewed.ttlMs;
      }
    } catch (e) {
      // Never stop silently: a renewer that stopped must say so.
      this.#fire('renew_refused', `renewal failed: ${(e as Error)?.message ?? String(e)}`);
    }
  }

  /** For messages: how long until the deadline. */
  toString(): string {
    const left = this.#deadline - now();
    return `lease of ${JSON.stringify(this.resource)} (token ${this.fencingToken}, ${this.lost ? `lost: ${this.#loss}` : `valid for ${humanize(left)}`})`;
  }
}
