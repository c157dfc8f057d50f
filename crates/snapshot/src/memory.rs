//! The memory file: guest RAM, sparse.

use std::fs::File;
use std::io::{Seek, SeekFrom};
use std::os::unix::fs::{FileExt, PermissionsExt};
use std::path::Path;

use forkbox_vmm::layout::PAGE_SIZE;
use forkbox_vmm::GuestMemory;
use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};

use crate::state::StateError;

/// What the state file records about its memory file.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct MemoryStats {
    /// Size of the file = guest RAM size.
    pub size: u64,
    /// Non-zero pages written.
    pub pages: u64,
    /// SHA-256 over (offset, bytes) of every non-zero page, in address order.
    pub checksum: String,
}

const CHUNK: u64 = 2 << 20;

fn io<'a>(what: &'static str, path: &'a Path) -> impl Fn(std::io::Error) -> StateError + 'a {
    move |source| StateError::io(what, path, source)
}

/// Pages of `mem` the host has backed (`mincore`), chunk by chunk: only those can be non-zero.
fn resident_pages(mem: &GuestMemory, chunk: u64, out: &mut Vec<u8>) -> Result<(), std::io::Error> {
    out.resize((CHUNK / PAGE_SIZE) as usize, 0);
    // SAFETY: the range lies inside the guest mapping; `out` has one byte per page.
    let rc = unsafe { libc::mincore((mem.host_addr() + chunk) as *mut libc::c_void, CHUNK as usize, out.as_mut_ptr()) };
    if rc != 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(())
}

/// Write guest RAM to a new sparse file at `path` (via a temp file + rename),
/// skipping pages that are not resident or all zero. The file ends up read-only.
pub fn write_memory(mem: &GuestMemory, path: &Path) -> Result<MemoryStats, StateError> {
    write_memory_with(mem, path, None)
}

/// [`write_memory`] of a memory that maps the memory file `base` copy-on-write
/// (a resumed checkpoint): the pages to look at are those the host backs
/// privately or in its page cache, and every page with data in `base` (which
/// may have left the page cache). The result does not refer to `base`.
pub fn write_memory_over(mem: &GuestMemory, base: &File, path: &Path) -> Result<MemoryStats, StateError> {
    let data = pages_of_base(mem, base).map_err(io("stat", path))?;
    write_memory_with(mem, path, Some(&data))
}

fn write_memory_with(mem: &GuestMemory, path: &Path, also: Option<&[bool]>) -> Result<MemoryStats, StateError> {
    let tmp = path.with_extension("tmp");
    let f = File::create(&tmp).map_err(io("create", &tmp))?;
    let written = fill_memory(mem, &f, also).map_err(io("write", &tmp));
    let done = written.and_then(|stats| {
        f.sync_all().map_err(io("fsync", &tmp))?;
        // fchmod on the open file, not chmod of a path: an exec thread's seccomp filter allows only the former.
        f.set_permissions(std::fs::Permissions::from_mode(0o444)).map_err(io("fchmod", &tmp))?;
        std::fs::rename(&tmp, path).map_err(io("rename", path))?;
        Ok(stats)
    });
    if done.is_err() {
        let _ = std::fs::remove_file(&tmp);
    }
    done
}

/// [`write_memory_over`] into `f`, a new empty file the caller opened (and
/// then syncs, protects and names: a sandbox worker writes a template's memory
/// into a file descriptor the API process gave it, and never names a path).
pub fn write_memory_over_into(mem: &GuestMemory, base: &File, f: &File) -> Result<MemoryStats, StateError> {
    let over = pages_of_base(mem, base).map_err(|e| StateError::io("stat", Path::new("base memory"), e))?;
    fill_memory(mem, f, Some(&over)).map_err(|e| StateError::io("write", Path::new("memory"), e))
}

/// The pages with data in `base` (one flag per page of `mem`).
fn pages_of_base(mem: &GuestMemory, base: &File) -> std::io::Result<Vec<bool>> {
    let pages = mem.size().div_ceil(PAGE_SIZE) as usize;
    let mut data = vec![false; pages];
    let size = base.metadata()?.len();
    let mut pos = 0u64;
    loop {
        let start = match seek_data(base, pos) {
            Some(d) if d < size => d,
            _ => break,
        };
        let end = seek_hole(base, start).unwrap_or(size).min(size);
        let mut p = start / PAGE_SIZE;
        while p * PAGE_SIZE < end {
            if let Some(slot) = data.get_mut(p as usize) {
                *slot = true;
            }
            p += 1;
        }
        pos = end;
    }
    Ok(data)
}

/// Write the non-zero pages of `mem` that are resident (or flagged in `also`)
/// into `f` at their offsets, `f` sized to the memory first (the rest are holes).
fn fill_memory(mem: &GuestMemory, f: &File, also: Option<&[bool]>) -> std::io::Result<MemoryStats> {
    f.set_len(mem.size())?;
    let mut hash = Sha256::new();
    let mut pages = 0;
    let mut resident = Vec::new();
    let mut chunk = 0;
    while chunk < mem.size() {
        resident_pages(mem, chunk, &mut resident)?;
        for (i, r) in resident.iter().enumerate() {
            let addr = chunk + i as u64 * PAGE_SIZE;
            let in_base = also.is_some_and(|a| a.get((addr / PAGE_SIZE) as usize).copied().unwrap_or(false));
            if r & 1 == 0 && !in_base {
                continue;
            }
            let page = mem.slice(addr, PAGE_SIZE).map_err(|_| std::io::Error::other("memory range"))?;
            if page.iter().all(|&b| b == 0) {
                continue;
            }
            f.write_all_at(page, addr)?;
            hash.update(addr.to_le_bytes());
            hash.update(page);
            pages += 1;
        }
        chunk += CHUNK;
    }
    Ok(MemoryStats { size: mem.size(), pages, checksum: hex::encode(hash.finalize()) })
}

/// An opened, verified memory file.
pub struct MemoryFile {
    pub file: File,
    pub stats: MemoryStats,
}

impl MemoryFile {
    /// Open and verify against what the state file says (size and checksum of every non-zero page).
    pub fn open(path: &Path, expect: &MemoryStats) -> Result<MemoryFile, StateError> {
        let mut file = File::open(path).map_err(io("open", path))?;
        let size = file.metadata().map_err(io("stat", path))?.len();
        if size != expect.size {
            return Err(StateError::Corrupt(format!(
                "memory file {} is {size} bytes, expected {} (truncated?)",
                crate::state::shown(path),
                expect.size
            )));
        }
        let mut hash = Sha256::new();
        let mut pages = 0;
        let mut page = vec![0u8; PAGE_SIZE as usize];
        let mut pos = 0u64;
        // Walk the data extents only: holes read as zeros and were never hashed.
        loop {
            let data = match seek_data(&file, pos) {
                Some(d) if d < size => d,
                _ => break,
            };
            let hole = seek_hole(&file, data).unwrap_or(size).min(size);
            let mut addr = data - data % PAGE_SIZE;
            while addr < hole {
                file.read_exact_at(&mut page, addr).map_err(io("read", path))?;
                if page.iter().any(|&b| b != 0) {
                    hash.update(addr.to_le_bytes());
                    hash.update(&page);
                    pages += 1;
                }
                addr += PAGE_SIZE;
            }
            pos = hole;
        }
        file.seek(SeekFrom::Start(0)).map_err(io("seek", path))?;
        let checksum = hex::encode(hash.finalize());
        if checksum != expect.checksum || pages != expect.pages {
            return Err(StateError::Corrupt(format!(
                "memory file {} does not match its checksum",
                crate::state::shown(path)
            )));
        }
        Ok(MemoryFile { file, stats: expect.clone() })
    }
}

pub(crate) fn seek_data(f: &File, from: u64) -> Option<u64> {
    use std::os::fd::AsRawFd;
    // SAFETY: lseek on our own fd.
    let r = unsafe { libc::lseek(f.as_raw_fd(), from as i64, libc::SEEK_DATA) };
    (r >= 0).then_some(r as u64)
}

pub(crate) fn seek_hole(f: &File, from: u64) -> Option<u64> {
    use std::os::fd::AsRawFd;
    // SAFETY: lseek on our own fd.
    let r = unsafe { libc::lseek(f.as_raw_fd(), from as i64, libc::SEEK_HOLE) };
    (r >= 0).then_some(r as u64)
}

/// A read-only shared view of a memory file: the pristine bytes a recycled
/// VM's pages are reset from (page cache, shared by every view of the file).
pub struct MemoryView {
    ptr: std::ptr::NonNull<u8>,
    len: usize,
}

// SAFETY: a read-only mapping of an immutable file; only ever read.
unsafe impl Send for MemoryView {}
// SAFETY: as above.
unsafe impl Sync for MemoryView {}

impl MemoryView {
    pub fn as_slice(&self) -> &[u8] {
        // SAFETY: the mapping lives as long as self and is never written.
        unsafe { std::slice::from_raw_parts(self.ptr.as_ptr(), self.len) }
    }
}

impl Drop for MemoryView {
    fn drop(&mut self) {
        // SAFETY: unmapping our own mapping once.
        unsafe { libc::munmap(self.ptr.as_ptr() as *mut libc::c_void, self.len) };
    }
}

impl MemoryFile {
    pub fn view(&self) -> Result<MemoryView, StateError> {
        use std::os::fd::AsRawFd;
        let len = self.stats.size as usize;
        // SAFETY: a new read-only shared mapping of a file we hold open.
        let p = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len,
                libc::PROT_READ,
                libc::MAP_SHARED | libc::MAP_NORESERVE,
                self.file.as_raw_fd(),
                0,
            )
        };
        if p == libc::MAP_FAILED {
            return Err(StateError::Io {
                what: "mmap",
                path: "memory file".into(),
                source: std::io::Error::last_os_error(),
            });
        }
        let ptr = std::ptr::NonNull::new(p as *mut u8)
            .ok_or_else(|| StateError::Corrupt("memory file mapped at address 0".into()))?;
        Ok(MemoryView { ptr, len })
    }
}
