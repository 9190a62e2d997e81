#!/usr/bin/env bash
# Alternating A/B timing of two builds of the busy-poll 1-byte SMC-R ping-pong: the way the
# changes to the data path are judged on this noisy VM (see docs/performance.md). Each pair runs
# both binaries one after the other, the order alternating from pair to pair, so that the VM's
# slow and fast phases (minutes long) hit both alike; the verdict is how many pairs B wins and
# the median of the per-pair ratios B/A.
#
#   scripts/pingpong-ab.sh A_BINARY B_BINARY [PAIRS] [ROUND_TRIPS]
#
# The binaries are builds of the pingpong example (cargo build --release -p smc --example
# pingpong; copy target/release/examples/pingpong aside before rebuilding). Defaults: 16 pairs
# of 200,000 round trips.
set -euo pipefail
a=$1
b=$2
pairs=${3:-16}
rounds=${4:-200000}

run() {
    PINGPONG_ONLY=smc-busy "$1" "$rounds" 2>&1 | sed -n 's/.*busy poll true): \([0-9.]*\) µs.*/\1/p'
}

for i in $(seq 1 "$pairs"); do
    if [ $((i % 2)) = 1 ]; then
        ta=$(run "$a")
        tb=$(run "$b")
    else
        tb=$(run "$b")
        ta=$(run "$a")
    fi
    echo "$ta $tb"
done | python3 -c '
import statistics, sys
ratios, wins = [], 0
for line in sys.stdin:
    a, b = map(float, line.split())
    ratios.append(b / a)
    wins += b < a
    print(f"A {a:.3f} µs  B {b:.3f} µs  B/A {b / a:.3f}")
print(f"B faster in {wins} of {len(ratios)} pairs; median B/A {statistics.median(ratios):.3f}")
'
