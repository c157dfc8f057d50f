//! Guest RAM: one host mapping that backs the single KVM memslot.
//!
//! Memory shared between guest processes (each its own VM): a host memfd per
//! shared object, mapped `MAP_SHARED | MAP_FIXED` over the guest-physical range
//! of the mapping inside this one host mapping (`map_shared`). Guest virtual
//! addresses equal guest physical ones, so no second memslot is needed: KVM's
//! MMU notifier sees the host mapping change (as for `discard`) and the
//! guest's next touch of those pages reaches the memfd's pages — the same host
//! pages in every VM that maps the object. A fork maps the parent's shared
//! ranges into the child again (`fork_copy`).
//!
//! Every access from the VMM goes through a bounds-checked accessor: guest
//! addresses and lengths are hostile input.

use std::os::fd::AsRawFd;
use std::ptr::NonNull;

use crate::error::{Result, VmmError};
use crate::layout::{align_down, align_up, PAGE_SIZE};

pub struct GuestMemory {
    host: NonNull<u8>,
    size: u64,
    /// The snapshot file behind a copy-on-write mapping (`private_file`).
    backing: Option<std::fs::File>,
    /// Whole-page ranges replaced by fresh anonymous memory (`discard`).
    discarded: Vec<(u64, u64)>,
    /// Pages the VMM changed (KVM's dirty log only sees the guest's writes):
    /// one bit per page, while `track_writes` is on.
    vmm_dirty: Option<Vec<u64>>,
    /// Guest ranges whose translations lost a permission in the page tables:
    /// KVM's cached translations of them must go before the vCPU runs again
    /// (`flush_invalidations`).
    stale: Vec<(u64, u64)>,
    /// Ranges whose host pages were replaced since the last flush (that
    /// dropped KVM's translations of them already).
    replaced: Vec<(u64, u64)>,
    /// Guest ranges backed by a shared host file (`map_shared`), by start.
    shared: std::collections::BTreeMap<u64, SharedRange>,
}

/// A host file whose pages are shared by the guest processes that map it.
pub type SharedFile = std::sync::Arc<std::fs::File>;

/// A guest range backed by `file` from byte `offset`.
#[derive(Clone)]
pub struct SharedRange {
    pub len: u64,
    pub file: SharedFile,
    pub offset: u64,
}

/// Shared ranges one guest memory may hold (each is a host mapping of its own).
pub const MAX_SHARED_RANGES: usize = 256;

/// What `reset_to_backing` did.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ResetStats {
    /// Private pages given the snapshot's bytes again (and kept, warm).
    pub copied: u64,
    /// Private pages kept with unchanged content.
    pub kept: u64,
    /// Private pages outside the kept set, given back to the host.
    pub dropped: u64,
    /// Guest ranges whose page-table translations had changed.
    pub retranslated: u64,
}

// SAFETY: the mapping is owned by this struct and only accessed through it;
// the vCPU that also sees it runs on the thread that owns the GuestMemory.
unsafe impl Send for GuestMemory {}

impl GuestMemory {
    /// Fresh, zero-filled guest RAM (MAP_NORESERVE: host pages are only used once touched).
    pub fn anonymous(size: u64) -> Result<GuestMemory> {
        // SAFETY: a new anonymous mapping, not aliasing anything.
        let p = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                size as usize,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_NORESERVE,
                -1,
                0,
            )
        };
        Self::from_mmap(p, size, "mmap(guest RAM)")
    }

    /// Guest RAM backed copy-on-write by a file (a snapshot's memory image):
    /// the file is never modified, writes land in private anonymous pages.
    pub fn private_file(file: &std::fs::File, size: u64) -> Result<GuestMemory> {
        let backing = file.try_clone().map_err(|source| VmmError::Sys { call: "dup(snapshot memory)", source })?;
        // SAFETY: a new private mapping of a file we hold open.
        let p = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                size as usize,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE | libc::MAP_NORESERVE,
                file.as_raw_fd(),
                0,
            )
        };
        let mut mem = Self::from_mmap(p, size, "mmap(snapshot memory)")?;
        mem.backing = Some(backing);
        Ok(mem)
    }

    fn from_mmap(p: *mut libc::c_void, size: u64, call: &'static str) -> Result<GuestMemory> {
        if p == libc::MAP_FAILED {
            return Err(VmmError::last_os(call));
        }
        let host = NonNull::new(p as *mut u8).ok_or_else(|| VmmError::last_os(call))?;
        Ok(GuestMemory {
            host,
            size,
            backing: None,
            discarded: Vec::new(),
            vmm_dirty: None,
            stale: Vec::new(),
            replaced: Vec::new(),
            shared: Default::default(),
        })
    }

    /// Is it a copy-on-write mapping of a snapshot file (`private_file`), not
    /// anonymous memory?
    pub fn has_backing(&self) -> bool {
        self.backing.is_some()
    }

    /// The whole-page ranges `discard` gave back in a file-backed mapping
    /// (they read as zeros, not as the file's bytes), as (address, length).
    pub fn discarded_ranges(&self) -> &[(u64, u64)] {
        &self.discarded
    }

    /// Record from now on which pages the VMM changes (see `take_vmm_dirty`).
    pub fn track_writes(&mut self) {
        self.vmm_dirty = Some(vec![0; (self.size / PAGE_SIZE).div_ceil(64) as usize]);
    }

    /// Pages the VMM changed since the last call (one bit per page), and reset.
    pub fn take_vmm_dirty(&mut self) -> Vec<u64> {
        let words = (self.size / PAGE_SIZE).div_ceil(64) as usize;
        match self.vmm_dirty.as_mut() {
            Some(bits) => std::mem::replace(bits, vec![0; words]),
            None => vec![0; words],
        }
    }

    fn mark(&mut self, addr: u64, len: u64) {
        if let (Some(bits), true) = (self.vmm_dirty.as_mut(), len > 0) {
            // In bounds: every caller checked [addr, addr+len) against the size.
            for page in addr / PAGE_SIZE..=(addr + len - 1) / PAGE_SIZE {
                bits[(page / 64) as usize] |= 1 << (page % 64);
            }
        }
    }

    /// Write without recording the pages as changed (restoring a checkpoint's own content).
    pub fn write_untracked(&mut self, addr: u64, data: &[u8]) -> Result<()> {
        let saved = self.vmm_dirty.take();
        let r = self.write(addr, data);
        self.vmm_dirty = saved;
        r
    }

    /// [`Self::slice_mut`] without recording the pages as changed (restoring a checkpoint's own content).
    pub fn slice_mut_untracked(&mut self, addr: u64, len: u64) -> Result<&mut [u8]> {
        self.check(addr, len)?;
        // SAFETY: as in `slice_mut`.
        Ok(unsafe { std::slice::from_raw_parts_mut(self.host.as_ptr().add(addr as usize), len as usize) })
    }

    /// Make the whole pages of `[addr, addr+len)` private and writable now,
    /// in one call (`MADV_POPULATE_WRITE`): what a first write to each would
    /// do (a copy-on-write copy of the snapshot file's page, or a zeroed
    /// page), without a fault per page, and without the read fault that a
    /// read-modify-write would take first. Changes no byte.
    pub fn populate_write(&mut self, addr: u64, len: u64) -> Result<()> {
        self.check(addr, len)?;
        let (start, end) = (align_down(addr, PAGE_SIZE), align_up(addr + len, PAGE_SIZE).min(self.size));
        if start >= end {
            return Ok(());
        }
        // SAFETY: the range lies inside our own mapping (checked above); populating changes no content.
        let r = unsafe {
            libc::madvise(
                self.host.as_ptr().add(start as usize) as *mut libc::c_void,
                (end - start) as usize,
                libc::MADV_POPULATE_WRITE,
            )
        };
        if r != 0 {
            return Err(VmmError::last_os("madvise(MADV_POPULATE_WRITE)"));
        }
        Ok(())
    }

    /// Guest pages that are private to this mapping: every page anyone (guest
    /// or VMM) ever wrote since the mapping was made — a copy-on-write copy of
    /// the snapshot file or fresh anonymous memory. One bit per page, read
    /// from /proc/self/pagemap (present, and not a file page).
    pub fn private_pages(&self) -> Result<Vec<u64>> {
        let pagemap = std::fs::File::open("/proc/self/pagemap")
            .map_err(|source| VmmError::Sys { call: "open(/proc/self/pagemap)", source })?;
        match self.private_pages_scan(&pagemap) {
            Some(bits) => Ok(bits),
            None => self.private_pages_read(&pagemap),
        }
    }

    /// PAGEMAP_SCAN (Linux 6.7+): the kernel returns just the matching ranges,
    /// so the cost follows the pages in use, not the 4 GiB of address space.
    fn private_pages_scan(&self, pagemap: &std::fs::File) -> Option<Vec<u64>> {
        const PAGE_IS_FILE: u64 = 1 << 2;
        const PAGE_IS_PRESENT: u64 = 1 << 3;
        const PAGE_IS_SWAPPED: u64 = 1 << 4;
        #[repr(C)]
        struct PmScanArg {
            size: u64,
            flags: u64,
            start: u64,
            end: u64,
            walk_end: u64,
            vec: u64,
            vec_len: u64,
            max_pages: u64,
            category_inverted: u64,
            category_mask: u64,
            category_anyof_mask: u64,
            return_mask: u64,
        }
        #[repr(C)]
        #[derive(Clone, Copy, Default)]
        struct PageRegion {
            start: u64,
            end: u64,
            categories: u64,
        }
        // _IOWR('f', 16, struct pm_scan_arg)
        const PAGEMAP_SCAN: libc::c_ulong = (3 << 30)
            | ((std::mem::size_of::<PmScanArg>() as libc::c_ulong) << 16)
            | ((b'f' as libc::c_ulong) << 8)
            | 16;
        let base = self.host_addr();
        let end = base + self.size;
        let mut bits = vec![0u64; (self.size / PAGE_SIZE).div_ceil(64) as usize];
        let mut regions = vec![PageRegion::default(); 4096];
        let mut start = base;
        while start < end {
            let mut arg = PmScanArg {
                size: std::mem::size_of::<PmScanArg>() as u64,
                flags: 0,
                start,
                end,
                walk_end: 0,
                vec: regions.as_mut_ptr() as u64,
                vec_len: regions.len() as u64,
                max_pages: 0,
                // match: not a file page, and present or swapped
                category_inverted: PAGE_IS_FILE,
                category_mask: PAGE_IS_FILE,
                category_anyof_mask: PAGE_IS_PRESENT | PAGE_IS_SWAPPED,
                return_mask: PAGE_IS_PRESENT | PAGE_IS_SWAPPED | PAGE_IS_FILE,
            };
            // SAFETY: arg and the region vector are valid for the kernel to fill.
            let n = unsafe { libc::ioctl(std::os::fd::AsRawFd::as_raw_fd(pagemap), PAGEMAP_SCAN, &mut arg) };
            if n < 0 {
                return None;
            }
            for r in &regions[..n as usize] {
                let (first, last) = ((r.start.max(base) - base) / PAGE_SIZE, (r.end.min(end) - base) / PAGE_SIZE);
                for page in first..last {
                    bits[(page / 64) as usize] |= 1 << (page % 64);
                }
            }
            if arg.walk_end <= start {
                return None;
            }
            start = arg.walk_end;
        }
        Some(bits)
    }

    /// The same from plain pagemap entries (older kernels): 8 bytes per page of guest RAM.
    fn private_pages_read(&self, pagemap: &std::fs::File) -> Result<Vec<u64>> {
        use std::os::unix::fs::FileExt;
        let pages = self.size / PAGE_SIZE;
        let first = self.host_addr() / PAGE_SIZE;
        let mut bits = vec![0u64; pages.div_ceil(64) as usize];
        const BATCH: u64 = 64 * 1024;
        let mut buf = vec![0u8; (BATCH * 8) as usize];
        let mut done = 0;
        while done < pages {
            let n = (pages - done).min(BATCH);
            let bytes = &mut buf[..(n * 8) as usize];
            pagemap
                .read_exact_at(bytes, (first + done) * 8)
                .map_err(|source| VmmError::Sys { call: "read(/proc/self/pagemap)", source })?;
            for (i, e) in bytes.chunks_exact(8).enumerate() {
                let v = u64::from_le_bytes([e[0], e[1], e[2], e[3], e[4], e[5], e[6], e[7]]);
                let present_or_swapped = v & (3 << 62) != 0;
                let file_page = v & (1 << 61) != 0;
                if present_or_swapped && !file_page {
                    let page = done + i as u64;
                    bits[(page / 64) as usize] |= 1 << (page % 64);
                }
            }
            done += n;
        }
        Ok(bits)
    }

    /// Queue `[addr, addr+len)` (whole pages) for `flush_invalidations`: its
    /// page-table entries lost a permission.
    pub fn invalidate(&mut self, addr: u64, len: u64) {
        if len > 0 && self.contains(addr, len) {
            match self.stale.last_mut() {
                Some((s, l)) if *s + *l == addr => *l += len,
                _ => self.stale.push((addr, len)),
            }
        }
    }

    /// The queued invalidations, emptying the queue (for tests and callers that flush themselves).
    pub fn take_invalidations(&mut self) -> Vec<(u64, u64)> {
        self.replaced.clear();
        std::mem::take(&mut self.stale)
    }

    /// Drop KVM's translations of every queued range, so the next guest
    /// access re-reads the page tables. KVM does not see the VMM writing the
    /// tables through its own mapping; it does see the host mapping change:
    /// a host mprotect there (read-only, then read-write again) makes it zap
    /// its shadow entries for those pages (MMU notifier) without touching their
    /// content. Ranges whose host pages were replaced since are skipped.
    pub fn flush_invalidations(&mut self) -> Result<()> {
        if self.stale.is_empty() {
            self.replaced.clear();
            return Ok(());
        }
        let mut stale = std::mem::take(&mut self.stale);
        let replaced = std::mem::take(&mut self.replaced);
        stale.sort_unstable();
        let mut merged: Vec<(u64, u64)> = Vec::with_capacity(stale.len());
        for (a, l) in stale {
            match merged.last_mut() {
                Some((s, ml)) if a <= *s + *ml => *ml = (*ml).max(a + l - *s),
                _ => merged.push((a, l)),
            }
        }
        for (a, l) in merged {
            if replaced.iter().any(|&(ra, rl)| ra <= a && a + l <= ra + rl) {
                continue;
            }
            self.protect_pair(a, l)?;
        }
        Ok(())
    }

    fn protect_pair(&self, addr: u64, len: u64) -> Result<()> {
        self.check(addr, len)?;
        // SAFETY: a range of our own mapping; the vCPU is not running (this
        // thread owns it) and the VMM does not access guest memory meanwhile.
        unsafe {
            let p = self.host.as_ptr().add(addr as usize) as *mut libc::c_void;
            if libc::mprotect(p, len as usize, libc::PROT_READ) != 0 {
                return Err(VmmError::last_os("mprotect(guest range, read-only: drop KVM translations)"));
            }
            if libc::mprotect(p, len as usize, libc::PROT_READ | libc::PROT_WRITE) != 0 {
                return Err(VmmError::last_os("mprotect(guest range, read-write)"));
            }
        }
        Ok(())
    }

    /// Make guest RAM equal its backing snapshot file again. Discarded ranges
    /// are mapped from the file again; every private page (see
    /// `private_pages`) in `keep` (one bit per page: the snapshot's own
    /// mappings) gets the file's bytes copied back from `original`, a
    /// read-only view of the same file, and stays private (warm: writing it
    /// again costs no fault); private pages outside `keep` are given back to
    /// the host (MADV_DONTNEED: they read as the file again). `retranslate`:
    /// ranges whose page-table translations differ from the snapshot's, to be
    /// dropped from KVM's caches too.
    /// `private`: the result of `private_pages` if the caller has it (valid
    /// only when nothing was discarded since).
    pub fn reset_to_backing(
        &mut self,
        original: &[u8],
        keep: &[u64],
        retranslate: &[(u64, u64)],
        private: Option<Vec<u64>>,
    ) -> Result<ResetStats> {
        let Some(file) = &self.backing else {
            return Err(VmmError::Sys {
                call: "reset (no snapshot file)",
                source: std::io::Error::from_raw_os_error(libc::EINVAL),
            });
        };
        if original.len() as u64 != self.size {
            return Err(VmmError::OutOfRange { addr: 0, len: original.len() as u64 });
        }
        let private = match private {
            Some(p) if self.discarded.is_empty() => Some(p),
            _ => None,
        };
        // Shared ranges were recorded as discarded too: the file's pages come back there.
        self.shared.clear();
        for (addr, len) in std::mem::take(&mut self.discarded) {
            // SAFETY: remapping a range of our own mapping with the file's matching pages.
            let p = unsafe {
                libc::mmap(
                    self.host.as_ptr().add(addr as usize) as *mut libc::c_void,
                    len as usize,
                    libc::PROT_READ | libc::PROT_WRITE,
                    libc::MAP_PRIVATE | libc::MAP_NORESERVE | libc::MAP_FIXED,
                    std::os::fd::AsRawFd::as_raw_fd(file),
                    addr as libc::off_t,
                )
            };
            if p == libc::MAP_FAILED {
                return Err(VmmError::last_os("mmap(MAP_FIXED snapshot range)"));
            }
        }
        let private = match private {
            Some(p) => p,
            None => self.private_pages()?,
        };
        let mut stats = ResetStats::default();
        let mut dropped: Vec<(u64, u64)> = Vec::new();
        for (w, &word) in private.iter().enumerate() {
            let mut bits = word;
            while bits != 0 {
                let page = w as u64 * 64 + bits.trailing_zeros() as u64;
                bits &= bits - 1;
                let at = page * PAGE_SIZE;
                self.check(at, PAGE_SIZE)?;
                if keep.get(w).is_some_and(|k| k & (1 << (page % 64)) != 0) {
                    let src = &original[at as usize..(at + PAGE_SIZE) as usize];
                    // SAFETY: in bounds (checked); exclusive through &mut self. Not `slice_mut`:
                    // restoring the snapshot's bytes is not a change to record.
                    let dst = unsafe {
                        std::slice::from_raw_parts_mut(self.host.as_ptr().add(at as usize), PAGE_SIZE as usize)
                    };
                    if dst != src {
                        dst.copy_from_slice(src);
                        stats.copied += 1;
                    } else {
                        stats.kept += 1;
                    }
                } else {
                    stats.dropped += 1;
                    match dropped.last_mut() {
                        Some((s, l)) if *s + *l == at => *l += PAGE_SIZE,
                        _ => dropped.push((at, PAGE_SIZE)),
                    }
                }
            }
        }
        for &(a, l) in &dropped {
            // SAFETY: a range of our own private file mapping: its private pages go, the file's show again.
            if unsafe {
                libc::madvise(self.host.as_ptr().add(a as usize) as *mut libc::c_void, l as usize, libc::MADV_DONTNEED)
            } != 0
            {
                return Err(VmmError::last_os("madvise(MADV_DONTNEED guest range)"));
            }
        }
        // Queued invalidations stay: a page may have lost a permission the
        // snapshot's tables give it too, after KVM cached the larger one.
        self.replaced.extend(dropped);
        for &(a, l) in retranslate {
            self.invalidate(a, l);
            stats.retranslated += l / PAGE_SIZE;
        }
        self.flush_invalidations()?;
        Ok(stats)
    }

    /// A copy of this memory for a forked guest process: the same snapshot file
    /// mapped copy-on-write (or fresh anonymous memory), the discarded ranges
    /// discarded again, and only the private pages (what was written: found with
    /// PAGEMAP_SCAN) copied — never the whole of guest RAM.
    pub fn fork_copy(&self) -> Result<(GuestMemory, u64)> {
        let mut child = match &self.backing {
            Some(f) => GuestMemory::private_file(f, self.size)?,
            None => GuestMemory::anonymous(self.size)?,
        };
        for &(a, l) in &self.discarded {
            child.discard(a, l)?;
        }
        let private = self.private_pages()?;
        let mut copied = 0u64;
        let mut run: Option<(u64, u64)> = None;
        let flush = |child: &mut GuestMemory, r: (u64, u64)| -> Result<()> {
            let (at, pages) = r;
            let len = pages * PAGE_SIZE;
            self.check(at, len)?;
            child.check(at, len)?;
            // SAFETY: both ranges are in bounds (checked) of two distinct mappings of the same size.
            unsafe {
                std::ptr::copy_nonoverlapping(
                    self.host.as_ptr().add(at as usize),
                    child.host.as_ptr().add(at as usize),
                    len as usize,
                )
            };
            Ok(())
        };
        for (w, &word) in private.iter().enumerate() {
            let mut bits = word;
            while bits != 0 {
                let page = w as u64 * 64 + bits.trailing_zeros() as u64;
                bits &= bits - 1;
                copied += 1;
                run = match run {
                    Some((at, n)) if at + n * PAGE_SIZE == page * PAGE_SIZE => Some((at, n + 1)),
                    Some(r) => {
                        flush(&mut child, r)?;
                        Some((page * PAGE_SIZE, 1))
                    }
                    None => Some((page * PAGE_SIZE, 1)),
                };
            }
        }
        if let Some(r) = run {
            flush(&mut child, r)?;
        }
        // Shared pages are file pages (not in `private`): the child maps the same host files.
        for (&at, r) in &self.shared {
            child.map_shared(at, r.len, &r.file, r.offset)?;
        }
        child.replaced.clear();
        Ok((child, copied))
    }

    /// A new host file of `size` bytes (zeros) for memory shared between guest
    /// processes: a memfd, never a path on the host.
    pub fn new_shared_file(size: u64) -> Result<SharedFile> {
        // SAFETY: a NUL-terminated name; the new fd is owned by the File below.
        let fd = unsafe { libc::memfd_create(c"forkbox-shm".as_ptr(), libc::MFD_CLOEXEC) };
        if fd < 0 {
            return Err(VmmError::last_os("memfd_create(shared guest memory)"));
        }
        // SAFETY: fd is a new descriptor nobody else owns.
        let file = unsafe { <std::fs::File as std::os::fd::FromRawFd>::from_raw_fd(fd) };
        file.set_len(size).map_err(|source| VmmError::Sys { call: "ftruncate(shared guest memory)", source })?;
        Ok(std::sync::Arc::new(file))
    }

    /// Back guest range `[addr, addr+len)` (whole pages) by `file` from byte
    /// `offset`: writes through it are seen by every VM that maps the same file
    /// range. The file must be at least `offset + len` bytes long (else host
    /// accesses past its end would fault).
    pub fn map_shared(&mut self, addr: u64, len: u64, file: &SharedFile, offset: u64) -> Result<()> {
        self.check(addr, len)?;
        let file_len =
            file.metadata().map_err(|source| VmmError::Sys { call: "fstat(shared guest memory)", source })?.len();
        let aligned = len != 0
            && addr.is_multiple_of(PAGE_SIZE)
            && len.is_multiple_of(PAGE_SIZE)
            && offset.is_multiple_of(PAGE_SIZE);
        if !aligned || offset.checked_add(len).is_none_or(|end| end > file_len) {
            return Err(VmmError::OutOfRange { addr, len });
        }
        self.forget_shared(addr, len);
        if self.shared.len() >= MAX_SHARED_RANGES {
            return Err(VmmError::Sys {
                call: "map_shared (too many shared ranges)",
                source: std::io::Error::from_raw_os_error(libc::ENOMEM),
            });
        }
        // SAFETY: the range lies inside our own mapping (checked); MAP_FIXED replaces it.
        let p = unsafe {
            libc::mmap(
                self.host.as_ptr().add(addr as usize) as *mut libc::c_void,
                len as usize,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_SHARED | libc::MAP_FIXED,
                std::os::fd::AsRawFd::as_raw_fd(&**file),
                offset as libc::off_t,
            )
        };
        if p == libc::MAP_FAILED {
            return Err(VmmError::last_os("mmap(MAP_SHARED|MAP_FIXED shared guest memory)"));
        }
        self.mark(addr, len);
        if self.backing.is_some() {
            self.discarded.push((addr, len));
        }
        self.replaced.push((addr, len));
        self.shared.insert(addr, SharedRange { len, file: file.clone(), offset });
        Ok(())
    }

    /// Drop the shared-range records overlapping `[addr, addr+len)` (their
    /// host pages are being replaced), keeping the parts outside it.
    fn forget_shared(&mut self, addr: u64, len: u64) {
        if self.shared.is_empty() {
            return;
        }
        let end = addr.saturating_add(len);
        let hit: Vec<u64> =
            self.shared.range(..end).rev().take_while(|(s, r)| *s + r.len > addr).map(|(s, _)| *s).collect();
        for s in hit {
            let Some(r) = self.shared.remove(&s) else { continue };
            let e = s + r.len;
            if s < addr {
                self.shared.insert(s, SharedRange { len: addr - s, ..r.clone() });
            }
            if e > end {
                self.shared.insert(end, SharedRange { len: e - end, offset: r.offset + (end - s), file: r.file });
            }
        }
    }

    /// The shared ranges: (guest address, range).
    pub fn shared_ranges(&self) -> impl Iterator<Item = (u64, &SharedRange)> + '_ {
        self.shared.iter().map(|(a, r)| (*a, r))
    }

    /// Turn every shared range into private memory with the same content (the
    /// last process that held it is the only one left: checkpoints store
    /// private memory). Copied 2 MiB at a time.
    pub fn privatize_shared(&mut self) -> Result<()> {
        let ranges: Vec<(u64, u64)> = self.shared.iter().map(|(a, r)| (*a, r.len)).collect();
        const CHUNK: u64 = 2 << 20;
        for (at, len) in ranges {
            let mut done = 0;
            while done < len {
                let n = (len - done).min(CHUNK);
                let bytes = self.slice(at + done, n)?.to_vec();
                self.discard(at + done, n)?;
                self.write(at + done, &bytes)?;
                done += n;
            }
        }
        Ok(())
    }

    /// Copy `len` bytes inside guest memory from `from` to `to` (ranges may overlap).
    pub fn copy_within(&mut self, from: u64, to: u64, len: u64) -> Result<()> {
        self.check(from, len)?;
        self.check(to, len)?;
        self.mark(to, len);
        // SAFETY: both ranges in bounds (checked); `copy` allows overlap; exclusive through &mut self.
        unsafe {
            std::ptr::copy(self.host.as_ptr().add(from as usize), self.host.as_ptr().add(to as usize), len as usize)
        };
        Ok(())
    }

    pub fn size(&self) -> u64 {
        self.size
    }

    pub fn host_addr(&self) -> u64 {
        self.host.as_ptr() as u64
    }

    /// Is `[addr, addr+len)` inside guest RAM?
    pub fn contains(&self, addr: u64, len: u64) -> bool {
        addr <= self.size && len <= self.size - addr
    }

    fn check(&self, addr: u64, len: u64) -> Result<()> {
        if self.contains(addr, len) {
            Ok(())
        } else {
            Err(VmmError::OutOfRange { addr, len })
        }
    }

    pub fn slice(&self, addr: u64, len: u64) -> Result<&[u8]> {
        self.check(addr, len)?;
        // SAFETY: bounds checked above; the guest is stopped while the VMM holds this borrow.
        Ok(unsafe { std::slice::from_raw_parts(self.host.as_ptr().add(addr as usize), len as usize) })
    }

    pub fn slice_mut(&mut self, addr: u64, len: u64) -> Result<&mut [u8]> {
        self.check(addr, len)?;
        self.mark(addr, len);
        // SAFETY: as in `slice`, and `&mut self` makes the borrow exclusive.
        Ok(unsafe { std::slice::from_raw_parts_mut(self.host.as_ptr().add(addr as usize), len as usize) })
    }

    pub fn read(&self, addr: u64, out: &mut [u8]) -> Result<()> {
        out.copy_from_slice(self.slice(addr, out.len() as u64)?);
        Ok(())
    }

    pub fn write(&mut self, addr: u64, data: &[u8]) -> Result<()> {
        self.slice_mut(addr, data.len() as u64)?.copy_from_slice(data);
        Ok(())
    }

    pub fn read_u64(&self, addr: u64) -> Result<u64> {
        let mut b = [0u8; 8];
        self.read(addr, &mut b)?;
        Ok(u64::from_le_bytes(b))
    }

    pub fn write_u64(&mut self, addr: u64, v: u64) -> Result<()> {
        self.write(addr, &v.to_le_bytes())
    }

    pub fn read_u32(&self, addr: u64) -> Result<u32> {
        let mut b = [0u8; 4];
        self.read(addr, &mut b)?;
        Ok(u32::from_le_bytes(b))
    }

    /// A NUL-terminated string of at most `max` bytes (without the NUL).
    /// `None` when it runs off guest memory or has no NUL within `max`.
    pub fn read_cstr(&self, addr: u64, max: usize) -> Option<&[u8]> {
        if addr >= self.size {
            return None;
        }
        let avail = (self.size - addr).min(max as u64 + 1);
        let s = self.slice(addr, avail).ok()?;
        let n = s.iter().position(|&b| b == 0)?;
        Some(&s[..n])
    }

    /// Make `[addr, addr+len)` read as zeros again and give its host pages back.
    /// Whole pages are replaced by fresh anonymous pages under the live memslot
    /// (this also drops copy-on-write copies of a snapshot file); partial pages are zeroed.
    pub fn discard(&mut self, addr: u64, len: u64) -> Result<()> {
        self.check(addr, len)?;
        self.mark(addr, len);
        self.forget_shared(
            align_up(addr, PAGE_SIZE),
            align_down(addr + len, PAGE_SIZE).saturating_sub(align_up(addr, PAGE_SIZE)),
        );
        let end = addr + len;
        let (ps, pe) = (align_up(addr, PAGE_SIZE).min(end), align_down(end, PAGE_SIZE));
        if ps >= pe {
            self.slice_mut(addr, len)?.fill(0);
            return Ok(());
        }
        self.slice_mut(addr, ps - addr)?.fill(0);
        self.slice_mut(pe, end - pe)?.fill(0);
        if self.backing.is_some() {
            self.discarded.push((ps, pe - ps));
        }
        // SAFETY: the range lies inside our own mapping (checked); MAP_FIXED replaces it.
        let p = unsafe {
            libc::mmap(
                self.host.as_ptr().add(ps as usize) as *mut libc::c_void,
                (pe - ps) as usize,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_NORESERVE | libc::MAP_FIXED,
                -1,
                0,
            )
        };
        if p == libc::MAP_FAILED {
            return Err(VmmError::last_os("mmap(MAP_FIXED discard)"));
        }
        self.replaced.push((ps, pe - ps));
        Ok(())
    }
}

impl Drop for GuestMemory {
    fn drop(&mut self) {
        // SAFETY: unmapping our own mapping exactly once.
        unsafe { libc::munmap(self.host.as_ptr() as *mut libc::c_void, self.size as usize) };
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bounds_are_checked() {
        let mut m = GuestMemory::anonymous(1 << 20).unwrap();
        assert!(m.slice(0, 1 << 20).is_ok());
        assert!(m.slice(1, 1 << 20).is_err());
        assert!(m.slice(u64::MAX, 2).is_err());
        assert!(m.slice((1 << 20) - 4, 8).is_err());
        assert!(m.write(1 << 20, &[1]).is_err());
        m.write_u64(8, 0xdead_beef).unwrap();
        assert_eq!(m.read_u64(8).unwrap(), 0xdead_beef);
    }

    #[test]
    fn cstr_needs_nul_within_limit() {
        let mut m = GuestMemory::anonymous(1 << 20).unwrap();
        m.write(100, b"hello\0").unwrap();
        assert_eq!(m.read_cstr(100, 16), Some(&b"hello"[..]));
        assert_eq!(m.read_cstr(100, 3), None);
        m.write((1 << 20) - 3, b"abc").unwrap();
        assert_eq!(m.read_cstr((1 << 20) - 3, 100), None, "string running off the end");
        assert_eq!(m.read_cstr(1 << 20, 100), None);
    }

    #[test]
    fn reset_restores_written_and_discarded_pages() {
        use std::io::Write;
        let mut f = tempfile::tempfile().unwrap();
        let original: Vec<u8> = (0..(1u32 << 20)).map(|i| (i / 4096) as u8 ^ 0x5A).collect();
        f.write_all(&original).unwrap();
        let mut m = GuestMemory::private_file(&f, 1 << 20).unwrap();
        m.write(4096 * 3 + 10, b"secret").unwrap(); // a VMM write
        m.discard(4096 * 8, 4096 * 4).unwrap();
        m.write(4096 * 9, b"in a discarded range").unwrap();
        // a "guest" write, straight through the mapping like the vCPU's
        // SAFETY: test-only write inside the mapping.
        unsafe { *(m.host_addr() as *mut u8).add(20 * 4096) = 0xFF };
        let _ = m.slice(30 * 4096, 4096).unwrap().to_vec(); // a read: stays a file page
        let private = m.private_pages().unwrap();
        assert_eq!(private[0] & (1 << 3 | 1 << 20 | 1 << 30), 1 << 3 | 1 << 20);
        let pagemap = std::fs::File::open("/proc/self/pagemap").unwrap();
        assert_eq!(m.private_pages_read(&pagemap).unwrap(), private, "scan and plain read agree");
        if let Some(scanned) = m.private_pages_scan(&pagemap) {
            assert_eq!(scanned, private);
        } else {
            eprintln!("PAGEMAP_SCAN unavailable (kernel < 6.7): plain pagemap reads are used");
        }
        // Keep every page but page 20: that one goes back to the host.
        let mut keep = vec![u64::MAX; 4];
        keep[0] &= !(1 << 20);
        let stats = m.reset_to_backing(&original, &keep, &[(4096 * 40, 4096)], None).unwrap();
        assert_eq!((stats.copied, stats.dropped, stats.retranslated), (1, 1, 1), "{stats:?}");
        assert_eq!(m.slice(0, 1 << 20).unwrap(), &original[..]);
        // the kept page stays private (and warm); its content is the file's; the dropped one is a file page again
        let private = m.private_pages().unwrap()[0];
        assert_eq!(private & (1 << 3 | 1 << 20), 1 << 3);
        let again = m.reset_to_backing(&original, &keep, &[], Some(m.private_pages().unwrap())).unwrap();
        assert_eq!((again.copied, again.kept, again.dropped), (0, 1, 0));
    }

    #[test]
    fn invalidations_merge_and_skip_replaced_ranges() {
        let mut m = GuestMemory::anonymous(1 << 20).unwrap();
        m.invalidate(0x1000, 0x1000);
        m.invalidate(0x2000, 0x1000);
        m.invalidate(1 << 20, 0x1000); // out of range: ignored
        assert_eq!(m.take_invalidations(), vec![(0x1000, 0x2000)]);
        m.slice_mut(0x4000, 0x1000).unwrap().fill(7);
        m.invalidate(0x4000, 0x1000);
        m.invalidate(0x8000, 0x2000);
        m.discard(0x8000, 0x2000).unwrap();
        m.flush_invalidations().unwrap();
        assert!(m.take_invalidations().is_empty());
        assert!(m.slice(0x4000, 0x1000).unwrap().iter().all(|&b| b == 7), "content survives the invalidation");
        m.write(0x4000, &[1]).unwrap();
    }

    #[test]
    fn shared_ranges_share_pages_across_memories_and_forks() {
        let file = GuestMemory::new_shared_file(4 * 4096).unwrap();
        let mut a = GuestMemory::anonymous(1 << 20).unwrap();
        let mut b = GuestMemory::anonymous(1 << 20).unwrap();
        a.map_shared(0x10000, 2 * 4096, &file, 0).unwrap();
        b.map_shared(0x40000, 2 * 4096, &file, 4096).unwrap();
        a.write(0x10000 + 4096 + 8, b"shared").unwrap();
        assert_eq!(b.slice(0x40000 + 8, 6).unwrap(), b"shared", "same host page at another guest address");
        // a fork maps the same file again
        let (mut c, _) = a.fork_copy().unwrap();
        c.write(0x10000, b"from the child").unwrap();
        assert_eq!(a.slice(0x10000, 14).unwrap(), b"from the child");
        assert!(a.map_shared(0x80000, 4096, &file, 4 * 4096).is_err(), "past the file's end");
        assert!(a.map_shared(0x80001, 4096, &file, 0).is_err(), "unaligned");
        // privatized: same content, no longer shared
        c.privatize_shared().unwrap();
        assert_eq!(c.shared_ranges().count(), 0);
        assert_eq!(c.slice(0x10000, 14).unwrap(), b"from the child");
        c.write(0x10000, b"private").unwrap();
        assert_eq!(a.slice(0x10000, 7).unwrap(), b"from th");
        // a discard (munmap) of part of a range keeps the rest shared
        a.discard(0x10000, 4096).unwrap();
        assert_eq!(
            a.shared_ranges().map(|(at, r)| (at, r.len, r.offset)).collect::<Vec<_>>(),
            vec![(0x11000, 4096, 4096)]
        );
        assert!(a.slice(0x10000, 4096).unwrap().iter().all(|&x| x == 0));
        drop((a, c));
        assert_eq!(std::sync::Arc::strong_count(&file), 2, "only b and this test hold the file");
    }

    #[test]
    fn discard_zeroes_partial_and_whole_pages() {
        let mut m = GuestMemory::anonymous(1 << 20).unwrap();
        m.slice_mut(0, 5 * 4096).unwrap().fill(0xAA);
        m.discard(100, 3 * 4096).unwrap();
        let s = m.slice(0, 5 * 4096).unwrap();
        assert!(s[..100].iter().all(|&b| b == 0xAA));
        assert!(s[100..100 + 3 * 4096].iter().all(|&b| b == 0));
        assert!(s[100 + 3 * 4096..].iter().all(|&b| b == 0xAA));
    }
}
