/**
 * Acquire, renew, release, describe and status against a real three-node cluster, the errors a
 * caller branches on, the lease's renewal and loss signal, and the outcome read from lockd's
 * ErrorInfo (a fake server answering as told).
 */

import assert from 'node:assert/strict';
import { describe, test } from 'node:test';
import { setTimeout as sleep } from 'node:timers/promises';
import { join } from 'node:path';

import grpc from '@grpc/grpc-js';
import { loadSync } from '@grpc/proto-loader';
import protobuf from 'protobufjs';

import {
  Client,
  fenceHeaders,
  fenceOptions,
  fenceValue,
  Grant,
  HeldError,
  InvalidArgumentError,
  Lease,
  LeaseLostError,
  LeaseNotCurrentError,
  LockdError,
  newRequestId,
  OutcomeUnknownError,
  quoteLiteral,
  UnavailableError,
  WaitTimedOutError,
  withFence,
} from '@lockd/client';

import { freePort, PACKAGE_DIR, unique } from './support/procs.js';
import { useCluster } from './support/use-cluster.js';

const lockd = useCluster();

describe('the RPCs against a real cluster', () => {
  test('acquire, renew, release, describe, status', async () => {
    const res = unique('node-basic');
    const grant = await lockd.client.acquire(res, { ttlMs: 5000, holder: 'node-test/basic' });
    assert.ok(grant.fencingToken > 0n && grant.leaseId.length === 32 && grant.ttlMs === 5000);
    assert.ok(grant.sequencer.length > 0, 'lockd signs every grant');
    const d = await lockd.client.describe(res);
    assert.deepEqual([d.held, d.holder, d.fencingToken], [true, 'node-test/basic', grant.fencingToken]);
    // The lease id is a secret: not in what gets logged.
    assert.ok(!JSON.stringify(grant).includes(grant.leaseId));
    const { inspect } = await import('node:util');
    assert.ok(!inspect(grant).includes(grant.leaseId));

    const renewed = await lockd.client.renew(res, grant.leaseId, { ttlMs: 7000 });
    assert.equal(renewed.ttlMs, 7000);
    assert.ok(renewed.sentAt >= grant.sentAt);

    const held = await lockd.client.acquire(res, { ttlMs: 5000 }).then(
      () => assert.fail('a held resource was granted twice'),
      (e: unknown) => e,
    );
    assert.ok(held instanceof HeldError, String(held));
    assert.equal(held.reason, 'LOCK_HELD');
    assert.equal(held.code, 'ABORTED');
    assert.ok(held.definitelyNotDone && held.message.includes(res));

    assert.equal(await lockd.client.release(res, grant.leaseId), true);
    assert.equal(await lockd.client.release(res, grant.leaseId), false);
    assert.equal((await lockd.client.describe(res)).held, false);
    await assert.rejects(lockd.client.renew(res, grant.leaseId), (e: unknown) => {
      assert.ok(e instanceof LeaseNotCurrentError);
      assert.equal(e.reason, 'LEASE_NOT_CURRENT');
      return true;
    });

    const again = await lockd.client.acquire(res, { ttlMs: 5000 });
    assert.ok(again.fencingToken > grant.fencingToken);
    await lockd.client.release(res, again.leaseId);

    const st = await lockd.client.status();
    assert.ok([1, 2, 3].includes(st.leaderId), JSON.stringify(st));
    assert.equal(st.members.length, 3);
  });

  test('the same request id returns the same lease; other arguments with it are refused', async () => {
    const res = unique('node-retry');
    const rid = newRequestId();
    const first = await lockd.client.acquire(res, { ttlMs: 5000, requestId: rid, holder: 'h' });
    const second = await lockd.client.acquire(res, { ttlMs: 5000, requestId: rid, holder: 'h' });
    assert.deepEqual([second.leaseId, second.fencingToken], [first.leaseId, first.fencingToken]);
    await assert.rejects(lockd.client.acquire(res, { ttlMs: 6000, requestId: rid, holder: 'h' }), (e: unknown) => {
      assert.ok(e instanceof InvalidArgumentError);
      assert.deepEqual([e.reason, e.code], ['INVALID_FIELD', 'INVALID_ARGUMENT']);
      return true;
    });
    // Another request id is another caller: held.
    await assert.rejects(lockd.client.acquire(res, { ttlMs: 5000, holder: 'h' }), HeldError);
    await lockd.client.release(res, first.leaseId);
  });

  test('a waiting acquire queues, times out, and gets the lock on release', async () => {
    const res = unique('node-wait');
    const holder = await lockd.client.acquire(res, { ttlMs: 5000 });
    const started = performance.now();
    await assert.rejects(lockd.client.acquire(res, { ttlMs: 5000, waitMs: 1000 }), (e: unknown) => {
      assert.ok(e instanceof WaitTimedOutError);
      assert.equal(e.reason, 'WAIT_TIMEOUT');
      assert.ok(e.definitelyNotDone);
      return true;
    });
    const took = performance.now() - started;
    assert.ok(took >= 900 && took < 4000, `took ${took} ms`);

    const waiting = lockd.client.acquire(res, { ttlMs: 5000, waitMs: 10_000 });
    await sleep(500);
    assert.equal((await lockd.client.describe(res)).waiters, 1);
    await lockd.client.release(res, holder.leaseId);
    const got = await waiting;
    assert.ok(got.fencingToken > holder.fencingToken);
    await lockd.client.release(res, got.leaseId);
  });

  test('bad arguments are refused before sending, naming the value', async () => {
    for (const bad of ['', 'a\u0007b', 'x'.repeat(257), 'lone \ud800 surrogate']) {
      await assert.rejects(lockd.client.acquire(bad), (e: unknown) => {
        assert.ok(e instanceof InvalidArgumentError && e.definitelyNotDone);
        assert.ok(e.message.includes(JSON.stringify(bad).slice(0, 20)), e.message);
        return true;
      });
    }
    // Below the 1 s policy floor: lockd says so, naming the field.
    await assert.rejects(lockd.client.acquire(unique('node-bad'), { ttlMs: 500 }), (e: unknown) => {
      assert.ok(e instanceof InvalidArgumentError);
      assert.equal(e.reason, 'INVALID_FIELD');
      assert.equal(e.metadata.field, 'lease_ttl_ms');
      return true;
    });
    await assert.rejects(lockd.client.acquire(unique('node-bad'), { ttlMs: -1 }), InvalidArgumentError);
    assert.throws(() => new Client({ endpoints: ['nohostport'] }), InvalidArgumentError);
    assert.throws(() => new Client({ endpoints: [] }), InvalidArgumentError);
    // A bearer token never goes over plaintext.
    assert.throws(() => new Client({ endpoints: ['127.0.0.1:7001'], token: 'secret' }), InvalidArgumentError);
    assert.throws(() => new Client({ endpoints: ['https://127.0.0.1:7001'] }), InvalidArgumentError);
  });
});

describe('the lease', () => {
  test('renewal keeps a lease alive past three ttls; leaving the block releases', async () => {
    const res = unique('node-lease');
    let kept: Lease;
    {
      await using lease = await lockd.client.lock(res, { ttlMs: 1000 });
      kept = lease;
      await sleep(3500);
      lease.check();
      assert.equal(lease.lost, false);
      assert.equal(lease.signal.aborted, false);
      assert.ok(lease.renewals >= 6, `only ${lease.renewals} renewals in 3.5 ttls`);
      const d = await lockd.client.describe(res);
      assert.ok(d.held && d.fencingToken === lease.fencingToken);
      await assert.rejects(lockd.client.acquire(res, { ttlMs: 1000 }), HeldError);
    }
    // Leaving the block fired the signal (workers stop) and released.
    assert.ok(kept.signal.aborted);
    assert.ok(kept.signal.reason instanceof LeaseLostError);
    assert.equal(kept.loss, 'released');
    assert.throws(() => kept.check(), (e: unknown) => e instanceof LeaseLostError && e.loss === 'released');
    assert.equal((await lockd.client.describe(res)).held, false);
    assert.equal(await kept.release(), false, 'a second release does nothing');
  });

  test('the signal fires not_current when the lease is released behind its back, and renewals stop', async () => {
    const res = unique('node-behind');
    const lease = await lockd.client.lock(res, { ttlMs: 1500 });
    const fired = new Promise<void>((done) => lease.signal.addEventListener('abort', () => done(), { once: true }));
    await lockd.client.release(res, lease.leaseId);
    await Promise.race([fired, sleep(3000).then(() => assert.fail('the signal did not fire within 3 s'))]);
    assert.equal(lease.loss, 'not_current');
    const renewals = lease.renewals;
    await sleep(1000);
    assert.equal(lease.renewals, renewals, 'a lost lease never renews again');
    assert.equal(await lease.release(), false);
  });

  test('withLock releases after the callback, also when it throws', async () => {
    const res = unique('node-withlock');
    const token = await lockd.client.withLock(res, { ttlMs: 2000 }, async (lease) => {
      assert.equal((await lockd.client.describe(res)).fencingToken, lease.fencingToken);
      return lease.fencingToken;
    });
    assert.equal((await lockd.client.describe(res)).held, false);
    let second = 0n;
    await assert.rejects(
      lockd.client.withLock(res, { ttlMs: 2000 }, (lease) => {
        second = lease.fencingToken;
        throw new Error('work failed');
      }),
      /work failed/,
    );
    assert.ok(second > token);
    assert.equal((await lockd.client.describe(res)).held, false);
  });
});

test('unreachable endpoints mean nothing was done', async () => {
  const port = await freePort('127.0.0.1');
  const c = new Client({ endpoints: [`127.0.0.1:${port}`], callTimeoutMs: 800 });
  const started = performance.now();
  await assert.rejects(c.acquire(unique('node-down')), (e: unknown) => {
    assert.ok(e instanceof UnavailableError, String(e));
    assert.ok(e.attempts >= 2 && e.definitelyNotDone);
    assert.ok(e.message.includes(String(port)), e.message);
    return true;
  });
  assert.ok(performance.now() - started < 3000);
  c.close();
});

// A fake lockd.v1.Lock that answers Acquire as told, with or without lockd's ErrorInfo.
const rpcTypes = protobuf.Root.fromJSON({
  nested: {
    Status: {
      fields: {
        code: { type: 'int32', id: 1 },
        message: { type: 'string', id: 2 },
        details: { rule: 'repeated', type: 'Any', id: 3 },
      },
    },
    Any: { fields: { typeUrl: { type: 'string', id: 1 }, value: { type: 'bytes', id: 2 } } },
    ErrorInfo: {
      fields: { reason: { type: 'string', id: 1 }, domain: { type: 'string', id: 2 } },
    },
  },
});

function statusWithReason(code: number, message: string, reason: string): grpc.Metadata {
  const info = rpcTypes.lookupType('ErrorInfo').encode({ reason, domain: 'lockd' }).finish();
  const st = rpcTypes
    .lookupType('Status')
    .encode({ code, message, details: [{ typeUrl: 'type.googleapis.com/google.rpc.ErrorInfo', value: info }] })
    .finish();
  const md = new grpc.Metadata();
  md.set('grpc-status-details-bin', Buffer.from(st));
  return md;
}

async function fakeLock(mode: 'hang' | 'plain' | 'no_quorum'): Promise<{ port: number; requestIds: string[]; stop: () => void }> {
  const def = loadSync('lockd/v1/lockd.proto', { includeDirs: [join(PACKAGE_DIR, 'proto')] });
  const pkg = grpc.loadPackageDefinition(def) as unknown as {
    lockd: { v1: { Lock: { service: grpc.ServiceDefinition } } };
  };
  const requestIds: string[] = [];
  const server = new grpc.Server();
  server.addService(pkg.lockd.v1.Lock.service, {
    Acquire: (call: grpc.ServerUnaryCall<{ requestId: string }, unknown>, callback: grpc.sendUnaryData<unknown>) => {
      requestIds.push(call.request.requestId);
      const UNAVAILABLE = grpc.status.UNAVAILABLE;
      if (mode === 'hang') {
        setTimeout(() => callback({ code: UNAVAILABLE, details: 'too late' }), 3000).unref();
      } else if (mode === 'no_quorum') {
        callback({ code: UNAVAILABLE, details: 'lockd: no quorum', metadata: statusWithReason(UNAVAILABLE, 'lockd: no quorum', 'NO_QUORUM') });
      } else {
        // UNAVAILABLE without lockd's ErrorInfo: not from lockd, proves nothing.
        callback({ code: UNAVAILABLE, details: 'lockd: nothing was done (says the message)' });
      }
    },
  });
  const port = await new Promise<number>((done, fail) =>
    server.bindAsync('127.0.0.1:0', grpc.ServerCredentials.createInsecure(), (err, p) => (err ? fail(err) : done(p))),
  );
  return { port, requestIds, stop: () => server.forceShutdown() };
}

describe('the outcome is read from the reason, and every retry carries the same request id', () => {
  const cases: ['hang' | 'plain' | 'no_quorum', boolean, 'unknown' | 'not_done'][] = [
    ['hang', true, 'unknown'],
    ['plain', true, 'unknown'],
    ['no_quorum', false, 'not_done'],
    // A request id the caller passes may have been sent by an earlier call: never "not done".
    ['no_quorum', true, 'unknown'],
  ];
  for (const [mode, callerId, outcome] of cases) {
    test(`${mode}, ${callerId ? 'caller-given' : 'fresh'} request id: ${outcome}`, async () => {
      const fake = await fakeLock(mode);
      const c = new Client({ endpoints: [`127.0.0.1:${fake.port}`], callTimeoutMs: 1200, attemptTimeoutMs: 400 });
      try {
        const rid = 'node-fixed-request-id';
        const e = await c.acquire('orders/1', callerId ? { requestId: rid } : {}).then(
          () => assert.fail('granted by a fake'),
          (err: unknown) => err,
        );
        assert.ok(e instanceof LockdError, String(e));
        assert.equal(e.outcome, outcome, e.message);
        assert.ok(fake.requestIds.length >= 2, 'retried');
        assert.equal(new Set(fake.requestIds).size, 1, 'every retry carries the same request id');
        if (callerId) assert.deepEqual([...new Set(fake.requestIds)], [rid]);
        if (outcome === 'unknown') {
          assert.ok(e instanceof OutcomeUnknownError);
          assert.equal(e.requestId, fake.requestIds[0]);
          // Rule 15: the message shows the start of the id only; the field holds all of it.
          assert.ok(e.message.includes(fake.requestIds[0]!.slice(0, 8)), e.message);
          assert.ok(!e.message.includes(fake.requestIds[0]!), e.message);
        } else {
          assert.ok(e instanceof UnavailableError && e.definitelyNotDone);
        }
      } finally {
        c.close();
        fake.stop();
      }
    });
  }
});

test('fence values, options and headers', () => {
  const g = new Grant('a b/c', 'x'.repeat(32), 7n, 5000, 'r', 0, 0, Buffer.from([1, 2]));
  assert.equal(fenceValue(g), 'a b/c:7');
  assert.equal(fenceValue(g, { signed: true }), 'a b/c:AQI=');
  assert.equal(fenceOptions(g), '-c lockd.fence=a\\ b/c:7'); // libpq splits options at spaces
  assert.deepEqual(fenceHeaders(g), { 'Lock-Resource': 'a b/c', 'Fencing-Token': '7', 'Lock-Sequencer': 'AQI=' });
  const unsigned = new Grant('r', 'x'.repeat(32), 7n, 5000, 'r', 0, 0, Buffer.alloc(0));
  assert.ok(!('Lock-Sequencer' in fenceHeaders(unsigned)));
  assert.throws(() => fenceValue(unsigned, { signed: true }), InvalidArgumentError);
  assert.equal(quoteLiteral("o'k"), "'o''k'");
  assert.equal(quoteLiteral('a\\b'), "E'a\\\\b'");
  // withFence checks first, and sends nothing for a lost lease.
  const lost = {
    resource: 'r',
    fencingToken: 1n,
    sequencer: Buffer.alloc(0),
    check: () => {
      throw new LeaseLostError('lost', 'deadline_passed');
    },
  };
  assert.throws(() => withFence(lost), LeaseLostError);
  const init = withFence({ resource: 'r', fencingToken: 9n, sequencer: Buffer.alloc(0), check: () => {} }, {
    method: 'PUT',
    headers: { 'X-Other': '1' },
  });
  const h = new Headers(init.headers);
  assert.deepEqual([h.get('lock-resource'), h.get('fencing-token'), h.get('x-other')], ['r', '9', '1']);
});
