//! The process table of one sandbox: pids, parents, process groups, sessions
//! and zombies, shared by all its processes (it lives in the sandbox's `Kernel`).
//!
//! Each guest process runs in its own KVM VM (own memory, page tables and vCPU:
//! processes are isolated from each other by the hardware, like sandboxes);
//! the sandbox's one host thread drives them all, switching (process, thread)
//! pairs on the vCPU the way it switches green threads. An exec ends with no
//! child alive (the engine kills the children still running at its end, and
//! drops unreaped zombies) unless the sandbox keeps them running (a session's):
//! then a checkpoint records this table ([`ProcTableState`]) with the children.
//! Memory the processes share lives in `shm.rs` (also host-side, also
//! emptied at the end of an exec).

use std::collections::BTreeMap;

use crate::errno::Errno;
use crate::thread::SigInfo;

/// The first process (the agent's): its pid, group and session.
pub const GUEST_PID: u32 = 2;
/// Processes alive at once in one sandbox, zombies included: a fork beyond fails with EAGAIN.
/// Room for a program that starts 100 workers at once (CPython's multiprocessing tests do);
/// the memory limit bounds what they hold.
pub const MAX_PROCS: usize = 128;
/// Pids go up to here, then wrap (skipping those in use).
const PID_MAX: u32 = 1 << 22;

pub const SIGCHLD: i32 = 17;
pub const CLD_EXITED: i32 = 1;
pub const CLD_KILLED: i32 = 2;

/// How a process ended.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Exit {
    Code(i32),
    Signal(i32),
}

impl Exit {
    /// The `wait4` status word.
    pub fn status(self) -> i32 {
        match self {
            Exit::Code(c) => (c & 0xFF) << 8,
            Exit::Signal(s) => s & 0x7F,
        }
    }
    /// waitid's (si_code, si_status).
    pub fn siginfo(self) -> (i32, i32) {
        match self {
            Exit::Code(c) => (CLD_EXITED, c & 0xFF),
            Exit::Signal(s) => (CLD_KILLED, s),
        }
    }
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Entry {
    pub ppid: u32,
    pub pgid: u32,
    pub sid: u32,
    /// Nice value (-20..=19; setpriority), inherited by a child.
    pub nice: i8,
    /// Set once it ended (a zombie until its parent reaps it).
    pub exit: Option<Exit>,
}

#[derive(Clone, Debug)]
pub struct ProcTable {
    pub map: BTreeMap<u32, Entry>,
    next_pid: u32,
    /// Signals for processes other than the caller, for the engine to deliver
    /// after the syscall (target pid, signal).
    pub outbox: Vec<(u32, SigInfo)>,
    /// Forks refused at the process limit (for reports).
    pub refused: u64,
}

impl Default for ProcTable {
    fn default() -> Self {
        let mut map = BTreeMap::new();
        map.insert(GUEST_PID, Entry { ppid: 1, pgid: GUEST_PID, sid: GUEST_PID, nice: 0, exit: None });
        ProcTable { map, next_pid: GUEST_PID + 1, outbox: Vec::new(), refused: 0 }
    }
}

/// The process table as a checkpoint records it (state format 10): every
/// entry (zombies not yet waited for included) and the next pid to give out.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct ProcTableState {
    pub entries: Vec<(u32, Entry)>,
    pub next_pid: u32,
}

/// Which children a wait4/waitid looks at.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Which {
    Any,
    Pid(u32),
    Group(u32),
}

impl ProcTable {
    /// A new child of `parent` (same group and session): its pid, or EAGAIN at the limit.
    pub fn spawn(&mut self, parent: u32) -> Result<u32, Errno> {
        if self.map.len() >= MAX_PROCS {
            self.refused += 1;
            return Err(Errno::EAGAIN);
        }
        let p = self.map.get(&parent).ok_or(Errno::ESRCH)?.clone();
        let mut pid = self.next_pid;
        while self.map.contains_key(&pid) || self.map.values().any(|e| e.pgid == pid || e.sid == pid) {
            pid = if pid + 1 >= PID_MAX { GUEST_PID + 1 } else { pid + 1 };
        }
        self.next_pid = if pid + 1 >= PID_MAX { GUEST_PID + 1 } else { pid + 1 };
        self.map.insert(pid, Entry { ppid: parent, pgid: p.pgid, sid: p.sid, nice: p.nice, exit: None });
        Ok(pid)
    }

    /// Forget a pid `spawn` gave out whose process could not be made.
    pub fn unspawn(&mut self, pid: u32) {
        self.map.remove(&pid);
    }

    pub fn get(&self, pid: u32) -> Option<&Entry> {
        self.map.get(&pid)
    }

    /// Processes alive (not zombies).
    pub fn running(&self) -> usize {
        self.map.values().filter(|e| e.exit.is_none()).count()
    }

    /// `pid` ended: its children go to "init" (zombies among them are dropped,
    /// the others are reaped by nobody when they end), it becomes a zombie of
    /// its parent, which gets SIGCHLD. Returns the parent to signal, if any.
    pub fn exit(&mut self, pid: u32, how: Exit) -> Option<u32> {
        let orphans: Vec<u32> = self.map.iter().filter(|(_, e)| e.ppid == pid).map(|(p, _)| *p).collect();
        for o in orphans {
            if self.map.get(&o).is_some_and(|e| e.exit.is_some()) {
                self.map.remove(&o);
            } else if let Some(e) = self.map.get_mut(&o) {
                e.ppid = 1;
            }
        }
        let ppid = self.map.get(&pid)?.ppid;
        if ppid == 1 || !self.map.contains_key(&ppid) {
            self.map.remove(&pid);
            return None;
        }
        if let Some(e) = self.map.get_mut(&pid) {
            e.exit = Some(how);
        }
        self.outbox
            .push((ppid, SigInfo { signo: SIGCHLD, code: how.siginfo().0, pid: pid as i32, ..Default::default() }));
        Some(ppid)
    }

    /// The children of `parent` that `which` selects: ECHILD if none; else the
    /// first zombie among them, if any.
    pub fn find_zombie(&self, parent: u32, which: Which) -> Result<Option<(u32, Exit)>, Errno> {
        let mut any = false;
        for (&pid, e) in &self.map {
            if e.ppid != parent || pid == parent {
                continue;
            }
            let hit = match which {
                Which::Any => true,
                Which::Pid(p) => p == pid,
                Which::Group(g) => g == e.pgid,
            };
            if !hit {
                continue;
            }
            any = true;
            if let Some(x) = e.exit {
                return Ok(Some((pid, x)));
            }
        }
        if any {
            Ok(None)
        } else {
            Err(Errno::ECHILD)
        }
    }

    /// Remove a reaped zombie.
    pub fn reap(&mut self, pid: u32) {
        if self.map.get(&pid).is_some_and(|e| e.exit.is_some()) {
            self.map.remove(&pid);
        }
    }

    /// setpgid(pid, pgid) by `caller` (0s already resolved to real ids).
    pub fn setpgid(&mut self, caller: u32, pid: u32, pgid: u32) -> Result<(), Errno> {
        let me = self.map.get(&caller).ok_or(Errno::ESRCH)?.clone();
        let target = self.map.get(&pid).ok_or(Errno::ESRCH)?.clone();
        if pid != caller && target.ppid != caller {
            return Err(Errno::ESRCH);
        }
        if target.sid != me.sid || target.sid == pid {
            return Err(Errno::EPERM);
        }
        // The group must be the target itself or an existing group of the same session.
        if pgid != pid && !self.map.values().any(|e| e.pgid == pgid && e.sid == me.sid && e.exit.is_none()) {
            return Err(Errno::EPERM);
        }
        if let Some(e) = self.map.get_mut(&pid) {
            e.pgid = pgid;
        }
        Ok(())
    }

    /// setsid by `caller`: EPERM for a group leader, as Linux.
    pub fn setsid(&mut self, caller: u32) -> Result<u32, Errno> {
        if self.map.values().any(|e| e.pgid == caller) {
            return Err(Errno::EPERM);
        }
        let e = self.map.get_mut(&caller).ok_or(Errno::ESRCH)?;
        e.pgid = caller;
        e.sid = caller;
        Ok(caller)
    }

    /// The live processes kill(pid, ...) by `caller` reaches (ESRCH if none).
    pub fn kill_targets(&self, caller: u32, pid: i32) -> Result<Vec<u32>, Errno> {
        let me = self.map.get(&caller).ok_or(Errno::ESRCH)?;
        let alive = |e: &Entry| e.exit.is_none();
        let v: Vec<u32> = match pid {
            // A zombie can still be signalled (nothing happens).
            p if p > 0 => self.map.get(&(p as u32)).map(|_| vec![p as u32]).unwrap_or_default(),
            0 => self.map.iter().filter(|(_, e)| e.pgid == me.pgid && alive(e)).map(|(p, _)| *p).collect(),
            // Every other process, as Linux (alone, the caller itself).
            -1 => {
                let v: Vec<u32> = self.map.iter().filter(|(p, e)| **p != caller && alive(e)).map(|(p, _)| *p).collect();
                if v.is_empty() {
                    vec![caller]
                } else {
                    v
                }
            }
            p => {
                let g = p.checked_neg().ok_or(Errno::ESRCH)? as u32;
                self.map.iter().filter(|(_, e)| e.pgid == g && alive(e)).map(|(p, _)| *p).collect()
            }
        };
        if v.is_empty() {
            Err(Errno::ESRCH)
        } else {
            Ok(v)
        }
    }

    /// The table as a checkpoint records it when only the live processes
    /// `recorded` (besides `GUEST_PID`) are: every other live process reads
    /// as killed by SIGKILL (a zombie its parent can wait for; its own
    /// children go to "init"), as if it had been killed at this point.
    pub fn save_state(&self, recorded: &[u32]) -> ProcTableState {
        let mut t = self.clone();
        let lost: Vec<u32> = t
            .map
            .iter()
            .filter(|(p, e)| **p != GUEST_PID && e.exit.is_none() && !recorded.contains(p))
            .map(|(p, _)| *p)
            .collect();
        for pid in lost {
            t.exit(pid, Exit::Signal(crate::thread::SIGKILL));
        }
        ProcTableState { entries: t.map.into_iter().collect(), next_pid: t.next_pid }
    }

    /// A table from a checkpoint, checked: `GUEST_PID` is there and alive,
    /// at most `MAX_PROCS` entries, pids in range, parents known (or 1),
    /// groups and sessions those of a process of the table or of an ended one,
    /// and exactly the processes `live` (besides `GUEST_PID`) alive.
    pub fn restore_state(s: ProcTableState, live: &[u32]) -> Result<ProcTable, String> {
        if s.entries.len() > MAX_PROCS {
            return Err(format!("{} processes (at most {MAX_PROCS})", s.entries.len()));
        }
        if !(GUEST_PID < s.next_pid && s.next_pid < PID_MAX) {
            return Err(format!("next pid {}", s.next_pid));
        }
        let mut map = BTreeMap::new();
        for (pid, e) in s.entries {
            if !(GUEST_PID..PID_MAX).contains(&pid) || map.insert(pid, e).is_some() {
                return Err(format!("pid {pid}"));
            }
        }
        if map.get(&GUEST_PID).is_none_or(|e| e.exit.is_some()) {
            return Err("the agent's process is not in the table".into());
        }
        for (pid, e) in &map {
            if e.ppid != 1 && (e.ppid == *pid || !map.contains_key(&e.ppid)) {
                return Err(format!("process {pid}: parent {}", e.ppid));
            }
            if !(-20..=19).contains(&e.nice) || e.pgid == 0 || e.sid == 0 {
                return Err(format!("process {pid}: group, session or nice value"));
            }
            let alive = e.exit.is_none();
            if *pid != GUEST_PID && alive != live.contains(pid) {
                return Err(format!("process {pid}: {} in the table", if alive { "alive" } else { "not alive" }));
            }
        }
        if live.iter().any(|p| !map.contains_key(p)) {
            return Err("a recorded process is not in the table".into());
        }
        Ok(ProcTable { map, next_pid: s.next_pid, outbox: Vec::new(), refused: 0 })
    }

    /// Forget every process but `GUEST_PID` (the end of an exec).
    pub fn keep_only_main(&mut self) {
        self.map.retain(|p, _| *p == GUEST_PID);
        self.outbox.clear();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn spawn_exit_reap_and_limit() {
        let mut t = ProcTable::default();
        let a = t.spawn(GUEST_PID).unwrap();
        assert_eq!(t.find_zombie(GUEST_PID, Which::Any), Ok(None));
        assert_eq!(t.find_zombie(a, Which::Any), Err(Errno::ECHILD));
        assert_eq!(t.exit(a, Exit::Code(3)), Some(GUEST_PID));
        assert_eq!(t.outbox.len(), 1);
        assert_eq!(t.find_zombie(GUEST_PID, Which::Pid(a)), Ok(Some((a, Exit::Code(3)))));
        assert_eq!(Exit::Code(3).status(), 0x300);
        assert_eq!(Exit::Signal(9).status(), 9);
        t.reap(a);
        assert_eq!(t.find_zombie(GUEST_PID, Which::Any), Err(Errno::ECHILD));
        for _ in 1..MAX_PROCS {
            t.spawn(GUEST_PID).unwrap();
        }
        assert_eq!(t.spawn(GUEST_PID), Err(Errno::EAGAIN));
        assert_eq!(t.refused, 1);
    }

    #[test]
    fn groups_sessions_and_orphans() {
        let mut t = ProcTable::default();
        let a = t.spawn(GUEST_PID).unwrap();
        let b = t.spawn(a).unwrap();
        assert_eq!(t.setsid(GUEST_PID), Err(Errno::EPERM), "a group leader");
        t.setpgid(GUEST_PID, a, a).unwrap();
        assert_eq!(t.get(a).unwrap().pgid, a);
        assert_eq!(t.kill_targets(GUEST_PID, -(a as i32)), Ok(vec![a]));
        assert_eq!(t.setsid(b), Ok(b));
        assert_eq!(t.get(b).unwrap().sid, b);
        t.exit(a, Exit::Signal(15));
        assert_eq!(t.get(b).unwrap().ppid, 1, "orphans go to init");
        assert_eq!(t.exit(b, Exit::Code(0)), None, "nobody reaps an orphan");
        assert!(t.get(b).is_none());
    }
}
