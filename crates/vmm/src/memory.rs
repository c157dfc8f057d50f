//! Guest RAM: one host mapping that backs the single KVM memslot.
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
        Self::from_mmap(p, size, "mmap(snapshot memory)")
    }

    fn from_mmap(p: *mut libc::c_void, size: u64, call: &'static str) -> Result<GuestMemory> {
        if p == libc::MAP_FAILED {
            return Err(VmmError::last_os(call));
        }
        let host = NonNull::new(p as *mut u8).ok_or_else(|| VmmError::last_os(call))?;
        Ok(GuestMemory { host, size })
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
        let end = addr + len;
        let (ps, pe) = (align_up(addr, PAGE_SIZE), align_down(end, PAGE_SIZE));
        if ps >= pe {
            self.slice_mut(addr, len)?.fill(0);
            return Ok(());
        }
        self.slice_mut(addr, ps - addr)?.fill(0);
        self.slice_mut(pe, end - pe)?.fill(0);
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
