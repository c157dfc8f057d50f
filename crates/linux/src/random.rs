//! Host entropy for the guest (getrandom, AT_RANDOM, the resolver's query ids).

use crate::errno::Errno;

/// Fill `buf` from the host's entropy pool (getrandom(2), restarted on EINTR).
pub fn fill_random(buf: &mut [u8]) -> Result<(), Errno> {
    let mut done = 0;
    while done < buf.len() {
        let rest = &mut buf[done..];
        // SAFETY: `rest` is a valid, writable buffer of `rest.len()` bytes.
        let r = unsafe { libc::getrandom(rest.as_mut_ptr().cast(), rest.len(), 0) };
        if r < 0 {
            if std::io::Error::last_os_error().raw_os_error() == Some(libc::EINTR) {
                continue;
            }
            return Err(Errno::EIO);
        }
        done += r as usize;
    }
    Ok(())
}
