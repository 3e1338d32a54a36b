// The stacks of tests/c/tree.c: `on_enter` (a raw tracepoint on
// sys_enter) counts the getppid(2) calls of processes named
// "bpfmap-tree" by kernel and user stack, in `counts`, keyed as
// offcputime keys its own (`pid`, `tgid`, `user_stack_id`,
// `kern_stack_id`), the stacks in `stacks` (its size set by the loader).
#include <linux/types.h>
#include <linux/bpf.h>
#include <bpf/bpf_helpers.h>

#define MAX_DEPTH 32
#define NR_GETPPID 110

struct {
	__uint(type, BPF_MAP_TYPE_STACK_TRACE);
	__uint(max_entries, 1024);
	__uint(key_size, sizeof(__u32));
	__uint(value_size, MAX_DEPTH * sizeof(__u64));
} stacks SEC(".maps");

struct key_t {
	__u32 pid;
	__u32 tgid;
	__s32 user_stack_id;
	__s32 kern_stack_id;
};

struct {
	__uint(type, BPF_MAP_TYPE_HASH);
	__uint(max_entries, 1 << 20);
	__type(key, struct key_t);
	__type(value, __u64);
	__uint(pinning, LIBBPF_PIN_BY_NAME);
} counts SEC(".maps");

SEC("raw_tracepoint/sys_enter")
int on_enter(struct bpf_raw_tracepoint_args *ctx)
{
	char comm[16];
	const char want[] = "bpfmap-tree";
	struct key_t k = {};
	__u64 id = bpf_get_current_pid_tgid(), one = 1, *n;

	if ((__s64)ctx->args[1] != NR_GETPPID)
		return 0;
	bpf_get_current_comm(comm, sizeof(comm));
	for (int i = 0; i < sizeof(want); i++)
		if (comm[i] != want[i])
			return 0;
	k.pid = (__u32)id;
	k.tgid = id >> 32;
	k.user_stack_id = bpf_get_stackid(ctx, &stacks, BPF_F_USER_STACK);
	k.kern_stack_id = bpf_get_stackid(ctx, &stacks, 0);
	n = bpf_map_lookup_elem(&counts, &k);
	if (n)
		__sync_fetch_and_add(n, 1);
	else
		bpf_map_update_elem(&counts, &k, &one, BPF_NOEXIST);
	return 0;
}

char LICENSE[] SEC("license") = "GPL";
