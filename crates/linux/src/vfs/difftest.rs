//! Differential test: the same random sequence of namespace operations on the VFS
//! (under /w) and on a real Linux directory (a host temp dir, via *at() calls on a
//! dirfd), comparing every result (value or errno) and the final trees.
//!
//! Generated paths and symlink targets never climb above `w` (no leading "..", no "."
//! or ".." targets), so both sides see the same tree.

// SAFETY (every unsafe block below): libc calls on the test's own dirfd, with
// NUL-terminated CStrings and stack buffers whose lengths are passed with them.
#![allow(clippy::undocumented_unsafe_blocks)]

use std::ffi::CString;

use super::*;
use crate::Errno;

struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        // xorshift64*
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }
    fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }
    fn pick<'a, T>(&mut self, xs: &'a [T]) -> &'a T {
        &xs[self.below(xs.len() as u64) as usize]
    }
}

const NAMES: &[&str] = &["a", "b", "c", "d"];

fn gen_path(rng: &mut Rng) -> String {
    let depth = 1 + rng.below(3);
    let mut comps: Vec<&str> = Vec::new();
    let (mut real, mut up) = (0, 0);
    for _ in 0..depth {
        let c = match rng.below(10) {
            0 => ".",
            1 if real > up => {
                up += 1;
                ".."
            }
            _ => {
                real += 1;
                rng.pick(NAMES)
            }
        };
        comps.push(c);
    }
    let mut p = comps.join("/");
    if rng.below(8) == 0 {
        p.push('/');
    }
    p
}

fn gen_target(rng: &mut Rng) -> String {
    let depth = 1 + rng.below(2);
    let mut comps: Vec<&str> = (0..depth).map(|_| *rng.pick(NAMES)).collect();
    if rng.below(6) == 0 {
        comps.insert(0, ".");
    }
    let mut t = comps.join("/");
    if rng.below(6) == 0 {
        t.push('/');
    }
    t
}

/// What one step did: a description and the host's and the VFS's results.
type Outcome = (String, Result<Vec<u8>, Errno>, Result<Vec<u8>, Errno>);

fn c(s: &str) -> CString {
    CString::new(s).unwrap()
}

fn host<T>(r: T, failed: bool) -> Result<T, Errno> {
    if failed {
        Err(Errno(std::io::Error::last_os_error().raw_os_error().unwrap_or(0)))
    } else {
        Ok(r)
    }
}

/// Comparable summary of a stat.
fn host_stat(dfd: i32, p: &str, follow: bool) -> Result<(u32, u64, u64), Errno> {
    let mut st: libc::stat = unsafe { std::mem::zeroed() };
    let flags = if follow { 0 } else { libc::AT_SYMLINK_NOFOLLOW };
    let r = unsafe { libc::fstatat(dfd, c(p).as_ptr(), &mut st, flags) };
    let kind = st.st_mode & libc::S_IFMT;
    let size = if kind == libc::S_IFDIR { 4096 } else { st.st_size as u64 };
    host((kind, size, st.st_nlink), r < 0)
}

fn vfs_stat(v: &Vfs, w: Ino, p: &str, follow: bool) -> Result<(u32, u64, u64), Errno> {
    let st = v.stat(v.resolve(w, p.as_bytes(), follow)?)?;
    Ok((st.kind.mode_bits(), st.size, st.nlink as u64))
}

fn host_tree(dir: &std::path::Path, out: &mut Vec<String>, prefix: &str) {
    let mut ents: Vec<_> = std::fs::read_dir(dir).unwrap().map(|e| e.unwrap()).collect();
    ents.sort_by_key(|e| e.file_name());
    for e in ents {
        let name = format!("{prefix}/{}", e.file_name().to_str().unwrap());
        let ft = e.file_type().unwrap();
        let path = e.path();
        if ft.is_symlink() {
            out.push(format!("{name} -> {}", std::fs::read_link(&path).unwrap().display()));
        } else if ft.is_dir() {
            out.push(format!("{name}/"));
            host_tree(&path, out, &name);
        } else {
            out.push(format!("{name} = {:?}", std::fs::read(&path).unwrap()));
        }
    }
}

fn vfs_tree(v: &Vfs, dir: Ino, out: &mut Vec<String>, prefix: &str) {
    for e in v.readdir(dir).unwrap().into_iter().skip(2) {
        let name = format!("{prefix}/{}", String::from_utf8(e.name).unwrap());
        match e.kind {
            FileType::Symlink => {
                out.push(format!("{name} -> {}", String::from_utf8(v.readlink_ino(e.ino).unwrap()).unwrap()))
            }
            FileType::Dir => {
                out.push(format!("{name}/"));
                vfs_tree(v, e.ino, out, &name);
            }
            _ => out.push(format!("{name} = {:?}", v.file_bytes(e.ino).unwrap())),
        }
    }
}

fn run(seed: u64, steps: usize) {
    let tmp = tempfile::tempdir().unwrap();
    let hw = tmp.path().join("w");
    std::fs::create_dir(&hw).unwrap();
    let dfd = unsafe { libc::open(c(hw.to_str().unwrap()).as_ptr(), libc::O_RDONLY | libc::O_DIRECTORY) };
    assert!(dfd >= 0);

    let dir = tempfile::tempdir().unwrap();
    std::fs::create_dir(dir.path().join("root")).unwrap();
    forkbox_image::pack_dir(&dir.path().join("root"), &dir.path().join("img")).unwrap();
    let image = Arc::new(forkbox_image::Image::open(&dir.path().join("img")).unwrap());
    let mut v = Vfs::new(image);
    v.mkdir(ROOT_INO, b"/w", 0o755).unwrap();
    let w = v.resolve(ROOT_INO, b"/w", true).unwrap();

    let open_flags = [
        libc::O_RDONLY,
        libc::O_WRONLY | libc::O_CREAT,
        libc::O_WRONLY | libc::O_CREAT | libc::O_EXCL,
        libc::O_RDWR | libc::O_TRUNC,
        libc::O_RDONLY | libc::O_DIRECTORY,
        libc::O_RDONLY | libc::O_NOFOLLOW,
        libc::O_WRONLY | libc::O_CREAT | libc::O_NOFOLLOW,
        libc::O_WRONLY,
        libc::O_RDONLY | libc::O_TRUNC,
        libc::O_CREAT | libc::O_DIRECTORY,
    ];
    let mut rng = Rng(seed | 1);
    for step in 0..steps {
        let p = gen_path(&mut rng);
        let q = gen_path(&mut rng);
        let cp = c(&p);
        let cq = c(&q);
        let (what, hr, vr): Outcome = match rng.below(13) {
            0 | 1 => {
                let fl = *rng.pick(&open_flags);
                let fd = unsafe { libc::openat(dfd, cp.as_ptr(), fl, 0o644) };
                let hr = host(fd, fd < 0).map(|fd| {
                    unsafe { libc::close(fd) };
                });
                let vr = v.open(w, p.as_bytes(), fl, 0o644).map(|ino| v.release(ino));
                (format!("open({p:?}, {fl:#o})"), hr.map(|_| vec![]), vr.map(|_| vec![]))
            }
            2 => {
                let off = rng.below(6);
                let data = [b'0' + (step % 10) as u8; 3];
                let fd = unsafe { libc::openat(dfd, cp.as_ptr(), libc::O_WRONLY) };
                let hr = host(fd, fd < 0).and_then(|fd| {
                    let n = unsafe { libc::pwrite(fd, data.as_ptr().cast(), 3, off as i64) };
                    unsafe { libc::close(fd) };
                    host(n as usize, n < 0)
                });
                let vr = v.open(w, p.as_bytes(), libc::O_WRONLY, 0).and_then(|ino| {
                    let r = v.write(ino, off, &data);
                    v.release(ino);
                    r
                });
                (format!("write({p:?}, {off})"), hr.map(|n| vec![n as u8]), vr.map(|n| vec![n as u8]))
            }
            3 => {
                let r = unsafe { libc::mkdirat(dfd, cp.as_ptr(), 0o755) };
                (format!("mkdir({p:?})"), host(vec![], r < 0), v.mkdir(w, p.as_bytes(), 0o755).map(|_| vec![]))
            }
            4 => {
                let r = unsafe { libc::unlinkat(dfd, cp.as_ptr(), libc::AT_REMOVEDIR) };
                (format!("rmdir({p:?})"), host(vec![], r < 0), v.rmdir(w, p.as_bytes()).map(|_| vec![]))
            }
            5 => {
                let r = unsafe { libc::unlinkat(dfd, cp.as_ptr(), 0) };
                (format!("unlink({p:?})"), host(vec![], r < 0), v.unlink(w, p.as_bytes()).map(|_| vec![]))
            }
            6 | 7 => {
                let fl = *rng.pick(&[0u32, 0, RENAME_NOREPLACE, RENAME_EXCHANGE]);
                let r = unsafe { libc::syscall(libc::SYS_renameat2, dfd, cp.as_ptr(), dfd, cq.as_ptr(), fl) };
                let vr = v.rename(w, p.as_bytes(), w, q.as_bytes(), fl);
                (format!("rename({p:?}, {q:?}, {fl})"), host(vec![], r < 0), vr.map(|_| vec![]))
            }
            8 => {
                let t = gen_target(&mut rng);
                let r = unsafe { libc::symlinkat(c(&t).as_ptr(), dfd, cp.as_ptr()) };
                (
                    format!("symlink({t:?}, {p:?})"),
                    host(vec![], r < 0),
                    v.symlink(t.as_bytes(), w, p.as_bytes()).map(|_| vec![]),
                )
            }
            9 => {
                let mut buf = [0u8; 256];
                let n = unsafe { libc::readlinkat(dfd, cp.as_ptr(), buf.as_mut_ptr().cast(), buf.len()) };
                let hr = host(n, n < 0).map(|n| buf[..n as usize].to_vec());
                (format!("readlink({p:?})"), hr, v.readlink(w, p.as_bytes()))
            }
            10 => {
                let follow = rng.below(2) == 0;
                let hr = host_stat(dfd, &p, follow).map(|s| format!("{s:?}").into_bytes());
                let vr = vfs_stat(&v, w, &p, follow).map(|s| format!("{s:?}").into_bytes());
                (format!("stat({p:?}, {follow})"), hr, vr)
            }
            11 => {
                let len = rng.below(8);
                let fd = unsafe { libc::openat(dfd, cp.as_ptr(), libc::O_WRONLY) };
                let hr = host(fd, fd < 0).and_then(|fd| {
                    let r = unsafe { libc::ftruncate(fd, len as i64) };
                    unsafe { libc::close(fd) };
                    host(vec![], r < 0)
                });
                let vr = v.open(w, p.as_bytes(), libc::O_WRONLY, 0).and_then(|ino| {
                    let r = v.truncate(ino, len);
                    v.release(ino);
                    r.map(|_| vec![])
                });
                (format!("truncate({p:?}, {len})"), hr, vr)
            }
            _ => {
                let r = unsafe { libc::linkat(dfd, cp.as_ptr(), dfd, cq.as_ptr(), 0) };
                (
                    format!("link({p:?}, {q:?})"),
                    host(vec![], r < 0),
                    v.link(w, p.as_bytes(), w, q.as_bytes(), false).map(|_| vec![]),
                )
            }
        };
        assert_eq!(hr, vr, "seed {seed} step {step}: {what}");
        if step % 50 == 49 || step == steps - 1 {
            let (mut ht, mut vt) = (Vec::new(), Vec::new());
            host_tree(&hw, &mut ht, "");
            vfs_tree(&v, w, &mut vt, "");
            assert_eq!(ht, vt, "seed {seed} step {step}: trees differ");
            assert_eq!(v.overlay_bytes(), v.recount());
            // Carry on with a VFS restored from a snapshot of this one.
            let state: VfsState = postcard::from_bytes(&postcard::to_stdvec(&v.save_state()).unwrap()).unwrap();
            v = Vfs::restore_state(v.image().clone(), state).unwrap();
        }
    }
    unsafe { libc::close(dfd) };
}

#[test]
fn matches_linux() {
    // FORKBOX_VFS_DIFF_SEEDS=n runs more sequences.
    let seeds = std::env::var("FORKBOX_VFS_DIFF_SEEDS").ok().and_then(|s| s.parse().ok()).unwrap_or(40u64);
    for seed in 1..=seeds {
        run(seed.wrapping_mul(0x9e37_79b9_7f4a_7c15), 400);
    }
}
