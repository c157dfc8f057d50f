//! The file-system part of a checkpoint, incremental: file bytes go to pack
//! files (see `forkbox_snapshot::files`), and a checkpoint writes only the
//! chunks that changed since the sandbox's previous checkpoint.
//!
//! A sandbox remembers, per overlay file, the bytes its last checkpoint stored
//! (an `Arc` shared with its VFS) and where their chunks are. Holding that
//! `Arc` makes the VFS copy a file on its next write (copy-on-write, as after
//! a fork), so an unchanged file is recognised by pointer, without reading it;
//! a changed one is compared chunk by chunk with what was stored.

use std::collections::HashMap;
use std::sync::Arc;

use forkbox_linux::process::ProcessState;
use forkbox_linux::vfs::{BodyState, FileBytes, FileState, Ino};
use forkbox_snapshot::files::{FileTable, PackReader, PackWriter, StoredChunk, StoredFile, CHUNK, PACK_HEADER};
use forkbox_snapshot::StateError;

/// A stored chunk and the pack (file name) it is in.
#[derive(Clone, Debug)]
struct Located {
    pack: Arc<str>,
    chunk: StoredChunk,
}

/// What the sandbox's latest checkpoint stored of each overlay file.
#[derive(Default)]
pub(crate) struct StoredFiles {
    files: HashMap<Ino, (Arc<Vec<u8>>, Vec<Located>)>,
}

enum Part {
    /// A chunk already in a pack.
    Keep(Located),
    /// Bytes `range` of the file go into the new pack at `offset`.
    New { range: std::ops::Range<usize>, offset: u64, crc: u32 },
}

/// The files of a checkpoint, decided before anything is written.
pub(crate) struct FilesPlan {
    files: Vec<(Ino, Arc<Vec<u8>>, Vec<Part>)>,
    /// Size of the new pack (0: nothing new, no pack is written).
    pack_bytes: u64,
    /// The table the state file will carry.
    pub table: FileTable,
}

impl FilesPlan {
    /// Take the bytes of every non-empty overlay file out of `state` (they stay
    /// in it as empty files; the table says where they are) and decide which
    /// chunks are new (to go into the pack `pack_name`).
    pub(crate) fn new(state: &mut ProcessState, stored: &StoredFiles, pack_name: &str) -> FilesPlan {
        let mut files = Vec::new();
        let mut at = PACK_HEADER;
        let new_pack: Arc<str> = Arc::from(pack_name);
        for node in &mut state.vfs.nodes {
            let BodyState::File(FileState::Owned(bytes)) = &mut node.body else { continue };
            if bytes.0.is_empty() {
                continue;
            }
            let data = std::mem::replace(&mut bytes.0, Arc::new(Vec::new()));
            let old = stored.files.get(&node.ino);
            let same = old.is_some_and(|(b, _)| Arc::ptr_eq(b, &data));
            let mut parts = Vec::with_capacity(data.len().div_ceil(CHUNK));
            for (i, start) in (0..data.len()).step_by(CHUNK).enumerate() {
                let range = start..(start + CHUNK).min(data.len());
                let keep = old.and_then(|(ob, oc)| {
                    let c = oc.get(i)?;
                    let unchanged = same || ob.get(range.clone()) == Some(&data[range.clone()]);
                    (unchanged && c.chunk.len as usize == range.len()).then(|| c.clone())
                });
                parts.push(match keep {
                    Some(l) => Part::Keep(l),
                    None => {
                        let crc = crc32fast::hash(&data[range.clone()]);
                        let offset = at;
                        at += range.len() as u64;
                        Part::New { range, offset, crc }
                    }
                });
            }
            files.push((node.ino, data, parts));
        }
        let pack_bytes = if at > PACK_HEADER { at } else { 0 };
        // The table, with pack indices.
        let mut packs: Vec<String> = Vec::new();
        let mut index: HashMap<Arc<str>, u32> = HashMap::new();
        let mut idx = |name: &Arc<str>| -> u32 {
            *index.entry(name.clone()).or_insert_with(|| {
                packs.push(name.to_string());
                (packs.len() - 1) as u32
            })
        };
        let mut table_files = Vec::with_capacity(files.len());
        for (ino, data, parts) in &files {
            let chunks = parts
                .iter()
                .map(|p| match p {
                    Part::Keep(l) => StoredChunk { pack: idx(&l.pack), ..l.chunk },
                    Part::New { range, offset, crc } => {
                        StoredChunk { pack: idx(&new_pack), offset: *offset, len: range.len() as u32, crc: *crc }
                    }
                })
                .collect();
            table_files.push(StoredFile { ino: *ino, len: data.len() as u64, chunks });
        }
        table_files.sort_by_key(|f| f.ino);
        FilesPlan { files, pack_bytes, table: FileTable { packs, files: table_files } }
    }

    /// Bytes the new pack will take on disk (0 if nothing changed).
    pub(crate) fn pack_bytes(&self) -> u64 {
        self.pack_bytes
    }

    /// Write the new pack (if any) into `f`, a new empty file (the caller syncs
    /// and names it, and removes it if a later step of the checkpoint fails).
    pub(crate) fn write_pack_into(&self, f: std::fs::File) -> Result<u64, StateError> {
        if self.pack_bytes == 0 {
            return Ok(0);
        }
        self.write_with(PackWriter::into_file(f)?)
    }

    fn write_with(&self, mut w: PackWriter) -> Result<u64, StateError> {
        for (_, data, parts) in &self.files {
            for p in parts {
                if let Part::New { range, offset, .. } = p {
                    let c = w.append(0, &data[range.clone()])?;
                    if c.offset != *offset {
                        return Err(StateError::Corrupt("pack offsets out of step".into()));
                    }
                }
            }
        }
        w.finish()
    }

    /// What the sandbox remembers once this checkpoint is committed.
    pub(crate) fn into_stored(self) -> StoredFiles {
        let FilesPlan { files, table, .. } = self;
        let mut out = HashMap::with_capacity(files.len());
        let by_ino: HashMap<Ino, &StoredFile> = table.files.iter().map(|f| (f.ino, f)).collect();
        for (ino, data, _) in files {
            let Some(f) = by_ino.get(&ino) else { continue };
            let chunks = f
                .chunks
                .iter()
                .filter_map(|c| {
                    Some(Located { pack: Arc::from(table.packs.get(c.pack as usize)?.as_str()), chunk: *c })
                })
                .collect();
            out.insert(ino, (data, chunks));
        }
        StoredFiles { files: out }
    }
}

/// Put the bytes of the files in `table` (read from the packs `reader` has,
/// verified) back into `state`, and remember where they are stored.
pub(crate) fn load(
    state: &mut ProcessState,
    table: &FileTable,
    reader: &mut PackReader<'_>,
) -> Result<StoredFiles, StateError> {
    table.validate()?;
    // Never allocate more than the state says its overlay holds.
    if table.total_bytes() > state.vfs.overlay_bytes {
        return Err(StateError::Corrupt("stored files hold more than the overlay's bytes".into()));
    }
    let mut nodes: HashMap<Ino, &mut FileBytes> = HashMap::new();
    for node in &mut state.vfs.nodes {
        if let BodyState::File(FileState::Owned(b)) = &mut node.body {
            nodes.insert(node.ino, b);
        }
    }
    let mut stored = HashMap::with_capacity(table.files.len());
    for f in &table.files {
        let slot = nodes
            .get_mut(&f.ino)
            .ok_or_else(|| StateError::Corrupt(format!("stored file {} is not a file of the state", f.ino)))?;
        if !slot.0.is_empty() {
            return Err(StateError::Corrupt(format!("file {} has bytes in the state and in a pack", f.ino)));
        }
        let mut bytes = Vec::with_capacity(f.len as usize);
        let mut located = Vec::with_capacity(f.chunks.len());
        for c in &f.chunks {
            reader.read_into(table, c, &mut bytes)?;
            let pack = table.packs.get(c.pack as usize).map_or("", String::as_str);
            located.push(Located { pack: Arc::from(pack), chunk: *c });
        }
        let data = Arc::new(bytes);
        slot.0 = data.clone();
        stored.insert(f.ino, (data, located));
    }
    Ok(StoredFiles { files: stored })
}
