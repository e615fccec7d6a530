#!/usr/bin/env bash
# A three-process lockd cluster for benchmarks, on its own loopback address so that it never
# collides with the test clusters (which use random 127.x.y.z addresses) or `lockd dev`.
#
#   cluster3.sh start [LOCKD FLAGS...]   fresh data dirs, nodes on $IP:7001-7003, metrics :9101-9103
#   cluster3.sh stop                     SIGTERM every node started here (by pid file)
#   cluster3.sh kill ID                  kill -9 node ID
#   cluster3.sh leader                   id of the node whose metrics say lockd_is_leader 1
#   cluster3.sh rss                      VmRSS of each running node
#   cluster3.sh cpu                      utime+stime seconds of each running node (from /proc)
#   cluster3.sh endpoints                the --endpoints value for lockd-bench
#
#   cluster3.sh cacert                   the CA file to trust (BENCH_TLS=1), for lockd-bench --cacert
#
# Environment: LOCKD_BIN (default target/release/lockd), BENCH_IP (127.0.0.50),
# BENCH_DIR (/tmp/lockd-bench-cluster), RUST_LOG (default warn), BENCH_TLS (1 = a CA and node
# certificates made with openssl in $BENCH_DIR/tls, and TLS on every node and on the metrics).
set -euo pipefail

BIN=${LOCKD_BIN:-target/release/lockd}
IP=${BENCH_IP:-127.0.0.50}
DIR=${BENCH_DIR:-/tmp/lockd-bench-cluster}
cmd=${1:?usage: cluster3.sh start|stop|kill ID|leader|rss|cpu|endpoints|cacert}
shift

TLS=${BENCH_TLS:-0}
CA="$DIR/tls/ca.pem"
scheme() { if [ "$TLS" = 1 ]; then echo https; else echo http; fi; }
curl_tls() { if [ "$TLS" = 1 ]; then curl --cacert "$CA" "$@"; else curl "$@"; fi; }

# A throwaway CA and one certificate per node, as the README's openssl recipe.
make_certs() {
    local t="$DIR/tls"
    mkdir -p "$t"
    openssl req -x509 -newkey ec -pkeyopt ec_paramgen_curve:P-256 -nodes -days 2 \
        -subj "/CN=lockd bench CA" -keyout "$t/ca-key.pem" -out "$t/ca.pem" 2>/dev/null
    for i in 1 2 3; do
        openssl req -newkey ec -pkeyopt ec_paramgen_curve:P-256 -nodes -subj "/CN=lockd node $i" \
            -keyout "$t/node$i-key.pem" -out "$t/node$i.csr" 2>/dev/null
        printf "subjectAltName=DNS:node-%s.lockd.lockd,IP:%s\nextendedKeyUsage=serverAuth,clientAuth\n" \
            "$i" "$IP" >"$t/node$i.ext"
        openssl x509 -req -in "$t/node$i.csr" -CA "$t/ca.pem" -CAkey "$t/ca-key.pem" -days 2 \
            -out "$t/node$i.pem" -extfile "$t/node$i.ext" 2>/dev/null
    done
}

pid_of() { cat "$DIR/node$1.pid" 2>/dev/null || true; }
running() { local p; p=$(pid_of "$1"); [ -n "$p" ] && kill -0 "$p" 2>/dev/null; }

case "$cmd" in
start)
    for i in 1 2 3; do
        if running "$i"; then echo "cluster3.sh: node $i is already running (pid $(pid_of "$i"))" >&2; exit 1; fi
    done
    rm -rf "$DIR"
    mkdir -p "$DIR"
    if [ "$TLS" = 1 ]; then make_certs; fi
    for i in 1 2 3; do
        tls_flags=()
        if [ "$TLS" = 1 ]; then
            tls_flags=(--tls-cert "$DIR/tls/node$i.pem" --tls-key "$DIR/tls/node$i-key.pem" --peer-ca "$CA")
        fi
        RUST_LOG=${RUST_LOG:-warn} "$BIN" --id "$i" --listen "$IP:700$i" \
            --peer "1=$IP:7001" --peer "2=$IP:7002" --peer "3=$IP:7003" \
            --data-dir "$DIR/node$i" --metrics-listen "$IP:910$i" "${tls_flags[@]}" "$@" \
            >"$DIR/node$i.log" 2>&1 &
        echo $! >"$DIR/node$i.pid"
    done
    # Wait for a leader.
    for _ in $(seq 1 100); do
        if "$0" leader >/dev/null 2>&1; then exit 0; fi
        sleep 0.2
    done
    echo "cluster3.sh: no leader after 20s; logs in $DIR" >&2
    exit 1
    ;;
stop)
    for i in 1 2 3; do
        if running "$i"; then kill "$(pid_of "$i")"; fi
    done
    sleep 1
    for i in 1 2 3; do
        if running "$i"; then kill -9 "$(pid_of "$i")"; fi
        rm -f "$DIR/node$i.pid"
    done
    ;;
kill)
    id=${1:?usage: cluster3.sh kill ID}
    if running "$id"; then kill -9 "$(pid_of "$id")"; fi
    ;;
leader)
    for i in 1 2 3; do
        running "$i" || continue
        if curl_tls -s --max-time 1 "$(scheme)://$IP:910$i/metrics" | grep -q '^lockd_is_leader 1'; then
            echo "$i"
            exit 0
        fi
    done
    exit 1
    ;;
rss)
    for i in 1 2 3; do
        running "$i" || continue
        echo "node $i pid $(pid_of "$i") $(grep VmRSS "/proc/$(pid_of "$i")/status" | tr -s ' ')"
    done
    ;;
cpu)
    tck=$(getconf CLK_TCK)
    for i in 1 2 3; do
        running "$i" || continue
        awk -v id="$i" -v t="$tck" '{printf "node %s cpu %.2f s\n", id, ($14+$15)/t}' "/proc/$(pid_of "$i")/stat"
    done
    ;;
endpoints)
    echo "$IP:7001,$IP:7002,$IP:7003"
    ;;
cacert)
    echo "$CA"
    ;;
*)
    echo "cluster3.sh: unknown command $cmd" >&2
    exit 2
    ;;
esac
