//! Round-trip and corruption tests for pack_dir + Image.

use std::fs;
use std::os::unix::fs::{symlink, PermissionsExt};
use std::path::Path;
use std::time::{Duration, SystemTime};

use crate::{pack_dir, pack_dir_with, Image, ImageError, NodeKind, PackOptions};

fn set_mtime(p: &Path, secs: u64) {
    let f = fs::File::options().write(true).open(p).or_else(|_| fs::File::open(p)).unwrap();
    f.set_modified(SystemTime::UNIX_EPOCH + Duration::from_secs(secs)).unwrap();
}

/// root/
///   a.txt            "hello"
///   bin/tool         0o755, 3 pages + 5 bytes
///   empty            0 bytes
///   lib/
///     ld.so          "ELF"
///     py/
///       deep/x.py    "print(1)"
///   link_abs   -> /lib/ld.so
///   link_rel   -> ../lib/ld.so   (inside bin/)  ... see below
///   dangling   -> nowhere/at/all
///   emptydir/
fn make_tree(root: &Path) -> Vec<u8> {
    let big: Vec<u8> = (0..3 * 4096 + 5).map(|i| (i * 7 % 251) as u8).collect();
    fs::create_dir_all(root.join("bin")).unwrap();
    fs::create_dir_all(root.join("lib/py/deep")).unwrap();
    fs::create_dir_all(root.join("emptydir")).unwrap();
    fs::write(root.join("a.txt"), b"hello").unwrap();
    fs::set_permissions(root.join("a.txt"), fs::Permissions::from_mode(0o644)).unwrap();
    fs::write(root.join("bin/tool"), &big).unwrap();
    fs::set_permissions(root.join("bin/tool"), fs::Permissions::from_mode(0o755)).unwrap();
    fs::write(root.join("empty"), b"").unwrap();
    fs::set_permissions(root.join("empty"), fs::Permissions::from_mode(0o600)).unwrap();
    fs::write(root.join("lib/ld.so"), b"ELF").unwrap();
    fs::write(root.join("lib/py/deep/x.py"), b"print(1)").unwrap();
    symlink("/lib/ld.so", root.join("link_abs")).unwrap();
    symlink("../lib/ld.so", root.join("bin/link_rel")).unwrap();
    symlink("nowhere/at/all", root.join("dangling")).unwrap();
    fs::set_permissions(root.join("emptydir"), fs::Permissions::from_mode(0o1777)).unwrap();
    set_mtime(&root.join("a.txt"), 1_000_000_000);
    big
}

fn path_lookup(img: &Image, path: &str) -> Option<u32> {
    let mut ino = Image::ROOT;
    for c in path.split('/').filter(|c| !c.is_empty()) {
        ino = img.lookup(ino, c.as_bytes())?;
    }
    Some(ino)
}

#[test]
fn round_trip() {
    let dir = tempfile::tempdir().unwrap();
    let root = dir.path().join("tree");
    let big = make_tree(&root);
    let out = dir.path().join("t.img");
    let id = pack_dir(&root, &out).unwrap();
    assert_eq!(id.len(), 64);
    let img = Image::open(&out).unwrap();
    assert_eq!(img.id(), id);
    assert_eq!(img.content_hash(), id);
    img.verify_content().unwrap();

    // 1 root + a.txt bin dangling empty emptydir lib link_abs + tool link_rel + ld.so py + deep + x.py
    assert_eq!(img.inode_count(), 14);
    let names: Vec<&[u8]> = img.children(Image::ROOT).iter().map(|(n, _)| *n).collect();
    assert_eq!(names, vec![&b"a.txt"[..], b"bin", b"dangling", b"empty", b"emptydir", b"lib", b"link_abs"]);
    for (name, ino) in img.children(Image::ROOT) {
        assert_eq!(img.lookup(Image::ROOT, name), Some(ino));
        assert_eq!(img.parent(ino), Image::ROOT);
        assert_eq!(img.name(ino), Some(name));
    }
    assert_eq!(img.parent(Image::ROOT), Image::ROOT);
    assert_eq!(img.lookup(Image::ROOT, b"nope"), None);
    assert_eq!(img.lookup(Image::ROOT, b"."), None);
    assert_eq!(img.lookup(Image::ROOT, b".."), None);
    assert_eq!(img.lookup(Image::ROOT, b""), None);

    let root_meta = img.meta(Image::ROOT).unwrap();
    assert_eq!(root_meta.kind, NodeKind::Dir);
    assert_eq!(root_meta.size, 4096);

    let a = path_lookup(&img, "a.txt").unwrap();
    let m = img.meta(a).unwrap();
    assert_eq!((m.kind, m.size, m.perm, m.mtime), (NodeKind::File, 5, 0o644, 1_000_000_000));
    assert_eq!(img.content(a), Some(&b"hello"[..]));
    assert_eq!(img.read_link(a), None);
    assert_eq!(img.lookup(a, b"x"), None);
    assert!(img.children(a).is_empty());
    assert_eq!(img.content_offset(a).unwrap() % 4096, 0);

    let tool = path_lookup(&img, "bin/tool").unwrap();
    let m = img.meta(tool).unwrap();
    assert_eq!((m.kind, m.perm, m.size), (NodeKind::File, 0o755, big.len() as u64));
    assert_eq!(img.content(tool), Some(&big[..]));
    assert_eq!(img.content_offset(tool).unwrap() % 4096, 0);

    let empty = path_lookup(&img, "empty").unwrap();
    let m = img.meta(empty).unwrap();
    assert_eq!((m.kind, m.perm, m.size), (NodeKind::File, 0o600, 0));
    assert_eq!(img.content(empty), Some(&b""[..]));

    let ed = path_lookup(&img, "emptydir").unwrap();
    let m = img.meta(ed).unwrap();
    assert_eq!((m.kind, m.perm), (NodeKind::Dir, 0o1777));
    assert!(img.children(ed).is_empty());
    assert_eq!(img.content(ed), None);

    let abs = path_lookup(&img, "link_abs").unwrap();
    let m = img.meta(abs).unwrap();
    assert_eq!((m.kind, m.size), (NodeKind::Symlink, 10));
    assert_eq!(img.read_link(abs), Some(&b"/lib/ld.so"[..]));
    assert_eq!(img.content(abs), None);
    // lookup never follows symlinks
    assert_eq!(img.lookup(abs, b"ld.so"), None);

    let rel = path_lookup(&img, "bin/link_rel").unwrap();
    assert_eq!(img.read_link(rel), Some(&b"../lib/ld.so"[..]));
    assert_eq!(img.parent(rel), path_lookup(&img, "bin").unwrap());
    let dangling = path_lookup(&img, "dangling").unwrap();
    assert_eq!(img.read_link(dangling), Some(&b"nowhere/at/all"[..]));

    let x = path_lookup(&img, "lib/py/deep/x.py").unwrap();
    assert_eq!(img.content(x), Some(&b"print(1)"[..]));
    let deep = img.parent(x);
    assert_eq!(img.name(deep), Some(&b"deep"[..]));
    assert_eq!(img.parent(img.parent(deep)), path_lookup(&img, "lib").unwrap());

    // out of range
    let n = img.inode_count();
    assert_eq!(img.meta(n), None);
    assert_eq!(img.content(n), None);
    assert_eq!(img.read_link(n), None);
    assert!(img.children(n).is_empty());
    assert_eq!(img.lookup(n, b"a"), None);
    assert_eq!(img.parent(n), Image::ROOT);

    // every inode is reachable exactly once and dense
    let mut seen = vec![false; n as usize];
    let mut stack = vec![Image::ROOT];
    seen[0] = true;
    while let Some(d) = stack.pop() {
        for (_, c) in img.children(d) {
            assert!(!seen[c as usize]);
            seen[c as usize] = true;
            if img.meta(c).unwrap().kind == NodeKind::Dir {
                stack.push(c);
            }
        }
    }
    assert!(seen.iter().all(|s| *s));
}

#[test]
fn deterministic_and_options() {
    let dir = tempfile::tempdir().unwrap();
    let root = dir.path().join("tree");
    make_tree(&root);
    let id1 = pack_dir(&root, &dir.path().join("1.img")).unwrap();
    let id2 = pack_dir(&root, &dir.path().join("2.img")).unwrap();
    assert_eq!(id1, id2);
    assert_eq!(fs::read(dir.path().join("1.img")).unwrap(), fs::read(dir.path().join("2.img")).unwrap());

    let want = "ab".repeat(32);
    let stats =
        pack_dir_with(&root, &dir.path().join("3.img"), &PackOptions { id: Some(want.clone()), mtime_clamp: Some(5) })
            .unwrap();
    assert_eq!(stats.id, want);
    assert_eq!(stats.files, 5);
    let img = Image::open(&dir.path().join("3.img")).unwrap();
    assert_eq!(img.id(), want);
    assert_ne!(img.content_hash(), want);
    assert!((0..img.inode_count()).all(|i| img.meta(i).unwrap().mtime <= 5));
    assert!(pack_dir_with(
        &root,
        &dir.path().join("4.img"),
        &PackOptions { id: Some("xyz".into()), mtime_clamp: None }
    )
    .is_err());
    // no temp files left behind
    let left: Vec<_> = fs::read_dir(dir.path()).unwrap().map(|e| e.unwrap().file_name()).collect();
    assert_eq!(left.len(), 4, "{left:?}");
}

#[test]
fn skips_special_files() {
    let dir = tempfile::tempdir().unwrap();
    let root = dir.path().join("tree");
    fs::create_dir(&root).unwrap();
    fs::write(root.join("f"), b"x").unwrap();
    let fifo = std::ffi::CString::new(root.join("fifo").to_str().unwrap()).unwrap();
    // SAFETY: a NUL-terminated path.
    assert_eq!(unsafe { libc::mkfifo(fifo.as_ptr(), 0o644) }, 0);
    let _sock = std::os::unix::net::UnixListener::bind(root.join("sock")).unwrap();
    pack_dir(&root, &dir.path().join("i.img")).unwrap();
    let img = Image::open(&dir.path().join("i.img")).unwrap();
    assert_eq!(img.inode_count(), 2);
    assert!(img.lookup(Image::ROOT, b"f").is_some());
}

fn packed() -> (tempfile::TempDir, std::path::PathBuf, Vec<u8>) {
    let dir = tempfile::tempdir().unwrap();
    let root = dir.path().join("tree");
    make_tree(&root);
    let out = dir.path().join("t.img");
    pack_dir(&root, &out).unwrap();
    let bytes = fs::read(&out).unwrap();
    (dir, out, bytes)
}

fn rewrite(p: &Path, bytes: &[u8]) {
    let _ = fs::set_permissions(p, fs::Permissions::from_mode(0o644));
    fs::write(p, bytes).unwrap();
}

fn index_range(bytes: &[u8]) -> (usize, usize) {
    let off = u64::from_le_bytes(bytes[24..32].try_into().unwrap()) as usize;
    let len = u64::from_le_bytes(bytes[32..40].try_into().unwrap()) as usize;
    (off, len)
}

#[test]
fn corrupt_index_byte() {
    let (_d, out, bytes) = packed();
    let (off, len) = index_range(&bytes);
    for pos in [off, off + len / 2, off + len - 1] {
        let mut b = bytes.clone();
        b[pos] ^= 0x40;
        rewrite(&out, &b);
        match Image::open(&out) {
            Err(ImageError::Corrupt(_, msg)) => assert!(msg.contains("checksum"), "{msg}"),
            other => panic!("expected Corrupt, got {other:?}"),
        }
    }
}

#[test]
fn corrupt_header_fields() {
    let (_d, out, bytes) = packed();
    // id / content hash / offsets are covered by the checksum or bounds checks
    for pos in [24, 33, 40, 60, 90, 125] {
        let mut b = bytes.clone();
        b[pos] ^= 0x01;
        rewrite(&out, &b);
        assert!(matches!(Image::open(&out), Err(ImageError::Corrupt(..))), "byte {pos}");
    }
}

#[test]
fn corrupt_content_detected_by_verify() {
    let (_d, out, bytes) = packed();
    let mut b = bytes.clone();
    b[4096] ^= 1;
    rewrite(&out, &b);
    let img = Image::open(&out).unwrap();
    assert!(matches!(img.verify_content(), Err(ImageError::Corrupt(..))));
}

#[test]
fn truncated() {
    let (_d, out, bytes) = packed();
    for len in [bytes.len() - 1, bytes.len() / 2, 4096, 200, 100, 10] {
        rewrite(&out, &bytes[..len]);
        match Image::open(&out) {
            Err(ImageError::Corrupt(_, msg)) => assert!(msg.contains("truncated"), "{len}: {msg}"),
            other => panic!("{len}: expected Corrupt, got {other:?}"),
        }
    }
    rewrite(&out, b"");
    assert!(matches!(Image::open(&out), Err(ImageError::BadHeader(_))));
}

#[test]
fn wrong_magic_or_version() {
    let (_d, out, bytes) = packed();
    let mut b = bytes.clone();
    b[0] = b'X';
    rewrite(&out, &b);
    let e = Image::open(&out).unwrap_err();
    assert!(matches!(e, ImageError::BadHeader(_)), "{e:?}");
    assert!(e.to_string().contains("not a forkbox image"));
    let mut b = bytes.clone();
    b[12] = 99;
    rewrite(&out, &b);
    assert!(matches!(Image::open(&out), Err(ImageError::BadHeader(_))));
    rewrite(&out, &vec![0u8; 10_000]);
    assert!(matches!(Image::open(&out), Err(ImageError::BadHeader(_))));
    assert!(matches!(Image::open(&out.with_extension("missing")), Err(ImageError::Io { .. })));
}

/// Structurally invalid index with a *valid* checksum (a buggy or malicious writer):
/// validation must reject it without panicking.
#[test]
fn invalid_index_with_valid_checksum() {
    use crate::format::{Header, Index};
    let (_d, out, bytes) = packed();
    let (off, len) = index_range(&bytes);
    let index: Index = postcard::from_bytes(&bytes[off..off + len]).unwrap();
    let header = Header::decode(&bytes).unwrap();
    type Mutation = Box<dyn Fn(&mut Index)>;
    let mutations: Vec<Mutation> = vec![
        Box::new(|i| i.nodes[0].kind = 1),
        Box::new(|i| i.nodes[0].b += 1),
        Box::new(|i| i.nodes[0].a = 0),
        Box::new(|i| i.nodes[1].parent = 5),
        Box::new(|i| i.nodes[1].name_len = 100_000),
        Box::new(|i| i.nodes[1].kind = 7),
        Box::new(|i| i.nodes[2].perm = 0o170000),
        Box::new(|i| {
            let f = i.nodes.iter().position(|n| n.kind == 1 && n.b > 0).unwrap();
            i.nodes[f].b = u64::MAX - 10;
        }),
        Box::new(|i| {
            let f = i.nodes.iter().position(|n| n.kind == 1 && n.b > 0).unwrap();
            i.nodes[f].a += 1;
        }),
        Box::new(|i| {
            let s = i.nodes.iter().position(|n| n.kind == 2).unwrap();
            i.nodes[s].a = u64::MAX;
        }),
        Box::new(|i| i.nodes.swap(1, 2)),
        Box::new(|i| {
            i.nodes.pop();
        }),
        Box::new(|i| i.nodes.clear()),
    ];
    for (k, m) in mutations.iter().enumerate() {
        let mut idx = index.clone();
        m(&mut idx);
        let ib = postcard::to_allocvec(&idx).unwrap();
        let mut h = header.clone();
        h.index_len = ib.len() as u64;
        h.checksum = h.compute_checksum(&ib);
        let mut b = bytes[..off].to_vec();
        b[..crate::format::HEADER_LEN].copy_from_slice(&h.encode());
        b.extend_from_slice(&ib);
        rewrite(&out, &b);
        match Image::open(&out) {
            Err(ImageError::Corrupt(..)) => {}
            other => panic!("mutation {k}: expected Corrupt, got {other:?}"),
        }
    }
}
