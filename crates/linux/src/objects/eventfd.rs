//! eventfd: a 64-bit counter (or a semaphore) that write adds to and read takes.

use serde::{Deserialize, Serialize};

use crate::errno::Errno;

use super::{ObjKind, Objects};

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct EventFd {
    pub count: u64,
    pub semaphore: bool,
}

impl Objects {
    pub fn eventfd_mut(&mut self, id: u64) -> Result<&mut EventFd, Errno> {
        match &mut self.get_mut(id)?.kind {
            ObjKind::EventFd(e) => Ok(e),
            _ => Err(Errno::EINVAL),
        }
    }

    pub fn eventfd_read(&mut self, id: u64) -> Result<u64, Errno> {
        let e = self.eventfd_mut(id)?;
        if e.count == 0 {
            return Err(Errno::EAGAIN);
        }
        if e.semaphore {
            e.count -= 1;
            Ok(1)
        } else {
            Ok(std::mem::take(&mut e.count))
        }
    }

    pub fn eventfd_write(&mut self, id: u64, v: u64) -> Result<(), Errno> {
        if v == u64::MAX {
            return Err(Errno::EINVAL);
        }
        let e = self.eventfd_mut(id)?;
        if u64::MAX - 1 - e.count < v {
            return Err(Errno::EAGAIN);
        }
        e.count += v;
        Ok(())
    }
}
