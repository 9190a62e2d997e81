#!/usr/bin/env bash
# Installs what the smc-rs tests need, only when it is missing (Debian 12, root or sudo).
#   tshark      – the outside decoder the wire tests check our bytes against (and roce captures)
#   iproute2    – network namespaces and veth pairs for the roce tests
#   clang, llvm, libbpf-dev – rebuild the eBPF TCP-option program to check that the committed
#                 object (crates/smc/bpf/smc_tcp_option.bpf.o) matches its source; a build
#                 of smc-rs itself never needs them
#   ethtool     – the roce capture test turns the veth's UDP segmentation offload off
#   nftables    – the roce loss test has the kernel drop RoCE datagrams at random (no netem here)
#   cargo-fuzz  – builds and briefly runs the fuzz targets (stable, `-s none`)
#   redis-server, redis-tools, python3, curl, socat, iperf3, nginx-light, memcached,
#               libmemcached-tools, wrk, sockperf, haproxy, lighttpd, apache2-utils (ab), apache2,
#               openssh-client, openssh-server, mosquitto, mosquitto-clients, stunnel4, varnish,
#               python3-gevent, python3-gi, libanyevent-perl, libev-perl – the unmodified
#               programs `scripts/preload-apps.sh` runs under `smc run`
#   setpriv (util-linux), mount – the hardening tests run `smc` as another uid and mount a
#                 tiny tmpfs (crates/smc-cli/tests/hardening_cli.rs)
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
command -v nft >/dev/null 2>&1 || [ -x /usr/sbin/nft ] || missing+=(nftables)
command -v clang >/dev/null 2>&1 || missing+=(clang)
command -v llvm-strip >/dev/null 2>&1 || missing+=(llvm)
[ -f /usr/include/bpf/bpf_helpers.h ] || missing+=(libbpf-dev)
command -v setpriv >/dev/null 2>&1 || missing+=(util-linux)
command -v mount >/dev/null 2>&1 || missing+=(mount)
if [ ${#missing[@]} -gt 0 ]; then
    echo "install-deps: installing ${missing[*]}" >&2
    as_root apt-get update -qq
    as_root env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${missing[@]}" >/dev/null
fi

# The programs of scripts/preload-apps.sh (services must not start on install: policy-rc.d).
apps=()
for c in redis-server:redis-server redis-cli:redis-tools python3:python3 curl:curl \
    socat:socat iperf3:iperf3 nginx:nginx-light memcached:memcached memcslap:libmemcached-tools \
    wrk:wrk sockperf:sockperf haproxy:haproxy lighttpd:lighttpd ab:apache2-utils ssh:openssh-client \
    sshd:openssh-server apache2:apache2; do
    command -v "${c%%:*}" >/dev/null 2>&1 || apps+=("${c#*:}")
done
# rsync: its daemon and client in scripts/preload-apps.sh (a connection used by forked
# processes, relayed).
command -v rsync >/dev/null 2>&1 || apps+=(rsync)
# vsftpd: raw clones into namespaces, RLIMIT_AS, data connections passed by SCM_RIGHTS.
command -v vsftpd >/dev/null 2>&1 || [ -x /usr/sbin/vsftpd ] || apps+=(vsftpd)
if [ ${#apps[@]} -gt 0 ]; then
    echo "install-deps: installing ${apps[*]}" >&2
    if [ ! -e /usr/sbin/policy-rc.d ]; then
        printf '#!/bin/sh\nexit 101\n' | as_root tee /usr/sbin/policy-rc.d >/dev/null
        as_root chmod +x /usr/sbin/policy-rc.d
    fi
    as_root apt-get update -qq
    as_root env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${apps[@]}" >/dev/null
fi

# preload-apps.sh section apps2: node (libuv) and PostgreSQL (run as user postgres; the
# package's cluster is not used, and policy-rc.d above keeps it from starting).
apps2=()
command -v node >/dev/null 2>&1 || apps2+=(nodejs)
ls /usr/lib/postgresql/*/bin/pgbench >/dev/null 2>&1 || apps2+=(postgresql)
command -v psql >/dev/null 2>&1 || apps2+=(postgresql-client)
if [ ${#apps2[@]} -gt 0 ]; then
    echo "install-deps: installing ${apps2[*]}" >&2
    if [ ! -e /usr/sbin/policy-rc.d ]; then
        printf '#!/bin/sh\nexit 101\n' | as_root tee /usr/sbin/policy-rc.d >/dev/null
        as_root chmod +x /usr/sbin/policy-rc.d
    fi
    as_root apt-get update -qq
    as_root env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${apps2[@]}" >/dev/null
fi

# preload-apps.sh section apps3: other event loops and daemons — mosquitto (drops root before
# it listens), stunnel4 (TLS), varnish (closefrom in its manager), Debian's python3 gevent
# and gi (GLib), perl AnyEvent over EV. Services must not start on install (policy-rc.d).
apps3=()
for c in mosquitto:mosquitto mosquitto_sub:mosquitto-clients stunnel4:stunnel4 varnishd:varnish \
    openssl:openssl; do
    command -v "${c%%:*}" >/dev/null 2>&1 || [ -x "/usr/sbin/${c%%:*}" ] || apps3+=("${c#*:}")
done
/usr/bin/python3 -c 'import gevent' 2>/dev/null || apps3+=(python3-gevent)
/usr/bin/python3 -c 'import gi; gi.require_version("Gio", "2.0")' 2>/dev/null || apps3+=(python3-gi gir1.2-glib-2.0)
perl -MAnyEvent -e1 2>/dev/null || apps3+=(libanyevent-perl)
perl -MEV -e1 2>/dev/null || apps3+=(libev-perl)
if [ ${#apps3[@]} -gt 0 ]; then
    echo "install-deps: installing ${apps3[*]}" >&2
    if [ ! -e /usr/sbin/policy-rc.d ]; then
        printf '#!/bin/sh\nexit 101\n' | as_root tee /usr/sbin/policy-rc.d >/dev/null
        as_root chmod +x /usr/sbin/policy-rc.d
    fi
    as_root apt-get update -qq
    as_root env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${apps3[@]}" >/dev/null
fi

# The kernel-peer VM of scripts/kernel-interop.sh (QEMU, the initramfs's tools); its
# build-image.sh downloads the kernel package itself with apt-get download.
vm=()
for c in qemu-system-x86_64:qemu-system-x86 busybox:busybox-static tcpdump:tcpdump cpio:cpio \
    modinfo:kmod gcc:gcc xz:xz-utils zstd:zstd gzip:gzip; do
    command -v "${c%%:*}" >/dev/null 2>&1 || vm+=("${c#*:}")
done
[ -f /usr/include/linux/smc.h ] || vm+=(linux-libc-dev)
[ -f /usr/include/stdio.h ] || vm+=(libc6-dev)
if [ ${#vm[@]} -gt 0 ]; then
    echo "install-deps: installing ${vm[*]}" >&2
    as_root apt-get update -qq
    as_root env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${vm[@]}" >/dev/null
fi

if ! cargo fuzz --version >/dev/null 2>&1; then
    echo "install-deps: installing cargo-fuzz" >&2
    cargo install --locked cargo-fuzz
fi
