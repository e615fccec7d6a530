#!/usr/bin/env bash
# Instructions per lock operation on each node, counted by callgrind: exact and repeatable on a
# shared machine where CPU seconds are not (and where `perf stat` has no hardware counters).
#
#   callgrind-per-op.sh NAME [--target leader|any] [--rate R] [--duration D] [--lockd "FLAGS"]
#
# Starts three release `lockd` processes, each under `valgrind --tool=callgrind`, on $CG_IP
# (default 127.0.0.51, so it collides neither with cluster3.sh nor with the tests), and waits for a
# leader. Then, on every node at once:
#   1. idle window: counters zeroed, $IDLE seconds of nothing, counters dumped (heartbeats, timers,
#      metrics upkeep: what a node costs with no client);
#   2. load window: counters zeroed, one `lockd-bench mixed` run (its warmup, the measured part and
#      the release of the leases still held at the end), counters dumped.
# Instructions per operation of a node = (load Ir - idle Ir per second x load seconds) / every call
# the bench made (`calls_total` of its JSON line). `--target leader` (the default here, although
# lockd-bench's own default is `any`, so that earlier figures stay reproducible) sends every call
# to the leader; `--target any` spreads them over the three nodes, so followers forward two thirds
# of them (the forwarding path). The rate must stay well below what the nodes manage under callgrind
# (about 50x slower than native); the default 100 ops/s does, with few enough commands per Raft
# entry that the per-entry costs weigh more than at 6,000 ops/s: the script prints commands per
# entry so that runs can be compared.
#
# Results go to $OUT/NAME/: summary.txt (the figures), node<i>.{idle,load}.cg (callgrind files;
# `callgrind_annotate --inclusive=yes FILE` for the profile), bench.json/err and node logs.
#
# Environment: LOCKD_BIN (default target/release/lockd), BENCH_BIN (target/release/lockd-bench),
# OUT (/tmp/callgrind-per-op), CG_IP, CG_DIR (/tmp/lockd-callgrind, data dirs), NICE (19),
# IDLE (20 s), RUST_LOG (warn).
set -euo pipefail

BIN=${LOCKD_BIN:-target/release/lockd}
B=${BENCH_BIN:-target/release/lockd-bench}
OUT=${OUT:-/tmp/callgrind-per-op}
IP=${CG_IP:-127.0.0.51}
DIR=${CG_DIR:-/tmp/lockd-callgrind}
NICE=${NICE:-19}
IDLE=${IDLE:-20}
name=${1:?usage: callgrind-per-op.sh NAME [--target leader|any] [--rate R] [--duration D] [--lockd FLAGS]}
shift
# Always passed to the bench explicitly: its own default is `any`.
target=leader
rate=100
duration=100s
# Slow nodes under callgrind: a heartbeat (openraft 0.9's AppendEntries timeout too) and an
# election timeout that a node 50x slower still meets, so that no election disturbs the run.
lockd_flags="--heartbeat 1s --election-timeout 3s"
while [ $# -gt 0 ]; do
    case "$1" in
    --target) target=$2; shift 2 ;;
    --rate) rate=$2; shift 2 ;;
    --duration) duration=$2; shift 2 ;;
    --lockd) lockd_flags="$lockd_flags $2"; shift 2 ;;
    *) echo "callgrind-per-op.sh: unknown option $1" >&2; exit 2 ;;
    esac
done
case "$target" in leader | any) ;; *) echo "callgrind-per-op.sh: --target $target must be leader or any" >&2; exit 2 ;; esac
for tool in valgrind callgrind_control curl jq; do
    command -v "$tool" >/dev/null || { echo "callgrind-per-op.sh: $tool not found" >&2; exit 1; }
done
[ -x "$BIN" ] || { echo "callgrind-per-op.sh: LOCKD_BIN $BIN is not an executable" >&2; exit 1; }
[ -x "$B" ] || { echo "callgrind-per-op.sh: BENCH_BIN $B is not an executable" >&2; exit 1; }

# Two runs at once would share ports and data dirs (and the second would delete the first's).
for i in 1 2 3; do
    if curl -s --max-time 2 -o /dev/null "http://$IP:910$i/metrics"; then
        echo "callgrind-per-op.sh: something already answers on $IP:910$i (another run?)" >&2
        exit 1
    fi
done
res="$OUT/$name"
rm -rf "$res" "$DIR"
mkdir -p "$res" "$DIR"
pids=()
stop() {
    for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done
    sleep 2
    for p in "${pids[@]}"; do kill -9 "$p" 2>/dev/null || true; done
}
trap stop EXIT

metric() { # node name -> value (empty when the node does not answer, after a few tries)
    local v _
    for _ in 1 2 3; do
        v=$(curl -s --max-time 10 "http://$IP:910$1/metrics" 2>/dev/null | awk -v m="$2" '$1 == m {print $2; exit}' || true)
        if [ -n "$v" ]; then echo "$v"; return 0; fi
        sleep 1
    done
}

for i in 1 2 3; do
    # shellcheck disable=SC2086
    RUST_LOG=${RUST_LOG:-warn} nice -n "$NICE" valgrind --tool=callgrind \
        --callgrind-out-file="$DIR/cg.node$i" --collect-atstart=yes \
        "$BIN" --id "$i" --listen "$IP:700$i" \
        --peer "1=$IP:7001" --peer "2=$IP:7002" --peer "3=$IP:7003" \
        --data-dir "$DIR/node$i" --metrics-listen "$IP:910$i" $lockd_flags \
        >"$res/node$i.log" 2>&1 &
    pids+=($!)
done
leader=""
for _ in $(seq 1 300); do
    for i in 1 2 3; do
        if [ "$(metric "$i" lockd_is_leader)" = 1 ]; then leader=$i; break 2; fi
    done
    sleep 1
done
[ -n "$leader" ] || { echo "callgrind-per-op.sh: no leader after 300 s; logs in $res" >&2; exit 1; }
# Let the new leader's first entries (membership, clock anchor, signing key) settle.
sleep 5

# callgrind_control, retried: on a loaded machine vgdb sometimes does not reach the process.
cg() {
    local _
    for _ in 1 2 3 4 5; do
        if callgrind_control "$@" >/dev/null 2>&1; then return 0; fi
        sleep 2
    done
    echo "callgrind-per-op.sh: callgrind_control $* failed 5 times" >&2
    return 1
}

# Zero (-z) or dump (-d) the counters of every node; dumps are renamed to $res/node<i>.<what>.cg.
control() {
    local what=$1 i
    for i in 1 2 3; do
        if [ "$what" = zero ]; then
            cg -z "${pids[$((i - 1))]}"
        else
            rm -f "$DIR/cg.node$i".*
            cg -d "$what" "${pids[$((i - 1))]}"
            local f
            for _ in $(seq 1 60); do
                f=$(ls "$DIR/cg.node$i".* 2>/dev/null | head -1 || true)
                [ -n "$f" ] && grep -q '^totals:' "$f" 2>/dev/null && break
                sleep 1
            done
            mv "$f" "$res/node$i.$what.cg"
        fi
    done
}
total_ir() { awk '/^summary:/ {print $2}' "$1"; }

control zero
t0=$(date +%s.%N)
sleep "$IDLE"
control idle
t1=$(date +%s.%N)
idle_s=$(echo "$t1 - $t0" | bc)

declare -A entries_before
for i in 1 2 3; do entries_before[$i]=$(metric "$i" lockd_raft_commit_index); done
control zero
t0=$(date +%s.%N)
nice -n "$NICE" "$B" --endpoints "$IP:7001,$IP:7002,$IP:7003" --target "$target" --no-progress \
    mixed --rate "$rate" --duration "$duration" --warmup 2s --resources 10000 \
    >"$res/bench.json" 2>"$res/bench.err"
control load
t1=$(date +%s.%N)
load_s=$(echo "$t1 - $t0" | bc)
entries_after=$(metric "$leader" lockd_raft_commit_index)

calls=$(jq .calls_total "$res/bench.json")
errors=$(jq '.errors + .warmup_errors' "$res/bench.json")
# Raft entries committed in the window: the leader's commit index moved by that much. A metrics
# read that failed leaves it unknown (the leader's number of proposer::stamped calls in its load
# file is the same figure).
entries=$((${entries_after:-0} - ${entries_before[$leader]:-0}))
[ -n "$entries_after" ] && [ -n "${entries_before[$leader]}" ] || entries=0
{
    echo "name $name: target $target, rate $rate ops/s, duration $duration, lockd flags: $lockd_flags"
    echo "binary $(realpath "$BIN") ($(stat -c %y "$BIN"))"
    if [ "$entries" -gt 0 ]; then
        echo "calls $calls (errors $errors), raft entries $entries, commands per entry $(echo "scale=1; $calls / $entries" | bc)"
    else
        echo "calls $calls (errors $errors), raft entries unknown (a metrics read failed)"
    fi
    echo "idle window ${idle_s}s, load window ${load_s}s"
    for i in 1 2 3; do
        role=follower
        [ "$i" = "$leader" ] && role=leader
        idle=$(total_ir "$res/node$i.idle.cg")
        load=$(total_ir "$res/node$i.load.cg")
        net=$(echo "$load - $idle / $idle_s * $load_s" | bc -l)
        printf "node %s %-8s load Ir %d, idle Ir/s %d, net Ir per op %d\n" "$i" "$role" "$load" \
            "$(echo "$idle / $idle_s" | bc)" "$(echo "$net / $calls" | bc)"
    done
} | tee "$res/summary.txt"
