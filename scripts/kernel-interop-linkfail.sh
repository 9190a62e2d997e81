#!/usr/bin/env bash
# Host side of phase d of scripts/kernel-interop.sh: link failures with the Linux 6.12 kernel as
# the server (kernel-peer runs this inside its namespace, with KP_* set; the VM is an AF_SMC echo
# server that reports every connection). Three smc-rs client processes (`smc nc`, one link
# group each, sharing 10.77.0.1:4791):
#   P1  4 MiB at 1 MiB/s, 42 s of silence, 4 MiB more. Rides through the 3 s outage below
#       (RoCE RC retransmission on both sides) and through the kernel's TEST LINK after 30 s
#       of silence (our keepalive is off, so the kernel's timer is the one that fires): the
#       whole echo must come back intact.
#   P2  16 MiB at 1 MiB/s; rides through the outage, then is stopped (SIGSTOP): its RoCE link
#       goes silent, as after a failure the kernel cannot see. The kernel must notice by TEST
#       LINK (30 s + 2 s), take its only link down, terminate the link group and abort the
#       connection (its server reports FAIL). Continued (SIGCONT), P2 must end with an error
#       (the kernel's TCP reset), not hang.
#   P3  after that: a new connection, over SMC-R, 512 KiB, 3 s of silence, 512 KiB, echo intact;
#       with our keepalive at 1 s, so the kernel answers our TEST LINKs meanwhile (else our
#       2 s LLC timer would take the link down and reset the connection).
# The outage: a blackhole route to the VM for 3 s while P1 and P2 stream (everything we send is
# lost; the netdev stays up, so neither side sees a port event).
# Prints "KP-HOST PASS" at the end when every check passed; "KP-HOST FAIL: why" otherwise.
set -u
run=$KP_RUN_DIR
smc=$SMC_BIN_ABS
vm=$KP_VM_IP
port=$KP_PORT
MiB=1048576

fail() {
    echo "KP-HOST FAIL: $*"
    for p in ${p1:-} ${p2:-} ${p3:-}; do kill -CONT "$p" 2>/dev/null; kill -KILL "$p" 2>/dev/null; done
    ip route del blackhole "$vm/32" 2>/dev/null
    exit 1
}
size() { stat -c %s "$1" 2>/dev/null || echo 0; }
# gone PID: the process has exited (a zombie counts as exited).
gone() { [ ! -e "/proc/$1" ] || grep -q '^[0-9]* (.*) Z' "/proc/$1/stat" 2>/dev/null; }
# wait_for SECS CMD...: poll CMD every 0.2 s; 1 when SECS pass first.
wait_for() {
    local end=$(($(date +%s) + $1))
    shift
    until "$@"; do
        [ "$(date +%s)" -ge "$end" ] && return 1
        sleep 0.2
    done
}
# sha FILE [BYTES]: SHA-256 of FILE (of its first BYTES).
sha() {
    if [ $# = 2 ]; then head -c "$2" "$1"; else cat "$1"; fi | sha256sum | cut -d' ' -f1
}

# The tool's data pattern (seed 0), which the VM checks every byte against.
python3 -c "import sys; sys.path.insert(0, '$KP_TOOL_DIR'); import hostpeer; sys.stdout.buffer.write(hostpeer.pattern(16 * $MiB))" \
    > "$run/pattern.bin" || fail "pattern"
# A paced writer of slices of the pattern: arguments START-END@BYTES_PER_S (0: at once) and
# sleep=S.
feed='
import os, sys, time
p = open(sys.argv[1], "rb").read()
out = sys.stdout.buffer
for a in sys.argv[2:]:
    if a.startswith("sleep="):
        time.sleep(float(a[6:])); continue
    span, rate = a.split("@"); s, e = map(int, span.split("-")); rate = int(rate)
    step = 65536
    for i in range(s, e, step):
        out.write(p[i:min(i + step, e)]); out.flush()
        if rate: time.sleep(step / rate)
'
client() { # client NAME FEED-ARGS...: smc nc fed by the writer, echo to NAME.echo; pid in $!
    local name=$1
    shift
    python3 -c "$feed" "$run/pattern.bin" "$@" 2>/dev/null |
        "$smc" nc -v "$vm" "$port" > "$run/$name.echo" 2> "$run/$name.err" &
}

t0=$(date +%s)
client p1 0-$((4 * MiB))@$MiB sleep=42 $((4 * MiB))-$((8 * MiB))@0
p1=$!
client p2 0-$((16 * MiB))@$MiB
p2=$!
running() { [ "$(size "$run/p1.echo")" -gt 262144 ] && [ "$(size "$run/p2.echo")" -gt 262144 ]; }
wait_for 30 running || fail "P1 and P2 did not get going: $(cat "$run/p1.err" "$run/p2.err")"
grep -q "over SMC-R" "$run/p1.err" || fail "P1 not over SMC-R: $(cat "$run/p1.err")"
grep -q "over SMC-R" "$run/p2.err" || fail "P2 not over SMC-R: $(cat "$run/p2.err")"
# P2's TCP port, by which the VM's report of its connection is known.
p2port=$(ss -Htnp state established dst "$vm:$port" | grep "pid=$p2," | awk '{print $3}' | sed 's/.*://')
[ -n "$p2port" ] || fail "P2's TCP connection not found: $(ss -Htnp)"
echo "KP-HOST P2 port=$p2port"

# The outage: 3 s of everything we send to the VM dropped, while both stream.
ip route add blackhole "$vm/32" || fail "blackhole route"
echo "KP-HOST outage start at $(($(date +%s) - t0)) s: P1 echo $(size "$run/p1.echo"), P2 echo $(size "$run/p2.echo")"
sleep 3
ip route del blackhole "$vm/32" || fail "blackhole route removal"
b2=$(size "$run/p2.echo")
echo "KP-HOST outage end: P1 echo $(size "$run/p1.echo"), P2 echo $b2"
# Both streams move again (P1 has 4 MiB to go at most; P2 16).
grows() { [ "$(size "$run/p2.echo")" -gt $((b2 + 524288)) ]; }
wait_for 20 grows || fail "P2 did not resume after the outage (echo $(size "$run/p2.echo"))"
"$smc" device --json --dir "$SMC_FABRIC_DIR" > "$run/devices.json" 2>&1
retx=$(python3 -c '
import json, sys
def walk(v):
    if isinstance(v, dict):
        return sum(walk(x) for x in v.values()) if "retransmits" not in v else v["retransmits"]
    if isinstance(v, list):
        return sum(walk(x) for x in v)
    return 0
print(walk(json.load(open(sys.argv[1]))))' "$run/devices.json" 2>/dev/null || echo "?")
echo "KP-HOST outage survived: P2 echo $(size "$run/p2.echo"); our retransmissions: $retx"
case $retx in '' | '?' | 0) fail "no retransmission counted: the outage lost nothing? $(cat "$run/devices.json")" ;; esac

# P2's link fails: the process stops answering. The kernel must abort its connection.
kill -STOP "$p2" || fail "SIGSTOP P2"
ts=$(date +%s)
echo "KP-HOST P2 stopped at $((ts - t0)) s (echo $(size "$run/p2.echo"))"
# (Linux 6.12 ends the socket as at EOF: its read returns 0, so the VM's report may say OK;
# the connection ends early, with less than the 16 MiB P2 would have sent.)
p2line() { tr -d '\r' < "$run/console.log" | grep -ao "KP-RESULT .* peer=[0-9.]*:$p2port .*"; }
wait_for 75 p2line || fail "the kernel did not end P2's connection 75 s after its link went silent"
echo "KP-HOST kernel ended P2's connection $(($(date +%s) - ts)) s after the stop: $(p2line)"
kill -CONT "$p2"
tc=$(date +%s)
wait_for 30 gone "$p2" || fail "P2 still runs 30 s after SIGCONT: $(cat "$run/p2.err")"
wait "$p2"
rc2=$?
echo "KP-HOST P2 ended $(($(date +%s) - tc)) s after SIGCONT with status $rc2: $(tr '\n' ' ' < "$run/p2.err")"
[ "$rc2" != 0 ] || fail "P2 ended with status 0 after its connection was aborted"
grep -qiE "reset|abort" "$run/p2.err" || fail "P2 did not report a reset: $(cat "$run/p2.err")"

# A new connection afterwards: SMC-R again, echo intact.
SMC_KEEPALIVE_MS=1000 client p3 0-$((MiB / 2))@0 sleep=3 $((MiB / 2))-$MiB@0
p3=$!
wait_for 60 gone "$p3" || fail "P3 did not finish in 60 s"
wait "$p3" || fail "P3 failed: $(cat "$run/p3.err")"
grep -q "over SMC-R" "$run/p3.err" || fail "P3 not over SMC-R: $(cat "$run/p3.err")"
[ "$(sha "$run/p3.echo")" = "$(sha "$run/pattern.bin" $MiB)" ] || fail "P3's echo differs ($(size "$run/p3.echo") bytes)"
echo "KP-HOST P3: 1 MiB echoed over SMC-R across 3 s of our TEST LINKs, SHA-256 $(sha "$run/p3.echo")"

# P1: through the outage and the kernel's TEST LINK, the whole echo.
wait_for 90 gone "$p1" || fail "P1 did not finish"
wait "$p1" || fail "P1 failed: $(cat "$run/p1.err")"
[ "$(sha "$run/p1.echo")" = "$(sha "$run/pattern.bin" $((8 * MiB)))" ] || fail "P1's echo differs ($(size "$run/p1.echo") bytes)"
echo "KP-HOST P1: 8 MiB echoed over SMC-R across the outage and 42 s of silence, SHA-256 $(sha "$run/p1.echo"); $(($(date +%s) - t0)) s in all"
# Nothing of ours is left: every stack removed its control socket at exit.
left=$(ls -A "$SMC_FABRIC_DIR/stacks" 2>/dev/null)
[ -z "$left" ] || fail "smc-rs stacks still registered in $SMC_FABRIC_DIR/stacks: $left"
# Our exits have deleted their link groups; give the kernel a moment before it is asked.
sleep 1
echo "KP-HOST PASS"
