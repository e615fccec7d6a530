#!/bin/bash
# pgbench -c 4 -j 2 -M prepared through fence-proxy's Postgres front end, side by side in one run:
# direct, an optional reference relay, then for each given fence-proxy binary unfenced and fenced
# (every transaction fenced with PGOPTIONS='-c lockd.fence=bench/1:1'), then direct again.
#
#   fence-proxy/postgres/bench/pgbench.sh BIN [BIN...]      (T=30 seconds per run by default)
#   REF_PORT=16544 ... also runs through a relay already listening there (e.g. PgBouncer);
#   REF_PID=PID        ... and reports that relay's figures per transaction too
#   UPSTREAM_QUERY='?sslmode=disable' ... appended to the proxy's --upstream URL (the default,
#                      sslmode=prefer, encrypts the proxy's upstream leg when Postgres has ssl on);
#                      pgbench's own connections follow PGSSLMODE (export PGSSLMODE=disable to
#                      compare plaintext legs throughout, as pgbench-alternate.sh does)
#   BIN may be NAME=PATH to label a run, and a wrapper script that execs fence-proxy with other
#   settings (e.g. FENCE_PROXY_PG_THREADS=1) serves to compare them.
#
# Beside tps, each run reports the CPU time Postgres spent per transaction (the postmaster and all
# its children, exited ones included, from /proc), and each relay run what the relay process spent
# per transaction: context switches (all threads, from /proc), CPU time (user + system, /proc)
# and, when `perf` works, system calls (raw_syscalls:sys_enter). Figures per transaction stay far
# more stable than tps on a loaded machine.
#
# Uses database pgbench_a on 127.0.0.1:5432 (user postgres), recreated at scale 1, and proxy
# port 16543. See docs/benchmarks.md, "fence-proxy Postgres front end (pgbench)".
set -eu
DB=pgbench_a
T=${T:-30}
[ $# -ge 1 ] || { echo "usage: $0 FENCE_PROXY_BINARY [MORE...]" >&2; exit 2; }
CLK_TCK=$(getconf CLK_TCK)
PERF=0
if command -v perf >/dev/null && perf stat -e raw_syscalls:sys_enter -x, -o /dev/null true 2>/dev/null; then
  PERF=1
fi
createdb -h 127.0.0.1 -U postgres $DB 2>/dev/null || true
pgbench -h 127.0.0.1 -U postgres -i -s 1 -q $DB >/dev/null 2>&1

ctxsw() { # pid: voluntary + involuntary context switches of all its threads
  cat /proc/"$1"/task/*/status 2>/dev/null | awk '/^(non)?voluntary_ctxt_switches/ {s += $2} END {print s + 0}'
}
cputicks() { # pid: user + system CPU time, in clock ticks
  awk '{print $14 + $15}' /proc/"$1"/stat
}

POSTMASTER=$(head -1 "$(psql -h 127.0.0.1 -U postgres -d postgres -Atc 'SHOW data_directory')/postmaster.pid" 2>/dev/null || true)
pg_cputicks() { # CPU of the postmaster, its reaped children and its live children, in clock ticks
  [ -n "$POSTMASTER" ] && [ -r /proc/"$POSTMASTER"/stat ] || { echo 0; return; }
  { awk '{print $14 + $15 + $16 + $17}' /proc/"$POSTMASTER"/stat
    for c in $(pgrep -P "$POSTMASTER"); do awk '{print $14 + $15}' /proc/"$c"/stat 2>/dev/null; done
  } | awk '{s += $1} END {print s + 0}'
}

run() { # label port [PGOPTIONS] [relay pid]
  local out pid=${4:-} c0 t0 c1 t1 perf_out tx extra="" perf_pid="" p0 p1
  # Every run starts right after a checkpoint: the full-page images written after one cost
  # pgbench's random updates several times the WAL, so a checkpoint falling inside one run and
  # not another skews the comparison more than anything the relay does.
  # pgbench's own vacuum (-n leaves it out) fails through fence-proxy, which runs each statement
  # in a transaction block: every target gets the same vacuumed tables from here instead.
  psql -h 127.0.0.1 -U postgres -d $DB -qc "VACUUM pgbench_branches, pgbench_tellers" \
    -c "TRUNCATE pgbench_history" -c CHECKPOINT
  p0=$(pg_cputicks)
  if [ -n "$pid" ]; then
    c0=$(ctxsw "$pid"); t0=$(cputicks "$pid")
    if [ $PERF = 1 ]; then
      perf_out=$(mktemp)
      perf stat -e raw_syscalls:sys_enter -x, -o "$perf_out" -p "$pid" &
      perf_pid=$!
    fi
  fi
  out=$(PGOPTIONS="${3:-}" pgbench -n -h 127.0.0.1 -p "$2" -U postgres -c 4 -j 2 -M prepared -T "$T" $DB 2>&1)
  tx=$(echo "$out" | awk '/number of transactions actually processed/ {print $NF}' | cut -d/ -f1)
  p1=$(pg_cputicks)
  if [ "${tx:-0}" -gt 0 ] && [ "$p0" != 0 ]; then
    extra=$(awk -v t=$((p1 - p0)) -v hz="$CLK_TCK" -v n="$tx" 'BEGIN {printf ", Postgres per transaction: %.0f us CPU", t / hz * 1e6 / n}')
  fi
  if [ -n "$pid" ] && [ "${tx:-0}" -gt 0 ]; then
    c1=$(ctxsw "$pid"); t1=$(cputicks "$pid")
    extra=$extra$(awk -v c=$((c1 - c0)) -v t=$((t1 - t0)) -v hz="$CLK_TCK" -v n="$tx" \
      'BEGIN {printf ", relay per transaction: %.1f context switches, %.0f us CPU", c / n, t / hz * 1e6 / n}')
    if [ -n "$perf_pid" ]; then
      kill -INT "$perf_pid"; wait "$perf_pid" 2>/dev/null || true
      extra="$extra$(awk -F, -v n="$tx" '/raw_syscalls:sys_enter/ {printf ", %.1f system calls", $1 / n}' "$perf_out")"
      rm -f "$perf_out"
    fi
  elif [ -n "$perf_pid" ]; then
    kill -INT "$perf_pid"; wait "$perf_pid" 2>/dev/null || true
    rm -f "$perf_out"
  fi
  echo "$1: $(echo "$out" | grep -E '^tps' | sed 's/ (without.*//'), latency $(echo "$out" | grep 'latency average' | awk '{print $4,$5}'), failed $(echo "$out" | grep -E 'number of failed' | awk '{print $5}'), transactions ${tx:-?}$extra"
}
echo "# $(date -u '+%Y-%m-%d %H:%M UTC'), load average $(cut -d' ' -f1-3 /proc/loadavg), T=$T s per run, perf syscall counts: $PERF"
run direct 5432
[ -n "${REF_PORT:-}" ] && run "reference relay" "$REF_PORT" "" "${REF_PID:-}"
for spec in "$@"; do
  label=${spec%%=*}; bin=${spec#*=}
  "$bin" postgres init --upstream postgres://postgres@127.0.0.1:5432/$DB >/dev/null
  "$bin" postgres --listen 127.0.0.1:16543 --upstream "postgres://postgres@127.0.0.1:5432/$DB${UPSTREAM_QUERY:-}" >/dev/null 2>&1 &
  pid=$!
  trap 'kill $pid 2>/dev/null' EXIT
  sleep 1
  run "$label unfenced" 16543 "" "$pid"
  run "$label fenced" 16543 "-c lockd.fence=bench/1:1" "$pid"
  kill $pid; wait $pid 2>/dev/null || true
done
run direct 5432
echo "# end $(date -u '+%H:%M UTC'), load average $(cut -d' ' -f1-3 /proc/loadavg)"
