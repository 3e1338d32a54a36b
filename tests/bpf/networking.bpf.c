// Maps with the exact layouts of maps in widely run networking programs,
// for the real-maps test: Cilium's connection tracking, load balancer and
// ipcache maps (bpf/lib/common.h, bpf/lib/maps.h), the per-CPU XDP stats
// array of the XDP tutorial, and a program's global data (.bss, .data).
// No programs: only the maps and their BTF matter.
#include <linux/types.h>
#include <linux/bpf.h>
#include <bpf/bpf_helpers.h>

#define __packed __attribute__((packed))

union v6addr {
	struct {
		__u32 p1;
		__u32 p2;
		__u32 p3;
		__u32 p4;
	};
	struct {
		__u64 d1;
		__u64 d2;
	};
	__u8 addr[16];
} __packed;

struct ipv4_ct_tuple {
	__be32 daddr;
	__be32 saddr;
	__be16 dport;
	__be16 sport;
	__u8 nexthdr;
	__u8 flags;
} __packed;

struct ipv6_ct_tuple {
	union v6addr daddr;
	union v6addr saddr;
	__be16 dport;
	__be16 sport;
	__u8 nexthdr;
	__u8 flags;
} __packed;

struct ct_entry {
	__u64 reserved0;
	__u64 backend_id;
	__u64 packets;
	__u64 bytes;
	__u32 lifetime;
	__u16 rx_closing:1,
	      tx_closing:1,
	      reserved1:1,
	      lb_loopback:1,
	      seen_non_syn:1,
	      node_port:1,
	      proxy_redirect:1,
	      dsr_internal:1,
	      from_l7lb:1,
	      reserved2:1,
	      from_tunnel:1,
	      reserved3:5;
	__u16 rev_nat_index;
	__u16 reserved4;
	__u8 tx_flags_seen;
	__u8 rx_flags_seen;
	__u32 src_sec_id;
	__u32 last_tx_report;
	__u32 last_rx_report;
};

struct {
	__uint(type, BPF_MAP_TYPE_HASH);
	__uint(max_entries, 1024);
	__type(key, struct ipv4_ct_tuple);
	__type(value, struct ct_entry);
	__uint(pinning, LIBBPF_PIN_BY_NAME);
} cilium_ct4_global SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_LRU_HASH);
	__uint(max_entries, 1024);
	__type(key, struct ipv6_ct_tuple);
	__type(value, struct ct_entry);
	__uint(pinning, LIBBPF_PIN_BY_NAME);
} cilium_ct6_global SEC(".maps");

struct lb4_key {
	__be32 address;
	__be16 dport;
	__u16 backend_slot;
	__u8 proto;
	__u8 scope;
	__u8 pad[2];
};

struct lb4_service {
	union {
		__u32 backend_id;
		__u32 affinity_timeout;
		__u32 l7_lb_proxy_port;
	};
	__u16 count;
	__u16 rev_nat_index;
	__u8 flags;
	__u8 flags2;
	__u16 qcount;
};

struct lb4_backend {
	__be32 address;
	__be16 port;
	__u8 proto;
	__u8 flags;
	__u16 cluster_id;
	__u8 zone;
	__u8 pad;
};

struct {
	__uint(type, BPF_MAP_TYPE_HASH);
	__uint(max_entries, 256);
	__type(key, struct lb4_key);
	__type(value, struct lb4_service);
	__uint(pinning, LIBBPF_PIN_BY_NAME);
} cilium_lb4_services_v2 SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_HASH);
	__uint(max_entries, 256);
	__type(key, __u32);
	__type(value, struct lb4_backend);
	__uint(pinning, LIBBPF_PIN_BY_NAME);
} cilium_lb4_backends_v3 SEC(".maps");

// Cilium's ipcache: longest-prefix match on a bpf_lpm_trie_key prefix.
struct ipcache_key {
	struct bpf_lpm_trie_key lpm_key;
	__u16 cluster_id;
	__u8 pad1;
	__u8 family;
	union {
		struct {
			__be32 ip4;
			__u32 pad4;
			__u32 pad5;
			__u32 pad6;
		};
		union v6addr ip6;
	};
} __packed;

struct remote_endpoint_info {
	__u32 sec_identity;
	__be32 tunnel_endpoint;
	__u16 pad;
	__u8 key;
	__u8 flag_skip_tunnel:1,
	     flag_has_tunnel_ep:1,
	     pad2:6;
};

struct {
	__uint(type, BPF_MAP_TYPE_LPM_TRIE);
	__uint(max_entries, 512);
	__type(key, struct ipcache_key);
	__type(value, struct remote_endpoint_info);
	__uint(map_flags, BPF_F_NO_PREALLOC);
	__uint(pinning, LIBBPF_PIN_BY_NAME);
} cilium_ipcache SEC(".maps");

// The XDP tutorial's per-CPU stats: one record per XDP action.
struct datarec {
	__u64 rx_packets;
	__u64 rx_bytes;
};

struct {
	__uint(type, BPF_MAP_TYPE_PERCPU_ARRAY);
	__uint(max_entries, XDP_REDIRECT + 1);
	__type(key, __u32);
	__type(value, struct datarec);
	__uint(pinning, LIBBPF_PIN_BY_NAME);
} xdp_stats_map SEC(".maps");

// Global data: libbpf and aya make a map of each section.
__u64 packets_seen = 0;
__u32 drops = 0;
__be16 listen_port = 0x5000; /* 80 in network order */
__u8 enabled = 1;

char LICENSE[] SEC("license") = "GPL";
