/**
 * A busy lease holder for the SIGSTOP test (run as its own process). Before every "write" it
 * reads `lease.lost`; the instants before and after each read are kept, so the pause shows as the
 * largest gap between two of them, and a write whose check began after the pause ended is a late
 * write. (A pause between a check and its write is the race only a fencing check at the storage
 * can catch: not counted here, see the zombie tests.)
 */

import { setImmediate as yieldToLoop } from 'node:timers/promises';

import { Client } from '@lockd/client';

const client = new Client({ endpoints: process.env.ENDPOINTS!.split(',') });
const lease = await client.lock(process.env.RESOURCE!, { ttlMs: 2000 });
console.log('token', lease.fencingToken.toString());

const KEEP = 200_000;
const before = new Float64Array(KEEP);
const afterCheck = new Float64Array(KEEP);
let n = 0;
let writes = 0;
let signalAtLoss = false;
for (;;) {
  const b = performance.now();
  const lost = lease.lost;
  before[n % KEEP] = b;
  afterCheck[n % KEEP] = performance.now();
  n += 1;
  if (lost) {
    signalAtLoss = lease.signal.aborted;
    break;
  }
  writes += 1;
  if (writes === 1000) console.log('writing');
  // A write is asynchronous I/O: the event loop (renewals, timers) runs between writes.
  await yieldToLoop();
}

// The largest gap between consecutive instants, and the checks that began after it ended.
const first = Math.max(0, n - KEEP);
let gap = 0;
let end = 0;
let prev = before[first % KEEP]!;
for (let i = first; i < n; i++) {
  for (const t of [before[i % KEEP]!, afterCheck[i % KEEP]!]) {
    if (t - prev > gap) {
      gap = t - prev;
      end = t;
    }
    prev = t;
  }
}
let late = 0;
for (let i = first; i < n - 1; i++) if (before[i % KEEP]! >= end) late += 1; // the last check saw the loss
console.log('lost', lease.loss, `gap=${Math.round(gap)}`, `late=${late}`, `signal=${signalAtLoss}`);
try {
  lease.check();
  console.log('check-passed');
} catch (e) {
  console.log('check-raised', (e as { loss?: string }).loss, e === lease.signal.reason);
}
client.close();
