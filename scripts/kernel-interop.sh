#!/usr/bin/env bash
# Live SMC-Rv2 interoperability with the Linux 6.12 kernel (issue #23 item 4), using the
# kernel-peer tool (a QEMU VM with rxe on a tap inside a network namespace, see
# shared/tools/kernel-peer/README.md). Runs, each with a fresh VM:
#   a) smc-rs client (`smc nc`, roce device on the tap, eBPF discovery) -> kernel AF_SMC echo
#      server: the kernel's smc_diag must say SMCR, the echo's SHA-256 must match on both sides;
#   b) kernel AF_SMC client -> smc-rs server (`smc nc -l --echo`), CONNS connections one after
#      the other (the 2nd and later reuse the link group): SMCR, data checked by the VM;
#   c) CONNS connections of one smc-rs client process (Python under the preload library) to the
#      kernel echo server, one after the other on one link group: SMCR, SHA-256 on both sides.
#   d) link failures against the kernel echo server (scripts/kernel-interop-linkfail.sh): a 3 s
#      outage while two smc-rs processes stream is survived; one of them stops answering on its
#      link and the kernel ends that connection (TEST LINK after 30 s, 2 s without a reply: its
#      only link goes, the link group with it); the stopped process, continued, gets the
#      kernel's TCP reset and exits with an error; a new connection works; the other process's
#      connection, idle 42 s, is kept because we answer the kernel's TEST LINK in time, and
#      the kernel answers ours (keepalive 1 s) in the new one; the kernel has no link group
#      left at the end.
# Each capture must decode with `smc decode -r` without error; after a, c and d (the smc-rs
# processes exit) no kernel RoCEv2 packet may meet a closed port (the exit deletes the link group).
# Usage: scripts/kernel-interop.sh [a|b|c|d]...   (default: a b c d). Root only.
# Environment: KERNEL_PEER_DIR (default ../shared/tools/kernel-peer next to the repo, else
# /work/shared/tools/kernel-peer),
# SMC_BIN, SMC_PRELOAD (default target/debug/smc and libsmc_preload.so, built), KP_BYTES (1048576), KP_CONNS for b (3),
# KP_OUT (the tool's output root). Exit 0: all passed; 1: a failure; 77: skipped (no root, no
# tool, the VM image cannot be built) with the reason on stderr.
set -euo pipefail

repo=$(cd "$(dirname "$0")/.." && pwd)
kp=${KERNEL_PEER_DIR:-$repo/../shared/tools/kernel-peer}
# The workplace keeps the tool at /work/shared as well; a checkout elsewhere still finds it there.
if [ -z "${KERNEL_PEER_DIR:-}" ] && [ ! -x "$kp/run-single.sh" ] && [ -x /work/shared/tools/kernel-peer/run-single.sh ]; then
    kp=/work/shared/tools/kernel-peer
fi
bytes=${KP_BYTES:-1048576}
conns=${KP_CONNS:-3}
ueid=KERNEL-PEER-SMCR-TEST
phases=("$@")
[ ${#phases[@]} -eq 0 ] && phases=(a b c d)

skip() {
    echo "kernel-interop: SKIP: $*" >&2
    exit 77
}

[ "$(id -u)" = 0 ] || skip "needs root (network namespace, tap device, eBPF)"
[ -x "$kp/run-single.sh" ] || skip "kernel-peer tool not found at $kp (set KERNEL_PEER_DIR)"
[ -e /dev/net/tun ] || skip "no /dev/net/tun"
if ! timeout 600 "$kp/build-image.sh" >/tmp/kernel-interop-image.$$.log 2>&1; then
    tail -5 /tmp/kernel-interop-image.$$.log >&2
    rm -f /tmp/kernel-interop-image.$$.log
    skip "the kernel-peer VM image cannot be built (see above)"
fi
rm -f /tmp/kernel-interop-image.$$.log

# The tool's namespace `kpeer` left behind by a run that was killed (no process in it) is
# removed; one with processes in it is another run in progress: two runs cannot share it.
if ip netns list | grep -qw kpeer; then
    if [ -z "$(ip netns pids kpeer 2>/dev/null)" ]; then
        echo "kernel-interop: removing the stale network namespace kpeer (no process in it)"
        ip netns del kpeer
    else
        echo "kernel-interop: network namespace kpeer is in use by another run (pids: $(ip netns pids kpeer | tr '\n' ' ')); runs cannot overlap" >&2
        exit 1
    fi
fi

# Without SMC_BIN / SMC_PRELOAD, the debug builds of this tree, brought up to date.
if [ -z "${SMC_BIN:-}${SMC_PRELOAD:-}" ]; then
    (cd "$repo" && cargo build -q -p smc-cli -p smc-preload)
fi
smc=${SMC_BIN:-$repo/target/debug/smc}
export SMC_BIN_ABS SMC_PRELOAD_ABS REPO_DIR=$repo
SMC_BIN_ABS=$(readlink -f "$smc")
preload=${SMC_PRELOAD:-$repo/target/debug/libsmc_preload.so}
SMC_PRELOAD_ABS=$(readlink -f "$preload")

# The stack's environment inside the namespace: one roce device on the tap (GID
# ::ffff:10.77.0.1), SMC option by eBPF, the VM's UEID, SMC-Rv2 only (rxe has no RoCE v1 GIDs).
export SMC_FABRIC_DEVICES="roce:r0=kp0" SMC_DISCOVERY=ebpf SMC_UEIDS=$ueid
export SMC_VERSIONS=${SMC_VERSIONS:-2}

# Phase c's client: the tool's data pattern, checked by SHA-256 against the echo.
export CLIENT_PY='
import hashlib, os, socket, sys
sys.path.insert(0, os.environ["KP_TOOL_DIR"])
import hostpeer
n = int(os.environ["KP_BYTES"]); data = hostpeer.pattern(n)
ok = True
for i in range(int(os.environ["KP_CONNS"])):
    s = socket.create_connection((os.environ["KP_VM_IP"], int(os.environ["KP_PORT"])))
    s.sendall(data); s.shutdown(socket.SHUT_WR)
    got = bytearray()
    while True:
        b = s.recv(65536)
        if not b: break
        got += b
    s.close()
    a, e = hashlib.sha256(data).hexdigest(), hashlib.sha256(got).hexdigest()
    print("KP-HOST conn=%d sent_sha256=%s echo_sha256=%s" % (i + 1, a, e), flush=True)
    ok = ok and a == e
sys.exit(0 if ok else 1)
'

# Phase d's verdict: the host side passed; the VM saw three SMC-R connections, two intact and
# one aborted; it has no link group left; a TEST LINK of the kernel was answered by us.
linkfail_verdict() {
    local out=$1 n ok failed
    if ! grep -q '^KP-HOST PASS' "$out/host-cmd.log"; then
        echo "kernel-interop: d: host side: $(grep -a 'KP-HOST FAIL' "$out/host-cmd.log" || tail -3 "$out/host-cmd.log")"
        return 1
    fi
    # P1 (8 MiB) and P3 (1 MiB) whole both ways; P2 cut short (the kernel ended it: its read
    # saw the end or an error, or its echo's write did); every byte the VM got is the pattern.
    local p2port
    p2port=$(grep -ao 'KP-HOST P2 port=[0-9]*' "$out/host-cmd.log" | sed 's/.*=//')
    if ! awk -v p2="10.77.0.1:$p2port" '
        { for (i = 1; i <= NF; i++) { split($i, kv, "="); f[kv[1]] = substr($i, length(kv[1]) + 2) } }
        f["mode"] != "SMCR" || f["data"] != "pattern" { bad = 1 }
        # (`+ 0`: a field cut out by substr is a string, compared as one otherwise.)
        f["peer"] == p2 { p2n++; if (f["rx"] + 0 >= 16777216) bad = 1; next }
        f["status"] == "OK" && f["rx"] == 8388608 && f["tx"] == 8388608 { p1n++; next }
        f["status"] == "OK" && f["rx"] == 1048576 && f["tx"] == 1048576 { p3n++; next }
        { bad = 1 }
        END { exit !(NR == 3 && p1n == 1 && p2n == 1 && p3n == 1 && !bad) }' "$out/results.log"; then
        echo "kernel-interop: d: expected 3 SMC-R connections in the VM: 8 MiB and 1 MiB echoed, and P2's (port $p2port) cut short:"
        cat "$out/results.log"
        return 1
    fi
    # The VM's link group list (printed after its server stopped) is empty.
    if ! tr -d '\r' < "$out/console.log" | awk '
        /^== SMC-R link groups ==/ { on = 1; next }
        /^== SMC-R links ==/ { on = 0 }
        on && NF { left = 1 }
        END { exit left }'; then
        echo "kernel-interop: d: the kernel still has a link group at the end:"
        tr -d '\r' < "$out/console.log" | sed -n '/^== SMC-R link groups ==/,/^== SMC-R links ==/p'
        return 1
    fi
    # TEST LINK: a request of the kernel to one of our QPs (the destination of one of its
    # CONFIRM LINK requests) answered by us on that link within the kernel's 2 s. (Linux sends
    # zero user data, so request and reply are matched by link and time; the capture's times
    # are read from the pcap records.)
    "$SMC_BIN_ABS" decode -r "$out/tap.pcap" --json > "$out/decode.json" || return 1
    if ! python3 - "$out/decode.json" "$out/tap.pcap" <<'PY'
import json, struct, sys
msgs = [json.loads(l) for l in open(sys.argv[1]) if l.startswith("{")]
raw = open(sys.argv[2], "rb").read()
end = "<" if raw[:4] in (b"\xd4\xc3\xb2\xa1", b"\x4d\x3c\xb2\xa1") else ">"
frac = 1e-9 if raw[:4] in (b"\x4d\x3c\xb2\xa1", b"\xa1\xb2\x3c\x4d") else 1e-6
t, off = [None], 24
while off + 16 <= len(raw):
    sec, sub, incl, _ = struct.unpack(end + "IIII", raw[off:off + 16])
    t.append(sec + sub * frac)
    off += 16 + incl
# our QP -> the kernel's QP of the same link
peer = {m["dest_qp"]: m["sender_qp_number"] for m in msgs
        if m["kind"] == "llc.confirm_link" and not m["reply"]}
tl = [m for m in msgs if m["kind"] == "llc.test_link"]
answered, late = 0, 0
for q, k in peer.items():
    asks = [m for m in tl if not m["reply"] and m["dest_qp"] == q]
    if not asks:
        continue
    t0 = t[asks[0]["frame"]]
    replies = [t[m["frame"]] - t0 for m in tl if m["reply"] and m["dest_qp"] == k and t[m["frame"]] >= t0]
    first = min(replies) if replies else None
    ok = first is not None and first <= 2.0
    answered += ok
    late += not ok
    print("kernel-interop: d: the kernel's TEST LINK to our QP %d (%d frames): %s" % (
        q, len(asks), "no reply" if first is None else "our reply after %.3f s" % first))
print("kernel-interop: d: %d link(s) answered the kernel's TEST LINK within 2 s, %d did not" % (answered, late))
# The other way (P3, our keepalive at 1 s): our TEST LINKs to the kernel's QP, each answered
# by the kernel within 2 s.
ours = {k: q for q, k in peer.items()}
mine = [m for m in tl if not m["reply"] and m["dest_qp"] in ours]
unanswered = 0
for m in mine:
    t0 = t[m["frame"]]
    if not any(r["reply"] and r["dest_qp"] == ours[m["dest_qp"]] and 0 <= t[r["frame"]] - t0 <= 2.0 for r in tl):
        unanswered += 1
print("kernel-interop: d: our TEST LINK frames to the kernel: %d, %d without its reply within 2 s" % (len(mine), unanswered))
sys.exit(0 if answered and mine and not unanswered else 1)
PY
    then
        echo "kernel-interop: d: TEST LINK not answered within 2 s (see above)"
        return 1
    fi
    return 0
}

fail=0
for phase in "${phases[@]}"; do
    case $phase in
    a)
        # The host command: the data pattern of the tool (seed 0), through `smc nc`, and the
        # echo compared with it. It also checks that smc-rs saw SMC-R.
        host_cmd='set -e
            python3 -c "import sys; sys.path.insert(0, \"$KP_TOOL_DIR\"); import hostpeer; sys.stdout.buffer.write(hostpeer.pattern($KP_BYTES))" > "$KP_RUN_DIR/sent.bin"
            timeout 60 "$SMC_BIN_ABS" nc -v "$KP_VM_IP" "$KP_PORT" < "$KP_RUN_DIR/sent.bin" > "$KP_RUN_DIR/echo.bin" 2> "$KP_RUN_DIR/smc-nc.log"
            cat "$KP_RUN_DIR/smc-nc.log"
            grep -q "over SMC-R" "$KP_RUN_DIR/smc-nc.log"
            a=$(sha256sum < "$KP_RUN_DIR/sent.bin" | cut -d" " -f1); b=$(sha256sum < "$KP_RUN_DIR/echo.bin" | cut -d" " -f1)
            echo "KP-HOST sent_sha256=$a echo_sha256=$b"
            [ "$a" = "$b" ]'
        args=(--role server --mode echo --conns 1 --bytes "$bytes" --ueid "$ueid" --expect smcr)
        ;;
    c)
        # Several connections of one smc-rs process on one link group: the tool's own Python
        # client under the preload library (every socket an smc-rs socket), one after the other.
        # Blocking sockets, one thread: each connection sends its bytes, half-closes, then
        # reads the whole echo, so KP_BYTES must fit in the receive buffers (256 KiB here).
        host_cmd='exec env LD_PRELOAD="$SMC_PRELOAD_ABS" timeout 100 python3 -c "$CLIENT_PY"'
        args=(--role server --mode echo --conns "$conns" --bytes 262144 --ueid "$ueid" --expect smcr)
        ;;
    d)
        # Link failures (scripts/kernel-interop-linkfail.sh): an outage survived, a silent link
        # the kernel ends by TEST LINK, a long-idle connection kept by answering its TEST LINK.
        # The VM serves until told (--conns 0) so that its link groups are listed after all.
        host_cmd='SMC_FABRIC_DIR="$KP_RUN_DIR/fabric" exec timeout 150 "$REPO_DIR/scripts/kernel-interop-linkfail.sh"'
        args=(--role server --mode echo --conns 0 --bytes 0 --idle 90 --ueid "$ueid" --expect smcr)
        ;;
    b)
        host_cmd='exec timeout 200 "$SMC_BIN_ABS" nc -v -l "$KP_PORT" --echo --bind "$KP_HOST_IP"'
        args=(--role client --mode echo --conns "$conns" --parallel "${KP_PARALLEL:-1}" --bytes "$bytes"
            --ueid "$ueid" --expect smcr --host-grace 5)
        ;;
    *)
        echo "kernel-interop: unknown phase '$phase' (a, b, c or d)" >&2
        exit 2
        ;;
    esac
    echo "kernel-interop: phase $phase"
    out=${KP_OUT:-/var/tmp/kernel-peer}/runs/interop-$phase-$(date +%Y%m%d-%H%M%S)-$$
    ok=1
    if [ "$phase" = d ]; then
        # One connection is meant to fail, which the tool's verdict counts as a failure: the
        # checks are ours (linkfail_verdict).
        "$kp/run-single.sh" "${args[@]}" --timeout 200 --out "$out" --host-cmd "$host_cmd" || true
        linkfail_verdict "$out" || ok=0
    else
        "$kp/run-single.sh" "${args[@]}" --timeout 150 --out "$out" --host-cmd "$host_cmd" || ok=0
    fi
    # Every SMC message of the capture decodes (smc decode exits non-zero on any error).
    if [ $ok = 1 ] && ! "$SMC_BIN_ABS" decode -r "$out/tap.pcap" >"$out/decode.txt"; then
        echo "kernel-interop: smc decode -r $out/tap.pcap reported errors"
        ok=0
    fi
    # Every phase ends with the smc-rs process (phase b's listener by SIGTERM, which `smc nc`
    # turns into exit): its exit deletes the link group, so the
    # kernel's packets never meet a closed port (ICMP port unreachable on the tap).
    if [ $ok = 1 ]; then
        unreachable=$(tcpdump -nr "$out/tap.pcap" 2>/dev/null | grep -c 'udp port 4791 unreachable' || true)
        if [ "$unreachable" != 0 ]; then
            echo "kernel-interop: $unreachable RoCEv2 packets of the kernel hit a closed port after our exit"
            ok=0
        fi
    fi
    if [ $ok = 1 ]; then
        echo "kernel-interop: phase $phase PASS ($out)"
    else
        echo "kernel-interop: phase $phase FAIL ($out)"
        fail=1
    fi
done
exit $fail
