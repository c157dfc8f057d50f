//! On-disk layout of a forkbox image (one read-only file).
//!
//! ```text
//! 0      header (HEADER_LEN bytes, little-endian), zero-padded to DATA_OFF
//! 4096   data region: every non-empty regular file's bytes, contiguous, each file
//!        starting on a 4096-byte boundary (so the VFS can mmap/copy it page-wise)
//! ...    index: postcard-serialized `Index` (nodes by inode number + a name blob)
//! ```
//!
//! Why this shape: the file is mmapped once and file contents are borrowed straight out of
//! the mapping; only the small index is decoded (and validated) at open. Inodes are
//! numbered breadth-first with each directory's children sorted by name, so a directory's
//! entries are one contiguous inode range: `lookup` is a binary search and no separate
//! dirent table is needed.
//!
//! Integrity: `checksum = sha256(header[..CHECKSUM_AT] || index)` is verified at open, so a
//! damaged header or index is an error, never a panic. File contents are covered by
//! `content_hash = sha256(data region || index)`, checked only on demand
//! (`Image::verify_content`) because it means reading the whole file.

use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};

pub const MAGIC: &[u8; 10] = b"FORKBOXIMG";
pub const VERSION: u32 = 1;
/// Alignment of every file's content inside the image.
pub const PAGE: u64 = 4096;
/// Where the data region starts (the header owns the first page).
pub const DATA_OFF: u64 = PAGE;

const O_MAGIC: usize = 0; // [u8; 10] + 2 zero bytes
const O_VERSION: usize = 12; // u32
const O_FLAGS: usize = 16; // u32, must be 0
const O_INDEX_OFF: usize = 24; // u64
const O_INDEX_LEN: usize = 32; // u64
const O_DATA_OFF: usize = 40; // u64
const O_DATA_LEN: usize = 48; // u64
const O_CONTENT_HASH: usize = 56; // [u8; 32]
const O_ID: usize = 88; // [u8; 32]
/// The checksum covers the header bytes before it plus the index.
pub const CHECKSUM_AT: usize = 120; // [u8; 32]
pub const HEADER_LEN: usize = 152;

pub const KIND_DIR: u8 = 0;
pub const KIND_FILE: u8 = 1;
pub const KIND_SYMLINK: u8 = 2;

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Header {
    pub version: u32,
    pub index_off: u64,
    pub index_len: u64,
    pub data_off: u64,
    pub data_len: u64,
    /// sha256(data region || index).
    pub content_hash: [u8; 32],
    /// What names the image: the content hash for `pack_dir`, the recipe hash for built images.
    pub id: [u8; 32],
    pub checksum: [u8; 32],
}

impl Header {
    pub fn encode(&self) -> [u8; HEADER_LEN] {
        let mut b = [0u8; HEADER_LEN];
        b[O_MAGIC..O_MAGIC + MAGIC.len()].copy_from_slice(MAGIC);
        b[O_VERSION..O_VERSION + 4].copy_from_slice(&self.version.to_le_bytes());
        b[O_FLAGS..O_FLAGS + 4].copy_from_slice(&0u32.to_le_bytes());
        b[O_INDEX_OFF..O_INDEX_OFF + 8].copy_from_slice(&self.index_off.to_le_bytes());
        b[O_INDEX_LEN..O_INDEX_LEN + 8].copy_from_slice(&self.index_len.to_le_bytes());
        b[O_DATA_OFF..O_DATA_OFF + 8].copy_from_slice(&self.data_off.to_le_bytes());
        b[O_DATA_LEN..O_DATA_LEN + 8].copy_from_slice(&self.data_len.to_le_bytes());
        b[O_CONTENT_HASH..O_CONTENT_HASH + 32].copy_from_slice(&self.content_hash);
        b[O_ID..O_ID + 32].copy_from_slice(&self.id);
        b[CHECKSUM_AT..CHECKSUM_AT + 32].copy_from_slice(&self.checksum);
        b
    }

    /// Parse the fixed header (magic, version, fields); offsets are checked by the reader.
    pub fn decode(b: &[u8]) -> Result<Header, HeaderError> {
        let b: &[u8; HEADER_LEN] = b.get(..HEADER_LEN).and_then(|s| s.try_into().ok()).ok_or(HeaderError::Truncated)?;
        if &b[O_MAGIC..O_MAGIC + MAGIC.len()] != MAGIC || b[10] != 0 || b[11] != 0 {
            return Err(HeaderError::Magic);
        }
        let version = u32_at(b, O_VERSION);
        if version != VERSION {
            return Err(HeaderError::Version(version));
        }
        if u32_at(b, O_FLAGS) != 0 {
            return Err(HeaderError::Flags);
        }
        Ok(Header {
            version,
            index_off: u64_at(b, O_INDEX_OFF),
            index_len: u64_at(b, O_INDEX_LEN),
            data_off: u64_at(b, O_DATA_OFF),
            data_len: u64_at(b, O_DATA_LEN),
            content_hash: arr32(b, O_CONTENT_HASH),
            id: arr32(b, O_ID),
            checksum: arr32(b, CHECKSUM_AT),
        })
    }

    /// sha256 over the header fields (everything before the checksum) and the index bytes.
    pub fn compute_checksum(&self, index: &[u8]) -> [u8; 32] {
        let enc = self.encode();
        let mut h = Sha256::new();
        h.update(&enc[..CHECKSUM_AT]);
        h.update(index);
        h.finalize().into()
    }
}

#[derive(Debug)]
pub enum HeaderError {
    Truncated,
    Magic,
    Version(u32),
    Flags,
}

fn u32_at(b: &[u8; HEADER_LEN], o: usize) -> u32 {
    let mut a = [0u8; 4];
    a.copy_from_slice(&b[o..o + 4]);
    u32::from_le_bytes(a)
}

fn u64_at(b: &[u8; HEADER_LEN], o: usize) -> u64 {
    let mut a = [0u8; 8];
    a.copy_from_slice(&b[o..o + 8]);
    u64::from_le_bytes(a)
}

fn arr32(b: &[u8; HEADER_LEN], o: usize) -> [u8; 32] {
    let mut a = [0u8; 32];
    a.copy_from_slice(&b[o..o + 32]);
    a
}

/// The index: one record per inode (index = inode number) and a blob holding entry names
/// and symlink targets.
#[derive(Serialize, Deserialize, Debug, Default, Clone, PartialEq, Eq)]
pub struct Index {
    pub nodes: Vec<NodeRec>,
    pub blob: Vec<u8>,
}

/// One inode. The meaning of `a`/`b` depends on `kind`:
/// - dir: `a` = first child inode, `b` = number of children (children sorted by name);
/// - file: `a` = absolute offset of the content in the image file, `b` = length;
/// - symlink: `a` = offset of the target in `blob`, `b` = target length.
#[derive(Serialize, Deserialize, Debug, Clone, Copy, PartialEq, Eq)]
pub struct NodeRec {
    pub kind: u8,
    pub perm: u32,
    pub mtime: i64,
    pub parent: u32,
    /// This node's name in its parent directory: `blob[name_off..name_off + name_len]`.
    pub name_off: u32,
    pub name_len: u32,
    pub a: u64,
    pub b: u64,
}
