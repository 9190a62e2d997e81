#!/usr/bin/env bash
# Instructions per busy-poll round trip of SMC-R, counted by callgrind: a measure of the data
# path's work that, unlike a timing, does not move with the noise of a shared VM (the busy
# 1-byte round trip here moves between about 1.0 and 2.2 µs from minute to minute while the
# code stays the same). Compare two commits by running this on each.
#
#   scripts/pingpong-instructions.sh            # build the pingpong example, count, report
#   scripts/pingpong-instructions.sh BINARY     # count an already built pingpong example
#
# Prints, per round trip and for the client process, the inclusive instruction count of the
# functions of the data path: `write` (application write to the SEND in the peer's ring and
# the bookkeeping after it), `poll` (every completion the polls handle: the incoming CDC,
# taken off the ring and through the endpoint, `handle_msg` of it, and our SEND's own
# completion and the receive reposts), and `read-wait` (`read` without the time it spends
# waiting). The spin loop's own instructions depend on timing and are left out. Installs
# valgrind when it is missing.
set -euo pipefail
cd "$(dirname "$0")/.."

if ! command -v valgrind > /dev/null; then
    apt-get install -y valgrind > /dev/null
fi
bin=${1:-}
if [ -z "$bin" ]; then
    cargo build --release --locked -p smc --example pingpong
    bin=target/release/examples/pingpong
fi
rounds=14000
out=$(mktemp -d)
trap 'rm -rf "$out"' EXIT
# The example runs 7 batches of ROUNDS/7 round trips after ROUNDS/28 warm-up ones.
PINGPONG_ONLY=smc-busy valgrind --tool=callgrind --trace-children=yes \
    --callgrind-out-file="$out/cg.%p" "$bin" "$rounds" > /dev/null 2>&1
client=$(grep -l "^cmd: .* $rounds\$" "$out"/cg.* | head -1)
callgrind_annotate --inclusive=yes --threshold=100 "$client" 2> /dev/null | python3 -c '
import re, sys
per = 14000 + 14000 // 28
names = {
    "<smc::stream::SmcStream as std::io::Write>::write": "write",
    "<smc::stream::SmcStream as std::io::Read>::read": "read",
    "smc::stream::SmcStream::wait_progress": "wait",
    "smc_proto::endpoint::llc::<impl smc_proto::endpoint::Endpoint>::handle_message": "handle_msg",
    "smc::stack::Core::poll_completions_at": "poll",
}
got = {}
for line in sys.stdin:
    m = re.match(r"\s*([\d,]+) \(.*?\)\s+\S*?:(.*?)( \[/.*)?$", line.rstrip())
    if m and m.group(2) in names:
        k = names[m.group(2)]
        got[k] = max(got.get(k, 0), int(m.group(1).replace(",", "")) / per)
if set(names.values()) - set(got):
    sys.exit("callgrind output without the expected functions (was the binary built with debug info?)")
path = got["write"] + got["read"] - got["wait"] + got["poll"]
print("instructions per round trip (client side): write %.0f, poll %.0f (of which handle_msg %.0f), read-wait %.0f; all %.0f"
      % (got["write"], got["poll"], got["handle_msg"], got["read"] - got["wait"], path))
'
