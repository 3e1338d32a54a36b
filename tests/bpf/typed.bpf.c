// Maps declared the way libbpf programs declare them, for the typed-maps
// test: clang -g emits their key and value types as BTF, which the loader
// hands to the kernel with the maps. No programs: only the maps matter.
#include <linux/types.h>
#include <linux/bpf.h>
#include <bpf/bpf_helpers.h>

enum l4_proto { L4_ICMP = 1, L4_TCP = 6, L4_UDP = 17 };

struct flow_key {
	__u32 saddr;
	__u32 daddr;
	__u16 sport;
	__u16 dport;
	enum l4_proto proto : 8;
	__u8 pad[3];
};

struct flow_stats {
	__u64 packets;
	__u64 bytes;
	char comm[16];
	struct { __u32 lo, hi; } range;
	union {
		__u32 as_u32;
		__u8 as_bytes[4];
	};
	_Bool active;
	__s8 delta;
};

struct {
	__uint(type, BPF_MAP_TYPE_HASH);
	__uint(max_entries, 1024);
	__type(key, struct flow_key);
	__type(value, struct flow_stats);
	__uint(pinning, LIBBPF_PIN_BY_NAME);
} flows SEC(".maps");

struct counters {
	__u64 rx;
	__u64 tx;
	__u32 drops;
	__u32 errors : 31;
	__u32 flag : 1;
};

struct {
	__uint(type, BPF_MAP_TYPE_PERCPU_ARRAY);
	__uint(max_entries, 4);
	__type(key, __u32);
	__type(value, struct counters);
	__uint(pinning, LIBBPF_PIN_BY_NAME);
} counters SEC(".maps");

char LICENSE[] SEC("license") = "GPL";

// A value of arrays and network-order members, for the Arrow tables test.
struct port_stats {
	__be16 port;
	__u16 hist[2][3];
	struct {
		__u32 a;
		__s32 b;
	} pairs[2];
};

struct {
	__uint(type, BPF_MAP_TYPE_HASH);
	__uint(max_entries, 64);
	__type(key, __u32);
	__type(value, struct port_stats);
	__uint(pinning, LIBBPF_PIN_BY_NAME);
} ports SEC(".maps");
