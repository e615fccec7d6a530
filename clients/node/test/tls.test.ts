/**
 * Over TLS with the cluster's CA. A client that does not trust it (system roots) or speaks
 * plaintext never gets a request through, and knows that nothing was done.
 */

import assert from 'node:assert/strict';
import { readFileSync } from 'node:fs';
import { test } from 'node:test';

import { Client, InvalidArgumentError, UnavailableError } from '@lockd/client';

import { unique } from './support/procs.js';
import { useCluster } from './support/use-cluster.js';

const lockd = useCluster({ tls: true });

test('TLS with the cluster CA; untrusting and plaintext clients get nothing through', { timeout: 60_000 }, async () => {
  const res = unique('node-tls');
  // The CA as a file path, and as PEM contents.
  for (const ca of [lockd.cluster.ca!, readFileSync(lockd.cluster.ca!)]) {
    const c = new Client({ endpoints: lockd.cluster.endpoints.map((e) => `https://${e}`), tls: { ca } });
    try {
      await using lease = await c.lock(res, { ttlMs: 2000 });
      assert.equal((await c.describe(res)).fencingToken, lease.fencingToken);
    } finally {
      c.close();
    }
  }
  const untrusting = new Client({ endpoints: lockd.cluster.endpoints, tls: true, callTimeoutMs: 1000 });
  await assert.rejects(untrusting.describe(res), (e: unknown) => e instanceof UnavailableError && e.definitelyNotDone);
  untrusting.close();
  const plain = new Client({ endpoints: lockd.cluster.endpoints, callTimeoutMs: 1000 });
  await assert.rejects(plain.acquire(res), (e: unknown) => e instanceof UnavailableError && e.definitelyNotDone);
  plain.close();
  assert.throws(() => new Client({ endpoints: [`http://${lockd.cluster.addr(1)}`], tls: true }), InvalidArgumentError);
  assert.throws(() => new Client({ endpoints: lockd.cluster.endpoints, tls: { cert: lockd.cluster.ca! } }), InvalidArgumentError);
  assert.throws(() => new Client({ endpoints: lockd.cluster.endpoints, tls: { ca: '/nonexistent/ca.pem' } }), /nonexistent/);
});
