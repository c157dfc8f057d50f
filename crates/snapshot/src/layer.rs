//! Layer files: the guest pages one checkpoint changed, over its parent.
//!
//! ```text
//! magic "FBXLAYER" | version u32 | page count u64 | CRC-32 of index+data u32
//! index: page numbers (u64, strictly ascending)
//! data:  4096 bytes per page, in index order
//! ```
//! A session's memory at checkpoint N = the template's memory file with the
//! layers of its ancestry applied, newest first (each page taken from the
//! newest layer that has it). A "flat" layer holds the union of a whole chain.
//! CRC-32 (not SHA-256) because layers are read on every resume and the check
//! is against disk corruption and torn writes, not against an adversary.

use std::fs::File;
use std::io::{Read, Write};
use std::path::Path;

use forkbox_vmm::layout::PAGE_SIZE;
use forkbox_vmm::GuestMemory;

use crate::state::StateError;

pub const LAYER_MAGIC: &[u8; 8] = b"FBXLAYER";
pub const LAYER_VERSION: u32 = 1;
const HEADER: usize = 8 + 4 + 8 + 4;

/// What writing a layer produced.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LayerStats {
    pub pages: u64,
    pub bytes: u64,
    pub crc: u32,
}

fn ioe<'a>(what: &'static str, path: &'a Path) -> impl Fn(std::io::Error) -> StateError + 'a {
    move |source| StateError::Io { what, path: path.display().to_string(), source }
}

/// Page numbers set in a bitmap (one bit per page).
pub fn pages_of(bitmap: &[u64]) -> Vec<u64> {
    let mut out = Vec::new();
    for (w, &word) in bitmap.iter().enumerate() {
        let mut bits = word;
        while bits != 0 {
            out.push(w as u64 * 64 + bits.trailing_zeros() as u64);
            bits &= bits - 1;
        }
    }
    out
}

/// Write the pages `pages` (ascending) of `mem` as a layer at `path`: temp file, fsync, rename.
pub fn write_layer(path: &Path, mem: &GuestMemory, pages: &[u64]) -> Result<LayerStats, StateError> {
    let mut body = Vec::with_capacity(pages.len() * (8 + PAGE_SIZE as usize));
    for p in pages {
        body.extend_from_slice(&p.to_le_bytes());
    }
    for p in pages {
        let page = mem.slice(p * PAGE_SIZE, PAGE_SIZE).map_err(|_| StateError::Corrupt(format!("page {p} outside guest memory")))?;
        body.extend_from_slice(page);
    }
    write_body(path, pages.len() as u64, &body)
}

fn write_body(path: &Path, count: u64, body: &[u8]) -> Result<LayerStats, StateError> {
    let crc = crc32fast::hash(body);
    let tmp = path.with_extension("tmp");
    {
        let mut f = File::create(&tmp).map_err(ioe("create", &tmp))?;
        let mut head = Vec::with_capacity(HEADER);
        head.extend_from_slice(LAYER_MAGIC);
        head.extend_from_slice(&LAYER_VERSION.to_le_bytes());
        head.extend_from_slice(&count.to_le_bytes());
        head.extend_from_slice(&crc.to_le_bytes());
        f.write_all(&head).map_err(ioe("write", &tmp))?;
        f.write_all(body).map_err(ioe("write", &tmp))?;
        f.sync_all().map_err(ioe("fsync", &tmp))?;
    }
    std::fs::rename(&tmp, path).map_err(ioe("rename", path))?;
    Ok(LayerStats { pages: count, bytes: (HEADER + body.len()) as u64, crc })
}

/// A layer read and verified.
pub struct Layer {
    pub pages: Vec<u64>,
    data: Vec<u8>,
}

impl Layer {
    pub fn read(path: &Path) -> Result<Layer, StateError> {
        let mut f = File::open(path).map_err(ioe("open", path))?;
        let mut raw = Vec::new();
        f.read_to_end(&mut raw).map_err(ioe("read", path))?;
        let corrupt = |why: &str| StateError::Corrupt(format!("layer {}: {why}", path.display()));
        let head = raw.get(..HEADER).ok_or_else(|| corrupt("truncated header"))?;
        if &head[..8] != LAYER_MAGIC {
            return Err(corrupt("bad magic"));
        }
        let version = u32::from_le_bytes([head[8], head[9], head[10], head[11]]);
        if version != LAYER_VERSION {
            return Err(StateError::BadVersion(version));
        }
        let mut n = [0u8; 8];
        n.copy_from_slice(&head[12..20]);
        let count = u64::from_le_bytes(n);
        let crc = u32::from_le_bytes([head[20], head[21], head[22], head[23]]);
        let body = &raw[HEADER..];
        let expect = count.checked_mul(8 + PAGE_SIZE).ok_or_else(|| corrupt("page count overflows"))?;
        if body.len() as u64 != expect {
            return Err(corrupt("size does not match its page count (truncated?)"));
        }
        if crc32fast::hash(body) != crc {
            return Err(corrupt("checksum mismatch"));
        }
        let pages: Vec<u64> = body[..(count * 8) as usize]
            .chunks_exact(8)
            .map(|c| u64::from_le_bytes([c[0], c[1], c[2], c[3], c[4], c[5], c[6], c[7]]))
            .collect();
        if pages.windows(2).any(|w| w[0] >= w[1]) {
            return Err(corrupt("page index not ascending"));
        }
        let data = raw[HEADER + (count * 8) as usize..].to_vec();
        Ok(Layer { pages, data })
    }

    pub fn page(&self, i: usize) -> &[u8] {
        &self.data[i * PAGE_SIZE as usize..(i + 1) * PAGE_SIZE as usize]
    }
}

/// Apply `layers` (newest first) to `mem`: each page from the newest layer
/// that has it. Writes are not tracked as changes (they are the checkpoint).
/// Returns the number of distinct pages applied.
pub fn apply_layers(mem: &mut GuestMemory, layers: &[Layer]) -> Result<u64, StateError> {
    let mut done = std::collections::HashSet::new();
    for layer in layers {
        for (i, &p) in layer.pages.iter().enumerate() {
            if done.insert(p) {
                mem.write_untracked(p * PAGE_SIZE, layer.page(i))
                    .map_err(|_| StateError::Corrupt(format!("layer page {p} outside guest memory")))?;
            }
        }
    }
    Ok(done.len() as u64)
}

/// Merge `layers` (newest first) into one flat layer at `path`.
pub fn write_flat(path: &Path, layers: &[Layer]) -> Result<LayerStats, StateError> {
    let mut newest: std::collections::BTreeMap<u64, (usize, usize)> = std::collections::BTreeMap::new();
    for (li, layer) in layers.iter().enumerate() {
        for (i, &p) in layer.pages.iter().enumerate() {
            newest.entry(p).or_insert((li, i));
        }
    }
    let mut body = Vec::with_capacity(newest.len() * (8 + PAGE_SIZE as usize));
    for p in newest.keys() {
        body.extend_from_slice(&p.to_le_bytes());
    }
    for &(li, i) in newest.values() {
        body.extend_from_slice(layers[li].page(i));
    }
    write_body(path, newest.len() as u64, &body)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn write_read_apply_and_flatten() {
        let dir = tempfile::tempdir().unwrap();
        let mut mem = GuestMemory::anonymous(1 << 20).unwrap();
        mem.write(3 * 4096, b"old").unwrap();
        mem.write(5 * 4096, b"five").unwrap();
        let old = write_layer(&dir.path().join("a"), &mem, &[3, 5]).unwrap();
        assert_eq!(old.pages, 2);
        mem.write(3 * 4096, b"new").unwrap();
        write_layer(&dir.path().join("b"), &mem, &[3]).unwrap();
        let layers = vec![Layer::read(&dir.path().join("b")).unwrap(), Layer::read(&dir.path().join("a")).unwrap()];
        let mut fresh = GuestMemory::anonymous(1 << 20).unwrap();
        assert_eq!(apply_layers(&mut fresh, &layers).unwrap(), 2);
        assert_eq!(fresh.slice(3 * 4096, 3).unwrap(), b"new");
        assert_eq!(fresh.slice(5 * 4096, 4).unwrap(), b"five");
        let flat = write_flat(&dir.path().join("flat"), &layers).unwrap();
        assert_eq!(flat.pages, 2);
        let f = Layer::read(&dir.path().join("flat")).unwrap();
        assert_eq!(f.pages, vec![3, 5]);
        assert_eq!(&f.page(0)[..3], b"new");
    }

    #[test]
    fn corrupt_and_truncated_layers_are_rejected() {
        let dir = tempfile::tempdir().unwrap();
        let mut mem = GuestMemory::anonymous(1 << 20).unwrap();
        mem.write(7 * 4096, b"data").unwrap();
        let p = dir.path().join("l");
        write_layer(&p, &mem, &[7]).unwrap();
        let good = std::fs::read(&p).unwrap();
        let mut bad = good.clone();
        bad[HEADER + 8 + 1] ^= 1;
        std::fs::write(&p, &bad).unwrap();
        assert!(Layer::read(&p).is_err());
        std::fs::write(&p, &good[..good.len() - 1]).unwrap();
        assert!(Layer::read(&p).is_err());
        std::fs::write(&p, b"FBXLAYER").unwrap();
        assert!(Layer::read(&p).is_err());
        let mut huge = good.clone();
        huge[12..20].copy_from_slice(&u64::MAX.to_le_bytes());
        std::fs::write(&p, &huge).unwrap();
        assert!(Layer::read(&p).is_err());
    }
}
