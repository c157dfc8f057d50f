//! The state file: magic, version, length, checksum, then a postcard payload.

use std::path::Path;

use forkbox_linux::process::ProcessState;
use forkbox_vmm::VcpuState;
use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};

use crate::memory::MemoryStats;

pub const MAGIC: &[u8; 8] = b"FBXSNAP\0";
/// 2: maps encoded as sequences of pairs.
/// 3: fd objects (pipes, AF_UNIX sockets, eventfd, epoll, timerfd) in the fd
///    table; FIFO and socket nodes in the VFS.
/// 4: AF_INET/AF_INET6 sockets in the fd table (`FileKind::Socket`: id,
///    domain, type; the host socket itself is never in a snapshot).
pub const FORMAT_VERSION: u32 = 4;
const HEADER_LEN: usize = 8 + 4 + 8 + 32;
/// A state file larger than this is rejected before it is read into memory.
const MAX_PAYLOAD: u64 = 4 << 30;

#[derive(Debug, thiserror::Error)]
pub enum StateError {
    #[error("snapshot {what} {path}: {source}")]
    Io {
        what: &'static str,
        path: String,
        #[source]
        source: std::io::Error,
    },
    #[error("not a forkbox snapshot (bad magic)")]
    BadMagic,
    #[error("snapshot format version {0}, this forkbox reads version {FORMAT_VERSION}")]
    BadVersion(u32),
    #[error("snapshot is corrupt: {0}")]
    Corrupt(String),
}

/// Everything a snapshot's state file holds.
#[derive(Serialize, Deserialize)]
pub struct Snapshot {
    /// The image the process' file system is layered on.
    pub image_id: String,
    pub vcpu: VcpuState,
    pub process: ProcessState,
    pub memory: MemoryStats,
    /// Free-form facts about the snapshot (what the agent reported, the preload...).
    pub info: String,
}

pub fn encode(s: &Snapshot) -> Vec<u8> {
    let payload = postcard::to_stdvec(s).unwrap_or_default();
    let mut out = Vec::with_capacity(HEADER_LEN + payload.len());
    out.extend_from_slice(MAGIC);
    out.extend_from_slice(&FORMAT_VERSION.to_le_bytes());
    out.extend_from_slice(&(payload.len() as u64).to_le_bytes());
    out.extend_from_slice(&Sha256::digest(&payload));
    out.extend_from_slice(&payload);
    out
}

pub fn decode(bytes: &[u8]) -> Result<Snapshot, StateError> {
    let header = bytes.get(..HEADER_LEN).ok_or_else(|| StateError::Corrupt("truncated header".into()))?;
    if &header[..8] != MAGIC {
        return Err(StateError::BadMagic);
    }
    let version = u32::from_le_bytes([header[8], header[9], header[10], header[11]]);
    if version != FORMAT_VERSION {
        return Err(StateError::BadVersion(version));
    }
    let mut len = [0u8; 8];
    len.copy_from_slice(&header[12..20]);
    let len = u64::from_le_bytes(len);
    let payload = &bytes[HEADER_LEN..];
    if len > MAX_PAYLOAD || payload.len() as u64 != len {
        return Err(StateError::Corrupt(format!("payload is {} bytes, header says {len}", payload.len())));
    }
    if Sha256::digest(payload).as_slice() != &header[20..52] {
        return Err(StateError::Corrupt("checksum mismatch".into()));
    }
    postcard::from_bytes(payload).map_err(|e| StateError::Corrupt(format!("undecodable payload: {e}")))
}

/// Write atomically: temp file, fsync, rename, fsync the directory.
pub fn write_state(path: &Path, s: &Snapshot) -> Result<(), StateError> {
    let tmp = path.with_extension("tmp");
    let ioe = |what| move |source| StateError::Io { what, path: path.display().to_string(), source };
    {
        use std::io::Write;
        let mut f = std::fs::File::create(&tmp).map_err(ioe("create"))?;
        f.write_all(&encode(s)).map_err(ioe("write"))?;
        f.sync_all().map_err(ioe("fsync"))?;
    }
    std::fs::rename(&tmp, path).map_err(ioe("rename"))?;
    if let Some(dir) = path.parent() {
        if let Ok(d) = std::fs::File::open(dir) {
            let _ = d.sync_all();
        }
    }
    Ok(())
}

pub fn read_state(path: &Path) -> Result<Snapshot, StateError> {
    let ioe = |what| move |source| StateError::Io { what, path: path.display().to_string(), source };
    let len = std::fs::metadata(path).map_err(ioe("stat"))?.len();
    if len > MAX_PAYLOAD + HEADER_LEN as u64 {
        return Err(StateError::Corrupt(format!("state file of {len} bytes")));
    }
    decode(&std::fs::read(path).map_err(ioe("read"))?)
}
