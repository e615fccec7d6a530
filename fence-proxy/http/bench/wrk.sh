#!/bin/bash
# fence-proxy http against nginx (issue 17), side by side in one run: wrk -t2 -c32 against an
# nginx `return 200` upstream directly, through nginx as a plain reverse proxy, and through each
# given fence-proxy binary (redb store, a fresh file per binary):
#
#   GET      pass-through reads
#   PUT      fenced writes, a distinct Lock-Resource per request (token 1): one token raise each
#   holder   16 parallel writers of one holder (one resource, one token), wrk -t2 -c16
#
#   fence-proxy/http/bench/wrk.sh NAME=BIN [NAME=BIN...]     (D=10s per run by default)
#
# nginx runs from its own config in a temp dir on loopback ports picked here; everything started
# here is stopped by PID on exit. Needs wrk and nginx (Debian: apt-get install wrk nginx-light).
# Prints one markdown table: req/s, p50/p99 from wrk --latency, the ratio to nginx's reverse
# proxy for the same load, and the p99 added over wrk direct.
set -eu
D=${D:-10s}
THREADS=${THREADS:-2}
CONNS=${CONNS:-32}
HOLDER_CONNS=${HOLDER_CONNS:-16}
[ $# -ge 1 ] || { echo "usage: $0 NAME=FENCE_PROXY_BINARY [...]" >&2; exit 2; }
command -v wrk >/dev/null || { echo "wrk not found" >&2; exit 2; }
NGINX=${NGINX:-$(command -v nginx || echo /usr/sbin/nginx)}
[ -x "$NGINX" ] || { echo "nginx not found" >&2; exit 2; }

TMP=$(mktemp -d)
PIDS=()
cleanup() {
  for pid in "${PIDS[@]}"; do
    kill "$pid" 2>/dev/null || true
  done
  for pid in "${PIDS[@]}"; do
    wait "$pid" 2>/dev/null || true
  done
  rm -rf "$TMP"
}
trap cleanup EXIT

free_port() {
  python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'
}
wait_port() { # port: until something accepts on it (5 s at most)
  for _ in $(seq 50); do
    (echo > /dev/tcp/127.0.0.1/"$1") 2>/dev/null && return 0
    sleep 0.1
  done
  echo "nothing listens on $1" >&2
  exit 1
}

# nginx in the foreground (daemon off), so that $! is the master's PID.
start_nginx() { # name port server-block
  local dir=$TMP/$1
  mkdir -p "$dir"
  cat > "$dir/nginx.conf" <<EOF
worker_processes auto;
pid $dir/nginx.pid;
error_log $dir/error.log warn;
events { worker_connections 4096; }
http {
  access_log off;
  client_body_temp_path $dir;
  proxy_temp_path $dir;
  fastcgi_temp_path $dir;
  uwsgi_temp_path $dir;
  scgi_temp_path $dir;
  keepalive_requests 1000000;
  $3
}
EOF
  "$NGINX" -p "$dir" -c "$dir/nginx.conf" -g 'daemon off;' &
  PIDS+=($!)
  wait_port "$2"
}

UP=$(free_port)
start_nginx upstream "$UP" "server { listen 127.0.0.1:$UP; location / { return 200 \"ok\\n\"; } }"
RP=$(free_port)
start_nginx reverse "$RP" "upstream u { server 127.0.0.1:$UP; keepalive 64; }
  server { listen 127.0.0.1:$RP; location / { proxy_pass http://u; proxy_http_version 1.1; proxy_set_header Connection \"\"; } }"

cat > "$TMP/distinct.lua" <<'EOF'
-- A distinct Lock-Resource per request, token 1: every write raises a token.
local next_thread = 0
function setup(thread)
  thread:set("thread_id", next_thread)
  next_thread = next_thread + 1
end
local n = 0
function request()
  n = n + 1
  return wrk.format("PUT", "/obj", {
    ["Lock-Resource"] = string.format("bench/%s/%d/%d", run_id, thread_id, n),
    ["Fencing-Token"] = "1",
  }, "x")
end
EOF
cat > "$TMP/holder.lua" <<'EOF'
-- One holder: one resource, one token, from every connection.
wrk.method = "PUT"
wrk.body = "x"
wrk.headers["Lock-Resource"] = "bench/holder"
wrk.headers["Fencing-Token"] = "7"
EOF

# One wrk run; prints "req/s p50 p99 non-2xx" (latencies in ms).
measure() { # url conns [script]
  local out
  out=$(wrk -t"$THREADS" -c"$2" -d"$D" --latency ${3:+-s "$3"} "$1" 2>&1)
  echo "$out" >> "$TMP/wrk.log"
  echo "$out" | awk '
    function ms(v) {
      if (v ~ /us$/) { sub(/us$/, "", v); return v / 1000 }
      if (v ~ /ms$/) { sub(/ms$/, "", v); return v + 0 }
      if (v ~ /s$/)  { sub(/s$/, "", v);  return v * 1000 }
      return v
    }
    /Requests\/sec:/ { rps = $2 }
    $1 == "50%" { p50 = ms($2) }
    $1 == "99%" { p99 = ms($2) }
    /Non-2xx or 3xx responses:/ { bad = $NF }
    /Socket errors:/ { bad = bad "+sock" }
    END { printf "%d %.2f %.2f %s\n", rps, p50, p99, (bad == "" ? 0 : bad) }'
}

ROWS=$TMP/rows
: > "$ROWS"
row() { # label kind figures...
  echo "$1|$2|$3 $4 $5 $6" >> "$ROWS"
}

run_target() { # label base-url
  local label=$1 url=$2 run_id=$RANDOM$RANDOM
  row "$label" GET $(measure "$url/obj" "$CONNS")
  sed "s/run_id/\"$run_id\"/" "$TMP/distinct.lua" > "$TMP/distinct-$run_id.lua"
  row "$label" PUT $(measure "$url/obj" "$CONNS" "$TMP/distinct-$run_id.lua")
  row "$label" holder $(measure "$url/obj" "$HOLDER_CONNS" "$TMP/holder.lua")
}

echo "# $(date -u '+%Y-%m-%d %H:%M UTC'), load average $(cut -d' ' -f1-3 /proc/loadavg), $(nproc) CPUs, wrk -t$THREADS -c$CONNS (holder: -c$HOLDER_CONNS) -d$D, nginx $("$NGINX" -v 2>&1 | sed 's/.*nginx\///')"
run_target direct "http://127.0.0.1:$UP"
run_target nginx "http://127.0.0.1:$RP"
for spec in "$@"; do
  label=${spec%%=*}
  bin=${spec#*=}
  port=$(free_port)
  mport=$(free_port)
  "$bin" http --listen "127.0.0.1:$port" --upstream "http://127.0.0.1:$UP" \
    --store "redb:$TMP/epochs-$label.redb" --metrics-listen "127.0.0.1:$mport" \
    > "$TMP/proxy-$label.log" 2>&1 &
  PIDS+=($!)
  pid=$!
  wait_port "$port"
  run_target "$label" "http://127.0.0.1:$port"
  kill "$pid"
  wait "$pid" 2>/dev/null || true
done
run_target "direct (again)" "http://127.0.0.1:$UP"

# The table: ratio to nginx's reverse proxy and p99 added over direct, per kind of load.
awk -F'|' '
  { split($3, f, " "); label[NR] = $1; kind[NR] = $2; rps[NR] = f[1]; p50[NR] = f[2]; p99[NR] = f[3]; bad[NR] = f[4]
    if ($1 == "direct") { d99[$2] = f[3] }
    if ($1 == "nginx") { n[$2] = f[1] } }
  END {
    print "| run | load | req/s | p50 ms | p99 ms | of nginx | p99 added ms | non-2xx |"
    print "|---|---|---|---|---|---|---|---|"
    for (i = 1; i <= NR; i++) {
      ratio = (n[kind[i]] > 0) ? sprintf("%.0f %%", 100 * rps[i] / n[kind[i]]) : "-"
      added = (label[i] ~ /^direct/) ? "-" : sprintf("%.2f", p99[i] - d99[kind[i]])
      printf "| %s | %s | %d | %.2f | %.2f | %s | %s | %s |\n", label[i], kind[i], rps[i], p50[i], p99[i], ratio, added, bad[i]
    }
  }' "$ROWS"
if [ -n "${KEEP_LOG:-}" ]; then cp "$TMP/wrk.log" "$KEEP_LOG"; fi
