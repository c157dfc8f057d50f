//! Layer files: the guest pages one checkpoint changed, over its parent.
//!
//! ```text
//! magic "FBXLAYER" | version u32 | page count u64 | CRC-32 of index+data u32 | data length u64
//! index: page numbers (u64, strictly ascending)
//! data:  per page, in index order: run count u16, then runs of
//!        (offset u16, length u16, bytes) = the page XOR the same page of the base
//! ```
//! A session's memory at checkpoint N = the template's memory file (the base)
//! with the layers of its ancestry applied, newest first (each page taken from
//! the newest layer that has it). A "flat" layer holds the union of a chain.
//! Pages are stored as the runs where they differ from the base because most
//! pages an exec dirties differ from the template in a few bytes (reference
//! counts, a list slot): ~30x smaller than whole pages, and applied straight
//! into guest memory without a decompression buffer.
//! CRC-32 (not SHA-256) because layers are read on every resume and the check
//! is against disk corruption and torn writes, not against an adversary.

use std::fs::File;
use std::io::{Read, Write};
use std::path::Path;

use forkbox_vmm::layout::PAGE_SIZE;
use forkbox_vmm::GuestMemory;

use crate::state::StateError;

pub const LAYER_MAGIC: &[u8; 8] = b"FBXLAYER";
/// The version `write_layer` writes. A change to the encoding bumps it and
/// keeps a reader for the old one (`Layer::read` dispatches on the version);
/// tests/golden.rs holds a golden layer of each readable version.
pub const LAYER_VERSION: u32 = 3;
/// Every layer version `Layer::read` reads (oldest first); the last is `LAYER_VERSION`.
pub const READABLE_LAYER_VERSIONS: &[u32] = &[3];
const HEADER: usize = 8 + 4 + 8 + 4 + 8;
/// No layer holds more pages than 64 GiB of guest RAM has.
const MAX_PAGES: u64 = (64 << 30) / PAGE_SIZE;

fn base_page(base: &[u8], p: u64) -> Result<&[u8], StateError> {
    // Checked: `p` comes from a layer's index, which a corrupt file controls.
    let outside = || StateError::Corrupt(format!("page {p} outside the base memory"));
    let start = usize::try_from(p.checked_mul(PAGE_SIZE).ok_or_else(outside)?).map_err(|_| outside())?;
    let end = start.checked_add(PAGE_SIZE as usize).ok_or_else(outside)?;
    base.get(start..end).ok_or_else(outside)
}

/// Append the runs where `page` differs from `base` (XORed) to `out`.
/// Compared a 64-bit word at a time: runs start and end on word boundaries,
/// and one equal word between two differing ones splits a run.
fn encode_page(out: &mut Vec<u8>, page: &[u8], base: &[u8]) {
    const W: usize = 8;
    let word = |b: &[u8], i: usize| u64::from_ne_bytes(b[i * W..i * W + W].try_into().unwrap_or([0; W]));
    let differs = |i: usize| word(page, i) != word(base, i);
    let count_at = out.len();
    out.extend_from_slice(&0u16.to_le_bytes());
    let mut runs = 0u16;
    let words = page.len() / W;
    let mut i = 0;
    while i < words {
        if !differs(i) {
            i += 1;
            continue;
        }
        let start = i;
        let mut end = i + 1;
        while end < words && differs(end) {
            end += 1;
        }
        let (a, b) = (start * W, end * W);
        out.extend_from_slice(&(a as u16).to_le_bytes());
        out.extend_from_slice(&((b - a) as u16).to_le_bytes());
        out.extend(page[a..b].iter().zip(&base[a..b]).map(|(x, y)| x ^ y));
        runs += 1;
        i = end;
    }
    out[count_at..count_at + 2].copy_from_slice(&runs.to_le_bytes());
}

/// What writing a layer produced.
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct LayerStats {
    pub pages: u64,
    pub bytes: u64,
    pub crc: u32,
}

fn ioe<'a>(what: &'static str, path: &'a Path) -> impl Fn(std::io::Error) -> StateError + 'a {
    move |source| StateError::io(what, path, source)
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

/// A layer about to be written: its size and checksum are known before any
/// byte goes to disk (a first pass encodes every page into one page-sized
/// scratch buffer, counting and checksumming; `write` encodes them again
/// straight into the file). No whole-layer buffer exists at any time.
pub struct LayerPlan<'a> {
    mem: &'a GuestMemory,
    base: &'a [u8],
    pages: &'a [u64],
    data_len: u64,
    crc: u32,
}

/// Capacity of the one-page scratch buffer: an encoded page is at most its
/// run count, a 4-byte header per run (at most one per two words) and its bytes.
const MAX_ENCODED_PAGE: usize = 2 + 4 * (PAGE_SIZE as usize / 16) + PAGE_SIZE as usize;

fn guest_page(mem: &GuestMemory, p: u64) -> Result<&[u8], StateError> {
    let at = p.checked_mul(PAGE_SIZE).ok_or_else(|| StateError::Corrupt(format!("page {p} outside guest memory")))?;
    mem.slice(at, PAGE_SIZE).map_err(|_| StateError::Corrupt(format!("page {p} outside guest memory")))
}

impl<'a> LayerPlan<'a> {
    /// Plan a layer of the pages `pages` (ascending) of `mem` over `base` (the
    /// template's memory).
    pub fn new(mem: &'a GuestMemory, base: &'a [u8], pages: &'a [u64]) -> Result<LayerPlan<'a>, StateError> {
        if pages.len() as u64 > MAX_PAGES {
            return Err(StateError::Corrupt("too many pages for one layer".into()));
        }
        let mut crc = crc32fast::Hasher::new();
        for p in pages {
            crc.update(&p.to_le_bytes());
        }
        let mut scratch = Vec::with_capacity(MAX_ENCODED_PAGE);
        let mut data_len = 0u64;
        for &p in pages {
            scratch.clear();
            encode_page(&mut scratch, guest_page(mem, p)?, base_page(base, p)?);
            crc.update(&scratch);
            data_len = data_len.saturating_add(scratch.len() as u64);
        }
        Ok(LayerPlan { mem, base, pages, data_len, crc: crc.finalize() })
    }

    /// Bytes the layer file will take.
    pub fn bytes(&self) -> u64 {
        (HEADER as u64).saturating_add(self.pages.len() as u64 * 8).saturating_add(self.data_len)
    }

    /// Write the layer at `path`: temp file, fsync, rename. On any error the
    /// temp file is removed before returning.
    pub fn write(&self, path: &Path) -> Result<LayerStats, StateError> {
        write_atomically(path, |f| self.write_into(f))?;
        Ok(self.stats())
    }

    /// The CRC-32 of all the bytes [`Self::write_into`] writes (header,
    /// index and data: what a `MemoryRef` to the layer records), known
    /// before they are written.
    pub fn bytes_crc(&self) -> u32 {
        let mut h = crc32fast::Hasher::new();
        h.update(&self.header());
        h.combine(&crc32fast::Hasher::new_with_initial_len(self.crc, self.bytes() - HEADER as u64));
        h.finalize()
    }

    fn header(&self) -> Vec<u8> {
        let mut head = Vec::with_capacity(HEADER);
        head.extend_from_slice(LAYER_MAGIC);
        head.extend_from_slice(&LAYER_VERSION.to_le_bytes());
        head.extend_from_slice(&(self.pages.len() as u64).to_le_bytes());
        head.extend_from_slice(&self.crc.to_le_bytes());
        head.extend_from_slice(&self.data_len.to_le_bytes());
        head
    }

    /// What [`Self::write`] and [`Self::write_into`] produce.
    pub fn stats(&self) -> LayerStats {
        LayerStats { pages: self.pages.len() as u64, bytes: self.bytes(), crc: self.crc }
    }

    /// Write the layer into `f`, a new empty file (the caller syncs and names it:
    /// a sandbox worker writes into a file descriptor it was given).
    pub fn write_into<W: Write>(&self, f: W) -> std::io::Result<()> {
        let head = self.header();
        let (mem, base, pages, expect) = (self.mem, self.base, self.pages, self.data_len);
        let mut w = std::io::BufWriter::with_capacity(1 << 20, f);
        w.write_all(&head)?;
        for p in pages {
            w.write_all(&p.to_le_bytes())?;
        }
        let mut scratch = Vec::with_capacity(MAX_ENCODED_PAGE);
        let mut written = 0u64;
        for &p in pages {
            scratch.clear();
            let (page, b) = match (guest_page(mem, p), base_page(base, p)) {
                (Ok(page), Ok(b)) => (page, b),
                _ => return Err(std::io::Error::other("page outside memory")),
            };
            encode_page(&mut scratch, page, b);
            written += scratch.len() as u64;
            w.write_all(&scratch)?;
        }
        if written != expect {
            return Err(std::io::Error::other("guest memory changed while its layer was written"));
        }
        w.flush()?;
        Ok(())
    }
}

/// Write the pages `pages` (ascending) of `mem` as a layer over `base` (the
/// template's memory) at `path`: temp file, fsync, rename (see `LayerPlan`).
pub fn write_layer(path: &Path, mem: &GuestMemory, base: &[u8], pages: &[u64]) -> Result<LayerStats, StateError> {
    LayerPlan::new(mem, base, pages)?.write(path)
}

/// A temp file next to `path` filled by `fill`, fsynced and renamed onto
/// `path`; on any failure the temp file is removed at once (a full disk leaves
/// nothing behind).
pub fn write_atomically(path: &Path, fill: impl FnOnce(&mut File) -> std::io::Result<()>) -> Result<(), StateError> {
    let tmp = path.with_extension("tmp");
    let r = (|| {
        let mut f = File::create(&tmp).map_err(ioe("create", &tmp))?;
        fill(&mut f).map_err(ioe("write", &tmp))?;
        f.sync_all().map_err(ioe("fsync", &tmp))?;
        drop(f);
        std::fs::rename(&tmp, path).map_err(ioe("rename", path))
    })();
    if r.is_err() {
        let _ = std::fs::remove_file(&tmp);
    }
    r
}

/// A layer read and verified: page numbers and where each page's runs are.
pub struct Layer {
    pub pages: Vec<u64>,
    /// The encoded runs of page `i` are `data[spans[i].0..spans[i].1]`.
    spans: Vec<(usize, usize)>,
    /// The layer's bytes as read (header and index too: the runs are not
    /// copied out of them).
    data: Vec<u8>,
}

impl Layer {
    pub fn read(path: &Path) -> Result<Layer, StateError> {
        let mut f = File::open(path).map_err(ioe("open", path))?;
        Layer::read_from(&mut f, &crate::state::shown(path))
    }

    /// A layer from an open file (a file descriptor the API process passed a
    /// sandbox worker); `shown` names it in errors.
    pub fn read_from(f: &mut File, shown: &str) -> Result<Layer, StateError> {
        let mut raw = Vec::new();
        f.read_to_end(&mut raw).map_err(|source| StateError::Io { what: "read", path: shown.into(), source })?;
        Layer::from_bytes(raw, shown)
    }

    /// A layer that is a part of an open file (one layer of a child
    /// process' memory in a checkpoint's process memory file): `r.len` bytes
    /// at `r.offset`, whose CRC-32 must be `r.crc`, then checked as a layer
    /// file is; `shown` names the file in errors.
    pub fn read_part(f: &File, r: &crate::state::MemoryRef, shown: &str) -> Result<Layer, StateError> {
        use std::os::unix::fs::FileExt;
        let corrupt = |why: &str| StateError::Corrupt(format!("layer in {shown} at {}: {why}", r.offset));
        let io = |what: &'static str| move |source| StateError::Io { what, path: shown.into(), source };
        let size = f.metadata().map_err(io("stat"))?.len();
        // Checked against the file first: the numbers come from a state file.
        if r.offset.checked_add(r.len).is_none_or(|end| end > size) {
            return Err(corrupt("beyond the end of the file (truncated?)"));
        }
        let mut raw = vec![0u8; usize::try_from(r.len).map_err(|_| corrupt("too large"))?];
        f.read_exact_at(&mut raw, r.offset).map_err(io("read"))?;
        if crc32fast::hash(&raw) != r.crc {
            return Err(corrupt("checksum mismatch"));
        }
        // Its own checksum covers a part of what was just checked.
        Layer::parse(raw, shown, false)
    }

    /// A layer from its bytes (a layer file's content, or a part of a
    /// file: see `read_part`), checked as a file is; `shown` names it in errors.
    pub fn from_bytes(raw: Vec<u8>, shown: &str) -> Result<Layer, StateError> {
        Layer::parse(raw, shown, true)
    }

    /// [`Self::from_bytes`], checking the layer's own checksum only if `check_crc`.
    fn parse(raw: Vec<u8>, shown: &str, check_crc: bool) -> Result<Layer, StateError> {
        let corrupt = |why: &str| StateError::Corrupt(format!("layer {shown}: {why}"));
        let head = raw.get(..HEADER).ok_or_else(|| corrupt("truncated header"))?;
        if &head[..8] != LAYER_MAGIC {
            return Err(corrupt("bad magic"));
        }
        let version = u32::from_le_bytes([head[8], head[9], head[10], head[11]]);
        match version {
            3 => Self::read_v3(raw, shown, check_crc),
            v => Err(corrupt(&format!(
                "layer format version {v}, this forkbox reads versions {READABLE_LAYER_VERSIONS:?}"
            ))),
        }
    }

    /// Version 3 (the current one; see the module docs for the layout).
    fn read_v3(raw: Vec<u8>, shown: &str, check_crc: bool) -> Result<Layer, StateError> {
        let corrupt = |why: &str| StateError::Corrupt(format!("layer {shown}: {why}"));
        let head = raw.get(..HEADER).ok_or_else(|| corrupt("truncated header"))?;
        let mut n = [0u8; 8];
        n.copy_from_slice(&head[12..20]);
        let count = u64::from_le_bytes(n);
        let crc = u32::from_le_bytes([head[20], head[21], head[22], head[23]]);
        n.copy_from_slice(&head[24..32]);
        let data_len = u64::from_le_bytes(n);
        if count > MAX_PAGES {
            return Err(corrupt("page count too large"));
        }
        let body = &raw[HEADER..];
        // Checked: `data_len` is untrusted (an overflow here was a panic under overflow checks).
        if count.checked_mul(8).and_then(|n| n.checked_add(data_len)) != Some(body.len() as u64) {
            return Err(corrupt("size does not match its header (truncated?)"));
        }
        if check_crc && crc32fast::hash(body) != crc {
            return Err(corrupt("checksum mismatch"));
        }
        let pages: Vec<u64> = body[..(count * 8) as usize]
            .chunks_exact(8)
            .map(|c| u64::from_le_bytes([c[0], c[1], c[2], c[3], c[4], c[5], c[6], c[7]]))
            .collect();
        if pages.windows(2).any(|w| w[0] >= w[1]) {
            return Err(corrupt("page index not ascending"));
        }
        if pages.last().is_some_and(|&p| p >= MAX_PAGES) {
            return Err(corrupt("page number beyond 64 GiB"));
        }
        // Walk every run once: bounds are checked here, so applying cannot fail.
        let data = raw;
        let mut spans = Vec::with_capacity(pages.len());
        let mut at = HEADER + (count * 8) as usize;
        let u16_at =
            |at: usize| -> Option<usize> { data.get(at..at + 2).map(|b| u16::from_le_bytes([b[0], b[1]]) as usize) };
        for _ in &pages {
            let start = at;
            let runs = u16_at(at).ok_or_else(|| corrupt("runs past the end"))?;
            at += 2;
            for _ in 0..runs {
                let (off, len) = (u16_at(at), u16_at(at + 2));
                let (Some(off), Some(len)) = (off, len) else { return Err(corrupt("runs past the end")) };
                if len == 0 || off + len > PAGE_SIZE as usize || at + 4 + len > data.len() {
                    return Err(corrupt("run out of bounds"));
                }
                at += 4 + len;
            }
            spans.push((start, at));
        }
        if at != data.len() {
            return Err(corrupt("trailing bytes"));
        }
        Ok(Layer { pages, spans, data })
    }

    /// Apply the runs of page `i` onto `page`, a copy of its base page.
    fn apply_runs(&self, i: usize, page: &mut [u8]) {
        let (mut at, end) = self.spans[i];
        at += 2;
        while at < end {
            let off = u16::from_le_bytes([self.data[at], self.data[at + 1]]) as usize;
            let len = u16::from_le_bytes([self.data[at + 2], self.data[at + 3]]) as usize;
            for (d, x) in page[off..off + len].iter_mut().zip(&self.data[at + 4..at + 4 + len]) {
                *d ^= x;
            }
            at += 4 + len;
        }
    }

    /// The content of page `i` of the index, given the base memory.
    pub fn page(&self, i: usize, base: &[u8]) -> Result<Vec<u8>, StateError> {
        let mut out = base_page(base, self.pages[i])?.to_vec();
        self.apply_runs(i, &mut out);
        Ok(out)
    }
}

/// Apply `layers` (newest first) to `mem`: each page from the newest layer
/// that has it. Writes are not tracked as changes (they are the checkpoint).
/// Returns the number of distinct pages applied.
pub fn apply_layers(mem: &mut GuestMemory, base: &[u8], layers: &[Layer]) -> Result<u64, StateError> {
    apply_with(mem, |p| base_page(base, p), layers)
}

/// [`apply_layers`] into memory that already holds the base's bytes at every
/// page the layers name: a VM's fresh copy-on-write mapping of the base's
/// file, or fresh anonymous memory for a base of zeros (a child process'
/// memory after an execve). Only the runs where a page differs from its base
/// are written, XORed in place; each run of consecutive pages is first made
/// private with one call (`GuestMemory::populate_write`: the kernel's
/// copy-on-write copy, without a fault per page). No base page is read and no
/// page is copied here, where [`apply_layers`] reads the base page, applies
/// the runs in a buffer and writes the whole page. Returns the number of
/// distinct pages applied.
pub fn apply_layers_in_place(mem: &mut GuestMemory, layers: &[Layer]) -> Result<u64, StateError> {
    let pages = mem.size() / PAGE_SIZE;
    // Each page from the newest layer that has it: sorted by page, then by layer (newest first).
    let mut todo: Vec<(u64, usize, usize)> = Vec::with_capacity(layers.iter().map(|l| l.pages.len()).sum());
    for (li, layer) in layers.iter().enumerate() {
        for (i, &p) in layer.pages.iter().enumerate() {
            if p >= pages {
                return Err(StateError::Corrupt(format!("layer page {p} outside guest memory")));
            }
            todo.push((p, li, i));
        }
    }
    todo.sort_unstable();
    todo.dedup_by_key(|t| t.0);
    let mut k = 0;
    while let Some(&(first, _, _)) = todo.get(k) {
        let mut end = first + 1;
        k += 1;
        while todo.get(k).is_some_and(|t| t.0 == end) {
            end += 1;
            k += 1;
        }
        // Best effort: where it fails, the writes below fault the pages in one at a time.
        let _ = mem.populate_write(first * PAGE_SIZE, (end - first) * PAGE_SIZE);
    }
    for &(p, li, i) in &todo {
        let page = mem
            .slice_mut_untracked(p * PAGE_SIZE, PAGE_SIZE)
            .map_err(|_| StateError::Corrupt(format!("layer page {p} outside guest memory")))?;
        layers[li].apply_runs(i, page);
    }
    Ok(todo.len() as u64)
}

fn apply_with<'b>(
    mem: &mut GuestMemory,
    base_page: impl Fn(u64) -> Result<&'b [u8], StateError>,
    layers: &[Layer],
) -> Result<u64, StateError> {
    let outside = |p: u64| StateError::Corrupt(format!("layer page {p} outside guest memory"));
    let pages = mem.size() / PAGE_SIZE;
    let mut done = vec![0u64; pages.div_ceil(64) as usize];
    let mut applied = 0u64;
    let mut page = vec![0u8; PAGE_SIZE as usize];
    for layer in layers {
        for (i, &p) in layer.pages.iter().enumerate() {
            if p >= pages {
                return Err(outside(p));
            }
            let (word, bit) = ((p / 64) as usize, 1u64 << (p % 64));
            if done[word] & bit != 0 {
                continue;
            }
            done[word] |= bit;
            applied += 1;
            page.copy_from_slice(base_page(p)?);
            layer.apply_runs(i, &mut page);
            mem.write_untracked(p * PAGE_SIZE, &page).map_err(|_| outside(p))?;
        }
    }
    Ok(applied)
}

/// Merge `layers` (newest first, all over the same base) into one flat layer
/// at `path`, streamed from the layers' runs (no merged buffer).
pub fn write_flat(path: &Path, layers: &[Layer]) -> Result<LayerStats, StateError> {
    let mut newest: std::collections::BTreeMap<u64, (usize, usize)> = std::collections::BTreeMap::new();
    for (li, layer) in layers.iter().enumerate() {
        for (i, &p) in layer.pages.iter().enumerate() {
            newest.entry(p).or_insert((li, i));
        }
    }
    let count = newest.len() as u64;
    let mut crc = crc32fast::Hasher::new();
    let mut data_len = 0u64;
    for p in newest.keys() {
        crc.update(&p.to_le_bytes());
    }
    let span = |&(li, i): &(usize, usize)| -> &[u8] {
        let (a, b) = layers[li].spans[i];
        &layers[li].data[a..b]
    };
    for v in newest.values() {
        crc.update(span(v));
        data_len += span(v).len() as u64;
    }
    let crc = crc.finalize();
    write_atomically(path, |f| {
        let mut w = std::io::BufWriter::with_capacity(1 << 20, f);
        w.write_all(LAYER_MAGIC)?;
        w.write_all(&LAYER_VERSION.to_le_bytes())?;
        w.write_all(&count.to_le_bytes())?;
        w.write_all(&crc.to_le_bytes())?;
        w.write_all(&data_len.to_le_bytes())?;
        for p in newest.keys() {
            w.write_all(&p.to_le_bytes())?;
        }
        for v in newest.values() {
            w.write_all(span(v))?;
        }
        w.flush()
    })?;
    Ok(LayerStats { pages: count, bytes: HEADER as u64 + count * 8 + data_len, crc })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A base ("template") with non-zero content, and guest memory starting as a copy of it.
    fn base_and_mem() -> (Vec<u8>, GuestMemory) {
        let base: Vec<u8> = (0..(1u32 << 20)).map(|i| (i % 251) as u8).collect();
        let mut mem = GuestMemory::anonymous(1 << 20).unwrap();
        mem.write(0, &base).unwrap();
        (base, mem)
    }

    #[test]
    fn write_read_apply_and_flatten() {
        let dir = tempfile::tempdir().unwrap();
        let (base, mut mem) = base_and_mem();
        mem.write(3 * 4096, b"old").unwrap();
        mem.write(5 * 4096, b"five").unwrap();
        let old = write_layer(&dir.path().join("a"), &mem, &base, &[3, 5]).unwrap();
        assert_eq!(old.pages, 2);
        assert!(old.bytes < 1024, "pages differing from the base in a few bytes compress: {} bytes", old.bytes);
        mem.write(3 * 4096, b"new").unwrap();
        write_layer(&dir.path().join("b"), &mem, &base, &[3]).unwrap();
        let layers = vec![Layer::read(&dir.path().join("b")).unwrap(), Layer::read(&dir.path().join("a")).unwrap()];
        let mut fresh = GuestMemory::anonymous(1 << 20).unwrap();
        fresh.write(0, &base).unwrap();
        assert_eq!(apply_layers(&mut fresh, &base, &layers).unwrap(), 2);
        let mut expect = base.clone();
        expect[3 * 4096..3 * 4096 + 3].copy_from_slice(b"new");
        expect[5 * 4096..5 * 4096 + 4].copy_from_slice(b"five");
        assert_eq!(fresh.slice(0, 1 << 20).unwrap(), &expect[..]);
        let flat = write_flat(&dir.path().join("flat"), &layers).unwrap();
        assert_eq!(flat.pages, 2);
        let f = Layer::read(&dir.path().join("flat")).unwrap();
        assert_eq!(f.pages, vec![3, 5]);
        assert_eq!(&f.page(0, &base).unwrap()[..3], b"new");
        assert_eq!(&f.page(0, &base).unwrap()[3..], &base[3 * 4096 + 3..4 * 4096]);
        // The CRC of a layer's bytes is known before they are written.
        let plan = LayerPlan::new(&mem, &base, &[3, 5]).unwrap();
        let mut bytes = Vec::new();
        plan.write_into(&mut bytes).unwrap();
        assert_eq!(plan.bytes_crc(), crc32fast::hash(&bytes));
        assert_eq!(plan.bytes(), bytes.len() as u64);
    }

    #[test]
    fn layers_applied_over_zeros_match_their_memory() {
        let dir = tempfile::tempdir().unwrap();
        let (base, mut mem) = base_and_mem();
        let mut noise = vec![0u8; 4096];
        fill(&mut noise);
        mem.write(2 * 4096, &noise).unwrap();
        mem.write(6 * 4096 + 100, b"older").unwrap();
        write_layer(&dir.path().join("a"), &mem, &base, &[2, 6]).unwrap();
        mem.write(6 * 4096 + 100, b"newer").unwrap();
        mem.write(255 * 4096, b"last page").unwrap();
        write_layer(&dir.path().join("b"), &mem, &base, &[6, 255]).unwrap();
        let layers = vec![Layer::read(&dir.path().join("b")).unwrap(), Layer::read(&dir.path().join("a")).unwrap()];
        let mut fresh = GuestMemory::anonymous(1 << 20).unwrap();
        fresh.write(0, &base).unwrap();
        assert_eq!(apply_layers(&mut fresh, &base, &layers).unwrap(), 3);
        assert_eq!(fresh.slice(0, 1 << 20).unwrap(), mem.slice(0, 1 << 20).unwrap());
        // Over zeros (a child's memory after an execve), in place.
        let zeros = vec![0u8; 1 << 20];
        write_layer(&dir.path().join("z"), &mem, &zeros, &[2, 6]).unwrap();
        mem.write(6 * 4096 + 100, b"newest").unwrap();
        write_layer(&dir.path().join("y"), &mem, &zeros, &[6, 255]).unwrap();
        let over_zeros = [Layer::read(&dir.path().join("y")).unwrap(), Layer::read(&dir.path().join("z")).unwrap()];
        let mut blank = GuestMemory::anonymous(1 << 20).unwrap();
        assert_eq!(apply_layers_in_place(&mut blank, &over_zeros).unwrap(), 3);
        for p in [2u64, 6, 255] {
            assert_eq!(blank.slice(p * 4096, 4096).unwrap(), mem.slice(p * 4096, 4096).unwrap());
        }
        assert!(blank.slice(3 * 4096, 4096).unwrap().iter().all(|&b| b == 0));
        // A page beyond the memory is an error, not a panic.
        let mut small = GuestMemory::anonymous(64 << 10).unwrap();
        assert!(apply_layers(&mut small, &base, &layers).is_err());
        assert!(apply_layers_in_place(&mut small, &over_zeros).is_err());
    }

    #[test]
    fn random_pages_round_trip() {
        let dir = tempfile::tempdir().unwrap();
        let (base, mut mem) = base_and_mem();
        let mut noise = vec![0u8; 4096];
        crate::layer::tests::fill(&mut noise);
        mem.write(9 * 4096, &noise).unwrap();
        write_layer(&dir.path().join("n"), &mem, &base, &[9, 10]).unwrap();
        let l = Layer::read(&dir.path().join("n")).unwrap();
        assert_eq!(l.page(0, &base).unwrap(), noise);
        assert_eq!(l.page(1, &base).unwrap(), &base[10 * 4096..11 * 4096]);
    }

    fn fill(b: &mut [u8]) {
        let mut x = 0x9E37_79B9_7F4A_7C15u64;
        for v in b.iter_mut() {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            *v = x as u8;
        }
    }

    #[test]
    fn corrupt_and_truncated_layers_are_rejected() {
        let dir = tempfile::tempdir().unwrap();
        let (base, mut mem) = base_and_mem();
        mem.write(7 * 4096, b"data").unwrap();
        let p = dir.path().join("l");
        write_layer(&p, &mem, &base, &[7]).unwrap();
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
