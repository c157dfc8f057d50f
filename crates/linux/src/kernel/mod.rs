//! The kernel core: what every syscall handler works with. `Ctx` (the guest
//! memory, the calling process and the sandbox's kernel state a handler may
//! touch), the arguments, the `Effect`s a call asks of the engine, and the
//! blocking contract (`block`). Nothing here knows a handler module: handlers
//! (`crate::syscalls`) and the file kinds behind descriptors build on this.

pub mod block;
pub mod state;

use forkbox_vmm::GuestMemory;

use crate::errno::{Errno, SysResult};
use crate::layout::{GUEST_BASE, RAM_SIZE};
use crate::process::Process;
use crate::vfs::Ino;

pub use state::Kernel;

pub type Args = [u64; 6];
pub type Handler = fn(&mut Ctx, &Args) -> SysResult;

/// Something the VMM must do besides returning a value.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Effect {
    /// The agent waits for a request: stop here without completing the call;
    /// the call is re-issued when the vCPU resumes.
    Park,
    /// exit_group / exit.
    Exit(i32),
    /// Killed by a signal it sent itself (abort()).
    Signaled(i32),
    /// arch_prctl(ARCH_SET_FS).
    SetFsBase(u64),
    /// rt_sigreturn: return from a signal handler the VMM entered.
    SigReturn,
    /// The call must wait: re-run it when state may have changed (see `crate::wait`).
    Block(block::Block),
    /// clone made thread `tid` (its record is in `proc.threads`): the engine
    /// gives it the caller's registers with RAX = 0 and RSP = `stack` (if not
    /// 0), and the caller's XSAVE state.
    Spawn { tid: crate::thread::Tid, stack: u64 },
    /// exit of one thread (others remain): the engine drops it and runs another.
    ThreadExit,
    /// sched_yield with other threads: let another runnable thread run.
    Yield,
    /// A futex wake ended waits of this process' threads: the caller keeps
    /// the vCPU until its next exit, since it may still hold the lock they
    /// wait for (a condition signalled under its mutex, CPython's GIL).
    Woke,
    /// fork/vfork/clone of a new process: the engine makes the child (pid
    /// already in the process table) from the caller's state; RAX = 0 in it.
    Fork(ForkSpec),
    /// execve/execveat passed every check: the engine drops the address space
    /// and loads the program (a failure from here on kills the process).
    Exec(Box<ExecSpec>),
}

/// Everything a handler may touch.
pub struct Ctx<'a> {
    pub mem: &'a mut GuestMemory,
    pub proc: &'a mut Process,
    pub kernel: &'a mut Kernel,
    pub effect: Option<Effect>,
    /// The engine re-runs a blocked call (`Effect::Block`) with this set once
    /// its deadline has passed: the handler must then complete as at a
    /// timeout (never block again). See `crate::wait`.
    pub timed_out: bool,
}

/// Longest path a guest may pass (PATH_MAX).
pub const PATH_MAX: usize = 4096;
/// Largest single read/write, as Linux (MAX_RW_COUNT).
pub const MAX_RW: u64 = 0x7FFF_F000;

impl Ctx<'_> {
    /// Make the current call block (see `block`): sets the effect; the return
    /// value is ignored by the engine (it re-runs the handler).
    pub fn block(&mut self, b: block::Block) -> SysResult {
        self.effect = Some(Effect::Block(b));
        Ok(0)
    }

    /// Is the current call blocking (a handler that composes others checks this)?
    pub fn is_blocking(&self) -> bool {
        matches!(self.effect, Some(Effect::Block(_)))
    }

    /// Check a guest buffer the VMM reads: every page of it mapped readable
    /// in the guest's memory map (EFAULT for unmapped or PROT_NONE pages, as
    /// Linux). What the guest did not map is never touched, so never backed.
    pub fn user_range(&self, addr: u64, len: u64) -> Result<(), Errno> {
        self.check_user(addr, len, false)
    }

    /// Check a guest buffer the VMM writes: every page mapped writable
    /// (EFAULT for read-only ones too).
    pub fn user_range_mut(&self, addr: u64, len: u64) -> Result<(), Errno> {
        self.check_user(addr, len, true)
    }

    fn check_user(&self, addr: u64, len: u64, write: bool) -> Result<(), Errno> {
        if len == 0 {
            return Ok(());
        }
        let end = addr.checked_add(len).ok_or(Errno::EFAULT)?;
        if addr < GUEST_BASE || end > RAM_SIZE.min(self.mem.size()) || self.proc.mm.accessible(addr, len, write) != len
        {
            return Err(Errno::EFAULT);
        }
        Ok(())
    }

    pub fn bytes(&self, addr: u64, len: u64) -> Result<&[u8], Errno> {
        self.user_range(addr, len)?;
        if len == 0 {
            return Ok(&[]);
        }
        self.mem.slice(addr, len).map_err(|_| Errno::EFAULT)
    }

    pub fn bytes_mut(&mut self, addr: u64, len: u64) -> Result<&mut [u8], Errno> {
        self.user_range_mut(addr, len)?;
        if len == 0 {
            return Ok(&mut []);
        }
        self.mem.slice_mut(addr, len).map_err(|_| Errno::EFAULT)
    }

    pub fn write_bytes(&mut self, addr: u64, data: &[u8]) -> Result<(), Errno> {
        self.bytes_mut(addr, data.len() as u64)?.copy_from_slice(data);
        Ok(())
    }

    pub fn write_u64(&mut self, addr: u64, v: u64) -> Result<(), Errno> {
        self.write_bytes(addr, &v.to_le_bytes())
    }

    pub fn write_i32(&mut self, addr: u64, v: i32) -> Result<(), Errno> {
        self.write_bytes(addr, &v.to_le_bytes())
    }

    pub fn read_u64(&self, addr: u64) -> Result<u64, Errno> {
        let b = self.bytes(addr, 8)?;
        Ok(u64::from_le_bytes(b.try_into().map_err(|_| Errno::EFAULT)?))
    }

    pub fn read_i64(&self, addr: u64) -> Result<i64, Errno> {
        self.read_u64(addr).map(|v| v as i64)
    }

    /// A NUL-terminated path from the guest (read only as far as it is mapped).
    pub fn path(&self, addr: u64) -> Result<Vec<u8>, Errno> {
        self.c_string(addr, PATH_MAX)
    }

    /// A NUL-terminated string of at most `max` bytes with its NUL
    /// (ENAMETOOLONG past that, EFAULT if its memory ends first).
    pub fn c_string(&self, addr: u64, max: usize) -> Result<Vec<u8>, Errno> {
        self.user_range(addr, 1)?;
        let avail = self.proc.mm.accessible(addr, max as u64, false);
        let s = self.mem.slice(addr, avail).map_err(|_| Errno::EFAULT)?;
        match s.iter().position(|&b| b == 0) {
            Some(n) => Ok(s[..n].to_vec()),
            // No NUL: too long if the memory is there, else a bad pointer.
            None if avail == max as u64 => Err(Errno::ENAMETOOLONG),
            None => Err(Errno::EFAULT),
        }
    }

    /// The directory a *at() call starts from: the cwd for AT_FDCWD, else the dirfd's node.
    pub fn dir_start(&self, dirfd: u64, path: &[u8]) -> Result<Ino, Errno> {
        if path.first() == Some(&b'/') || dirfd as i32 == libc::AT_FDCWD {
            return Ok(self.proc.cwd);
        }
        match self.proc.fds.get(dirfd as i32)?.kind {
            crate::fd::FileKind::Node(ino) => Ok(ino),
            _ => Err(Errno::ENOTDIR),
        }
    }
}

/// What the engine needs to make a forked child.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ForkSpec {
    pub pid: u32,
    /// The child's stack pointer (0: the caller's).
    pub stack: u64,
    /// CLONE_CHILD_SETTID: write the pid here in the child's memory.
    pub set_tid: Option<u64>,
    /// CLONE_CHILD_CLEARTID: the child's clear-child-tid address.
    pub clear_tid: Option<u64>,
    /// CLONE_SETTLS: the child's FS base.
    pub tls: Option<u64>,
}

/// A program to load, checked (exists, executable, an ELF) by the handler.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ExecSpec {
    /// Absolute path of the ELF to load (after `#!` resolution), or
    /// /dev/fd/N for an fexecve: its name for AT_EXECFN and /proc/self/exe.
    pub path: String,
    /// The ELF's node, resolved by the handler (the engine holds it while
    /// the close-on-exec fds close, so an fexecve of one of them still loads).
    pub ino: crate::vfs::Ino,
    /// argv and envp as the guest gave them: bytes, not necessarily UTF-8.
    pub argv: Vec<Vec<u8>>,
    pub envp: Vec<Vec<u8>>,
}
