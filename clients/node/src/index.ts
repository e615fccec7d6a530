/**
 * @lockd/client: the Node client of lockd.
 *
 * ```ts
 * import { Client, withFence } from '@lockd/client';
 *
 * const client = new Client({ endpoints: ['10.0.0.1:7001', '10.0.0.2:7001', '10.0.0.3:7001'] });
 * await using lease = await client.lock('orders/42', { ttlMs: 30_000, waitMs: 10_000 });
 * await fetch(url, withFence(lease, { method: 'PUT', body })); // checks, adds the fence headers
 * // leaving the block fires lease.signal, stops renewing and releases
 * ```
 *
 * Semantics (retries with one request id, endpoint rotation, deadlines from send time on a
 * monotonic clock, renewal at ttl/3 with jitter, the loss signal) follow the numbered rules of
 * docs/clients.md, shared with the Rust and Python clients. It does not re-acquire a lost lease,
 * and it does not talk Raft: any lockd node forwards to the leader.
 */

export {
  Client,
  Grant,
  type AcquireOptions,
  type ClientOptions,
  type ClusterStatus,
  type Description,
  type HotResource,
  type ReleaseOutcome,
  type Renewed,
  type TlsOptions,
} from './client.js';
export { Lease } from './lease.js';
export {
  HeldError,
  InvalidArgumentError,
  LeaseLostError,
  LeaseNotCurrentError,
  LimitReachedError,
  LockdError,
  OutcomeUnknownError,
  PermissionDeniedError,
  ProtocolError,
  UnauthenticatedError,
  UnavailableError,
  WaitTimedOutError,
  type ErrorFields,
  type LossReason,
  type Outcome,
} from './errors.js';
export {
  fenceHeaders,
  fenceOptions,
  fenceValue,
  HEADER_RESOURCE,
  HEADER_SEQUENCER,
  HEADER_TOKEN,
  quoteLiteral,
  resetFence,
  setFence,
  withFence,
  type CheckedFence,
  type Fenced,
  type PgQueryable,
} from './fence.js';
export { newRequestId } from './core.js';
