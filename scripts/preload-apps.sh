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
    wrk sockperf haproxy lighttpd ab ssh sshd ssh-keygen apache2 vsftpd; do
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
# The library goes to a directory of this run: a program that drops root grants its new user
# read on it (and search on the directory), which an older smc would take for a directory
# that is not private any more.
mkdir -m 700 "$work/xdg"
export XDG_RUNTIME_DIR="$work/xdg"
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

echo "== negative control: programs without sockets behave as without smc run"
[ "$("$SMC" run -- sh -c 'echo hello; ls /' )" = "$(sh -c 'echo hello; ls /')" ] || fail "sh/ls output differs"
"$SMC" run true || fail "true failed"
if "$SMC" run false; then fail "false succeeded"; fi
grep -q 'SMC-R\|listening' "$SMC_LOG" && fail "a program without sockets touched SMC"

echo "== socket semantics call by call (scripts/preload-semantics.py, both ends under smc run)"
"$SMC" run python3 scripts/preload-semantics.py server 19100 "$SMC" >"$work/sem-s.log" 2>&1 &
sem=$!
for _ in $(seq 1 100); do grep -q "listening on port 19100" "$SMC_LOG" && break; sleep 0.05; done
timeout 60 "$SMC" run python3 scripts/preload-semantics.py client 19100 "$SMC" >"$work/sem-c.log" 2>&1 \
    || { cat "$work/sem-c.log"; fail "semantics client"; }
wait $sem || { cat "$work/sem-s.log"; fail "semantics server"; }
echo "   $(grep -c '^ok' "$work/sem-s.log" "$work/sem-c.log" | awk -F: '{s+=$2} END {print s}') checks passed"

echo "== a peer's reset (scripts/preload-reset.py): plain TCP first, then both ends under smc run"
for mode in plain smc; do
    run=(); [ $mode = smc ] && run=("$SMC" run)
    before=$(grep -c 'fd [0-9]*: SMC-R' "$SMC_LOG" || true)
    "${run[@]}" python3 scripts/preload-reset.py server 19180 >"$work/reset-s.log" 2>&1 &
    pids+=($!); rs=$!
    for _ in $(seq 1 100); do ss -ltn 'sport = :19180' | grep -q 19180 && break; sleep 0.05; done
    timeout 60 "${run[@]}" python3 scripts/preload-reset.py client 19180 >"$work/reset-c.log" 2>&1 \
        || { cat "$work/reset-c.log" "$work/reset-s.log"; fail "reset semantics ($mode)"; }
    wait $rs || { cat "$work/reset-s.log"; fail "reset server ($mode)"; }
    after=$(grep -c 'fd [0-9]*: SMC-R' "$SMC_LOG" || true)
    if [ $mode = smc ] && [ $((after - before)) -ne 6 ]; then
        fail "reset semantics: $((after - before)) SMC-R connection ends, 6 expected"
    fi
done
echo "   answer read before the reset, ECONNRESET once (read, write or SO_ERROR), then EOF/EPIPE: as TCP"

echo "== sockets closed through syscall(SYS_close), as libuv (node) closes them (scripts/preload-rawclose.py)"
py_pair rawclose 19181 "raw close: the client did not get every answer and end of stream"
cat "$work/rawclose-s.log" "$work/rawclose-c.log" | sed 's/^/   /'

echo "== an accepted connection handed to an exec'd program before its first use, as sshd does (scripts/preload-execaccept.py)"
before=$(grep -c "handed to an exec'd program: declined, TCP" "$SMC_LOG" || true)
py_pair execaccept 19182 "exec'd handlers: the client did not get every greeting and answer"
after=$(grep -c "handed to an exec'd program: declined, TCP" "$SMC_LOG" || true)
[ $((after - before)) -eq 3 ] || fail "exec'd handlers: $((after - before)) connections settled as TCP before the exec, 3 expected"
cat "$work/execaccept-s.log" "$work/execaccept-c.log" | sed 's/^/   /'

echo "== accepted connections served by raw clone children, as vsftpd's (scripts/preload-rawclone.py)"
before=$(grep -c 'fd [0-9]*: SMC-R' "$SMC_LOG" || true)
# The first over SMC-R, the second (no stack possible in the child) declined, then TCP.
py_pair rawclone 19183 "raw clone children: the client did not get every greeting and echo"
after=$(grep -c 'fd [0-9]*: SMC-R' "$SMC_LOG" || true)
[ $((after - before)) -eq 2 ] || fail "raw clone children: $((after - before)) SMC-R connection ends, 2 expected (the first connection)"
cat "$work/rawclone-s.log" "$work/rawclone-c.log" | sed 's/^/   /'

echo "== a server that accepts 4 connections before it serves any, a client that connects one after another (scripts/preload-backlog.py)"
before=$(grep -c 'fd [0-9]*: SMC-R' "$SMC_LOG" || true)
settled=$(grep -c 'after accept: rendezvous run' "$SMC_LOG" || true)
py_pair backlog 19184 "accepted before served: the client did not connect 4 times or an echo was wrong"
after=$(grep -c 'fd [0-9]*: SMC-R' "$SMC_LOG" || true)
[ $((after - before)) -eq 8 ] || fail "accepted before served: $((after - before)) SMC-R connection ends, 8 expected"
[ $(($(grep -c 'after accept: rendezvous run' "$SMC_LOG" || true) - settled)) -ge 1 ] \
    || fail "accepted before served: no rendezvous run for an unused connection"
cat "$work/backlog-s.log" "$work/backlog-c.log" | sed 's/^/   /'

echo "== a server that accepts the data connection only after RETR on the control connection, as FTP's passive mode (scripts/preload-ftpstyle.py)"
# Before: each data connection's connect waited 6 s for the server's Accept (then NOACCEPT, TCP).
before=$(grep -c 'fd [0-9]*: SMC-R' "$SMC_LOG" || true)
noaccept=$(grep -c 'NOACCEPT' "$SMC_LOG" || true)
pending=$(grep -c "the server's answer is not in yet" "$SMC_LOG" || true)
py_pair ftpstyle 19196 "FTP-style data connections: a transfer was wrong or waited for the 6 s accept wait"
after=$(grep -c 'fd [0-9]*: SMC-R' "$SMC_LOG" || true)
# The control connection and the first three data connections, both ends.
[ $((after - before)) -eq 8 ] || fail "FTP-style: $((after - before)) SMC-R connection ends, 8 expected"
[ $(($(grep -c "the server's answer is not in yet" "$SMC_LOG" || true) - pending)) -ge 4 ] \
    || fail "FTP-style: the data connections' connect did not return before the server's answer"
# The late round: the client's Decline after its accept wait, read by the server.
[ $(($(grep -c 'NOACCEPT' "$SMC_LOG" || true) - noaccept)) -ge 2 ] \
    || fail "FTP-style: the late data connection did not fall back (NOACCEPT) at both ends"
cat "$work/ftpstyle-s.log" "$work/ftpstyle-c.log" | sed 's/^/   /'

echo "== vsftpd (session processes raw-cloned into namespaces, RLIMIT_AS 200 MiB, passive data connections passed by SCM_RIGHTS) + curl"
# Before: "500 OOPS: mmap" even towards a plain curl (the stack's threads' malloc arenas
# counted against vsftpd's RLIMIT_AS), a login process that hung in setgroups (a library thread
# copied by the raw clone in its first instant), EIO in the session process (no relay reachable
# from its network namespace), a data connection whose client waited 30 s for an Accept.
ftp=$(mktemp -d)
chmod 755 "$ftp"
mkdir -p "$ftp/root" /var/run/vsftpd/empty
head -c 3000000 /dev/urandom >"$ftp/root/big.bin"
ftp_want=$(sha256sum <"$ftp/root/big.bin" | cut -d' ' -f1)
cat >"$ftp/vsftpd.conf" <<EOF
listen=YES
listen_ipv6=NO
listen_address=127.0.0.1
listen_port=19285
anonymous_enable=YES
anon_root=$ftp/root
no_anon_password=YES
local_enable=NO
write_enable=NO
seccomp_sandbox=NO
pasv_enable=YES
pasv_min_port=19286
pasv_max_port=19289
secure_chroot_dir=/var/run/vsftpd/empty
background=NO
xferlog_enable=NO
EOF
"$SMC" run vsftpd "$ftp/vsftpd.conf" >"$work/vsftpd.log" 2>&1 &
pids+=($!)
vsftpd_pid=$!
for _ in $(seq 1 100); do ss -ltn "sport = :19285" | grep -q 19285 && break; sleep 0.05; done
ftp_got=$(timeout 30 curl -sS ftp://127.0.0.1:19285/big.bin | sha256sum | cut -d' ' -f1)
[ "$ftp_got" = "$ftp_want" ] || fail "vsftpd under smc run, plain curl: the file came back wrong ($ftp_got)"
before=$(grep -c 'DeclineCode::CLONED' "$SMC_LOG" || true)
t0=$(date +%s%N)
ftp_got=$(timeout 30 "$SMC" run curl -sS ftp://127.0.0.1:19285/big.bin | sha256sum | cut -d' ' -f1)
t1=$(date +%s%N)
[ "$ftp_got" = "$ftp_want" ] || fail "vsftpd and curl under smc run: the file came back wrong ($ftp_got)"
[ $(($(grep -c 'DeclineCode::CLONED' "$SMC_LOG" || true) - before)) -eq 1 ] \
    || fail "vsftpd: the control connection was not declined as a raw clone's (CLONED)"
grep -q 'RLIMIT_AS 209715200 set as' "$SMC_LOG" || fail "vsftpd: its RLIMIT_AS was not adjusted"
echo "   3 MB file right to a plain curl and to curl under smc run ($(((t1 - t0) / 1000000)) ms: the data connection's connect returns before vsftpd accepts, which declines it before passing it, PASSED; 6 s before); both connections TCP by design"
kill "$vsftpd_pid" 2>/dev/null || true
wait "$vsftpd_pid" 2>/dev/null || true
rm -rf "$ftp"

echo "== descriptor numbers (scripts/preload-fdnums.py): the same under smc run as without, also after 20 inherited ones"
# The stack's descriptors (eBPF discovery, control socket, eventfds, epoll instances) stay
# out of the program's low numbers: with 20 inherited descriptors, wrk -c8 under smc run
# had every connect fail ("Socket errors: connect 8"), its event loop sized for TCP's numbers.
fdnums() { # PORT PREFIX...: the server's and the client's numbers, one line each
    local port=$1
    shift
    "$@" python3 scripts/preload-fdnums.py server "$port" >"$work/fdnums-s" 2>&1 &
    local srv=$!
    for _ in $(seq 1 100); do ss -ltn "sport = :$port" | grep -q "$port" && break; sleep 0.05; done
    timeout 30 "$@" python3 scripts/preload-fdnums.py client "$port" || fail "fdnums client ($*)"
    wait $srv || fail "fdnums server ($*): $(cat "$work/fdnums-s")"
    cat "$work/fdnums-s"
}
fd_before=$(grep -c ": SMC-R" "$SMC_LOG" 2>/dev/null || true)
for inherited in 0 20; do
    (
        for i in $(seq 3 $((2 + inherited))); do eval "exec $i</dev/null"; done
        plain=$(fdnums $((19170 + inherited / 10)) env)
        smc=$(fdnums $((19171 + inherited / 10)) "$SMC" run)
        [ "$plain" = "$smc" ] || fail "descriptor numbers with $inherited inherited: plain [$plain], smc run [$smc]"
    )
done
fd_smc=$(($(grep -c ": SMC-R" "$SMC_LOG" || true) - fd_before))
[ "$fd_smc" = 16 ] || fail "descriptor numbers: $fd_smc SMC-R ends, 16 expected"
echo "   the same numbers under smc run (16 SMC-R ends) as without, with 0 and 20 inherited descriptors"

echo "== python3 http.server + curl"
mkdir -p "$work/www" && cp "$work/r4m" "$work/www/f"
"$SMC" run python3 -m http.server 18000 --bind 127.0.0.1 -d "$work/www" >"$work/http.log" 2>&1 &
pids+=($!); http=$!
wait_port 18000
for i in 1 2 3; do
    got=$(timeout 20 "$SMC" run curl -sSf "http://127.0.0.1:18000/f" | sha256sum | cut -d' ' -f1) || fail "curl $i failed"
    [ "$got" = "$want" ] || fail "curl $i over SMC-R: payload differs"
done
# A port probe above was one plain connection (TCP); three curls are SMC-R.
[ "$(stat_of $http smc_connections)" = 3 ] || fail "http.server: $(stat_of $http smc_connections) SMC-R connections, 3 expected"
fb=$(stat_of $http fallbacks)
got=$(timeout 20 curl -sSf "http://127.0.0.1:18000/f" | sha256sum | cut -d' ' -f1) || fail "plain curl failed"
[ "$got" = "$want" ] || fail "plain curl: payload differs"
[ "$(stat_of $http fallbacks)" = $((fb + 1)) ] || fail "plain curl was not a TCP fallback"
[ "$(stat_of $http smc_connections)" = 3 ] || fail "plain curl counted as SMC-R"
echo "   3 curls over SMC-R, 1 plain curl over TCP, payloads verified"

echo "== redis-server + redis-benchmark + redis-cli"
"$SMC" run redis-server --port 16390 --save '' --appendonly no --dir "$work" >"$work/redis.log" 2>&1 &
pids+=($!); redis=$!
wait_port 16390
timeout 60 "$SMC" run redis-benchmark -p 16390 -t set,get,lpush,lrange_100 -n 20000 -c 20 -q >"$work/bench.out" 2>&1 \
    || fail "redis-benchmark: $(tail -3 "$work/bench.out")"
tr '\r' '\n' <"$work/bench.out" | grep "requests per second" | sed 's/^/   /'
# BGSAVE during load: a forked child inherits every client connection and must leave them
# alone (it never touches them; its exit must not end them).
timeout 60 "$SMC" run redis-benchmark -p 16390 -t set -n 30000 -c 10 -q >"$work/bench2.out" 2>&1 &
b2=$!
sleep 0.5
[ "$(timeout 5 "$SMC" run redis-cli -p 16390 bgsave)" = "Background saving started" ] || fail "bgsave"
wait $b2 || fail "redis-benchmark during BGSAVE: $(tail -3 "$work/bench2.out")"
for _ in $(seq 1 100); do grep -q "Background saving terminated with success" "$work/redis.log" && break; sleep 0.05; done
grep -q "Background saving terminated with success" "$work/redis.log" || fail "BGSAVE did not finish"
[ "$(timeout 5 "$SMC" run redis-cli -p 16390 ping)" = PONG ] || fail "redis after BGSAVE"
timeout 10 "$SMC" run redis-cli -p 16390 -x set big <"$work/r4m" >/dev/null || fail "redis-cli set"
got=$(timeout 10 "$SMC" run redis-cli -p 16390 --raw get big | head -c 4000000 | sha256sum | cut -d' ' -f1) \
    || fail "redis-cli get failed"
[ "$got" = "$want" ] || fail "redis get: value differs"
# A connection handed to exec'd programs (bash's /dev/tcp written by cat, read by head): each
# asks bash, the connection's owner, for a relay. (bash's own printf would write past the
# library, below.) cat writes a SET of the 4 MB value and a GET; the heads read the answers.
out=$(timeout 30 "$SMC" run bash -c 'exec 3<>/dev/tcp/127.0.0.1/16390
{ printf "*3\r\n\$3\r\nSET\r\n\$6\r\ndevtcp\r\n\$4000000\r\n"; cat "$1"
  printf "\r\n*2\r\n\$3\r\nGET\r\n\$6\r\ndevtcp\r\n"; } | cat >&3
head -c 15 <&3 | tr "\r\n" "__"; echo
head -c 4000000 <&3 | sha256sum | cut -d" " -f1
head -c 2 <&3 | tr "\r\n" "__"; echo' _ "$work/r4m" 2>&1) \
    || fail "bash /dev/tcp + cat + head: $out"
[ "$out" = "+OK__\$4000000__"$'\n'"$want"$'\n'"__" ] || fail "bash /dev/tcp + cat + head: $out"
[ "$(timeout 5 "$SMC" run redis-cli -p 16390 strlen devtcp)" = 4000000 ] || fail "bash /dev/tcp + cat: the value was not stored"
# A write the library cannot see (bash's printf goes through glibc's stdio, which calls an
# internal write) lands on the idle TCP socket: the server's stack aborts the connection, so
# bash's read (a real read the library serves) fails with a reset instead of waiting forever.
aborts=$(stat_of $redis tcp_data_aborts)
out=$(timeout 20 "$SMC" run bash -c 'exec 3<>/dev/tcp/127.0.0.1/16390; printf "PING\r\n" >&3; read -r l <&3; echo "read=$?"' 2>&1) \
    || fail "bash /dev/tcp + printf + read: no error in 20 s ($out)"
case "$out" in
    *"Connection reset by peer"*"read=1"*) ;;
    *) fail "bash /dev/tcp + printf + read: no reset ($out)" ;;
esac
[ "$(stat_of $redis tcp_data_aborts)" -gt "$aborts" ] || fail "redis: the bytes on TCP were not counted"
smc=$(stat_of $redis smc_connections)
[ "$smc" -ge 95 ] || fail "redis: $smc SMC-R connections, at least 95 expected (4 x 20 + 10 + 5)"
fb=$(stat_of $redis fallbacks)
[ "$(timeout 5 redis-cli -p 16390 strlen big)" = 4000000 ] || fail "plain redis-cli"
[ "$(stat_of $redis fallbacks)" = $((fb + 1)) ] || fail "plain redis-cli was not a TCP fallback"
echo "   $smc connections over SMC-R, BGSAVE under load, 4 MB value verified, /dev/tcp handed to cat and head:"
echo "   4 MB SET and GET relayed through bash,"
echo "   printf to /dev/tcp (stdio, past the library): reset, plain redis-cli over TCP"

echo "== redis replica (nonblocking connect from an event loop, full sync through a fork)"
mkdir -p "$work/replica"
"$SMC" run redis-server --port 16391 --save '' --appendonly no --dir "$work/replica" \
    --replicaof 127.0.0.1 16390 >"$work/replica.log" 2>&1 &
pids+=($!); replica=$!
for _ in $(seq 1 100); do
    [ "$(timeout 5 "$SMC" run redis-cli -p 16391 strlen big 2>/dev/null)" = 4000000 ] && break
    sleep 0.1
done
[ "$(timeout 5 "$SMC" run redis-cli -p 16391 strlen big)" = 4000000 ] || fail "replica did not sync"
timeout 5 "$SMC" run redis-cli -p 16390 set after-sync yes >/dev/null
for _ in $(seq 1 50); do
    [ "$(timeout 5 "$SMC" run redis-cli -p 16391 get after-sync)" = yes ] && break
    sleep 0.1
done
[ "$(timeout 5 "$SMC" run redis-cli -p 16391 get after-sync)" = yes ] || fail "replica did not follow"
[ "$(stat_of $replica fallbacks)" = 0 ] || fail "replica: $(stat_of $replica fallbacks) connections fell back"
n=$(grep -c "^smc-preload\[$replica\]: fd [0-9]*: SMC-R" "$SMC_LOG" || true)
[ "$n" -ge 1 ] || fail "replica: its connection to the master is not SMC-R"
echo "   the replica synced 4 MB and follows, over SMC-R"

echo "== memcached -t 2 (accept thread hands connections to worker threads) + memcslap + a python client"
"$SMC" run memcached -p 11311 -l 127.0.0.1 -t 2 -U 0 -u root >"$work/memcached.log" 2>&1 &
pids+=($!); mc=$!
wait_port 11311
timeout 30 "$SMC" run memcslap --servers=127.0.0.1:11311 --concurrency=8 --execute-number=2000 >"$work/memcslap.out" 2>&1 \
    || fail "memcslap: $(tail -3 "$work/memcslap.out")"
# A 500 kB value set and read back through the text protocol, checked byte for byte.
timeout 20 "$SMC" run python3 - "$work/r4m" <<'PY' || fail "memcached python client"
import socket, sys
data = open(sys.argv[1], "rb").read()[:500_000]
s = socket.create_connection(("127.0.0.1", 11311))
f = s.makefile("rb")
s.sendall(b"set big 0 0 %d\r\n" % len(data) + data + b"\r\n")
assert f.readline() == b"STORED\r\n"
s.sendall(b"get big\r\n")
assert f.readline() == b"VALUE big 0 %d\r\n" % len(data)
assert f.read(len(data) + 2) == data + b"\r\n"
assert f.readline() == b"END\r\n"
PY
smc=$(stat_of $mc smc_connections)
[ "$smc" = 9 ] || fail "memcached: $smc SMC-R connections, 9 expected (8 memcslap + 1)"
[ "$(stat_of $mc fallbacks)" = 1 ] || fail "memcached: the port probe was not the one TCP fallback"
echo "   9 connections over SMC-R (memcslap x8, python), 500 kB value verified"

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
# never sees, close every other descriptor, exec) from a process that never forked: the
# program asks the parent (which started its relay server before the vfork) for a relay and
# reads the echo; the parent's connection goes on working.
out=$(timeout 30 "$SMC" run python3 -c '
import socket, subprocess
s = socket.create_connection(("127.0.0.1", 17000))
s.sendall(b"abcd")
r = subprocess.run(["head", "-c", "4"], stdin=s.fileno(), capture_output=True, timeout=10)
print("child rc=%d out=%s err=%s" % (r.returncode, r.stdout.decode(), r.stderr.decode().strip()))
s.sendall(b"still here")
got = b""
while len(got) < 10:
    got += s.recv(10 - len(got))
print("parent got %s" % got.decode())' 2>&1) || fail "python subprocess with a connection as stdin: $out"
case "$out" in
    *"child rc=0 out=abcd err="*"parent got still here"*) ;;
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
echo "   subprocess's stdin: the echo read there, relayed, the parent's echo intact; /dev/tcp to cat and head:"
echo "   4 MB echo relayed through bash; socat EXEC:cat: 4 MB echo over SMC-R"

echo "== iperf3 (select, two connections), -R, and -P 4 (four data streams)"
for rev in "" "-R" "-P 4"; do
    : >"$SMC_LOG.iperf"
    SMC_LOG="$SMC_LOG.iperf" "$SMC" run iperf3 -s -p 15201 -1 >"$work/iperf-s.log" 2>&1 &
    pids+=($!); srv=$!
    # (No probe connection: the one-off server would take it for its client.)
    for _ in $(seq 1 100); do grep -q "listening on port 15201" "$SMC_LOG.iperf" && break; sleep 0.05; done
    SMC_LOG="$SMC_LOG.iperf" timeout 30 "$SMC" run iperf3 -c 127.0.0.1 -p 15201 -t 2 $rev >"$work/iperf.out" 2>&1 \
        || fail "iperf3 $rev: $(tail -3 "$work/iperf.out")"
    wait $srv || fail "iperf3 server $rev"
    grep receiver "$work/iperf.out" | tail -1 | sed "s/^/   $rev /"
    # Control and data connections, SMC-R at both ends.
    want_ends=4
    [ "$rev" = "-P 4" ] && want_ends=10
    n=$(grep -c ": SMC-R" "$SMC_LOG.iperf" || true)
    [ "$n" = "$want_ends" ] || fail "iperf3 $rev: $n SMC-R ends, $want_ends expected"
    ! grep -q "]: fd [0-9]*: TCP" "$SMC_LOG.iperf" || fail "iperf3 $rev: a connection is TCP"
done

echo "== nginx, 2 workers (listener inherited across fork), sendfile + curl"
mkdir -p "$work/nginx"
cat >"$work/nginx/nginx.conf" <<EOF
daemon off;
master_process on;
worker_processes 2;
user root;
pid $work/nginx/nginx.pid;
error_log $work/nginx/error.log;
events { worker_connections 256; }
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
        listen 127.0.0.1:18080;
        root $work/www;
    }
}
EOF
: >"$SMC_LOG.nginx"
SMC_LOG="$SMC_LOG.nginx" "$SMC" run nginx -c "$work/nginx/nginx.conf" -p "$work/nginx" &
pids+=($!)
wait_port 18080
for i in 1 2 3 4; do
    got=$(SMC_LOG="$SMC_LOG.nginx" timeout 20 "$SMC" run curl -sSf "http://127.0.0.1:18080/f" | sha256sum | cut -d' ' -f1) \
        || fail "nginx curl $i failed: $(cat "$work/nginx/error.log")"
    [ "$got" = "$want" ] || fail "nginx curl $i: payload differs"
done
got=$(timeout 20 curl -sSf "http://127.0.0.1:18080/f" | sha256sum | cut -d' ' -f1) || fail "nginx plain curl failed"
[ "$got" = "$want" ] || fail "nginx plain curl: payload differs"
n=$(grep -c ": SMC-R" "$SMC_LOG.nginx" || true)
[ "$n" = 8 ] || fail "nginx: $n SMC-R ends, 8 expected"
grep -q "TCP (Tcp(PeerWithoutOption))" "$SMC_LOG.nginx" || fail "nginx: the plain curl was not TCP"
echo "   4 curls over SMC-R (workers' own stacks), 1 plain curl over TCP, payloads verified"

echo "== nginx (the 2 workers above) + wrk (2 threads, 16 connections, 3 s), every 1 KiB body checked"
head -c 1024 /dev/urandom >"$work/www/k1"
# wrk's Lua hooks: each thread compares every response's status and body with the file and
# counts; done() sums the threads' counts.
cat >"$work/wrk-check.lua" <<'LUA'
local threads = {}
function setup(thread) table.insert(threads, thread) end
function init(args)
    local f = assert(io.open(os.getenv("WRK_EXPECT"), "rb"))
    expected = f:read("*a")
    f:close()
    good, bad = 0, 0
end
function response(status, headers, body)
    if status == 200 and body == expected then good = good + 1 else bad = bad + 1 end
end
function done(summary, latency, requests)
    local g, b = 0, 0
    for _, t in ipairs(threads) do g = g + t:get("good"); b = b + t:get("bad") end
    io.write(string.format("checked %d bad %d requests %d\n", g, b, summary.requests))
end
LUA
ng_before=$(grep -c ": SMC-R" "$SMC_LOG.nginx" || true)
: >"$SMC_LOG.wrk"
SMC_LOG="$SMC_LOG.wrk" WRK_EXPECT="$work/www/k1" timeout 30 "$SMC" run \
    wrk -t2 -c16 -d3s -s "$work/wrk-check.lua" "http://127.0.0.1:18080/k1" >"$work/wrk.out" 2>&1 \
    || fail "wrk: $(cat "$work/wrk.out")"
# wrk prints these lines only when there were any.
! grep -q "Socket errors\|Non-2xx" "$work/wrk.out" || fail "wrk: $(cat "$work/wrk.out")"
read -r good bad total < <(awk '/^checked/ {print $2, $4, $6}' "$work/wrk.out")
[ "${bad:-x}" = 0 ] && [ "${good:-0}" -gt 1000 ] && [ "$good" -ge "$total" ] \
    || fail "wrk: bodies checked ${good:-?}, wrong ${bad:-?}, requests ${total:-?}"
# Every connection wrk made (16, and a new one after each 1000 requests: nginx's
# keepalive_requests) is SMC-R at both ends.
conns=$(grep -c ": SMC-R" "$SMC_LOG.wrk" || true)
! grep -q "]: fd [0-9]*: TCP" "$SMC_LOG.wrk" || fail "wrk: a connection is TCP"
[ "$conns" -ge 16 ] || fail "wrk: $conns SMC-R connections, at least 16 expected"
for _ in $(seq 1 40); do
    [ $(( $(grep -c ": SMC-R" "$SMC_LOG.nginx") - ng_before )) = "$conns" ] && break
    sleep 0.05
done
ng_n=$(( $(grep -c ": SMC-R" "$SMC_LOG.nginx") - ng_before ))
[ "$ng_n" = "$conns" ] || fail "wrk: $conns SMC-R connections, nginx's workers logged $ng_n"
echo "   $(grep Requests/sec "$work/wrk.out" | tr -s ' '), $good bodies verified, $conns connections SMC-R at both ends"

echo "== sockperf ping-pong (--tcp, 64 B): blocking recvfrom, then select, poll and epoll servers"
# Stop the server of the round just measured. A server that is gone already ended on its own
# after its client left (seen once in CI with the epoll server, not reproduced in 60 rounds by
# hand, issue #22's note): said loudly with its exit status and last words, not failed on —
# the client's checks above (every message back, in order, SMC-R at both ends) are the test.
sockperf_server_stop() {
    if ! kill "$sp" 2>/dev/null; then
        local st=0
        wait "$sp" 2>/dev/null || st=$?
        echo "   WARNING: the sockperf server ($1) had exited by itself, status $st: $(tail -3 "$work/sr.out" | tr '\n' ' ')"
        grep -v "loaded into" "$SMC_LOG.sp" | tail -5 | sed "s/^/   WARNING: /" || true
    else
        wait "$sp" 2>/dev/null || true
    fi
}
# sockperf binds without SO_REUSEADDR: fresh ports for each server and each run (a port of a
# run that was killed may still be taken), above memcached's 11311 (once drawn: "Can't bind").
spp=$((12000 + RANDOM % 250 * 8))
: >"$SMC_LOG.sp"
SMC_LOG="$SMC_LOG.sp" "$SMC" run sockperf sr --tcp -i 127.0.0.1 -p $spp >"$work/sr.out" 2>&1 &
pids+=($!); sp=$!
for _ in $(seq 1 100); do grep -q "listening on port $spp" "$SMC_LOG.sp" && break; sleep 0.05; done
SMC_LOG="$SMC_LOG.sp" timeout 30 "$SMC" run sockperf pp --tcp -i 127.0.0.1 -p $spp -t 2 -m 64 \
    >"$work/pp.out" 2>&1 || fail "sockperf pp: $(tail -5 "$work/pp.out")"
sockperf_server_stop "blocking"

# sockperf numbers its messages and counts what came back lost, twice or out of order.
grep -q "# dropped messages = 0; # duplicated messages = 0; # out-of-order messages = 0" "$work/pp.out" \
    || fail "sockperf pp: $(grep -i "messages" "$work/pp.out")"
[ "$(grep -c ": SMC-R" "$SMC_LOG.sp")" = 2 ] || fail "sockperf: not SMC-R at both ends"
echo "   blocking: $(grep -o "percentile 50.000 = *[0-9.]*" "$work/pp.out") us, no message lost"
for mux in s p e; do
    spp=$((spp + 2))
    printf 'T:127.0.0.1:%d\nT:127.0.0.1:%d\n' $spp $((spp + 1)) >"$work/feed.txt"
    : >"$SMC_LOG.sp"
    SMC_LOG="$SMC_LOG.sp" "$SMC" run sockperf sr -f "$work/feed.txt" -F $mux >"$work/sr.out" 2>&1 &
    pids+=($!); sp=$!
    for _ in $(seq 1 100); do grep -q "listening on port $((spp + 1))" "$SMC_LOG.sp" && break; sleep 0.05; done
    SMC_LOG="$SMC_LOG.sp" timeout 30 "$SMC" run sockperf pp -f "$work/feed.txt" -t 1 -m 64 \
        >"$work/pp.out" 2>&1 || fail "sockperf pp -F $mux: $(tail -5 "$work/pp.out")"
    sockperf_server_stop "-F $mux"
    grep -q "# dropped messages = 0; # duplicated messages = 0; # out-of-order messages = 0" "$work/pp.out" \
        || fail "sockperf pp -F $mux: $(grep -i "messages" "$work/pp.out")"
    [ "$(grep -c ": SMC-R" "$SMC_LOG.sp")" = 4 ] || fail "sockperf -F $mux: 2 connections not SMC-R at both ends"
    grep -q "using $(case $mux in s) echo select;; p) echo poll;; e) echo epoll;; esac)()" "$work/sr.out" \
        || fail "sockperf sr -F $mux: $(grep using "$work/sr.out")"
    echo "   -F $mux, 2 connections: $(grep -o "percentile 50.000 = *[0-9.]*" "$work/pp.out") us, no message lost"
done

echo "== haproxy (2 threads, splice forwarding both ways) in front of the python3 http.server above + curl"
cat >"$work/haproxy.cfg" <<EOF
global
    maxconn 64
    nbthread 2
defaults
    mode http
    timeout connect 5s
    timeout client 30s
    timeout server 30s
    option splice-auto
    option splice-request
    option splice-response
frontend fe
    bind 127.0.0.1:18090
    default_backend be
backend be
    server s1 127.0.0.1:18000
EOF
: >"$SMC_LOG.hap"
SMC_LOG="$SMC_LOG.hap" "$SMC" run haproxy -db -f "$work/haproxy.cfg" >"$work/haproxy.log" 2>&1 &
pids+=($!)
wait_port 18090
# The second response used to hang (a splice into haproxy's own pipe waited for room).
for i in 1 2 3 4; do
    got=$(SMC_LOG="$SMC_LOG.hap" timeout 20 "$SMC" run curl -sSf "http://127.0.0.1:18090/f" | sha256sum | cut -d' ' -f1) \
        || fail "haproxy curl $i failed: $(tail -3 "$work/haproxy.log")"
    [ "$got" = "$want" ] || fail "haproxy curl $i: payload differs"
done
n=$(grep -c ": SMC-R" "$SMC_LOG.hap" || true)
# 4 curls and haproxy's 4 accepted ends, plus its connections to the backend (1 to 4).
[ "$n" -ge 9 ] || fail "haproxy: $n SMC-R ends, at least 9 expected"
[ "$(grep -c ": TCP (" "$SMC_LOG.hap" || true)" = 1 ] || fail "haproxy: TCP connections besides the port probe"
echo "   4 GETs of 4 MB through haproxy's splice forwarding, $n SMC-R ends, payloads verified"

echo "== sshd (re-executes itself with the accepted connection) + ssh and scp: declined before the exec, TCP"
ssh-keygen -q -t ed25519 -N '' -f "$work/ssh_host_key" </dev/null
ssh-keygen -q -t ed25519 -N '' -f "$work/ssh_id" </dev/null
cp "$work/ssh_id.pub" "$work/authorized_keys"
mkdir -p /run/sshd
cat >"$work/sshd_config" <<EOF
Port 18022
ListenAddress 127.0.0.1
HostKey $work/ssh_host_key
PermitRootLogin yes
PasswordAuthentication no
KbdInteractiveAuthentication no
UsePAM no
AuthorizedKeysFile $work/authorized_keys
StrictModes no
PidFile $work/sshd.pid
Subsystem sftp internal-sftp
EOF
: >"$SMC_LOG.ssh"
SMC_LOG="$SMC_LOG.ssh" "$SMC" run "$(command -v sshd)" -D -e -f "$work/sshd_config" >"$work/sshd.log" 2>&1 &
pids+=($!)
wait_port 18022
sshopt=(-o StrictHostKeyChecking=no -o UserKnownHostsFile=/dev/null -o BatchMode=yes -o LogLevel=ERROR
    -i "$work/ssh_id")
got=$(SMC_LOG="$SMC_LOG.ssh" timeout 30 "$SMC" run ssh "${sshopt[@]}" -p 18022 root@127.0.0.1 sha256sum \
    <"$work/r4m" | cut -d' ' -f1) || fail "ssh failed: $(tail -5 "$work/sshd.log")"
[ "$got" = "$want" ] || fail "ssh: payload differs"
SMC_LOG="$SMC_LOG.ssh" timeout 30 "$SMC" run scp -q "${sshopt[@]}" -P 18022 "$work/r4m" \
    "root@127.0.0.1:$work/scp.out" || fail "scp failed: $(tail -5 "$work/sshd.log")"
[ "$(sum "$work/scp.out")" = "$want" ] || fail "scp: payload differs"
n=$(grep -c "handed to an exec'd program: declined, TCP" "$SMC_LOG.ssh" || true)
[ "$n" = 2 ] || fail "sshd: $n connections declined before the exec, 2 expected"
[ "$(grep -c "PeerDeclined { code: DeclineCode::EXECED" "$SMC_LOG.ssh" || true)" = 2 ] \
    || fail "ssh/scp: not TCP after the server's Decline"
echo "   ssh and scp (4 MB each way) over TCP, payloads verified"

echo "== lighttpd (one epoll loop) + ab (keep-alive, 8 connections, 2000 requests) + curl"
cat >"$work/lighttpd.conf" <<EOF
server.document-root = "$work/www"
server.port = 18091
server.bind = "127.0.0.1"
server.errorlog = "$work/lighttpd.err"
EOF
: >"$SMC_LOG.lt"
SMC_LOG="$SMC_LOG.lt" "$SMC" run lighttpd -D -f "$work/lighttpd.conf" &
pids+=($!)
wait_port 18091
for i in 1 2; do
    got=$(SMC_LOG="$SMC_LOG.lt" timeout 20 "$SMC" run curl -sSf "http://127.0.0.1:18091/f" | sha256sum | cut -d' ' -f1) \
        || fail "lighttpd curl $i failed: $(tail -3 "$work/lighttpd.err")"
    [ "$got" = "$want" ] || fail "lighttpd curl $i: payload differs"
done
SMC_LOG="$SMC_LOG.lt" timeout 60 "$SMC" run ab -q -k -n 2000 -c 8 "http://127.0.0.1:18091/k1" >"$work/ab.out" 2>&1 \
    || fail "ab: $(tail -5 "$work/ab.out")"
grep -q "^Complete requests: *2000" "$work/ab.out" && grep -q "^Failed requests: *0" "$work/ab.out" \
    && grep -q "^Keep-Alive requests: *2000" "$work/ab.out" || fail "ab: $(grep -i requests "$work/ab.out")"
n=$(grep -c ": SMC-R" "$SMC_LOG.lt" || true)
[ "$n" = 20 ] || fail "lighttpd: $n SMC-R ends, 20 expected (2 curls, 8 ab connections)"
echo "   2 curls of 4 MB, ab $(grep -o "Requests per second: *[0-9.]*" "$work/ab.out" | tr -s ' '), 20 SMC-R ends"

# ==== privilege drop (issue #22): servers whose workers change their uid keep SMC-R ====
# nginx (`user www-data;`) and apache2 (`User www-data`, mpm_event) start as root and their
# workers call setuid(33). The library grants uid 33 the fabric directory before the call
# (docs/preload.md, "Privilege drop"): the fabric lies in a private (0700) directory of root
# here, so the grant must also give search on that parent. Then SMC_UID_CHANGE=tcp: the same
# server stays TCP (also with the fabric directory granted by the runs before), bytes right.
echo "== privilege drop: nginx (user www-data, 3 workers) + curl + wrk, apache2 (User www-data) + curl, opt-out"
pd="$work/pd"
mkdir -m 700 "$pd"
# The document root must be readable by www-data: $work only searchable, the files readable.
chmod 711 "$work"
mkdir -m 755 "$work/pd-www"
head -c 4000000 /dev/urandom >"$work/pd-www/f"
head -c 1024 /dev/urandom >"$work/pd-www/k1"
chmod 644 "$work/pd-www/f" "$work/pd-www/k1"
pd_want=$(sha256sum "$work/pd-www/f" | cut -d' ' -f1)
pd_env=(env SMC_FABRIC_DIR="$pd/fabric" SMC_LOG="$pd/smc.log")
pd_fail() {
    echo "--- privilege drop: library log (last 40 lines)" >&2
    tail -n 40 "$pd/smc.log" >&2 || true
    fail "privdrop: $*"
}
setpriv --reuid=33 --regid=33 --clear-groups test -x "$pd" && pd_fail "www-data may search $pd before any grant"
pd_nginx() { # PORT: a config of nginx with workers as www-data
    mkdir -p "$pd/nginx$1"
    cat >"$pd/nginx$1/nginx.conf" <<EOF
daemon off;
worker_processes 3;
user www-data;
pid $pd/nginx$1/nginx.pid;
error_log $pd/nginx$1/error.log;
events { worker_connections 256; }
http {
    access_log off;
    sendfile on;
    client_body_temp_path $pd/nginx$1;
    proxy_temp_path $pd/nginx$1;
    fastcgi_temp_path $pd/nginx$1;
    uwsgi_temp_path $pd/nginx$1;
    scgi_temp_path $pd/nginx$1;
    server { listen 127.0.0.1:$1; root $work/pd-www; }
}
EOF
}
pd_curl() { # URL WHAT: the 4 MB file through smc run curl, checksummed
    local got
    got=$("${pd_env[@]}" timeout 20 "$SMC" run curl -sSf "$1" | sha256sum | cut -d' ' -f1) || pd_fail "$2 failed"
    [ "$got" = "$pd_want" ] || pd_fail "$2: payload differs"
}
pd_nginx 18471
"${pd_env[@]}" "$SMC" run nginx -c "$pd/nginx18471/nginx.conf" &
pids+=($!)
pd_ng=$!
wait_port 18471
for i in 1 2 3 4; do pd_curl "http://127.0.0.1:18471/f" "nginx curl $i"; done
grep -q "setuid to uid \[33\]: fabric directory $pd/fabric granted" "$pd/smc.log" \
    || pd_fail "nginx's workers granted nothing"
[ "$(grep -c ": SMC-R" "$pd/smc.log")" = 8 ] || pd_fail "$(grep -c ": SMC-R" "$pd/smc.log") SMC-R ends, 8 expected (4 curls)"
# wrk through the workers; meanwhile `smc ss` must list the workers' (uid 33) connections
# as SMC-R under the program name nginx, and no TCP connection of nginx or wrk.
# 16 connections, not 8: wrk sizes its event loop to 10 + 3 × connections numbers, and with
# CI's 20 inherited descriptors -c8 leaves one spare number, which a descriptor the library
# makes for a moment at the lowest free number (an eventfd before it moves up, a peer's memfd
# being mapped) can take while wrk reconnects: "connect 1", 1 run in 15 (docs/preload.md).
"${pd_env[@]}" WRK_EXPECT="$work/pd-www/k1" timeout 30 "$SMC" run \
    wrk -t2 -c16 -d2s --timeout 10s -s "$work/wrk-check.lua" "http://127.0.0.1:18471/k1" >"$pd/wrk.out" 2>&1 &
pd_wrk=$!
seen=0
# Until wrk ends (its start under `smc run` may take a while on a loaded machine).
for _ in $(seq 1 300); do
    kill -0 "$pd_wrk" 2>/dev/null || break
    sleep 0.1
    seen=$("$SMC" ss --json --dir "$pd/fabric" | python3 -c '
import json, sys
workers = 0
for s in json.load(sys.stdin):
    pid, prog = s["pid"], s["program"]
    try:
        with open("/proc/%s/status" % pid) as f:
            uid = [l.split()[1] for l in f if l.startswith("Uid:")][0]
    except OSError:
        continue
    for c in s["ss"]:
        if prog in ("nginx", "wrk") and c["mode"] != "SMC-R":
            sys.exit("%s (%s) has a %s connection" % (prog, pid, c["mode"]))
        if prog == "nginx" and c["role"] == "server" and uid == "33":
            workers += 1
print(workers)') || pd_fail "smc ss: $seen"
    [ "$seen" -ge 1 ] && break
done
[ "$seen" -ge 1 ] || pd_fail "smc ss listed no SMC-R connection of an nginx worker (uid 33)"
wait $pd_wrk || pd_fail "wrk: $(cat "$pd/wrk.out")"
! grep -q "Socket errors\|Non-2xx" "$pd/wrk.out" || pd_fail "wrk: $(cat "$pd/wrk.out")"
read -r good bad total < <(awk '/^checked/ {print $2, $4, $6}' "$pd/wrk.out")
[ "${bad:-x}" = 0 ] && [ "${good:-0}" -gt 100 ] && [ "$good" -ge "$total" ] \
    || pd_fail "wrk: bodies checked ${good:-?}, wrong ${bad:-?}, requests ${total:-?}"
# TCP only for wait_port's plain probe (at most one, seen by a worker as PeerWithoutOption).
tcp=$(grep "]: fd [0-9]*: TCP" "$pd/smc.log" || true)
[ "$(grep -vc PeerWithoutOption <<<"$tcp")" = 0 ] && [ "$(grep -c PeerWithoutOption <<<"$tcp")" -le 1 ] \
    || pd_fail "a connection is TCP: $tcp"
kill "$pd_ng"; wait "$pd_ng" 2>/dev/null || true
echo "   4 curls of 4 MB and wrk ($good bodies verified) SMC-R; smc ss: $seen SMC-R connections of uid-33 workers"

# apache2, mpm_event, 2 child processes of 8 threads, as www-data.
mkdir -p "$pd/apache"
cat >"$pd/apache/httpd.conf" <<EOF
ServerRoot $pd/apache
LoadModule mpm_event_module /usr/lib/apache2/modules/mod_mpm_event.so
LoadModule authz_core_module /usr/lib/apache2/modules/mod_authz_core.so
User www-data
Group www-data
ServerName localhost
Listen 127.0.0.1:18473
PidFile $pd/apache/httpd.pid
ErrorLog $pd/apache/error.log
Mutex file:$pd/apache default
DocumentRoot $work/pd-www
StartServers 2
ServerLimit 2
ThreadsPerChild 8
MaxRequestWorkers 16
EnableSendfile On
<Directory $work/pd-www>
    Require all granted
</Directory>
EOF
: >"$pd/smc.log"
"${pd_env[@]}" "$SMC" run apache2 -f "$pd/apache/httpd.conf" -DFOREGROUND &
pids+=($!)
pd_ap=$!
wait_port 18473
for i in 1 2 3; do pd_curl "http://127.0.0.1:18473/f" "apache2 curl $i"; done
[ "$(grep -c ": SMC-R" "$pd/smc.log")" = 6 ] || pd_fail "apache2: $(grep -c ": SMC-R" "$pd/smc.log") SMC-R ends, 6 expected"
grep -q "setuid to uid \[33\]: fabric directory" "$pd/smc.log" || pd_fail "apache2's children granted nothing"
kill "$pd_ap"; wait "$pd_ap" 2>/dev/null || true
echo "   apache2: 3 curls of 4 MB over SMC-R"

# The opt-out, on the directory the runs above granted: TCP (declined), bytes right.
pd_nginx 18472
: >"$pd/smc.log"
"${pd_env[@]}" SMC_UID_CHANGE=tcp "$SMC" run nginx -c "$pd/nginx18472/nginx.conf" &
pids+=($!)
pd_ng=$!
wait_port 18472
for i in 1 2; do pd_curl "http://127.0.0.1:18472/f" "opt-out curl $i"; done
! grep -q ": SMC-R" "$pd/smc.log" || pd_fail "SMC_UID_CHANGE=tcp: a connection is SMC-R"
[ "$(grep -c "]: fd [0-9]*: TCP (Tcp(PeerDeclined" "$pd/smc.log")" = 2 ] \
    || pd_fail "SMC_UID_CHANGE=tcp: the curls were not declined to TCP"
grep -q "SMC_UID_CHANGE=tcp, nothing granted" "$pd/smc.log" || pd_fail "the opt-out was not seen"
kill "$pd_ng"; wait "$pd_ng" 2>/dev/null || true
echo "   SMC_UID_CHANGE=tcp: 2 curls of 4 MB over TCP (declined by the workers), payloads verified"

# A temporary switch (the real or saved uid stays root: sshd's, samba's, cron's seteuid) is no
# privilege drop: nothing granted. Then a drop (setuid by root) grants, also the private parent.
mkdir -m 700 "$pd/sw"
sw_env=(env SMC_FABRIC_DIR="$pd/sw/fabric" SMC_LOG="$pd/sw.log")
"${sw_env[@]}" "$SMC" run python3 -c 'import os
os.seteuid(33); os.seteuid(0)
os.setresuid(-1, 33, 0); os.setresuid(0, 0, 0)
os.setreuid(-1, 33); os.setreuid(0, 0)
assert os.getresuid() == (0, 0, 0)' || pd_fail "temporary switches under smc run"
! grep -q "granted\|nothing granted" "$pd/sw.log" || pd_fail "a temporary switch granted: $(cat "$pd/sw.log")"
setpriv --reuid=33 --regid=33 --clear-groups test -x "$pd/sw" && pd_fail "a temporary switch gave uid 33 search on $pd/sw"
"${sw_env[@]}" "$SMC" run python3 -c 'import os; os.setuid(33)' || pd_fail "setuid(33) under smc run"
grep -q "setuid to uid \[33\]: fabric directory .* granted" "$pd/sw.log" || pd_fail "the drop granted nothing: $(cat "$pd/sw.log")"
setpriv --reuid=33 --regid=33 --clear-groups test -x "$pd/sw" || pd_fail "the drop gave uid 33 no search on $pd/sw"
echo "   seteuid/setresuid(-1,33,0)/setreuid(-1,33) by root granted nothing; setuid(33) granted"
# ==== end of privilege drop ====

# ==== relay: connections used by more than one process (docs/preload.md, "Connections
# shared by processes"). Self-contained section: scripts/preload-fork.py, then rsync.
echo "== a connection used by a forked child too, relayed through its owner (scripts/preload-fork.py)"
before=$(grep -c "relayed through it" "$SMC_LOG" 2>/dev/null || true)
kept0=$(grep -c "kept for it" "$SMC_LOG" 2>/dev/null || true)
ended0=$(grep -c "no process holds the kept connection" "$SMC_LOG" 2>/dev/null || true)
py_pair fork 19190 "a connection shared by parent and child" "$SMC"
after=$(grep -c "relayed through it" "$SMC_LOG" || true)
[ $((after - before)) -eq 12 ] || fail "fork: $((after - before)) relayed connections, 12 expected (11 scenarios, the first at both ends)"
# Scenarios 10 and 11: the parent closed before the child's first use; kept, then closed.
kept=$(($(grep -c "kept for it" "$SMC_LOG" || true) - kept0))
ended=$(($(grep -c "no process holds the kept connection" "$SMC_LOG" || true) - ended0))
[ "$kept" -eq 2 ] && [ "$ended" -eq 2 ] || fail "fork: $kept connections kept for a child, $ended closed after (2 and 2 expected)"
grep '^ok' "$work/fork-c.log" | sed 's/^/   /'

echo "== a connection passed by SCM_RIGHTS (sendmsg, sendmmsg) to forked and exec'd workers after the request, past a squatter of its name and a failed send (scripts/preload-passfd.py)"
before=$(grep -c "relayed through it" "$SMC_LOG" 2>/dev/null || true)
got0=$(grep -c "received a passed connection" "$SMC_LOG" 2>/dev/null || true)
py_pair passfd 19191 "a connection passed to a worker by SCM_RIGHTS" "$SMC"
after=$(grep -c "relayed through it" "$SMC_LOG" || true)
got=$(($(grep -c "received a passed connection" "$SMC_LOG" || true) - got0))
[ $((after - before)) -eq 8 ] && [ "$got" -eq 12 ] \
    || fail "passfd: $((after - before)) relayed (8 expected: the workers that used it), $got passes looked up (12 expected: 10 to workers, 1 back to the owner, 1 on)"
# The squatter of the pass name: refused by the receiver, which found the owner under it;
# the failed send of a pass: undone.
grep -q "the name of a passed connection (inode [0-9]*) is held by another socket: bound as" "$SMC_LOG" \
    && grep -q "relay: the server at @smc-rs-passed/[0-9/]* is process [0-9]* of uid 65534, .*: refused" "$SMC_LOG" \
    && grep -q "the name of a passed connection is held by another socket; its owner [0-9]* answered at" "$SMC_LOG" \
    || fail "passfd: the squatted pass name was not refused and passed by"
grep -q "the send of a pass failed: undone" "$SMC_LOG" || fail "passfd: the failed send of a pass was not undone"
grep '^ok' "$work/passfd-c.log" | sed 's/^/   /'

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

# ---- section apps2: tokio, node, python asyncio, PostgreSQL (self-contained) ----

# Wait until something listens on TCP port $1 (ss: no connection that the server would count).
listening() {
    for _ in $(seq 1 200); do ss -ltn "sport = :$1" | grep -q ":$1 " && return 0; sleep 0.05; done
    fail "nothing listens on port $1"
}

# An echo server and client of one event loop (CMD server PORT CONNS / CMD client PORT CONNS
# BYTES): 8 connections of 2 MB each way both ends under smc run, then a plain client's
# 1 MB (TCP); every echo checked by SHA-256, 16 SMC-R ends and 1 TCP one in the log.
echo_pair() {
    local name=$1 port=$2
    shift 2
    : >"$SMC_LOG.$name"
    SMC_LOG="$SMC_LOG.$name" "$SMC" run "$@" server "$port" 9 >"$work/$name-s.log" 2>&1 &
    pids+=($!)
    local srv=$!
    listening "$port"
    SMC_LOG="$SMC_LOG.$name" timeout 60 "$SMC" run "$@" client "$port" 8 2000000 >"$work/$name-c.log" 2>&1 \
        || { cat "$work/$name-c.log" "$work/$name-s.log"; fail "$name client (under smc run)"; }
    timeout 60 "$@" client "$port" 1 1000000 >>"$work/$name-c.log" 2>&1 \
        || { cat "$work/$name-c.log" "$work/$name-s.log"; fail "$name client (plain)"; }
    wait $srv || { cat "$work/$name-s.log"; fail "$name server"; }
    grep -q "9 connections, 17000000 bytes echoed" "$work/$name-s.log" || fail "$name server: $(cat "$work/$name-s.log")"
    local n
    n=$(grep -c ": SMC-R$" "$SMC_LOG.$name" || true)
    [ "$n" = 16 ] || fail "$name: $n SMC-R ends, 16 expected"
    n=$(grep -c ": TCP (Tcp(PeerWithoutOption))" "$SMC_LOG.$name" || true)
    [ "$n" = 1 ] || fail "$name: the plain client's connection not TCP ($n)"
    echo "   8 echoes of 2 MB right (SHA-256), 16 SMC-R ends; the plain client's echo right over TCP"
}

echo "== tokio (multi-thread runtime, tokio::net; mio dups its epoll number): echo server + client"
cargo build -q -p smc --example tokio_echo --locked
echo_pair tokio 18110 target/debug/examples/tokio_echo

echo "== tokio across two fabric directories (stacks that cannot reach each other: the client declines in place of its Confirm)"
tok=target/debug/examples/tokio_echo
: >"$SMC_LOG.tokx"
SMC_FABRIC_DIR="$work/fabric-b" SMC_LOG="$SMC_LOG.tokx" "$SMC" run "$tok" server 18113 4 >"$work/tokx-s.log" 2>&1 &
pids+=($!)
tsrv=$!
listening 18113
SMC_LOG="$SMC_LOG.tokx" timeout 60 "$SMC" run "$tok" client 18113 4 1000000 >"$work/tokx-c.log" 2>&1 \
    || { cat "$work/tokx-c.log" "$work/tokx-s.log"; fail "tokio client (another fabric)"; }
wait $tsrv || { cat "$work/tokx-s.log"; fail "tokio server (another fabric)"; }
grep -q "4 connections, 4000000 bytes echoed" "$work/tokx-s.log" || fail "tokio server: $(cat "$work/tokx-s.log")"
n=$(grep -c ": TCP (Tcp(.*Declined" "$SMC_LOG.tokx" || true)
[ "$n" = 8 ] || fail "tokio across fabrics: $n declined TCP ends, 8 expected"
echo "   4 echoes of 1 MB right over TCP (no Decline taken for data)"

if command -v node >/dev/null 2>&1; then
    echo "== node (libuv, net module, half-close): echo server + client"
    echo_pair node 18111 node scripts/preload-node.js
else
    echo "== node: skipped (node missing; run scripts/install-deps.sh)"
fi

echo "== python asyncio streams (selector loop, write_eof): echo server + client"
echo_pair asyncio 18112 python3 scripts/preload-asyncio.py

pgbin=$(ls -d /usr/lib/postgresql/*/bin 2>/dev/null | sort -V | tail -n 1)
if [ -n "$pgbin" ] && id postgres >/dev/null 2>&1; then
    echo "== PostgreSQL (a backend forked per connection) + psql (4 MB row, sha256()) + pgbench (-c 40, -C)"
    # Run as user postgres (initdb refuses root) with the discovery's capabilities, over a
    # fabric directory of that user; the clients too.
    pgw="$work/pg"
    mkdir -p "$pgw"
    chmod 711 "$work"
    cp "$SMC" "$pgw/smc"
    head -c 3000000 "$work/r4m" | base64 -w0 >"$pgw/row.txt"
    chown -R postgres "$pgw"
    chmod 700 "$pgw"
    aspg_cmd=(setpriv --reuid=postgres --regid=postgres --init-groups
        --inh-caps=+bpf,+net_admin,+perfmon --ambient-caps=+bpf,+net_admin,+perfmon
        env -u XDG_RUNTIME_DIR HOME="$pgw" SMC_FABRIC_DIR="$pgw/fabric" SMC_LOG="$pgw/preload.log"
        PGHOST=127.0.0.1 PGPORT=18432 PGUSER=postgres PGDATABASE=postgres)
    aspg() { "${aspg_cmd[@]}" "$@"; }
    aspg "$pgbin/initdb" -D "$pgw/data" -A trust -U postgres --no-sync >"$work/initdb.log" 2>&1 \
        || { cat "$work/initdb.log"; fail "initdb"; }
    # (Not through the function: $! must be the server's pid, which setpriv and smc keep.)
    "${aspg_cmd[@]}" "$pgw/smc" run "$pgbin/postgres" -D "$pgw/data" -k "$pgw" -p 18432 \
        -c listen_addresses=127.0.0.1 -c fsync=off >"$work/pg.log" 2>&1 &
    pids+=($!)
    pgpid=$!
    # (A failed check stops the server at once: a smart shutdown may wait on.)
    pgfail() { kill -QUIT $pgpid 2>/dev/null || true; fail "$@"; }
    listening 18432
    got=$(aspg timeout 30 "$pgw/smc" run psql -X -q -At -v ON_ERROR_STOP=1 -c "create table t(v text)" \
        -c "\\copy t from '$pgw/row.txt'" -c "select encode(sha256(convert_to(v, 'UTF8')), 'hex') from t") \
        || pgfail "psql: $(tail -3 "$work/pg.log")"
    [ "$got" = "$(sum "$pgw/row.txt")" ] || pgfail "psql: the row's SHA-256 differs"
    aspg timeout 30 "$pgw/smc" run "$pgbin/pgbench" -q -i -s 1 >"$work/pgbench.log" 2>&1 \
        || { cat "$work/pgbench.log"; pgfail "pgbench -i"; }
    # 40 backends at once (each shares the postmaster's eBPF instance: past 64 programs on the
    # cgroup the 65th declined), then a connection per transaction.
    aspg timeout 60 "$pgw/smc" run "$pgbin/pgbench" -c 40 -j 2 -t 20 >"$work/pgbench.log" 2>&1 \
        && grep -q "processed: 800/800" "$work/pgbench.log" \
        && grep -q "failed transactions: 0 " "$work/pgbench.log" || { cat "$work/pgbench.log"; pgfail "pgbench -c 40"; }
    aspg timeout 60 "$pgw/smc" run "$pgbin/pgbench" -C -c 4 -j 2 -t 25 -S >"$work/pgbench-C.log" 2>&1 \
        && grep -q "processed: 100/100" "$work/pgbench-C.log" || { cat "$work/pgbench-C.log"; pgfail "pgbench -C"; }
    got=$(aspg timeout 30 psql -X -At -c "select count(*) from pgbench_accounts") || pgfail "plain psql"
    [ "$got" = 100000 ] || pgfail "plain psql: $got rows of pgbench_accounts, 100000 expected"
    # pgbench as root, in the script's fabric directory, not the server's (two users' programs
    # with their default ones: the stacks cannot reach each other), 4 clients from 2 threads
    # on one CPU: every connection TCP (the client declines in place of its Confirm). It hung
    # in a connect when a backend's rendezvous read the client's startup packet along with
    # its Decline.
    : >"$work/pgbench-x.smclog"
    SMC_LOG="$work/pgbench-x.smclog" timeout 60 taskset -c 0 "$SMC" run "$pgbin/pgbench" -h 127.0.0.1 \
        -p 18432 -U postgres -c 4 -j 2 -t 20 postgres >"$work/pgbench-x.log" 2>&1 \
        && grep -q "processed: 80/80" "$work/pgbench-x.log" \
        || { cat "$work/pgbench-x.log"; pgfail "pgbench as root across fabric directories"; }
    n=$(grep -c ": TCP (Tcp(Declined(DeclineCode::ERR_RDYLNK)))" "$work/pgbench-x.smclog" || true)
    [ "$n" = 5 ] || pgfail "pgbench across fabric directories: $n declined client ends, 5 expected"
    kill -INT $pgpid
    wait $pgpid || true
    # psql 1, pgbench -i 1, -c 40 41 (its first connection checks the tables), -C 101: 144
    # connections, 288 ends; the plain psql's connection TCP.
    n=$(grep -c ": SMC-R$" "$pgw/preload.log" || true)
    [ "$n" = 288 ] || fail "PostgreSQL: $n SMC-R ends, 288 expected"
    n=$(grep -c ": TCP (Tcp(PeerWithoutOption))" "$pgw/preload.log" || true)
    [ "$n" = 1 ] || fail "PostgreSQL: the plain psql's connection not TCP ($n)"
    n=$(grep -c ": TCP (Tcp(PeerDeclined { code: DeclineCode::ERR_RDYLNK" "$pgw/preload.log" || true)
    [ "$n" = 5 ] || fail "PostgreSQL: $n backends declined by root's pgbench, 5 expected"
    echo "   4 MB row hash right, pgbench 800 + 100 transactions, 0 failed, 288 SMC-R ends; plain psql over TCP;"
    echo "   root's pgbench (another fabric directory) 80 transactions over TCP, 5 connections declined"
else
    echo "== PostgreSQL: skipped (postgresql missing; run scripts/install-deps.sh)"
fi

# ---- end of section apps2 ----

# ---- section apps3: other event loops and daemons (issue #22: programs outside the matrix) ----

echo "== closefrom(3) and close_range after the stack exists, as varnishd's manager does (scripts/preload-closefrom.py)"
# The stack's descriptors survive both: before, the library's threads spun on the closed
# numbers and the next listen could not mark its port (TCP only).
: >"$SMC_LOG.closefrom"
SMC_LOG="$SMC_LOG.closefrom" py_pair closefrom 19185 "closefrom: an echo failed"
n=$(grep -c ": SMC-R$" "$SMC_LOG.closefrom" || true)
[ "$n" = 6 ] || fail "closefrom: $n SMC-R ends, 6 expected (3 connections: before, after closefrom, after close_range)"
! grep -q "discovery failed" "$SMC_LOG.closefrom" || fail "closefrom: $(grep "discovery failed" "$SMC_LOG.closefrom")"
cat "$work/closefrom-s.log" "$work/closefrom-c.log" | sed 's/^/   /'

echo "== POLLOUT as TCP's: a third of the peer's RMBE free, not its first free byte (scripts/preload-pollout.py: plain TCP, then smc run)"
: >"$SMC_LOG.pollout"
for mode in plain smc; do
    run=()
    [ $mode = smc ] && run=("$SMC" run)
    SMC_LOG="$SMC_LOG.pollout" "${run[@]}" python3 scripts/preload-pollout.py server 19188 >"$work/pollout-s.log" 2>&1 &
    pids+=($!)
    po=$!
    listening 19188
    SMC_LOG="$SMC_LOG.pollout" timeout 30 "${run[@]}" python3 scripts/preload-pollout.py client 19188 \
        >"$work/pollout-c.log" 2>&1 || { cat "$work/pollout-c.log" "$work/pollout-s.log"; fail "POLLOUT ($mode)"; }
    wait $po || { cat "$work/pollout-s.log"; fail "POLLOUT server ($mode)"; }
    sed "s/^/   $mode: /" "$work/pollout-c.log"
done
n=$(grep -c ": SMC-R$" "$SMC_LOG.pollout" || true)
[ "$n" = 4 ] || fail "POLLOUT: $n SMC-R ends, 4 expected"

# Debian's python3 (gevent, gi) and perl modules (AnyEvent, EV): scripts/install-deps.sh.
sys_py=/usr/bin/python3
if "$sys_py" -c 'import gevent' 2>/dev/null; then
    echo "== python gevent (libev loop, greenlets, StreamServer): echo server + client"
    echo_pair gevent 18114 "$sys_py" scripts/preload-gevent.py
else
    echo "== gevent: skipped (python3-gevent missing; run scripts/install-deps.sh)"
fi
if "$sys_py" -c 'import gi; gi.require_version("Gio", "2.0")' 2>/dev/null; then
    echo "== GLib/GIO (GMainLoop, GSocketService, asynchronous streams): echo server + client"
    echo_pair gio 18115 "$sys_py" scripts/preload-gio.py
else
    echo "== GIO: skipped (python3-gi missing; run scripts/install-deps.sh)"
fi
if perl -MEV -MAnyEvent -e1 2>/dev/null; then
    echo "== perl AnyEvent over EV (libev epoll, AnyEvent::Handle, tcp_connect): echo server + client"
    echo_pair anyevent 18116 perl scripts/preload-anyevent.pl
else
    echo "== AnyEvent: skipped (libanyevent-perl or libev-perl missing; run scripts/install-deps.sh)"
fi

if command -v mosquitto >/dev/null 2>&1 && command -v mosquitto_sub >/dev/null 2>&1 && id mosquitto >/dev/null 2>&1; then
    echo "== mosquitto (drops root to user mosquitto before it listens) + mosquitto_pub/sub, 4 MB message"
    # mosquitto started as root becomes user mosquitto before it opens its listener: the
    # library loads the eBPF discovery before the change (as that user it could not; every
    # connection stayed TCP). A retained message: each subscriber gets it when it subscribes.
    printf 'listener 18883 127.0.0.1\nallow_anonymous true\n' >"$work/mosquitto.conf"
    : >"$SMC_LOG.mosq"
    SMC_LOG="$SMC_LOG.mosq" "$SMC" run mosquitto -c "$work/mosquitto.conf" >"$work/mosquitto.log" 2>&1 &
    pids+=($!)
    mosq=$!
    listening 18883
    SMC_LOG="$SMC_LOG.mosq" timeout 20 "$SMC" run mosquitto_pub -h 127.0.0.1 -p 18883 -t big -r -f "$work/r4m" \
        || fail "mosquitto_pub: $(tail -3 "$work/mosquitto.log")"
    for i in 1 2 3 plain; do
        run=("$SMC" run)
        [ $i = plain ] && run=()
        got=$(SMC_LOG="$SMC_LOG.mosq" timeout 20 "${run[@]}" mosquitto_sub -h 127.0.0.1 -p 18883 -t big -C 1 \
            | head -c 4000000 | sha256sum | cut -d' ' -f1) || fail "mosquitto_sub $i failed"
        [ "$got" = "$want" ] || fail "mosquitto_sub $i: message differs"
    done
    grep -q "^smc-preload\[$mosq\]: setuid to uid .*eBPF discovery loaded for it" "$SMC_LOG.mosq" \
        || fail "mosquitto: no discovery loaded before its privilege drop: $(grep "\[$mosq\]" "$SMC_LOG.mosq" | head -3)"
    n=$(grep -c "^smc-preload\[$mosq\]: fd [0-9]*: SMC-R$" "$SMC_LOG.mosq" || true)
    [ "$n" = 4 ] || fail "mosquitto: $n SMC-R connections at the broker, 4 expected (pub + 3 subs)"
    n=$(grep -c ": SMC-R$" "$SMC_LOG.mosq" || true)
    [ "$n" = 8 ] || fail "mosquitto: $n SMC-R ends, 8 expected"
    grep -q "^smc-preload\[$mosq\]: fd [0-9]*: TCP (Tcp(PeerWithoutOption))" "$SMC_LOG.mosq" \
        || fail "mosquitto: the plain subscriber was not TCP"
    kill $mosq
    wait $mosq 2>/dev/null || true
    echo "   4 MB message to 3 subscribers right, 8 SMC-R ends (the broker as user mosquitto); plain subscriber over TCP"
else
    echo "== mosquitto: skipped (mosquitto or mosquitto-clients missing; run scripts/install-deps.sh)"
fi

if command -v stunnel4 >/dev/null 2>&1 && command -v openssl >/dev/null 2>&1; then
    echo "== stunnel4 (TLS, a thread per connection) client and server tunnels to a socat echo, 4 MB"
    openssl req -x509 -newkey rsa:2048 -nodes -keyout "$work/tls.key" -out "$work/tls.crt" -days 2 \
        -subj /CN=localhost >/dev/null 2>&1 || fail "openssl req"
    printf '%s\n' "foreground = yes" "pid =" "[echo]" "accept = 127.0.0.1:18444" "connect = 127.0.0.1:17102" \
        "cert = $work/tls.crt" "key = $work/tls.key" >"$work/stunnel-s.conf"
    printf '%s\n' "foreground = yes" "pid =" "[echo]" "client = yes" "accept = 127.0.0.1:18445" \
        "connect = 127.0.0.1:18444" >"$work/stunnel-c.conf"
    : >"$SMC_LOG.stunnel"
    SMC_LOG="$SMC_LOG.stunnel" "$SMC" run socat TCP-LISTEN:17102,reuseaddr,fork SYSTEM:cat >/dev/null 2>&1 &
    pids+=($!)
    SMC_LOG="$SMC_LOG.stunnel" "$SMC" run stunnel4 "$work/stunnel-s.conf" >"$work/stunnel-s.log" 2>&1 &
    pids+=($!)
    SMC_LOG="$SMC_LOG.stunnel" "$SMC" run stunnel4 "$work/stunnel-c.conf" >"$work/stunnel-c.log" 2>&1 &
    pids+=($!)
    listening 17102
    listening 18444
    listening 18445
    for i in 1 2; do
        got=$(SMC_LOG="$SMC_LOG.stunnel" timeout 30 "$SMC" run socat -t 5 - TCP:127.0.0.1:18445 <"$work/r4m" \
            | sha256sum | cut -d' ' -f1) || fail "stunnel echo $i failed: $(tail -n 3 "$work/stunnel-c.log" "$work/stunnel-s.log"; tail -n 8 "$SMC_LOG.stunnel")"
        [ "$got" = "$want" ] || fail "stunnel echo $i: payload differs ($(tail -3 "$work/stunnel-s.log"))"
    done
    # 64 MB: socat polls, then writes 8 KiB to its blocking socket. With POLLOUT for any room
    # that write waited while its own input stayed unread: the chain stopped with every RMBE
    # full (200 MB: 2 of 2 runs, after 9 and 45 MB; 50 MB: 1 of 3).
    head -c 64000000 /dev/urandom >"$work/r64m"
    got=$(SMC_LOG="$SMC_LOG.stunnel" timeout 60 "$SMC" run socat -t 5 - TCP:127.0.0.1:18445 <"$work/r64m" \
        | sha256sum | cut -d' ' -f1) || fail "stunnel 64 MB echo failed: $(tail -n 3 "$work/stunnel-c.log" "$work/stunnel-s.log"; tail -n 8 "$SMC_LOG.stunnel")"
    [ "$got" = "$(sum "$work/r64m")" ] || fail "stunnel 64 MB echo: payload differs"
    rm -f "$work/r64m"
    # Per echo: client -> tunnel, tunnel -> tunnel (TLS), tunnel -> echo server: 3 connections.
    n=$(grep -c ": SMC-R$" "$SMC_LOG.stunnel" || true)
    [ "$n" = 18 ] || fail "stunnel: $n SMC-R ends, 18 expected"
    echo "   2 echoes of 4 MB and one of 64 MB through TLS right, 18 SMC-R ends (the TLS hop included)"
else
    echo "== stunnel4: skipped (stunnel4 missing; run scripts/install-deps.sh)"
fi

if command -v varnishd >/dev/null 2>&1 && command -v varnishadm >/dev/null 2>&1; then
    echo "== varnishd (manager: closefrom(3); cache child as user vcache; VCL compiler as another user) + curl + varnishadm"
    # The manager makes a stack (it tries the listening address), then closes every
    # descriptor from 3: the library's survive (its CLI then SMC-R). The VCL compiler runs as
    # another user and must load the library (before: ld.so "cannot be preloaded" in the output).
    chmod 711 "$work"
    mkdir -m 755 "$work/varn-www"
    cp "$work/r4m" "$work/varn-www/f"
    chmod 644 "$work/varn-www/f"
    : >"$SMC_LOG.varnish"
    SMC_LOG="$SMC_LOG.varnish" "$SMC" run python3 -m http.server 18131 --bind 127.0.0.1 -d "$work/varn-www" \
        >"$work/varn-http.log" 2>&1 &
    pids+=($!)
    listening 18131
    SMC_LOG="$SMC_LOG.varnish" "$SMC" run varnishd -F -n "$work/varn" -a 127.0.0.1:18132 -b 127.0.0.1:18131 \
        -s malloc,32m >"$work/varnish.log" 2>&1 &
    pids+=($!)
    varn=$!
    # (The cache process starts once the VCL is compiled: seconds.)
    for _ in $(seq 1 400); do ss -ltn "sport = :18132" | grep -q ":18132 " && break; sleep 0.05; done
    listening 18132
    for i in 1 2 3 plain; do
        run=("$SMC" run)
        [ $i = plain ] && run=()
        got=$(SMC_LOG="$SMC_LOG.varnish" timeout 20 "${run[@]}" curl -sSf "http://127.0.0.1:18132/f" | sha256sum | cut -d' ' -f1) \
            || fail "varnish curl $i failed: $(tail -5 "$work/varnish.log")"
        [ "$got" = "$want" ] || fail "varnish curl $i: payload differs"
    done
    [ "$(SMC_LOG="$SMC_LOG.varnish" timeout 10 "$SMC" run varnishadm -n "$work/varn" ping | cut -d' ' -f1)" = PONG ] \
        || fail "varnishadm ping"
    ! grep -q "cannot be preloaded" "$work/varnish.log" || fail "varnish: $(grep -m1 "cannot be preloaded" "$work/varnish.log")"
    ! grep -q "discovery failed" "$SMC_LOG.varnish" || fail "varnish: $(grep -m1 "discovery failed" "$SMC_LOG.varnish")"
    n=$(grep -c "^smc-preload\[$varn\]: fd [0-9]*: SMC-R$" "$SMC_LOG.varnish" || true)
    [ "$n" = 1 ] || fail "varnish: the manager's CLI connection (varnishadm) not SMC-R ($n)"
    # 3 curls and the cache's backend connection (one, kept alive), both ends; varnishadm's.
    n=$(grep -c ": SMC-R$" "$SMC_LOG.varnish" || true)
    [ "$n" = 10 ] || fail "varnish: $n SMC-R ends, 10 expected"
    [ "$(grep -c ": TCP (Tcp(PeerWithoutOption))" "$SMC_LOG.varnish")" = 1 ] || fail "varnish: the plain curl not TCP"
    kill $varn
    wait $varn 2>/dev/null || true
    echo "   3 curls of 4 MB through varnish right, varnishadm to the manager, 10 SMC-R ends; plain curl over TCP"
else
    echo "== varnish: skipped (varnish missing; run scripts/install-deps.sh)"
fi

# ---- end of section apps3 ----

echo "preload-apps: all passed"
