//! The guest's virtual file system: the read-only image as the lower layer and an
//! in-memory overlay of persistent maps on top.
//!
//! - Everything is resolved in memory, inside the image + overlay: no host path can be
//!   named (there is no `std::fs` in here).
//! - `Vfs` is `Clone` in O(1) and the clones are independent afterwards: the overlay is
//!   made of `imbl` maps and `Arc`ed file bytes, copied on the first write after a clone
//!   (a whole file once, then in place).
//! - Image inodes keep their numbers (`0..image.inode_count()`, the image root is the
//!   VFS root); a copy-up stores an overlay node under the same number. New inodes are
//!   numbered from `FIRST_OVERLAY_INO` (1 << 32).
//! - The guest is root (uid 0): permission bits are kept and reported but only `X_OK`
//!   in `access` looks at them. Nothing is read-only: image files are written through
//!   copy-up.
//!
//! Open files: `open` takes a reference on the inode it returns and the caller gives it
//! back with `release` when the open file description is closed (use `hold` for other
//! long-lived references, e.g. a cwd). An unlinked inode stays readable/writable by
//! number while referenced, and is dropped (its bytes freed from the quota) when both
//! its link count and its references reach 0. A caller that never calls `release` only
//! keeps unlinked files alive for the life of the `Vfs`.
//!
//! Snapshots: `save_state` gives everything but the image as a serde `VfsState`
//! (deterministic, sharing file bytes), `restore_state` rebuilds the `Vfs` over the same
//! image after checking the state (see `state.rs`). The references above are part of it.

mod check;
#[cfg(test)]
mod difftest;
mod generated;
mod io;
mod journal;
mod layer;
mod node;
mod notify;
mod ops;
mod path;
mod state;
#[cfg(test)]
mod state_tests;
#[cfg(test)]
mod tests;

use std::sync::Arc;
use std::time::{SystemTime, UNIX_EPOCH};

use forkbox_image::{Image, NodeKind};
use imbl::OrdMap;

use crate::Errno;
pub use generated::Gen;
pub use journal::{Change, ChangeKind, Changes, JOURNAL_BYTES, JOURNAL_EVENTS};
pub use notify::{MAX_QUEUED, MAX_QUEUED_BYTES, MAX_WATCHES};
pub mod inotify {
    //! inotify's event and flag bits.
    pub use super::notify::{
        IN_ACCESS, IN_ALL_EVENTS, IN_ATTRIB, IN_CLOSE_NOWRITE, IN_CLOSE_WRITE, IN_CREATE, IN_DELETE, IN_DELETE_SELF,
        IN_DONT_FOLLOW, IN_EXCL_UNLINK, IN_IGNORED, IN_ISDIR, IN_MASK_ADD, IN_MASK_CREATE, IN_MODIFY, IN_MOVED_FROM,
        IN_MOVED_TO, IN_MOVE_SELF, IN_ONESHOT, IN_ONLYDIR, IN_OPEN, IN_Q_OVERFLOW, IN_UNMOUNT, IN_VALID,
    };
}
pub use layer::{LayerError, Layers};
pub use node::{entry_cost, makedev, DevKind, ENTRY_COST, NODE_COST};
use node::{Body, FileData, Node};
pub use state::{BodyState, FileBytes, FileState, NodeState, VfsState, VfsStateError};

pub type Ino = u64;
/// The VFS root: the image root.
pub const ROOT_INO: Ino = Image::ROOT as Ino;
/// First inode number of nodes created in the overlay.
pub const FIRST_OVERLAY_INO: Ino = 1 << 32;
/// Symlinks followed in one resolution before ELOOP (Linux: 40).
pub const MAX_SYMLINKS: u32 = 40;
/// Longest path, including its terminating NUL (so 4095 bytes of path at most).
pub const PATH_MAX: usize = 4096;
/// Longest name of one component.
pub const NAME_MAX: usize = 255;
/// Overlay quota until `set_quota` is called (a guest must not be able to make the
/// VMM allocate without bound, e.g. by writing at offset 2^60).
pub const DEFAULT_QUOTA: u64 = 1 << 30;
/// Largest file offset / size (Linux MAX_LFS_FILESIZE).
pub const MAX_FILE_SIZE: u64 = i64::MAX as u64;

pub const RENAME_NOREPLACE: u32 = 1;
pub const RENAME_EXCHANGE: u32 = 2;

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum FileType {
    Dir,
    File,
    Symlink,
    CharDev,
    /// A FIFO node (mkfifo), or what `Stat::pipe` reports for pipe-like fds.
    Fifo,
    /// An AF_UNIX socket file.
    Socket,
}

impl FileType {
    /// The S_IF* bits of `st_mode`.
    pub fn mode_bits(self) -> u32 {
        match self {
            FileType::Dir => libc::S_IFDIR,
            FileType::File => libc::S_IFREG,
            FileType::Symlink => libc::S_IFLNK,
            FileType::CharDev => libc::S_IFCHR,
            FileType::Fifo => libc::S_IFIFO,
            FileType::Socket => libc::S_IFSOCK,
        }
    }

    /// The DT_* value for getdents64's `d_type`.
    pub fn dirent_type(self) -> u8 {
        match self {
            FileType::Dir => libc::DT_DIR,
            FileType::File => libc::DT_REG,
            FileType::Symlink => libc::DT_LNK,
            FileType::CharDev => libc::DT_CHR,
            FileType::Fifo => libc::DT_FIFO,
            FileType::Socket => libc::DT_SOCK,
        }
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Stat {
    pub ino: Ino,
    pub kind: FileType,
    /// Permission bits (07777), no type bits.
    pub perm: u32,
    /// File: bytes. Symlink: target length. Directory: 4096. Device: 0.
    pub size: u64,
    pub nlink: u32,
    /// Modification time, nanoseconds since the epoch (also good for ctime).
    pub mtime_ns: i128,
    /// Access time, nanoseconds since the epoch.
    pub atime_ns: i128,
    /// Device number of a character device (`makedev` encoding), else 0.
    pub rdev: u64,
    /// Owner (user, group).
    pub uid: u32,
    pub gid: u32,
}

impl Stat {
    /// What fstat says about a pipe-like fd that is not a VFS node (inode `ino` is
    /// the caller's choice).
    pub fn pipe(ino: Ino) -> Stat {
        Stat {
            ino,
            kind: FileType::Fifo,
            perm: 0o600,
            size: 0,
            nlink: 1,
            mtime_ns: 0,
            atime_ns: 0,
            rdev: 0,
            uid: 0,
            gid: 0,
        }
    }
    /// Modification time as (tv_sec, tv_nsec).
    pub fn mtime(&self) -> (i64, i64) {
        (self.mtime_sec(), i64::from(self.mtime_nsec()))
    }
    /// `st_mode`: S_IF* | permission bits.
    pub fn mode(&self) -> u32 {
        self.kind.mode_bits() | self.perm
    }
    /// Access time as (tv_sec, tv_nsec).
    pub fn atime(&self) -> (i64, i64) {
        (self.atime_ns.div_euclid(1_000_000_000) as i64, self.atime_ns.rem_euclid(1_000_000_000) as i64)
    }
    pub fn mtime_sec(&self) -> i64 {
        self.mtime_ns.div_euclid(1_000_000_000) as i64
    }
    pub fn mtime_nsec(&self) -> u32 {
        self.mtime_ns.rem_euclid(1_000_000_000) as u32
    }
    /// `st_blocks`: 512-byte blocks.
    pub fn blocks(&self) -> u64 {
        self.size.div_ceil(512)
    }
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DirEntry {
    pub name: Vec<u8>,
    pub ino: Ino,
    pub kind: FileType,
}

/// Current time in nanoseconds since the epoch (host clock), e.g. for UTIME_NOW.
pub fn now_ns() -> i128 {
    match SystemTime::now().duration_since(UNIX_EPOCH) {
        Ok(d) => d.as_nanos() as i128,
        Err(e) => -(e.duration().as_nanos() as i128),
    }
}

/// The guest's file system: image + overlay. See the module documentation.
#[derive(Clone)]
pub struct Vfs {
    image: Arc<Image>,
    /// Overlay nodes; they override image inodes of the same number.
    nodes: imbl::HashMap<Ino, Node>,
    /// References held by the caller (`open`/`hold` minus `release`), by inode.
    refs: imbl::HashMap<Ino, u32>,
    next_ino: Ino,
    /// Sum of `Node::cost` over `nodes`.
    used: u64,
    quota: u64,
    /// Owners (user, group) of the inodes that do not belong to 0:0 (every
    /// image inode and every new one does until a chown).
    owners: imbl::HashMap<Ino, (u32, u32)>,
    /// Bumped on every change to the overlay (not part of the saved state): a
    /// cheap "did anything change" for callers that watch the file system.
    generation: u64,
    /// The change journal, while someone outside watches (see `journal.rs`).
    journal: Option<journal::Shared>,
}

/// Read-only view of one inode.
enum View<'a> {
    Overlay(&'a Node),
    Image(u32, forkbox_image::NodeMeta),
}

impl Vfs {
    /// A VFS over `image`, with `/dev/{null,zero,full,random,urandom}` (always
    /// character devices, replacing whatever the image has under those names) and
    /// `/tmp` (1777), `/proc`, `/root` directories if the image lacks them.
    pub fn new(image: Arc<Image>) -> Vfs {
        let mut vfs = Vfs {
            image,
            nodes: imbl::HashMap::new(),
            refs: imbl::HashMap::new(),
            next_ino: FIRST_OVERLAY_INO,
            used: 0,
            quota: DEFAULT_QUOTA,
            owners: imbl::HashMap::new(),
            generation: 0,
            journal: None,
        };
        // Only fails on a corrupt image (e.g. a root that is not a directory); the
        // VFS is still usable, just without these.
        if let Err(e) = vfs.install_defaults() {
            tracing::warn!("vfs: could not provide /dev, /tmp, /proc, /root: {e}");
        }
        vfs
    }

    fn install_defaults(&mut self) -> Result<(), Errno> {
        let dev = self.ensure_dir(ROOT_INO, b"dev", 0o755)?;
        for (name, kind) in [
            (&b"null"[..], DevKind::Null),
            (b"zero", DevKind::Zero),
            (b"full", DevKind::Full),
            (b"random", DevKind::Urandom),
            (b"urandom", DevKind::Urandom),
            (b"tty", DevKind::Tty),
            (b"ptmx", DevKind::Ptmx),
        ] {
            if let Some(old) = self.lookup(dev, name)? {
                if matches!(self.view(old)?, View::Overlay(Node { body: Body::CharDev(_), .. })) {
                    continue;
                }
                self.remove_entry(dev, name)?;
                self.dec_link(old)?;
            }
            self.create(dev, name, Body::CharDev(kind), 0o666, false)?;
        }
        // As udev makes them: the standard streams and /dev/fd are links to the
        // calling process' /proc/self/fd (open follows them to its fds).
        for (name, target) in [
            (&b"stdin"[..], &b"/proc/self/fd/0"[..]),
            (b"stdout", b"/proc/self/fd/1"),
            (b"stderr", b"/proc/self/fd/2"),
            (b"fd", b"/proc/self/fd"),
        ] {
            if self.lookup(dev, name)?.is_none() {
                self.create(dev, name, Body::Symlink(Arc::from(target)), 0o777, false)?;
            }
        }
        // POSIX shared memory (shm_open) is files in a tmpfs: here, the overlay.
        self.ensure_dir(dev, b"shm", 0o1777)?;
        self.ensure_dir(ROOT_INO, b"tmp", 0o1777)?;
        self.ensure_dir(ROOT_INO, b"proc", 0o555)?;
        self.ensure_dir(ROOT_INO, b"root", 0o700)?;
        Ok(())
    }

    /// The directory `name` in `dir` (a symlink to a directory is fine), created
    /// (replacing anything else) if needed.
    fn ensure_dir(&mut self, dir: Ino, name: &[u8], perm: u32) -> Result<Ino, Errno> {
        if let Ok(ino) = self.walk(dir, name, true, &mut 0) {
            if self.is_dir(ino)? {
                return Ok(ino);
            }
        }
        if let Some(old) = self.lookup(dir, name)? {
            if self.is_dir(old)? {
                return Ok(old);
            }
            self.remove_entry(dir, name)?;
            self.dec_link(old)?;
        }
        self.create(dir, name, Self::empty_dir(dir), perm, false)
    }

    fn empty_dir(parent: Ino) -> Body {
        Body::Dir { entries: OrdMap::new(), parent }
    }

    pub fn image(&self) -> &Arc<Image> {
        &self.image
    }

    // ----- inode views -------------------------------------------------------------

    fn image_ino(&self, ino: Ino) -> Option<u32> {
        (ino < self.image.inode_count() as u64).then_some(ino as u32)
    }

    fn view(&self, ino: Ino) -> Result<View<'_>, Errno> {
        if let Some(n) = self.nodes.get(&ino) {
            return match n.body {
                Body::Gone => Err(Errno::ENOENT),
                _ => Ok(View::Overlay(n)),
            };
        }
        let i = self.image_ino(ino).ok_or(Errno::ENOENT)?;
        let meta = self.image.meta(i).ok_or(Errno::EIO)?;
        Ok(View::Image(i, meta))
    }

    pub fn file_type(&self, ino: Ino) -> Result<FileType, Errno> {
        Ok(match self.view(ino)? {
            View::Overlay(n) => n.kind().ok_or(Errno::ENOENT)?,
            View::Image(_, m) => match m.kind {
                NodeKind::Dir => FileType::Dir,
                NodeKind::File => FileType::File,
                NodeKind::Symlink => FileType::Symlink,
            },
        })
    }

    pub fn is_dir(&self, ino: Ino) -> Result<bool, Errno> {
        Ok(self.file_type(ino)? == FileType::Dir)
    }

    /// Names referring to `ino` (directories: 1 while linked, 0 once removed).
    fn link_count(&self, ino: Ino) -> Result<u32, Errno> {
        Ok(match self.view(ino)? {
            View::Overlay(n) => n.nlink,
            View::Image(..) => 1,
        })
    }

    /// One name in a directory (no "." / "..", no symlink following).
    fn lookup(&self, dir: Ino, name: &[u8]) -> Result<Option<Ino>, Errno> {
        match self.view(dir)? {
            View::Overlay(Node { body: Body::Dir { entries, .. }, .. }) => Ok(entries.get(name).copied()),
            View::Image(i, m) if m.kind == NodeKind::Dir => Ok(self.image.lookup(i, name).map(Ino::from)),
            _ => Err(Errno::ENOTDIR),
        }
    }

    /// ".." of a directory.
    fn parent_of(&self, dir: Ino) -> Result<Ino, Errno> {
        match self.view(dir)? {
            View::Overlay(Node { body: Body::Dir { parent, .. }, .. }) => Ok(*parent),
            View::Image(i, m) if m.kind == NodeKind::Dir => Ok(Ino::from(self.image.parent(i))),
            _ => Err(Errno::ENOTDIR),
        }
    }

    /// Entries of a directory, sorted by name (no "." / "..").
    fn entries(&self, dir: Ino) -> Result<Vec<(Vec<u8>, Ino)>, Errno> {
        match self.view(dir)? {
            View::Overlay(Node { body: Body::Dir { entries, .. }, .. }) => {
                Ok(entries.iter().map(|(k, v)| (k.clone(), *v)).collect())
            }
            View::Image(i, m) if m.kind == NodeKind::Dir => {
                Ok(self.image.children(i).into_iter().map(|(k, v)| (k.to_vec(), Ino::from(v))).collect())
            }
            _ => Err(Errno::ENOTDIR),
        }
    }

    /// The name of `child` in `dir` (a linear scan; for getcwd).
    fn name_in(&self, dir: Ino, child: Ino) -> Result<Option<Vec<u8>>, Errno> {
        match self.view(dir)? {
            View::Overlay(Node { body: Body::Dir { entries, .. }, .. }) => {
                Ok(entries.iter().find(|(_, &c)| c == child).map(|(n, _)| n.clone()))
            }
            View::Image(i, m) if m.kind == NodeKind::Dir => {
                Ok(self.image.children(i).into_iter().find(|&(_, c)| Ino::from(c) == child).map(|(n, _)| n.to_vec()))
            }
            _ => Err(Errno::ENOTDIR),
        }
    }

    fn dir_is_empty(&self, dir: Ino) -> Result<bool, Errno> {
        match self.view(dir)? {
            View::Overlay(Node { body: Body::Dir { entries, .. }, .. }) => Ok(entries.is_empty()),
            View::Image(i, m) if m.kind == NodeKind::Dir => Ok(self.image.children(i).is_empty()),
            _ => Err(Errno::ENOTDIR),
        }
    }

    fn subdir_count(&self, dir: Ino) -> Result<u32, Errno> {
        let n = match self.view(dir)? {
            View::Overlay(Node { body: Body::Dir { entries, .. }, .. }) => {
                entries.values().filter(|&&c| self.is_dir(c).unwrap_or(false)).count()
            }
            View::Image(i, m) if m.kind == NodeKind::Dir => self
                .image
                .children(i)
                .iter()
                .filter(|(_, c)| matches!(self.image.meta(*c), Some(m) if m.kind == NodeKind::Dir))
                .count(),
            _ => return Err(Errno::ENOTDIR),
        };
        Ok(u32::try_from(n).unwrap_or(u32::MAX))
    }

    /// Target of a symlink.
    fn link_target(&self, ino: Ino) -> Result<&[u8], Errno> {
        match self.view(ino)? {
            View::Overlay(Node { body: Body::Symlink(t), .. }) => Ok(t),
            View::Image(i, m) if m.kind == NodeKind::Symlink => self.image.read_link(i).ok_or(Errno::EIO),
            _ => Err(Errno::EINVAL),
        }
    }

    // ----- overlay mutation --------------------------------------------------------

    /// Store `node` under `ino`, keeping `used` in step.
    fn put_node(&mut self, ino: Ino, node: Node) {
        self.generation = self.generation.wrapping_add(1);
        let add = node.cost();
        let old = self.nodes.insert(ino, node).map_or(0, |n| n.cost());
        self.used = self.used.saturating_sub(old).saturating_add(add);
    }

    /// Metadata copy-up: make sure `ino` has an overlay node. A directory gets its
    /// entries copied (names -> numbers, cheap); a file keeps pointing at the image's
    /// bytes (`FileData::Image`) until it is written.
    fn ensure_overlay(&mut self, ino: Ino) -> Result<(), Errno> {
        let (i, m) = match self.view(ino)? {
            View::Overlay(_) => return Ok(()),
            View::Image(i, m) => (i, m),
        };
        let body = match m.kind {
            NodeKind::Dir => Body::Dir {
                entries: self.image.children(i).into_iter().map(|(k, v)| (k.to_vec(), Ino::from(v))).collect(),
                parent: Ino::from(self.image.parent(i)),
            },
            NodeKind::File => Body::File(FileData::Image(i)),
            NodeKind::Symlink => Body::Symlink(Arc::from(self.image.read_link(i).ok_or(Errno::EIO)?)),
        };
        let mtime_ns = i128::from(m.mtime) * 1_000_000_000;
        self.put_node(ino, Node { body, perm: m.perm & 0o7777, mtime_ns, atime_ns: mtime_ns, nlink: 1 });
        Ok(())
    }

    fn node_mut(&mut self, ino: Ino) -> Result<&mut Node, Errno> {
        self.generation = self.generation.wrapping_add(1);
        self.ensure_overlay(ino)?;
        self.nodes.get_mut(&ino).ok_or(Errno::ENOENT)
    }

    fn dir_entries_mut(&mut self, dir: Ino) -> Result<&mut OrdMap<Vec<u8>, Ino>, Errno> {
        match &mut self.node_mut(dir)?.body {
            Body::Dir { entries, .. } => Ok(entries),
            _ => Err(Errno::ENOTDIR),
        }
    }

    fn touch(&mut self, ino: Ino) -> Result<(), Errno> {
        self.node_mut(ino)?.mtime_ns = now_ns();
        Ok(())
    }

    /// ENOSPC once the numbers run out (only reachable from a restored state).
    fn alloc_ino(&mut self) -> Result<Ino, Errno> {
        let ino = self.next_ino;
        self.next_ino = ino.checked_add(1).ok_or(Errno::ENOSPC)?;
        Ok(ino)
    }

    /// Create a new node named `name` in `dir` (which must not have that name yet).
    /// `charge`: check the quota (not for the VFS's own /dev etc.).
    fn create(&mut self, dir: Ino, name: &[u8], body: Body, perm: u32, charge: bool) -> Result<Ino, Errno> {
        // A removed directory (e.g. a deleted cwd) takes no new entries.
        if self.link_count(dir)? == 0 {
            return Err(Errno::ENOENT);
        }
        let now = now_ns();
        let node = Node { body, perm, mtime_ns: now, atime_ns: now, nlink: 1 };
        if charge && self.used.saturating_add(node.cost()).saturating_add(node::entry_cost(name)) > self.quota {
            return Err(Errno::ENOSPC);
        }
        let ino = self.alloc_ino()?;
        self.dir_entries_mut(dir)?.insert(name.to_vec(), ino);
        self.used = self.used.saturating_add(node::entry_cost(name));
        self.put_node(ino, node);
        self.touch(dir)?;
        self.note(journal::ChangeKind::Create, dir, name, Some(ino));
        Ok(ino)
    }

    fn remove_entry(&mut self, dir: Ino, name: &[u8]) -> Result<Option<Ino>, Errno> {
        let old = self.dir_entries_mut(dir)?.remove(name);
        if old.is_some() {
            self.used = self.used.saturating_sub(node::entry_cost(name));
            self.note(journal::ChangeKind::Remove, dir, name, old);
        }
        self.touch(dir)?;
        Ok(old)
    }

    /// One name of `ino` went away.
    fn dec_link(&mut self, ino: Ino) -> Result<(), Errno> {
        let n = self.link_count(ino)?.saturating_sub(1);
        if n == 0 {
            self.note_gone(ino);
        }
        if n == 0 && !self.refs.contains_key(&ino) {
            self.drop_node(ino);
        } else {
            self.node_mut(ino)?.nlink = n;
        }
        Ok(())
    }

    /// Forget an inode with no names and no references.
    fn drop_node(&mut self, ino: Ino) {
        self.generation = self.generation.wrapping_add(1);
        self.owners.remove(&ino);
        if self.image_ino(ino).is_some() {
            self.put_node(ino, Node { body: Body::Gone, perm: 0, mtime_ns: 0, atime_ns: 0, nlink: 0 });
        } else if let Some(old) = self.nodes.remove(&ino) {
            self.used = self.used.saturating_sub(old.cost());
        }
    }

    // ----- references held by the caller -------------------------------------------

    /// Take a reference on `ino` (done by `open`): an unlinked inode stays usable until
    /// its last reference is released.
    pub fn hold(&mut self, ino: Ino) {
        let c = self.refs.entry(ino).or_insert(0);
        *c = c.saturating_add(1);
    }

    /// Give back a reference from `open` or `hold` (e.g. on the last close of an open
    /// file description). Frees the inode if it was unlinked and this was the last one.
    pub fn release(&mut self, ino: Ino) {
        let Some(c) = self.refs.get_mut(&ino) else { return };
        *c = c.saturating_sub(1);
        if *c == 0 {
            self.refs.remove(&ino);
            if self.link_count(ino) == Ok(0) {
                self.drop_node(ino);
            }
        }
    }

    // ----- quota -------------------------------------------------------------------

    /// Bytes held by the overlay: file bytes copied up or written by the guest, symlink
    /// targets, `NODE_COST` per overlay node and `entry_cost` (`ENTRY_COST` + the name)
    /// per entry of an overlay directory (so hard links and names are charged). Counts unlinked files still held.
    pub fn overlay_bytes(&self) -> u64 {
        self.used
    }

    /// Charge `bytes` more (a new directory entry): ENOSPC past the quota.
    fn charge(&mut self, bytes: u64) -> Result<(), Errno> {
        let used = self.used.saturating_add(bytes);
        if used > self.quota {
            return Err(Errno::ENOSPC);
        }
        self.used = used;
        Ok(())
    }

    /// Limit for `overlay_bytes`: a write, truncate or create growing past it fails
    /// with ENOSPC (shrinking and deleting always work). Default `DEFAULT_QUOTA`.
    pub fn set_quota(&mut self, max_overlay_bytes: u64) {
        self.quota = max_overlay_bytes;
    }

    pub fn quota(&self) -> u64 {
        self.quota
    }

    /// Changes whenever the overlay changes (any write, create, remove, chmod, ...).
    pub fn generation(&self) -> u64 {
        self.generation
    }

    // ----- metadata ----------------------------------------------------------------

    pub fn stat(&self, ino: Ino) -> Result<Stat, Errno> {
        let kind = self.file_type(ino)?;
        let (perm, size, mtime_ns, atime_ns, rdev) = match self.view(ino)? {
            View::Overlay(n) => {
                let (size, rdev) = match &n.body {
                    Body::Dir { .. } => (4096, 0),
                    Body::File(_) => (self.file_bytes(ino)?.len() as u64, 0),
                    Body::Symlink(t) => (t.len() as u64, 0),
                    Body::CharDev(d) => (0, d.rdev()),
                    Body::Fifo | Body::Socket => (0, 0),
                    Body::Gone => return Err(Errno::ENOENT),
                };
                (n.perm, size, n.mtime_ns, n.atime_ns, rdev)
            }
            View::Image(_, m) => {
                let t = i128::from(m.mtime) * 1_000_000_000;
                (m.perm & 0o7777, m.size, t, t, 0)
            }
        };
        let links = self.link_count(ino)?;
        let nlink = if kind == FileType::Dir && links > 0 { self.subdir_count(ino)?.saturating_add(2) } else { links };
        let (uid, gid) = self.owner(ino);
        Ok(Stat { ino, kind, perm, size, nlink, mtime_ns, atime_ns, rdev, uid, gid })
    }

    /// chmod: permission bits (07777) of `ino`.
    pub fn chmod(&mut self, ino: Ino, perm: u32) -> Result<(), Errno> {
        self.node_mut(ino)?.perm = perm & 0o7777;
        self.note_ino(journal::ChangeKind::Chmod, ino);
        Ok(())
    }

    /// The owner (user, group) of `ino`.
    pub fn owner(&self, ino: Ino) -> (u32, u32) {
        self.owners.get(&ino).copied().unwrap_or((0, 0))
    }

    /// chown: set the owner of `ino` (`None` keeps that id). As Linux's
    /// `chown_common`, a file that is not a directory loses its set-user-ID
    /// bit, and its set-group-ID bit when it is group-executable.
    /// (Permission is the caller's to check: `crate::creds`.)
    pub fn chown(&mut self, ino: Ino, uid: Option<u32>, gid: Option<u32>) -> Result<(), Errno> {
        let kind = self.file_type(ino)?;
        let (old_uid, old_gid) = self.owner(ino);
        let owner = (uid.unwrap_or(old_uid), gid.unwrap_or(old_gid));
        if kind != FileType::Dir {
            let perm = self.stat(ino)?.perm;
            let mut new = perm & !libc::S_ISUID;
            if perm & (libc::S_ISGID | libc::S_IXGRP) == libc::S_ISGID | libc::S_IXGRP {
                new &= !libc::S_ISGID;
            }
            if new != perm {
                self.chmod(ino, new)?;
            }
        }
        self.generation = self.generation.wrapping_add(1);
        if owner == (0, 0) {
            self.owners.remove(&ino);
        } else {
            self.owners.insert(ino, owner);
        }
        self.note_ino(journal::ChangeKind::Chmod, ino);
        Ok(())
    }

    /// The owners that are not 0:0, sorted by inode (what a snapshot keeps).
    pub fn owners_state(&self) -> Vec<(Ino, u32, u32)> {
        let mut v: Vec<(Ino, u32, u32)> = self.owners.iter().map(|(&i, &(u, g))| (i, u, g)).collect();
        v.sort_unstable();
        v
    }

    /// Restore what `owners_state` saved: strictly sorted inodes that exist,
    /// never 0:0 (that is no entry).
    pub fn restore_owners(&mut self, owners: &[(Ino, u32, u32)]) -> Result<(), String> {
        let mut prev = None;
        let mut map = imbl::HashMap::new();
        for &(ino, uid, gid) in owners {
            if prev.is_some_and(|p| p >= ino) {
                return Err(format!("owners: inode {ino} out of order"));
            }
            prev = Some(ino);
            if (uid, gid) == (0, 0) {
                return Err(format!("owners: inode {ino} listed as 0:0"));
            }
            if self.file_type(ino).is_err() {
                return Err(format!("owners: no inode {ino}"));
            }
            map.insert(ino, (uid, gid));
        }
        self.owners = map;
        Ok(())
    }

    /// utimensat: set the modification time (only mtime is kept; use `now_ns()` for
    /// UTIME_NOW and skip the call for UTIME_OMIT).
    pub fn set_times(&mut self, ino: Ino, mtime_ns: i128) -> Result<(), Errno> {
        self.node_mut(ino)?.mtime_ns = mtime_ns;
        self.note_ino(journal::ChangeKind::Chmod, ino);
        Ok(())
    }

    /// utimensat with both times: `None` leaves one as it is (UTIME_OMIT).
    pub fn set_atime_mtime(&mut self, ino: Ino, atime_ns: Option<i128>, mtime_ns: Option<i128>) -> Result<(), Errno> {
        let n = self.node_mut(ino)?;
        if let Some(a) = atime_ns {
            n.atime_ns = a;
        }
        if let Some(m) = mtime_ns {
            n.mtime_ns = m;
        }
        self.note_ino(journal::ChangeKind::Chmod, ino);
        Ok(())
    }

    /// `set_times` with (tv_sec, tv_nsec).
    pub fn set_mtime(&mut self, ino: Ino, sec: i64, nsec: u32) -> Result<(), Errno> {
        self.set_times(ino, i128::from(sec) * 1_000_000_000 + i128::from(nsec))
    }

    /// Absolute path of a directory (getcwd). ENOENT if it was removed.
    pub fn dir_path(&self, ino: Ino) -> Result<Vec<u8>, Errno> {
        if !self.is_dir(ino)? {
            return Err(Errno::ENOTDIR);
        }
        let mut names: Vec<Vec<u8>> = Vec::new();
        let mut len = 0usize;
        let mut cur = ino;
        while cur != ROOT_INO {
            if self.link_count(cur)? == 0 {
                return Err(Errno::ENOENT);
            }
            let parent = self.parent_of(cur)?;
            let name = self.name_in(parent, cur)?.ok_or(Errno::ENOENT)?;
            len += name.len() + 1;
            if len >= PATH_MAX {
                return Err(Errno::ENAMETOOLONG);
            }
            names.push(name);
            cur = parent;
        }
        if names.is_empty() {
            return Ok(b"/".to_vec());
        }
        let mut out = Vec::with_capacity(len);
        for n in names.iter().rev() {
            out.push(b'/');
            out.extend_from_slice(n);
        }
        Ok(out)
    }

    /// getdents: ".", ".." and then the entries sorted by name.
    pub fn readdir(&self, ino: Ino) -> Result<Vec<DirEntry>, Errno> {
        let entries = self.entries(ino)?;
        let parent = if ino == ROOT_INO { ROOT_INO } else { self.parent_of(ino)? };
        let mut out = Vec::with_capacity(entries.len() + 2);
        out.push(DirEntry { name: b".".to_vec(), ino, kind: FileType::Dir });
        out.push(DirEntry { name: b"..".to_vec(), ino: parent, kind: FileType::Dir });
        for (name, child) in entries {
            // An entry always has a live node; skip rather than fail if not.
            if let Ok(kind) = self.file_type(child) {
                out.push(DirEntry { name, ino: child, kind });
            }
        }
        Ok(out)
    }

    /// Consistency check for tests: `used` equals the sum of node costs.
    #[cfg(test)]
    fn recount(&self) -> u64 {
        self.nodes.values().map(|n| n.cost()).sum()
    }
}
