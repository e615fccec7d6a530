/**
 * The zombie story end to end: a holder paused (SIGSTOP) past its ttl after it checked its lease
 * and prepared a write; a newer holder writes; the resumed zombie's write is refused by
 * fence-proxy (HTTP 412, Postgres 55P03) and never reaches the upstream, and the helpers refuse
 * to fence with its lost lease at all. Also the README's example, run as a program.
 */

import assert from 'node:assert/strict';
import { execFile, spawnSync } from 'node:child_process';
import { randomBytes } from 'node:crypto';
import { readFileSync } from 'node:fs';
import { join } from 'node:path';
import { test } from 'node:test';
import { promisify } from 'node:util';

import pg from 'pg';

import { fenceOptions, setFence, withFence } from '@lockd/client';

import {
  binary,
  exited,
  freePort,
  Lines,
  nodeChild,
  PACKAGE_DIR,
  PG_URL,
  Proc,
  randomLoopbackIp,
  unique,
  waitTcp,
} from './support/procs.js';
import { HttpProxy } from './support/upstream.js';
import { useCluster } from './support/use-cluster.js';

const lockd = useCluster();

/** Runs the zombie child up to "checked", pauses it, lets `newer` run, resumes it. */
async function zombie(
  env: Record<string, string>,
  newer: () => Promise<void>,
): Promise<{ out: Lines; oldToken: bigint }> {
  const child = nodeChild('zombie-child.js', { ENDPOINTS: lockd.cluster.endpoints.join(','), ...env });
  const out = new Lines(child);
  try {
    const oldToken = BigInt((await out.waitFor('checked'))[1]!);
    child.kill('SIGSTOP');
    await newer();
    child.kill('SIGCONT');
    child.stdin!.end('go\n');
    assert.equal(await exited(child, 20_000), 0, `${out.lines.join('\n')}\n${out.stderr}`);
    return { out, oldToken };
  } finally {
    if (child.exitCode === null && child.signalCode === null) {
      child.kill('SIGCONT');
      child.kill('SIGKILL');
    }
  }
}

test('HTTP: the zombie write is refused by fence-proxy', { timeout: 60_000 }, async () => {
  const proxy = await HttpProxy.start(lockd.cluster.dir);
  try {
    const res = unique('node-zombie');
    const url = `${proxy.url}/${res}`;
    let newerToken = 0n;
    const { out, oldToken } = await zombie({ MODE: 'http', RESOURCE: res, TARGET_URL: url }, async () => {
      // The paused holder's lease expires; B gets the lock with a larger token and writes.
      await using b = await lockd.client.lock(res, { ttlMs: 5000, waitMs: 5000 });
      newerToken = b.fencingToken;
      const r = await fetch(url, withFence(b, { method: 'PUT', body: 'from B' }));
      assert.equal(r.status, 200, await r.text());
    });
    assert.ok(newerToken > oldToken);
    assert.deepEqual(await out.waitFor('wrote'), ['wrote', '200']);
    assert.deepEqual(await out.waitFor('stale'), ['stale', '412', 'stale-fencing-token', String(oldToken), String(newerToken)]);
    const [, loss] = await out.waitFor('refused-locally');
    assert.ok(loss === 'deadline_passed' || loss === 'not_current', loss);
    const writes = proxy.upstream.writes();
    assert.deepEqual(writes.map((w) => w.body), ['from A', 'from B']);
    const a = writes[0]!.headers;
    assert.deepEqual([a['lock-resource'], a['fencing-token']], [res, String(oldToken)]);
    assert.ok(a['lock-sequencer'] && Buffer.from(a['lock-sequencer'], 'base64').length > 0);
  } finally {
    await proxy.stop();
  }
});

const PG_FENCE_TABLE = 'public.lockd_fence_nodeclient';

async function pgReachable(): Promise<string | undefined> {
  const c = new pg.Client({ connectionString: PG_URL, connectionTimeoutMillis: 3000 });
  try {
    await c.connect();
    return undefined;
  } catch (e) {
    return (e as Error).message;
  } finally {
    await c.end().catch(() => {});
  }
}

test('Postgres: the zombie transaction is refused by fence-proxy (55P03)', { timeout: 90_000 }, async (t) => {
  const why = await pgReachable();
  if (why !== undefined) {
    t.skip(`Postgres at ${PG_URL}: ${why}`);
    return;
  }
  // A fence table of this suite's own, so that its guard never replaces the one other suites
  // installed for public.lockd_fence (init is CREATE OR REPLACE).
  const init = spawnSync(binary('fence-proxy'), ['postgres', 'init', '--upstream', PG_URL, '--fence-table', PG_FENCE_TABLE], {
    encoding: 'utf8',
    timeout: 60_000,
  });
  assert.equal(init.status, 0, init.stderr);
  const ip = randomLoopbackIp();
  const port = await freePort(ip);
  const proxyProc = new Proc(
    'fence-proxy-pg',
    [binary('fence-proxy'), 'postgres', '--listen', `${ip}:${port}`, '--upstream', PG_URL, '--fence-table', PG_FENCE_TABLE],
    lockd.cluster.dir,
  );
  const proxyUrl = `postgres://postgres@${ip}:${port}/test`;
  const table = `node_orders_${randomBytes(4).toString('hex')}`;
  const direct = new pg.Client({ connectionString: PG_URL });
  await direct.connect();
  try {
    await waitTcp(ip, port, proxyProc);
    await direct.query(`CREATE TABLE ${table} (id serial primary key, by text not null)`);
    const res = unique('node-pg');
    let newerToken = 0n;
    const { out, oldToken } = await zombie({ MODE: 'pg', RESOURCE: res, TARGET_URL: proxyUrl, TABLE: table }, async () => {
      await using b = await lockd.client.lock(res, { ttlMs: 5000, waitMs: 5000 });
      newerToken = b.fencingToken;
      // B fences at connection start-up...
      const b1 = new pg.Client({ connectionString: proxyUrl, options: fenceOptions(b) });
      await b1.connect();
      await b1.query(`INSERT INTO ${table} (by) VALUES ('B')`);
      await b1.end();
      // ...and with SET.
      const b2 = new pg.Client({ connectionString: proxyUrl });
      await b2.connect();
      await setFence(b2, b);
      await b2.query('BEGIN');
      await b2.query(`INSERT INTO ${table} (by) VALUES ('B, set')`);
      await b2.query('COMMIT');
      await b2.end();
    });
    assert.ok(newerToken > oldToken);
    await out.waitFor('wrote');
    assert.deepEqual(await out.waitFor('refused'), ['refused', '55P03', 'true']);
    assert.deepEqual(await out.waitFor('select-refused'), ['select-refused', '55P03']);
    assert.deepEqual(await out.waitFor('usable'), ['usable', '1']);
    const [, loss] = await out.waitFor('refused-locally');
    assert.ok(loss === 'deadline_passed' || loss === 'not_current', loss);
    const rows = await direct.query(`SELECT by FROM ${table} ORDER BY id`);
    assert.deepEqual(
      rows.rows.map((r: { by: string }) => r.by),
      ['A', 'B', 'B, set'],
    );
    const fence = await direct.query(`SELECT token FROM ${PG_FENCE_TABLE} WHERE resource = $1`, [res]);
    assert.equal(BigInt(fence.rows[0].token), newerToken);
  } finally {
    await direct.query(`DROP TABLE IF EXISTS ${table}`).catch(() => {});
    await direct.end();
    await proxyProc.stop();
  }
});

test('the README example takes a lock and writes through the proxy', { timeout: 60_000 }, async () => {
  const proxy = await HttpProxy.start(lockd.cluster.dir);
  try {
    const example = join(PACKAGE_DIR, 'examples', 'fenced-write.mjs');
    assert.ok(readFileSync(example, 'utf8').trim().split('\n').length <= 12);
    const { stdout } = await promisify(execFile)(process.execPath, [example], {
      env: { ...process.env, LOCKD_ENDPOINTS: lockd.cluster.endpoints.join(','), FENCE_PROXY_URL: proxy.url },
      timeout: 30_000,
    });
    assert.match(stdout, /written with fencing token \d+/);
    const token = stdout.trim().split(' ').at(-1);
    const writes = proxy.upstream.writes();
    assert.equal(writes.at(-1)?.path, '/orders/42');
    assert.equal(writes.at(-1)?.headers['fencing-token'], token);
    assert.equal((await lockd.client.describe('orders/42')).held, false, 'the example releases when done');
  } finally {
    await proxy.stop();
  }
});
