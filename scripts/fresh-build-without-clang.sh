#!/usr/bin/env bash
# Proves the README's main command on a machine without clang: builds smc-cli in a fresh
# target directory while every clang binary is hidden behind a failing stand-in (a private mount
# namespace, so the rest of the machine is untouched), then runs `smc demo --bytes 64M`.
#
#   scripts/fresh-build-without-clang.sh [TARGET_DIR]   (default: target/fresh-no-clang, emptied first)
#
# Needs root (unshare -m, bind mounts). Without root it says so and exits 1.
set -euo pipefail
cd "$(dirname "$0")/.."

if [ "$(id -u)" -ne 0 ]; then
    echo "fresh-build-without-clang: needs root (a private mount namespace hides clang)" >&2
    exit 1
fi
target=${1:-target/fresh-no-clang}
rm -rf "$target"
mkdir -p "$target"
stand_in="$target/clang-stand-in"
cat >"$stand_in" <<'STANDIN'
#!/bin/sh
echo "clang is hidden by scripts/fresh-build-without-clang.sh" >&2
exit 127
STANDIN
chmod +x "$stand_in"

export FRESH_TARGET=$target FRESH_STAND_IN=$PWD/$stand_in
unshare -m --propagation private bash -euo pipefail -c '
    hidden=0
    for f in /usr/bin/clang* /usr/local/bin/clang* /usr/lib/llvm-*/bin/clang*; do
        [ -e "$f" ] || continue
        mount --bind "$FRESH_STAND_IN" "$f"
        hidden=$((hidden + 1))
    done
    if clang --version >/dev/null 2>&1; then
        echo "fresh-build-without-clang: clang is still reachable" >&2
        exit 1
    fi
    echo "fresh-build-without-clang: $hidden clang binaries hidden; building in $FRESH_TARGET"
    CARGO_TARGET_DIR=$FRESH_TARGET cargo build --release --locked -p smc-cli
    "$FRESH_TARGET/release/smc" demo --bytes 64M
'
