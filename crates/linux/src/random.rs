//! Host entropy: for the guest (getrandom, AT_RANDOM, the resolver's query ids)
//! and, re-exported by the engine, for the ids and secrets made above it (session,
//! checkpoint and exec ids, API keys): the one place that reads the host's pool.

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

/// `n` bytes from the host's entropy pool as lowercase hex (`2 * n` digits).
pub fn random_hex(n: usize) -> Result<String, Errno> {
    let mut b = vec![0u8; n];
    fill_random(&mut b)?;
    Ok(hex::encode(b))
}
