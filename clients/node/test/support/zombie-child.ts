/**
 * The zombie of the fence tests (run as its own process): takes the lock, writes through
 * fence-proxy, checks its lease and prepares the next write, then says "checked" and waits for a
 * "go" line on stdin. The test SIGSTOPs it there, lets a newer holder write, resumes it and says
 * go: the write it prepared while its lease was valid must be refused by the proxy, and the
 * helpers must refuse to fence with the lost lease at all.
 *
 * MODE=http: PUT to $TARGET_URL. MODE=pg: INSERT INTO $TABLE through the proxy at $TARGET_URL.
 */

import { once } from 'node:events';
import { createInterface } from 'node:readline';

import pg from 'pg';

import { Client, fenceHeaders, LeaseLostError, resetFence, setFence, withFence } from '@lockd/client';

const client = new Client({ endpoints: process.env.ENDPOINTS!.split(',') });
const lease = await client.lock(process.env.RESOURCE!, { ttlMs: 1000 });
const url = process.env.TARGET_URL!;
const lines = createInterface({ input: process.stdin });
const go = once(lines, 'line');

function refusedLocally(e: unknown): void {
  if (!(e instanceof LeaseLostError)) throw e;
  console.log('refused-locally', e.loss);
}

if (process.env.MODE === 'http') {
  const first = await fetch(url, withFence(lease, { method: 'PUT', body: 'from A' }));
  console.log('wrote', first.status);
  lease.check();
  const headers = fenceHeaders(lease); // the next write, prepared while the lease is valid
  console.log('checked', lease.fencingToken.toString());
  await go;
  const stale = await fetch(url, { method: 'PUT', body: 'from A, stale', headers });
  const body = (await stale.json()) as { token: number; highest: number };
  console.log('stale', stale.status, stale.headers.get('fence-proxy-error'), body.token, body.highest);
  try {
    withFence(lease, { method: 'PUT', body: 'from A again' });
    console.log('sent-again');
  } catch (e) {
    refusedLocally(e);
  }
} else {
  const table = process.env.TABLE!;
  const conn = new pg.Client({ connectionString: url });
  await conn.connect();
  await setFence(conn, lease);
  await conn.query('BEGIN');
  await conn.query(`INSERT INTO ${table} (by) VALUES ('A')`);
  await conn.query('COMMIT');
  console.log('wrote');
  lease.check();
  console.log('checked', lease.fencingToken.toString());
  await go;
  try {
    await conn.query('BEGIN');
    await conn.query(`INSERT INTO ${table} (by) VALUES ('A, stale')`);
    await conn.query('COMMIT');
    console.log('committed');
  } catch (e) {
    const err = e as { code?: string; message: string };
    console.log('refused', err.code, err.message.includes(process.env.RESOURCE!));
    await conn.query('ROLLBACK').catch(() => {});
  }
  // A fenced session's transactions all carry the fence, reads included.
  await conn.query('SELECT 1').then(
    () => console.log('select-passed'),
    (e: { code?: string }) => console.log('select-refused', e.code),
  );
  // The session stays usable once its fence is cleared; the lost lease cannot set it again.
  await resetFence(conn);
  const one = await conn.query('SELECT 1 AS one');
  console.log('usable', one.rows[0].one);
  await setFence(conn, lease).then(() => console.log('fenced-again'), refusedLocally);
  await conn.end();
}
lines.close();
client.close();
