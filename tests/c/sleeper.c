/* A process that is off the CPU in a function of its own: it calls
 * nanosleep(2) by a syscall instruction in bpfmap_test_wait_here, so its
 * user stack starts in that function (frame pointers kept), under
 * bpfmap_test_loop and main. x86-64. */
#include <time.h>

__attribute__((noinline)) void bpfmap_test_wait_here(void)
{
	struct timespec ts = { 0, 20 * 1000 * 1000 };
	long ret;
	__asm__ volatile("syscall"
			 : "=a"(ret)
			 : "a"(35 /* SYS_nanosleep */), "D"(&ts), "S"(0)
			 : "rcx", "r11", "memory");
	(void)ret;
}

__attribute__((noinline)) void bpfmap_test_loop(void)
{
	for (;;)
		bpfmap_test_wait_here();
}

int main(void)
{
	bpfmap_test_loop();
	return 0;
}
