//! `pack_dir`: host directory tree -> image file.
//!
//! The tree is walked breadth-first with each directory's entries sorted by name (see
//! `format.rs` for why), never following host symlinks: a symlink's target is stored as
//! bytes and resolved later, inside the image, by the VFS. Sockets, fifos and device nodes
//! are skipped. The output is written to a temporary sibling and renamed into place, so an
//! image path either holds a complete image or nothing.

use std::collections::VecDeque;
use std::ffi::OsString;
use std::fs::{self, File};
use std::io::{self, BufWriter, Seek, SeekFrom, Write};
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::{MetadataExt, PermissionsExt};
use std::path::{Path, PathBuf};

use sha2::{Digest, Sha256};

use crate::format::{Header, Index, NodeRec, DATA_OFF, HEADER_LEN, KIND_DIR, KIND_FILE, KIND_SYMLINK, PAGE, VERSION};
use crate::ImageError;

/// Knobs for `pack_dir_with`.
#[derive(Clone, Debug, Default)]
pub struct PackOptions {
    /// Store this (32-byte, hex) id in the header instead of the content hash.
    pub id: Option<String>,
    /// Clamp every mtime to at most this value (reproducible builds, like SOURCE_DATE_EPOCH).
    pub mtime_clamp: Option<i64>,
}

/// What `pack_dir_with` produced.
#[derive(Clone, Debug)]
pub struct PackStats {
    /// The id stored in the header (== `content_hash` unless overridden).
    pub id: String,
    pub content_hash: String,
    pub inodes: u32,
    pub files: u64,
    /// Sum of regular file sizes.
    pub file_bytes: u64,
    /// Size of the image file.
    pub image_bytes: u64,
}

/// Pack a host directory tree (files, dirs, symlinks; modes and mtimes kept) into an
/// image file at `out`. Returns the image id (content hash, hex).
pub fn pack_dir(root: &Path, out: &Path) -> Result<String, ImageError> {
    pack_dir_with(root, out, &PackOptions::default()).map(|s| s.id)
}

/// `pack_dir` with options; returns statistics as well as the id.
pub fn pack_dir_with(root: &Path, out: &Path, opts: &PackOptions) -> Result<PackStats, ImageError> {
    let id_override = match &opts.id {
        None => None,
        Some(hexid) => {
            let mut a = [0u8; 32];
            hex::decode_to_slice(hexid, &mut a).map_err(|e| {
                ImageError::Corrupt(
                    out.display().to_string(),
                    format!("requested id {hexid:?} is not 32 hex bytes: {e}"),
                )
            })?;
            Some(a)
        }
    };
    let tree = walk(root, opts.mtime_clamp)?;

    let tmp = tmp_sibling(out);
    let result = write_image(&tree, &tmp, id_override);
    match result {
        Ok(mut stats) => {
            fs::rename(&tmp, out).map_err(|e| io_err(out, e))?;
            stats.inodes = tree.nodes.len() as u32;
            Ok(stats)
        }
        Err(e) => {
            let _ = fs::remove_file(&tmp);
            Err(e)
        }
    }
}

struct Tree {
    nodes: Vec<NodeRec>,
    blob: Vec<u8>,
    /// Host path of each regular file, by inode (None for dirs and symlinks).
    sources: Vec<Option<PathBuf>>,
}

fn io_err(p: &Path, source: io::Error) -> ImageError {
    ImageError::Io { path: p.display().to_string(), source }
}

fn tmp_sibling(out: &Path) -> PathBuf {
    let mut name = out.file_name().map(|n| n.to_os_string()).unwrap_or_else(|| OsString::from("image"));
    name.push(format!(".tmp.{}", std::process::id()));
    out.with_file_name(name)
}

fn blob_push(blob: &mut Vec<u8>, bytes: &[u8], what: &Path) -> Result<(u32, u32), ImageError> {
    let off = u32::try_from(blob.len());
    let len = u32::try_from(bytes.len());
    match (off, len) {
        (Ok(o), Ok(l)) if (o as u64 + l as u64) <= u32::MAX as u64 => {
            blob.extend_from_slice(bytes);
            Ok((o, l))
        }
        _ => Err(ImageError::Corrupt(what.display().to_string(), "name table exceeds 4 GiB".into())),
    }
}

/// Breadth-first walk assigning inode numbers; a directory's children get consecutive
/// numbers in name order.
fn walk(root: &Path, clamp: Option<i64>) -> Result<Tree, ImageError> {
    let clamp_t = |t: i64| clamp.map_or(t, |c| t.min(c));
    // The root itself may be given as a symlink to a directory: follow that one.
    let rmeta = fs::metadata(root).map_err(|e| io_err(root, e))?;
    if !rmeta.is_dir() {
        return Err(io_err(root, io::Error::new(io::ErrorKind::NotADirectory, "not a directory")));
    }
    let mut t = Tree {
        nodes: vec![NodeRec {
            kind: KIND_DIR,
            perm: rmeta.permissions().mode() & 0o7777,
            mtime: clamp_t(rmeta.mtime()),
            parent: 0,
            name_off: 0,
            name_len: 0,
            a: 0,
            b: 0,
        }],
        blob: Vec::new(),
        sources: vec![None],
    };
    let mut dirs: VecDeque<(u32, PathBuf)> = VecDeque::from([(0, root.to_path_buf())]);
    while let Some((dino, dpath)) = dirs.pop_front() {
        let mut entries = Vec::new();
        for e in fs::read_dir(&dpath).map_err(|e| io_err(&dpath, e))? {
            let e = e.map_err(|e| io_err(&dpath, e))?;
            let path = e.path();
            let meta = fs::symlink_metadata(&path).map_err(|e| io_err(&path, e))?;
            let ft = meta.file_type();
            if !(ft.is_dir() || ft.is_file() || ft.is_symlink()) {
                tracing::debug!(path = %path.display(), "skipping special file");
                continue;
            }
            entries.push((e.file_name(), path, meta));
        }
        entries.sort_by(|a, b| a.0.as_bytes().cmp(b.0.as_bytes()));
        let first = t.nodes.len() as u64;
        if first + entries.len() as u64 > u32::MAX as u64 {
            return Err(io_err(root, io::Error::other("more than 2^32 inodes")));
        }
        for (name, path, meta) in entries {
            let ino = t.nodes.len() as u32;
            let (name_off, name_len) = blob_push(&mut t.blob, name.as_bytes(), &path)?;
            let ft = meta.file_type();
            let mut rec = NodeRec {
                kind: KIND_DIR,
                perm: meta.permissions().mode() & 0o7777,
                mtime: clamp_t(meta.mtime()),
                parent: dino,
                name_off,
                name_len,
                a: 0,
                b: 0,
            };
            let mut source = None;
            if ft.is_dir() {
                dirs.push_back((ino, path));
            } else if ft.is_file() {
                rec.kind = KIND_FILE;
                rec.b = meta.len(); // provisional: the real length is what we copy
                source = Some(path);
            } else {
                rec.kind = KIND_SYMLINK;
                let target = fs::read_link(&path).map_err(|e| io_err(&path, e))?;
                let (o, l) = blob_push(&mut t.blob, target.as_os_str().as_bytes(), &path)?;
                rec.a = o as u64;
                rec.b = l as u64;
            }
            t.nodes.push(rec);
            t.sources.push(source);
        }
        let count = t.nodes.len() as u64 - first;
        let d = &mut t.nodes[dino as usize];
        d.a = if count > 0 { first } else { 0 };
        d.b = count;
    }
    Ok(t)
}

/// Writer that hashes everything it writes and tracks the logical position; zero padding
/// is hashed but left as a hole in the file.
struct HashingWriter {
    out: BufWriter<File>,
    hash: Sha256,
    pos: u64,
}

impl HashingWriter {
    fn pad_to(&mut self, align: u64) -> io::Result<()> {
        let pad = (align - self.pos % align) % align;
        if pad > 0 {
            const ZEROS: [u8; PAGE as usize] = [0; PAGE as usize];
            self.hash.update(&ZEROS[..pad as usize]);
            self.pos += pad;
            self.out.seek(SeekFrom::Start(self.pos))?;
        }
        Ok(())
    }
}

impl Write for HashingWriter {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        let n = self.out.write(buf)?;
        self.hash.update(&buf[..n]);
        self.pos += n as u64;
        Ok(n)
    }
    fn flush(&mut self) -> io::Result<()> {
        self.out.flush()
    }
}

fn write_image(tree: &Tree, tmp: &Path, id_override: Option<[u8; 32]>) -> Result<PackStats, ImageError> {
    let file = File::create(tmp).map_err(|e| io_err(tmp, e))?;
    let mut w = HashingWriter { out: BufWriter::with_capacity(1 << 20, file), hash: Sha256::new(), pos: DATA_OFF };
    w.out.seek(SeekFrom::Start(DATA_OFF)).map_err(|e| io_err(tmp, e))?;

    let mut nodes = tree.nodes.clone();
    let (mut files, mut file_bytes) = (0u64, 0u64);
    for (rec, src) in nodes.iter_mut().zip(&tree.sources) {
        let Some(src) = src else { continue };
        files += 1;
        let mut f = File::open(src).map_err(|e| io_err(src, e))?;
        let start = w.pos;
        let len = io::copy(&mut f, &mut w).map_err(|e| io_err(src, e))?;
        rec.a = if len > 0 { start } else { 0 };
        rec.b = len;
        file_bytes += len;
        w.pad_to(PAGE).map_err(|e| io_err(tmp, e))?;
    }
    let data_len = w.pos - DATA_OFF;

    let index = Index { nodes, blob: tree.blob.clone() };
    let index_bytes = postcard::to_allocvec(&index)
        .map_err(|e| ImageError::Corrupt(tmp.display().to_string(), format!("index serialization: {e}")))?;
    let index_off = w.pos;
    w.write_all(&index_bytes).map_err(|e| io_err(tmp, e))?;
    let content_hash: [u8; 32] = w.hash.clone().finalize().into();

    let mut header = Header {
        version: VERSION,
        index_off,
        index_len: index_bytes.len() as u64,
        data_off: DATA_OFF,
        data_len,
        content_hash,
        id: id_override.unwrap_or(content_hash),
        checksum: [0; 32],
    };
    header.checksum = header.compute_checksum(&index_bytes);
    let enc: [u8; HEADER_LEN] = header.encode();
    let mut file = w.out.into_inner().map_err(|e| io_err(tmp, e.into_error()))?;
    file.seek(SeekFrom::Start(0)).map_err(|e| io_err(tmp, e))?;
    file.write_all(&enc).map_err(|e| io_err(tmp, e))?;
    file.sync_all().map_err(|e| io_err(tmp, e))?;
    let image_bytes = index_off + index_bytes.len() as u64;
    // Images are read-only artefacts.
    let _ = fs::set_permissions(tmp, fs::Permissions::from_mode(0o444));
    Ok(PackStats {
        id: hex::encode(header.id),
        content_hash: hex::encode(content_hash),
        inodes: 0,
        files,
        file_bytes,
        image_bytes,
    })
}
