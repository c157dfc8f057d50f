//! The x86-64 Linux signal ABI: sigaction records, default actions, the
//! signals CPU exceptions raise, and the `rt_sigframe` a handler is entered
//! with. The engine only does the VM side (reads XSAVE, writes the frame's
//! bytes into guest memory, loads the handler's registers); what goes into a
//! frame, where it goes and how the process state changes is decided here.
//!
//! The interrupted user state is kept host-side per thread
//! (`crate::thread::SigFrame`, part of the process state, so a snapshot can
//! hold a thread inside a handler); nothing is read back from the guest
//! frame, which the guest may have overwritten.

use forkbox_vmm::{kvm_regs, GuestFault};

use crate::layout::{GUEST_BASE, RAM_SIZE};
use crate::process::Process;
use crate::thread::{SavedCpu, SigFrame, SigInfo, SI_KERNEL};

pub use crate::thread::{sigbit, NSIG, SIGALRM, SIGINT, SIGKILL, SIGSTOP, UNBLOCKABLE};

pub const SIG_DFL: u64 = 0;
pub const SIG_IGN: u64 = 1;
pub const SA_RESTART: u64 = 0x1000_0000;
pub const SA_ONSTACK: u64 = 0x0800_0000;
pub const SA_RESTORER: u64 = 0x0400_0000;
pub const SA_NODEFER: u64 = 0x4000_0000;
pub const SA_RESETHAND: u64 = 0x8000_0000;
pub const SS_DISABLE: i32 = 2;
pub const SS_ONSTACK: i32 = 1;
/// Handlers that may be in flight at once per thread.
pub const MAX_NESTED: usize = 8;

const SEGV_MAPERR: i32 = 1;
const SEGV_ACCERR: i32 = 2;
const ILL_ILLOPN: i32 = 2;
const FPE_INTDIV: i32 = 1;
const FPE_FLTINV: i32 = 7;
const TRAP_BRKPT: i32 = 1;
const BUS_ADRALN: i32 = 1;
const RED_ZONE: u64 = 128;

/// `struct rt_sigframe` (x86-64): pretcode, ucontext (uc_flags, uc_link,
/// uc_stack, uc_mcontext = sigcontext, uc_sigmask), siginfo. No FPU state is
/// written (sigcontext.fpstate = NULL); the host keeps it.
pub const FRAME_SIZE: u64 = 440;
const UC_OFF: usize = 8;
const UC_STACK_OFF: usize = UC_OFF + 16;
const MCONTEXT_OFF: usize = UC_OFF + 40;
const SIGMASK_OFF: usize = UC_OFF + 296;
const SIGINFO_OFF: usize = 312;

/// rt_sigaction's record for one signal (kernel `struct sigaction`).
pub struct Action {
    pub handler: u64,
    pub flags: u64,
    pub restorer: u64,
    pub mask: u64,
}

pub fn action(proc: &Process, sig: usize) -> Action {
    let a = proc.signals.actions.get(sig).copied().unwrap_or([0; 32]);
    let w = |i: usize| u64::from_le_bytes(a[i * 8..i * 8 + 8].try_into().unwrap_or([0; 8]));
    Action { handler: w(0), flags: w(1), restorer: w(2), mask: w(3) }
}

/// What a signal's default action does.
pub enum DefaultAction {
    Ignore,
    Terminate,
}

pub fn default_action(sig: i32) -> DefaultAction {
    match sig {
        // SIGCHLD, SIGCONT, SIGURG, SIGWINCH are ignored; the stop signals
        // (SIGSTOP, SIGTSTP, SIGTTIN, SIGTTOU) have nothing to stop here.
        17 | 18 | 23 | 28 | 19 | 20 | 21 | 22 => DefaultAction::Ignore,
        _ => DefaultAction::Terminate,
    }
}

/// What a CPU exception adds to a delivery: siginfo's si_addr and
/// sigcontext's err, trapno and cr2.
pub struct FaultInfo {
    pub addr: u64,
    pub err: u64,
    pub trapno: u64,
}

/// The signal Linux raises for a CPU exception in user mode (signal, si_code,
/// fault details); None for vectors a user program cannot cause (those crash).
pub fn fault_signal(f: &GuestFault) -> Option<(SigInfo, FaultInfo)> {
    let (signo, code, addr) = match f.vector {
        // #PF: error code bit 0 = the page was present (a protection violation).
        14 => (libc::SIGSEGV, if f.error_code & 1 != 0 { SEGV_ACCERR } else { SEGV_MAPERR }, f.cr2),
        10..=13 => (libc::SIGSEGV, SI_KERNEL, 0),
        6 => (libc::SIGILL, ILL_ILLOPN, f.rip),
        0 => (libc::SIGFPE, FPE_INTDIV, f.rip),
        16 | 19 => (libc::SIGFPE, FPE_FLTINV, f.rip),
        1 | 3 => (libc::SIGTRAP, TRAP_BRKPT, f.rip),
        17 => (libc::SIGBUS, BUS_ADRALN, f.cr2),
        _ => return None,
    };
    let info = SigInfo { signo, code, pid: 0, ..Default::default() };
    Some((info, FaultInfo { addr, err: f.error_code, trapno: f.vector as u64 }))
}

fn signal_name(sig: i32) -> &'static str {
    match sig {
        libc::SIGSEGV => "SIGSEGV",
        libc::SIGBUS => "SIGBUS",
        libc::SIGILL => "SIGILL",
        libc::SIGFPE => "SIGFPE",
        libc::SIGTRAP => "SIGTRAP",
        _ => "signal",
    }
}

/// How a fault the guest cannot take (or did not handle) is reported.
pub fn crash_report(f: &GuestFault) -> String {
    match fault_signal(f) {
        Some((i, _)) => format!("{f} ({})", signal_name(i.signo)),
        None => f.to_string(),
    }
}

/// The interrupted state goes into the frame as a kernel's sigcontext would have it.
fn sigcontext(u: &kvm_regs, mask: u64, fault: Option<&FaultInfo>) -> [u8; 256] {
    let mut b = [0u8; 256];
    let words = [
        u.r8, u.r9, u.r10, u.r11, u.r12, u.r13, u.r14, u.r15, u.rdi, u.rsi, u.rbp, u.rbx, u.rdx, u.rax, u.rcx, u.rsp,
        u.rip, u.rflags,
    ];
    for (i, w) in words.iter().enumerate() {
        b[i * 8..i * 8 + 8].copy_from_slice(&w.to_le_bytes());
    }
    b[144..146].copy_from_slice(&forkbox_vmm::arch::USER_CS.to_le_bytes());
    b[150..152].copy_from_slice(&forkbox_vmm::arch::USER_SS.to_le_bytes());
    // err, trapno (of a fault), oldmask, cr2 (a page fault's address); fpstate = NULL.
    if let Some(f) = fault {
        b[152..160].copy_from_slice(&f.err.to_le_bytes());
        b[160..168].copy_from_slice(&f.trapno.to_le_bytes());
        if f.trapno == 14 {
            b[176..184].copy_from_slice(&f.addr.to_le_bytes());
        }
    }
    b[168..176].copy_from_slice(&mask.to_le_bytes());
    b
}

/// A signal frame ready to go: its bytes and guest address, and the
/// registers that enter the handler. `commit` records it in the process.
pub struct Frame {
    pub addr: u64,
    pub bytes: [u8; FRAME_SIZE as usize],
    pub handler: kvm_regs,
    sig: usize,
    /// The mask the handler's return restores.
    restore_mask: u64,
    /// The mask while the handler runs.
    handler_mask: u64,
    reset_action: bool,
}

impl Frame {
    /// Lay out the frame of `info` for the current thread, whose user state is
    /// `u` (the interrupted instruction, or after a completed syscall).
    /// `restore_mask`: what the handler's return puts back (rt_sigsuspend's
    /// caller's mask), else the current one. Err(why) when no frame can be
    /// built: no restorer, or no writable guest memory where it must go.
    pub fn build(
        proc: &Process,
        u: &kvm_regs,
        info: &SigInfo,
        fault: Option<&FaultInfo>,
        restore_mask: Option<u64>,
    ) -> Result<Frame, String> {
        let sig = info.signo as usize;
        let act = action(proc, sig);
        if act.flags & SA_RESTORER == 0 {
            return Err(format!("the signal {sig} handler has no restorer"));
        }
        let alt = proc.signals.altstack;
        let ss_sp = u64::from_le_bytes(alt[0..8].try_into().unwrap_or([0; 8]));
        let ss_flags = i32::from_le_bytes(alt[8..12].try_into().unwrap_or([0; 4]));
        let ss_size = u64::from_le_bytes(alt[16..24].try_into().unwrap_or([0; 8]));
        let on_alt = ss_flags & SS_DISABLE == 0 && u.rsp > ss_sp && u.rsp <= ss_sp.saturating_add(ss_size);
        let sp = if act.flags & SA_ONSTACK != 0 && ss_flags & SS_DISABLE == 0 && ss_size > 0 && !on_alt {
            ss_sp.saturating_add(ss_size)
        } else {
            u.rsp.wrapping_sub(RED_ZONE)
        };
        let addr = (sp.wrapping_sub(FRAME_SIZE) & !15).wrapping_sub(8);
        let end = addr.checked_add(FRAME_SIZE).ok_or("no room for the signal frame")?;
        if addr < GUEST_BASE
            || end > RAM_SIZE
            || sp > RAM_SIZE
            || proc.mm.accessible(addr, FRAME_SIZE, true) != FRAME_SIZE
        {
            return Err(format!("no room for the signal frame at {addr:#x} (stack pointer {:#x})", u.rsp));
        }
        let mask = restore_mask.unwrap_or(proc.signals.mask);
        let mut f = [0u8; FRAME_SIZE as usize];
        f[0..8].copy_from_slice(&act.restorer.to_le_bytes());
        f[UC_STACK_OFF..UC_STACK_OFF + 8].copy_from_slice(&ss_sp.to_le_bytes());
        let cur_flags = if on_alt { SS_ONSTACK } else { ss_flags };
        f[UC_STACK_OFF + 8..UC_STACK_OFF + 12].copy_from_slice(&cur_flags.to_le_bytes());
        f[UC_STACK_OFF + 16..UC_STACK_OFF + 24].copy_from_slice(&ss_size.to_le_bytes());
        f[MCONTEXT_OFF..MCONTEXT_OFF + 256].copy_from_slice(&sigcontext(u, mask, fault));
        f[SIGMASK_OFF..SIGMASK_OFF + 8].copy_from_slice(&mask.to_le_bytes());
        f[SIGINFO_OFF..SIGINFO_OFF + 128].copy_from_slice(&info.to_bytes());
        if let Some(fi) = fault {
            // si_addr (the union's first word) for a fault.
            f[SIGINFO_OFF + 16..SIGINFO_OFF + 24].copy_from_slice(&fi.addr.to_le_bytes());
        }
        let mut handler_mask = proc.signals.mask | act.mask;
        if act.flags & SA_NODEFER == 0 {
            handler_mask |= sigbit(info.signo);
        }
        let mut h = *u;
        h.rip = act.handler;
        h.rsp = addr;
        h.rdi = sig as u64;
        h.rsi = addr + SIGINFO_OFF as u64;
        h.rdx = addr + UC_OFF as u64;
        h.rax = 0;
        // As Linux: no direction flag, trap or resume flag into the handler.
        h.rflags = u.rflags & !(0x400 | 0x100 | 0x1_0000);
        Ok(Frame {
            addr,
            bytes: f,
            handler: h,
            sig,
            restore_mask: mask,
            handler_mask: handler_mask & !UNBLOCKABLE,
            reset_action: act.flags & SA_RESETHAND != 0,
        })
    }

    /// The frame is in guest memory: the current thread enters the handler
    /// (its mask, SA_RESETHAND) and keeps `cpu`, the interrupted state.
    pub fn commit(self, proc: &mut Process, cpu: SavedCpu) {
        proc.signals.mask = self.handler_mask;
        if self.reset_action {
            if let Some(a) = std::sync::Arc::make_mut(&mut proc.signals.actions).get_mut(self.sig) {
                *a = [0; 32];
            }
        }
        proc.threads.current_mut().frames.push(SigFrame { cpu, mask: self.restore_mask, frame: self.addr });
    }
}

/// rt_sigreturn with RSP `rsp`: the current thread's innermost frame, popped,
/// with the signal mask it restores put back; None when `rsp` does not match
/// a frame built here (a bad frame: Linux kills with SIGSEGV).
pub fn pop_frame(proc: &mut Process, rsp: u64) -> Option<SigFrame> {
    let frames = &mut proc.threads.current_mut().frames;
    if frames.last()?.frame.wrapping_add(8) != rsp {
        return None;
    }
    let s = frames.pop()?;
    proc.signals.mask = s.mask & !UNBLOCKABLE;
    Some(s)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sigcontext_layout_matches_the_kernel() {
        let u = kvm_regs { r8: 8, rdi: 0xd1, rsp: 0x5a, rip: 0x1234, rflags: 0x246, rcx: 0xc, ..Default::default() };
        let fault = FaultInfo { addr: 0x8000_0000, err: 6, trapno: 14 };
        let b = sigcontext(&u, 0x10, Some(&fault));
        let at = |i: usize| u64::from_le_bytes(b[i..i + 8].try_into().unwrap());
        assert_eq!(at(0), 8, "r8 first");
        assert_eq!(at(64), 0xd1, "rdi at 64");
        assert_eq!(at(112), 0xc, "rcx at 112");
        assert_eq!(at(120), 0x5a, "rsp at 120");
        assert_eq!(at(128), 0x1234, "rip at 128");
        assert_eq!(at(136), 0x246, "eflags at 136");
        assert_eq!(u16::from_le_bytes([b[144], b[145]]), forkbox_vmm::arch::USER_CS);
        assert_eq!(at(168), 0x10, "oldmask");
        assert_eq!(at(152), 6, "err");
        assert_eq!(at(160), 14, "trapno");
        assert_eq!(at(176), 0x8000_0000, "cr2");
        assert_eq!(at(184), 0, "fpstate NULL");
        assert_eq!(SIGINFO_OFF as u64 + 128, FRAME_SIZE);
    }

    #[test]
    fn fault_vectors_map_to_linux_signals() {
        let f = |vector: u16, error_code: u64| GuestFault {
            vector,
            error_code,
            rip: 0x40_0000,
            rsp: 0x7000_0000,
            rflags: 0x202,
            cr2: 0x1000,
            user_mode: true,
        };
        let sig = |g: &GuestFault| fault_signal(g).map(|(i, _)| (i.signo, i.code));
        assert_eq!(sig(&f(14, 4)), Some((libc::SIGSEGV, SEGV_MAPERR)), "a user read of an unmapped page");
        assert_eq!(sig(&f(14, 7)), Some((libc::SIGSEGV, SEGV_ACCERR)), "a write to a read-only page");
        assert_eq!(sig(&f(0, 0)), Some((libc::SIGFPE, FPE_INTDIV)));
        assert_eq!(sig(&f(6, 0)), Some((libc::SIGILL, ILL_ILLOPN)));
        assert_eq!(sig(&f(8, 0)), None, "a double fault is no user signal");
    }
}
