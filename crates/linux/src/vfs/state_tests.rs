//! Tests of `Vfs::save_state` / `Vfs::restore_state`.

use std::collections::{HashMap, HashSet};
use std::fs;
use std::sync::Arc;

use forkbox_image::{pack_dir, Image};

use super::tests::{check_accounting, create, fixture, make_tree, r, read_all, Fixture};
use super::*;
use crate::Errno;

const RDONLY: i32 = libc::O_RDONLY;
const RDWR: i32 = libc::O_RDWR;

fn open(v: &mut Vfs, path: &str, flags: i32) -> Ino {
    v.open(ROOT_INO, path.as_bytes(), flags, 0o644).unwrap()
}

/// A VFS exercising every kind of overlay state. Returns it and the inodes it holds
/// (open references).
fn build(f: &Fixture) -> (Vfs, Vec<Ino>) {
    let mut v = Vfs::new(f.image.clone());
    let root = ROOT_INO;
    // New files and directories.
    create(&mut v, "/tmp/new.txt", b"hello, state\n");
    v.mkdir(root, b"/tmp/a", 0o755).unwrap();
    v.mkdir(root, b"/tmp/a/b", 0o700).unwrap();
    create(&mut v, "/tmp/a/b/deep.bin", &[7u8; 5000]);
    create(&mut v, "/tmp/empty", b"");
    // Copy-up with data: write into an image file.
    let host = r(&v, "/etc/hostname").unwrap();
    v.write(host, 0, b"FORK").unwrap();
    // Metadata-only copy-ups: chmod, times.
    let py = r(&v, "/usr/bin/python3").unwrap();
    v.chmod(py, 0o700).unwrap();
    let osr = r(&v, "/etc/os-release").unwrap();
    v.set_mtime(osr, 1_234_567, 890).unwrap();
    // Deletions of image entries: a file, a symlink, an empty directory.
    v.unlink(root, b"/usr/lib/x86_64-linux-gnu/libfoo.so").unwrap();
    v.unlink(root, b"/dangling").unwrap();
    v.rmdir(root, b"/emptydir").unwrap();
    // Renames of image directories: within a directory and across directories.
    v.rename(root, b"/usr/lib/python3.11", root, b"/usr/lib/py", 0).unwrap();
    v.rename(root, b"/usr/share/doc", root, b"/tmp/a/doc", 0).unwrap();
    // A renamed image file and an exchange.
    v.rename(root, b"/usr/lib/py/json/__init__.py", root, b"/tmp/json_init.py", 0).unwrap();
    v.rename(root, b"/tmp/new.txt", root, b"/tmp/empty", RENAME_EXCHANGE).unwrap();
    // Symlinks: new, and over an image name.
    v.symlink(b"../usr/lib/py/os.py", root, b"/tmp/os_link").unwrap();
    v.symlink(b"/etc/hostname", root, b"/tmp/a/abs_link").unwrap();
    // Hard links: of an image file (metadata copy-up) and of a new file.
    v.link(root, b"/usr/lib/py/os.py", root, b"/tmp/os_hard", false).unwrap();
    v.link(root, b"/tmp/a/b/deep.bin", root, b"/tmp/deep2", false).unwrap();
    // chmod of a new directory.
    let a = r(&v, "/tmp/a").unwrap();
    v.chmod(a, 0o750).unwrap();
    // Unlinked but held: an image file, a new file, a removed directory.
    let big = open(&mut v, "/data/big.bin", RDONLY);
    v.unlink(root, b"/data/big.bin").unwrap();
    let tmpf = open(&mut v, "/tmp/scratch", RDWR | libc::O_CREAT);
    v.write(tmpf, 0, b"scratch data").unwrap();
    v.unlink(root, b"/tmp/scratch").unwrap();
    v.mkdir(root, b"/tmp/cwd", 0o755).unwrap();
    let cwd = r(&v, "/tmp/cwd").unwrap();
    v.hold(cwd);
    v.rmdir(root, b"/tmp/cwd").unwrap();
    // Held and still linked, twice.
    let host_ref = open(&mut v, "/etc/hostname", RDONLY);
    v.hold(host_ref);
    v.set_quota(50_000_000);
    check_accounting(&v);
    (v, vec![big, tmpf, cwd, host_ref])
}

fn fnv(b: &[u8]) -> u64 {
    b.iter().fold(0xcbf2_9ce4_8422_2325u64, |h, &x| (h ^ u64::from(x)).wrapping_mul(0x100_0000_01b3))
}

/// Everything observable through the API, as text (never panics).
fn observe(v: &Vfs, held: &[Ino]) -> Vec<String> {
    let mut out = Vec::new();
    let mut seen = HashSet::new();
    observe_dir(v, ROOT_INO, "/", &mut out, &mut seen);
    for &ino in held {
        out.push(format!("held {ino}: {:?} {:?}", v.stat(ino), v.file_bytes(ino).map(fnv)));
    }
    out.push(format!("bytes {} quota {}", v.overlay_bytes(), v.quota()));
    out
}

fn observe_dir(v: &Vfs, dir: Ino, path: &str, out: &mut Vec<String>, seen: &mut HashSet<Ino>) {
    if !seen.insert(dir) || seen.len() > 10_000 {
        out.push(format!("{path}: seen before"));
        return;
    }
    out.push(format!(
        "{path}: {:?} {:?}",
        v.stat(dir),
        v.dir_path(dir).map(|p| String::from_utf8_lossy(&p).into_owned())
    ));
    let entries = match v.readdir(dir) {
        Ok(e) => e,
        Err(e) => return out.push(format!("{path}: readdir {e:?}")),
    };
    for e in entries {
        let name = String::from_utf8_lossy(&e.name).into_owned();
        let stat = v.stat(e.ino);
        out.push(format!("{path}{name}: {} {:?} {stat:?}", e.ino, e.kind));
        if name == "." || name == ".." {
            continue;
        }
        match e.kind {
            FileType::File => {
                out.push(format!("  bytes {:?}", v.file_bytes(e.ino).map(|b| (b.len(), fnv(b)))));
                let mut buf = [0u8; 16];
                out.push(format!("  read {:?} {buf:?}", v.read(e.ino, 0, &mut buf)));
            }
            FileType::Symlink => out.push(format!("  -> {:?}", v.readlink_ino(e.ino))),
            FileType::Dir => observe_dir(v, e.ino, &format!("{path}{name}/"), out, seen),
            FileType::CharDev | FileType::Fifo | FileType::Socket => {}
        }
    }
}

fn to_bytes(s: &VfsState) -> Vec<u8> {
    postcard::to_stdvec(s).unwrap()
}

fn roundtrip(image: &Arc<Image>, v: &Vfs) -> Vfs {
    let bytes = to_bytes(&v.save_state());
    let state: VfsState = postcard::from_bytes(&bytes).unwrap();
    Vfs::restore_state(image.clone(), state).unwrap()
}

#[test]
fn state_roundtrip_preserves_everything() {
    let f = fixture();
    let (mut v, held) = build(&f);
    let mut w = roundtrip(&f.image, &v);
    let before = observe(&v, &held);
    assert!(before.len() > 100);
    assert_eq!(before, observe(&w, &held));
    // Spot checks of what `observe` covers.
    assert_eq!(read_all(&w, r(&w, "/etc/hostname").unwrap()), b"FORKbox\n");
    assert_eq!(read_all(&w, r(&w, "/tmp/empty").unwrap()), b"hello, state\n");
    assert_eq!(r(&w, "/usr/lib/python3.11"), Err(Errno::ENOENT));
    assert_eq!(r(&w, "/emptydir"), Err(Errno::ENOENT));
    assert_eq!(w.readlink(ROOT_INO, b"/tmp/os_link").unwrap(), b"../usr/lib/py/os.py");
    assert_eq!(read_all(&w, r(&w, "/tmp/os_link").unwrap()), b"import sys\n# the os module\n");
    assert_eq!(w.stat(r(&w, "/tmp/deep2").unwrap()).unwrap().nlink, 2);
    assert_eq!(w.stat(r(&w, "/usr/bin/python3").unwrap()).unwrap().perm, 0o700);
    assert_eq!(w.dir_path(r(&w, "/tmp/a/doc").unwrap()).unwrap(), b"/tmp/a/doc");
    assert_eq!(w.resolve(r(&w, "/tmp/a/doc").unwrap(), b"..", true).unwrap(), r(&w, "/tmp/a").unwrap());
    let [big, tmpf, cwd, host] = held[..] else { panic!() };
    assert_eq!(read_all(&w, big).len(), 10_000);
    assert_eq!(read_all(&w, tmpf), b"scratch data");
    assert_eq!(w.dir_path(cwd), Err(Errno::ENOENT));
    assert_eq!(w.quota(), 50_000_000);
    check_consistent(&v);
    check_consistent(&w);

    // Both behave the same from here: releasing frees the unlinked inodes, new inodes
    // get the same numbers, writes are charged the same.
    for x in [&mut v, &mut w] {
        for &ino in &held {
            x.release(ino);
        }
        check_accounting(x);
    }
    assert_eq!(v.stat(big), Err(Errno::ENOENT));
    assert_eq!(w.stat(big), Err(Errno::ENOENT));
    assert_eq!(w.stat(tmpf), Err(Errno::ENOENT));
    assert_eq!(w.stat(cwd), Err(Errno::ENOENT));
    assert!(w.stat(host).is_ok(), "still held once and linked");
    assert_eq!(v.overlay_bytes(), w.overlay_bytes());
    let n1 = create(&mut v, "/tmp/after", b"x");
    let n2 = create(&mut w, "/tmp/after", b"x");
    assert_eq!(n1, n2);
    for x in [&mut v, &mut w] {
        x.unlink(ROOT_INO, b"/tmp/a/b/deep.bin").unwrap();
        x.write(r(x, "/tmp/deep2").unwrap(), 4990, b"0123456789abcdef").unwrap();
        x.rename(ROOT_INO, b"/tmp/a", ROOT_INO, b"/usr/moved", 0).unwrap();
        check_accounting(x);
    }
    assert_eq!(v.overlay_bytes(), w.overlay_bytes());
    assert_eq!(
        observe(&v, &held).into_iter().filter(|l| !l.contains("mtime")).collect::<Vec<_>>(),
        observe(&w, &held).into_iter().filter(|l| !l.contains("mtime")).collect::<Vec<_>>()
    );
}

#[test]
fn state_bytes_are_deterministic() {
    let f = fixture();
    let (v, _) = build(&f);
    let s1 = v.save_state();
    let b1 = to_bytes(&s1);
    assert_eq!(b1, to_bytes(&v.save_state()), "save twice");
    assert_eq!(b1, to_bytes(&v.clone().save_state()), "save of a clone");
    // Restore builds its maps in another order (and with other hash keys).
    let w = roundtrip(&f.image, &v);
    assert_eq!(b1, to_bytes(&w.save_state()), "save -> restore -> save");
    let w2 = roundtrip(&f.image, &w);
    assert_eq!(b1, to_bytes(&w2.save_state()));
    assert_eq!(s1, w2.save_state());
    // Sorted as documented.
    assert!(s1.nodes.windows(2).all(|p| p[0].ino < p[1].ino));
    assert!(s1.refs.windows(2).all(|p| p[0].0 < p[1].0));
}

#[test]
fn state_shares_file_bytes_and_encodes_them_raw() {
    let f = fixture();
    let mut v = Vfs::new(f.image.clone());
    let data: Vec<u8> = (0..1_000_000u32).map(|i| (i * 7 % 256) as u8).collect();
    let ino = create(&mut v, "/tmp/big", &data);
    let small = to_bytes(&Vfs::new(f.image.clone()).save_state()).len();
    let state = v.save_state();
    // Saving copied nothing: the state holds the Vfs's own buffer.
    let saved = state.nodes.iter().find(|n| n.ino == ino).unwrap();
    let BodyState::File(FileState::Owned(bytes)) = &saved.body else { panic!("{saved:?}") };
    let Some(Node { body: Body::File(FileData::Owned(live)), .. }) = v.nodes.get(&ino) else { panic!() };
    assert!(Arc::ptr_eq(&bytes.0, live));
    // Encoded as length + raw bytes: overhead of a few bytes over the data itself.
    let enc = to_bytes(&state);
    assert!(enc.len() <= small + data.len() + 64, "{} vs {}", enc.len(), small + data.len());
    assert!(enc.windows(4096).any(|w| w == &data[..4096]));
    // Same wire format as a plain Vec<u8> (postcard writes a u8 sequence the same way).
    assert_eq!(
        postcard::to_stdvec(&FileBytes(Arc::new(vec![1, 2, 3]))).unwrap(),
        postcard::to_stdvec(&vec![1u8, 2, 3]).unwrap()
    );
    let back: VfsState = postcard::from_bytes(&enc).unwrap();
    assert_eq!(back, state);
    drop(state);
    let w = Vfs::restore_state(f.image.clone(), back).unwrap();
    assert_eq!(w.file_bytes(ino).unwrap(), &data[..]);
    // The restored buffer is not shared: writing does not copy the file.
    let mut w = w;
    let before = w.overlay_bytes();
    w.write(ino, 10, b"x").unwrap();
    assert_eq!(w.overlay_bytes(), before);
    check_accounting(&w);
}

#[test]
fn state_for_another_image_is_refused() {
    let f = fixture();
    let (v, _) = build(&f);
    // Another image: the same tree plus one file.
    let dir = tempfile::tempdir().unwrap();
    let root = dir.path().join("root");
    fs::create_dir(&root).unwrap();
    make_tree(&root);
    fs::write(root.join("extra"), b"x").unwrap();
    let out = dir.path().join("img");
    pack_dir(&root, &out).unwrap();
    let other = Arc::new(Image::open(&out).unwrap());
    assert_ne!(other.id(), f.image.id());
    let err = Vfs::restore_state(other.clone(), v.save_state()).err().unwrap();
    assert!(matches!(err, VfsStateError::WrongImage { .. }), "{err}");
    assert!(err.to_string().contains(f.image.id()), "{err}");
    // Even with the id forged, the state does not fit that image... or if it happens
    // to, it is a consistent VFS: no panic either way.
    let mut s = v.save_state();
    s.image_id = other.id().to_owned();
    if let Ok(w) = Vfs::restore_state(other, s) {
        observe(&w, &[]);
    }
    let mut s = v.save_state();
    s.version = 99;
    assert!(matches!(Vfs::restore_state(f.image.clone(), s), Err(VfsStateError::Version(99))));
}

/// `restore_state` of `v`'s state after `edit` must fail with a message containing `msg`.
fn expect_inconsistent(f: &Fixture, v: &Vfs, msg: &str, edit: impl FnOnce(&mut VfsState)) {
    let mut s = v.save_state();
    edit(&mut s);
    match Vfs::restore_state(f.image.clone(), s) {
        Err(e @ VfsStateError::Inconsistent(_)) => {
            assert!(e.to_string().contains(msg), "expected {msg:?}, got: {e}")
        }
        Err(e) => panic!("expected {msg:?}, got: {e}"),
        Ok(_) => panic!("expected {msg:?}, got a Vfs"),
    }
}

fn node_mut(s: &mut VfsState, ino: Ino) -> &mut NodeState {
    s.nodes.iter_mut().find(|n| n.ino == ino).unwrap()
}

fn entries_mut(s: &mut VfsState, dir: Ino) -> &mut Vec<(Vec<u8>, Ino)> {
    match &mut node_mut(s, dir).body {
        BodyState::Dir { entries, .. } => entries,
        b => panic!("{b:?}"),
    }
}

fn parent_mut(s: &mut VfsState, dir: Ino) -> &mut Ino {
    match &mut node_mut(s, dir).body {
        BodyState::Dir { parent, .. } => parent,
        b => panic!("{b:?}"),
    }
}

#[test]
fn corrupt_states_are_refused() {
    let f = fixture();
    let (v, held) = build(&f);
    let ino = |p: &str| r(&v, p).unwrap();
    let (tmp, a, b, new_txt) = (ino("/tmp"), ino("/tmp/a"), ino("/tmp/a/b"), ino("/tmp/empty"));
    let libdir = ino("/usr/lib/x86_64-linux-gnu");
    let next = v.save_state().next_ino;
    Vfs::restore_state(f.image.clone(), v.save_state()).unwrap();

    // Dangling entries: to a never-allocated inode, to a dropped one, to a deleted
    // image inode.
    expect_inconsistent(&f, &v, "does not exist", |s| entries_mut(s, tmp).push((b"zz".to_vec(), next + 5)));
    expect_inconsistent(&f, &v, "does not exist", |s| entries_mut(s, tmp).push((b"zz".to_vec(), 1_000_000)));
    let removed_lib = image_ino(&f.image, "usr/lib/x86_64-linux-gnu/libfoo.so");
    assert!(matches!(v.save_state().nodes.iter().find(|n| n.ino == removed_lib).unwrap().body, BodyState::Gone));
    expect_inconsistent(&f, &v, "does not exist", |s| entries_mut(s, tmp).push((b"zz".to_vec(), removed_lib)));
    // A node removed from the state while still named.
    expect_inconsistent(&f, &v, "does not exist", |s| s.nodes.retain(|n| n.ino != b));
    // Parents: a file, a missing inode, a directory that does not hold the name.
    expect_inconsistent(&f, &v, "not a directory", |s| *parent_mut(s, b) = new_txt);
    expect_inconsistent(&f, &v, "does not exist", |s| *parent_mut(s, b) = next + 1);
    expect_inconsistent(&f, &v, "its name is in", |s| *parent_mut(s, b) = tmp);
    expect_inconsistent(&f, &v, "root", |s| *parent_mut(s, ROOT_INO) = tmp);
    // Link counts.
    expect_inconsistent(&f, &v, "link count", |s| node_mut(s, new_txt).nlink += 1);
    expect_inconsistent(&f, &v, "link count", |s| entries_mut(s, a).push((b"zz_again".to_vec(), new_txt)));
    expect_inconsistent(&f, &v, "more than one name", |s| entries_mut(s, tmp).push((b"zz_a2".to_vec(), a)));
    expect_inconsistent(&f, &v, "entry for the root", |s| entries_mut(s, b).push((b"up".to_vec(), ROOT_INO)));
    // An image entry vanished from a copied-up directory without a node saying why.
    let libfoo = image_ino(&f.image, "usr/lib/x86_64-linux-gnu/libfoo.so.1");
    assert!(v.save_state().nodes.iter().all(|n| n.ino != libfoo));
    expect_inconsistent(&f, &v, "no name left", |s| entries_mut(s, libdir).retain(|e| e.1 != libfoo));
    // An image directory moved without its ".." following.
    let py = image_ino(&f.image, "usr/lib/python3.11");
    assert!(v.save_state().nodes.iter().all(|n| n.ino != py));
    expect_inconsistent(&f, &v, "named in", |s| {
        entries_mut(s, ino("/usr/lib")).retain(|e| e.1 != py);
        entries_mut(s, tmp).push((b"zz_py".to_vec(), py));
    });
    // Counters: bytes, next inode, references.
    expect_inconsistent(&f, &v, "overlay bytes", |s| s.overlay_bytes += 1);
    expect_inconsistent(&f, &v, "neither an image inode nor an allocated", |s| s.next_ino = b);
    expect_inconsistent(&f, &v, "below", |s| s.next_ino = 5);
    expect_inconsistent(&f, &v, "neither names nor references", |s| s.refs.retain(|&(i, _)| i != held[1]));
    expect_inconsistent(&f, &v, "does not exist", |s| {
        s.refs.push((next + 10, 1));
    });
    expect_inconsistent(&f, &v, "does not exist", |s| {
        s.refs.insert(0, (removed_lib, 1));
        s.refs.sort();
    });
    expect_inconsistent(&f, &v, "zero reference", |s| s.refs[0].1 = 0);
    // Order and duplicates.
    expect_inconsistent(&f, &v, "strictly sorted", |s| s.nodes.swap(0, 1));
    expect_inconsistent(&f, &v, "strictly sorted", |s| {
        let n = s.nodes[2].clone();
        s.nodes.insert(2, n);
    });
    expect_inconsistent(&f, &v, "strictly sorted", |s| entries_mut(s, tmp).reverse());
    expect_inconsistent(&f, &v, "strictly sorted", |s| {
        let r0 = s.refs[0];
        s.refs.insert(0, r0);
    });
    // Names.
    expect_inconsistent(&f, &v, "invalid entry name", |s| entries_mut(s, a).push((b"x/y".to_vec(), new_txt)));
    expect_inconsistent(&f, &v, "invalid entry name", |s| entries_mut(s, a).insert(0, (b"..".to_vec(), new_txt)));
    expect_inconsistent(&f, &v, "invalid entry name", |s| entries_mut(s, a).insert(0, (Vec::new(), new_txt)));
    // Kinds against the image, permission bits, deleted-inode markers.
    let py = ino("/usr/bin/python3");
    expect_inconsistent(&f, &v, "over an image", |s| node_mut(s, py).body = BodyState::Symlink(b"x".to_vec()));
    expect_inconsistent(&f, &v, "image file contents", |s| {
        node_mut(s, new_txt).body = BodyState::File(FileState::Image)
    });
    expect_inconsistent(&f, &v, "permission bits", |s| node_mut(s, py).perm = 0o100755);
    expect_inconsistent(&f, &v, "only image inodes", |s| {
        let n = node_mut(s, new_txt);
        n.body = BodyState::Gone;
        n.nlink = 0;
    });
    expect_inconsistent(&f, &v, "neither an image inode", |s| {
        let mut n = s.nodes.last().unwrap().clone();
        n.ino = FIRST_OVERLAY_INO - 1;
        s.nodes.insert(s.nodes.partition_point(|x| x.ino < n.ino), n);
    });
    // A removed directory with entries; a directory with link count 2.
    let cwd = held[2];
    expect_inconsistent(&f, &v, "still has entries", |s| entries_mut(s, cwd).push((b"x".to_vec(), new_txt)));
    expect_inconsistent(&f, &v, "link count 2", |s| node_mut(s, a).nlink = 2);
    // A detached cycle: /tmp/a moved under its own child b.
    expect_inconsistent(&f, &v, "not reachable from the root", |s| {
        entries_mut(s, tmp).retain(|e| e.1 != a);
        entries_mut(s, b).push((b"loop".to_vec(), a));
        entries_mut(s, b).sort();
        *parent_mut(s, a) = b;
    });
    // A directory that is its own parent.
    expect_inconsistent(&f, &v, "reachable", |s| {
        entries_mut(s, a).retain(|e| e.1 != b);
        entries_mut(s, b).push((b"me".to_vec(), b));
        *parent_mut(s, b) = b;
    });
}

fn image_ino(img: &Image, path: &str) -> Ino {
    let mut cur = Image::ROOT;
    for c in path.split('/').filter(|c| !c.is_empty()) {
        cur = img.lookup(cur, c.as_bytes()).unwrap();
    }
    Ino::from(cur)
}

#[test]
fn exhausted_inode_numbers_give_enospc() {
    let f = fixture();
    let v = Vfs::new(f.image.clone());
    let mut s = v.save_state();
    s.next_ino = u64::MAX;
    let mut w = Vfs::restore_state(f.image.clone(), s).unwrap();
    assert_eq!(w.mkdir(ROOT_INO, b"/tmp/x", 0o755), Err(Errno::ENOSPC));
    check_accounting(&w);
}

struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }
    fn below(&mut self, n: usize) -> usize {
        (self.next() % n as u64) as usize
    }
}

/// The tree as seen through the API agrees with the link counts: every name found by
/// walking from the root is counted, every live overlay node is found (or unlinked and
/// held), every directory has one name, ".." is where it was found, and `dir_path`
/// leads back to it.
fn check_consistent(v: &Vfs) {
    let mut names: HashMap<Ino, u32> = HashMap::new();
    let mut stack = vec![(ROOT_INO, ROOT_INO)];
    while let Some((dir, from)) = stack.pop() {
        let entries = v.readdir(dir).unwrap();
        assert_eq!(entries[0].ino, dir);
        assert_eq!(entries[1].ino, from, "'..' of {dir}");
        let path = v.dir_path(dir).unwrap();
        assert_eq!(v.resolve(ROOT_INO, &path, false).unwrap(), dir);
        for e in &entries[2..] {
            *names.entry(e.ino).or_insert(0) += 1;
            assert_eq!(v.stat(e.ino).unwrap().kind, e.kind);
            if e.kind == FileType::Dir {
                assert_eq!(names[&e.ino], 1, "directory {} named twice", e.ino);
                stack.push((e.ino, dir));
            }
        }
    }
    for (&ino, &n) in &names {
        let st = v.stat(ino).unwrap();
        if st.kind != FileType::Dir {
            assert_eq!(st.nlink, n, "names of {ino}");
        }
    }
    for (&ino, node) in v.nodes.iter() {
        if node.kind().is_none() {
            assert_eq!(v.stat(ino), Err(Errno::ENOENT));
        } else if node.nlink == 0 {
            assert!(v.refs.contains_key(&ino));
            assert!(!names.contains_key(&ino));
        } else {
            assert!(ino == ROOT_INO || names.contains_key(&ino), "{ino} not reachable");
        }
    }
    check_accounting(v);
}

/// Use a restored VFS every way we can; it must never panic.
fn exercise(v: &mut Vfs) {
    observe(v, &[]);
    check_consistent(v);
    let refs: Vec<(Ino, u32)> = v.save_state().refs;
    check_accounting(v);
    let _ = v.mkdir(ROOT_INO, b"/tmp/fz", 0o755);
    if let Ok(ino) = v.open(ROOT_INO, b"/tmp/fz/f", libc::O_CREAT | RDWR, 0o644) {
        let _ = v.write(ino, 3, b"abc");
        v.release(ino);
    }
    let _ = v.rename(ROOT_INO, b"/tmp/a", ROOT_INO, b"/tmp/fz/a", 0);
    let _ = v.rename(ROOT_INO, b"/usr", ROOT_INO, b"/tmp/usr2", 0);
    let _ = v.unlink(ROOT_INO, b"/tmp/empty");
    let _ = v.rmdir(ROOT_INO, b"/tmp/a/b");
    for (ino, count) in refs {
        let _ = v.write(ino, 0, b"zz");
        let _ = v.truncate(ino, 1);
        let _ = v.dir_path(ino);
        for _ in 0..count.min(4) {
            v.release(ino);
        }
    }
    check_consistent(v);
    observe(v, &[]);
    let again = v.save_state();
    Vfs::restore_state(v.image().clone(), again).unwrap();
}

#[test]
fn state_fuzz_never_panics() {
    let f = fixture();
    // A small state (short files), so that flips land in the structure.
    let mut v = Vfs::new(f.image.clone());
    create(&mut v, "/tmp/new.txt", b"hi");
    v.mkdir(ROOT_INO, b"/tmp/a", 0o755).unwrap();
    v.mkdir(ROOT_INO, b"/tmp/a/b", 0o755).unwrap();
    create(&mut v, "/tmp/a/b/f", b"f");
    v.link(ROOT_INO, b"/tmp/a/b/f", ROOT_INO, b"/tmp/f2", false).unwrap();
    v.symlink(b"a/b", ROOT_INO, b"/tmp/l").unwrap();
    let host = r(&v, "/etc/hostname").unwrap();
    v.chmod(host, 0o600).unwrap();
    v.unlink(ROOT_INO, b"/etc/os-release").unwrap();
    v.rename(ROOT_INO, b"/usr/lib/python3.11", ROOT_INO, b"/tmp/a/py", 0).unwrap();
    v.rmdir(ROOT_INO, b"/emptydir").unwrap();
    let held = v.open(ROOT_INO, b"/tmp/new.txt", RDONLY, 0).unwrap();
    v.unlink(ROOT_INO, b"/tmp/new.txt").unwrap();
    let _ = held;
    let good = to_bytes(&v.save_state());
    let mut rng = Rng(0x9e37_79b9_7f4a_7c15);
    let (mut decode_err, mut invalid, mut ok) = (0, 0, 0);
    for i in 0..3000 {
        let mut bytes = good.clone();
        match i % 8 {
            // Truncation.
            0 => bytes.truncate(rng.below(bytes.len())),
            // Small increments (off-by-one counters, inode numbers).
            1 | 2 => {
                let at = rng.below(bytes.len());
                bytes[at] = bytes[at].wrapping_add(if rng.next() & 1 == 0 { 1 } else { 255 });
            }
            // Random bit flips.
            _ => {
                for _ in 0..1 + rng.below(3) {
                    let at = rng.below(bytes.len());
                    bytes[at] ^= 1 << rng.below(8);
                }
            }
        }
        let Ok(state) = postcard::from_bytes::<VfsState>(&bytes) else {
            decode_err += 1;
            continue;
        };
        match Vfs::restore_state(f.image.clone(), state) {
            Err(_) => invalid += 1,
            Ok(mut w) => {
                ok += 1;
                exercise(&mut w);
            }
        }
    }
    // All three outcomes happen.
    assert!(decode_err > 0 && invalid > 100 && ok > 100, "{decode_err} {invalid} {ok}");
}

/// Semantic mutations of a valid state (retargeted entries, moved names, parents, link
/// counts, references, dropped nodes): each is refused, or gives a consistent VFS.
#[test]
fn state_structured_fuzz() {
    let f = fixture();
    let (v, _) = build(&f);
    let base = v.save_state();
    let mut rng = Rng(0x2545_f491_4f6c_dd1d);
    // Inode numbers worth trying: every node, image inodes, edges of the ranges.
    let mut pool: Vec<Ino> = base.nodes.iter().map(|n| n.ino).collect();
    pool.extend(0..u64::from(f.image.inode_count()) + 1);
    pool.extend([FIRST_OVERLAY_INO - 1, base.next_ino - 1, base.next_ino, base.next_ino + 1, u64::MAX]);
    let (mut refused, mut accepted) = (0, 0);
    for _ in 0..4000 {
        let mut s = base.clone();
        for _ in 0..1 + rng.below(2) {
            let pick = pool[rng.below(pool.len())];
            let dirs: Vec<usize> =
                (0..s.nodes.len()).filter(|&i| matches!(s.nodes[i].body, BodyState::Dir { .. })).collect();
            let d = dirs[rng.below(dirs.len())];
            let k = rng.below(s.nodes.len());
            match rng.below(9) {
                0 | 1 => {
                    if let BodyState::Dir { entries, .. } = &mut s.nodes[d].body {
                        if !entries.is_empty() {
                            let e = rng.below(entries.len());
                            entries[e].1 = pick;
                        }
                    }
                }
                2 => {
                    // Move a name to another directory.
                    let d2 = dirs[rng.below(dirs.len())];
                    let taken = match &mut s.nodes[d].body {
                        BodyState::Dir { entries, .. } if !entries.is_empty() => {
                            Some(entries.remove(rng.below(entries.len())))
                        }
                        _ => None,
                    };
                    if let (Some((name, ino)), BodyState::Dir { entries, .. }) = (taken, &mut s.nodes[d2].body) {
                        let mut name = name;
                        name.extend_from_slice(b"_moved");
                        entries.push((name, ino));
                        entries.sort();
                        entries.dedup_by(|a, b| a.0 == b.0);
                    }
                }
                3 => {
                    if let BodyState::Dir { parent, .. } = &mut s.nodes[d].body {
                        *parent = pick;
                    }
                }
                4 => {
                    let n = &mut s.nodes[k];
                    n.nlink = if rng.below(2) == 0 { n.nlink.wrapping_add(1) } else { n.nlink.wrapping_sub(1) };
                }
                5 => {
                    s.nodes.remove(k);
                }
                6 => {
                    if rng.below(2) == 0 && !s.refs.is_empty() {
                        s.refs.remove(rng.below(s.refs.len()));
                    } else {
                        s.refs.push((pick, 1));
                        s.refs.sort();
                        s.refs.dedup_by_key(|r| r.0);
                    }
                }
                7 => {
                    let n = &mut s.nodes[k];
                    n.body = BodyState::Gone;
                    n.nlink = 0;
                    n.perm = 0;
                    n.mtime_ns = 0;
                }
                _ => {
                    s.next_ino = pick.max(FIRST_OVERLAY_INO);
                }
            }
        }
        // Keep the byte count right so that the structure is what gets judged.
        s.overlay_bytes = s
            .nodes
            .iter()
            .map(|n| match &n.body {
                BodyState::Gone => 0,
                BodyState::File(FileState::Owned(b)) => NODE_COST + b.0.len() as u64,
                BodyState::Symlink(t) => NODE_COST + t.len() as u64,
                BodyState::Dir { entries, .. } => NODE_COST + entries.iter().map(|(k, _)| entry_cost(k)).sum::<u64>(),
                _ => NODE_COST,
            })
            .sum();
        match Vfs::restore_state(f.image.clone(), s) {
            Err(_) => refused += 1,
            Ok(mut w) => {
                accepted += 1;
                exercise(&mut w);
            }
        }
    }
    assert!(refused > 1000 && accepted > 100, "{refused} {accepted}");
}

/// Random operations over image and new names, with references taken and given back:
/// after every step the state round-trips (restore accepts it, the bytes come back the
/// same, the restored tree is consistent), and the sequence carries on with the
/// restored VFS every few steps.
#[test]
fn state_random_ops_roundtrip() {
    const NAMES: &[&str] = &[
        "etc",
        "usr",
        "lib",
        "tmp",
        "data",
        "bin",
        "hostname",
        "os-release",
        "python3",
        "python3.11",
        "os.py",
        "json",
        "big.bin",
        "share",
        "doc",
        "emptydir",
        "a",
        "b",
    ];
    let f = fixture();
    let mut v = Vfs::new(f.image.clone());
    let mut rng = Rng(0xdead_beef_1234_5679);
    let mut held: Vec<Ino> = Vec::new();
    // Mostly names that exist (picked from the directory at hand), some that do not.
    let path = |v: &Vfs, rng: &mut Rng| {
        let mut out = String::new();
        let mut dir = Some(ROOT_INO);
        for _ in 0..1 + rng.below(4) {
            let listed = dir.and_then(|d| v.readdir(d).ok()).map(|e| e[2..].to_vec()).unwrap_or_default();
            let name = if !listed.is_empty() && rng.below(5) != 0 {
                let e = &listed[rng.below(listed.len())];
                dir = (e.kind == FileType::Dir).then_some(e.ino);
                String::from_utf8(e.name.clone()).unwrap()
            } else {
                dir = None;
                NAMES[rng.below(NAMES.len())].to_owned()
            };
            out.push('/');
            out.push_str(&name);
            if dir.is_none() || rng.below(3) == 0 {
                break;
            }
        }
        out
    };
    for step in 0..1500 {
        let p = path(&v, &mut rng);
        let q = path(&v, &mut rng);
        let (pb, qb) = (p.as_bytes(), q.as_bytes());
        match rng.below(14) {
            0 => {
                if let Ok(ino) = v.open(ROOT_INO, pb, libc::O_CREAT | RDWR, 0o644) {
                    let _ = v.write(ino, rng.below(20) as u64, b"written");
                    v.release(ino);
                }
            }
            1 => {
                if let Ok(ino) = v.resolve(ROOT_INO, pb, true) {
                    let _ = v.truncate(ino, rng.below(30) as u64);
                }
            }
            2 => drop(v.mkdir(ROOT_INO, pb, 0o755)),
            3 => drop(v.rmdir(ROOT_INO, pb)),
            4 | 5 => drop(v.unlink(ROOT_INO, pb)),
            6 | 7 => {
                let fl = [0, 0, RENAME_NOREPLACE, RENAME_EXCHANGE][rng.below(4)];
                let _ = v.rename(ROOT_INO, pb, ROOT_INO, qb, fl);
            }
            8 => drop(v.symlink(qb, ROOT_INO, pb)),
            9 => drop(v.link(ROOT_INO, pb, ROOT_INO, qb, rng.below(2) == 0)),
            10 => {
                if let Ok(ino) = v.resolve(ROOT_INO, pb, false) {
                    let _ = v.chmod(ino, rng.below(0o10000) as u32);
                    let _ = v.set_mtime(ino, rng.below(1 << 30) as i64, 5);
                }
            }
            11 => {
                if let Ok(ino) = v.open(ROOT_INO, pb, RDONLY, 0) {
                    held.push(ino);
                }
            }
            _ => {
                if !held.is_empty() {
                    let ino = held.swap_remove(rng.below(held.len()));
                    v.release(ino);
                }
            }
        }
        let bytes = to_bytes(&v.save_state());
        let state: VfsState = postcard::from_bytes(&bytes).unwrap();
        let w = match Vfs::restore_state(f.image.clone(), state) {
            Ok(w) => w,
            Err(e) => panic!("step {step}: {e}"),
        };
        assert_eq!(to_bytes(&w.save_state()), bytes, "step {step}");
        if step % 10 == 9 {
            check_consistent(&w);
            assert_eq!(observe(&v, &held), observe(&w, &held), "step {step}");
            v = w;
        }
    }
    for ino in held.drain(..) {
        v.release(ino);
    }
    check_consistent(&v);
    Vfs::restore_state(f.image.clone(), v.save_state()).unwrap();
}

/// A package layer: a packed tree rooted at the guest's `/` (`lib` is the
/// image's symlink to `usr/lib`, so `lib/python3.11` lands in the image's directory).
fn layer(dir: &std::path::Path, files: &[(&str, &[u8])]) -> Arc<Image> {
    let root = dir.join("layer-root");
    for (p, b) in files {
        let p = root.join(p);
        fs::create_dir_all(p.parent().unwrap()).unwrap();
        fs::write(&p, b).unwrap();
    }
    let out = dir.join("layer.img");
    pack_dir(&root, &out).unwrap();
    Arc::new(Image::open(&out).unwrap())
}

#[test]
fn package_layers_are_references_in_the_state() {
    let f = fixture();
    let dir = tempfile::tempdir().unwrap();
    let big = vec![b'x'; 100_000];
    let l =
        layer(dir.path(), &[("lib/python3.11/pkg/__init__.py", b"X = 1\n"), ("usr/local/lib/site/pkg/big.bin", &big)]);
    let mut v = Vfs::new(f.image.clone());
    let before = v.overlay_bytes();
    assert_eq!(v.install_layer(&l).unwrap(), 2);
    // Through the image's /lib symlink, beside the image's own files.
    assert_eq!(read_all(&v, r(&v, "/usr/lib/python3.11/pkg/__init__.py").unwrap()), b"X = 1\n");
    assert_eq!(read_all(&v, r(&v, "/usr/lib/python3.11/os.py").unwrap()), b"import sys\n# the os module\n");
    assert_eq!(read_all(&v, r(&v, "/usr/local/lib/site/pkg/big.bin").unwrap()).len(), big.len());
    // The bytes are not charged: only nodes and entries.
    assert!(v.overlay_bytes() - before < 10_000, "{}", v.overlay_bytes() - before);

    // A checkpoint names the layer, never its bytes.
    let s = v.save_state();
    assert_eq!(s.layer_ids().into_iter().collect::<Vec<_>>(), vec![l.id().to_string()]);
    let bytes = postcard::to_stdvec(&s).unwrap();
    assert!(bytes.len() < 10_000, "{} bytes", bytes.len());
    // Without the layer it is a clear error; with it, the same files.
    let e = Vfs::restore_state(f.image.clone(), s.clone()).err().unwrap();
    assert!(matches!(e, VfsStateError::MissingLayer(ref id) if id == l.id()), "{e}");
    let layers: Layers = [(l.id().to_string(), l.clone())].into_iter().collect();
    let mut w = Vfs::restore_state_with(f.image.clone(), s, &layers).unwrap();
    assert_eq!(read_all(&w, r(&w, "/usr/lib/python3.11/pkg/__init__.py").unwrap()), b"X = 1\n");
    check_accounting(&w);

    // Writing copies the file into the overlay; the layer is unchanged.
    let ino = r(&w, "/usr/lib/python3.11/pkg/__init__.py").unwrap();
    w.write(ino, 0, b"Y").unwrap();
    assert_eq!(read_all(&w, ino), b"Y = 1\n");
    assert_eq!(read_all(&v, r(&v, "/usr/lib/python3.11/pkg/__init__.py").unwrap()), b"X = 1\n");
    check_accounting(&w);

    // Installing it again (or over any existing file) is refused and changes nothing.
    let gen = v.save_state();
    let e = v.install_layer(&l).unwrap_err();
    assert!(matches!(e, LayerError::Exists { ref path } if path.contains("/pkg/")), "{e}");
    assert_eq!(v.save_state(), gen);
    // A file where the layer needs a directory.
    let mut x = Vfs::new(f.image.clone());
    create(&mut x, "/usr/local", b"file");
    assert!(matches!(x.install_layer(&l).unwrap_err(), LayerError::NotADirectory { .. }));
    // A quota too small for the nodes: nothing is installed.
    let mut q = Vfs::new(f.image.clone());
    q.set_quota(q.overlay_bytes() + 300);
    assert!(matches!(q.install_layer(&l).unwrap_err(), LayerError::NoSpace));
    assert!(r(&q, "/usr/lib/python3.11/pkg").is_err());

    // A forged state pointing at a directory of the layer is refused.
    let mut s = v.save_state();
    for n in &mut s.nodes {
        if let BodyState::File(FileState::Layer { ino, .. }) = &mut n.body {
            *ino = Image::ROOT;
        }
    }
    assert!(Vfs::restore_state_with(f.image.clone(), s, &layers).is_err());
}
