// Counters that a BPF program increments while user space drains them, for
// the drain benchmark (tests/benches/drain.rs): what
// BPF_MAP_LOOKUP_AND_DELETE_BATCH does to increments made through a pointer
// the program looked up.
//
// Each tc program (run with BPF_PROG_TEST_RUN; not XDP, whose test runs
// with a repeat count swap the XDP dispatcher twice a call, milliseconds
// each) takes a u32 key from the first 4 bytes of its input packet, looks it up in its map, inserts 0 if
// it is absent (BPF_NOEXIST, then looks it up again) and increments the
// value through the pointer, as counting programs do:
// - count_prealloc: `counters`, a preallocated hash (the default);
// - count_no_prealloc: `counters_no_prealloc`, BPF_F_NO_PREALLOC;
// - count_percpu: `counters_percpu`, a per-CPU hash (the CPU's own value);
// - count_double: `counters_a` or `counters_b`, whichever `active` names, a
//   pair of preallocated hashes that the collector swaps before draining
//   the one no longer written.
// A run whose second lookup finds nothing (the key deleted between the
// insert and the lookup) counts itself in `vanished`, at its program's
// index.
//
// fsync_enter and fsync_exit (raw tracepoints on sys_enter and sys_exit)
// count the fsync and fdatasync calls of one process and the time spent in
// them, in `fsync_stats`: the benchmark's daemon spools every drained chunk
// with fsync.
#include <linux/types.h>
#include <linux/bpf.h>
#include <bpf/bpf_helpers.h>

#define MAX_KEYS 1024
#define TC_ACT_OK 0
#define TC_ACT_SHOT 2

struct {
	__uint(type, BPF_MAP_TYPE_HASH);
	__uint(max_entries, MAX_KEYS);
	__type(key, __u32);
	__type(value, __u64);
} counters SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_HASH);
	__uint(max_entries, MAX_KEYS);
	__uint(map_flags, BPF_F_NO_PREALLOC);
	__type(key, __u32);
	__type(value, __u64);
} counters_no_prealloc SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_PERCPU_HASH);
	__uint(max_entries, MAX_KEYS);
	__type(key, __u32);
	__type(value, __u64);
} counters_percpu SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_HASH);
	__uint(max_entries, MAX_KEYS);
	__type(key, __u32);
	__type(value, __u64);
} counters_a SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_HASH);
	__uint(max_entries, MAX_KEYS);
	__type(key, __u32);
	__type(value, __u64);
} counters_b SEC(".maps");

// Which of counters_a (0) and counters_b (1) count_double writes.
struct {
	__uint(type, BPF_MAP_TYPE_ARRAY);
	__uint(max_entries, 1);
	__type(key, __u32);
	__type(value, __u32);
} active SEC(".maps");

// Runs that lost their key between the insert and the second lookup, by
// program: 0 prealloc, 1 no_prealloc, 2 percpu, 3 double.
struct {
	__uint(type, BPF_MAP_TYPE_ARRAY);
	__uint(max_entries, 4);
	__type(key, __u32);
	__type(value, __u64);
} vanished SEC(".maps");

static __always_inline int bump(void *map, struct __sk_buff *ctx, __u32 index)
{
	void *data = (void *)(long)ctx->data;
	void *data_end = (void *)(long)ctx->data_end;
	__u64 zero = 0, *v, *miss;
	__u32 key;

	if (data + sizeof(key) > data_end)
		return TC_ACT_SHOT;
	key = *(__u32 *)data;
	v = bpf_map_lookup_elem(map, &key);
	if (!v) {
		bpf_map_update_elem(map, &key, &zero, BPF_NOEXIST);
		v = bpf_map_lookup_elem(map, &key);
		if (!v) {
			miss = bpf_map_lookup_elem(&vanished, &index);
			if (miss)
				__sync_fetch_and_add(miss, 1);
			return TC_ACT_SHOT;
		}
	}
	__sync_fetch_and_add(v, 1);
	return TC_ACT_OK;
}

SEC("classifier")
int count_prealloc(struct __sk_buff *ctx)
{
	return bump(&counters, ctx, 0);
}

SEC("classifier")
int count_no_prealloc(struct __sk_buff *ctx)
{
	return bump(&counters_no_prealloc, ctx, 1);
}

SEC("classifier")
int count_percpu(struct __sk_buff *ctx)
{
	return bump(&counters_percpu, ctx, 2);
}

SEC("classifier")
int count_double(struct __sk_buff *ctx)
{
	__u32 zero = 0;
	__u32 *which = bpf_map_lookup_elem(&active, &zero);

	if (which && *which)
		return bump(&counters_b, ctx, 3);
	return bump(&counters_a, ctx, 3);
}

// Set by the loader: the process whose fsyncs are counted, and the
// architecture's syscall numbers of fsync and fdatasync.
const volatile __u32 target_tgid = 0;
const volatile __s64 nr_fsync = -1;
const volatile __s64 nr_fdatasync = -1;

struct fsync_totals {
	__u64 calls;
	__u64 ns;
};

struct {
	__uint(type, BPF_MAP_TYPE_HASH);
	__uint(max_entries, 1024);
	__type(key, __u32);
	__type(value, __u64);
} fsync_start SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_ARRAY);
	__uint(max_entries, 1);
	__type(key, __u32);
	__type(value, struct fsync_totals);
} fsync_stats SEC(".maps");

SEC("raw_tracepoint/sys_enter")
int fsync_enter(struct bpf_raw_tracepoint_args *ctx)
{
	__u64 id = bpf_get_current_pid_tgid();
	__s64 nr;
	__u32 tid;
	__u64 now;

	if ((id >> 32) != target_tgid)
		return 0;
	nr = (__s64)ctx->args[1];
	if (nr != nr_fsync && nr != nr_fdatasync)
		return 0;
	tid = (__u32)id;
	now = bpf_ktime_get_ns();
	bpf_map_update_elem(&fsync_start, &tid, &now, BPF_ANY);
	return 0;
}

SEC("raw_tracepoint/sys_exit")
int fsync_exit(struct bpf_raw_tracepoint_args *ctx)
{
	__u64 id = bpf_get_current_pid_tgid();
	struct fsync_totals *t;
	__u32 tid, zero = 0;
	__u64 *start;

	if ((id >> 32) != target_tgid)
		return 0;
	tid = (__u32)id;
	start = bpf_map_lookup_elem(&fsync_start, &tid);
	if (!start)
		return 0;
	t = bpf_map_lookup_elem(&fsync_stats, &zero);
	if (t) {
		__sync_fetch_and_add(&t->calls, 1);
		__sync_fetch_and_add(&t->ns, bpf_ktime_get_ns() - *start);
	}
	bpf_map_delete_elem(&fsync_start, &tid);
	return 0;
}

char LICENSE[] SEC("license") = "GPL";
