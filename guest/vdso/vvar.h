/* SPDX-License-Identifier: Apache-2.0 */
/*
 * forkbox vDSO: the layout of the VMM-written data page ("vvar").
 *
 * This header is the single C definition of the page. It is mirrored, field
 * for field, by `VvarData` in crates/vmm/src/vdso.rs; the static asserts below
 * and the Rust const asserts pin the same offsets, so a change to one side
 * that is not made on the other fails to build.
 *
 * Guest layout (guest virtual == guest physical, identity paging):
 *   VVAR_ADDR  one 4 KiB page, user read-only, written by the VMM only while
 *              the vCPU is stopped;
 *   VDSO_ADDR  the vDSO image, copied verbatim (file offset 0 at VDSO_ADDR),
 *              user read+exec, at most VDSO_MAX_LEN bytes.
 *
 * Clock arithmetic (all unsigned, the product taken in 128 bits):
 *   delta = tsc_now - tsc_base            (0 if tsc_now < tsc_base)
 *   ns    = (delta * mult) >> shift
 *   CLOCK_MONOTONIC = mono_ns + ns, CLOCK_REALTIME = real_ns + ns,
 *   CLOCK_BOOTTIME  = boot_ns + ns.
 * enabled == 0 makes every entry point use the real `syscall` instruction.
 */
#ifndef FORKBOX_VVAR_H
#define FORKBOX_VVAR_H

#define FORKBOX_VVAR_ADDR     0x1F0000UL
#define FORKBOX_VDSO_ADDR     0x1F1000UL
#define FORKBOX_VDSO_MAX_LEN  (3 * 4096)

#ifndef __ASSEMBLER__
#include <stdint.h>
#include <stddef.h>

struct forkbox_vvar {
	uint64_t seq;      /* reserved; the VMM writes only while the guest is stopped */
	uint64_t tsc_base; /* guest TSC at the sampling instant */
	uint64_t mono_ns;  /* host CLOCK_MONOTONIC at that instant, ns */
	uint64_t real_ns;  /* host CLOCK_REALTIME at that instant, ns */
	uint64_t boot_ns;  /* host CLOCK_BOOTTIME at that instant, ns */
	uint64_t mult;     /* ns = (delta_tsc * mult) >> shift */
	uint32_t shift;
	uint32_t enabled;  /* 0: always fall back to the real syscall */
};

_Static_assert(offsetof(struct forkbox_vvar, seq) == 0, "vvar layout");
_Static_assert(offsetof(struct forkbox_vvar, tsc_base) == 8, "vvar layout");
_Static_assert(offsetof(struct forkbox_vvar, mono_ns) == 16, "vvar layout");
_Static_assert(offsetof(struct forkbox_vvar, real_ns) == 24, "vvar layout");
_Static_assert(offsetof(struct forkbox_vvar, boot_ns) == 32, "vvar layout");
_Static_assert(offsetof(struct forkbox_vvar, mult) == 40, "vvar layout");
_Static_assert(offsetof(struct forkbox_vvar, shift) == 48, "vvar layout");
_Static_assert(offsetof(struct forkbox_vvar, enabled) == 52, "vvar layout");
_Static_assert(sizeof(struct forkbox_vvar) == 56, "vvar layout");

#endif /* __ASSEMBLER__ */
#endif /* FORKBOX_VVAR_H */
