#!/usr/bin/env bash
# `smc run` with unmodified Debian programs (docs/preload.md): every payload is verified and
# every connection is checked to be SMC-R (both ends under `smc run`) or TCP (a plain peer),
# from the stacks' counters (`smc stats --json`) and the preload library's log (SMC_LOG).
#
# Usage: scripts/preload-apps.sh [path/to/smc]   (default: builds and uses target/debug/smc)
# Needs root (the eBPF discovery of the SMC-R capability) and the programs
# scripts/install-deps.sh installs; skips with a message otherwise.
set -euo pipefail
cd "$(dirname "$0")/.."

if [ "$(id -u)" -ne 0 ]; then
    echo "preload-apps: skipped (needs root for the eBPF discovery)"
    exit 0
fi
for p in redis-server redis-cli redis-benchmark python3 curl socat iperf3 nginx memcached memcslap \
    wrk sockperf haproxy lighttpd ab ssh sshd ssh-keygen apache2; do
    if ! command -v "$p" >/dev/null 2>&1; then
        echo "preload-apps: skipped ($p missing; run scripts/install-deps.sh)"
        exit 0
    fi
done

SMC=${1:-}
if [ -z "$SMC" ]; then
    cargo build -q -p smc-cli --locked
    SMC=target/debug/smc
fi
SMC=$(realpath "$SMC")

work=$(mktemp -d)
export SMC_FABRIC_DIR="$work/fabric"
export SMC_LOG="$work/preload.log"
export SMC_DISCOVERY=ebpf
pids=()
cleanup() {
    for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done
    wait 2>/dev/null || true
    rm -rf "$work"
}
trap cleanup EXIT

fail() {
    echo "preload-apps: FAIL: $*" >&2
    echo "--- preload log (last 40 lines)" >&2
    tail -n 40 "$SMC_LOG" >&2 || true
    exit 1
}

# One of the python3 checks scripts/preload-NAME.py: its server on PORT, then its client, both
# under smc run; a client or server that fails prints both logs and fails with WHAT.
py_pair() {
    local name=$1 port=$2 what=$3
    shift 3
    "$SMC" run python3 "scripts/preload-$name.py" server "$port" "$@" >"$work/$name-s.log" 2>&1 &
    pids+=($!)
    local srv=$!
    for _ in $(seq 1 100); do ss -ltn "sport = :$port" | grep -q "$port" && break; sleep 0.05; done
    timeout 60 "$SMC" run python3 "scripts/preload-$name.py" client "$port" "$@" >"$work/$name-c.log" 2>&1 \
        || { cat "$work/$name-c.log" "$work/$name-s.log"; fail "$what"; }
    wait $srv || { cat "$work/$name-s.log"; fail "$what: server"; }
}

# A stack counter of process $1 (from `smc stats --json`).
stat_of() {
    "$SMC" stats --json | python3 -c '
import json, sys
pid, key = sys.argv[1], sys.argv[2]
for s in json.load(sys.stdin):
    if s["pid"] == pid:
        print(s["stats"].get(key, 0)); break
else:
    print("none")' "$1" "$2"
}

# Wait until TCP port $1 on 127.0.0.1 accepts connections (plain probe: no preload).
wait_port() {
    for _ in $(seq 1 100); do
        if (exec 3<>"/dev/tcp/127.0.0.1/$1") 2>/dev/null; then return 0; fi
        sleep 0.05
    done
    fail "nothing listens on port $1"
}

head -c 4000000 /dev/urandom >"$work/r4m"
sum() { sha256sum "$1" | cut -d' ' -f1; }
want=$(sum "$work/r4m")

http=0; redis=0
echo "== socat fork (accept, then a forked child serves the connection)"
"$SMC" run socat TCP-LISTEN:17000,reuseaddr,fork SYSTEM:cat >"$work/socat.log" 2>&1 &
pids+=($!); socat=$!
wait_port 17000
for i in 1 2 3; do
    got=$(timeout 20 "$SMC" run socat -t 5 - TCP:127.0.0.1:17000 <"$work/r4m" | sha256sum | cut -d' ' -f1) \
        || fail "socat client $i failed"
    [ "$got" = "$want" ] || fail "socat echo $i: payload differs"
done
n=$(grep -E "^smc-preload\[[0-9]+\]: fd [0-9]+: SMC-R" "$SMC_LOG" | grep -vc "\[$http\]\|\[$redis\]" || true)
# Clients and served children: 3 connections, both ends each.
[ "$n" -ge 6 ] || fail "socat: $n SMC-R ends logged, 6 expected"
# Python's subprocess hands the connection to a program as its stdin (vfork, dup2 the table
# never sees, close every other descriptor, exec): the program's reads fail with EIO at once,
# and the parent's connection goes on working.
out=$(timeout 30 "$SMC" run python3 -c '
import socket, subprocess
s = socket.create_connection(("127.0.0.1", 17000))
r = subprocess.run(["head", "-c", "4"], stdin=s.fileno(), capture_output=True, timeout=10)
print("child rc=%d err=%s" % (r.returncode, r.stderr.decode().strip()))
s.sendall(b"still here")
got = b""
while len(got) < 10:
    got += s.recv(10 - len(got))
print("parent got %s" % got.decode())' 2>&1) || fail "python subprocess with a connection as stdin: $out"
case "$out" in
    *"child rc=1"*"Input/output error"*"parent got still here"*) ;;
    *) fail "python subprocess with a connection as stdin: $out" ;;
esac
# bash hands its /dev/tcp connection to two exec'd programs at once: cat writes 4 MB while
# head reads the echo, both relayed through bash.
got=$(timeout 30 "$SMC" run bash -c 'exec 3<>/dev/tcp/127.0.0.1/17000
cat "$1" >&3 & head -c 4000000 <&3 | sha256sum | cut -d" " -f1; wait' _ "$work/r4m" 2>&1) \
    || fail "bash /dev/tcp to cat and head: $got"
[ "$got" = "$want" ] || fail "bash /dev/tcp to cat and head: echo differs ($got)"
# socat EXEC: the serving child runs the program on a socketpair and moves the bytes itself.
ends=$(grep -c ": SMC-R$" "$SMC_LOG" || true)
"$SMC" run socat TCP-LISTEN:17001,reuseaddr,fork EXEC:cat >"$work/socat-exec.log" 2>&1 &
pids+=($!)
wait_port 17001
got=$(timeout 20 "$SMC" run socat -t 5 - TCP:127.0.0.1:17001 <"$work/r4m" | sha256sum | cut -d' ' -f1) \
    || fail "socat EXEC:cat client failed"
[ "$got" = "$want" ] || fail "socat EXEC:cat echo: payload differs"
[ $(($(grep -c ": SMC-R$" "$SMC_LOG") - ends)) -eq 2 ] || fail "socat EXEC:cat: not SMC-R at both ends"
echo "   3 echoes of 4 MB verified, served by forked children over SMC-R; a connection as a"
echo "   subprocess's stdin: EIO in the child, the parent's echo intact; /dev/tcp to cat and head:"
echo "   4 MB echo relayed through bash; socat EXEC:cat: 4 MB echo over SMC-R"

# ==== relay: connections used by more than one process (docs/preload.md, "Connections
# shared by processes"). Self-contained section: scripts/preload-fork.py, then rsync.
echo "== a connection used by a forked child too, relayed through its owner (scripts/preload-fork.py)"
before=$(grep -c "relayed through it" "$SMC_LOG" 2>/dev/null || true)
py_pair fork 19190 "a connection shared by parent and child" "$SMC"
after=$(grep -c "relayed through it" "$SMC_LOG" || true)
[ $((after - before)) -eq 12 ] || fail "fork: $((after - before)) relayed connections, 12 expected (11 scenarios, the first at both ends)"
# Scenarios 10 and 11: the parent closed before the child's first use; kept, then closed.
kept=$(grep -c "kept for it" "$SMC_LOG" || true)
ended=$(grep -c "no process holds the kept connection" "$SMC_LOG" || true)
[ "$kept" -eq 2 ] && [ "$ended" -eq 2 ] || fail "fork: $kept connections kept for a child, $ended closed after (2 and 2 expected)"
grep '^ok' "$work/fork-c.log" | sed 's/^/   /'

echo "== rsync daemon + rsync client, push and pull of 30 MB (the receiver is forked after the connection is set up)"
command -v rsync >/dev/null 2>&1 || fail "rsync missing: run scripts/install-deps.sh"
mkdir -p "$work/rsync/mod" "$work/rsync/dst"
head -c 30000000 /dev/urandom >"$work/rsync/r30m"
r30=$(sum "$work/rsync/r30m")
printf '%s\n' "pid file = $work/rsyncd.pid" "use chroot = no" "[mod]" "path = $work/rsync/mod" \
    "read only = no" "uid = root" "gid = root" >"$work/rsyncd.conf"
: >"$SMC_LOG.rsync"
SMC_LOG="$SMC_LOG.rsync" "$SMC" run rsync --daemon --no-detach --config="$work/rsyncd.conf" \
    --address=127.0.0.1 --port=18873 --log-file="$work/rsyncd.log" &
pids+=($!)
wait_port 18873
SMC_LOG="$SMC_LOG.rsync" timeout 120 "$SMC" run rsync -a "$work/rsync/r30m" rsync://127.0.0.1:18873/mod/ \
    >"$work/rsync-push.log" 2>&1 || fail "rsync push: $(cat "$work/rsync-push.log"; tail -3 "$work/rsyncd.log")"
[ "$(sum "$work/rsync/mod/r30m")" = "$r30" ] || fail "rsync push: payload differs"
SMC_LOG="$SMC_LOG.rsync" timeout 120 "$SMC" run rsync -a rsync://127.0.0.1:18873/mod/r30m "$work/rsync/dst/" \
    >"$work/rsync-pull.log" 2>&1 || fail "rsync pull: $(cat "$work/rsync-pull.log"; tail -3 "$work/rsyncd.log")"
[ "$(sum "$work/rsync/dst/r30m")" = "$r30" ] || fail "rsync pull: payload differs"
n=$(grep -c "fd [0-9]*: SMC-R$" "$SMC_LOG.rsync" || true)
m=$(grep -c "relayed through it" "$SMC_LOG.rsync" || true)
[ "$n" = 4 ] && [ "$m" = 2 ] \
    || fail "rsync: $n SMC-R ends (4 expected), $m relayed (2 expected: the daemon's receiver, the client's)"
if grep -q "rsync error" "$work/rsyncd.log"; then fail "rsync daemon: $(grep "rsync error" "$work/rsyncd.log")"; fi
echo "   push and pull of 30 MB verified, 4 SMC-R ends, the forked receivers relayed through their parents"
# ==== end of the relay section
