// SPDX-License-Identifier: Apache-2.0
/*
 * glibc bind check for the forkbox vDSO, run on the host (no KVM).
 *
 *   uexec VDSO.so MONO_OFFSET_S PROGRAM [ARGS...]
 *
 * A userland exec: maps VDSO.so at FORKBOX_VDSO_ADDR and a vvar page at
 * FORKBOX_VVAR_ADDR (host clocks + rdtsc, with CLOCK_MONOTONIC shifted by
 * MONO_OFFSET_S seconds so the caller can tell the vDSO answered), loads the
 * host's ld.so, and jumps to it with a fresh stack whose auxiliary vector has
 * AT_SYSINFO_EHDR = FORKBOX_VDSO_ADDR; ld.so, invoked as a program, then
 * loads and runs PROGRAM. This is how the VMM starts the guest, minus the VM.
 * Used by the `vdso_glibc_binds_image` test in crates/vmm/src/vdso.rs.
 *
 * A non-zero offset makes absolute CLOCK_MONOTONIC futex/timer deadlines the
 * program computes lie that far in the (host) future: keep programs simple.
 */
#define _GNU_SOURCE
#include <elf.h>
#include <fcntl.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/auxv.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>
#include <x86intrin.h>
#include "../vvar.h"

#define LDSO "/lib64/ld-linux-x86-64.so.2"
#define DIE(...) do { fprintf(stderr, "uexec: " __VA_ARGS__); exit(111); } while (0)

static uint64_t now_ns(clockid_t c)
{
	struct timespec t;
	clock_gettime(c, &t);
	return (uint64_t)t.tv_sec * 1000000000ull + (uint64_t)t.tv_nsec;
}

/* Maps ld.so's PT_LOADs anywhere; returns its load bias, fills *eh. */
static uint64_t load_ldso(Elf64_Ehdr *eh)
{
	Elf64_Phdr ph[64];
	uint64_t lo = UINT64_MAX, hi = 0;
	int fd = open(LDSO, O_RDONLY | O_CLOEXEC);

	if (fd < 0 || pread(fd, eh, sizeof *eh, 0) != sizeof *eh || eh->e_phnum > 64 ||
	    pread(fd, ph, sizeof(Elf64_Phdr) * eh->e_phnum, eh->e_phoff) != (ssize_t)(sizeof(Elf64_Phdr) * eh->e_phnum))
		DIE("cannot read %s\n", LDSO);
	for (int i = 0; i < eh->e_phnum; i++) {
		if (ph[i].p_type != PT_LOAD)
			continue;
		if ((ph[i].p_vaddr & ~0xfffUL) < lo)
			lo = ph[i].p_vaddr & ~0xfffUL;
		if (ph[i].p_vaddr + ph[i].p_memsz > hi)
			hi = ph[i].p_vaddr + ph[i].p_memsz;
	}
	uint8_t *area = mmap(NULL, hi - lo, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
	if (area == MAP_FAILED)
		DIE("mmap\n");
	uint64_t bias = (uint64_t)area - lo;
	for (int i = 0; i < eh->e_phnum; i++) {
		if (ph[i].p_type != PT_LOAD)
			continue;
		uint64_t va = ph[i].p_vaddr & ~0xfffUL, off = ph[i].p_offset & ~0xfffUL;
		uint64_t fend = ph[i].p_vaddr + ph[i].p_filesz, mend = ph[i].p_vaddr + ph[i].p_memsz;
		uint64_t fpage = (fend + 0xfff) & ~0xfffUL, mpage = (mend + 0xfff) & ~0xfffUL;
		int prot = (ph[i].p_flags & PF_R ? PROT_READ : 0) | (ph[i].p_flags & PF_W ? PROT_WRITE : 0) |
			   (ph[i].p_flags & PF_X ? PROT_EXEC : 0);
		if (mmap((void *)(bias + va), fend - va, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_FIXED, fd, off) == MAP_FAILED)
			DIE("mmap segment\n");
		memset((void *)(bias + fend), 0, fpage - fend);
		if (mpage > fpage &&
		    mmap((void *)(bias + fpage), mpage - fpage, prot, MAP_PRIVATE | MAP_FIXED | MAP_ANONYMOUS, -1, 0) == MAP_FAILED)
			DIE("mmap bss\n");
		mprotect((void *)(bias + va), fpage - va, prot);
	}
	close(fd);
	return bias;
}

int main(int argc, char **argv, char **envp)
{
	if (argc < 4)
		DIE("usage: uexec VDSO.so MONO_OFFSET_S PROGRAM [ARGS...]\n");

	/* The vDSO image at its fixed address. */
	int fd = open(argv[1], O_RDONLY | O_CLOEXEC);
	struct stat st;
	if (fd < 0 || fstat(fd, &st) != 0 || st.st_size > FORKBOX_VDSO_MAX_LEN)
		DIE("cannot read %s\n", argv[1]);
	void *img = mmap((void *)FORKBOX_VDSO_ADDR, FORKBOX_VDSO_MAX_LEN, PROT_READ | PROT_WRITE,
			 MAP_PRIVATE | MAP_ANONYMOUS | MAP_FIXED_NOREPLACE, -1, 0);
	if (img != (void *)FORKBOX_VDSO_ADDR)
		DIE("cannot map the vDSO at %#lx\n", FORKBOX_VDSO_ADDR);
	if (read(fd, img, st.st_size) != st.st_size)
		DIE("short read\n");
	close(fd);
	mprotect(img, FORKBOX_VDSO_MAX_LEN, PROT_READ | PROT_EXEC);

	/* The vvar page: TSC rate calibrated over 20 ms against CLOCK_MONOTONIC. */
	struct forkbox_vvar *vv = mmap((void *)FORKBOX_VVAR_ADDR, 4096, PROT_READ | PROT_WRITE,
				       MAP_PRIVATE | MAP_ANONYMOUS | MAP_FIXED_NOREPLACE, -1, 0);
	if (vv != (void *)FORKBOX_VVAR_ADDR)
		DIE("cannot map the vvar page at %#lx\n", FORKBOX_VVAR_ADDR);
	uint64_t t0 = now_ns(CLOCK_MONOTONIC), c0 = __rdtsc();
	usleep(20000);
	uint64_t t1 = now_ns(CLOCK_MONOTONIC), c1 = __rdtsc();
	vv->shift = 32;
	vv->mult = (uint64_t)(((unsigned __int128)(t1 - t0) << 32) / (c1 - c0));
	vv->tsc_base = __rdtsc();
	vv->mono_ns = now_ns(CLOCK_MONOTONIC) + strtoull(argv[2], NULL, 0) * 1000000000ull;
	vv->real_ns = now_ns(CLOCK_REALTIME);
	vv->boot_ns = now_ns(CLOCK_BOOTTIME);
	vv->enabled = 1;
	mprotect(vv, 4096, PROT_READ);

	Elf64_Ehdr eh;
	uint64_t bias = load_ldso(&eh);
	uint64_t entry = bias + eh.e_entry;

	/* Initial stack: argc, argv = {LDSO, PROGRAM, ARGS...}, envp, auxv. */
	size_t stack_len = 1 << 20;
	uint8_t *stack = mmap(NULL, stack_len, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
	if (stack == MAP_FAILED)
		DIE("mmap stack\n");
	uint64_t *sp = (uint64_t *)(stack + stack_len - 65536), *p = sp;
	*p++ = (uint64_t)(argc - 2);
	*p++ = (uint64_t)LDSO;
	for (int i = 3; i < argc; i++)
		*p++ = (uint64_t)argv[i];
	*p++ = 0;
	for (int i = 0; envp[i]; i++)
		*p++ = (uint64_t)envp[i];
	*p++ = 0;
#define AUX(k, v) do { *p++ = (k); *p++ = (uint64_t)(v); } while (0)
	AUX(AT_SYSINFO_EHDR, FORKBOX_VDSO_ADDR);
	AUX(AT_MINSIGSTKSZ, getauxval(AT_MINSIGSTKSZ));
	AUX(AT_HWCAP, getauxval(AT_HWCAP));
	AUX(AT_PAGESZ, 4096);
	AUX(AT_CLKTCK, getauxval(AT_CLKTCK));
	AUX(AT_PHDR, bias + eh.e_phoff); /* ld.so run as the program */
	AUX(AT_PHENT, sizeof(Elf64_Phdr));
	AUX(AT_PHNUM, eh.e_phnum);
	AUX(AT_BASE, 0);
	AUX(AT_FLAGS, 0);
	AUX(AT_ENTRY, entry);
	AUX(AT_UID, getuid());
	AUX(AT_EUID, geteuid());
	AUX(AT_GID, getgid());
	AUX(AT_EGID, getegid());
	AUX(AT_SECURE, 0);
	AUX(AT_RANDOM, getauxval(AT_RANDOM));
	AUX(AT_HWCAP2, getauxval(AT_HWCAP2));
	AUX(AT_EXECFN, LDSO);
	AUX(AT_PLATFORM, getauxval(AT_PLATFORM));
	AUX(AT_NULL, 0);
	__asm__ volatile("mov %0, %%rsp\n\txor %%edx, %%edx\n\tjmp *%1" : : "r"(sp), "r"(entry) : "memory");
	__builtin_unreachable();
}
