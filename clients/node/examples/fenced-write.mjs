// Take a lock and write through fence-proxy: LOCKD_ENDPOINTS=host:port,... FENCE_PROXY_URL=http://...
import { Client, withFence } from '@lockd/client';

const client = new Client({ endpoints: process.env.LOCKD_ENDPOINTS ?? '127.0.0.1:7001,127.0.0.1:7002,127.0.0.1:7003' });
const proxy = process.env.FENCE_PROXY_URL ?? 'http://127.0.0.1:8080';
await client.withLock('orders/42', { ttlMs: 30_000, waitMs: 10_000 }, async (lease) => {
  // withFence checks the lease, then adds Lock-Resource, Fencing-Token and Lock-Sequencer.
  const reply = await fetch(`${proxy}/orders/42`, withFence(lease, { method: 'PUT', body: '{"status":"paid"}' }));
  if (!reply.ok) throw new Error(`write refused: ${reply.status} ${await reply.text()}`);
  console.log('written with fencing token', lease.fencingToken.toString());
});
client.close();
