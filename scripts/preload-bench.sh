#!/usr/bin/env bash
# Unmodified programs, plain TCP loopback against both ends under `smc run` (SMC-R over the
# shared-memory fabric), in the same run, alternating: redis-benchmark (SET/GET, 50 clients)
# and iperf3 (one stream, 5 s). Prints one line per measurement and the ratios.
#
# Usage: scripts/preload-bench.sh [path/to/smc] [rounds]   (default: target/release/smc, 2)
# Needs root (eBPF discovery) and redis-server, redis-benchmark, iperf3.
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

# $1: "" or "smc run"; prints Gbit/s of the receiver.
iperf_round() {
    local pre=($1)
    ${pre[@]+"${pre[@]}"} iperf3 -s -p 15299 -1 >/dev/null 2>&1 &
    local srv=$!
    sleep 0.5
    local out
    out=$(${pre[@]+"${pre[@]}"} iperf3 -c 127.0.0.1 -p 15299 -t 5 -f g 2>/dev/null | grep receiver)
    wait $srv 2>/dev/null || true
    echo "$out" | awk '{for (i = 1; i <= NF; i++) if ($i == "Gbits/sec") print $(i-1)}'
}

echo "# load average: $(cut -d' ' -f1-3 /proc/loadavg); smc: $SMC"
declare -a rs rg ri ps pg pi
for r in $(seq 1 "$ROUNDS"); do
    read -r s g < <(redis_round "")
    echo "round $r plain   redis SET $s GET $g"
    ps+=("$s"); pg+=("$g")
    read -r s g < <(redis_round "$SMC run")
    echo "round $r smc run redis SET $s GET $g"
    rs+=("$s"); rg+=("$g")
    i=$(iperf_round "")
    echo "round $r plain   iperf3 $i Gbit/s"
    pi+=("$i")
    i=$(iperf_round "$SMC run")
    echo "round $r smc run iperf3 $i Gbit/s"
    ri+=("$i")
done
ratio() { python3 -c 'import sys, statistics as s; a=[float(x) for x in sys.argv[1].split()]; b=[float(x) for x in sys.argv[2].split()]; print(f"{s.median(b)/s.median(a):.2f}x (median {s.median(b):.1f} vs {s.median(a):.1f})")' "$1" "$2"; }
echo "redis SET  smc run / plain: $(ratio "${ps[*]}" "${rs[*]}")"
echo "redis GET  smc run / plain: $(ratio "${pg[*]}" "${rg[*]}")"
echo "iperf3     smc run / plain: $(ratio "${pi[*]}" "${ri[*]}")"
echo "# load average at the end: $(cut -d' ' -f1-3 /proc/loadavg)"
