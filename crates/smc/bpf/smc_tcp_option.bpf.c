// SPDX-License-Identifier: MIT OR GPL-2.0
//
// smc-rs capability discovery (RFC 7609 §3.1, §3.5.1.1): a BPF_PROG_TYPE_SOCK_OPS program that
// puts the SMC experimental TCP option (kind 254, length 6, ExID E2 D4 C3 D9) on the SYN of
// sockets smc-rs marked, and on a SYN-ACK only when the SYN carried it, and records for each
// connection whether both handshake segments carried it.
//
// Maps shared with userspace (crates/smc/src/discovery.rs mirrors the layouts):
//   smc_sockets       socket cookie -> state   client sockets marked before connect()
//   smc_listen_ports  local port -> 1          listeners marked before listen()
//   smc_accepted      flow key -> 1            passive connections whose SYN and SYN-ACK carried it
#include <linux/bpf.h>
#include <linux/types.h>
#include <bpf/bpf_helpers.h>
#include <bpf/bpf_endian.h>

#define TCPOPT_EXP 254
#define SMC_OPT_LEN 6
#define TCP_FLAG_SYN 0x02
#define TCP_FLAG_ACK 0x10
#define AF_INET 2
#define AF_INET6 10

// Client socket states (values of smc_sockets).
#define SMC_CLIENT_MARKED 1      // marked by userspace; the SYN carries the option
#define SMC_CLIENT_PEER_OFFERED 2 // the SYN-ACK carried the option too

struct smc_flow_key {
	__u32 family;
	__u32 local_port;  // host byte order
	__u32 remote_port; // host byte order
	__u32 local_ip[4]; // network byte order words; IPv4 uses word 0
	__u32 remote_ip[4];
};

// The hash maps allocate their elements as entries are added (BPF_F_NO_PREALLOC) instead of
// all of them when the map is made: every process's stack makes its own maps, and making
// 65,536 + 4,096 preallocated elements cost a few milliseconds of CPU and megabytes of kernel
// memory at each start. The LRU map must stay preallocated (the kernel refuses the flag) and
// keeps its 65,536 flows: an entry lives from the handshake to the program's accept (userspace
// removes it there), but one pushed out before its accept is worse than a peer without the
// option — the SYN-ACK already carried the option, so the client sends its CLC Proposal while
// the server, finding no entry, runs plain TCP — and the kernel's LRU recycles entries well
// before the map is full (free lists per CPU).
struct {
	__uint(type, BPF_MAP_TYPE_HASH);
	__uint(max_entries, 65536);
	__uint(map_flags, BPF_F_NO_PREALLOC);
	__type(key, __u64);
	__type(value, __u32);
} smc_sockets SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_HASH);
	__uint(max_entries, 4096);
	__uint(map_flags, BPF_F_NO_PREALLOC);
	__type(key, __u32);
	__type(value, __u32);
} smc_listen_ports SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_LRU_HASH);
	__uint(max_entries, 65536);
	__type(key, struct smc_flow_key);
	__type(value, __u32);
} smc_accepted SEC(".maps");

static __always_inline void smc_opt(__u8 *o)
{
	o[0] = TCPOPT_EXP;
	o[1] = SMC_OPT_LEN;
	o[2] = 0xE2;
	o[3] = 0xD4;
	o[4] = 0xC3;
	o[5] = 0xD9;
}

// Whether the SYN (flags = BPF_LOAD_HDR_OPT_TCP_SYN) or the current segment (flags = 0)
// carries the SMC option: kind 254 with the 4-byte ExID, length exactly 6.
static __always_inline int has_smc_opt(struct bpf_sock_ops *skops, __u64 flags)
{
	__u8 buf[SMC_OPT_LEN] = {};
	long n;

	smc_opt(buf);
	n = bpf_load_hdr_opt(skops, buf, sizeof(buf), flags);
	return n == SMC_OPT_LEN && buf[1] == SMC_OPT_LEN;
}

static __always_inline void flow_key(struct bpf_sock_ops *skops, struct smc_flow_key *k)
{
	k->family = skops->family;
	k->local_port = skops->local_port;
	k->remote_port = bpf_ntohl(skops->remote_port);
	if (skops->family == AF_INET6) {
		k->local_ip[0] = skops->local_ip6[0];
		k->local_ip[1] = skops->local_ip6[1];
		k->local_ip[2] = skops->local_ip6[2];
		k->local_ip[3] = skops->local_ip6[3];
		k->remote_ip[0] = skops->remote_ip6[0];
		k->remote_ip[1] = skops->remote_ip6[1];
		k->remote_ip[2] = skops->remote_ip6[2];
		k->remote_ip[3] = skops->remote_ip6[3];
	} else {
		k->local_ip[0] = skops->local_ip4;
		k->remote_ip[0] = skops->remote_ip4;
	}
}

SEC("sockops")
int smc_tcp_option(struct bpf_sock_ops *skops)
{
	__u32 op = skops->op;
	__u32 tcp_flags;
	__u64 cookie;
	__u32 port;
	__u32 *state;
	__u8 opt[SMC_OPT_LEN];

	if (skops->family != AF_INET && skops->family != AF_INET6)
		return 1;

	switch (op) {
	case BPF_SOCK_OPS_TCP_CONNECT_CB:
		// A marked client socket is about to send its SYN: ask for the header-option callbacks.
		cookie = bpf_get_socket_cookie(skops);
		if (bpf_map_lookup_elem(&smc_sockets, &cookie))
			bpf_sock_ops_cb_flags_set(skops, skops->bpf_sock_ops_cb_flags |
						     BPF_SOCK_OPS_WRITE_HDR_OPT_CB_FLAG);
		break;

	case BPF_SOCK_OPS_TCP_LISTEN_CB:
		// A marked listener: its SYN-ACKs go through the header-option callbacks.
		port = skops->local_port;
		if (bpf_map_lookup_elem(&smc_listen_ports, &port))
			bpf_sock_ops_cb_flags_set(skops, skops->bpf_sock_ops_cb_flags |
						     BPF_SOCK_OPS_WRITE_HDR_OPT_CB_FLAG);
		break;

	case BPF_SOCK_OPS_HDR_OPT_LEN_CB:
	case BPF_SOCK_OPS_WRITE_HDR_OPT_CB:
		tcp_flags = skops->skb_tcp_flags;
		if (!(tcp_flags & TCP_FLAG_SYN))
			break;
		// Another smc-rs stack's program may have enabled these callbacks on a socket this
		// instance does not own: act only on our own sockets, so the option is never doubled.
		if (tcp_flags & TCP_FLAG_ACK) {
			port = skops->local_port;
			if (!bpf_map_lookup_elem(&smc_listen_ports, &port))
				break;
			// SYN-ACK: only when the SYN carried the option (RFC 7609 §3.5.1.1: "the
			// server should only include the SMC-R TCP option on the SYN-ACK if the client
			// included it on its SYN packet").
			if (!has_smc_opt(skops, BPF_LOAD_HDR_OPT_TCP_SYN))
				break;
		} else {
			cookie = bpf_get_socket_cookie(skops);
			if (!bpf_map_lookup_elem(&smc_sockets, &cookie))
				break;
		}
		if (op == BPF_SOCK_OPS_HDR_OPT_LEN_CB) {
			bpf_reserve_hdr_opt(skops, SMC_OPT_LEN, 0);
			break;
		}
		smc_opt(opt);
		bpf_store_hdr_opt(skops, opt, sizeof(opt), 0);
		if (tcp_flags & TCP_FLAG_ACK) {
			struct smc_flow_key k = {};
			__u32 one = 1;

			flow_key(skops, &k);
			bpf_map_update_elem(&smc_accepted, &k, &one, BPF_ANY);
		}
		break;

	case BPF_SOCK_OPS_ACTIVE_ESTABLISHED_CB:
		// The SYN-ACK that concluded the handshake is in skb_data.
		cookie = bpf_get_socket_cookie(skops);
		state = bpf_map_lookup_elem(&smc_sockets, &cookie);
		if (state) {
			if (has_smc_opt(skops, 0)) {
				__u32 v = SMC_CLIENT_PEER_OFFERED;

				bpf_map_update_elem(&smc_sockets, &cookie, &v, BPF_EXIST);
			}
			// No further segment needs the callbacks: a fallen-back connection costs nothing.
			bpf_sock_ops_cb_flags_set(skops, skops->bpf_sock_ops_cb_flags &
						     ~BPF_SOCK_OPS_WRITE_HDR_OPT_CB_FLAG);
		}
		break;

	case BPF_SOCK_OPS_PASSIVE_ESTABLISHED_CB:
		// Children inherit the listener's flags; stop the callbacks on the data path.
		if (skops->bpf_sock_ops_cb_flags & BPF_SOCK_OPS_WRITE_HDR_OPT_CB_FLAG)
			bpf_sock_ops_cb_flags_set(skops, skops->bpf_sock_ops_cb_flags &
						     ~BPF_SOCK_OPS_WRITE_HDR_OPT_CB_FLAG);
		break;
	}
	return 1;
}

char _license[] SEC("license") = "Dual MIT/GPL";
