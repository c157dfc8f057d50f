//! Linux error numbers as returned to the guest (negated in RAX).

use std::fmt;

/// A Linux errno value (positive). Syscall handlers return `Result<u64, Errno>`;
/// the dispatcher turns `Err(e)` into `-e` in RAX.
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
pub struct Errno(pub i32);

impl Errno {
    pub const EPERM: Errno = Errno(libc::EPERM);
    pub const ENOENT: Errno = Errno(libc::ENOENT);
    pub const ESRCH: Errno = Errno(libc::ESRCH);
    pub const EINTR: Errno = Errno(libc::EINTR);
    pub const EIO: Errno = Errno(libc::EIO);
    pub const E2BIG: Errno = Errno(libc::E2BIG);
    pub const ENOEXEC: Errno = Errno(libc::ENOEXEC);
    pub const ENXIO: Errno = Errno(libc::ENXIO);
    pub const ENODEV: Errno = Errno(libc::ENODEV);
    pub const EBADF: Errno = Errno(libc::EBADF);
    pub const ECHILD: Errno = Errno(libc::ECHILD);
    pub const EAGAIN: Errno = Errno(libc::EAGAIN);
    pub const ENOMEM: Errno = Errno(libc::ENOMEM);
    pub const EACCES: Errno = Errno(libc::EACCES);
    pub const EFAULT: Errno = Errno(libc::EFAULT);
    pub const EBUSY: Errno = Errno(libc::EBUSY);
    pub const EEXIST: Errno = Errno(libc::EEXIST);
    pub const EXDEV: Errno = Errno(libc::EXDEV);
    pub const ENOTDIR: Errno = Errno(libc::ENOTDIR);
    pub const EISDIR: Errno = Errno(libc::EISDIR);
    pub const EINVAL: Errno = Errno(libc::EINVAL);
    pub const ENFILE: Errno = Errno(libc::ENFILE);
    pub const EMFILE: Errno = Errno(libc::EMFILE);
    pub const ENOTTY: Errno = Errno(libc::ENOTTY);
    pub const EFBIG: Errno = Errno(libc::EFBIG);
    pub const ENOSPC: Errno = Errno(libc::ENOSPC);
    pub const ESPIPE: Errno = Errno(libc::ESPIPE);
    pub const EROFS: Errno = Errno(libc::EROFS);
    pub const EMLINK: Errno = Errno(libc::EMLINK);
    pub const EPIPE: Errno = Errno(libc::EPIPE);
    pub const ERANGE: Errno = Errno(libc::ERANGE);
    pub const ENAMETOOLONG: Errno = Errno(libc::ENAMETOOLONG);
    pub const ENOSYS: Errno = Errno(libc::ENOSYS);
    pub const ENOTEMPTY: Errno = Errno(libc::ENOTEMPTY);
    pub const ELOOP: Errno = Errno(libc::ELOOP);
    pub const ENODATA: Errno = Errno(libc::ENODATA);
    pub const EOVERFLOW: Errno = Errno(libc::EOVERFLOW);
    pub const ENOTSOCK: Errno = Errno(libc::ENOTSOCK);
    pub const EOPNOTSUPP: Errno = Errno(libc::EOPNOTSUPP);
    pub const EAFNOSUPPORT: Errno = Errno(libc::EAFNOSUPPORT);
    pub const ETIMEDOUT: Errno = Errno(libc::ETIMEDOUT);
    pub const EDESTADDRREQ: Errno = Errno(libc::EDESTADDRREQ);
    pub const EMSGSIZE: Errno = Errno(libc::EMSGSIZE);
    pub const ENOPROTOOPT: Errno = Errno(libc::ENOPROTOOPT);
    pub const EPROTONOSUPPORT: Errno = Errno(libc::EPROTONOSUPPORT);
    pub const ESOCKTNOSUPPORT: Errno = Errno(libc::ESOCKTNOSUPPORT);
    pub const EADDRINUSE: Errno = Errno(libc::EADDRINUSE);
    pub const EADDRNOTAVAIL: Errno = Errno(libc::EADDRNOTAVAIL);
    pub const ENOBUFS: Errno = Errno(libc::ENOBUFS);
    pub const ENETUNREACH: Errno = Errno(libc::ENETUNREACH);
    pub const ETOOMANYREFS: Errno = Errno(libc::ETOOMANYREFS);
    pub const EISCONN: Errno = Errno(libc::EISCONN);
    pub const ENOTCONN: Errno = Errno(libc::ENOTCONN);
    pub const ECONNRESET: Errno = Errno(libc::ECONNRESET);
    pub const ECONNREFUSED: Errno = Errno(libc::ECONNREFUSED);
    pub const EINPROGRESS: Errno = Errno(libc::EINPROGRESS);
    pub const EALREADY: Errno = Errno(libc::EALREADY);
    pub const EPROTOTYPE: Errno = Errno(libc::EPROTOTYPE);

    /// The value to place in RAX: `-errno` as an unsigned 64-bit word.
    pub fn to_rax(self) -> u64 {
        (-(self.0 as i64)) as u64
    }
}

impl fmt::Debug for Errno {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Errno({})", self.0)
    }
}

impl fmt::Display for Errno {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}", std::io::Error::from_raw_os_error(self.0))
    }
}

pub type SysResult = Result<u64, Errno>;
