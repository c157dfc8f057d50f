//! epoll instances: their watches, and the edge-triggered (EPOLLET)
//! bookkeeping of what each watch last reported.

use imbl::OrdMap;
use serde::{Deserialize, Serialize};

use crate::errno::Errno;

use super::{ObjKind, Objects, ALWAYS};

/// Nesting of epoll instances looked through for readiness (Linux: 5).
pub const EPOLL_MAX_NESTS: u32 = 5;

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Watch {
    pub ofd: u64,
    pub events: u32,
    pub data: u64,
}

#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Epoll {
    /// By fd number (as registered).
    #[serde(with = "crate::serde_map")]
    pub watches: OrdMap<i32, Watch>,
}

impl Objects {
    pub fn epoll_mut(&mut self, id: u64) -> Result<&mut Epoll, Errno> {
        match &mut self.get_mut(id)?.kind {
            ObjKind::Epoll(e) => Ok(e),
            _ => Err(Errno::EINVAL),
        }
    }

    /// What watch `fd` of epoll `ep` reports given its description's readiness
    /// `ready` (0: nothing). A disarmed one-shot watch reports nothing; an
    /// edge-triggered one only what it has not reported yet.
    pub fn watch_fires(&self, ep: u64, fd: i32, w: &Watch, ready: u32) -> u32 {
        let asked = w.events & !(EPOLLONESHOT | EPOLLET);
        if asked == 0 {
            return 0;
        }
        let r = ready & (asked | ALWAYS);
        if r != 0 && w.events & EPOLLET != 0 && self.et_reported.get(&(w.ofd, ep, fd)) == Some(&r) {
            return 0;
        }
        r
    }

    /// Record what an edge-triggered watch reported (`r`; 0 forgets it).
    pub fn et_note(&mut self, ep: u64, fd: i32, ofd: u64, r: u32) {
        if r == 0 {
            self.et_reported.remove(&(ofd, ep, fd));
        } else {
            self.et_reported.insert((ofd, ep, fd), r);
        }
    }

    /// The guest found description `ofd` drained (a read's EAGAIN: `events`
    /// POLLIN) or full (a write's: POLLOUT): that readiness, when it comes
    /// back, is a new edge for every edge-triggered watch on it.
    pub fn et_drained(&mut self, ofd: u64, events: u32) {
        if self.et_reported.is_empty() {
            return;
        }
        let mut bits = 0;
        if events & libc::POLLIN as u32 != 0 {
            bits |= (libc::POLLIN | libc::POLLRDNORM) as u32;
        }
        if events & libc::POLLOUT as u32 != 0 {
            bits |= (libc::POLLOUT | libc::POLLWRNORM) as u32;
        }
        for (_, r) in self.et_reported.range_mut((ofd, 0, i32::MIN)..=(ofd, u64::MAX, i32::MAX)) {
            *r &= !bits;
        }
    }

    /// A watch was added, changed or removed: it reports its readiness afresh (as Linux re-checks).
    pub fn et_forget_watch(&mut self, ep: u64, fd: i32) {
        self.et_reported.retain(|&(_, e, f), _| !(e == ep && f == fd));
    }
}

pub const EPOLLONESHOT: u32 = 1 << 30;

pub const EPOLLET: u32 = 1 << 31;
