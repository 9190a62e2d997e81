#!/usr/bin/env bash
# Runs every smc-rs test: formatting, clippy, the workspace tests (unit, property, vector,
# tshark, multi-process), and a short stable run of every fuzz target.
# Installs missing tools first (scripts/install-deps.sh).
set -euo pipefail
cd "$(dirname "$0")/.."

scripts/install-deps.sh

echo "== rustfmt"
cargo fmt --all -- --check
echo "== clippy"
cargo clippy --workspace --all-targets --locked -- -D warnings
echo "== tests"
cargo test --workspace --locked

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
echo "all tests passed"
