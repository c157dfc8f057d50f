//! `Image`: an opened, validated, mmapped image file.
//!
//! Everything that comes from the file is checked once in `open` (checksum, then every
//! structural invariant the accessors rely on), so the accessors can index without
//! panicking and without re-validating: a corrupt file is an `ImageError`, never a panic
//! later in the VFS.

use std::fs::File;
use std::io::Read;
use std::path::{Path, PathBuf};

use memmap2::Mmap;
use sha2::{Digest, Sha256};

use crate::format::{
    Header, HeaderError, Index, NodeRec, DATA_OFF, HEADER_LEN, KIND_DIR, KIND_FILE, KIND_SYMLINK, MAGIC, PAGE,
};
use crate::{ImageError, Ino, NodeKind, NodeMeta};

/// A packed, read-only guest image opened from disk (mmapped).
pub struct Image {
    map: Mmap,
    nodes: Vec<NodeRec>,
    blob: Vec<u8>,
    header: Header,
    id: String,
    content_hash: String,
    path: PathBuf,
}

impl std::fmt::Debug for Image {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Image")
            .field("path", &self.path)
            .field("id", &self.id)
            .field("inodes", &self.nodes.len())
            .finish()
    }
}

impl Image {
    pub const ROOT: Ino = 0;

    pub fn open(path: &Path) -> Result<Image, ImageError> {
        let shown = path.display().to_string();
        let io = |source| ImageError::Io { path: shown.clone(), source };
        let corrupt = |msg: String| ImageError::Corrupt(shown.clone(), msg);

        let file = File::open(path).map_err(io)?;
        let len = file.metadata().map_err(io)?.len();
        if len < HEADER_LEN as u64 {
            // Too short to hold a header: a truncated image if the magic is there, else
            // not an image at all.
            let mut head = Vec::new();
            (&file).take(MAGIC.len() as u64).read_to_end(&mut head).map_err(io)?;
            if head == MAGIC {
                return Err(corrupt(format!("truncated to {len} bytes")));
            }
            return Err(ImageError::BadHeader(shown));
        }
        // SAFETY: image files are written once (to a temp name, then renamed into place)
        // and never modified afterwards; we only ever read through the mapping.
        let map = unsafe { Mmap::map(&file) }.map_err(io)?;
        let header = match Header::decode(&map) {
            Ok(h) => h,
            Err(HeaderError::Magic | HeaderError::Truncated) => return Err(ImageError::BadHeader(shown)),
            Err(HeaderError::Version(v)) => {
                return Err(ImageError::BadHeader(format!(
                    "{shown} (format version {v}; this build reads version {})",
                    crate::format::VERSION
                )))
            }
            Err(HeaderError::Flags) => return Err(corrupt("unknown header flags".into())),
        };
        let flen = map.len() as u64;
        let data_end = header.data_off.checked_add(header.data_len);
        let index_end = header.index_off.checked_add(header.index_len);
        match (data_end, index_end) {
            (Some(de), Some(ie)) if header.data_off == DATA_OFF && de <= header.index_off && ie <= flen => {}
            _ => {
                return Err(corrupt(format!(
                    "truncated or inconsistent layout (file {flen} bytes, data {}+{}, index {}+{})",
                    header.data_off, header.data_len, header.index_off, header.index_len
                )))
            }
        }
        let index_bytes = &map[header.index_off as usize..(header.index_off + header.index_len) as usize];
        if header.compute_checksum(index_bytes) != header.checksum {
            return Err(corrupt("index checksum mismatch".into()));
        }
        let index: Index =
            postcard::from_bytes(index_bytes).map_err(|e| corrupt(format!("index does not decode: {e}")))?;
        validate(&index, &header).map_err(corrupt)?;
        Ok(Image {
            id: hex::encode(header.id),
            content_hash: hex::encode(header.content_hash),
            nodes: index.nodes,
            blob: index.blob,
            header,
            map,
            path: path.to_path_buf(),
        })
    }

    /// The hash that names this image (hex): the content hash for `pack_dir` images, the
    /// recipe hash for images made by `build` (see `content_hash` for the former).
    pub fn id(&self) -> &str {
        &self.id
    }

    /// sha256 (hex) of the data region and the index, whatever `id` is.
    pub fn content_hash(&self) -> &str {
        &self.content_hash
    }

    /// Where the image was opened from.
    pub fn path(&self) -> &Path {
        &self.path
    }

    pub fn inode_count(&self) -> u32 {
        // validate() guarantees the count fits in u32.
        self.nodes.len() as u32
    }

    pub fn meta(&self, ino: Ino) -> Option<NodeMeta> {
        let n = self.nodes.get(ino as usize)?;
        let (kind, size) = match n.kind {
            KIND_DIR => (NodeKind::Dir, 4096),
            KIND_FILE => (NodeKind::File, n.b),
            _ => (NodeKind::Symlink, n.b),
        };
        Some(NodeMeta { kind, perm: n.perm, size, mtime: n.mtime })
    }

    /// One directory entry by name (no "." / "..", no symlink following).
    pub fn lookup(&self, dir: Ino, name: &[u8]) -> Option<Ino> {
        let (first, count) = self.dir_range(dir)?;
        let range = first..first + count;
        let slice = self.nodes.get(range)?;
        let i = slice.binary_search_by(|n| self.name_of(n).cmp(name)).ok()?;
        Some((first + i) as Ino)
    }

    /// The parent directory of `ino` (root's parent is root; so is an out-of-range ino's).
    pub fn parent(&self, ino: Ino) -> Ino {
        self.nodes.get(ino as usize).map_or(Self::ROOT, |n| n.parent)
    }

    /// Name of `ino` in its parent directory (empty for the root).
    pub fn name(&self, ino: Ino) -> Option<&[u8]> {
        self.nodes.get(ino as usize).map(|n| self.name_of(n))
    }

    /// Entries of a directory, sorted by name (no "." / ".."). Empty for non-directories.
    pub fn children(&self, dir: Ino) -> Vec<(&[u8], Ino)> {
        let Some((first, count)) = self.dir_range(dir) else {
            return Vec::new();
        };
        (first..first + count).filter_map(|i| self.nodes.get(i).map(|n| (self.name_of(n), i as Ino))).collect()
    }

    pub fn read_link(&self, ino: Ino) -> Option<&[u8]> {
        let n = self.nodes.get(ino as usize)?;
        if n.kind != KIND_SYMLINK {
            return None;
        }
        self.blob.get(n.a as usize..(n.a + n.b) as usize)
    }

    /// File bytes, borrowed from the mapped image.
    pub fn content(&self, ino: Ino) -> Option<&[u8]> {
        let n = self.nodes.get(ino as usize)?;
        if n.kind != KIND_FILE {
            return None;
        }
        if n.b == 0 {
            return Some(&[]);
        }
        self.map.get(n.a as usize..(n.a + n.b) as usize)
    }

    /// Offset of a regular file's content inside the image file (a multiple of 4096 when
    /// the file is non-empty), for callers that want to mmap the image file themselves.
    pub fn content_offset(&self, ino: Ino) -> Option<u64> {
        let n = self.nodes.get(ino as usize)?;
        (n.kind == KIND_FILE).then_some(n.a)
    }

    /// Re-hash the data region + index and compare with the header (reads the whole file).
    pub fn verify_content(&self) -> Result<(), ImageError> {
        let h = &self.header;
        let data = self.map.get(h.data_off as usize..(h.data_off + h.data_len) as usize);
        let index = self.map.get(h.index_off as usize..(h.index_off + h.index_len) as usize);
        let (Some(data), Some(index)) = (data, index) else {
            return Err(ImageError::Corrupt(self.path.display().to_string(), "truncated".into()));
        };
        let mut s = Sha256::new();
        s.update(data);
        s.update(index);
        let got: [u8; 32] = s.finalize().into();
        if got != h.content_hash {
            return Err(ImageError::Corrupt(self.path.display().to_string(), "content hash mismatch".into()));
        }
        Ok(())
    }

    fn name_of(&self, n: &NodeRec) -> &[u8] {
        let s = n.name_off as usize;
        self.blob.get(s..s + n.name_len as usize).unwrap_or(&[])
    }

    fn dir_range(&self, dir: Ino) -> Option<(usize, usize)> {
        let n = self.nodes.get(dir as usize)?;
        (n.kind == KIND_DIR).then_some((n.a as usize, n.b as usize))
    }
}

/// Check every invariant the accessors rely on. Returns a description of the first
/// violation.
fn validate(index: &Index, h: &Header) -> Result<(), String> {
    let nodes = &index.nodes;
    let n = nodes.len();
    if n == 0 || n > u32::MAX as usize {
        return Err(format!("bad inode count {n}"));
    }
    let blob_len = index.blob.len() as u64;
    let in_blob = |off: u64, len: u64| off.checked_add(len).is_some_and(|e| e <= blob_len);
    let data_end = h.data_off + h.data_len; // checked by the caller
    let mut claimed: u64 = 0;
    for (i, r) in nodes.iter().enumerate() {
        if r.perm & !0o7777 != 0 {
            return Err(format!("inode {i}: bad permission bits {:#o}", r.perm));
        }
        if !in_blob(r.name_off as u64, r.name_len as u64) {
            return Err(format!("inode {i}: name out of bounds"));
        }
        let name = &index.blob[r.name_off as usize..(r.name_off as usize + r.name_len as usize)];
        if i == 0 {
            if r.kind != KIND_DIR || r.parent != 0 || !name.is_empty() {
                return Err("root is not a directory with parent root".into());
            }
        } else if name.is_empty() || name == b"." || name == b".." || name.contains(&b'/') || name.contains(&0) {
            return Err(format!("inode {i}: invalid name {:?}", String::from_utf8_lossy(name)));
        }
        match r.kind {
            KIND_DIR => {
                let (first, count) = (r.a, r.b);
                // Children come after their directory (breadth-first numbering): this rules
                // out cycles and the root being anyone's child.
                if count > 0 && (first <= i as u64 || first.checked_add(count).is_none_or(|e| e > n as u64)) {
                    return Err(format!("inode {i}: children range {first}+{count} invalid"));
                }
                let mut prev: Option<&[u8]> = None;
                for c in first..first + count {
                    let cr = &nodes[c as usize];
                    if cr.parent as usize != i {
                        return Err(format!("inode {c}: parent {} but listed in {i}", cr.parent));
                    }
                    let cs = cr.name_off as usize;
                    let cname = index.blob.get(cs..cs + cr.name_len as usize).unwrap_or(&[]);
                    if prev.is_some_and(|p| p >= cname) {
                        return Err(format!("directory {i}: entries not strictly sorted"));
                    }
                    prev = Some(cname);
                }
                claimed += count;
            }
            KIND_FILE => {
                if r.b > 0 {
                    let ok =
                        r.a % PAGE == 0 && r.a >= h.data_off && r.a.checked_add(r.b).is_some_and(|e| e <= data_end);
                    if !ok {
                        return Err(format!("inode {i}: content {}+{} outside data region", r.a, r.b));
                    }
                }
            }
            KIND_SYMLINK => {
                if !in_blob(r.a, r.b) {
                    return Err(format!("inode {i}: symlink target out of bounds"));
                }
            }
            k => return Err(format!("inode {i}: unknown kind {k}")),
        }
    }
    // Each non-root node is listed by at most one directory (its parent, checked above);
    // the counts adding up means every one is listed exactly once.
    if claimed != n as u64 - 1 {
        return Err(format!("{} of {} inodes are not in any directory", n as u64 - 1 - claimed.min(n as u64 - 1), n));
    }
    Ok(())
}
