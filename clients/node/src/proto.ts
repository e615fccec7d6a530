/**
 * The lockd.v1 service definitions, loaded at run time from the proto this package carries
 * (copied from lockd/api/proto by scripts/build.mjs), and the generated types that describe them.
 */

import { fileURLToPath } from 'node:url';
import { loadSync, type MethodDefinition } from '@grpc/proto-loader';

import type { AcquireRequest } from './gen/lockd/v1/AcquireRequest.js';
import type { AcquireResponse__Output } from './gen/lockd/v1/AcquireResponse.js';
import type { DescribeRequest } from './gen/lockd/v1/DescribeRequest.js';
import type { DescribeResponse__Output } from './gen/lockd/v1/DescribeResponse.js';
import type { ReleaseRequest } from './gen/lockd/v1/ReleaseRequest.js';
import type { ReleaseResponse__Output } from './gen/lockd/v1/ReleaseResponse.js';
import type { RenewRequest } from './gen/lockd/v1/RenewRequest.js';
import type { RenewResponse__Output } from './gen/lockd/v1/RenewResponse.js';
import type { StatusRequest } from './gen/lockd/v1/StatusRequest.js';
import type { StatusResponse__Output } from './gen/lockd/v1/StatusResponse.js';

export type {
  AcquireRequest,
  AcquireResponse__Output,
  DescribeRequest,
  DescribeResponse__Output,
  ReleaseRequest,
  ReleaseResponse__Output,
  RenewRequest,
  RenewResponse__Output,
  StatusRequest,
  StatusResponse__Output,
};

/** Where the package keeps its copy of the proto (dist/../proto). */
export const PROTO_DIR = fileURLToPath(new URL('../proto/', import.meta.url));
export const PROTO_FILE = 'lockd/v1/lockd.proto';

// Must match the flags scripts/build.mjs gives proto-loader-gen-types: 64-bit integers arrive as
// decimal strings (a fencing token is a u64; a JS number would round it above 2^53).
const definition = loadSync(PROTO_FILE, {
  includeDirs: [PROTO_DIR],
  longs: String,
  enums: String,
  defaults: true,
  oneofs: true,
});

function method<Req, Res>(service: string, name: string): MethodDefinition<Req, Res> {
  const svc = definition[`lockd.v1.${service}`] as unknown as Record<string, MethodDefinition<Req, Res>> | undefined;
  const def = svc?.[name];
  if (def === undefined) throw new Error(`@lockd/client: ${PROTO_DIR}${PROTO_FILE} has no lockd.v1.${service}/${name}`);
  return def;
}

/** The RPCs this client calls. */
export const methods = {
  acquire: method<AcquireRequest, AcquireResponse__Output>('Lock', 'Acquire'),
  renew: method<RenewRequest, RenewResponse__Output>('Lock', 'Renew'),
  release: method<ReleaseRequest, ReleaseResponse__Output>('Lock', 'Release'),
  describe: method<DescribeRequest, DescribeResponse__Output>('Lock', 'Describe'),
  status: method<StatusRequest, StatusResponse__Output>('Cluster', 'Status'),
};
