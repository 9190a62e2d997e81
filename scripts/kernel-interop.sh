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
# Each capture must decode with `smc decode -r` without error; after a and c (the smc-rs process
# exits) no kernel RoCEv2 packet may meet a closed port (the exit deletes the link group).
# Usage: scripts/kernel-interop.sh [a|b|c]...   (default: a b c). Root only.
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
[ ${#phases[@]} -eq 0 ] && phases=(a b c)

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

# Without SMC_BIN / SMC_PRELOAD, the debug builds of this tree, brought up to date.
if [ -z "${SMC_BIN:-}${SMC_PRELOAD:-}" ]; then
    (cd "$repo" && cargo build -q -p smc-cli -p smc-preload)
fi
smc=${SMC_BIN:-$repo/target/debug/smc}
export SMC_BIN_ABS SMC_PRELOAD_ABS
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
    b)
        host_cmd='exec timeout 200 "$SMC_BIN_ABS" nc -v -l "$KP_PORT" --echo --bind "$KP_HOST_IP"'
        args=(--role client --mode echo --conns "$conns" --parallel 1 --bytes "$bytes"
            --ueid "$ueid" --expect smcr --host-grace 5)
        ;;
    *)
        echo "kernel-interop: unknown phase '$phase' (a, b or c)" >&2
        exit 2
        ;;
    esac
    echo "kernel-interop: phase $phase"
    out=${KP_OUT:-/var/tmp/kernel-peer}/runs/interop-$phase-$(date +%Y%m%d-%H%M%S)-$$
    ok=1
    "$kp/run-single.sh" "${args[@]}" --timeout 150 --out "$out" --host-cmd "$host_cmd" || ok=0
    # Every SMC message of the capture decodes (smc decode exits non-zero on any error).
    if [ $ok = 1 ] && ! "$SMC_BIN_ABS" decode -r "$out/tap.pcap" >"$out/decode.txt"; then
        echo "kernel-interop: smc decode -r $out/tap.pcap reported errors"
        ok=0
    fi
    # Phases a and c end with the smc-rs process: its exit deletes the link group, so the
    # kernel's packets never meet a closed port (ICMP port unreachable on the tap).
    if [ $ok = 1 ] && [ "$phase" != b ]; then
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
