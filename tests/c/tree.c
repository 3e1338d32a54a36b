/* A process whose user stacks are many and distinct by name: it walks
 * every path of a binary tree of calls 17 levels deep (131,072 paths),
 * level i calling bpfmap_tree_aI or bpfmap_tree_bI as the path's bit i
 * says, and at each leaf makes a getppid(2) by a syscall instruction in
 * bpfmap_tree_leaf (frame pointers kept: the kernel unwinds its user
 * stack). Then it prints "walked" and sleeps, so that its binary is there
 * to name the frames. x86-64. */
#include <stdio.h>
#include <unistd.h>

#define DEPTH 17

__attribute__((noinline)) void bpfmap_tree_leaf(void)
{
	long ret;
	__asm__ volatile("syscall"
			 : "=a"(ret)
			 : "a"(110 /* SYS_getppid */)
			 : "rcx", "r11", "memory");
	(void)ret;
}

/* Level DEPTH: the leaves' callers. */
__attribute__((noinline)) void bpfmap_tree_a17(unsigned long path)
{
	(void)path;
	bpfmap_tree_leaf();
	__asm__ volatile("" ::: "memory");
}

__attribute__((noinline)) void bpfmap_tree_b17(unsigned long path)
{
	(void)path;
	bpfmap_tree_leaf();
	__asm__ volatile("" ::: "memory");
}

/* Level I calls level J's a or b by the path's low bit. */
#define LEVEL(I, J)                                                        \
	__attribute__((noinline)) void bpfmap_tree_a##I(unsigned long path) \
	{                                                                  \
		if (path & 1)                                              \
			bpfmap_tree_a##J(path >> 1);                       \
		else                                                       \
			bpfmap_tree_b##J(path >> 1);                       \
		__asm__ volatile("" ::: "memory");                         \
	}                                                                  \
	__attribute__((noinline)) void bpfmap_tree_b##I(unsigned long path) \
	{                                                                  \
		if (path & 1)                                              \
			bpfmap_tree_a##J(path >> 1);                       \
		else                                                       \
			bpfmap_tree_b##J(path >> 1);                       \
		__asm__ volatile("" ::: "memory");                         \
	}

LEVEL(16, 17)
LEVEL(15, 16)
LEVEL(14, 15)
LEVEL(13, 14)
LEVEL(12, 13)
LEVEL(11, 12)
LEVEL(10, 11)
LEVEL(9, 10)
LEVEL(8, 9)
LEVEL(7, 8)
LEVEL(6, 7)
LEVEL(5, 6)
LEVEL(4, 5)
LEVEL(3, 4)
LEVEL(2, 3)
LEVEL(1, 2)
LEVEL(0, 1)

int main(void)
{
	for (unsigned long path = 0; path < (1UL << DEPTH); path++)
		bpfmap_tree_a0(path);
	printf("walked\n");
	fflush(stdout);
	for (;;)
		pause();
}
