//! Readiness of what a blocked call waits for (`kernel::block`): asked by
//! poll/select/epoll and by the engine's scheduler, which re-runs blocked
//! handlers when a description may have become ready, waits on the host fds
//! behind sockets, and wakes at the next timer expiry.

use std::time::{Duration, Instant};

use crate::fd::{FdTable, FileKind};
use crate::file::ops::PollCtx;
use crate::kernel::block::WaitOn;
use crate::kernel::Kernel;
use crate::process::Process;

/// `POLL*` readiness of the open file description `ofd` (POLLNVAL if it is
/// gone). POLLHUP / POLLERR come whatever was asked for, as on Linux.
pub fn ready(proc: &Process, kernel: &Kernel, ofd: u64) -> u32 {
    let p = PollCtx { fds: &proc.fds, kernel, vfs: &proc.vfs, pid: proc.pid, ready: ready_at };
    ready_at(&p, ofd, 0)
}

fn ready_at(p: &PollCtx, ofd: u64, depth: u32) -> u32 {
    let Some(f) = p.fds.description(ofd) else { return libc::POLLNVAL as u32 };
    crate::file::ops(&p.fds.objects, f.kind).poll(p, f, depth)
}

/// The host fds (host sockets, the resolver's lookups) behind what `on` waits for, directly or
/// through an epoll instance in it: the engine waits on them on the host
/// (`poll(2)`) instead of sleeping, so a socket becoming ready ends the wait.
pub fn host_fds(proc: &Process, kernel: &Kernel, on: &WaitOn) -> Vec<libc::pollfd> {
    let mut out = Vec::new();
    for (ofd, events) in on.fds() {
        host_fds_at(&proc.fds, kernel, ofd, events, 0, &mut out);
    }
    out
}

/// Wait on host fds until one is ready or `until`, checking `interrupted`
/// every 20 ms. True when interrupted.
pub fn poll_host(fds: &mut [libc::pollfd], until: Instant, interrupted: impl Fn() -> bool) -> bool {
    loop {
        if interrupted() {
            return true;
        }
        let now = Instant::now();
        if now >= until {
            return false;
        }
        let slice = until.saturating_duration_since(now).min(Duration::from_millis(20));
        let ms = slice.as_millis().max(1) as i32;
        // SAFETY: fds is a valid, exclusively borrowed array of pollfd of its length.
        let n = unsafe { libc::poll(fds.as_mut_ptr(), fds.len() as libc::nfds_t, ms) };
        if n > 0 {
            return false;
        }
    }
}

fn host_fds_at(fds: &FdTable, kernel: &Kernel, ofd: u64, events: u32, depth: u32, out: &mut Vec<libc::pollfd>) {
    let Some(f) = fds.description(ofd) else { return };
    match f.kind {
        FileKind::Socket(s) if out.len() < crate::fd::MAX_FDS as usize => {
            if let Some(p) = kernel.net.pollfd(s.id, events as i16) {
                out.push(p);
            }
            // Answers of the resolver waiting for a host lookup.
            kernel.net.lookup_pollfds(s.id, events as i16, out);
        }
        FileKind::Object(id) if depth < 5 => {
            if let Ok(crate::objects::Object { kind: crate::objects::ObjKind::Epoll(e), .. }) = fds.objects.get(id) {
                for w in e.watches.values() {
                    host_fds_at(fds, kernel, w.ofd, w.events, depth + 1, out);
                }
            }
        }
        _ => {}
    }
}

/// The earliest time at which process state that `on` depends on changes by
/// itself (a timerfd in the set, or watched by an epoll in it, expires), if
/// any. The engine re-runs the blocked handler then.
/// Host sockets held back by the bandwidth limit count too: the wait is
/// re-run when the limit lets them move again.
pub fn next_change(proc: &Process, kernel: &mut Kernel, on: &WaitOn) -> Option<Instant> {
    let fds = &proc.fds;
    let obj = |ofd: u64| match fds.description(ofd)?.kind {
        FileKind::Object(id) => Some(id),
        _ => None,
    };
    let ns = on.fds().filter_map(|(ofd, _)| obj(ofd)).filter_map(|id| fds.objects.next_expiry_in(id, 0, &obj)).min();
    let timer = ns.and_then(|ns| Instant::now().checked_add(Duration::from_nanos(ns)));
    let throttle = kernel.net.throttled_until().filter(|_| !host_fds(proc, kernel, on).is_empty());
    timer.into_iter().chain(throttle).min()
}
