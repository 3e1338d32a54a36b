// User stacks kept by build ID: a stack-trace map created with
// BPF_F_STACK_BUILD_ID keeps each user frame as the ELF build ID of its
// binary and the frame's offset in that file (no address), so that it can
// be named after the process exits. `on_enter` (a raw tracepoint on
// sys_enter) counts the nanosleep(2) calls of process `target_tgid` by
// user stack, in `counts`, keyed as libbpf-tools key theirs (`tgid`,
// `user_stack_id`); `on_enter_plain` the same by address in `plain_counts`
// and `plain_stacks`, a stack-trace map as profilers make them.
#include <linux/types.h>
#include <linux/bpf.h>
#include <bpf/bpf_helpers.h>

#define MAX_DEPTH 32
#define NR_NANOSLEEP 35

struct {
	__uint(type, BPF_MAP_TYPE_STACK_TRACE);
	__uint(max_entries, 1024);
	__uint(key_size, sizeof(__u32));
	__uint(value_size, MAX_DEPTH * sizeof(struct bpf_stack_build_id));
	__uint(map_flags, BPF_F_STACK_BUILD_ID);
} build_id_stacks SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_STACK_TRACE);
	__uint(max_entries, 1024);
	__uint(key_size, sizeof(__u32));
	__uint(value_size, MAX_DEPTH * sizeof(__u64));
} plain_stacks SEC(".maps");

struct key {
	__u32 tgid;
	__s32 user_stack_id;
};

struct {
	__uint(type, BPF_MAP_TYPE_HASH);
	__uint(max_entries, 1024);
	__type(key, struct key);
	__type(value, __u64);
	__uint(pinning, LIBBPF_PIN_BY_NAME);
} counts SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_HASH);
	__uint(max_entries, 1024);
	__type(key, struct key);
	__type(value, __u64);
	__uint(pinning, LIBBPF_PIN_BY_NAME);
} plain_counts SEC(".maps");

static void count(void *map, struct key *k)
{
	__u64 one = 1, *n = bpf_map_lookup_elem(map, k);

	if (n)
		__sync_fetch_and_add(n, 1);
	else
		bpf_map_update_elem(map, k, &one, BPF_NOEXIST);
}

volatile const __u32 target_tgid = 0;

/* The key of the nanosleep(2) calls of process target_tgid, else 0. */
static int sleeping(struct bpf_raw_tracepoint_args *ctx, struct key *k)
{
	__u64 id = bpf_get_current_pid_tgid();

	if ((id >> 32) != target_tgid || (__s64)ctx->args[1] != NR_NANOSLEEP)
		return 0;
	k->tgid = id >> 32;
	return 1;
}

/* Two programs: a map of counts and its stack map are found through the
 * programs that use both. */
SEC("raw_tracepoint/sys_enter")
int on_enter(struct bpf_raw_tracepoint_args *ctx)
{
	struct key k = {};

	if (!sleeping(ctx, &k))
		return 0;
	k.user_stack_id = bpf_get_stackid(ctx, &build_id_stacks, BPF_F_USER_STACK);
	count(&counts, &k);
	return 0;
}

SEC("raw_tracepoint/sys_enter")
int on_enter_plain(struct bpf_raw_tracepoint_args *ctx)
{
	struct key k = {};

	if (!sleeping(ctx, &k))
		return 0;
	k.user_stack_id = bpf_get_stackid(ctx, &plain_stacks, BPF_F_USER_STACK);
	count(&plain_counts, &k);
	return 0;
}

char LICENSE[] SEC("license") = "GPL";
