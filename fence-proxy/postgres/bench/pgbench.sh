#!/bin/bash
# pgbench -c 4 -j 2 -M prepared through fence-proxy's Postgres front end, side by side in one run:
# direct, an optional reference relay, then for each given fence-proxy binary unfenced and fenced
# (every transaction fenced with PGOPTIONS='-c lockd.fence=bench/1:1'), then direct again.
#
#   fence-proxy/postgres/bench/pgbench.sh BIN [BIN...]      (T=30 seconds per run by default)
#   REF_PORT=16544 ... also runs through a relay already listening there (e.g. PgBouncer)
#
# Uses database pgbench_a on 127.0.0.1:5432 (user postgres), recreated at scale 1, and proxy
# port 16543. See docs/benchmarks.md, "fence-proxy Postgres front end (pgbench)".
set -eu
DB=pgbench_a
T=${T:-30}
[ $# -ge 1 ] || { echo "usage: $0 FENCE_PROXY_BINARY [MORE...]" >&2; exit 2; }
createdb -h 127.0.0.1 -U postgres $DB 2>/dev/null || true
pgbench -h 127.0.0.1 -U postgres -i -s 1 -q $DB >/dev/null 2>&1
run() { # label port [PGOPTIONS]
  local out
  out=$(PGOPTIONS="${3:-}" pgbench -h 127.0.0.1 -p "$2" -U postgres -c 4 -j 2 -M prepared -T "$T" $DB 2>&1)
  echo "$1: $(echo "$out" | grep -E '^tps' | sed 's/ (without.*//'), latency $(echo "$out" | grep 'latency average' | awk '{print $4,$5}'), failed $(echo "$out" | grep -E 'number of failed' | awk '{print $5}')"
}
run direct 5432
[ -n "${REF_PORT:-}" ] && run "reference relay" "$REF_PORT"
for bin in "$@"; do
  "$bin" postgres init --upstream postgres://postgres@127.0.0.1:5432/$DB >/dev/null
  "$bin" postgres --listen 127.0.0.1:16543 --upstream postgres://postgres@127.0.0.1:5432/$DB >/dev/null 2>&1 &
  pid=$!
  trap 'kill $pid 2>/dev/null' EXIT
  sleep 1
  run "$bin unfenced" 16543
  run "$bin fenced" 16543 "-c lockd.fence=bench/1:1"
  kill $pid; wait $pid 2>/dev/null || true
done
run direct 5432
