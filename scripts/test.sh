#!/usr/bin/env bash
# Runs every smc-rs test: formatting, clippy, the workspace tests (unit, property, vector,
# tshark, multi-process), and a short stable run of every fuzz target.
# Installs missing tools first (scripts/install-deps.sh).
set -euo pipefail
shopt -s inherit_errexit 2>/dev/null || true
cd "$(dirname "$0")/.."

scripts/install-deps.sh

echo "== rustfmt"
cargo fmt --all -- --check
echo "== clippy"
cargo clippy --workspace --all-targets --locked -- -D warnings
# The smc crate without its default features (no eBPF discovery) is a supported configuration.
cargo clippy -p smc --no-default-features --locked -- -D warnings

echo "== fresh build without clang: the README's main command (scripts/fresh-build-without-clang.sh)"
if [ "$(id -u)" -eq 0 ]; then
    scripts/fresh-build-without-clang.sh
else
    echo "skipped: needs root to hide clang in a private mount namespace"
fi
echo "== tests"
log=$(mktemp)
trap 'rm -f "$log"' EXIT
cargo test --workspace --locked 2>&1 | tee "$log"

echo "== smc demo --fabric roce and smc bench --fabric roce --quick (two namespaces; root)"
if [ "$(id -u)" -eq 0 ]; then
    # The acceptance commands of issue #21 as a user runs them: a failover mid-stream with a
    # SHA-256 check, and the bench's SMC-R and TCP rounds (figures not judged here).
    target/debug/smc demo --fabric roce --bytes 32M
    target/debug/smc bench --fabric roce --quick
else
    echo "skipped: needs root for network namespaces"
fi

echo "== unmodified programs under smc run (scripts/preload-apps.sh)"
scripts/preload-apps.sh 2>&1 | tee -a "$log"

echo "== live SMC-Rv2 with the Linux 6.12 kernel in a VM (scripts/kernel-interop.sh)"
rc=0
timeout 420 scripts/kernel-interop.sh 2>&1 | tee -a "$log" || rc=${PIPESTATUS[0]}
case $rc in
0) ;;
77) echo "kernel interop skipped (reason above)" ;;
*) echo "kernel interop failed (exit $rc)"; exit 1 ;;
esac

echo "== loom model of the shm ring and doorbell (smc-fabric)"
RUSTFLAGS="--cfg loom" CARGO_TARGET_DIR=target/loom \
    cargo test -p smc-fabric --release --locked --lib loom 2>&1 | tee -a "$log"

echo "== fuzz (stable, no sanitizer, ${SMC_FUZZ_SECONDS:=10}s per target)"
(
    cd fuzz
    cargo fuzz build -s none
    for t in $(cargo fuzz list); do
        mkdir -p "corpus/$t"
        # Work on a scratch copy so the committed seed corpus stays as it is.
        work=$(mktemp -d)
        cp -r "corpus/$t/." "$work/"
        cargo fuzz run -s none "$t" "$work" -- -max_total_time="$SMC_FUZZ_SECONDS" >"$work.log" 2>&1 || {
            cat "$work.log"; echo "fuzz target $t failed"; exit 1; }
        grep -E '^Done [0-9]+ runs' "$work.log" | sed "s/^/fuzz $t: /" || tail -n 1 "$work.log"
        rm -rf "$work" "$work.log"
    done
)
passed=$(grep -E '^test result: ok' "$log" | sed -E 's/.* ([0-9]+) passed.*/\1/' | awk '{s+=$1} END {print s+0}')
echo "all tests passed"
echo "tests: ${passed} passed, 0 failed"
