//! Property tests of the image reader (`Image::open`): a small packed image with
//! random truncations, bit flips, byte and word overwrites — raw (the header and
//! index checksum must catch them) and resealed (the index checksum recomputed,
//! so the index decoder and its validation are reached). `open` must return a
//! clean error or an image every accessor of which works without a panic.
#![allow(clippy::unwrap_used)] // a test may unwrap: a panic is its failure

use std::path::{Path, PathBuf};
use std::sync::OnceLock;

use forkbox_image::{pack_dir_with, Image, PackOptions};
use proptest::prelude::*;
use sha2::{Digest, Sha256};

const HEADER_LEN: usize = 152;
const CHECKSUM_AT: usize = 120;

fn packed() -> &'static (tempfile::TempDir, Vec<u8>) {
    static P: OnceLock<(tempfile::TempDir, Vec<u8>)> = OnceLock::new();
    P.get_or_init(|| {
        let tmp = tempfile::tempdir().unwrap();
        let root = tmp.path().join("root");
        std::fs::create_dir_all(root.join("etc/deep/er")).unwrap();
        std::fs::create_dir_all(root.join("bin")).unwrap();
        std::fs::write(root.join("etc/hostname"), b"props\n").unwrap();
        std::fs::write(root.join("etc/deep/er/big"), vec![7u8; 10_000]).unwrap();
        std::fs::write(root.join("bin/tool"), b"\x7fELF not really").unwrap();
        std::os::unix::fs::symlink("../etc/hostname", root.join("bin/link")).unwrap();
        std::os::unix::fs::symlink("/etc", root.join("abs")).unwrap();
        let out = tmp.path().join("image");
        pack_dir_with(&root, &out, &PackOptions { id: None, mtime_clamp: Some(1_600_000_000) }).unwrap();
        let bytes = std::fs::read(&out).unwrap();
        (tmp, bytes)
    })
}

fn u64_at(b: &[u8], o: usize) -> u64 {
    u64::from_le_bytes(b[o..o + 8].try_into().unwrap())
}

/// Recompute the checksum over the (mutated) header fields and index, when the
/// header's index range lies inside the file.
fn reseal(mut b: Vec<u8>) -> Vec<u8> {
    if b.len() < HEADER_LEN {
        return b;
    }
    let (off, len) = (u64_at(&b, 24), u64_at(&b, 32));
    let Some(end) = off.checked_add(len).filter(|&e| e <= b.len() as u64) else { return b };
    let mut h = Sha256::new();
    h.update(&b[..CHECKSUM_AT]);
    h.update(&b[off as usize..end as usize]);
    let sum: [u8; 32] = h.finalize().into();
    b[CHECKSUM_AT..CHECKSUM_AT + 32].copy_from_slice(&sum);
    b
}

fn exercise(path: &Path) {
    let Ok(img) = Image::open(path) else { return };
    let _ = (img.id(), img.content_hash(), img.path());
    let n = img.inode_count();
    for ino in 0..n.saturating_add(2) {
        let _ = img.meta(ino);
        let _ = img.name(ino);
        let _ = img.read_link(ino);
        let _ = img.content(ino);
        let _ = img.content_offset(ino);
        if ino < n {
            let _ = img.parent(ino);
            for (name, child) in img.children(ino) {
                let _ = img.lookup(ino, name);
                let _ = img.meta(child);
            }
            let _ = img.lookup(ino, b"hostname");
        }
    }
    let _ = img.verify_content();
}

fn check(bytes: &[u8]) {
    let dir = tempfile::tempdir().unwrap();
    let p: PathBuf = dir.path().join("x.img");
    std::fs::write(&p, bytes).unwrap();
    exercise(&p);
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 300, ..ProptestConfig::default() })]

    #[test]
    fn mutated_images_open_cleanly_or_not_at_all(
        muts in prop::collection::vec((any::<usize>(), any::<u8>(), 0u8..4, any::<u64>()), 1..6),
        index_only in any::<bool>(),
    ) {
        let g = packed().1.clone();
        let index_off = u64_at(&g, 24) as usize;
        let mut b = g;
        for (i, v, kind, w) in muts {
            let lo = if index_only { index_off } else { 0 };
            let n = b.len().saturating_sub(lo);
            if n == 0 {
                break;
            }
            let at = lo + i % n;
            match kind {
                0 => b[at] ^= 1 << (v % 8),
                1 => b[at] = v,
                2 => {
                    let e = (at + 8).min(b.len());
                    b[at..e].copy_from_slice(&w.to_le_bytes()[..e - at]);
                }
                _ => b.truncate(at),
            }
        }
        check(&b);
        check(&reseal(b));
    }

    #[test]
    fn random_headers(fields in prop::collection::vec(any::<u64>(), 4), small in prop::collection::vec(0u64..5000, 4)) {
        let mut b = packed().1.clone();
        for (k, o) in [24usize, 32, 40, 48].iter().enumerate() {
            let v = if k % 2 == 0 { fields[k] } else { small[k] };
            b[*o..*o + 8].copy_from_slice(&v.to_le_bytes());
        }
        check(&b);
        check(&reseal(b));
    }
}

#[test]
fn the_packed_image_opens() {
    let dir = tempfile::tempdir().unwrap();
    let p = dir.path().join("x.img");
    std::fs::write(&p, &packed().1).unwrap();
    let img = Image::open(&p).unwrap();
    assert!(img.inode_count() >= 8);
    img.verify_content().unwrap();
}
