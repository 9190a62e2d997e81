#!/usr/bin/env bash
# Regenerates the committed eBPF object crates/smc/bpf/smc_tcp_option.bpf.o from its source,
# and its stamp (the source's SHA-256 and the compiler that built it).
#
# The object is committed so that every build of smc-rs has eBPF discovery without clang (the
# convention of aya and bpf2go users). Run this after editing the C source; the test
# `committed_bpf_object_matches_its_source` (crates/smc/tests/bpf_object.rs) fails until you do.
#
#   scripts/build-bpf.sh           rebuild the object and the stamp
#   scripts/build-bpf.sh --print   build into a temporary file and print its path (used by the test)
set -euo pipefail
cd "$(dirname "$0")/../crates/smc"

clang=${CLANG:-clang}
strip=${LLVM_STRIP:-llvm-strip}
case "$(uname -m)" in
    x86_64) inc=/usr/include/x86_64-linux-gnu ;;
    aarch64) inc=/usr/include/aarch64-linux-gnu ;;
    *) inc= ;;
esac

out=bpf/smc_tcp_option.bpf.o
if [ "${1:-}" = "--print" ]; then
    out=$(mktemp --suffix=.bpf.o)
fi

# A relative source path and a fixed debug prefix keep the object free of this checkout's path;
# `strip -g` drops the DWARF sections (aya needs only .BTF/.BTF.ext, which it keeps), so the same
# compiler gives the same bytes on every machine.
"$clang" -O2 -g -target bpf ${inc:+-I"$inc"} -fdebug-prefix-map="$PWD"=. \
    -c bpf/smc_tcp_option.bpf.c -o "$out"
"$strip" -g "$out"

if [ "${1:-}" = "--print" ]; then
    echo "$out"
    exit 0
fi
{
    echo "source-sha256 $(sha256sum bpf/smc_tcp_option.bpf.c | cut -d' ' -f1)"
    echo "compiler $("$clang" --version | head -n 1)"
} > bpf/smc_tcp_option.bpf.o.stamp
echo "wrote crates/smc/$out and its stamp"
