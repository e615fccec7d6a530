#!/usr/bin/env bash
# Runs the figures of docs/benchmarks.md, one scenario per call, each on a fresh cluster started
# by cluster3.sh. Results go to $OUT/<name>.{json,err,info}: the bench's JSON line, its table, and
# the load average, per-node CPU seconds, RSS and snapshot/purge counts around the run.
#
#   measure.sh NAME [--kill-follower] [--lockd "LOCKD FLAGS"] -- LOCKD-BENCH ARGS...
#
# Unless the bench's flags say otherwise, calls are spread over the nodes (lockd-bench's default
# `--target any`); add `--target leader` to them for leader-only figures, such as those of
# docs/benchmarks.md that name no target (taken while `leader` was the default).
#
# Environment: BENCH_TLS (1 = the cluster and the bench over TLS, see cluster3.sh), NICE (niceness of cluster and bench, default 0), OUT (default /tmp/benchres),
# BENCH_BIN (default target/release/lockd-bench), STATUS_LOOPS (default 0: that many shell loops
# calling `lockctl status` against all nodes during the run; CTL_BIN, default
# target/release/lockctl), plus cluster3.sh's.
#
# STATUS_LOOPS starts a lockctl process per call, so on a small machine it measures process
# spawning as much as lockd. To load the nodes with Status calls alone, pass the bench's own
# option instead: `-- mixed --status-callers 8 ...` runs 8 Status loops inside lockd-bench, each
# on its own connections, and reports their calls, rate and latency apart (JSON key "status").
set -euo pipefail
here=$(dirname "$0")
S="$here/cluster3.sh"
B=${BENCH_BIN:-target/release/lockd-bench}
OUT=${OUT:-/tmp/benchres}
NICE=${NICE:-0}
name=${1:?usage: measure.sh NAME [--kill-follower] [--lockd FLAGS] -- ARGS}
shift
kill_follower=0
lockd_flags=""
while [ $# -gt 0 ]; do
    case "$1" in
    --kill-follower) kill_follower=1; shift ;;
    --lockd) lockd_flags=$2; shift 2 ;;
    --) shift; break ;;
    *) echo "measure.sh: unknown option $1" >&2; exit 2 ;;
    esac
done
mkdir -p "$OUT"
info="$OUT/$name.info"
"$S" stop >/dev/null 2>&1 || true
# openraft logs each snapshot ("update_snapshot") and each purge decision ("purge_log" with
# purge_upto) at info; distinct purge_upto values are the purges.
export RUST_LOG=${RUST_LOG:-warn,openraft::engine::handler::log_handler=info,openraft::engine::handler::snapshot_handler=info}
# shellcheck disable=SC2086
nice -n "$NICE" "$S" start $lockd_flags
leader=$("$S" leader)
{
    echo "name $name"
    echo "bench args: $*"
    echo "lockd flags: $lockd_flags"
    echo "nice $NICE"
    echo "leader at start: node $leader"
} >"$info"
if [ "$kill_follower" = 1 ]; then
    for i in 1 2 3; do
        if [ "$i" != "$leader" ]; then "$S" kill "$i"; echo "killed follower node $i" >>"$info"; break; fi
    done
    sleep 1
fi
echo "load before: $(cut -d' ' -f1-3 /proc/loadavg)" >>"$info"
"$S" cpu | sed 's/^/cpu before: /' >>"$info"
status_pids=()
for _ in $(seq 1 "${STATUS_LOOPS:-0}"); do
    ctl=${CTL_BIN:-target/release/lockctl}
    eps=$("$S" endpoints)
    (while :; do "$ctl" --endpoints "$eps" status >/dev/null 2>&1 || true; done) &
    status_pids+=($!)
done
echo "status loops: ${#status_pids[@]}" >>"$info"
start=$(date +%s.%N)
tls_args=()
if [ "${BENCH_TLS:-0}" = 1 ]; then tls_args=(--cacert "$("$S" cacert)"); fi
nice -n "$NICE" /usr/bin/time -f "bench cpu: user %U s sys %S s maxrss %M KiB" \
    "$B" "${tls_args[@]}" --endpoints "$("$S" endpoints)" --no-progress "$@" >"$OUT/$name.json" 2>"$OUT/$name.err"
end=$(date +%s.%N)
for p in "${status_pids[@]}"; do kill "$p" 2>/dev/null || true; done
echo "wall: $(echo "$end - $start" | bc) s" >>"$info"
echo "load after: $(cut -d' ' -f1-3 /proc/loadavg)" >>"$info"
"$S" cpu | sed 's/^/cpu after: /' >>"$info"
"$S" rss | sed 's/^/rss: /' >>"$info"
echo "leader at end: node $("$S" leader || echo none)" >>"$info"
dir=${BENCH_DIR:-/tmp/lockd-bench-cluster}
for i in 1 2 3; do
    f="$dir/node$i.log"
    [ -f "$f" ] || continue
    plain=$(sed 's/\x1b\[[0-9;]*m//g' "$f")
    echo "node $i: snapshots $(grep -c 'update_snapshot:' <<<"$plain" || true), purges $(grep 'purge_log' <<<"$plain" | grep -o 'purge_upto=[^ ]*' | grep -v 'purge_upto=None' | sort -u | wc -l)" >>"$info"
done
ip=${BENCH_IP:-127.0.0.50}
for i in 1 2 3; do
    if [ "${BENCH_TLS:-0}" = 1 ]; then
        m=(curl --cacert "$("$S" cacert)" -s --max-time 2 "https://$ip:910$i/metrics")
    else
        m=(curl -s --max-time 2 "http://$ip:910$i/metrics")
    fi
    "${m[@]}" 2>/dev/null |
        grep -E '^lockd_(active_locks|leader_changes_total|raft_commit_index|raft_commit_duration_seconds_(sum|count)) ' |
        sed "s/^/node $i metric: /" >>"$info" || true
done
"$S" stop >/dev/null 2>&1 || true
echo "== $name"; cat "$info"; grep -v '^lockd-bench:  ' "$OUT/$name.err"
