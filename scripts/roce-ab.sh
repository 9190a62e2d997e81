#!/usr/bin/env bash
# Alternating A/B of builds of `smc` over the software RoCEv2 device (issue #21), the way the
# figures of docs/performance.md "One datagram per update" were taken: two network namespaces
# joined by one veth pair (MTU 1500), each round runs every binary over SMC-R and then the first
# binary over TCP (SMC_DISCOVERY=off), so that the VM's slow and fast phases hit all alike.
#
#   scripts/roce-ab.sh stream ROUNDS MIB BIN...      # smc nc -l > /dev/null  <-  smc nc < /dev/shm file
#   scripts/roce-ab.sh pingpong ROUNDS SIZE BIN...   # smc nc --pingpong SIZE --time 1 against --echo
#
# stream prints MB/s (client start to both exits) and each side's CPU ms (user space's share in
# parentheses) and context switches (`perf stat`, needs perf); pingpong prints the client's line
# (p50_us, p99_us). Root only.
# ROCE_AB_CPUS="SERVER CLIENT" pins pingpong's echo server and client (taskset CPU lists, e.g.
# "0 1" on two CPUs, "0 0" on one); unset, the scheduler places them.
# ROCE_AB_MTU sets the veth's MTU (default 1500: path MTU 1024; 4176 or more: path MTU 4096).
# Copy each build aside (cp target/release/smc /tmp/smc-a) before rebuilding.
set -euo pipefail
[ "$(id -u)" = 0 ] || { echo "roce-ab: needs root (network namespaces)" >&2; exit 77; }
mode=$1
rounds=$2
arg=$3
shift 3
bins=("$@")
[ ${#bins[@]} -ge 1 ] || { echo "usage: see the head of $0" >&2; exit 2; }

a=roceab-a$$
b=roceab-b$$
dir=$(mktemp -d /tmp/roce-ab.XXXXXX)
cleanup() {
    ip netns del "$a" 2>/dev/null || true
    ip netns del "$b" 2>/dev/null || true
    rm -rf "$dir"
}
trap cleanup EXIT
[ -n "${ROCE_AB_KEEP:-}" ] && trap - EXIT
ip netns add "$a"
ip netns add "$b"
ip link add rab0 netns "$a" type veth peer name rab1 netns "$b"
ip -n "$a" addr add 10.79.1.1/24 dev rab0
ip -n "$b" addr add 10.79.1.2/24 dev rab1
for n in "$a" "$b"; do ip -n "$n" link set lo up; done
ip -n "$a" link set rab0 mtu "${ROCE_AB_MTU:-1500}"
ip -n "$b" link set rab1 mtu "${ROCE_AB_MTU:-1500}"
ip -n "$a" link set rab0 up
ip -n "$b" link set rab1 up
# A connection made within moments of the links coming up may run over TCP (seen for the first
# round): let them settle.
sleep 1

# ns side discovery bin args...
nc_in() {
    local ns=$1 side=$2 disc=$3 bin=$4 dev
    shift 4
    dev=rab0
    [ "$side" = b ] && dev=rab1
    ip netns exec "$ns" env SMC_IPV4_SUBNETS=10.79.0.0/16 SMC_DISCOVERY="$disc" \
        SMC_FABRIC_DEVICES="roce:r0=$dev" SMC_FABRIC_DIR="$dir/$side" "$@"
}

# CPU ms (of which user space: "u"), context switches.
stat_of() {
    awk -F, '/task-clock/ {printf "%.0f ms", $1} /user_time/ {printf " (%.0f u)", $1 / 1e6}
        /context-switches/ {printf " %s cs", $1}' "$1"
}

stream() {
    local bin=$1 disc=$2 label=$3 file=$dir/in.bin sp t0 t1
    [ -f "$file" ] || head -c $((arg << 20)) /dev/urandom >"$file"
    nc_in "$a" a "$disc" "$bin" perf stat -x, -e task-clock,context-switches,user_time -o "$dir/srv.stat" \
        "$bin" nc -v -l 7000 --bind 10.79.1.1 >/dev/null 2>"$dir/srv.err" &
    sp=$!
    # Until the listener listens (under load a fixed 0.3 s was not always enough: the client's
    # "connection refused" ended the series), at most 5 s.
    for _ in $(seq 1 50); do
        ip netns exec "$a" ss -Hltn 'sport = :7000' | grep -q . && break
        sleep 0.1
    done
    t0=$(date +%s.%N)
    nc_in "$b" b "$disc" "$bin" perf stat -x, -e task-clock,context-switches,user_time -o "$dir/cli.stat" \
        "$bin" nc -v 10.79.1.1 7000 <"$file" >/dev/null 2>"$dir/cli.err"
    wait "$sp"
    t1=$(date +%s.%N)
    printf '%-6s %8.1f MB/s  sender %s  receiver %s\n' "$label" \
        "$(echo "$arg * 1048576 / ($t1 - $t0) / 1000000" | bc -l)" \
        "$(stat_of "$dir/cli.stat")" "$(stat_of "$dir/srv.stat")"
}

# Kill each process given and wait until it is gone (at most 5 s each).
kill_and_wait() {
    local p
    for p in "$@"; do kill "$p" 2>/dev/null || true; done
    for p in "$@"; do
        for _ in $(seq 1 100); do
            kill -0 "$p" 2>/dev/null || break
            sleep 0.05
        done
    done
}

pingpong() {
    local bin=$1 disc=$2 label=$3 sp out s c pin_s=() pin_c=()
    if [ -n "${ROCE_AB_CPUS:-}" ]; then
        read -r s c <<<"$ROCE_AB_CPUS"
        pin_s=(taskset -c "$s")
        pin_c=(taskset -c "$c")
    fi
    local st=()
    command -v perf >/dev/null && st=(perf stat -x, -e task-clock,context-switches,user_time)
    nc_in "$a" a "$disc" "$bin" "${pin_s[@]}" "${st[@]}" ${st:+-o "$dir/pp-srv.stat"} \
        "$bin" nc -v -l 7001 --echo --bind 10.79.1.1 2>"$dir/pp-srv.err" &
    sp=$!
    # Until the listener listens (a loaded machine starts it slowly), at most 5 s.
    for _ in $(seq 1 50); do
        ip netns exec "$a" ss -Hltn 'sport = :7001' | grep -q . && break
        sleep 0.1
    done
    out=$(nc_in "$b" b "$disc" "$bin" "${pin_c[@]}" "${st[@]}" ${st:+-o "$dir/pp-cli.stat"} \
        "$bin" nc -v 10.79.1.1 7001 --pingpong "$arg" --time 1 2>"$dir/pp-cli.err") ||
        out="failed: $(tail -1 "$dir/pp-cli.err")"
    # The echo listener serves until killed. `$sp` is the subshell running `nc_in`; the
    # listener is its child (`ip netns exec` and `env` exec into it): kill that one, or it
    # keeps port 7001 and every later round's client talks to the first round's binary.
    # It takes a moment to exit (its exit handlers): wait until it is gone, at most 5 s.
    local kids
    kids=$(pgrep -P "$sp" || true)
    # Under perf stat the listener is one level further down: kill it first, and perf writes
    # its counts and exits.
    if [ -n "${st[*]}" ]; then
        local grand=""
        for p in $kids; do grand="$grand $(pgrep -P "$p" || true)"; done
        kill_and_wait $grand
    fi
    kill_and_wait $kids
    kill "$sp" 2>/dev/null || true
    wait "$sp" 2>/dev/null || true
    if [ -n "${st[*]}" ] && [ -s "$dir/pp-cli.stat" ]; then
        # CPU per round trip: the client's, and the echo server's (its whole life, whose
        # start and exit add a little).
        local rt
        rt=$(awk '{for (i = 1; i < NF; i++) if ($i == "round_trips") print $(i + 1)}' <<<"$out")
        out="$out client $(stat_of "$dir/pp-cli.stat") server $(stat_of "$dir/pp-srv.stat")"
        [ -n "$rt" ] && out="$out cpu_us_per_rt $(awk -F, -v n="$rt" '/task-clock/ {printf "%.1f", $1 * 1000 / n}' "$dir/pp-cli.stat")"
    fi
    echo "$label $out"
}

for _ in $(seq 1 "$rounds"); do
    i=0
    for bin in "${bins[@]}"; do
        "$mode" "$bin" assert-peer "smc$i"
        i=$((i + 1))
    done
    "$mode" "${bins[0]}" off tcp
done
