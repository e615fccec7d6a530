/**
 * The cluster of a test file, without the start and stop boilerplate: `useCluster()` at the top
 * of a file starts one cluster before the file's first test and stops it (and removes its
 * directory) after the last; `useOwnClusters()` gives each test that asks a cluster of its own,
 * all stopped after the file's last test. The cluster's directory (`cluster.dir`) also takes
 * the files of whatever else a test starts (proxies, certificates).
 */

import { after, before } from 'node:test';

import type { Client } from '@lockd/client';

import { Cluster, tempDir } from './procs.js';

/** What a test file shares: read it inside tests and hooks, after `before` has run. */
export interface SharedCluster {
  /** The file's three-node cluster. */
  readonly cluster: Cluster;
  /** A client of every node of the cluster (default options), closed when the cluster stops. */
  readonly client: Client;
}

/**
 * Registers the `before` and `after` hooks of a file's shared cluster (`tls`: the nodes speak
 * TLS, `cluster.ca` is their CA). Call it at the top level of a test file.
 */
export function useCluster(options: { tls?: boolean } = {}): SharedCluster {
  let cluster: Cluster | undefined;
  let client: Client | undefined;
  let dir: { path: string; remove: () => void } | undefined;
  before(async () => {
    dir = tempDir(options.tls ? 'lockd-node-tls-' : 'lockd-node-');
    cluster = await Cluster.start(dir.path, options);
  });
  after(async () => {
    await cluster?.stop();
    dir?.remove();
  });
  const started = (): Cluster => {
    // A read outside a test or hook: the cluster starts in the file's `before` hook.
    if (cluster === undefined) throw new Error('useCluster: the cluster is not started (read it inside a test)');
    return cluster;
  };
  return {
    get cluster() {
      return started();
    },
    get client() {
      client ??= started().client();
      return client;
    },
  };
}

/** Clusters of their own for the tests of one file, and what else must go when the file ends. */
export interface OwnClusters {
  /** Starts a cluster that is stopped (and its directory removed) after the file's last test. */
  start(): Promise<Cluster>;
  /** Runs `cleanup` after the file's last test; cleanups run in the reverse order of their registration. */
  defer(cleanup: () => Promise<void> | void): void;
}

/**
 * Registers the `after` hook of a file whose tests each need a cluster of their own (they kill
 * nodes). Call it at the top level of a test file.
 */
export function useOwnClusters(): OwnClusters {
  const cleanups: (() => Promise<void> | void)[] = [];
  after(async () => {
    for (const c of cleanups.reverse()) await c();
  });
  return {
    async start() {
      const dir = tempDir('lockd-node-');
      const cluster = await Cluster.start(dir.path).catch((e: unknown) => {
        dir.remove();
        throw e;
      });
      cleanups.push(async () => {
        await cluster.stop();
        dir.remove();
      });
      return cluster;
    },
    defer(cleanup) {
      cleanups.push(cleanup);
    },
  };
}
