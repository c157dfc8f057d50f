//! VFS tests over a real packed image built from a temporary host tree.

use std::fs;
use std::os::unix::fs::{symlink, PermissionsExt};
use std::path::Path;
use std::sync::Arc;

use forkbox_image::{pack_dir, Image};

use super::*;
use crate::Errno;

const RDONLY: i32 = libc::O_RDONLY;
const RDWR: i32 = libc::O_RDWR;
const WRONLY: i32 = libc::O_WRONLY;
const CREAT: i32 = libc::O_CREAT;
const EXCL: i32 = libc::O_EXCL;
const TRUNC: i32 = libc::O_TRUNC;

const HOSTNAME: &[u8] = b"forkbox\n";
const OS_PY: &[u8] = b"import sys\n# the os module\n";

fn big_bytes() -> Vec<u8> {
    (0..10_000u32).map(|i| (i % 251) as u8).collect()
}

/// A small Debian-like tree: merged-/usr symlinks, relative and absolute symlinks,
/// escaping symlinks, a cycle.
pub(super) fn make_tree(root: &Path) {
    let w = |p: &str, b: &[u8], mode: u32| {
        let p = root.join(p);
        fs::create_dir_all(p.parent().unwrap()).unwrap();
        fs::write(&p, b).unwrap();
        fs::set_permissions(&p, fs::Permissions::from_mode(mode)).unwrap();
    };
    w("etc/hostname", HOSTNAME, 0o644);
    w("etc/os-release", b"ID=debian\n", 0o644);
    w("usr/bin/python3", b"\x7fELF fake", 0o755);
    w("usr/lib/python3.11/os.py", OS_PY, 0o644);
    w("usr/lib/python3.11/json/__init__.py", b"# json\n", 0o644);
    w("usr/lib/x86_64-linux-gnu/libfoo.so.1", b"libfoo", 0o644);
    w("data/big.bin", &big_bytes(), 0o600);
    fs::create_dir_all(root.join("emptydir")).unwrap();
    fs::create_dir_all(root.join("usr/share/doc")).unwrap();
    let l = |target: &str, at: &str| symlink(target, root.join(at)).unwrap();
    l("usr/lib", "lib");
    l("usr/bin", "bin");
    l("libfoo.so.1", "usr/lib/x86_64-linux-gnu/libfoo.so");
    l("/usr/bin/python3", "usr/bin/python");
    l("/../../etc", "escape");
    l("../../../../../etc", "usr/share/escape2");
    l("/etc/../../host/path", "hostlink");
    l("loop2", "loop1");
    l("loop1", "loop2");
    l("self", "self");
    l("/nonexistent/file", "dangling");
    l("newtarget", "etc/dangling_rel");
}

pub(super) struct Fixture {
    _dir: tempfile::TempDir,
    pub(super) image: Arc<Image>,
}

pub(super) fn fixture() -> Fixture {
    let dir = tempfile::tempdir().unwrap();
    let root = dir.path().join("root");
    fs::create_dir(&root).unwrap();
    make_tree(&root);
    let out = dir.path().join("img");
    pack_dir(&root, &out).unwrap();
    let image = Arc::new(Image::open(&out).unwrap());
    Fixture { _dir: dir, image }
}

fn vfs() -> (Fixture, Vfs) {
    let f = fixture();
    let v = Vfs::new(f.image.clone());
    (f, v)
}

pub(super) fn r(v: &Vfs, path: &str) -> Result<Ino, Errno> {
    v.resolve(ROOT_INO, path.as_bytes(), true)
}

pub(super) fn read_all(v: &Vfs, ino: Ino) -> Vec<u8> {
    let mut out = Vec::new();
    let mut buf = [0u8; 1000];
    loop {
        let n = v.read(ino, out.len() as u64, &mut buf).unwrap();
        if n == 0 {
            return out;
        }
        out.extend_from_slice(&buf[..n]);
    }
}

fn read_path(v: &Vfs, path: &str) -> Vec<u8> {
    read_all(v, r(v, path).unwrap())
}

fn names(v: &Vfs, path: &str) -> Vec<String> {
    v.readdir(r(v, path).unwrap()).unwrap().into_iter().map(|e| String::from_utf8(e.name).unwrap()).collect()
}

pub(super) fn create(v: &mut Vfs, path: &str, data: &[u8]) -> Ino {
    let ino = v.open(ROOT_INO, path.as_bytes(), CREAT | WRONLY | TRUNC, 0o644).unwrap();
    assert_eq!(v.write(ino, 0, data).unwrap(), data.len());
    v.release(ino);
    ino
}

/// The image's own view of a path (bypassing the VFS).
fn image_lookup(img: &Image, path: &str) -> u32 {
    let mut cur = Image::ROOT;
    for c in path.split('/').filter(|c| !c.is_empty()) {
        cur = img.lookup(cur, c.as_bytes()).unwrap();
    }
    cur
}

pub(super) fn check_accounting(v: &Vfs) {
    assert_eq!(v.overlay_bytes(), v.recount());
}

#[test]
fn absolute_and_relative_symlinks() {
    let (_f, v) = vfs();
    let lib = r(&v, "/usr/lib/x86_64-linux-gnu/libfoo.so.1").unwrap();
    // /lib -> usr/lib (relative, at the root), libfoo.so -> libfoo.so.1 (relative).
    assert_eq!(r(&v, "/lib/x86_64-linux-gnu/libfoo.so").unwrap(), lib);
    assert_eq!(read_path(&v, "/lib/x86_64-linux-gnu/libfoo.so"), b"libfoo");
    // Relative path from a start directory.
    let usr = r(&v, "/usr").unwrap();
    assert_eq!(v.resolve(usr, b"lib/x86_64-linux-gnu/libfoo.so", true).unwrap(), lib);
    assert_eq!(v.resolve(usr, b"./lib/../lib/./x86_64-linux-gnu//libfoo.so", true).unwrap(), lib);
    // Absolute target: /usr/bin/python -> /usr/bin/python3, and through /bin.
    let py3 = r(&v, "/usr/bin/python3").unwrap();
    assert_eq!(r(&v, "/bin/python").unwrap(), py3);
    // Not following the last component gives the link itself.
    let link = v.resolve(ROOT_INO, b"/bin/python", false).unwrap();
    assert_ne!(link, py3);
    assert_eq!(v.stat(link).unwrap().kind, FileType::Symlink);
    assert_eq!(v.stat(link).unwrap().mode(), libc::S_IFLNK | 0o777);
    assert_eq!(v.readlink(ROOT_INO, b"/bin/python").unwrap(), b"/usr/bin/python3");
    assert_eq!(v.readlink(ROOT_INO, b"/usr/bin/python3"), Err(Errno::EINVAL));
    // A symlink in the middle is always followed, even with follow_last = false.
    assert_eq!(v.resolve(ROOT_INO, b"/lib/x86_64-linux-gnu/libfoo.so.1", false).unwrap(), lib);
    // A trailing slash follows the last symlink and requires a directory.
    let usr_lib = r(&v, "/usr/lib").unwrap();
    assert_eq!(v.resolve(ROOT_INO, b"/lib/", false).unwrap(), usr_lib);
    assert_ne!(v.resolve(ROOT_INO, b"/lib", false).unwrap(), usr_lib);
    assert_eq!(v.resolve(ROOT_INO, b"/bin/python/", true), Err(Errno::ENOTDIR));
}

#[test]
fn paths_stay_inside_the_vfs() {
    let (_f, mut v) = vfs();
    let etc = r(&v, "/etc").unwrap();
    let hostname = r(&v, "/etc/hostname").unwrap();
    // ".." of the root is the root.
    assert_eq!(r(&v, "/..").unwrap(), ROOT_INO);
    assert_eq!(r(&v, "/../../..").unwrap(), ROOT_INO);
    assert_eq!(r(&v, "/../../etc/hostname").unwrap(), hostname);
    assert_eq!(v.resolve(etc, b"../../../etc/hostname", true).unwrap(), hostname);
    // Symlinks that try to climb out land back inside.
    assert_eq!(r(&v, "/escape").unwrap(), etc);
    assert_eq!(r(&v, "/escape/hostname").unwrap(), hostname);
    assert_eq!(r(&v, "/usr/share/escape2/hostname").unwrap(), hostname);
    // A host-looking path is just a missing path here.
    assert_eq!(v.open(ROOT_INO, b"/etc/../../host/path", RDONLY, 0), Err(Errno::ENOENT));
    assert_eq!(v.open(ROOT_INO, b"/hostlink", RDONLY, 0), Err(Errno::ENOENT));
    assert_eq!(v.open(ROOT_INO, b"/tmp/../../../../etc/passwd", RDONLY, 0), Err(Errno::ENOENT));
    assert_eq!(v.open(ROOT_INO, b"/dangling", RDONLY, 0), Err(Errno::ENOENT));
    // getcwd-style paths.
    assert_eq!(v.dir_path(ROOT_INO).unwrap(), b"/");
    assert_eq!(v.dir_path(r(&v, "/usr/lib/python3.11/json").unwrap()).unwrap(), b"/usr/lib/python3.11/json");
    assert_eq!(v.dir_path(r(&v, "/lib").unwrap()).unwrap(), b"/usr/lib");
    assert_eq!(v.dir_path(hostname), Err(Errno::ENOTDIR));
}

#[test]
fn symlink_loops_and_limits() {
    let (_f, mut v) = vfs();
    assert_eq!(r(&v, "/loop1"), Err(Errno::ELOOP));
    assert_eq!(r(&v, "/self/x"), Err(Errno::ELOOP));
    assert_eq!(r(&v, "/self/"), Err(Errno::ELOOP));
    // Without following the last one, the link itself resolves.
    assert!(v.resolve(ROOT_INO, b"/loop1", false).is_ok());
    assert_eq!(v.open(ROOT_INO, b"/loop1", RDONLY, 0), Err(Errno::ELOOP));
    assert_eq!(v.open(ROOT_INO, b"/loop1", RDONLY | CREAT, 0o644), Err(Errno::ELOOP));
    // A chain of exactly MAX_SYMLINKS links works, one more is ELOOP.
    v.mkdir(ROOT_INO, b"/c", 0o755).unwrap();
    create(&mut v, "/c/end", b"end");
    v.symlink(b"end", ROOT_INO, b"/c/l0").unwrap();
    for i in 1..=MAX_SYMLINKS {
        v.symlink(format!("l{}", i - 1).as_bytes(), ROOT_INO, format!("/c/l{i}").as_bytes()).unwrap();
    }
    assert_eq!(read_path(&v, &format!("/c/l{}", MAX_SYMLINKS - 1)), b"end");
    assert_eq!(r(&v, &format!("/c/l{}", MAX_SYMLINKS)), Err(Errno::ELOOP));
}

#[test]
fn path_errors() {
    let (_f, v) = vfs();
    assert_eq!(r(&v, "/etc/hostname/x"), Err(Errno::ENOTDIR));
    assert_eq!(r(&v, "/etc/hostname/"), Err(Errno::ENOTDIR));
    assert_eq!(r(&v, "/etc/hostname/.."), Err(Errno::ENOTDIR));
    assert_eq!(r(&v, "/nope/x"), Err(Errno::ENOENT));
    assert_eq!(r(&v, ""), Err(Errno::ENOENT));
    let hostname = r(&v, "/etc/hostname").unwrap();
    // A relative path from a non-directory start (openat with a file's dirfd).
    assert_eq!(v.resolve(hostname, b"x", true), Err(Errno::ENOTDIR));
    let long = "a".repeat(256);
    assert_eq!(r(&v, &format!("/{long}")), Err(Errno::ENAMETOOLONG));
    assert_eq!(r(&v, &format!("/{}", "a".repeat(255))), Err(Errno::ENOENT));
    let deep = "/.".repeat(2048); // 4096 bytes
    assert_eq!(r(&v, &deep), Err(Errno::ENAMETOOLONG));
    assert_eq!(r(&v, &deep[..4094]).unwrap(), ROOT_INO);
    assert_eq!(v.resolve(ROOT_INO, b"/etc\0x", true), Err(Errno::EINVAL));
    assert_eq!(r(&v, "//etc///hostname").unwrap(), hostname);
}

#[test]
fn create_write_read_back() {
    let (_f, mut v) = vfs();
    let ino = v.open(ROOT_INO, b"/tmp/a.txt", CREAT | RDWR, 0o640).unwrap();
    assert!(ino >= FIRST_OVERLAY_INO);
    assert_eq!(v.write(ino, 0, b"hello").unwrap(), 5);
    assert_eq!(v.write(ino, 5, b" world").unwrap(), 6);
    assert_eq!(v.write(ino, 0, b"J").unwrap(), 1);
    assert_eq!(read_all(&v, ino), b"Jello world");
    // Sparse extension zero-fills.
    assert_eq!(v.write(ino, 20, b"!").unwrap(), 1);
    let all = read_all(&v, ino);
    assert_eq!(all.len(), 21);
    assert_eq!(&all[11..20], &[0u8; 9]);
    let st = v.stat(ino).unwrap();
    assert_eq!((st.kind, st.perm, st.size, st.nlink), (FileType::File, 0o640, 21, 1));
    assert_eq!(st.mode(), libc::S_IFREG | 0o640);
    assert!(st.mtime_ns > 0);
    // Reads past the end, offsets beyond.
    let mut buf = [0u8; 4];
    assert_eq!(v.read(ino, 21, &mut buf).unwrap(), 0);
    assert_eq!(v.read(ino, u64::MAX, &mut buf).unwrap(), 0);
    assert_eq!(v.read(ino, 18, &mut buf).unwrap(), 3);
    assert_eq!(&buf[..3], b"\0\0!");
    // The same name resolves to the same inode; reopen without O_CREAT.
    assert_eq!(r(&v, "/tmp/a.txt").unwrap(), ino);
    assert_eq!(v.open(ROOT_INO, b"/tmp/a.txt", RDONLY, 0).unwrap(), ino);
    // Relative creation from a start dir.
    let tmp = r(&v, "/tmp").unwrap();
    let b = v.open(tmp, b"b", CREAT | WRONLY, 0o600).unwrap();
    assert_eq!(v.resolve(ROOT_INO, b"/tmp/b", true).unwrap(), b);
    // Writing past MAX_FILE_SIZE.
    assert_eq!(v.write(b, MAX_FILE_SIZE, b"x"), Err(Errno::EFBIG));
    // Truncate grows with zeros and shrinks.
    v.truncate(ino, 3).unwrap();
    assert_eq!(read_all(&v, ino), b"Jel");
    v.truncate(ino, 6).unwrap();
    assert_eq!(read_all(&v, ino), b"Jel\0\0\0");
    assert_eq!(v.file_bytes(ino).unwrap(), b"Jel\0\0\0");
    check_accounting(&v);
}

#[test]
fn copy_up_keeps_image_intact() {
    let (f, mut v) = vfs();
    let ino = r(&v, "/etc/hostname").unwrap();
    let etc_before = names(&v, "/etc");
    let h = v.open(ROOT_INO, b"/etc/hostname", WRONLY, 0).unwrap();
    assert_eq!(h, ino);
    // Opening for writing copies nothing.
    assert_eq!(v.file_bytes(ino).unwrap(), HOSTNAME);
    assert_eq!(v.write(ino, 0, b"sandbox").unwrap(), 7);
    assert_eq!(read_path(&v, "/etc/hostname"), b"sandbox\n");
    // Same inode number, the directory unchanged.
    assert_eq!(r(&v, "/etc/hostname").unwrap(), ino);
    assert_eq!(names(&v, "/etc"), etc_before);
    // The image's bytes are untouched.
    let img_ino = image_lookup(&f.image, "/etc/hostname");
    assert_eq!(Ino::from(img_ino), ino);
    assert_eq!(f.image.content(img_ino).unwrap(), HOSTNAME);
    // Copy-up of a larger file written in the middle.
    let big = r(&v, "/data/big.bin").unwrap();
    v.write(big, 5000, b"XYZ").unwrap();
    let mut expect = big_bytes();
    expect[5000..5003].copy_from_slice(b"XYZ");
    assert_eq!(read_all(&v, big), expect);
    assert_eq!(f.image.content(image_lookup(&f.image, "/data/big.bin")).unwrap(), &big_bytes()[..]);
    assert_eq!(v.stat(big).unwrap().perm, 0o600);
    // Writing into an image directory (site-packages style).
    create(&mut v, "/usr/lib/python3.11/mine.py", b"x = 1\n");
    assert_eq!(read_path(&v, "/usr/lib/python3.11/mine.py"), b"x = 1\n");
    assert_eq!(read_path(&v, "/usr/lib/python3.11/os.py"), OS_PY);
    assert!(f.image.lookup(image_lookup(&f.image, "/usr/lib/python3.11"), b"mine.py").is_none());
    check_accounting(&v);
}

#[test]
fn open_flags() {
    let (f, mut v) = vfs();
    // O_EXCL on an existing file, on a dangling symlink, on a directory.
    assert_eq!(v.open(ROOT_INO, b"/etc/hostname", CREAT | EXCL | WRONLY, 0o644), Err(Errno::EEXIST));
    assert_eq!(v.open(ROOT_INO, b"/dangling", CREAT | EXCL | WRONLY, 0o644), Err(Errno::EEXIST));
    assert_eq!(v.open(ROOT_INO, b"/tmp", CREAT | EXCL | WRONLY, 0o644), Err(Errno::EEXIST));
    let n = v.open(ROOT_INO, b"/tmp/new", CREAT | EXCL | WRONLY, 0o644).unwrap();
    assert_eq!(v.stat(n).unwrap().size, 0);
    assert_eq!(v.open(ROOT_INO, b"/tmp/new", CREAT | EXCL | WRONLY, 0o644), Err(Errno::EEXIST));
    // O_CREAT without O_EXCL opens the existing file, keeps its bytes.
    let h = v.open(ROOT_INO, b"/etc/hostname", CREAT | WRONLY, 0o600).unwrap();
    assert_eq!(read_all(&v, h), HOSTNAME);
    assert_eq!(v.stat(h).unwrap().perm, 0o644);
    // O_CREAT through a dangling (relative) symlink creates its target.
    let t = v.open(ROOT_INO, b"/etc/dangling_rel", CREAT | WRONLY, 0o644).unwrap();
    assert_eq!(r(&v, "/etc/newtarget").unwrap(), t);
    // ... but not through a dangling symlink whose directory is missing.
    assert_eq!(v.open(ROOT_INO, b"/dangling", CREAT | WRONLY, 0o644), Err(Errno::ENOENT));
    // O_CREAT on directories, trailing slashes.
    assert_eq!(v.open(ROOT_INO, b"/tmp", CREAT | RDONLY, 0o644), Err(Errno::EISDIR));
    assert_eq!(v.open(ROOT_INO, b"/tmp/x/", CREAT | WRONLY, 0o644), Err(Errno::EISDIR));
    assert_eq!(v.open(ROOT_INO, b"/", CREAT | RDONLY, 0o644), Err(Errno::EISDIR));
    assert_eq!(v.open(ROOT_INO, b"/lib", CREAT | RDONLY, 0o644), Err(Errno::EISDIR));
    assert_eq!(v.open(ROOT_INO, b"/nodir/x", CREAT | WRONLY, 0o644), Err(Errno::ENOENT));
    assert_eq!(v.open(ROOT_INO, b"/etc/hostname/x", CREAT | WRONLY, 0o644), Err(Errno::ENOTDIR));
    // O_TRUNC on an image file: empty in the VFS, intact in the image.
    let h = v.open(ROOT_INO, b"/etc/hostname", WRONLY | TRUNC, 0).unwrap();
    assert_eq!(v.stat(h).unwrap().size, 0);
    assert_eq!(read_all(&v, h), b"");
    assert_eq!(f.image.content(image_lookup(&f.image, "/etc/hostname")).unwrap(), HOSTNAME);
    // O_TRUNC on an overlay file.
    let a = create(&mut v, "/tmp/a", b"abcdef");
    v.open(ROOT_INO, b"/tmp/a", RDWR | TRUNC, 0).unwrap();
    assert_eq!(v.stat(a).unwrap().size, 0);
    // Directories.
    let tmp = r(&v, "/tmp").unwrap();
    assert_eq!(v.open(ROOT_INO, b"/tmp", RDONLY | libc::O_DIRECTORY, 0).unwrap(), tmp);
    assert_eq!(v.open(ROOT_INO, b"/tmp", WRONLY, 0), Err(Errno::EISDIR));
    assert_eq!(v.open(ROOT_INO, b"/tmp", RDWR, 0), Err(Errno::EISDIR));
    assert_eq!(v.open(ROOT_INO, b"/tmp", RDONLY | TRUNC, 0), Err(Errno::EISDIR));
    assert_eq!(v.open(ROOT_INO, b"/etc/os-release", RDONLY | libc::O_DIRECTORY, 0), Err(Errno::ENOTDIR));
    assert_eq!(v.open(ROOT_INO, b"/lib", RDONLY | libc::O_DIRECTORY, 0).unwrap(), r(&v, "/usr/lib").unwrap());
    // O_NOFOLLOW / O_PATH.
    assert_eq!(v.open(ROOT_INO, b"/bin/python", RDONLY | libc::O_NOFOLLOW, 0), Err(Errno::ELOOP));
    assert_eq!(v.open(ROOT_INO, b"/bin/python", CREAT | WRONLY | libc::O_NOFOLLOW, 0), Err(Errno::ELOOP));
    assert!(v.open(ROOT_INO, b"/usr/bin/python3", RDONLY | libc::O_NOFOLLOW, 0).is_ok());
    let lnk = v.open(ROOT_INO, b"/bin/python", libc::O_PATH | libc::O_NOFOLLOW, 0).unwrap();
    assert_eq!(v.stat(lnk).unwrap().kind, FileType::Symlink);
    assert_eq!(v.readlink_ino(lnk).unwrap(), b"/usr/bin/python3");
    // O_TMPFILE (includes O_DIRECTORY's bit) and O_CREAT|O_DIRECTORY.
    assert_eq!(v.open(ROOT_INO, b"/tmp", libc::O_TMPFILE | RDWR, 0o600), Err(Errno::EOPNOTSUPP));
    assert_eq!(v.open(ROOT_INO, b"/tmp/d", CREAT | libc::O_DIRECTORY, 0o600), Err(Errno::EINVAL));
    check_accounting(&v);
}

#[test]
fn mkdir_rmdir() {
    let (_f, mut v) = vfs();
    v.mkdir(ROOT_INO, b"/tmp/d", 0o750).unwrap();
    let d = r(&v, "/tmp/d").unwrap();
    let st = v.stat(d).unwrap();
    assert_eq!((st.kind, st.perm, st.nlink), (FileType::Dir, 0o750, 2));
    assert_eq!(st.mode(), libc::S_IFDIR | 0o750);
    assert_eq!(v.mkdir(ROOT_INO, b"/tmp/d", 0o755), Err(Errno::EEXIST));
    assert_eq!(v.mkdir(ROOT_INO, b"/tmp/d/", 0o755), Err(Errno::EEXIST));
    assert_eq!(v.mkdir(ROOT_INO, b"/etc/hostname", 0o755), Err(Errno::EEXIST));
    assert_eq!(v.mkdir(ROOT_INO, b"/dangling", 0o755), Err(Errno::EEXIST));
    assert_eq!(v.mkdir(ROOT_INO, b"/", 0o755), Err(Errno::EEXIST));
    assert_eq!(v.mkdir(ROOT_INO, b"/nope/d", 0o755), Err(Errno::ENOENT));
    v.mkdir(d, b"sub/", 0o755).unwrap();
    assert_eq!(v.stat(d).unwrap().nlink, 3);
    assert_eq!(v.dir_path(r(&v, "/tmp/d/sub").unwrap()).unwrap(), b"/tmp/d/sub");
    create(&mut v, "/tmp/d/sub/f", b"x");
    assert_eq!(v.rmdir(ROOT_INO, b"/tmp/d"), Err(Errno::ENOTEMPTY));
    assert_eq!(v.rmdir(ROOT_INO, b"/tmp/d/sub"), Err(Errno::ENOTEMPTY));
    assert_eq!(v.rmdir(ROOT_INO, b"/tmp/d/sub/f"), Err(Errno::ENOTDIR));
    assert_eq!(v.rmdir(ROOT_INO, b"/lib"), Err(Errno::ENOTDIR)); // a symlink to a dir
    assert_eq!(v.rmdir(ROOT_INO, b"/"), Err(Errno::EBUSY));
    assert_eq!(v.rmdir(d, b"."), Err(Errno::EINVAL));
    assert_eq!(v.rmdir(d, b".."), Err(Errno::ENOTEMPTY));
    assert_eq!(v.rmdir(ROOT_INO, b"/tmp/nope"), Err(Errno::ENOENT));
    // An image directory that is not empty, then an empty one.
    assert_eq!(v.rmdir(ROOT_INO, b"/usr/share"), Err(Errno::ENOTEMPTY));
    v.rmdir(ROOT_INO, b"/emptydir").unwrap();
    assert_eq!(r(&v, "/emptydir"), Err(Errno::ENOENT));
    v.unlink(ROOT_INO, b"/tmp/d/sub/f").unwrap();
    // A removed directory used as a cwd: getcwd and creations fail with ENOENT.
    let sub = r(&v, "/tmp/d/sub").unwrap();
    v.hold(sub);
    v.rmdir(ROOT_INO, b"/tmp/d/sub/").unwrap();
    assert_eq!(v.stat(d).unwrap().nlink, 2);
    assert_eq!(v.dir_path(sub), Err(Errno::ENOENT));
    assert_eq!(v.open(sub, b"f", CREAT | WRONLY, 0o644), Err(Errno::ENOENT));
    assert_eq!(v.mkdir(sub, b"x", 0o755), Err(Errno::ENOENT));
    assert_eq!(v.stat(sub).unwrap().nlink, 0);
    v.release(sub);
    assert_eq!(v.stat(sub), Err(Errno::ENOENT));
    v.rmdir(ROOT_INO, b"/tmp/d").unwrap();
    assert_eq!(names(&v, "/tmp"), [".", ".."]);
    check_accounting(&v);
}

#[test]
fn unlink_semantics() {
    let (f, mut v) = vfs();
    assert_eq!(v.unlink(ROOT_INO, b"/tmp"), Err(Errno::EISDIR));
    assert_eq!(v.unlink(ROOT_INO, b"/"), Err(Errno::EISDIR));
    assert_eq!(v.unlink(ROOT_INO, b"/nope"), Err(Errno::ENOENT));
    assert_eq!(v.unlink(ROOT_INO, b"/etc/hostname/"), Err(Errno::ENOTDIR));
    // A symlink is removed itself, not its target.
    v.unlink(ROOT_INO, b"/usr/bin/python").unwrap();
    assert_eq!(v.resolve(ROOT_INO, b"/usr/bin/python", false), Err(Errno::ENOENT));
    assert_eq!(read_path(&v, "/usr/bin/python3"), b"\x7fELF fake");
    // An image file.
    let os_ino = r(&v, "/usr/lib/python3.11/os.py").unwrap();
    v.unlink(ROOT_INO, b"/usr/lib/python3.11/os.py").unwrap();
    assert_eq!(r(&v, "/usr/lib/python3.11/os.py"), Err(Errno::ENOENT));
    assert_eq!(v.stat(os_ino), Err(Errno::ENOENT));
    assert_eq!(f.image.content(os_ino as u32).unwrap(), OS_PY);
    // Unlinked while open: still readable and writable by inode until released.
    let base = v.overlay_bytes();
    let t = v.open(ROOT_INO, b"/tmp/t", CREAT | RDWR, 0o600).unwrap();
    v.write(t, 0, &[7u8; 5000]).unwrap();
    assert_eq!(v.overlay_bytes(), base + NODE_COST + entry_cost(b"t") + 5000);
    v.unlink(ROOT_INO, b"/tmp/t").unwrap();
    assert_eq!(r(&v, "/tmp/t"), Err(Errno::ENOENT));
    assert_eq!(v.stat(t).unwrap().nlink, 0);
    assert_eq!(read_all(&v, t), vec![7u8; 5000]);
    v.write(t, 5000, b"more").unwrap();
    assert_eq!(v.stat(t).unwrap().size, 5004);
    v.release(t);
    assert_eq!(v.stat(t), Err(Errno::ENOENT));
    assert_eq!(v.overlay_bytes(), base);
    // An unlinked image file while open.
    let h = v.open(ROOT_INO, b"/etc/hostname", RDONLY, 0).unwrap();
    v.unlink(ROOT_INO, b"/etc/hostname").unwrap();
    assert_eq!(read_all(&v, h), HOSTNAME);
    v.release(h);
    assert_eq!(v.read(h, 0, &mut [0u8; 8]), Err(Errno::ENOENT));
    // A new file with the same name is a new inode.
    let h2 = create(&mut v, "/etc/hostname", b"new\n");
    assert_ne!(h2, h);
    assert_eq!(read_path(&v, "/etc/hostname"), b"new\n");
    check_accounting(&v);
}

#[test]
fn rename_files() {
    let (_f, mut v) = vfs();
    let a = create(&mut v, "/tmp/a", b"AAA");
    let b = create(&mut v, "/tmp/b", b"BBBBBB");
    let before = v.overlay_bytes();
    v.rename(ROOT_INO, b"/tmp/a", ROOT_INO, b"/tmp/b", 0).unwrap();
    assert_eq!(r(&v, "/tmp/b").unwrap(), a);
    assert_eq!(read_path(&v, "/tmp/b"), b"AAA");
    assert_eq!(r(&v, "/tmp/a"), Err(Errno::ENOENT));
    assert_eq!(v.stat(b), Err(Errno::ENOENT)); // replaced and not held: freed
    assert_eq!(v.overlay_bytes(), before - NODE_COST - 6 - entry_cost(b"a"));
    assert_eq!(names(&v, "/tmp"), [".", "..", "b"]);
    // Over an image file, across directories.
    let etc = r(&v, "/etc").unwrap();
    let tmp = r(&v, "/tmp").unwrap();
    v.rename(tmp, b"b", etc, b"os-release", 0).unwrap();
    assert_eq!(read_path(&v, "/etc/os-release"), b"AAA");
    // An image file moved away.
    let hn = r(&v, "/etc/hostname").unwrap();
    v.rename(ROOT_INO, b"/etc/hostname", ROOT_INO, b"/tmp/hn", 0).unwrap();
    assert_eq!(r(&v, "/tmp/hn").unwrap(), hn);
    assert_eq!(read_path(&v, "/tmp/hn"), HOSTNAME);
    assert_eq!(r(&v, "/etc/hostname"), Err(Errno::ENOENT));
    // Same inode: nothing happens.
    v.rename(ROOT_INO, b"/tmp/hn", ROOT_INO, b"/tmp/hn", 0).unwrap();
    assert_eq!(r(&v, "/tmp/hn").unwrap(), hn);
    // Errors.
    assert_eq!(v.rename(ROOT_INO, b"/tmp/nope", ROOT_INO, b"/tmp/x", 0), Err(Errno::ENOENT));
    assert_eq!(v.rename(ROOT_INO, b"/tmp/hn", ROOT_INO, b"/nope/x", 0), Err(Errno::ENOENT));
    assert_eq!(v.rename(ROOT_INO, b"/tmp/hn", ROOT_INO, b"/usr", 0), Err(Errno::EISDIR));
    assert_eq!(v.rename(ROOT_INO, b"/tmp/hn/", ROOT_INO, b"/tmp/x", 0), Err(Errno::ENOTDIR));
    assert_eq!(v.rename(ROOT_INO, b"/tmp/hn", ROOT_INO, b"/tmp/x/", 0), Err(Errno::ENOTDIR));
    assert_eq!(v.rename(ROOT_INO, b"/tmp/hn", ROOT_INO, b"/etc/os-release", RENAME_NOREPLACE), Err(Errno::EEXIST));
    assert_eq!(v.rename(ROOT_INO, b"/tmp/hn", ROOT_INO, b"/tmp/x", 4), Err(Errno::EINVAL));
    assert_eq!(v.rename(ROOT_INO, b"/tmp/.", ROOT_INO, b"/tmp/x", 0), Err(Errno::EBUSY));
    assert_eq!(v.rename(ROOT_INO, b"/tmp/hn", ROOT_INO, b"/", 0), Err(Errno::EBUSY));
    // RENAME_NOREPLACE to a free name works; RENAME_EXCHANGE swaps.
    v.rename(ROOT_INO, b"/tmp/hn", ROOT_INO, b"/tmp/hn2", RENAME_NOREPLACE).unwrap();
    v.rename(ROOT_INO, b"/tmp/hn2", ROOT_INO, b"/etc/os-release", RENAME_EXCHANGE).unwrap();
    assert_eq!(read_path(&v, "/etc/os-release"), HOSTNAME);
    assert_eq!(read_path(&v, "/tmp/hn2"), b"AAA");
    assert_eq!(v.rename(ROOT_INO, b"/tmp/hn2", ROOT_INO, b"/tmp/zz", RENAME_EXCHANGE), Err(Errno::ENOENT));
    // A symlink is renamed as itself.
    v.rename(ROOT_INO, b"/lib", ROOT_INO, b"/lib2", 0).unwrap();
    assert_eq!(v.readlink(ROOT_INO, b"/lib2").unwrap(), b"usr/lib");
    assert_eq!(read_path(&v, "/lib2/python3.11/os.py"), OS_PY);
    check_accounting(&v);
}

#[test]
fn rename_directories() {
    let (_f, mut v) = vfs();
    // Move an image directory (with image children) somewhere else.
    let py = r(&v, "/usr/lib/python3.11").unwrap();
    let json = r(&v, "/usr/lib/python3.11/json").unwrap();
    v.rename(ROOT_INO, b"/usr/lib/python3.11", ROOT_INO, b"/tmp/py", 0).unwrap();
    assert_eq!(r(&v, "/tmp/py").unwrap(), py);
    assert_eq!(read_path(&v, "/tmp/py/os.py"), OS_PY);
    assert_eq!(read_path(&v, "/tmp/py/json/__init__.py"), b"# json\n");
    assert_eq!(r(&v, "/tmp/py/json/../..").unwrap(), r(&v, "/tmp").unwrap());
    assert_eq!(v.dir_path(json).unwrap(), b"/tmp/py/json");
    assert_eq!(v.dir_path(py).unwrap(), b"/tmp/py");
    assert_eq!(r(&v, "/usr/lib/python3.11"), Err(Errno::ENOENT));
    assert_eq!(names(&v, "/usr/lib"), [".", "..", "x86_64-linux-gnu"]);
    assert_eq!(v.readdir(json).unwrap()[1].ino, py);
    // Into its own subtree.
    assert_eq!(v.rename(ROOT_INO, b"/tmp/py", ROOT_INO, b"/tmp/py/json/x", 0), Err(Errno::EINVAL));
    assert_eq!(v.rename(ROOT_INO, b"/tmp/py", ROOT_INO, b"/tmp/py/x", 0), Err(Errno::EINVAL));
    // Over a non-empty directory, over a file, over an empty directory.
    assert_eq!(v.rename(ROOT_INO, b"/tmp/py", ROOT_INO, b"/usr/share", 0), Err(Errno::ENOTEMPTY));
    assert_eq!(v.rename(ROOT_INO, b"/tmp/py/json", ROOT_INO, b"/tmp/py", 0), Err(Errno::ENOTEMPTY));
    assert_eq!(v.rename(ROOT_INO, b"/tmp/py", ROOT_INO, b"/etc/hostname", 0), Err(Errno::ENOTDIR));
    let empty = r(&v, "/emptydir").unwrap();
    v.rename(ROOT_INO, b"/tmp/py", ROOT_INO, b"/emptydir/", 0).unwrap();
    assert_eq!(r(&v, "/emptydir").unwrap(), py);
    assert_eq!(v.stat(empty), Err(Errno::ENOENT));
    assert_eq!(read_path(&v, "/emptydir/json/__init__.py"), b"# json\n");
    // Rename within the same directory keeps the parent.
    v.rename(ROOT_INO, b"/emptydir", ROOT_INO, b"/py", 0).unwrap();
    assert_eq!(v.dir_path(json).unwrap(), b"/py/json");
    // A new overlay directory moved under an image directory and back.
    v.mkdir(ROOT_INO, b"/tmp/n", 0o755).unwrap();
    create(&mut v, "/tmp/n/f", b"f");
    v.rename(ROOT_INO, b"/tmp/n", ROOT_INO, b"/usr/share/doc/n", 0).unwrap();
    assert_eq!(read_path(&v, "/usr/share/doc/n/f"), b"f");
    assert_eq!(v.dir_path(r(&v, "/usr/share/doc/n").unwrap()).unwrap(), b"/usr/share/doc/n");
    assert_eq!(v.stat(r(&v, "/usr/share/doc").unwrap()).unwrap().nlink, 3);
    assert_eq!(v.stat(r(&v, "/tmp").unwrap()).unwrap().nlink, 2);
    // Exchange two directories in different parents.
    v.rename(ROOT_INO, b"/usr/share/doc/n", ROOT_INO, b"/py/json", RENAME_EXCHANGE).unwrap();
    assert_eq!(read_path(&v, "/py/json/f"), b"f");
    assert_eq!(read_path(&v, "/usr/share/doc/n/__init__.py"), b"# json\n");
    assert_eq!(v.dir_path(json).unwrap(), b"/usr/share/doc/n");
    check_accounting(&v);
}

#[test]
fn readdir_lists_exactly() {
    let (_f, mut v) = vfs();
    assert_eq!(names(&v, "/etc"), [".", "..", "dangling_rel", "hostname", "os-release"]);
    create(&mut v, "/etc/zz", b"");
    create(&mut v, "/etc/aa", b"");
    v.mkdir(ROOT_INO, b"/etc/mm", 0o755).unwrap();
    v.symlink(b"hostname", ROOT_INO, b"/etc/ll").unwrap();
    v.unlink(ROOT_INO, b"/etc/os-release").unwrap();
    assert_eq!(names(&v, "/etc"), [".", "..", "aa", "dangling_rel", "hostname", "ll", "mm", "zz"]);
    let ents = v.readdir(r(&v, "/etc").unwrap()).unwrap();
    let kind = |n: &str| ents.iter().find(|e| e.name == n.as_bytes()).unwrap().kind;
    assert_eq!(kind("."), FileType::Dir);
    assert_eq!(kind("mm"), FileType::Dir);
    assert_eq!(kind("ll"), FileType::Symlink);
    assert_eq!(kind("hostname"), FileType::File);
    assert_eq!(ents[1].ino, ROOT_INO);
    // The root: ".." is itself; defaults were added.
    let root = v.readdir(ROOT_INO).unwrap();
    assert_eq!(root[1].ino, ROOT_INO);
    let rn = names(&v, "/");
    for d in ["dev", "tmp", "proc", "root", "etc", "usr", "lib"] {
        assert!(rn.iter().any(|n| n == d), "{d} missing from {rn:?}");
    }
    assert_eq!(v.readdir(r(&v, "/etc/hostname").unwrap()), Err(Errno::ENOTDIR));
    assert_eq!(
        names(&v, "/dev"),
        [
            ".", "..", "fd", "full", "null", "ptmx", "random", "shm", "stderr", "stdin", "stdout", "tty", "urandom",
            "zero"
        ]
    );
    assert_eq!(v.readlink(ROOT_INO, b"/dev/stdin").unwrap(), b"/proc/self/fd/0");
    assert_eq!(names(&v, "/proc"), [".", ".."]);
}

#[test]
fn clones_are_independent() {
    let (f, mut a) = vfs();
    let new = create(&mut a, "/tmp/shared", b"base");
    let hn = r(&a, "/etc/hostname").unwrap();
    let mut b = a.clone();
    // A new file created in the clone.
    create(&mut b, "/tmp/only_b", b"b");
    assert_eq!(r(&a, "/tmp/only_b"), Err(Errno::ENOENT));
    create(&mut a, "/tmp/only_a", b"a");
    assert_eq!(r(&b, "/tmp/only_a"), Err(Errno::ENOENT));
    assert_eq!(names(&a, "/tmp"), [".", "..", "only_a", "shared"]);
    assert_eq!(names(&b, "/tmp"), [".", "..", "only_b", "shared"]);
    // A file that existed before the clone, written on both sides.
    b.write(new, 0, b"BBBB").unwrap();
    assert_eq!(read_all(&a, new), b"base");
    a.write(new, 4, b"+a").unwrap();
    assert_eq!(read_all(&a, new), b"base+a");
    assert_eq!(read_all(&b, new), b"BBBB");
    // A copied-up image file.
    b.write(hn, 0, b"clone-b").unwrap();
    assert_eq!(read_all(&a, hn), HOSTNAME);
    a.truncate(hn, 4).unwrap();
    assert_eq!(read_all(&a, hn), b"fork");
    assert_eq!(read_all(&b, hn), b"clone-b\n");
    assert_eq!(f.image.content(hn as u32).unwrap(), HOSTNAME);
    // Directory listings of an image directory.
    b.unlink(ROOT_INO, b"/etc/os-release").unwrap();
    a.mkdir(ROOT_INO, b"/etc/a.d", 0o755).unwrap();
    assert_eq!(names(&a, "/etc"), [".", "..", "a.d", "dangling_rel", "hostname", "os-release"]);
    assert_eq!(names(&b, "/etc"), [".", "..", "dangling_rel", "hostname"]);
    // Clone of a clone, and renames.
    let mut c = b.clone();
    c.rename(ROOT_INO, b"/etc/hostname", ROOT_INO, b"/tmp/h", 0).unwrap();
    assert_eq!(read_path(&b, "/etc/hostname"), b"clone-b\n");
    assert_eq!(read_path(&c, "/tmp/h"), b"clone-b\n");
    assert_eq!(r(&b, "/tmp/h"), Err(Errno::ENOENT));
    // Quota accounting is per clone.
    check_accounting(&a);
    check_accounting(&b);
    check_accounting(&c);
    // Small writes after a clone copy the file once, then write in place.
    let mut d = a.clone();
    let shared = a.file_bytes(new).unwrap().as_ptr();
    assert_eq!(d.file_bytes(new).unwrap().as_ptr(), shared);
    d.write(new, 0, b"d").unwrap();
    let own = d.file_bytes(new).unwrap().as_ptr();
    assert_ne!(own, shared);
    for i in 1..6u64 {
        d.write(new, i, b"x").unwrap();
        assert_eq!(d.file_bytes(new).unwrap().as_ptr(), own);
    }
    assert_eq!(read_all(&d, new), b"dxxxxx");
    assert_eq!(read_all(&a, new), b"base+a");
    assert_eq!(a.file_bytes(new).unwrap().as_ptr(), shared);
    // ... and the original, no longer shared, writes in place too.
    a.write(new, 0, b"A").unwrap();
    assert_eq!(a.file_bytes(new).unwrap().as_ptr(), shared);
    assert_eq!(read_all(&d, new), b"dxxxxx");
}

#[test]
fn quota_enospc() {
    let (_f, mut v) = vfs();
    let base = v.overlay_bytes();
    let q = NODE_COST + entry_cost(b"q");
    v.set_quota(base + q + 10_000);
    let t = v.open(ROOT_INO, b"/tmp/q", CREAT | WRONLY, 0o644).unwrap();
    v.write(t, 0, &[1u8; 9_000]).unwrap();
    assert_eq!(v.write(t, 9_000, &[1u8; 1_001]), Err(Errno::ENOSPC));
    v.write(t, 9_000, &[1u8; 1_000]).unwrap();
    assert_eq!(v.overlay_bytes(), base + q + 10_000);
    // Overwriting in place needs no space; growing does.
    v.write(t, 0, &[2u8; 10_000]).unwrap();
    assert_eq!(v.write(t, 10_000, b"x"), Err(Errno::ENOSPC));
    assert_eq!(v.truncate(t, 10_001), Err(Errno::ENOSPC));
    assert_eq!(v.write(t, 1 << 40, b"x"), Err(Errno::ENOSPC));
    // New nodes cost too.
    assert_eq!(v.open(ROOT_INO, b"/tmp/q2", CREAT | WRONLY, 0o644), Err(Errno::ENOSPC));
    assert_eq!(v.mkdir(ROOT_INO, b"/tmp/qd", 0o755), Err(Errno::ENOSPC));
    // Copy-up of an image file is charged.
    let big = r(&v, "/data/big.bin").unwrap();
    assert_eq!(v.write(big, 0, b"x"), Err(Errno::ENOSPC));
    assert_eq!(read_path(&v, "/data/big.bin"), big_bytes());
    // Shrinking frees space.
    v.truncate(t, 100).unwrap();
    assert_eq!(v.overlay_bytes(), base + q + 100);
    v.write(t, 100, &[3u8; 500]).unwrap();
    // Deleting frees space.
    v.release(t);
    v.unlink(ROOT_INO, b"/tmp/q").unwrap();
    assert_eq!(v.overlay_bytes(), base);
    v.set_quota(u64::MAX);
    v.write(big, 0, b"x").unwrap();
    assert_eq!(v.overlay_bytes(), base + NODE_COST + 10_000);
    check_accounting(&v);
    // The default quota stops huge sparse writes without allocating.
    let mut w = Vfs::new(v.image().clone());
    let t = w.open(ROOT_INO, b"/tmp/huge", CREAT | WRONLY, 0o644).unwrap();
    assert_eq!(w.write(t, DEFAULT_QUOTA, b"x"), Err(Errno::ENOSPC));
    assert_eq!(w.truncate(t, 1 << 50), Err(Errno::ENOSPC));
}

#[test]
fn devices() {
    let (_f, mut v) = vfs();
    let null = v.open(ROOT_INO, b"/dev/null", RDWR, 0).unwrap();
    let st = v.stat(null).unwrap();
    assert_eq!(st.kind, FileType::CharDev);
    assert_eq!(st.mode(), libc::S_IFCHR | 0o666);
    assert_eq!(st.rdev, makedev(1, 3));
    let mut buf = [9u8; 64];
    assert_eq!(v.read(null, 0, &mut buf).unwrap(), 0);
    assert_eq!(buf, [9u8; 64]);
    let before = v.overlay_bytes();
    assert_eq!(v.write(null, 0, &[1u8; 1000]).unwrap(), 1000);
    assert_eq!(v.stat(null).unwrap().size, 0);
    assert_eq!(v.overlay_bytes(), before);
    // O_TRUNC on a device is ignored; truncate(2) is not allowed.
    assert_eq!(v.open(ROOT_INO, b"/dev/null", WRONLY | TRUNC | CREAT, 0o644).unwrap(), null);
    assert_eq!(v.truncate(null, 0), Err(Errno::EINVAL));
    assert_eq!(v.file_bytes(null), Err(Errno::EINVAL));

    let zero = r(&v, "/dev/zero").unwrap();
    assert_eq!(v.read(zero, 12345, &mut buf).unwrap(), 64);
    assert_eq!(buf, [0u8; 64]);
    assert_eq!(v.write(zero, 0, b"abc").unwrap(), 3);
    assert_eq!(v.stat(zero).unwrap().rdev, makedev(1, 5));

    let full = r(&v, "/dev/full").unwrap();
    assert_eq!(v.write(full, 0, b"abc"), Err(Errno::ENOSPC));

    let ur = r(&v, "/dev/urandom").unwrap();
    let (mut x, mut y) = ([0u8; 32], [0u8; 32]);
    assert_eq!(v.read(ur, 0, &mut x).unwrap(), 32);
    assert_eq!(v.read(ur, 0, &mut y).unwrap(), 32);
    assert_ne!(x, y);
    assert_ne!(x, [0u8; 32]);
    let rnd = r(&v, "/dev/random").unwrap();
    assert_eq!(v.read(rnd, 0, &mut x).unwrap(), 32);
    assert_eq!(v.stat(ur).unwrap().rdev, makedev(1, 9));
}

#[test]
fn defaults_and_metadata() {
    let (_f, mut v) = vfs();
    let tmp = v.stat(r(&v, "/tmp").unwrap()).unwrap();
    assert_eq!(tmp.mode(), libc::S_IFDIR | 0o1777);
    assert_eq!(v.stat(r(&v, "/root").unwrap()).unwrap().kind, FileType::Dir);
    assert_eq!(v.stat(r(&v, "/proc").unwrap()).unwrap().kind, FileType::Dir);
    // Image metadata is passed through.
    let py = v.stat(r(&v, "/usr/bin/python3").unwrap()).unwrap();
    assert_eq!((py.perm, py.size, py.nlink), (0o755, 9, 1));
    assert!(py.mtime_ns > 0);
    // The root's nlink counts its subdirectories (etc usr data emptydir dev tmp proc root).
    assert_eq!(v.stat(ROOT_INO).unwrap().nlink, 2 + 8);
    // access: root may read/write anything, X_OK needs an x bit.
    v.access(ROOT_INO, b"/usr/bin/python3", libc::X_OK, true).unwrap();
    v.access(ROOT_INO, b"/bin/python", libc::X_OK | libc::R_OK, true).unwrap();
    v.access(ROOT_INO, b"/etc/hostname", libc::R_OK | libc::W_OK, true).unwrap();
    assert_eq!(v.access(ROOT_INO, b"/etc/hostname", libc::X_OK, true), Err(Errno::EACCES));
    v.access(ROOT_INO, b"/etc", libc::X_OK, true).unwrap();
    assert_eq!(v.access(ROOT_INO, b"/dangling", libc::F_OK, true), Err(Errno::ENOENT));
    v.access(ROOT_INO, b"/dangling", libc::F_OK, false).unwrap();
    assert_eq!(v.access(ROOT_INO, b"/etc", 8, true), Err(Errno::EINVAL));
    // chmod / set_times on an image file copy metadata only.
    let hn = r(&v, "/etc/hostname").unwrap();
    let before = v.overlay_bytes();
    v.chmod(hn, 0o100755).unwrap();
    v.set_times(hn, 1_234_567_890_123_456_789).unwrap();
    let st = v.stat(hn).unwrap();
    assert_eq!((st.perm, st.mtime_sec(), st.mtime_nsec()), (0o755, 1_234_567_890, 123_456_789));
    assert_eq!(v.overlay_bytes(), before + NODE_COST);
    v.access(ROOT_INO, b"/etc/hostname", libc::X_OK, true).unwrap();
    assert_eq!(read_all(&v, hn), HOSTNAME);
    // Hard links.
    v.link(ROOT_INO, b"/etc/hostname", ROOT_INO, b"/tmp/hl", false).unwrap();
    assert_eq!(r(&v, "/tmp/hl").unwrap(), hn);
    assert_eq!(v.stat(hn).unwrap().nlink, 2);
    assert_eq!(v.link(ROOT_INO, b"/etc", ROOT_INO, b"/tmp/dl", false), Err(Errno::EPERM));
    assert_eq!(v.link(ROOT_INO, b"/etc/hostname", ROOT_INO, b"/tmp/hl", false), Err(Errno::EEXIST));
    v.unlink(ROOT_INO, b"/etc/hostname").unwrap();
    assert_eq!(v.stat(hn).unwrap().nlink, 1);
    assert_eq!(read_path(&v, "/tmp/hl"), HOSTNAME);
    // Symlink creation errors.
    assert_eq!(v.symlink(b"", ROOT_INO, b"/tmp/s"), Err(Errno::ENOENT));
    assert_eq!(v.symlink(b"x", ROOT_INO, b"/tmp/hl"), Err(Errno::EEXIST));
    assert_eq!(v.symlink(&[b'a'; 4096], ROOT_INO, b"/tmp/s"), Err(Errno::ENAMETOOLONG));
    // An absolute symlink created by the guest resolves inside the VFS.
    v.symlink(b"/../etc/os-release", ROOT_INO, b"/tmp/s").unwrap();
    assert_eq!(read_path(&v, "/tmp/s"), b"ID=debian\n");
    let s = v.resolve(ROOT_INO, b"/tmp/s", false).unwrap();
    assert_eq!(v.stat(s).unwrap().size, 18);
    check_accounting(&v);
}

#[test]
fn vfs_is_send_and_sync() {
    fn check<T: Send + Sync + Clone>() {}
    check::<Vfs>();
}

#[test]
fn deep_trees() {
    let (_f, mut v) = vfs();
    // Deeper than any path can name: built with relative mkdirs (like mkdirat on a dirfd).
    v.mkdir(ROOT_INO, b"/tmp/top", 0o755).unwrap();
    let top = r(&v, "/tmp/top").unwrap();
    let mut cur = top;
    for _ in 0..3000 {
        v.mkdir(cur, b"d", 0o755).unwrap();
        cur = v.resolve(cur, b"d", true).unwrap();
    }
    assert_eq!(v.dir_path(cur), Err(Errno::ENAMETOOLONG));
    assert_eq!(v.rename(ROOT_INO, b"/tmp/top", cur, b"x", 0), Err(Errno::EINVAL));
    v.rename(ROOT_INO, b"/tmp/top", ROOT_INO, b"/top2", 0).unwrap();
    assert_eq!(
        v.resolve(cur, b"../..", true).unwrap(),
        v.resolve(cur, b"..", true).and_then(|p| v.resolve(p, b"..", true)).unwrap()
    );
    check_accounting(&v);
}
