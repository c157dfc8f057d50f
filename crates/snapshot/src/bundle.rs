//! The transfer format of a template directory: its `state` file and its
//! sparse `memory` file as one file (one object in a bucket), holes left out.
//!
//! A template's memory file has the apparent size of guest RAM (GiBs) and
//! holds ~45 MiB of data; a bundle carries only its non-zero pages, as runs of
//! consecutive pages. The encoding is canonical: the same `state` bytes and
//! the same non-zero pages (the set `MemoryFile::open` checksums) always give
//! the same bundle bytes, whatever extents the file system reports, so a
//! bundle's SHA-256 names a template's contents.
//!
//! Layout of version 1 (little-endian integers):
//!
//! ```text
//! header   magic "FBXTMPL\0" (8) | version u32 | flags u32 (0)
//!          | state_len u64 | memory_size u64 | runs u64 | pages u64      (48 bytes)
//! state    state_len bytes: the template's `state` file, verbatim
//! runs     runs x (first_page u64, pages u64): ascending, at least one
//!          page each, never adjacent nor overlapping (maximal runs), inside
//!          memory_size; their pages add up to `pages`
//! data     pages x 4096 bytes, run after run; no page is all zeros
//! trailer  SHA-256 of everything before it (32 bytes)
//! ```
//!
//! The reader checks that the lengths add up to the input's length before it
//! reads anything else, streams the state and the pages into the files with
//! fixed-size buffers (nothing is allocated from a length in the input), and
//! checks the trailer at the end; on any error the files it wrote are removed.
//! What the files mean (the state decodes, the memory matches the checksum the
//! state records) is checked by their own readers (`read_state`, `MemoryFile::open`).
//!
//! Versioning: a new layout gets a new `BUNDLE_VERSION`, a reader for each
//! version in `READABLE_BUNDLE_VERSIONS`, and a golden file
//! (`tests/golden/template-bundle-vN.bin`, see `tests/golden.rs`).

use std::fs::File;
use std::io::{BufReader, BufWriter, Read, Write};
use std::os::unix::fs::{FileExt, PermissionsExt};
use std::path::Path;

use forkbox_vmm::layout::PAGE_SIZE;
use sha2::{Digest, Sha256};

use crate::memory::{seek_data, seek_hole};
use crate::state::StateError;

pub const BUNDLE_MAGIC: &[u8; 8] = b"FBXTMPL\0";
/// 1: header, state, runs, pages, trailer (see the module docs).
pub const BUNDLE_VERSION: u32 = 1;
/// Every version [`unpack`] reads.
pub const READABLE_BUNDLE_VERSIONS: &[u32] = &[1];
pub const BUNDLE_HEADER: u64 = 48;
const TRAILER: u64 = 32;
/// Largest state file a bundle may carry (as `read_state` allows).
pub const MAX_STATE: u64 = (4 << 30) + 52;
/// Largest memory file a bundle may describe (guest RAM is 4 GiB today).
pub const MAX_MEMORY: u64 = 64 << 30;
/// Names of the two files of a template directory.
pub const STATE_FILE: &str = "state";
pub const MEMORY_FILE: &str = "memory";

const PAGE: usize = PAGE_SIZE as usize;
const BUF: usize = 64 << 10;

/// What a bundle holds, and its own SHA-256 (its name in a bucket).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct BundleInfo {
    /// SHA-256 (hex) of the whole bundle, trailer included.
    pub sha256: String,
    /// Bytes of the whole bundle.
    pub bytes: u64,
    /// SHA-256 (hex) of the state file.
    pub state_sha256: String,
    pub state_bytes: u64,
    /// Apparent size of the memory file.
    pub memory_size: u64,
    /// Non-zero pages of the memory file (= pages carried).
    pub pages: u64,
    pub runs: u64,
}

fn ioe<'a>(what: &'static str, path: &'a Path) -> impl Fn(std::io::Error) -> StateError + 'a {
    move |source| StateError::io(what, path, source)
}

fn corrupt(why: impl Into<String>) -> StateError {
    StateError::Corrupt(format!("template bundle: {}", why.into()))
}

/// A writer that hashes what goes through it (twice: the trailer covers
/// everything before it, the bundle's name everything).
struct Hashing<W> {
    inner: W,
    body: Sha256,
    bytes: u64,
}

impl<W: Write> Hashing<W> {
    fn put(&mut self, b: &[u8]) -> std::io::Result<()> {
        self.body.update(b);
        self.bytes += b.len() as u64;
        self.inner.write_all(b)
    }
}

/// The non-zero pages of the sparse file `f` of `size` bytes as maximal runs
/// (first page, pages): the data extents (`SEEK_DATA`/`SEEK_HOLE`) read page
/// by page, all-zero pages left out.
fn runs_of(f: &File, size: u64, path: &Path) -> Result<Vec<(u64, u64)>, StateError> {
    let mut runs: Vec<(u64, u64)> = Vec::new();
    let mut page = vec![0u8; PAGE];
    let mut pos = 0u64;
    loop {
        let start = match seek_data(f, pos) {
            Some(d) if d < size => d,
            _ => break,
        };
        let end = seek_hole(f, start).unwrap_or(size).min(size);
        let mut addr = start - start % PAGE_SIZE;
        while addr < end {
            f.read_exact_at(&mut page, addr).map_err(ioe("read", path))?;
            if page.iter().any(|&b| b != 0) {
                let p = addr / PAGE_SIZE;
                match runs.last_mut() {
                    Some((first, n)) if *first + *n == p => *n += 1,
                    _ => runs.push((p, 1)),
                }
            }
            addr += PAGE_SIZE;
        }
        pos = end.max(start + 1);
    }
    Ok(runs)
}

/// Write the template directory `dir` (`state` + `memory`) as a bundle at
/// `out` (created or truncated; the caller renames it into place). The memory
/// file's holes and zero pages are not carried.
pub fn pack(dir: &Path, out: &Path) -> Result<BundleInfo, StateError> {
    let state_path = dir.join(STATE_FILE);
    let memory_path = dir.join(MEMORY_FILE);
    let state = File::open(&state_path).map_err(ioe("open", &state_path))?;
    let state_len = state.metadata().map_err(ioe("stat", &state_path))?.len();
    let memory = File::open(&memory_path).map_err(ioe("open", &memory_path))?;
    let memory_size = memory.metadata().map_err(ioe("stat", &memory_path))?.len();
    if state_len > MAX_STATE {
        return Err(corrupt(format!("state file of {state_len} bytes")));
    }
    if memory_size % PAGE_SIZE != 0 || memory_size > MAX_MEMORY {
        return Err(corrupt(format!("memory file of {memory_size} bytes")));
    }
    let runs = runs_of(&memory, memory_size, &memory_path)?;
    let pages: u64 = runs.iter().map(|r| r.1).sum();
    let file = File::create(out).map_err(ioe("create", out))?;
    let mut w = Hashing { inner: BufWriter::with_capacity(BUF, file), body: Sha256::new(), bytes: 0 };
    let wr = ioe("write", out);
    let mut header = Vec::with_capacity(BUNDLE_HEADER as usize);
    header.extend_from_slice(BUNDLE_MAGIC);
    header.extend_from_slice(&BUNDLE_VERSION.to_le_bytes());
    header.extend_from_slice(&0u32.to_le_bytes());
    for v in [state_len, memory_size, runs.len() as u64, pages] {
        header.extend_from_slice(&v.to_le_bytes());
    }
    w.put(&header).map_err(&wr)?;
    let mut state_hash = Sha256::new();
    let mut buf = vec![0u8; BUF];
    let mut left = state_len;
    let mut r = BufReader::new(state);
    while left > 0 {
        let n = (left.min(BUF as u64)) as usize;
        r.read_exact(&mut buf[..n]).map_err(ioe("read", &state_path))?;
        state_hash.update(&buf[..n]);
        w.put(&buf[..n]).map_err(&wr)?;
        left -= n as u64;
    }
    for (first, n) in &runs {
        w.put(&first.to_le_bytes()).map_err(&wr)?;
        w.put(&n.to_le_bytes()).map_err(&wr)?;
    }
    let mut page = vec![0u8; PAGE];
    for (first, n) in &runs {
        for p in *first..*first + *n {
            memory.read_exact_at(&mut page, p * PAGE_SIZE).map_err(ioe("read", &memory_path))?;
            if page.iter().all(|&b| b == 0) {
                // Changed under us: the memory file is never modified once written.
                return Err(corrupt("the memory file changed while it was packed"));
            }
            w.put(&page).map_err(&wr)?;
        }
    }
    let trailer = w.body.clone().finalize();
    w.put(&trailer).map_err(&wr)?;
    let Hashing { inner, body, bytes } = w;
    let file = inner.into_inner().map_err(|e| StateError::io("flush", out, e.into_error()))?;
    file.sync_all().map_err(ioe("fsync", out))?;
    Ok(BundleInfo {
        sha256: hex::encode(body.finalize()),
        bytes,
        state_sha256: hex::encode(state_hash.finalize()),
        state_bytes: state_len,
        memory_size,
        pages,
        runs: runs.len() as u64,
    })
}

/// A reader that hashes what it reads and counts it.
struct Hashed<R> {
    inner: R,
    body: Sha256,
    all: Sha256,
}

impl<R: Read> Hashed<R> {
    fn take(&mut self, buf: &mut [u8]) -> Result<(), StateError> {
        self.inner.read_exact(buf).map_err(|e| match e.kind() {
            std::io::ErrorKind::UnexpectedEof => corrupt("truncated"),
            _ => StateError::Io { what: "read", path: "template bundle".into(), source: e },
        })?;
        self.body.update(&*buf);
        self.all.update(&*buf);
        Ok(())
    }

    fn u64(&mut self) -> Result<u64, StateError> {
        let mut b = [0u8; 8];
        self.take(&mut b)?;
        Ok(u64::from_le_bytes(b))
    }
}

/// Read the bundle file `src` into the directory `dir` (which must exist):
/// `dir/state` and `dir/memory` (sparse, read-only). See [`unpack_from`].
pub fn unpack(src: &Path, dir: &Path) -> Result<BundleInfo, StateError> {
    let f = File::open(src).map_err(ioe("open", src))?;
    let len = f.metadata().map_err(ioe("stat", src))?.len();
    unpack_from(BufReader::with_capacity(BUF, f), len, dir)
}

/// Read a bundle of `len` bytes from `r` into `dir`: every length is checked
/// against `len` first, the trailer at the end. On an error, neither file is
/// left in `dir`.
pub fn unpack_from(r: impl Read, len: u64, dir: &Path) -> Result<BundleInfo, StateError> {
    let state_path = dir.join(STATE_FILE);
    let memory_path = dir.join(MEMORY_FILE);
    let r = unpack_inner(r, len, &state_path, &memory_path);
    if r.is_err() {
        let _ = std::fs::remove_file(&state_path);
        let _ = std::fs::remove_file(&memory_path);
    }
    r
}

fn unpack_inner(r: impl Read, len: u64, state_path: &Path, memory_path: &Path) -> Result<BundleInfo, StateError> {
    let mut r = Hashed { inner: r.take(len), body: Sha256::new(), all: Sha256::new() };
    if len < BUNDLE_HEADER + TRAILER {
        return Err(corrupt(format!("{len} bytes, shorter than a header and a trailer")));
    }
    let mut magic = [0u8; 8];
    r.take(&mut magic)?;
    if &magic != BUNDLE_MAGIC {
        return Err(corrupt("bad magic (not a template bundle)"));
    }
    let mut word = [0u8; 4];
    r.take(&mut word)?;
    let version = u32::from_le_bytes(word);
    if !READABLE_BUNDLE_VERSIONS.contains(&version) {
        return Err(corrupt(format!("format version {version}, this forkbox reads {READABLE_BUNDLE_VERSIONS:?}")));
    }
    r.take(&mut word)?;
    if u32::from_le_bytes(word) != 0 {
        return Err(corrupt("unknown flags"));
    }
    let state_len = r.u64()?;
    let memory_size = r.u64()?;
    let runs = r.u64()?;
    let pages = r.u64()?;
    if state_len > MAX_STATE {
        return Err(corrupt(format!("state of {state_len} bytes")));
    }
    if memory_size % PAGE_SIZE != 0 || memory_size > MAX_MEMORY {
        return Err(corrupt(format!("memory size {memory_size}")));
    }
    if pages > memory_size / PAGE_SIZE || runs > pages {
        return Err(corrupt(format!("{runs} runs of {pages} pages in {memory_size} bytes")));
    }
    // Every length adds up to the input's, before anything else is read.
    let expect = [state_len, runs.saturating_mul(16), pages.saturating_mul(PAGE_SIZE), TRAILER]
        .iter()
        .try_fold(BUNDLE_HEADER, |a, b| a.checked_add(*b));
    if expect != Some(len) {
        return Err(corrupt(format!("{len} bytes, its header says {expect:?}")));
    }
    let mut buf = vec![0u8; BUF];
    let mut state_hash = Sha256::new();
    {
        let f = File::create(state_path).map_err(ioe("create", state_path))?;
        let mut w = BufWriter::with_capacity(BUF, f);
        let mut left = state_len;
        while left > 0 {
            let n = (left.min(BUF as u64)) as usize;
            r.take(&mut buf[..n])?;
            state_hash.update(&buf[..n]);
            w.write_all(&buf[..n]).map_err(ioe("write", state_path))?;
            left -= n as u64;
        }
        let f = w.into_inner().map_err(|e| StateError::io("flush", state_path, e.into_error()))?;
        f.sync_all().map_err(ioe("fsync", state_path))?;
    }
    // The run table grows as its entries are read (never sized from `runs`:
    // it is bounded by the input, 16 bytes of it per entry).
    let mut table: Vec<(u64, u64)> = Vec::new();
    let mut next = 0u64; // the first page a run may start at
    let mut total = 0u64;
    for _ in 0..runs {
        let first = r.u64()?;
        let n = r.u64()?;
        let end = first.checked_add(n).filter(|e| n > 0 && *e <= memory_size / PAGE_SIZE);
        let Some(end) = end else { return Err(corrupt(format!("run of {n} pages at page {first}"))) };
        if first < next {
            return Err(corrupt(format!("run at page {first} overlaps, touches or precedes the one before")));
        }
        next = end + 1;
        total += n;
        table.push((first, n));
    }
    if total != pages {
        return Err(corrupt(format!("runs of {total} pages, header says {pages}")));
    }
    let memory = File::create(memory_path).map_err(ioe("create", memory_path))?;
    memory.set_len(memory_size).map_err(ioe("truncate", memory_path))?;
    let mut page = vec![0u8; PAGE];
    for (first, n) in table {
        for p in first..first + n {
            r.take(&mut page)?;
            if page.iter().all(|&b| b == 0) {
                return Err(corrupt(format!("page {p} is all zeros (holes are not carried)")));
            }
            memory.write_all_at(&page, p * PAGE_SIZE).map_err(ioe("write", memory_path))?;
        }
    }
    let expected = r.body.clone().finalize();
    let mut trailer = [0u8; 32];
    r.take(&mut trailer)?;
    if trailer[..] != expected[..] {
        return Err(corrupt("checksum mismatch"));
    }
    memory.sync_all().map_err(ioe("fsync", memory_path))?;
    memory.set_permissions(std::fs::Permissions::from_mode(0o444)).map_err(ioe("fchmod", memory_path))?;
    Ok(BundleInfo {
        sha256: hex::encode(r.all.finalize()),
        bytes: len,
        state_sha256: hex::encode(state_hash.finalize()),
        state_bytes: state_len,
        memory_size,
        pages,
        runs,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sparse_dir(pages: &[(u64, u8)], size: u64) -> tempfile::TempDir {
        let d = tempfile::tempdir().unwrap();
        std::fs::write(d.path().join(STATE_FILE), b"state bytes").unwrap();
        let f = File::create(d.path().join(MEMORY_FILE)).unwrap();
        f.set_len(size).unwrap();
        for (p, v) in pages {
            f.write_all_at(&vec![*v; PAGE], p * PAGE_SIZE).unwrap();
        }
        d
    }

    #[test]
    fn zero_pages_and_holes_are_left_out_and_runs_are_maximal() {
        // Pages 1, 2, 3 (3 written as zeros: left out), 5, 6.
        let d = sparse_dir(&[(1, 1), (2, 2), (3, 0), (5, 5), (6, 6)], 64 * PAGE_SIZE);
        let out = d.path().join("b");
        let info = pack(d.path(), &out).unwrap();
        assert_eq!((info.runs, info.pages, info.memory_size), (2, 4, 64 * PAGE_SIZE));
        assert_eq!(info.bytes, BUNDLE_HEADER + 11 + 2 * 16 + 4 * PAGE_SIZE + TRAILER);
        let back = tempfile::tempdir().unwrap();
        let got = unpack(&out, back.path()).unwrap();
        assert_eq!(got, info);
        let a = std::fs::read(d.path().join(MEMORY_FILE)).unwrap();
        let b = std::fs::read(back.path().join(MEMORY_FILE)).unwrap();
        assert!(a == b, "memory differs after a round trip");
        assert_eq!(std::fs::read(back.path().join(STATE_FILE)).unwrap(), b"state bytes");
        // The same contents in another file layout give the same bundle.
        let again = back.path().join("b2");
        assert_eq!(pack(back.path(), &again).unwrap().sha256, info.sha256);
    }
}
