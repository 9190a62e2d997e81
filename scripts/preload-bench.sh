#!/usr/bin/env bash
# Unmodified programs, plain TCP loopback against both ends under `smc run` (SMC-R over the
# shared-memory fabric), in the same run, alternating: redis-benchmark (SET/GET, 50 clients),
# iperf3 (one stream, and -P 4; 5 s), nginx (2 workers) + wrk (1 KiB file, 2 threads,
# 32 connections, 5 s), sockperf ping-pong (--tcp, 64 B, 5 s; the p50 of the one-way latency
# it reports), and the cost for programs without SMC sockets (dd with 1-byte blocks: 6 million
# read/write calls through the library; a CPU-bound python3 loop, its start included).
# Prints one line per measurement and the ratios of the medians.
#
# Usage: scripts/preload-bench.sh [path/to/smc] [rounds]   (default: target/release/smc, 2)
# Needs root (eBPF discovery) and redis-server, redis-benchmark, iperf3, nginx, wrk, sockperf.
set -euo pipefail
cd "$(dirname "$0")/.."
SMC=$(realpath "${1:-target/release/smc}")
ROUNDS=${2:-2}
work=$(mktemp -d)
export SMC_FABRIC_DIR="$work/fabric" SMC_DISCOVERY=ebpf
trap 'kill $(jobs -p) 2>/dev/null || true; wait 2>/dev/null || true; rm -rf "$work"' EXIT

wait_port() {
    for _ in $(seq 1 100); do
        (exec 3<>"/dev/tcp/127.0.0.1/$1") 2>/dev/null && return 0
        sleep 0.05
    done
    echo "nothing on port $1" >&2
    exit 1
}

# A server that would take a probe connection for a client (iperf3 -1, sockperf): wait for
# its listening socket in ss instead.
wait_listen() {
    for _ in $(seq 1 100); do
        ss -Htln "sport = :$1" | grep -q . && return 0
        sleep 0.05
    done
    echo "nothing listens on port $1" >&2
    exit 1
}

# $1: "" (plain) or "smc run"; prints "SET GET" requests per second.
redis_round() {
    local pre=($1)
    ${pre[@]+"${pre[@]}"} redis-server --port 16399 --save '' --appendonly no --dir "$work" >/dev/null 2>&1 &
    local srv=$!
    wait_port 16399
    local out
    out=$(${pre[@]+"${pre[@]}"} redis-benchmark -p 16399 -t set,get -n 100000 -c 50 -q 2>/dev/null | tr '\r' '\n' | grep "requests per second")
    kill $srv; wait $srv 2>/dev/null || true
    echo "$out" | awk '/^SET/ {s=$2} /^GET/ {g=$2} END {print s, g}'
}

# $1: "" or "smc run", $2: more iperf3 client options; prints the receiver's Gbit/s (the
# sum of the streams).
iperf_round() {
    local pre=($1)
    ${pre[@]+"${pre[@]}"} iperf3 -s -p 15299 -1 >/dev/null 2>&1 &
    local srv=$!
    wait_listen 15299
    local out
    # shellcheck disable=SC2086 # $2: several options
    out=$(${pre[@]+"${pre[@]}"} iperf3 -c 127.0.0.1 -p 15299 -t 5 -f g $2 2>/dev/null | grep receiver | tail -1)
    wait $srv 2>/dev/null || true
    echo "$out" | awk '{for (i = 1; i <= NF; i++) if ($i == "Gbits/sec") print $(i-1)}'
}

mkdir -p "$work/nginx" "$work/www"
head -c 1024 /dev/urandom >"$work/www/k1"
cat >"$work/nginx/nginx.conf" <<EOF
daemon off;
master_process on;
worker_processes 2;
user root;
pid $work/nginx/nginx.pid;
error_log $work/nginx/error.log;
events { worker_connections 1024; }
http {
    access_log off;
    sendfile on;
    tcp_nopush on;
    client_body_temp_path $work/nginx;
    proxy_temp_path $work/nginx;
    fastcgi_temp_path $work/nginx;
    uwsgi_temp_path $work/nginx;
    scgi_temp_path $work/nginx;
    server {
        listen 127.0.0.1:18089;
        root $work/www;
    }
}
EOF

# $1: "" or "smc run"; prints wrk's requests per second for the 1 KiB file; fails on
# socket errors or non-2xx answers (wrk prints those lines only when there were any).
wrk_round() {
    local pre=($1)
    ${pre[@]+"${pre[@]}"} nginx -c "$work/nginx/nginx.conf" -p "$work/nginx" &
    local srv=$!
    wait_port 18089
    local out
    out=$(${pre[@]+"${pre[@]}"} wrk -t2 -c32 -d5s http://127.0.0.1:18089/k1 2>&1)
    kill $srv; wait $srv 2>/dev/null || true
    if grep -q "Socket errors\|Non-2xx" <<<"$out"; then
        echo "wrk: $out" >&2
        exit 1
    fi
    awk '/^Requests\/sec/ {print $2}' <<<"$out"
}

# $1: "" or "smc run"; prints sockperf's p50 (µs, one way) of 64 B ping-pong over TCP
# sockets; fails when a message was lost. A fresh port each time: sockperf binds without
# SO_REUSEADDR.
spport=$((12000 + RANDOM % 400 * 8))
sockperf_round() {
    local pre=($1)
    ${pre[@]+"${pre[@]}"} sockperf sr --tcp -i 127.0.0.1 -p "$2" >/dev/null 2>&1 &
    local srv=$!
    wait_listen "$2"
    local out
    out=$(${pre[@]+"${pre[@]}"} sockperf pp --tcp -i 127.0.0.1 -p "$2" -t 5 -m 64 2>&1)
    kill $srv; wait $srv 2>/dev/null || true
    if ! grep -q "# dropped messages = 0; # duplicated messages = 0; # out-of-order messages = 0" <<<"$out"; then
        echo "sockperf: $out" >&2
        exit 1
    fi
    grep -o "percentile 50.000 = *[0-9.]*" <<<"$out" | awk '{print $NF}'
}

# $1: "" or "smc run", then the command; prints its wall-clock seconds.
seconds() {
    local pre=($1)
    shift
    local t0 t1
    t0=$(date +%s.%N)
    ${pre[@]+"${pre[@]}"} "$@" >/dev/null 2>&1
    t1=$(date +%s.%N)
    python3 -c 'import sys; print(f"{float(sys.argv[2]) - float(sys.argv[1]):.3f}")' "$t0" "$t1"
}

loop='sum(i * i for i in range(10000000))'
echo "# load average: $(cut -d' ' -f1-3 /proc/loadavg); smc: $SMC; $(nproc) cores"
declare -a ps pg rs rg pi ri pi4 ri4 pw rw pp rp pd rd py ry
for r in $(seq 1 "$ROUNDS"); do
    read -r s g < <(redis_round "")
    echo "round $r plain   redis SET $s GET $g"
    ps+=("$s"); pg+=("$g")
    read -r s g < <(redis_round "$SMC run")
    echo "round $r smc run redis SET $s GET $g"
    rs+=("$s"); rg+=("$g")
    i=$(iperf_round "" ""); echo "round $r plain   iperf3 $i Gbit/s"; pi+=("$i")
    i=$(iperf_round "$SMC run" ""); echo "round $r smc run iperf3 $i Gbit/s"; ri+=("$i")
    i=$(iperf_round "" "-P 4"); echo "round $r plain   iperf3 -P 4 $i Gbit/s"; pi4+=("$i")
    i=$(iperf_round "$SMC run" "-P 4"); echo "round $r smc run iperf3 -P 4 $i Gbit/s"; ri4+=("$i")
    w=$(wrk_round ""); echo "round $r plain   nginx+wrk 1 KiB $w req/s"; pw+=("$w")
    w=$(wrk_round "$SMC run"); echo "round $r smc run nginx+wrk 1 KiB $w req/s"; rw+=("$w")
    l=$(sockperf_round "" $((spport + 2 * r))); echo "round $r plain   sockperf pp 64 B p50 $l us"; pp+=("$l")
    l=$(sockperf_round "$SMC run" $((spport + 2 * r + 1))); echo "round $r smc run sockperf pp 64 B p50 $l us"; rp+=("$l")
    t=$(seconds "" dd if=/dev/zero of=/dev/null bs=1 count=3000000); echo "round $r plain   dd bs=1 x3M $t s"; pd+=("$t")
    t=$(seconds "$SMC run" dd if=/dev/zero of=/dev/null bs=1 count=3000000); echo "round $r smc run dd bs=1 x3M $t s"; rd+=("$t")
    t=$(seconds "" python3 -c "$loop"); echo "round $r plain   python3 loop $t s"; py+=("$t")
    t=$(seconds "$SMC run" python3 -c "$loop"); echo "round $r smc run python3 loop $t s"; ry+=("$t")
done
ratio() { python3 -c 'import sys, statistics as s; a=[float(x) for x in sys.argv[1].split()]; b=[float(x) for x in sys.argv[2].split()]; print(f"{s.median(b)/s.median(a):.2f}x (median {s.median(b):.4g} vs {s.median(a):.4g})")' "$1" "$2"; }
echo "redis SET             smc run / plain: $(ratio "${ps[*]}" "${rs[*]}")  goal >= 1.4x"
echo "redis GET             smc run / plain: $(ratio "${pg[*]}" "${rg[*]}")  goal >= 1.4x"
echo "iperf3                smc run / plain: $(ratio "${pi[*]}" "${ri[*]}")  goal >= 1.5x"
echo "iperf3 -P 4           smc run / plain: $(ratio "${pi4[*]}" "${ri4[*]}")  goal >= 1.5x"
echo "nginx+wrk 1 KiB       smc run / plain: $(ratio "${pw[*]}" "${rw[*]}")  goal >= 1.35x"
echo "sockperf pp 64 B p50  smc run / plain: $(ratio "${pp[*]}" "${rp[*]}")  goal <= 0.33x"
echo "dd bs=1 (no sockets)  smc run / plain: $(ratio "${pd[*]}" "${rd[*]}")  goal <= 1.02x"
echo "python3 (no sockets)  smc run / plain: $(ratio "${py[*]}" "${ry[*]}")  goal <= 1.02x"
echo "# load average at the end: $(cut -d' ' -f1-3 /proc/loadavg)"
