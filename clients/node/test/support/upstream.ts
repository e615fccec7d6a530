/** A tiny HTTP service that records every request it gets, and fence-proxy http in front of it. */

import { createServer, type Server } from 'node:http';
import { join } from 'node:path';

import { binary, freePort, Proc, randomLoopbackIp, waitTcp } from './procs.js';

export interface Recorded {
  method: string;
  path: string;
  headers: Record<string, string>;
  body: string;
}

export class Upstream {
  private constructor(
    readonly server: Server,
    readonly url: string,
    /** Every request received, in order. */
    readonly requests: Recorded[],
  ) {}

  static start(ip: string): Promise<Upstream> {
    const requests: Recorded[] = [];
    const server = createServer((req, res) => {
      const chunks: Buffer[] = [];
      req.on('data', (c: Buffer) => chunks.push(c));
      req.on('end', () => {
        const headers: Record<string, string> = {};
        for (const [k, v] of Object.entries(req.headers)) headers[k] = Array.isArray(v) ? v.join(', ') : (v ?? '');
        requests.push({ method: req.method ?? '', path: req.url ?? '', headers, body: Buffer.concat(chunks).toString('utf8') });
        const out = JSON.stringify({ ok: true });
        res.writeHead(200, { 'Content-Type': 'application/json', 'Content-Length': Buffer.byteLength(out) });
        res.end(out);
      });
    });
    return new Promise((done, fail) => {
      server.once('error', fail);
      server.listen(0, ip, () => {
        const { port } = server.address() as { port: number };
        done(new Upstream(server, `http://${ip}:${port}`, requests));
      });
    });
  }

  writes(): Recorded[] {
    return this.requests.filter((r) => r.method !== 'GET');
  }

  close(): Promise<void> {
    this.server.closeAllConnections();
    return new Promise((done) => this.server.close(() => done()));
  }
}

/** fence-proxy http with a redb store in front of an Upstream. */
export class HttpProxy {
  private constructor(
    readonly proc: Proc,
    readonly url: string,
    readonly upstream: Upstream,
  ) {}

  static async start(dir: string, extraArgs: string[] = []): Promise<HttpProxy> {
    const ip = randomLoopbackIp();
    const upstream = await Upstream.start(ip);
    const port = await freePort(ip);
    const args = [binary('fence-proxy'), 'http', '--listen', `${ip}:${port}`, '--upstream', upstream.url];
    args.push('--store', `redb:${join(dir, 'epochs.redb')}`, ...extraArgs);
    const proc = new Proc('fence-proxy-http', args, dir);
    try {
      await waitTcp(ip, port, proc);
    } catch (e) {
      await proc.stop();
      await upstream.close();
      throw e;
    }
    return new HttpProxy(proc, `http://${ip}:${port}`, upstream);
  }

  async stop(): Promise<void> {
    await this.proc.stop();
    await this.upstream.close();
  }
}
