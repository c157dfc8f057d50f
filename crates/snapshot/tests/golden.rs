//! Golden files of the persisted formats: a template's state file, a session
//! checkpoint's state file, a layer file and a template bundle (the transfer
//! format of a template directory, `bundle.rs`: its own synthetic directory), built from a tiny synthetic
//! state (a packed 3-file image, a few mappings and fds, fixed registers),
//! committed under `tests/golden/`.
//!
//! What the tests hold to:
//! - the current version's golden files are exactly what this code writes for
//!   the synthetic state (so any change to the format — a field added, removed,
//!   reordered or retyped in `Snapshot`, `VcpuRecord`, `CpuFingerprint`,
//!   `MemoryStats`, `ProcessState` and everything in it (the persisted
//!   shapes of src/state/, and the live types still written as their serde
//!   form), or the layer encoding — fails here);
//! - every golden file of every version this code says it reads
//!   (`READABLE_VERSIONS`, `READABLE_LAYER_VERSIONS`) still decodes.
//!
//! So when a format changes: bump its version (`FORMAT_VERSION` in
//! src/state.rs, `LAYER_VERSION` in src/layer.rs, `BUNDLE_VERSION` in src/bundle.rs), give the previous version a
//! reader (its module in src/state/ stays frozen; the new version's module
//! holds the new shape and the upgrade from it; see src/state.rs),
//! then write the new version's golden files with
//!
//! ```text
//! cargo test --release -p forkbox-snapshot --test golden -- --ignored write_golden_files
//! ```
//!
//! and commit them next to the old ones. The writer never overwrites an
//! existing golden file that differs (that would hide a format change); delete
//! one by hand only if the synthetic state itself was changed on purpose and
//! the version it describes was never released.
#![allow(clippy::unwrap_used)] // a test may unwrap: a panic is its failure

use std::path::{Path, PathBuf};
use std::sync::Arc;

use forkbox_image::{Image, PackOptions};
use forkbox_linux::fd::{FileKind, SockInfo};
use forkbox_linux::mm::VmaKind;
use forkbox_linux::net::ListenerState;
use forkbox_linux::process::{ChildState, ProcessState};
use forkbox_linux::procs::{Entry, Exit, ProcTable, ProcTableState};
use forkbox_linux::thread::{SavedCpu, SigInfo, Thread, Timer, Wait, WaitKind};
use forkbox_linux::vfs::{BodyState, Vfs, ROOT_INO};
use forkbox_linux::Process;
use forkbox_snapshot::bundle::{self, BUNDLE_VERSION, READABLE_BUNDLE_VERSIONS};
use forkbox_snapshot::cpu::{CpuFingerprint, CpuidLeaf};
use forkbox_snapshot::files::{FileTable, StoredChunk, StoredFile};
use forkbox_snapshot::layer::{apply_layers, write_layer, Layer, LAYER_VERSION, READABLE_LAYER_VERSIONS};
use forkbox_snapshot::regs::{DTable, Regs, Segment, Sregs, VcpuRecord, Xcr, Xcrs, Xsave, XSAVE_SIZE};
use forkbox_snapshot::{
    state, ChildRecord, Children, LayerPlan, MemoryRef, MemoryStats, Snapshot, FORMAT_VERSION, READABLE_VERSIONS,
};
use forkbox_vmm::GuestMemory;

const IMAGE_ID: &str = "601de0601de0601de0601de0601de0601de0601de0601de0601de0601de06000";
const FIXED_MTIME_NS: i128 = 1_700_000_000_123_456_789;
const TEMPLATE_ID: &str = "goldentemplate00goldentemplate00";
const PACKAGE_LAYER_ID: &str = "9ac4a9e09ac4a9e09ac4a9e09ac4a9e09ac4a9e09ac4a9e09ac4a9e09ac4a9e0";

fn golden_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/golden")
}

fn golden(kind: &str, version: u32) -> PathBuf {
    golden_dir().join(format!("{kind}-v{version}.bin"))
}

/// A tiny image: /etc/hostname, /bin/tool (executable), /tmp; fixed id and mtimes.
fn image(tmp: &Path) -> Arc<Image> {
    use std::os::unix::fs::PermissionsExt;
    let root = tmp.join("root");
    for d in ["etc", "bin", "tmp"] {
        std::fs::create_dir_all(root.join(d)).unwrap();
    }
    std::fs::write(root.join("etc/hostname"), b"golden\n").unwrap();
    std::fs::write(root.join("bin/tool"), b"\x7fELF not really").unwrap();
    for (p, mode) in
        [("etc/hostname", 0o644), ("bin/tool", 0o755), ("etc", 0o755), ("bin", 0o755), ("tmp", 0o1777), ("", 0o755)]
    {
        std::fs::set_permissions(root.join(p), std::fs::Permissions::from_mode(mode)).unwrap();
    }
    let out = tmp.join("image");
    let opts = PackOptions { id: Some(IMAGE_ID.into()), mtime_clamp: Some(1_600_000_000) };
    forkbox_image::pack_dir_with(&root, &out, &opts).unwrap();
    let image = Image::open(&out).unwrap();
    assert_eq!(image.id(), IMAGE_ID);
    Arc::new(image)
}

/// A package layer (an unpacked wheel, packed): one module under /usr/local.
fn package_layer(tmp: &Path) -> Arc<Image> {
    let root = tmp.join("package-root");
    let pkg = root.join("usr/local/lib/python3.11/dist-packages/goldpkg");
    std::fs::create_dir_all(&pkg).unwrap();
    std::fs::write(pkg.join("__init__.py"), b"GOLD = 1\n").unwrap();
    let out = tmp.join("package.img");
    let opts = PackOptions { id: Some(PACKAGE_LAYER_ID.into()), mtime_clamp: Some(1_600_000_000) };
    forkbox_image::pack_dir_with(&root, &out, &opts).unwrap();
    Arc::new(Image::open(&out).unwrap())
}

/// The layers the golden states may refer to, by id.
fn layers(tmp: &Path) -> forkbox_linux::vfs::Layers {
    let l = package_layer(tmp);
    [(l.id().to_string(), l)].into_iter().collect()
}

/// A process as a template has it (mappings, a heap, stdio) or, for a
/// session checkpoint, after some work (a file written, an fd open, TLS, a mask).
fn process(image: &Arc<Image>, session: bool) -> ProcessState {
    process_and_child(image, session).0
}

/// [`process`], and for a session a child it forked (format 10): it shares
/// the agent's descriptions (a file, a socket, both ends of a pipe), has a
/// mask of its own and a thread on the vCPU.
fn process_and_child(image: &Arc<Image>, session: bool) -> (ProcessState, Option<ChildState>) {
    let mut p = Process::new(Vfs::new(image.clone()), 256 << 20);
    let (r, rw, rx) = (
        libc::PROT_READ as u32,
        (libc::PROT_READ | libc::PROT_WRITE) as u32,
        (libc::PROT_READ | libc::PROT_EXEC) as u32,
    );
    p.mm.map(Some(0x40_0000), 0x2000, rx, VmaKind::File).unwrap();
    p.mm.map(Some(0x40_2000), 0x1000, r, VmaKind::File).unwrap();
    p.mm.map(Some(0x4800_0000), 0x10_000, rw, VmaKind::Anon).unwrap();
    p.mm.map(Some(0xFFFF_F000 - 0x2_0000), 0x2_0000, rw, VmaKind::Stack).unwrap();
    p.mm.set_brk_start(0x60_0000);
    let _ = p.mm.set_brk(0x60_3000);
    if session {
        let ino = p.vfs.open(ROOT_INO, b"/tmp/out.txt", libc::O_CREAT | libc::O_RDWR, 0o600).unwrap();
        p.vfs.write(ino, 0, b"checkpointed bytes").unwrap();
        let fd = p.fds.open(FileKind::Node(ino), libc::O_RDWR | libc::O_CLOEXEC).unwrap();
        p.fds.get_mut(fd).unwrap().offset = 18;
        // An inet socket: only its id, domain and type are in the state (the host socket never is).
        p.fds.open(FileKind::Socket(SockInfo { id: 7, domain: libc::AF_INET, stream: true }), libc::O_RDWR).unwrap();
        p.mm.map(Some(0x4801_0000), 0x1000, rw, VmaKind::SharedFile { ino, offset: 0 }).unwrap();
        p.vfs.mkdir(ROOT_INO, b"/tmp/dir", 0o755).unwrap();
        // Files of another owner (format 8).
        let dir = p.vfs.resolve(ROOT_INO, b"/tmp/dir", true).unwrap();
        p.vfs.chown(dir, Some(1000), Some(100)).unwrap();
        p.vfs.chown(ino, None, Some(27)).unwrap();
        p.vfs.unlink(ROOT_INO, b"/etc/hostname").unwrap();
        // A package installed at run time: its file is a reference to the layer (format 6).
        let tmp = tempfile::tempdir().unwrap();
        p.vfs.install_layer(&package_layer(tmp.path())).unwrap();
        // A pipe resized with F_SETPIPE_SZ, holding bytes, and credentials
        // changed with setresuid/setgroups (format 7).
        let pipe = p.fds.objects.new_pipe(None);
        let (_r, _w) = p.fds.open_two((pipe, libc::O_RDONLY), (pipe, libc::O_WRONLY)).unwrap();
        p.fds.objects.set_pipe_size(pipe, 8192).unwrap();
        p.fds.objects.pipe_write(pipe, b"in the pipe").unwrap();
        p.creds.uid.set_res(1000, 0, 1000, true).unwrap();
        p.creds.set_groups(vec![27, 4]).unwrap();
        p.fs_base = 0x4802_0700;
        p.tid_address = 0x4802_09d0;
        p.signals.mask = 1 << (libc::SIGINT - 1);
        p.umask = 0o077;
        // A second thread parked in a futex wait, a process-directed signal
        // not yet taken, an armed POSIX timer and alarm().
        let main = p.threads.list[0].clone();
        let regs = vcpu(true).regs;
        let mut xsave = Xsave::default();
        xsave.region[24..28].copy_from_slice(&0x1f80_u32.to_le_bytes());
        let wait = Wait::new(
            Regs { rax: 202, rdi: 0x4800_0040, rsi: 0x80, ..regs },
            Some(2_000_000_000),
            Err(libc::ETIMEDOUT),
            WaitKind::Futex { addr: 0x4800_0040, bitset: u32::MAX },
        );
        p.threads.list.push(Thread {
            tid: main.tid + 1,
            cpu: Some(SavedCpu { regs: Regs { rsp: 0x4800_8000, ..regs }, xsave: Arc::new(xsave) }),
            fs_base: 0x4800_9700,
            sigmask: 0,
            clear_tid: 0x4800_99d0,
            wait: Some(wait),
            ..main
        });
        p.threads.next_tid = main.tid + 2;
        p.threads.pending.push(SigInfo::user(libc::SIGUSR1, 0));
        let timer = Timer {
            id: 0,
            clock: libc::CLOCK_MONOTONIC,
            signo: libc::SIGALRM,
            tid: None,
            silent: false,
            value: 7,
            expiry: Some(1_500_000_000),
            interval_ns: 250_000_000,
            overrun: 0,
        };
        p.threads.timers.push(timer.clone());
        p.threads.itimer_real = Some(Timer { id: -1, expiry: Some(3_000_000_000), interval_ns: 0, ..timer });
    }
    let child = session.then(|| {
        let mut c = p.fork_child(3);
        c.signals.mask = 1 << (libc::SIGTERM - 1);
        c.umask = 0o027;
        c.save_child_state()
    });
    let mut s = p.save_state();
    if session {
        // A listening socket on fd 5 (format 9): re-created on restore.
        s.listeners.push(ListenerState {
            id: 0x1234_5678_0000_0009,
            domain: libc::AF_INET,
            local: "0.0.0.0:8000".parse().unwrap(),
            backlog: 6,
            reuse: true,
            rcvtimeo: None,
            sndtimeo: Some(std::time::Duration::from_millis(1500)),
            opts: vec![((libc::IPPROTO_TCP, libc::TCP_NODELAY), 1i32.to_le_bytes().to_vec())],
        });
    }
    // Node mtimes are "now" when made: pin them.
    for n in s.vfs.nodes.iter_mut().filter(|n| !matches!(n.body, BodyState::Gone)) {
        n.mtime_ns = FIXED_MTIME_NS;
        n.atime_ns = FIXED_MTIME_NS;
    }
    (s, child)
}

/// A child's memory layer over zeros (page 1 of the layer inputs), as a
/// process memory file holds it.
fn child_layer() -> Vec<u8> {
    let (_, mem, _) = layer_inputs();
    let zeros = vec![0u8; 16 * 4096];
    let mut memory = Vec::new();
    LayerPlan::new(&mem, &zeros, &[1]).unwrap().write_into(&mut memory).unwrap();
    memory
}

/// The other processes of the session checkpoint (format 10): one running
/// child (pid 3) whose memory is two layers over zeros in the process memory
/// files of this checkpoint and of its parent, one zombie (pid 4) not yet
/// waited for.
fn children(image: &Arc<Image>) -> Children {
    let (_, child) = process_and_child(image, true);
    let layer = child_layer();
    let part = |file: &str, offset: u64| MemoryRef {
        file: file.into(),
        offset,
        len: layer.len() as u64,
        crc: crc32fast::hash(&layer),
    };
    let memory = vec![part("c_0002.procs", 0), part("c_0001.procs", 4096)];
    let entry = |ppid, exit| Entry { ppid, pgid: 2, sid: 2, nice: 0, exit };
    Children {
        table: Some(ProcTableState {
            entries: vec![(2, entry(1, None)), (3, entry(2, None)), (4, entry(2, Some(Exit::Code(3))))],
            next_pid: 5,
        }),
        processes: vec![ChildRecord {
            process: child.unwrap(),
            vcpu: vcpu(true),
            pending_user: Some(Regs { rax: 0, rip: 0x7f00_1236, ..vcpu(true).regs }),
            in_stub: true,
            memory,
            on_template: false,
        }],
    }
}

fn cpu() -> CpuFingerprint {
    let leaf = |function, index, flags, eax, ebx, ecx, edx| CpuidLeaf { function, index, flags, eax, ebx, ecx, edx };
    CpuFingerprint {
        xcr0: 0xe7,
        leaves: vec![
            leaf(0, 0, 0, 0x1f, 0x756e_6547, 0x6c65_746e, 0x4965_6e69),
            leaf(1, 0, 0, 0x000a_06a6, 0x0080_0800, 0xfffa_3203, 0x1f8b_fbff),
            leaf(7, 0, 1, 0, 0xd19f_4fbb, 0x1840_5fce, 0xfc1c_c410),
            leaf(0xd, 0, 1, 0xe7, 0xa88, 0xa88, 0),
        ],
    }
}

fn vcpu(session: bool) -> VcpuRecord {
    let seg = |selector: u16, type_: u8, l: u8| Segment {
        base: 0,
        limit: 0xFFFF_FFFF,
        selector,
        type_,
        present: 1,
        dpl: 3,
        db: 1 - l,
        s: 1,
        l,
        g: 1,
        avl: 0,
        unusable: 0,
    };
    let data = seg(0x33, 3, 0);
    let mut xsave = Xsave::default();
    xsave.region[..4].copy_from_slice(&0x037f_u32.to_le_bytes()); // FCW
    xsave.region[24..28].copy_from_slice(&0x1f80_u32.to_le_bytes()); // MXCSR
    xsave.region[512..520].copy_from_slice(&0x7_u64.to_le_bytes()); // XSTATE_BV
    assert_eq!(xsave.region.len(), XSAVE_SIZE);
    VcpuRecord {
        regs: Regs {
            rax: 0,
            rbx: 1,
            rcx: 0x7f00_1234,
            rdx: 0x1000,
            rsi: 0x4800_1000,
            rdi: 3,
            rsp: 0xFFFF_E000 - if session { 0x800 } else { 0x400 },
            rbp: 0,
            r8: 8,
            r9: 9,
            r10: 10,
            r11: 0x246,
            r12: 12,
            r13: 13,
            r14: 14,
            r15: 15,
            rip: 0x7f00_1234,
            rflags: 0x202,
        },
        sregs: Sregs {
            cs: seg(0x2b, 0xb, 1),
            ds: data,
            es: data,
            fs: data,
            gs: data,
            ss: data,
            tr: Segment { base: 0x3000, limit: 0x67, selector: 0x38, type_: 11, present: 1, ..Segment::default() },
            ldt: Segment::default(),
            gdt: DTable { base: 0x1000, limit: 55 },
            idt: DTable { base: 0x2000, limit: 4095 },
            cr0: 0x8005_0033,
            cr2: if session { 0x4801_0000 } else { 0 },
            cr3: 0x10_0000,
            cr4: 0x0030_0620,
            cr8: 0,
            efer: 0xd01,
            apic_base: 0xfee0_0900,
            interrupt_bitmap: [0; 4],
        },
        xcrs: Xcrs(vec![Xcr { index: 0, value: 0xe7 }]),
        xsave,
        fs_base: if session { 0x4802_0700 } else { 0 },
    }
}

fn memory_stats() -> MemoryStats {
    MemoryStats { size: 4 << 30, pages: 11_540, checksum: "ab".repeat(32) }
}

/// The template's state file (its `info` is the engine's TemplateInfo JSON).
fn template_state(image: &Arc<Image>) -> Snapshot {
    let info = serde_json_info();
    Snapshot {
        image_id: IMAGE_ID.into(),
        cpu: cpu(),
        vcpu: vcpu(false),
        process: process(image, false),
        memory: memory_stats(),
        info,
        files: FileTable::default(),
        children: Children::default(),
    }
}

/// TemplateInfo as forkbox-engine writes it (checked against its type there).
fn serde_json_info() -> String {
    format!(
        "{{\"id\":\"{TEMPLATE_ID}\",\"image_id\":\"{IMAGE_ID}\",\"preload\":\"import numpy\",\
         \"agent\":{{\"numpy\":\"1.24.2\",\"python\":\"3.11.2\"}},\"created_unix\":1700000000,\"boot_ms\":812.5,\"memory_pages\":11540}}"
    )
}

/// A session checkpoint's state file (its `info` is the template id).
fn session_state(image: &Arc<Image>) -> Snapshot {
    Snapshot {
        image_id: IMAGE_ID.into(),
        cpu: cpu(),
        vcpu: vcpu(true),
        process: process(image, true),
        memory: memory_stats(),
        info: TEMPLATE_ID.into(),
        children: children(image),
        // One overlay file whose bytes are in two chunks of two packs.
        files: FileTable {
            packs: vec!["c_0001.files".into(), "c_0002.files".into()],
            files: vec![StoredFile {
                ino: 4242,
                len: 300_000,
                chunks: vec![
                    StoredChunk { pack: 0, offset: 0, len: 262_144, crc: 0x1234_5678 },
                    StoredChunk { pack: 1, offset: 4096, len: 37_856, crc: 0x9abc_def0 },
                ],
            }],
        },
    }
}

/// 16 pages of base ("template") memory, and memory that differs from it in
/// a few bytes of page 1, a whole page 3, and not at all in page 5 (listed anyway).
fn layer_inputs() -> (Vec<u8>, GuestMemory, Vec<u64>) {
    let base: Vec<u8> = (0..16 * 4096u32).map(|i| (i % 251) as u8).collect();
    let mut mem = GuestMemory::anonymous(1 << 20).unwrap();
    mem.write(0, &base).unwrap();
    mem.write(4096 + 100, b"a few bytes").unwrap();
    mem.write(4096 + 4000, &0xdead_beef_u64.to_le_bytes()).unwrap();
    let page3: Vec<u8> = (0..4096u32).map(|i| (i.wrapping_mul(2_654_435_761) >> 24) as u8).collect();
    mem.write(3 * 4096, &page3).unwrap();
    (base, mem, vec![1, 3, 5])
}

/// A tiny template directory for the bundle format: a state file (any bytes:
/// a bundle carries it verbatim) and a sparse 1 MiB memory file with data in
/// pages 1, 2 and 9 and an explicitly written zero page 7 (left out).
fn bundle_dir(tmp: &Path) -> PathBuf {
    use std::os::unix::fs::FileExt;
    let dir = tmp.join("template");
    std::fs::create_dir_all(&dir).unwrap();
    std::fs::write(dir.join(bundle::STATE_FILE), b"a template's state file, carried verbatim\n").unwrap();
    let (base, _, _) = layer_inputs();
    let f = std::fs::File::create(dir.join(bundle::MEMORY_FILE)).unwrap();
    f.set_len(1 << 20).unwrap();
    f.write_all_at(&base[4096..3 * 4096], 4096).unwrap();
    f.write_all_at(&[0u8; 4096], 7 * 4096).unwrap();
    f.write_all_at(&base[..4096], 9 * 4096).unwrap();
    dir
}

/// What the current code writes: (golden file name, bytes).
fn current_files(tmp: &Path) -> Vec<(PathBuf, Vec<u8>)> {
    let image = image(tmp);
    let (base, mem, pages) = layer_inputs();
    let layer = tmp.join("layer");
    write_layer(&layer, &mem, &base, &pages).unwrap();
    let bundle_file = tmp.join("bundle");
    bundle::pack(&bundle_dir(tmp), &bundle_file).unwrap();
    vec![
        (golden("template-state", FORMAT_VERSION), state::encode(&template_state(&image))),
        (golden("session-state", FORMAT_VERSION), state::encode(&session_state(&image))),
        (golden("layer", LAYER_VERSION), std::fs::read(&layer).unwrap()),
        (golden("template-bundle", BUNDLE_VERSION), std::fs::read(&bundle_file).unwrap()),
    ]
}

#[test]
fn current_formats_match_the_golden_files() {
    let tmp = tempfile::tempdir().unwrap();
    for (path, bytes) in current_files(tmp.path()) {
        let name = path.file_name().unwrap().to_string_lossy().into_owned();
        let Ok(golden) = std::fs::read(&path) else {
            panic!(
                "no golden file {name} for the current format version: write it with \
                 `cargo test --release -p forkbox-snapshot --test golden -- --ignored write_golden_files` and commit it"
            )
        };
        assert!(
            golden == bytes,
            "{name}: this code writes other bytes ({} bytes, golden {}) than the golden file of its own \
             format version. The format changed: bump the version (keeping a reader for the old one) and \
             write new golden files (see tests/golden.rs).",
            bytes.len(),
            golden.len()
        );
        // (A session's state holds two vCPU records since format 10: the agent's and a child's.)
        assert!(bytes.len() < 24 << 10, "{name} is {} bytes: golden files stay small", bytes.len());
    }
}

#[test]
fn golden_states_of_every_readable_version_decode() {
    let tmp = tempfile::tempdir().unwrap();
    let image = image(tmp.path());
    assert_eq!(READABLE_VERSIONS.last(), Some(&FORMAT_VERSION));
    for &v in READABLE_VERSIONS {
        for (kind, expect) in [("template-state", template_state(&image)), ("session-state", session_state(&image))] {
            let path = golden(kind, v);
            let bytes = std::fs::read(&path)
                .unwrap_or_else(|e| panic!("{}: {e} (a readable version needs its golden files)", path.display()));
            let snap = state::decode(&bytes).unwrap_or_else(|e| panic!("{kind} v{v} no longer decodes: {e}"));
            // What every version records.
            assert_eq!(snap.image_id, expect.image_id, "{kind} v{v}");
            assert_eq!(snap.memory, expect.memory, "{kind} v{v}");
            assert_eq!(snap.info, expect.info, "{kind} v{v}");
            assert_eq!(snap.vcpu.regs, expect.vcpu.regs, "{kind} v{v}");
            assert_eq!(snap.vcpu.xcrs.xcr0(), Some(0xe7), "{kind} v{v}");
            // The process state is a real one: it restores against its image,
            // with its children (their references to its descriptions count).
            let others: Vec<&forkbox_linux::fd::FdTable> =
                snap.children.processes.iter().map(|c| &c.process.fds).collect();
            let proc =
                Process::restore_state_sharing(image.clone(), snap.process.clone(), &layers(tmp.path()), &others)
                    .unwrap_or_else(|e| panic!("{kind} v{v}: the process state does not restore: {e}"));
            // The file system of every version reads in the current layout
            // (version 4's directory entries charged to the byte count), and is
            // exactly what the restored VFS saves again.
            assert_eq!(snap.process.vfs.version, forkbox_linux::vfs::VfsState::VERSION, "{kind} v{v}");
            assert!(proc.vfs.save_state() == snap.process.vfs, "{kind} v{v}: restore + save changed the VFS state");
            for c in &snap.children.processes {
                let child = Process::restore_child(&proc, c.process.clone())
                    .unwrap_or_else(|e| panic!("{kind} v{v}: a child does not restore: {e}"));
                assert!(child.save_child_state() == c.process, "{kind} v{v}: restore + save changed a child");
            }
            let files = snap.children.memory_files().unwrap();
            assert_eq!(files.len(), 2 * usize::from(kind == "session-state" && v >= 10), "{kind} v{v}");
            if let Some(t) = snap.children.table.clone() {
                let live: Vec<u32> = snap.children.processes.iter().map(|c| c.process.pid).collect();
                ProcTable::restore_state(t, &live).unwrap_or_else(|e| panic!("{kind} v{v}: process table: {e}"));
            }
            // Children are recorded from version 10 on; before, none.
            let children = usize::from(kind == "session-state" && v >= 10);
            assert_eq!(snap.children.processes.len(), children, "{kind} v{v}");
            if v == FORMAT_VERSION {
                assert!(snap == expect, "{kind} v{v} decodes to something else than it was written from");
                // Listeners are the sandbox's network state, not the process': it adds them.
                let mut without = snap.process.clone();
                without.listeners.clear();
                assert!(proc.save_state() == without, "{kind} v{v}: restore + save changed the process state");
            }
            // Listening sockets are recorded from version 9 on; before, none.
            let listeners = usize::from(kind == "session-state" && v >= 9);
            assert_eq!(snap.process.listeners.len(), listeners, "{kind} v{v}");
        }
    }
    // The session's file is there, with its bytes, after restore.
    let snap = state::decode(&std::fs::read(golden("session-state", FORMAT_VERSION)).unwrap()).unwrap();
    let others: Vec<&forkbox_linux::fd::FdTable> = snap.children.processes.iter().map(|c| &c.process.fds).collect();
    let proc =
        Process::restore_state_sharing(image.clone(), snap.process.clone(), &layers(tmp.path()), &others).unwrap();
    // Without its children, the agent's table does not add up (they hold references).
    assert!(Process::restore_state_with(image.clone(), snap.process.clone(), &layers(tmp.path())).is_err());
    let ino = proc.vfs.resolve(ROOT_INO, b"/tmp/out.txt", true).unwrap();
    assert_eq!(proc.vfs.file_bytes(ino).unwrap(), b"checkpointed bytes");
    let pkg = proc.vfs.resolve(ROOT_INO, b"/usr/local/lib/python3.11/dist-packages/goldpkg/__init__.py", true).unwrap();
    assert_eq!(proc.vfs.file_bytes(pkg).unwrap(), b"GOLD = 1\n", "the package layer's file, by reference");
    assert!(proc.vfs.resolve(ROOT_INO, b"/etc/hostname", true).is_err(), "the unlink is part of the state");
}

#[test]
fn golden_layers_of_every_readable_version_apply() {
    assert_eq!(READABLE_LAYER_VERSIONS.last(), Some(&LAYER_VERSION));
    let (base, mem, pages) = layer_inputs();
    for &v in READABLE_LAYER_VERSIONS {
        let layer = Layer::read(&golden("layer", v)).unwrap_or_else(|e| panic!("layer v{v} no longer reads: {e}"));
        assert_eq!(layer.pages, pages, "layer v{v}");
        let mut fresh = GuestMemory::anonymous(1 << 20).unwrap();
        fresh.write(0, &base).unwrap();
        assert_eq!(apply_layers(&mut fresh, &base, &[layer]).unwrap(), 3);
        assert_eq!(
            fresh.slice(0, 16 * 4096).unwrap(),
            mem.slice(0, 16 * 4096).unwrap(),
            "layer v{v} applies to other bytes"
        );
    }
}

/// A child's memory layer is read from its part of a process memory file,
/// checked against the record's offset, length and checksum.
#[test]
fn child_memory_layers_read_from_their_part_of_a_file() {
    let tmp = tempfile::tempdir().unwrap();
    let layer = child_layer();
    let path = tmp.path().join("c_0001.procs");
    let mut bytes = vec![0x5a; 4096];
    bytes.extend_from_slice(&layer);
    std::fs::write(&path, &bytes).unwrap();
    let f = std::fs::File::open(&path).unwrap();
    let at =
        MemoryRef { file: "c_0001.procs".into(), offset: 4096, len: layer.len() as u64, crc: crc32fast::hash(&layer) };
    let read = Layer::read_part(&f, &at, "c_0001.procs").unwrap();
    assert_eq!(read.pages, [1]);
    let (_, mem, _) = layer_inputs();
    let zeros = vec![0u8; 16 * 4096];
    let mut fresh = GuestMemory::anonymous(1 << 20).unwrap();
    assert_eq!(apply_layers(&mut fresh, &zeros, &[read]).unwrap(), 1);
    assert_eq!(fresh.slice(4096, 4096).unwrap(), mem.slice(4096, 4096).unwrap());
    // Another checksum, a part beyond the end, an offset that overflows, a part that is not a layer.
    for bad in [
        MemoryRef { crc: at.crc ^ 1, ..at.clone() },
        MemoryRef { offset: 4097, ..at.clone() },
        MemoryRef { offset: u64::MAX, ..at.clone() },
        MemoryRef { offset: 0, len: 64, crc: crc32fast::hash(&bytes[..64]), ..at.clone() },
    ] {
        assert!(Layer::read_part(&f, &bad, "c_0001.procs").is_err(), "{bad:?} was read");
    }
}

#[test]
fn golden_bundles_of_every_readable_version_unpack() {
    assert_eq!(READABLE_BUNDLE_VERSIONS.last(), Some(&BUNDLE_VERSION));
    let tmp = tempfile::tempdir().unwrap();
    let src = bundle_dir(tmp.path());
    for &v in READABLE_BUNDLE_VERSIONS {
        let out = tmp.path().join(format!("unpacked-v{v}"));
        std::fs::create_dir_all(&out).unwrap();
        let info = bundle::unpack(&golden("template-bundle", v), &out)
            .unwrap_or_else(|e| panic!("template bundle v{v} no longer unpacks: {e}"));
        assert_eq!((info.pages, info.runs, info.memory_size), (3, 2, 1 << 20), "bundle v{v}");
        for f in [bundle::STATE_FILE, bundle::MEMORY_FILE] {
            assert!(
                std::fs::read(out.join(f)).unwrap() == std::fs::read(src.join(f)).unwrap(),
                "bundle v{v}: {f} differs"
            );
        }
        // Sparse: the holes stay holes (the 1 MiB file has 3 pages of data).
        let used = std::os::unix::fs::MetadataExt::blocks(&std::fs::metadata(out.join(bundle::MEMORY_FILE)).unwrap());
        assert!(used * 512 <= 64 << 10, "bundle v{v}: the unpacked memory file uses {} bytes", used * 512);
    }
}

/// Every golden file in the directory is of a version this code reads (an
/// old one dropped from the readers must be deleted on purpose).
#[test]
fn no_golden_file_of_an_unreadable_version() {
    for e in std::fs::read_dir(golden_dir()).unwrap() {
        let name = e.unwrap().file_name().to_string_lossy().into_owned();
        let Some(stem) = name.strip_suffix(".bin") else { continue };
        let (kind, v) = stem.rsplit_once("-v").unwrap_or_else(|| panic!("golden file {name} is not KIND-vN.bin"));
        let v: u32 = v.parse().unwrap_or_else(|_| panic!("golden file {name}: bad version"));
        let readable = match kind {
            "layer" => READABLE_LAYER_VERSIONS,
            "template-bundle" => READABLE_BUNDLE_VERSIONS,
            _ => READABLE_VERSIONS,
        };
        assert!(readable.contains(&v), "golden file {name}: version {v} is not readable any more");
    }
}

/// Writes the current version's golden files that are missing (see the module docs).
#[test]
#[ignore]
fn write_golden_files() {
    let tmp = tempfile::tempdir().unwrap();
    std::fs::create_dir_all(golden_dir()).unwrap();
    for (path, bytes) in current_files(tmp.path()) {
        match std::fs::read(&path) {
            Ok(old) if old == bytes => eprintln!("{}: up to date", path.display()),
            Ok(_) => panic!(
                "{} exists with other bytes: the format changed without a version bump (or the synthetic \
                 state changed). Bump the version; do not overwrite a golden file.",
                path.display()
            ),
            Err(_) => {
                std::fs::write(&path, &bytes).unwrap();
                eprintln!("{}: written ({} bytes)", path.display(), bytes.len());
            }
        }
    }
}

/// Layers applied in place (over a fresh copy-on-write mapping of the base's
/// file, or over fresh zeroed memory) give what applying them by copy gives:
/// each page from the newest layer that has it, the other pages the base's.
#[test]
fn layers_applied_in_place_match_layers_applied_by_copy() {
    use forkbox_snapshot::layer::apply_layers_in_place;
    let tmp = tempfile::tempdir().unwrap();
    let (base, older, _) = layer_inputs();
    let mut newer = GuestMemory::anonymous(1 << 20).unwrap();
    newer.write(0, older.slice(0, 16 * 4096).unwrap()).unwrap();
    newer.write(3 * 4096 + 8, b"newer bytes").unwrap();
    newer.write(6 * 4096, &[0xff; 4096]).unwrap();
    let read = |name: &str, mem: &GuestMemory, base: &[u8], pages: &[u64]| {
        let path = tmp.path().join(name);
        write_layer(&path, mem, base, pages).unwrap();
        Layer::read(&path).unwrap()
    };
    let mut padded = base.clone();
    padded.resize(1 << 20, 0);
    let file = tmp.path().join("base.mem");
    std::fs::write(&file, &padded).unwrap();
    let file = std::fs::File::open(&file).unwrap();
    let zeros = vec![0u8; 1 << 20];
    for (base, fresh) in [
        (&padded[..], GuestMemory::private_file(&file, 1 << 20).unwrap()),
        (&zeros[..], GuestMemory::anonymous(1 << 20).unwrap()),
    ] {
        // Newest first: page 3 is in both, the newer one's wins.
        let layers = [read("b", &newer, base, &[3, 6]), read("a", &older, base, &[1, 3, 5])];
        let mut by_copy = GuestMemory::anonymous(1 << 20).unwrap();
        by_copy.write(0, base).unwrap();
        assert_eq!(apply_layers(&mut by_copy, base, &layers).unwrap(), 4);
        let mut in_place = fresh;
        in_place.track_writes();
        assert_eq!(apply_layers_in_place(&mut in_place, &layers).unwrap(), 4);
        assert_eq!(in_place.slice(0, 1 << 20).unwrap(), by_copy.slice(0, 1 << 20).unwrap());
        for p in [1u64, 3, 5, 6] {
            assert_eq!(in_place.slice(p * 4096, 4096).unwrap(), newer.slice(p * 4096, 4096).unwrap(), "page {p}");
        }
        assert_eq!(in_place.slice(2 * 4096, 4096).unwrap(), &base[2 * 4096..3 * 4096]);
        // Nothing it wrote counts as a change of the VMM's.
        assert!(in_place.take_vmm_dirty().iter().all(|w| *w == 0));
    }
}
