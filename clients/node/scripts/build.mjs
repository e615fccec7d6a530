// Build step of @lockd/client: copy the lockd.v1 proto into the package, generate its TypeScript
// types, compile src/ to dist/ (ESM + .d.ts). With --tests, also compile test/ to dist-test/.
//
// The proto is looked up in $LOCKD_PROTO_DIR, then ../../lockd/api/proto (a checkout:
// `npm install ./clients/node`), then ./proto (a packed tarball, which carries the copy). The
// repository keeps one proto; the copy and the generated types are build output (.gitignore).
//
// The loader options here and in src/proto.ts must agree: the generated types describe what the
// loader produces.

import { spawnSync } from 'node:child_process';
import { copyFileSync, existsSync, mkdirSync, rmSync } from 'node:fs';
import { dirname, join, resolve } from 'node:path';
import { fileURLToPath } from 'node:url';

const here = resolve(dirname(fileURLToPath(import.meta.url)), '..');
const PROTO_REL = join('lockd', 'v1', 'lockd.proto');
const withTests = process.argv.includes('--tests');

function fail(message) {
  console.error(`@lockd/client build: ${message}`);
  process.exit(1);
}

function protoRoot() {
  const candidates = [];
  if (process.env.LOCKD_PROTO_DIR) candidates.push(resolve(process.env.LOCKD_PROTO_DIR));
  candidates.push(resolve(here, '..', '..', 'lockd', 'api', 'proto'), join(here, 'proto'));
  const found = candidates.find((root) => existsSync(join(root, PROTO_REL)));
  if (!found) fail(`cannot find ${PROTO_REL} under any of ${candidates.join(', ')}; set LOCKD_PROTO_DIR`);
  return found;
}

function run(what, args) {
  const done = spawnSync(process.execPath, args, { cwd: here, stdio: 'inherit' });
  if (done.status !== 0) fail(`${what} failed (exit ${done.status ?? done.signal})`);
}

const root = protoRoot();
const ownProto = join(here, 'proto');
if (root !== ownProto) {
  mkdirSync(dirname(join(ownProto, PROTO_REL)), { recursive: true });
  copyFileSync(join(root, PROTO_REL), join(ownProto, PROTO_REL));
}

// Stale output of a renamed or deleted file must not survive into the package.
for (const dir of ['src/gen', 'dist', ...(withTests ? ['dist-test'] : [])]) {
  rmSync(join(here, dir), { recursive: true, force: true });
}

run('proto-loader-gen-types', [
  join(here, 'node_modules', '@grpc', 'proto-loader', 'build', 'bin', 'proto-loader-gen-types.js'),
  '--longs=String',
  '--enums=String',
  '--defaults',
  '--oneofs',
  '--includeComments',
  '--grpcLib=@grpc/grpc-js',
  '--importFileExtension=.js',
  '-I',
  ownProto,
  '-O',
  join(here, 'src', 'gen'),
  PROTO_REL,
]);

const tsc = join(here, 'node_modules', 'typescript', 'bin', 'tsc');
run('tsc (src)', [tsc, '-p', join(here, 'tsconfig.json')]);
if (withTests) run('tsc (test)', [tsc, '-p', join(here, 'tsconfig.test.json')]);
