#!/bin/bash
# Two fence-proxy builds side by side, in alternating rounds: pgbench (-M prepared) through each,
# unfenced and then fenced (PGOPTIONS='-c lockd.fence=bench/1:1'), the order of the two builds
# swapped every round, VACUUM of the updated tables and CHECKPOINT before every run (pgbench's
# own vacuum cannot run through the proxy). On a shared machine whose speed drifts
# between runs, rounds of short runs compared by their medians say more than one long run each.
#
#   fence-proxy/postgres/bench/pgbench-alternate.sh BASE_BINARY NEW_BINARY
#   ROUNDS=10 T=5 (seconds per run) C=4 J=2 (pgbench clients and threads)
#   MODE=prepared (pgbench -M: simple, extended or prepared)
#   DIRECT=1 also runs pgbench directly each round; REF_PORT=16544 also through a relay there
#
# Prints one line per run: round, label, tps, Postgres CPU per transaction (µs: the postmaster
# and its children, from /proc; a backend not yet reaped when the run ends makes a sample too
# low, so drop samples far below the others), failed transactions, the relay's CPU per
# transaction (µs, from /proc; 0 for direct, and for the reference unless REF_PID is given);
# then the sorted tps and the medians per label. Uses database pgbench_a (recreated at scale 1) and ports 16543 and 16545.
# See docs/benchmarks.md, "A prepared BEGIN in the client's place".
set -eu
[ $# -eq 2 ] || { echo "usage: $0 BASE_BINARY NEW_BINARY" >&2; exit 2; }
DB=pgbench_a; T=${T:-5}; ROUNDS=${ROUNDS:-10}; C=${C:-4}; J=${J:-2}; MODE=${MODE:-prepared}
HZ=$(getconf CLK_TCK)
createdb -h 127.0.0.1 -U postgres $DB 2>/dev/null || true
pgbench -h 127.0.0.1 -U postgres -i -s 1 -q $DB >/dev/null 2>&1
PM=$(head -1 "$(psql -h 127.0.0.1 -U postgres -d postgres -Atc 'SHOW data_directory')/postmaster.pid")
pg_ticks() {
  { awk '{print $14 + $15 + $16 + $17}' /proc/"$PM"/stat
    for c in $(pgrep -P "$PM"); do awk '{print $14 + $15}' /proc/"$c"/stat 2>/dev/null; done
  } | awk '{s += $1} END {print s + 0}'
}
"$1" postgres init --upstream "postgres://postgres@127.0.0.1:5432/$DB" >/dev/null
UP="postgres://postgres@127.0.0.1:5432/$DB?sslmode=disable"
# Plaintext on every leg, like the proxies' upstream legs: a direct pgbench would otherwise
# negotiate TLS with a server that offers it, and pay for it alone.
export PGSSLMODE=disable
"$1" postgres --listen 127.0.0.1:16543 --upstream "$UP" >/dev/null 2>&1 & BASE_PID=$!
"$2" postgres --listen 127.0.0.1:16545 --upstream "$UP" >/dev/null 2>&1 & NEW_PID=$!
trap 'kill $BASE_PID $NEW_PID 2>/dev/null' EXIT
sleep 1
OUT=$(mktemp)
relay_ticks() { # pid, or nothing
  [ -n "$1" ] && awk '{print $14 + $15}' /proc/"$1"/stat 2>/dev/null || echo 0
}
run() { # round label port PGOPTIONS [relay pid]
  # Every target starts from the same tables: pgbench's own vacuum (-n leaves it out) fails
  # through fence-proxy, which runs each statement in a transaction block, so it is done here.
  psql -h 127.0.0.1 -U postgres -d $DB -qc "VACUUM pgbench_branches, pgbench_tellers" \
    -c "TRUNCATE pgbench_history" -c CHECKPOINT
  local p0 p1 r0 r1 out tx tps failed
  p0=$(pg_ticks); r0=$(relay_ticks "${5:-}")
  out=$(PGOPTIONS="$4" pgbench -n -h 127.0.0.1 -p "$3" -U postgres -c "$C" -j "$J" -M "$MODE" -T "$T" $DB 2>&1)
  p1=$(pg_ticks); r1=$(relay_ticks "${5:-}")
  tx=$(echo "$out" | awk '/number of transactions actually processed/ {print $NF}' | cut -d/ -f1)
  tps=$(echo "$out" | awk '/^tps/ {printf "%.0f", $3}')
  failed=$(echo "$out" | awk '/number of failed/ {print $5}')
  awk -v r="$1" -v l="$2" -v tps="${tps:-0}" -v t=$((p1 - p0)) -v rt=$((r1 - r0)) -v hz="$HZ" -v n="${tx:-0}" -v f="${failed:-?}" \
    'BEGIN {printf "%s %s %s %.0f %s %.0f\n", r, l, tps, (n > 0 ? t / hz * 1e6 / n : 0), f, (n > 0 ? rt / hz * 1e6 / n : 0)}' | tee -a "$OUT"
}
FENCE="-c lockd.fence=bench/1:1"
echo "# $(date -u '+%Y-%m-%d %H:%M UTC'), load average $(cut -d' ' -f1-3 /proc/loadavg): round label tps pg_cpu_us_per_tx failed relay_cpu_us_per_tx"
for r in $(seq 1 "$ROUNDS"); do
  order="base new"; [ $((r % 2)) = 0 ] && order="new base"
  [ -n "${DIRECT:-}" ] && run "$r" direct 5432 ""
  [ -n "${REF_PORT:-}" ] && run "$r" reference "$REF_PORT" "" "${REF_PID:-}"
  for fence in unfenced fenced; do
    opts=""; [ $fence = fenced ] && opts=$FENCE
    for b in $order; do
      port=16543; pid=$BASE_PID; [ $b = new ] && port=16545 && pid=$NEW_PID
      run "$r" "$b-$fence" $port "$opts" $pid
    done
  done
done
echo "# end $(date -u '+%H:%M UTC'), load average $(cut -d' ' -f1-3 /proc/loadavg)"
median() { sort -n | awk '{v[NR] = $1} END {print (NR % 2 ? v[(NR + 1) / 2] : (v[NR / 2] + v[NR / 2 + 1]) / 2)}'; }
for label in $(awk '{print $2}' "$OUT" | sort -u); do
  printf '%s: tps%s; median %.0f tps, Postgres %.0f µs and relay %.0f µs of CPU per transaction\n' "$label" \
    "$(awk -v l="$label" '$2 == l {print $3}' "$OUT" | sort -n | tr '\n' ' ' | sed 's/^/ /; s/ $//')" \
    "$(awk -v l="$label" '$2 == l {print $3}' "$OUT" | median)" \
    "$(awk -v l="$label" '$2 == l {print $4}' "$OUT" | median)" \
    "$(awk -v l="$label" '$2 == l {print $6}' "$OUT" | median)"
done
rm -f "$OUT"
