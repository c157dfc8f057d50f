//! Pack files: the file-system bytes of checkpoints, stored incrementally.
//!
//! ```text
//! magic "FBXPACK\0" | version u32 | then chunks, back to back (raw bytes)
//! ```
//! A checkpoint's state file lists every overlay file whose bytes are not in
//! the state itself (`FileTable`): its length and its chunks, each a range of
//! a pack file with the CRC-32 of its bytes. A checkpoint writes a pack of the
//! chunks that changed since its parent (`<checkpoint>.files`) and references
//! the unchanged ones in its ancestors' packs, so a checkpoint costs what the
//! exec changed, not the size of the file system. A pack lives as long as its
//! checkpoint, which lives as long as any descendant (the sessions' garbage
//! collection keeps ancestors), so a reference never dangles.
//!
//! Chunks are `CHUNK` bytes (the last of a file shorter). Chunks are verified
//! when read (length and CRC); a pack has no checksum of its own.

use std::fs::File;
use std::io::Write;
use std::os::unix::fs::FileExt;
use std::path::Path;

use serde::{Deserialize, Serialize};

use crate::state::StateError;

pub const PACK_MAGIC: &[u8; 8] = b"FBXPACK\0";
pub const PACK_VERSION: u32 = 1;
pub const PACK_HEADER: u64 = 12;
/// Bytes per chunk: an exec that changes one byte of a big file writes one chunk.
pub const CHUNK: usize = 256 << 10;

/// One chunk of a file: `len` bytes at `offset` of pack `pack` (an index into
/// `FileTable::packs`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct StoredChunk {
    pub pack: u32,
    pub offset: u64,
    pub len: u32,
    pub crc: u32,
}

/// An overlay file (inode `ino`) whose bytes are stored in packs.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct StoredFile {
    pub ino: u64,
    pub len: u64,
    pub chunks: Vec<StoredChunk>,
}

/// The files of a checkpoint stored in packs, and the packs they use (file
/// names in the checkpoint's directory).
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct FileTable {
    pub packs: Vec<String>,
    pub files: Vec<StoredFile>,
}

/// The name of a checkpoint's process memory file (its child processes'
/// memory layers) beside its pack `pack_name` (`<name>.files` -> `<name>.procs`).
pub fn procs_name(pack_name: &str) -> String {
    let stem = pack_name.strip_suffix(".files").unwrap_or(pack_name);
    format!("{stem}.procs")
}

/// A pack name as written by this code: one plain file name.
pub fn valid_pack_name(name: &str) -> bool {
    !name.is_empty()
        && name.len() <= 128
        && name != "."
        && name != ".."
        && name.bytes().all(|c| c.is_ascii_alphanumeric() || b"._-".contains(&c))
}

impl FileTable {
    /// Check the table against itself: pack names, chunk lengths adding up to
    /// each file's length, chunks of at most `CHUNK` bytes, files in inode order.
    pub fn validate(&self) -> Result<(), StateError> {
        let bad = |why: String| Err(StateError::Corrupt(format!("file table: {why}")));
        if let Some(p) = self.packs.iter().find(|p| !valid_pack_name(p)) {
            return bad(format!("bad pack name {p:?}"));
        }
        if self.files.windows(2).any(|w| w[0].ino >= w[1].ino) {
            return bad("files not in inode order".into());
        }
        for f in &self.files {
            let mut sum = 0u64;
            for c in &f.chunks {
                if c.pack as usize >= self.packs.len() || c.len == 0 || c.len as usize > CHUNK || c.offset < PACK_HEADER
                {
                    return bad(format!("bad chunk of inode {}", f.ino));
                }
                sum = sum.saturating_add(u64::from(c.len));
            }
            if sum != f.len {
                return bad(format!("chunks of inode {} hold {sum} bytes, not {}", f.ino, f.len));
            }
        }
        Ok(())
    }

    /// Bytes of all files (what restoring them allocates).
    pub fn total_bytes(&self) -> u64 {
        self.files.iter().fold(0u64, |a, f| a.saturating_add(f.len))
    }
}

/// Reads chunks from packs, each pack opened once: from one directory, or
/// from files opened by someone else (a sandbox worker gets file descriptors).
pub struct PackReader<'a> {
    dir: Option<&'a Path>,
    open: std::collections::HashMap<String, File>,
    /// Packs whose header was checked.
    checked: std::collections::HashSet<String>,
}

impl<'a> PackReader<'a> {
    pub fn new(dir: &'a Path) -> PackReader<'a> {
        PackReader { dir: Some(dir), open: Default::default(), checked: Default::default() }
    }

    /// Over these packs only (by name); a chunk of any other pack is an error.
    pub fn with_files(files: std::collections::HashMap<String, File>) -> PackReader<'static> {
        PackReader { dir: None, open: files, checked: Default::default() }
    }

    /// Append the bytes of `c` (of `table`) to `out`, verified.
    pub fn read_into(&mut self, table: &FileTable, c: &StoredChunk, out: &mut Vec<u8>) -> Result<(), StateError> {
        let name =
            table.packs.get(c.pack as usize).ok_or_else(|| StateError::Corrupt("chunk of an unknown pack".into()))?;
        // Before anything is allocated for it (the table may not have been validated).
        if c.len == 0 || c.len as usize > CHUNK || c.offset < PACK_HEADER {
            return Err(StateError::Corrupt(format!("pack {name}: bad chunk ({} bytes at {})", c.len, c.offset)));
        }
        let dir = self.dir;
        let ioe = |what, name: &str, e| StateError::Io {
            what,
            path: dir.map_or_else(|| name.to_string(), |d| crate::state::shown(&d.join(name))),
            source: e,
        };
        if !self.open.contains_key(name) {
            let Some(dir) = self.dir else {
                return Err(StateError::Corrupt(format!("pack {name} was not given")));
            };
            let path = dir.join(name);
            let f = File::open(&path).map_err(|e| StateError::io("open", &path, e))?;
            self.open.insert(name.clone(), f);
        }
        let f = &self.open[name];
        if !self.checked.contains(name) {
            let mut head = [0u8; PACK_HEADER as usize];
            f.read_exact_at(&mut head, 0).map_err(|e| ioe("read", name, e))?;
            if &head[..8] != PACK_MAGIC || head[8..12] != PACK_VERSION.to_le_bytes() {
                return Err(StateError::Corrupt(format!("pack {name}: bad magic or version")));
            }
            self.checked.insert(name.clone());
        }
        let f = &self.open[name];
        let at = out.len();
        out.resize(at + c.len as usize, 0);
        f.read_exact_at(&mut out[at..], c.offset).map_err(|e| ioe("read", name, e))?;
        if crc32fast::hash(&out[at..]) != c.crc {
            return Err(StateError::Corrupt(format!("pack {name}: chunk at {} does not match its checksum", c.offset)));
        }
        Ok(())
    }
}

/// A pack being written: a temp file next to its final name, streamed through
/// a buffer; `finish` fsyncs and renames it, dropping it unfinished removes it.
/// Or ([`PackWriter::into_file`]) into a file someone else opened and names.
pub struct PackWriter {
    /// (final path, temp path) when this writer names the file.
    paths: Option<(std::path::PathBuf, std::path::PathBuf)>,
    w: Option<std::io::BufWriter<File>>,
    at: u64,
}

impl PackWriter {
    pub fn create(path: &Path) -> Result<PackWriter, StateError> {
        let tmp = path.with_extension("tmp");
        let f = File::create(&tmp).map_err(|e| StateError::io("create", &tmp, e))?;
        PackWriter::start(f, Some((path.to_path_buf(), tmp)))
    }

    /// A pack written into `f` (a new empty file): `finish` only flushes it.
    pub fn into_file(f: File) -> Result<PackWriter, StateError> {
        PackWriter::start(f, None)
    }

    fn start(f: File, paths: Option<(std::path::PathBuf, std::path::PathBuf)>) -> Result<PackWriter, StateError> {
        let mut p = PackWriter { paths, w: Some(std::io::BufWriter::with_capacity(1 << 20, f)), at: 0 };
        let mut head = PACK_MAGIC.to_vec();
        head.extend_from_slice(&PACK_VERSION.to_le_bytes());
        p.put(&head)?;
        Ok(p)
    }

    fn shown(&self) -> String {
        self.paths.as_ref().map_or_else(|| "pack".to_string(), |(_, tmp)| crate::state::shown(tmp))
    }

    fn put(&mut self, bytes: &[u8]) -> Result<(), StateError> {
        let w = self.w.as_mut().ok_or_else(|| StateError::Corrupt("pack already finished".into()))?;
        if let Err(source) = w.write_all(bytes) {
            return Err(StateError::Io { what: "write", path: self.shown(), source });
        }
        self.at += bytes.len() as u64;
        Ok(())
    }

    /// Append one chunk; returns where it went (`pack` is the caller's index).
    pub fn append(&mut self, pack: u32, bytes: &[u8]) -> Result<StoredChunk, StateError> {
        let len = u32::try_from(bytes.len()).map_err(|_| StateError::Corrupt("chunk too large".into()))?;
        let offset = self.at;
        self.put(bytes)?;
        Ok(StoredChunk { pack, offset, len, crc: crc32fast::hash(bytes) })
    }

    /// Bytes written so far (the pack's size once finished).
    pub fn bytes(&self) -> u64 {
        self.at
    }

    pub fn finish(mut self) -> Result<u64, StateError> {
        let shown = self.shown();
        let w = self.w.take().ok_or_else(|| StateError::Corrupt("pack already finished".into()))?;
        let f = w.into_inner().map_err(|e| StateError::Io {
            what: "write",
            path: shown.clone(),
            source: e.into_error(),
        })?;
        if let Some((path, tmp)) = self.paths.take() {
            let done = f
                .sync_all()
                .map_err(|e| StateError::io("fsync", &tmp, e))
                .and_then(|_| std::fs::rename(&tmp, &path).map_err(|e| StateError::io("rename", &path, e)));
            if done.is_err() {
                let _ = std::fs::remove_file(&tmp);
            }
            done?;
        }
        Ok(self.at)
    }
}

impl Drop for PackWriter {
    fn drop(&mut self) {
        if self.w.take().is_some() {
            if let Some((_, tmp)) = &self.paths {
                let _ = std::fs::remove_file(tmp);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pack_round_trip_and_corruption() {
        let dir = tempfile::tempdir().unwrap();
        let mut w = PackWriter::create(&dir.path().join("a.files")).unwrap();
        let c1 = w.append(0, b"hello").unwrap();
        let c2 = w.append(0, &[7u8; 1000]).unwrap();
        assert_eq!(w.finish().unwrap(), PACK_HEADER + 1005);
        assert!(!dir.path().join("a.tmp").exists());
        let table = FileTable {
            packs: vec!["a.files".into()],
            files: vec![StoredFile { ino: 5, len: 1005, chunks: vec![c1, c2] }],
        };
        table.validate().unwrap();
        let mut out = Vec::new();
        let mut r = PackReader::new(dir.path());
        for c in &table.files[0].chunks {
            r.read_into(&table, c, &mut out).unwrap();
        }
        assert_eq!(&out[..5], b"hello");
        assert_eq!(out.len(), 1005);
        let mut bad = table.clone();
        bad.files[0].chunks[0].crc ^= 1;
        assert!(PackReader::new(dir.path()).read_into(&bad, &bad.files[0].chunks[0], &mut Vec::new()).is_err());
        bad = table.clone();
        bad.files[0].len = 3;
        assert!(bad.validate().is_err());
        bad = table.clone();
        bad.packs[0] = "../x".into();
        assert!(bad.validate().is_err());
    }

    #[test]
    fn an_unfinished_pack_leaves_no_file() {
        let dir = tempfile::tempdir().unwrap();
        let mut w = PackWriter::create(&dir.path().join("b.files")).unwrap();
        w.append(0, b"x").unwrap();
        drop(w);
        assert_eq!(std::fs::read_dir(dir.path()).unwrap().count(), 0);
    }
}
