/**
 * Carrying a lease's fence to storage behind fence-proxy (docs/fence-proxy.md,
 * docs/fence-proxy-postgres.md), rule 13 of docs/clients.md.
 *
 * HTTP: `withFence(lease, init)` for `fetch` checks the lease (throwing instead of sending a write
 * on a lost lease) and adds `Lock-Resource`, `Fencing-Token` and `Lock-Sequencer` (base64);
 * `fenceHeaders(lease)` gives the headers alone. Postgres (node-postgres): `setFence(client,
 * lease)` runs `SET lockd.fence = '<resource>:<token>'`; `fenceOptions(lease)` gives the
 * `options` of a new connection instead.
 *
 * The local check cannot help a process paused between it and the write: only the proxy's fencing
 * check catches that, which is why every write carries the token.
 */

import { InvalidArgumentError } from './errors.js';

/** What the helpers need of a lease (a `Lease`, or a `Grant` plus a check of your own). */
export interface Fenced {
  readonly resource: string;
  readonly fencingToken: bigint;
  readonly sequencer: Uint8Array;
}

/** A fenced lease that can also say it is lost. */
export interface CheckedFence extends Fenced {
  check(): void;
  readonly signal?: AbortSignal;
}

export const HEADER_RESOURCE = 'Lock-Resource';
export const HEADER_TOKEN = 'Fencing-Token';
export const HEADER_SEQUENCER = 'Lock-Sequencer';

function base64(bytes: Uint8Array): string {
  return Buffer.from(bytes.buffer, bytes.byteOffset, bytes.byteLength).toString('base64');
}

/** The fence-proxy headers of `lease` (no check: see {@link withFence} for that). */
export function fenceHeaders(lease: Fenced): Record<string, string> {
  const headers: Record<string, string> = {
    [HEADER_RESOURCE]: lease.resource,
    [HEADER_TOKEN]: lease.fencingToken.toString(),
  };
  if (lease.sequencer.byteLength > 0) headers[HEADER_SEQUENCER] = base64(lease.sequencer);
  return headers;
}

/**
 * `fetch(url, withFence(lease, { method: 'PUT', body }))`: throws `LeaseLostError` once the lease
 * may be gone, else returns `init` with the fence headers added and, for a `Lease`, its signal
 * joined to `init.signal` (the request is aborted when the lease is lost; a write already sent
 * may still have been applied, with a token that was valid when it was sent).
 */
export function withFence(lease: CheckedFence, init: RequestInit = {}): RequestInit {
  lease.check();
  const headers = new Headers(init.headers);
  for (const [k, v] of Object.entries(fenceHeaders(lease))) headers.set(k, v);
  let signal = init.signal ?? undefined;
  if (lease.signal !== undefined) signal = signal ? AbortSignal.any([signal, lease.signal]) : lease.signal;
  return { ...init, headers, ...(signal ? { signal } : {}) };
}

/**
 * `<resource>:<token>`, or with `signed` `<resource>:<sequencer base64>` for a proxy started with
 * `--verify-key`.
 */
export function fenceValue(lease: Fenced, options: { signed?: boolean } = {}): string {
  if (options.signed) {
    if (lease.sequencer.byteLength === 0) {
      throw new InvalidArgumentError(
        `lease of ${JSON.stringify(lease.resource)} carries no sequencer (lockd without signing)`,
        { resource: lease.resource },
      );
    }
    return `${lease.resource}:${base64(lease.sequencer)}`;
  }
  return `${lease.resource}:${lease.fencingToken}`;
}

/**
 * The libpq `options` that set the fence at connection start-up:
 * `new pg.Client({ connectionString, options: fenceOptions(lease) })`. Postgres splits options at
 * spaces, so spaces and backslashes are escaped with a backslash.
 */
export function fenceOptions(lease: Fenced, options: { signed?: boolean } = {}): string {
  return `-c lockd.fence=${fenceValue(lease, options).replace(/\\/g, '\\\\').replace(/ /g, '\\ ')}`;
}

/**
 * A string literal Postgres reads back as `value` whatever `standard_conforming_strings` says:
 * quotes doubled, and with a backslash present the escape form `E'...'` with backslashes doubled.
 */
export function quoteLiteral(value: string): string {
  if (value.includes('\0')) throw new InvalidArgumentError('a Postgres string cannot hold a NUL character');
  const body = value.replace(/'/g, "''");
  return value.includes('\\') ? `E'${body.replace(/\\/g, '\\\\')}'` : `'${body}'`;
}

/** The part of a node-postgres `Client` (or `PoolClient`) the helpers use. */
export interface PgQueryable {
  query(text: string): Promise<unknown>;
  /** node-postgres >= 8.12: `I` idle, `T` in a transaction, `E` in a failed transaction. */
  getTransactionStatus?(): string | null;
}

function outsideTransaction(conn: PgQueryable, what: string): void {
  const status = conn.getTransactionStatus?.();
  if (status === 'T' || status === 'E') {
    throw new InvalidArgumentError(`${what}: the connection is inside a transaction; commit or roll back first`);
  }
}

/**
 * Sets the session's fence on a node-postgres connection after checking the lease: `SET
 * lockd.fence = '<resource>:<token>'` (with `signed`, the sequencer in place of the token), sent
 * outside a transaction so that it stays set for the session. A plain SET (not `set_config`)
 * because a proxy with `--verify-key` verifies the values it sees set that way. With a pool, reset
 * or discard the connection before it goes back.
 */
export async function setFence(conn: PgQueryable, lease: CheckedFence, options: { signed?: boolean } = {}): Promise<void> {
  lease.check();
  outsideTransaction(conn, 'setFence');
  await conn.query(`SET lockd.fence = ${quoteLiteral(fenceValue(lease, options))}`);
}

/** `RESET lockd.fence`: later transactions of the session carry no fence. */
export async function resetFence(conn: PgQueryable): Promise<void> {
  outsideTransaction(conn, 'resetFence');
  await conn.query('RESET lockd.fence');
}
