/**
 * Real processes for the tests: a three-node lockd cluster, fence-proxy, child Node programs.
 * Binaries come from $LOCKD_BIN_DIR (run-tests.sh sets it). Every process is stopped by its PID:
 * by the test's `after` hook, and, should the test process die first, by an exit handler that
 * SIGKILLs whatever is still running.
 */

import { type ChildProcess, execFileSync, spawn, type SpawnOptions } from 'node:child_process';
import { closeSync, existsSync, mkdirSync, mkdtempSync, openSync, readFileSync, rmSync, writeFileSync } from 'node:fs';
import { createConnection, createServer } from 'node:net';
import { tmpdir } from 'node:os';
import { dirname, join, resolve } from 'node:path';
import { setTimeout as sleep } from 'node:timers/promises';
import { fileURLToPath } from 'node:url';

import { Client, LockdError } from '@lockd/client';

/** clients/node */
export const PACKAGE_DIR = resolve(dirname(fileURLToPath(import.meta.url)), '..', '..', '..');
export const PG_URL = process.env.LOCKD_TEST_PG ?? 'postgres://postgres@127.0.0.1:5432/test';

export function binary(name: string): string {
  const dir = process.env.LOCKD_BIN_DIR;
  if (!dir) throw new Error('LOCKD_BIN_DIR is not set: run clients/node/run-tests.sh BIN_DIR');
  const path = join(dir, name);
  if (!existsSync(path)) throw new Error(`binary ${path} not found: LOCKD_BIN_DIR must hold lockd, lockctl and fence-proxy`);
  return path;
}

/** Everything started and not yet seen to exit. */
const running = new Set<{ killNow(): void }>();
process.on('exit', () => {
  for (const p of running) p.killNow();
});
// A test file stopped by a signal (the runner's timeout, ^C) takes its processes with it too.
for (const sig of ['SIGINT', 'SIGTERM'] as const) {
  process.once(sig, () => {
    for (const p of running) p.killNow();
    process.exit(128 + (sig === 'SIGINT' ? 2 : 15));
  });
}

/** A child process with its output in a log file, stopped by its PID. */
export class Proc {
  readonly child: ChildProcess;
  readonly pid: number;
  readonly logPath: string;
  #exited: Promise<void>;
  #done = false;

  constructor(
    readonly name: string,
    args: string[],
    logDir: string,
    env: Record<string, string> = {},
  ) {
    this.logPath = join(logDir, `${name}.log`);
    const fd = openSync(this.logPath, 'a');
    const options: SpawnOptions = {
      stdio: ['ignore', fd, fd],
      env: { RUST_LOG: 'warn,openraft=off', ...process.env, ...env },
    };
    this.child = spawn(args[0]!, args.slice(1), options);
    closeSync(fd);
    if (this.child.pid === undefined) throw new Error(`${name}: could not start ${args[0]}`);
    this.pid = this.child.pid;
    this.#exited = new Promise((done) => this.child.once('exit', () => done()));
    void this.#exited.then(() => {
      this.#done = true;
      running.delete(this);
    });
    running.add(this);
  }

  get alive(): boolean {
    return !this.#done;
  }

  signal(sig: NodeJS.Signals): void {
    if (this.alive) process.kill(this.pid, sig);
  }

  /** SIGKILL, then wait for the exit. */
  async kill(): Promise<void> {
    if (!this.alive) return;
    process.kill(this.pid, 'SIGKILL');
    await this.#exited;
  }

  killNow(): void {
    try {
      if (this.alive) process.kill(this.pid, 'SIGKILL');
    } catch {
      // already gone
    }
  }

  /** SIGCONT (it may be stopped), SIGTERM, then SIGKILL after 3 s. */
  async stop(): Promise<void> {
    if (!this.alive) return;
    try {
      process.kill(this.pid, 'SIGCONT');
      process.kill(this.pid, 'SIGTERM');
    } catch {
      return;
    }
    const timer = setTimeout(() => this.killNow(), 3000);
    await this.#exited;
    clearTimeout(timer);
  }

  logTail(n = 4000): string {
    try {
      return readFileSync(this.logPath, 'utf8').slice(-n);
    } catch {
      return '';
    }
  }
}

export function randomLoopbackIp(): string {
  const r = (lo: number, hi: number): number => lo + Math.floor(Math.random() * (hi - lo + 1));
  return `127.${r(1, 254)}.${r(0, 255)}.${r(1, 254)}`;
}

export function freePort(ip: string): Promise<number> {
  return new Promise((done, fail) => {
    const srv = createServer();
    srv.once('error', fail);
    srv.listen(0, ip, () => {
      const { port } = srv.address() as { port: number };
      srv.close(() => done(port));
    });
  });
}

export async function waitTcp(ip: string, port: number, proc: Proc, timeoutMs = 15_000): Promise<void> {
  const end = performance.now() + timeoutMs;
  while (performance.now() < end) {
    if (!proc.alive) throw new Error(`${proc.name} exited: ${proc.logTail()}`);
    const ok = await new Promise<boolean>((done) => {
      const s = createConnection({ host: ip, port });
      s.once('connect', () => {
        s.destroy();
        done(true);
      });
      s.once('error', () => done(false));
    });
    if (ok) return;
    await sleep(50);
  }
  throw new Error(`${proc.name} did not listen on ${ip}:${port}: ${proc.logTail()}`);
}

export function tempDir(prefix: string): { path: string; remove: () => void } {
  const path = mkdtempSync(join(tmpdir(), prefix));
  return { path, remove: () => rmSync(path, { recursive: true, force: true }) };
}

export function unique(prefix: string): string {
  return `${prefix}/${Math.random().toString(16).slice(2, 14)}`;
}

/**
 * A throwaway CA and one certificate per node naming `node-<id>.lockd.lockd` and `ip`, as
 * lockd/bench/scripts/cluster3.sh makes them. Returns the CA's path.
 */
export function makeCerts(dir: string, ip: string): string {
  mkdirSync(dir, { recursive: true });
  const openssl = (...args: string[]): void => {
    execFileSync('openssl', args, { stdio: 'pipe', timeout: 30_000 });
  };
  const ec = ['-newkey', 'ec', '-pkeyopt', 'ec_paramgen_curve:P-256', '-nodes'];
  openssl('req', '-x509', ...ec, '-days', '2', '-subj', '/CN=lockd node test CA', '-keyout', join(dir, 'ca-key.pem'), '-out', join(dir, 'ca.pem'));
  for (const i of [1, 2, 3]) {
    openssl('req', ...ec, '-subj', `/CN=lockd node ${i}`, '-keyout', join(dir, `node${i}-key.pem`), '-out', join(dir, `node${i}.csr`));
    writeFileSync(
      join(dir, `node${i}.ext`),
      `subjectAltName=DNS:node-${i}.lockd.lockd,IP:${ip}\nextendedKeyUsage=serverAuth,clientAuth\n`,
    );
    openssl(
      'x509', '-req', '-in', join(dir, `node${i}.csr`), '-CA', join(dir, 'ca.pem'), '-CAkey', join(dir, 'ca-key.pem'),
      '-days', '2', '-out', join(dir, `node${i}.pem`), '-extfile', join(dir, `node${i}.ext`),
    );
  }
  return join(dir, 'ca.pem');
}

/** Three lockd nodes on a random 127.x.y.z address, ports 7001-7003, fast elections. */
export class Cluster {
  readonly ip = randomLoopbackIp();
  readonly nodes = new Map<number, Proc>();
  readonly #clients: Client[] = [];
  /** The CA of the nodes' certificates, when the cluster runs TLS. */
  ca: string | undefined;

  private constructor(readonly dir: string) {}

  static async start(dir: string, options: { tls?: boolean } = {}): Promise<Cluster> {
    const c = new Cluster(dir);
    try {
      if (options.tls) c.ca = makeCerts(join(dir, 'tls'), c.ip);
      for (const i of [1, 2, 3]) c.startNode(i);
      await c.leader();
    } catch (e) {
      await c.stop();
      throw e;
    }
    return c;
  }

  addr(i: number): string {
    return `${this.ip}:${7000 + i}`;
  }

  get endpoints(): string[] {
    return [1, 2, 3].map((i) => this.addr(i));
  }

  startNode(i: number): void {
    const args = [binary('lockd'), '--id', String(i), '--listen', this.addr(i), '--data-dir', join(this.dir, `node${i}`)];
    args.push('--heartbeat', '100ms', '--election-timeout', '600ms');
    if (this.ca !== undefined) {
      const t = join(this.dir, 'tls');
      args.push('--tls-cert', join(t, `node${i}.pem`), '--tls-key', join(t, `node${i}-key.pem`), '--peer-ca', this.ca);
    }
    for (const p of [1, 2, 3]) args.push('--peer', `${p}=${this.addr(p)}`);
    this.nodes.set(i, new Proc(`lockd-${i}`, args, this.dir));
  }

  /** A client of this cluster, closed by `stop()`. */
  client(options: Partial<ConstructorParameters<typeof Client>[0]> = {}): Client {
    const tls = this.ca !== undefined ? { ca: this.ca } : undefined;
    const c = new Client({ endpoints: this.endpoints, callTimeoutMs: 10_000, tls, ...options });
    this.#clients.push(c);
    return c;
  }

  /** The id of the leader that a majority agrees on and that serves a linearizable read. */
  async leader(timeoutMs = 20_000): Promise<number> {
    const end = performance.now() + timeoutMs;
    let last: unknown;
    while (performance.now() < end) {
      for (const [i, proc] of this.nodes) {
        if (!proc.alive) continue;
        const tls = this.ca !== undefined ? { ca: this.ca } : undefined;
        const c = new Client({ endpoints: [this.addr(i)], callTimeoutMs: 1000, attemptTimeoutMs: 1000, tls });
        try {
          const st = await c.status();
          if (st.leaderId && this.nodes.get(st.leaderId)?.alive) {
            await c.describe('node-test/leader-probe');
            return st.leaderId;
          }
        } catch (e) {
          if (!(e instanceof LockdError)) throw e;
          last = e;
        } finally {
          c.close();
        }
      }
      await sleep(100);
    }
    throw new Error(`no leader within ${timeoutMs} ms (${String(last)}); logs: ${this.nodes.get(1)?.logTail()}`);
  }

  async stop(): Promise<void> {
    for (const c of this.#clients) c.close();
    await Promise.all([...this.nodes.values()].map((p) => p.stop()));
  }
}

/** Runs a compiled helper program of dist-test/test/support with `node`, output piped. */
export function nodeChild(script: string, env: Record<string, string>): ChildProcess {
  const path = join(PACKAGE_DIR, 'dist-test', 'test', 'support', script);
  const child = spawn(process.execPath, [path], {
    stdio: ['pipe', 'pipe', 'pipe'],
    env: { ...process.env, ...env },
    cwd: PACKAGE_DIR,
  });
  const guard = {
    killNow: (): void => {
      if (child.exitCode === null && child.signalCode === null) child.kill('SIGKILL');
    },
  };
  running.add(guard);
  child.once('exit', () => running.delete(guard));
  return child;
}

/** Collects a child's stdout lines and waits for one with a given first word. */
export class Lines {
  readonly lines: string[] = [];
  #buffer = '';
  #waiters: (() => void)[] = [];
  stderr = '';
  #closed = false;

  constructor(child: ChildProcess) {
    child.stdout!.setEncoding('utf8');
    child.stdout!.on('data', (chunk: string) => {
      this.#buffer += chunk;
      let nl: number;
      while ((nl = this.#buffer.indexOf('\n')) >= 0) {
        this.lines.push(this.#buffer.slice(0, nl));
        this.#buffer = this.#buffer.slice(nl + 1);
      }
      this.#notify();
    });
    child.stderr!.setEncoding('utf8');
    child.stderr!.on('data', (chunk: string) => (this.stderr += chunk));
    child.once('close', () => {
      this.#closed = true;
      this.#notify();
    });
  }

  #notify(): void {
    const w = this.#waiters;
    this.#waiters = [];
    for (const f of w) f();
  }

  /** The first line whose first word is `word`, split into words. */
  async waitFor(word: string, timeoutMs = 20_000): Promise<string[]> {
    const end = performance.now() + timeoutMs;
    for (;;) {
      const line = this.lines.find((l) => l.split(' ')[0] === word);
      if (line !== undefined) return line.split(' ');
      if (this.#closed) throw new Error(`child exited without "${word}": ${this.lines.join('\n')}\n${this.stderr}`);
      const left = end - performance.now();
      if (left <= 0) throw new Error(`no "${word}" line within ${timeoutMs} ms: ${this.lines.join('\n')}\n${this.stderr}`);
      await new Promise<void>((done) => {
        const t = setTimeout(done, left);
        this.#waiters.push(() => {
          clearTimeout(t);
          done();
        });
      });
    }
  }
}

export function exited(child: ChildProcess, timeoutMs: number): Promise<number | null> {
  if (child.exitCode !== null || child.signalCode !== null) return Promise.resolve(child.exitCode);
  return new Promise((done, fail) => {
    const t = setTimeout(() => fail(new Error(`child ${child.pid} still running after ${timeoutMs} ms`)), timeoutMs);
    child.once('exit', (code) => {
      clearTimeout(t);
      done(code);
    });
  });
}
