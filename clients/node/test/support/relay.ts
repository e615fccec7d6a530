/**
 * A TCP relay in front of one lockd node that loses the first reply: on its first connection it
 * forwards everything the client sends, and from the node only the connection-level HTTP/2 frames
 * (stream 0: SETTINGS, PING, WINDOW_UPDATE). The first frame of a call's reply is held back; once
 * the reply's DATA frame has arrived (the request was executed), the relay keeps its payload for
 * the test and cuts both connections. Later connections are relayed unchanged.
 */

import { createConnection, createServer, type Server, type Socket } from 'node:net';

const FRAME_HEADER = 9;
const TYPE_DATA = 0;

export class DropFirstReplyRelay {
  readonly server: Server;
  /** gRPC message payloads of the replies that were dropped (without the 5-byte prefix). */
  readonly dropped: Buffer[] = [];
  /** When each reply was dropped (`performance.now()`). */
  readonly droppedAt: number[] = [];
  connections = 0;
  #sockets = new Set<Socket>();

  private constructor(
    readonly ip: string,
    readonly port: number,
    server: Server,
  ) {
    this.server = server;
  }

  get target(): string {
    return `${this.ip}:${this.port}`;
  }

  static start(ip: string, upstreamHost: string, upstreamPort: number): Promise<DropFirstReplyRelay> {
    return new Promise((done, fail) => {
      let relay: DropFirstReplyRelay | undefined;
      const server = createServer((client) => relay!.accept(client, upstreamHost, upstreamPort));
      server.once('error', fail);
      server.listen(0, ip, () => {
        relay = new DropFirstReplyRelay(ip, (server.address() as { port: number }).port, server);
        done(relay);
      });
    });
  }

  private accept(client: Socket, host: string, port: number): void {
    this.connections += 1;
    const lossy = this.connections === 1;
    const upstream = createConnection({ host, port });
    for (const s of [client, upstream]) {
      this.#sockets.add(s);
      s.once('close', () => this.#sockets.delete(s));
      s.on('error', () => {
        client.destroy();
        upstream.destroy();
      });
    }
    client.pipe(upstream);
    if (!lossy) {
      upstream.pipe(client);
      return;
    }
    // Parse the node's frames; pass stream-0 frames, hold back the rest until the reply's DATA.
    let pending = Buffer.alloc(0);
    upstream.on('data', (chunk: Buffer) => {
      pending = Buffer.concat([pending, chunk]);
      while (pending.length >= FRAME_HEADER) {
        const length = pending.readUIntBE(0, 3);
        if (pending.length < FRAME_HEADER + length) break;
        const frame = pending.subarray(0, FRAME_HEADER + length);
        pending = pending.subarray(FRAME_HEADER + length);
        const type = frame[3]!;
        const stream = frame.readUInt32BE(5) & 0x7fffffff;
        if (stream === 0) {
          client.write(frame);
          continue;
        }
        if (type === TYPE_DATA && length >= 5) {
          // One gRPC message: a compression flag byte, a 4-byte length, the protobuf bytes.
          const size = frame.readUInt32BE(FRAME_HEADER + 1);
          this.dropped.push(Buffer.from(frame.subarray(FRAME_HEADER + 5, FRAME_HEADER + 5 + size)));
          this.droppedAt.push(performance.now());
          client.destroy();
          upstream.destroy();
          return;
        }
      }
    });
  }

  close(): Promise<void> {
    for (const s of this.#sockets) s.destroy();
    return new Promise((done) => this.server.close(() => done()));
  }
}
