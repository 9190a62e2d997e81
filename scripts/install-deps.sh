#!/usr/bin/env bash
# Installs what the smc-rs tests need, only when it is missing (Debian 12, root or sudo).
#   tshark      – the outside decoder the wire tests check our bytes against (and roce captures)
#   iproute2    – network namespaces and veth pairs for the roce tests
#   ethtool     – the roce capture test turns the veth's UDP segmentation offload off
#   clang, libbpf-dev – build the eBPF TCP-option program (crates/smc/bpf)
#   cargo-fuzz  – builds and briefly runs the fuzz targets (stable, `-s none`)
set -euo pipefail

as_root() {
    if [ "$(id -u)" -eq 0 ]; then "$@"; else sudo "$@"; fi
}

if ! command -v tshark >/dev/null 2>&1; then
    echo "install-deps: installing tshark" >&2
    as_root apt-get update -qq
    # tshark asks whether non-root users may capture; the default (no) is fine.
    echo "wireshark-common wireshark-common/install-setuid boolean false" | as_root debconf-set-selections
    as_root env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq tshark >/dev/null
fi

missing=()
# ip (network namespaces and veth pairs of the roce tests)
command -v ip >/dev/null 2>&1 || missing+=(iproute2)
command -v ethtool >/dev/null 2>&1 || [ -x /usr/sbin/ethtool ] || missing+=(ethtool)
command -v clang >/dev/null 2>&1 || missing+=(clang)
[ -f /usr/include/bpf/bpf_helpers.h ] || missing+=(libbpf-dev)
if [ ${#missing[@]} -gt 0 ]; then
    echo "install-deps: installing ${missing[*]}" >&2
    as_root apt-get update -qq
    as_root env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${missing[@]}" >/dev/null
fi

if ! cargo fuzz --version >/dev/null 2>&1; then
    echo "install-deps: installing cargo-fuzz" >&2
    cargo install --locked cargo-fuzz
fi
