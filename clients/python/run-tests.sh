#!/usr/bin/env bash
# Runs the Python client's tests against real lockd / fence-proxy binaries.
#
#   clients/python/run-tests.sh [BIN_DIR] [PYTEST ARGS...]
#
# BIN_DIR holds lockd, lockctl and fence-proxy (default: $LOCKD_BIN_DIR, else the workspace's
# target/debug). Creates clients/python/.venv if missing and installs the package with its test
# extras into it (`pip install ./clients/python[test]`: the gRPC stubs are generated from
# lockd/api/proto during that install). Postgres tests use $LOCKD_TEST_PG (default
# postgres://postgres@127.0.0.1:5432/test) and are skipped when it cannot be reached.
set -euo pipefail

here=$(cd "$(dirname "$0")" && pwd)
bin_dir=${1:-${LOCKD_BIN_DIR:-$here/../../target/debug}}
[ $# -gt 0 ] && shift
bin_dir=$(cd "$bin_dir" && pwd) || { echo "run-tests.sh: no such directory: $bin_dir" >&2; exit 2; }
for b in lockd lockctl fence-proxy; do
    [ -x "$bin_dir/$b" ] || { echo "run-tests.sh: $bin_dir/$b missing: build with cargo build -p lockd-server -p lockctl -p fence-proxy --bins" >&2; exit 2; }
done

python=${PYTHON:-python3}
venv="$here/.venv"
if [ ! -x "$venv/bin/python" ]; then
    "$python" -m venv "$venv"
fi
# pip rebuilds and reinstalls a local directory every time, so the stubs follow the proto and the
# tests run the current code.
"$venv/bin/python" -m pip install --quiet --disable-pip-version-check "$here[test]"

cd "$here"
# The pytest script, not `python -m pytest`: that would put this directory on sys.path and import
# the source tree (which has no generated stubs) instead of the installed package.
LOCKD_BIN_DIR="$bin_dir" exec "$venv/bin/pytest" -q -p no:cacheprovider tests "$@"
