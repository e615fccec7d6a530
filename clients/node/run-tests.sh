#!/usr/bin/env bash
# Runs the Node client's tests against real lockd / fence-proxy binaries.
#
#   clients/node/run-tests.sh [BIN_DIR] [NODE --test ARGS...]
#
# BIN_DIR holds lockd, lockctl and fence-proxy (default: $LOCKD_BIN_DIR, else the workspace's
# target/debug). Installs the pinned dependencies from package-lock.json (`npm ci`, which also
# builds the package: the proto is copied from lockd/api/proto and its types generated), compiles
# the tests and runs them with node's test runner, one file at a time. Postgres tests use
# $LOCKD_TEST_PG (default postgres://postgres@127.0.0.1:5432/test) and are skipped when it cannot
# be reached. Exits non-zero when anything fails.
set -euo pipefail

here=$(cd "$(dirname "$0")" && pwd)
bin_dir=${1:-${LOCKD_BIN_DIR:-$here/../../target/debug}}
[ $# -gt 0 ] && shift
bin_dir=$(cd "$bin_dir" && pwd) || { echo "run-tests.sh: no such directory: $bin_dir" >&2; exit 2; }
for b in lockd lockctl fence-proxy; do
    [ -x "$bin_dir/$b" ] || { echo "run-tests.sh: $bin_dir/$b missing: build with cargo build -p lockd-server -p lockctl -p fence-proxy --bins" >&2; exit 2; }
done
command -v node >/dev/null || { echo "run-tests.sh: node not found (Node >= 20.4 is needed)" >&2; exit 2; }

cd "$here"
npm ci --no-audit --no-fund --loglevel=error
node scripts/build.mjs --tests
# Each file starts its own cluster; one file at a time keeps a 2-core machine responsive.
LOCKD_BIN_DIR="$bin_dir" exec node --test --test-concurrency=1 "$@" dist-test/test/*.test.js
