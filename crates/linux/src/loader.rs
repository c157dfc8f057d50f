//! execve as the kernel does it: load the executable and its program
//! interpreter (ld.so) from the VFS, map the vDSO, build the initial stack
//! (argc, argv, envp, auxv) and return where to start.

use forkbox_vmm::layout::{VDSO_PAGE, VDSO_PAGES};
use forkbox_vmm::GuestMemory;
use goblin::elf::header::{EM_X86_64, ET_DYN, ET_EXEC};
use goblin::elf::program_header::{PF_R, PF_W, PF_X, PT_INTERP, PT_LOAD, PT_PHDR};
use goblin::elf::Elf;
use thiserror::Error;

use crate::errno::Errno;
use crate::layout::*;
use crate::mm::VmaKind;
use crate::process::Process;
use crate::vfs::{Ino, ROOT_INO};

#[derive(Debug, Error)]
pub enum LoadError {
    #[error("cannot open {path} in the guest image: {errno}")]
    Open { path: String, errno: Errno },
    #[error("{path} is not a loadable x86-64 ELF file: {why}")]
    BadElf { path: String, why: String },
    #[error("cannot map {path}: {errno}")]
    Map { path: String, errno: Errno },
    #[error("the initial stack does not fit ({0} bytes of arguments and environment)")]
    StackTooBig(usize),
    #[error("the vDSO image is {0} bytes, more than its {1}-byte slot")]
    VdsoTooBig(usize, u64),
}

/// What the kernel would tell the program about the machine.
#[derive(Clone, Debug, Default)]
pub struct ExecOptions {
    /// CPUID.1:EDX, as AT_HWCAP.
    pub hwcap: u64,
    /// vDSO image to map at `VDSO_PAGE` (announced with AT_SYSINFO_EHDR).
    pub vdso: Option<&'static [u8]>,
}

/// Where the guest starts.
#[derive(Clone, Copy, Debug)]
pub struct Start {
    pub entry: u64,
    pub rsp: u64,
}

struct Loaded {
    entry: u64,
    bias: u64,
    phdr: u64,
    phnum: u64,
    end: u64,
    interp: Option<String>,
}

fn prot_of(flags: u32) -> u32 {
    let mut p = 0;
    if flags & PF_R != 0 {
        p |= libc::PROT_READ as u32;
    }
    if flags & PF_W != 0 {
        p |= libc::PROT_WRITE as u32;
    }
    if flags & PF_X != 0 {
        p |= libc::PROT_EXEC as u32;
    }
    p
}

/// Load the ELF at `path`, or at node `ino` (named `path`) where the caller resolved it.
fn load_elf(
    mem: &mut GuestMemory,
    proc: &mut Process,
    path: &str,
    ino: Option<Ino>,
    dyn_base: u64,
) -> Result<Loaded, LoadError> {
    let open_err = |errno| LoadError::Open { path: path.to_string(), errno };
    let bad = |why: String| LoadError::BadElf { path: path.to_string(), why };
    let ino = match ino {
        Some(ino) => ino,
        None => proc.vfs.resolve(ROOT_INO, path.as_bytes(), true).map_err(open_err)?,
    };
    // The image is immutable and shared: copy the bytes out so the VFS borrow ends.
    let bytes = proc.vfs.file_bytes(ino).map_err(open_err)?.to_vec();
    let elf = Elf::parse_header(&bytes).map_err(|e| bad(e.to_string()))?;
    if elf.e_machine != EM_X86_64 || elf.e_ident[goblin::elf::header::EI_CLASS] != goblin::elf::header::ELFCLASS64 {
        return Err(bad("not x86-64".into()));
    }
    let bias = match elf.e_type {
        ET_EXEC => 0,
        ET_DYN => dyn_base,
        t => return Err(bad(format!("ELF type {t} is not an executable"))),
    };
    let full = Elf::parse(&bytes).map_err(|e| bad(e.to_string()))?;
    let mut loaded =
        Loaded { entry: elf.e_entry + bias, bias, phdr: 0, phnum: elf.e_phnum as u64, end: 0, interp: None };
    for ph in &full.program_headers {
        match ph.p_type {
            PT_INTERP => {
                let s = bytes
                    .get(ph.p_offset as usize..(ph.p_offset + ph.p_filesz) as usize)
                    .ok_or_else(|| bad("PT_INTERP out of file".into()))?;
                let s = s.split(|&b| b == 0).next().unwrap_or_default();
                loaded.interp = Some(String::from_utf8_lossy(s).into_owned());
            }
            PT_PHDR => loaded.phdr = ph.p_vaddr + bias,
            PT_LOAD => {
                let va = ph.p_vaddr.checked_add(bias).ok_or_else(|| bad("segment address overflows".into()))?;
                if ph.p_filesz > ph.p_memsz {
                    return Err(bad("segment file size exceeds memory size".into()));
                }
                let end = va.checked_add(ph.p_memsz).ok_or_else(|| bad("segment size overflows".into()))?;
                let (start, stop) = (align_down(va, PAGE_SIZE), align_up(end, PAGE_SIZE));
                if start < GUEST_BASE || stop > MMAP_BASE {
                    return Err(bad(format!("segment {va:#x}..{end:#x} outside the program area")));
                }
                proc.mm
                    .map(Some(start), stop - start, prot_of(ph.p_flags), VmaKind::File)
                    .map_err(|errno| LoadError::Map { path: path.to_string(), errno })?;
                let data = bytes
                    .get(ph.p_offset as usize..(ph.p_offset + ph.p_filesz) as usize)
                    .ok_or_else(|| bad("segment data out of file".into()))?;
                let map_err = |_| LoadError::Map { path: path.to_string(), errno: Errno::EFAULT };
                mem.write(va, data).map_err(map_err)?;
                mem.slice_mut(va + ph.p_filesz, ph.p_memsz - ph.p_filesz).map_err(map_err)?.fill(0);
                if loaded.phdr == 0 && elf.e_phoff >= ph.p_offset && elf.e_phoff < ph.p_offset + ph.p_filesz {
                    loaded.phdr = va + (elf.e_phoff - ph.p_offset);
                }
                loaded.end = loaded.end.max(end);
            }
            _ => {}
        }
    }
    if loaded.end == 0 {
        return Err(bad("no loadable segments".into()));
    }
    Ok(loaded)
}

/// Load `path` with `argv` and `envp` into a fresh process and memory. The
/// strings are bytes, passed on as they are (an environment need not be UTF-8).
pub fn exec<A: AsRef<[u8]>, E: AsRef<[u8]>>(
    mem: &mut GuestMemory,
    proc: &mut Process,
    path: &str,
    argv: &[A],
    envp: &[E],
    opts: &ExecOptions,
) -> Result<Start, LoadError> {
    exec_node(mem, proc, path, None, argv, envp, opts)
}

/// `exec` of the program at node `ino` (as execve resolved it: an fexecve's
/// file need not have a path), named `path`; `None` resolves `path`.
pub fn exec_node<A: AsRef<[u8]>, E: AsRef<[u8]>>(
    mem: &mut GuestMemory,
    proc: &mut Process,
    path: &str,
    ino: Option<Ino>,
    argv: &[A],
    envp: &[E],
    opts: &ExecOptions,
) -> Result<Start, LoadError> {
    let argv: Vec<&[u8]> = argv.iter().map(AsRef::as_ref).collect();
    let envp: Vec<&[u8]> = envp.iter().map(AsRef::as_ref).collect();
    let main = load_elf(mem, proc, path, ino, PIE_BASE)?;
    proc.mm.set_brk_start(main.end);
    let interp = match &main.interp {
        Some(p) => Some(load_elf(mem, proc, p, None, INTERP_BASE)?),
        None => None,
    };
    if let Some(vdso) = opts.vdso {
        let slot = VDSO_PAGES * PAGE_SIZE;
        if vdso.len() as u64 > slot {
            return Err(LoadError::VdsoTooBig(vdso.len(), slot));
        }
        mem.write(VDSO_PAGE, vdso).map_err(|_| LoadError::VdsoTooBig(vdso.len(), slot))?;
    }
    proc.mm
        .map(Some(STACK_BOTTOM), STACK_SIZE, (libc::PROT_READ | libc::PROT_WRITE) as u32, VmaKind::Stack)
        .map_err(|errno| LoadError::Map { path: "[stack]".into(), errno })?;
    let rsp = build_stack(mem, path, &argv, &envp, &main, interp.as_ref(), proc, opts)?;
    let nul_joined = |v: &[&[u8]]| -> std::sync::Arc<[u8]> {
        v.iter().flat_map(|s| s.iter().copied().chain(std::iter::once(0))).collect::<Vec<u8>>().into()
    };
    proc.exec_info = crate::process::ExecInfo {
        exe: path.as_bytes().into(),
        cmdline: nul_joined(&argv),
        environ: nul_joined(&envp),
    };
    Ok(Start { entry: interp.as_ref().map_or(main.entry, |i| i.entry), rsp })
}

const AT_NULL: u64 = 0;
const AT_PHDR: u64 = 3;
const AT_PHENT: u64 = 4;
const AT_PHNUM: u64 = 5;
const AT_PAGESZ: u64 = 6;
const AT_BASE: u64 = 7;
const AT_FLAGS: u64 = 8;
const AT_ENTRY: u64 = 9;
const AT_UID: u64 = 11;
const AT_EUID: u64 = 12;
const AT_GID: u64 = 13;
const AT_EGID: u64 = 14;
const AT_PLATFORM: u64 = 15;
const AT_HWCAP: u64 = 16;
const AT_CLKTCK: u64 = 17;
const AT_SECURE: u64 = 23;
const AT_RANDOM: u64 = 25;
const AT_HWCAP2: u64 = 26;
const AT_EXECFN: u64 = 31;
const AT_SYSINFO_EHDR: u64 = 33;
const AT_MINSIGSTKSZ: u64 = 51;

#[allow(clippy::too_many_arguments)]
fn build_stack(
    mem: &mut GuestMemory,
    path: &str,
    argv: &[&[u8]],
    envp: &[&[u8]],
    main: &Loaded,
    interp: Option<&Loaded>,
    proc: &Process,
    opts: &ExecOptions,
) -> Result<u64, LoadError> {
    // Strings and the random bytes go at the top; pointers below them.
    let strings: usize = path.len() + 1 + argv.iter().chain(envp).map(|s| s.len() + 1).sum::<usize>() + 7;
    if strings > 256 << 10 {
        return Err(LoadError::StackTooBig(strings));
    }
    let too_big = |_| LoadError::StackTooBig(strings);
    let mut sp = STACK_TOP;
    let mut push_str = |mem: &mut GuestMemory, s: &[u8]| -> Result<u64, LoadError> {
        sp -= s.len() as u64 + 1;
        mem.write(sp, s).map_err(too_big)?;
        mem.write(sp + s.len() as u64, &[0]).map_err(too_big)?;
        Ok(sp)
    };
    let execfn = push_str(mem, path.as_bytes())?;
    let argv_ptrs = argv.iter().map(|s| push_str(mem, s)).collect::<Result<Vec<_>, _>>()?;
    let envp_ptrs = envp.iter().map(|s| push_str(mem, s)).collect::<Result<Vec<_>, _>>()?;
    let platform = push_str(mem, b"x86_64")?;
    sp = align_down(sp - 16, 16);
    let random = sp;
    let mut rnd = [0u8; 16];
    crate::random::fill_random(&mut rnd).map_err(|_| LoadError::StackTooBig(0))?;
    mem.write(random, &rnd).map_err(too_big)?;

    let mut aux = vec![
        (AT_PHDR, main.phdr),
        (AT_PHENT, 56),
        (AT_PHNUM, main.phnum),
        (AT_PAGESZ, PAGE_SIZE),
        (AT_BASE, interp.map_or(0, |i| i.bias)),
        (AT_FLAGS, 0),
        (AT_ENTRY, main.entry),
        (AT_UID, proc.creds.uid.real.into()),
        (AT_EUID, proc.creds.uid.effective.into()),
        (AT_GID, proc.creds.gid.real.into()),
        (AT_EGID, proc.creds.gid.effective.into()),
        (AT_SECURE, 0),
        (AT_RANDOM, random),
        (AT_HWCAP, opts.hwcap),
        (AT_HWCAP2, 0),
        (AT_CLKTCK, 100),
        (AT_PLATFORM, platform),
        (AT_EXECFN, execfn),
        (AT_MINSIGSTKSZ, 8192),
    ];
    if opts.vdso.is_some() {
        aux.push((AT_SYSINFO_EHDR, VDSO_PAGE));
    }
    aux.push((AT_NULL, 0));

    let mut words: Vec<u64> = vec![argv_ptrs.len() as u64];
    words.extend(&argv_ptrs);
    words.push(0);
    words.extend(&envp_ptrs);
    words.push(0);
    for (k, v) in aux {
        words.extend([k, v]);
    }
    sp -= 8 * words.len() as u64;
    sp = align_down(sp, 16);
    for (i, w) in words.iter().enumerate() {
        mem.write_u64(sp + 8 * i as u64, *w).map_err(too_big)?;
    }
    Ok(sp)
}
