/**
 * A busy holder process SIGSTOPped past its ttl, then resumed: no write starts after the pause
 * (`lease.lost` compares the deadline with the clock itself, before any timer of the resumed
 * process has run), the loss says the deadline passed, the signal has fired, and the new holder
 * has a larger token.
 */

import assert from 'node:assert/strict';
import { test } from 'node:test';
import { setTimeout as sleep } from 'node:timers/promises';

import { exited, Lines, nodeChild, unique } from './support/procs.js';
import { useCluster } from './support/use-cluster.js';

const lockd = useCluster();

test('a paused holder sees its loss before it can write', { timeout: 60_000 }, async () => {
  const res = unique('node-paused');
  const child = nodeChild('paused-child.js', { ENDPOINTS: lockd.cluster.endpoints.join(','), RESOURCE: res });
  const out = new Lines(child);
  try {
    const oldToken = BigInt((await out.waitFor('token'))[1]!);
    await out.waitFor('writing');
    child.kill('SIGSTOP');
    // Another client gets the lock once the paused holder's lease expired.
    const newer = await lockd.client.acquire(res, { ttlMs: 5000, waitMs: 5000 });
    assert.ok(newer.fencingToken > oldToken);
    // The holder's last renewal may have been up to ttl/3 before the stop: stay stopped long
    // enough that the pause is longer than the whole ttl.
    await sleep(1000);
    child.kill('SIGCONT');
    assert.equal(await exited(child, 10_000), 0, out.stderr);
    const [, reason, gap, late, signal] = await out.waitFor('lost');
    assert.ok(Number(gap!.split('=')[1]) >= 2000, `the pause did not show: ${out.lines.join('\n')}`);
    assert.equal(late, 'late=0', `writes after the pause: ${out.lines.join('\n')}`);
    assert.equal(reason, 'deadline_passed');
    assert.equal(signal, 'signal=true', 'the signal fired when the loss was seen');
    assert.deepEqual(await out.waitFor('check-raised'), ['check-raised', 'deadline_passed', 'true']);
    assert.equal((await lockd.client.describe(res)).fencingToken, newer.fencingToken);
    await lockd.client.release(res, newer.leaseId);
  } finally {
    if (child.exitCode === null && child.signalCode === null) {
      child.kill('SIGCONT');
      child.kill('SIGKILL');
    }
  }
});
