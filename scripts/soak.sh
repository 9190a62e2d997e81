#!/usr/bin/env bash
# Soak: a mixed workload between two processes with periodic failovers, for a long time
# (not part of CI). Reports RSS and fds of both processes every 10 s, the bytes verified, the
# streams and short connections that failed (by error) and any corruption (must stay 0).
#
#   scripts/soak.sh [seconds=3600] [failover-every-ms=5000] [long-streams=4]
#
# The report goes to target/soak/soak-<UTC date>.md (a Markdown table plus the summary);
# the full log next to it.
set -euo pipefail
cd "$(dirname "$0")/.."
secs=${1:-3600}
every_ms=${2:-5000}
streams=${3:-4}
out=target/soak
mkdir -p "$out"
stamp=$(date -u +%Y-%m-%dT%H%M)
log="$out/soak-$stamp.log"
report="$out/soak-$stamp.md"
echo "soak: ${secs}s, a port down/up every ${every_ms} ms, $streams long streams; log $log"
set +e
SMC_REL_SOAK_SECS=$secs SMC_REL_SOAK_FAILOVER_MS=$every_ms SMC_REL_SOAK_STREAMS=$streams \
    cargo test --locked -p smc --test reliability_soak -- --ignored --nocapture 2>&1 | tee "$log"
status=${PIPESTATUS[0]}
set -e
{
    echo "# Soak $stamp"
    echo
    echo "\`scripts/soak.sh $secs $every_ms $streams\` on $(nproc) cores, $(uname -r); exit status $status."
    echo
    echo "| t (s) | server RSS (KiB) | server fds | client RSS (KiB) | failovers | verified (MiB) | long streams | stream errors | short conns ok | short conn errors | corrupt | server errors |"
    echo "|---|---|---|---|---|---|---|---|---|---|---|---|"
    grep -E '^SOAK [0-9]' "$log" | awk '{printf "|"; for (i = 2; i <= NF; i++) printf " %s |", $i; print ""}'
    echo
    echo '```'
    grep -E 'SOAK-END|test result|panicked' "$log" || true
    echo '```'
} >"$report"
echo "report: $report"
exit "$status"
