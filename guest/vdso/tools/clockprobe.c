// SPDX-License-Identifier: Apache-2.0
/* Prints what glibc's time functions return; run under tools/uexec.c. */
#include <stdio.h>
#include <sys/time.h>
#include <time.h>

static long long ns(clockid_t c)
{
	struct timespec t;
	if (clock_gettime(c, &t) != 0)
		return -1;
	return t.tv_sec * 1000000000LL + t.tv_nsec;
}

int main(void)
{
	struct timespec res = { -1, -1 };
	struct timeval tv;

	clock_getres(CLOCK_MONOTONIC, &res);
	gettimeofday(&tv, NULL);
	printf("monotonic_ns=%lld\nrealtime_ns=%lld\nboottime_ns=%lld\ncputime_ns=%lld\n"
	       "time_s=%lld\ngettimeofday_us=%lld\ngetres_ns=%ld\n",
	       ns(CLOCK_MONOTONIC), ns(CLOCK_REALTIME), ns(CLOCK_BOOTTIME), ns(CLOCK_PROCESS_CPUTIME_ID),
	       (long long)time(NULL), tv.tv_sec * 1000000LL + tv.tv_usec, res.tv_nsec);
	return 0;
}
