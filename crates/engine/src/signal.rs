//! Signal delivery, as Linux does it on x86-64 for a handler installed with
//! rt_sigaction (CPython's, with SA_RESTORER): the interrupted user state is
//! kept host-side, per thread (registers and XSAVE, `forkbox_linux::thread::SigFrame`,
//! part of the process state so a snapshot can hold a thread inside a
//! handler), a minimal `rt_sigframe` is built on the guest stack (below the
//! 128-byte red zone, aligned like a call), the vCPU enters the handler with
//! rdi = signo, rsi = &siginfo, rdx = &ucontext, and the handler's return
//! through the restorer (rt_sigreturn) puts the saved state back. The host
//! copy is the truth: nothing is read back from the guest frame, which the
//! guest may have overwritten.
//!
//! Which signals exist and who takes them is `forkbox_linux::thread`; the
//! host's interrupt (SIGINT) is one of them, with its own rules (`SignalState`).
//! The main thread never parks (gets snapshotted) inside a handler.

use std::time::{Duration, Instant};

use forkbox_linux::layout::{GUEST_BASE, RAM_SIZE, STACK_GUARD};
use forkbox_linux::thread::{SavedCpu, SigFrame, SigInfo};
use forkbox_linux::Process;
use forkbox_vmm::{kvm_regs, Vm};

use crate::error::EngineError;

pub const SIGINT: usize = 2;
pub const SIG_DFL: u64 = 0;
pub const SIG_IGN: u64 = 1;
pub const SA_RESTART: u64 = 0x1000_0000;
/// How long an interrupted exec has to get back to the agent before it is killed.
pub const GRACE: Duration = Duration::from_secs(2);

const SA_ONSTACK: u64 = 0x0800_0000;
const SA_RESTORER: u64 = 0x0400_0000;
const SA_NODEFER: u64 = 0x4000_0000;
const SA_RESETHAND: u64 = 0x8000_0000;
const SS_DISABLE: i32 = 2;
const SS_ONSTACK: i32 = 1;
const SIGKILL_STOP: u64 = (1 << 8) | (1 << 18);
const RED_ZONE: u64 = 128;
/// Handlers that may be in flight at once per thread.
const MAX_NESTED: usize = 8;

/// `struct rt_sigframe` (x86-64): pretcode, ucontext (uc_flags, uc_link,
/// uc_stack, uc_mcontext = sigcontext, uc_sigmask), siginfo. No FPU state is
/// written (sigcontext.fpstate = NULL); the host keeps it.
const FRAME_SIZE: u64 = 440;
const UC_OFF: usize = 8;
const UC_STACK_OFF: usize = UC_OFF + 16;
const MCONTEXT_OFF: usize = UC_OFF + 40;
const SIGMASK_OFF: usize = UC_OFF + 296;
const SIGINFO_OFF: usize = 312;

/// The host interrupt's state in the current run (never snapshotted).
#[derive(Default)]
pub struct SignalState {
    /// An interrupt waits to be queued (once the agent has read its request).
    pub want: bool,
    /// End of the grace period that started with this exec's first interrupt.
    pub grace: Option<Instant>,
}

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

fn killed(why: &str) -> EngineError {
    EngineError::Interrupted(why.to_string())
}

/// The interrupted state goes into the frame as a kernel's sigcontext would have it.
fn sigcontext(u: &kvm_regs, mask: u64) -> [u8; 256] {
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
    // err, trapno = 0; oldmask; cr2 = 0; fpstate = NULL.
    b[168..176].copy_from_slice(&mask.to_le_bytes());
    b
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

impl SignalState {
    /// Forget everything (start of a run).
    pub fn reset(&mut self) {
        *self = SignalState::default();
    }

    /// Can the host's interrupt be taken? Errors end the exec: the guest has
    /// SIGINT's default action (terminate), ignores it, or blocks it outside a handler.
    pub fn check_interrupt(proc: &Process) -> Result<(), EngineError> {
        let act = action(proc, SIGINT);
        match act.handler {
            SIG_DFL => return Err(killed("SIGINT has its default action (terminate)")),
            SIG_IGN => return Err(killed("the guest ignores SIGINT")),
            _ => {}
        }
        let t = &proc.threads;
        let main = t.index_of(forkbox_linux::thread::MAIN_TID);
        let blocked_everywhere = (0..t.len()).all(|i| proc.mask_of(i) & (1 << (SIGINT - 1)) != 0);
        let in_handler = main.is_some_and(|m| !t.list[m].frames.is_empty());
        if blocked_everywhere && !in_handler {
            return Err(killed("the guest blocks SIGINT"));
        }
        Ok(())
    }
}

/// Deliver `info` to the current thread, whose user state is `u` (the
/// registers at the interrupted instruction, or after a completed syscall):
/// returns the registers that enter the handler. `restore_mask`: the mask the
/// handler's return puts back (rt_sigsuspend's caller's), else the current one.
/// Errors end the exec (no restorer, no room for the frame).
pub fn deliver(
    vm: &mut Vm,
    proc: &mut Process,
    u: &kvm_regs,
    info: &SigInfo,
    restore_mask: Option<u64>,
) -> Result<kvm_regs, EngineError> {
    let sig = info.signo as usize;
    let act = action(proc, sig);
    let fail = |why: String| if sig == SIGINT { killed(&why) } else { EngineError::GuestSignaled(sig as i32) };
    if proc.threads.current().frames.len() >= MAX_NESTED {
        return Err(fail(format!("signal {sig}: too many nested handlers")));
    }
    if act.flags & SA_RESTORER == 0 {
        return Err(fail(format!("the signal {sig} handler has no restorer")));
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
    let frame = (sp.wrapping_sub(FRAME_SIZE) & !15).wrapping_sub(8);
    let end = frame.checked_add(FRAME_SIZE).ok_or_else(|| fail("no room for the signal frame".into()))?;
    let in_guard = frame < STACK_GUARD.1 && end > STACK_GUARD.0;
    if frame < GUEST_BASE || end > RAM_SIZE || in_guard || sp > RAM_SIZE || !writable(proc, frame, end) {
        return Err(fail(format!("no room for the signal frame at {frame:#x} (stack pointer {:#x})", u.rsp)));
    }
    let xsave = vm.xsave()?;
    let mask = restore_mask.unwrap_or(proc.signals.mask);
    let mut f = [0u8; FRAME_SIZE as usize];
    f[0..8].copy_from_slice(&act.restorer.to_le_bytes());
    f[UC_STACK_OFF..UC_STACK_OFF + 8].copy_from_slice(&ss_sp.to_le_bytes());
    let cur_flags = if on_alt { SS_ONSTACK } else { ss_flags };
    f[UC_STACK_OFF + 8..UC_STACK_OFF + 12].copy_from_slice(&cur_flags.to_le_bytes());
    f[UC_STACK_OFF + 16..UC_STACK_OFF + 24].copy_from_slice(&ss_size.to_le_bytes());
    f[MCONTEXT_OFF..MCONTEXT_OFF + 256].copy_from_slice(&sigcontext(u, mask));
    f[SIGMASK_OFF..SIGMASK_OFF + 8].copy_from_slice(&mask.to_le_bytes());
    f[SIGINFO_OFF..SIGINFO_OFF + 128].copy_from_slice(&info.to_bytes());
    vm.mem_mut().write(frame, &f)?;
    let mut new_mask = proc.signals.mask | act.mask;
    if act.flags & SA_NODEFER == 0 {
        new_mask |= 1 << (sig - 1);
    }
    proc.signals.mask = new_mask & !SIGKILL_STOP;
    if act.flags & SA_RESETHAND != 0 {
        std::sync::Arc::make_mut(&mut proc.signals.actions)[sig] = [0; 32];
    }
    let cpu = SavedCpu { regs: crate::sandbox::regs_to_words(u), xsave: crate::sandbox::xsave_to_words(&xsave) };
    proc.threads.current_mut().frames.push(SigFrame { cpu, mask, frame });
    let mut h = *u;
    h.rip = act.handler;
    h.rsp = frame;
    h.rdi = sig as u64;
    h.rsi = frame + SIGINFO_OFF as u64;
    h.rdx = frame + UC_OFF as u64;
    h.rax = 0;
    // As Linux: no direction flag, trap or resume flag into the handler.
    h.rflags = u.rflags & !(0x400 | 0x100 | 0x1_0000);
    Ok(h)
}

/// rt_sigreturn with RSP `rsp`: the state to return to user mode with (the
/// XSAVE state and signal mask are restored here). A sigreturn that does
/// not match a frame we built kills the guest, as a bad frame does on Linux.
pub fn sigreturn(vm: &mut Vm, proc: &mut Process, rsp: u64) -> Result<kvm_regs, EngineError> {
    let frames = &mut proc.threads.current_mut().frames;
    match frames.last() {
        Some(s) if s.frame.wrapping_add(8) == rsp => {}
        _ => return Err(EngineError::GuestSignaled(libc::SIGSEGV)),
    }
    let Some(s) = frames.pop() else { return Err(EngineError::GuestSignaled(libc::SIGSEGV)) };
    vm.set_xsave(&*crate::sandbox::words_to_xsave(&s.cpu.xsave)?)?;
    proc.signals.mask = s.mask & !SIGKILL_STOP;
    Ok(crate::sandbox::words_to_regs(&s.cpu.regs))
}

/// Is [start, end) mapped writable for the guest (a VMA with PROT_WRITE, or the brk heap)?
fn writable(proc: &Process, start: u64, end: u64) -> bool {
    let heap = |a: u64| a >= proc.mm.brk_start && a < proc.mm.brk;
    let vma = |a: u64| proc.mm.mapping_at(a).is_some_and(|v| v.prot & libc::PROT_WRITE as u32 != 0);
    let last = end - 1;
    (vma(start) || heap(start)) && (vma(last) || heap(last))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sigcontext_layout_matches_the_kernel() {
        let u = kvm_regs { r8: 8, rdi: 0xd1, rsp: 0x5a, rip: 0x1234, rflags: 0x246, rcx: 0xc, ..Default::default() };
        let b = sigcontext(&u, 0x10);
        let at = |i: usize| u64::from_le_bytes(b[i..i + 8].try_into().unwrap());
        assert_eq!(at(0), 8, "r8 first");
        assert_eq!(at(64), 0xd1, "rdi at 64");
        assert_eq!(at(112), 0xc, "rcx at 112");
        assert_eq!(at(120), 0x5a, "rsp at 120");
        assert_eq!(at(128), 0x1234, "rip at 128");
        assert_eq!(at(136), 0x246, "eflags at 136");
        assert_eq!(u16::from_le_bytes([b[144], b[145]]), forkbox_vmm::arch::USER_CS);
        assert_eq!(at(168), 0x10, "oldmask");
        assert_eq!(at(184), 0, "fpstate NULL");
        assert_eq!(SIGINFO_OFF as u64 + 128, FRAME_SIZE);
    }
}
