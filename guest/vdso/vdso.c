// SPDX-License-Identifier: Apache-2.0
/*
 * forkbox vDSO: clock_gettime / gettimeofday / time / clock_getres / getcpu
 * answered inside the guest from rdtsc and the VMM-written vvar page, so the
 * guest takes no VM exit for them (CPython 3.11 reads CLOCK_MONOTONIC on
 * every lock acquire).
 *
 * Built by crates/vmm/build.rs with vdso.lds into a position-independent
 * shared object (linked at 0, no relocations, one R+X PT_LOAD). glibc finds it
 * through AT_SYSINFO_EHDR and binds the __vdso_* symbols of version LINUX_2.6.
 *
 * Return conventions are the kernel's: the entry points return 0 or a
 * negative errno (what the `syscall` instruction returns); __vdso_time
 * returns the seconds. Fallbacks use only clock_gettime (228) and
 * clock_getres (229), so the VMM needs no gettimeofday/time syscalls.
 *
 * Freestanding: no libc, no libgcc, no writable data, no stack protector.
 */
#include "vvar.h"

#define NSEC_PER_SEC 1000000000ULL

#define SYS_clock_gettime 228
#define SYS_clock_getres  229

#define CLOCK_REALTIME           0
#define CLOCK_MONOTONIC          1
#define CLOCK_MONOTONIC_RAW      4
#define CLOCK_REALTIME_COARSE    5
#define CLOCK_MONOTONIC_COARSE   6
#define CLOCK_BOOTTIME           7

/* The x86_64 kernel ABI types (all 64-bit fields). */
struct vdso_timespec {
	long tv_sec;
	long tv_nsec;
};

struct vdso_timeval {
	long tv_sec;
	long tv_usec;
};

struct vdso_timezone {
	int tz_minuteswest;
	int tz_dsttime;
};

#define EXPORT __attribute__((visibility("default")))

static inline const volatile struct forkbox_vvar *vvar(void)
{
	return (const volatile struct forkbox_vvar *)FORKBOX_VVAR_ADDR;
}

static inline long raw_syscall2(long nr, long a0, long a1)
{
	long ret;

	__asm__ volatile("syscall"
			 : "=a"(ret)
			 : "0"(nr), "D"(a0), "S"(a1)
			 : "rcx", "r11", "memory");
	return ret;
}

/* lfence keeps rdtsc from executing ahead of earlier instructions. */
static inline uint64_t rdtsc_ordered(void)
{
	uint32_t lo, hi;

	__asm__ volatile("lfence\n\trdtsc" : "=a"(lo), "=d"(hi) : : "memory");
	return ((uint64_t)hi << 32) | lo;
}

/*
 * Nanoseconds of `clk` now, from the vvar page. Returns 0 (and leaves *ns
 * alone) when the clock is not handled here or the page is disabled.
 */
static inline int vvar_clock_ns(int clk, uint64_t *ns)
{
	const volatile struct forkbox_vvar *vv = vvar();
	uint64_t base, delta;

	if (!vv->enabled)
		return 0;

	switch (clk) {
	case CLOCK_REALTIME:
	case CLOCK_REALTIME_COARSE:
		base = vv->real_ns;
		break;
	case CLOCK_MONOTONIC:
	case CLOCK_MONOTONIC_RAW:
	case CLOCK_MONOTONIC_COARSE:
		base = vv->mono_ns;
		break;
	case CLOCK_BOOTTIME:
		base = vv->boot_ns;
		break;
	default:
		return 0;
	}

	delta = rdtsc_ordered() - vv->tsc_base;
	if ((int64_t)delta < 0) /* TSC behind the sample: never go backwards */
		delta = 0;
	*ns = base + (uint64_t)(((unsigned __int128)delta * vv->mult) >> (vv->shift & 127));
	return 1;
}

static inline int clock_is_handled(int clk)
{
	switch (clk) {
	case CLOCK_REALTIME:
	case CLOCK_MONOTONIC:
	case CLOCK_MONOTONIC_RAW:
	case CLOCK_REALTIME_COARSE:
	case CLOCK_MONOTONIC_COARSE:
	case CLOCK_BOOTTIME:
		return 1;
	default:
		return 0;
	}
}

EXPORT int __vdso_clock_gettime(int clk, struct vdso_timespec *ts)
{
	uint64_t ns;

	if (!vvar_clock_ns(clk, &ns))
		return (int)raw_syscall2(SYS_clock_gettime, clk, (long)ts);
	ts->tv_sec = (long)(ns / NSEC_PER_SEC);
	ts->tv_nsec = (long)(ns % NSEC_PER_SEC);
	return 0;
}

EXPORT int __vdso_gettimeofday(struct vdso_timeval *tv, struct vdso_timezone *tz)
{
	uint64_t ns;

	if (tv) {
		if (vvar_clock_ns(CLOCK_REALTIME, &ns)) {
			tv->tv_sec = (long)(ns / NSEC_PER_SEC);
			tv->tv_usec = (long)((ns % NSEC_PER_SEC) / 1000);
		} else {
			struct vdso_timespec ts;
			long r = raw_syscall2(SYS_clock_gettime, CLOCK_REALTIME, (long)&ts);

			if (r < 0)
				return (int)r;
			tv->tv_sec = ts.tv_sec;
			tv->tv_usec = ts.tv_nsec / 1000;
		}
	}
	if (tz) {
		/* The guest's "kernel" keeps no timezone: UTC, no DST. */
		tz->tz_minuteswest = 0;
		tz->tz_dsttime = 0;
	}
	return 0;
}

EXPORT long __vdso_time(long *t)
{
	uint64_t ns;
	long secs;

	if (vvar_clock_ns(CLOCK_REALTIME, &ns)) {
		secs = (long)(ns / NSEC_PER_SEC);
	} else {
		struct vdso_timespec ts;
		long r = raw_syscall2(SYS_clock_gettime, CLOCK_REALTIME, (long)&ts);

		if (r < 0)
			return r;
		secs = ts.tv_sec;
	}
	if (t)
		*t = secs;
	return secs;
}

EXPORT int __vdso_clock_getres(int clk, struct vdso_timespec *res)
{
	if (!vvar()->enabled || !clock_is_handled(clk))
		return (int)raw_syscall2(SYS_clock_getres, clk, (long)res);
	if (res) {
		res->tv_sec = 0;
		res->tv_nsec = 1;
	}
	return 0;
}

/* One vCPU: always CPU 0, NUMA node 0 (answered here even when disabled). */
EXPORT long __vdso_getcpu(unsigned *cpu, unsigned *node, void *unused)
{
	(void)unused;
	if (cpu)
		*cpu = 0;
	if (node)
		*node = 0;
	return 0;
}

/* Plain names, as the kernel's vDSO exports them. */
int clock_gettime(int, struct vdso_timespec *)
	__attribute__((weak, alias("__vdso_clock_gettime"), visibility("default")));
int gettimeofday(struct vdso_timeval *, struct vdso_timezone *)
	__attribute__((weak, alias("__vdso_gettimeofday"), visibility("default")));
long time(long *)
	__attribute__((weak, alias("__vdso_time"), visibility("default")));
int clock_getres(int, struct vdso_timespec *)
	__attribute__((weak, alias("__vdso_clock_getres"), visibility("default")));
long getcpu(unsigned *, unsigned *, void *)
	__attribute__((weak, alias("__vdso_getcpu"), visibility("default")));
