#!/usr/bin/env bash
# Memory over a long mixed run: starts a fresh cluster (cluster3.sh), runs lockd-bench mixed at
# RATE ops/s for SECONDS, and every minute appends each node's VmRSS and its resident heap
# (anonymous pages, from smaps) to $OUT/NAME/rss.txt; VmHWM at the end. The bench's report goes
# to $OUT/NAME/bench.txt.
#
#   rss-minutes.sh NAME [SECONDS [RATE]]     (defaults: 600 s, 6,000 ops/s)
#
# Environment: LOCKD_BIN, BENCH_BIN (default target/release/lockd-bench), OUT (default
# /tmp/benchres), plus cluster3.sh's.
set -euo pipefail
here=$(dirname "$0")
S="$here/cluster3.sh"
B=${BENCH_BIN:-target/release/lockd-bench}
OUT=${OUT:-/tmp/benchres}
name=${1:?usage: rss-minutes.sh NAME [SECONDS [RATE]]}
secs=${2:-600}
rate=${3:-6000}
dir=${BENCH_DIR:-/tmp/lockd-bench-cluster}
out="$OUT/$name"
mkdir -p "$out"
: >"$out/rss.txt"
"$S" stop >/dev/null 2>&1 || true
"$S" start >/dev/null
trap '"$S" stop >/dev/null 2>&1 || true' EXIT
"$B" --endpoints "$("$S" endpoints)" --no-progress mixed --rate "$rate" --duration "${secs}s" \
    --interval 60s >"$out/bench.txt" 2>&1 &
bench=$!
for m in $(seq 1 $((secs / 60))); do
    sleep 60
    for i in 1 2 3; do
        pid=$(cat "$dir/node$i.pid")
        awk -v m="$m" -v n="$i" '/^Rss:/ { r += $2 } /^Anonymous:/ { a += $2 }
            END { printf "minute %d node %d rss %d MB heap %d MB\n", m, n, r / 1024, a / 1024 }' \
            "/proc/$pid/smaps" >>"$out/rss.txt"
    done
done
wait "$bench"
# The leader the bench found (node N listens on port 700N).
grep -o '"leader":"[^"]*"' "$out/bench.txt" >>"$out/rss.txt" || true
for i in 1 2 3; do
    echo "node $i $(grep VmHWM "/proc/$(cat "$dir/node$i.pid")/status")" >>"$out/rss.txt"
done
