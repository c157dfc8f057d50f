//! Snapshots of a `Vfs`: everything except the image, as plain serde data.
//!
//! - `Vfs::save_state` copies no file bytes: the state shares them (`Arc`) with the
//!   `Vfs`, and serializing writes each file once, as one byte string. (While a state
//!   is alive, the first write to a file it shares copies that file, as after a
//!   `Vfs::clone`; drop the state once it is serialized.)
//! - Deterministic: nodes and references are sorted by inode number and directory
//!   entries by name, so equal VFS contents give equal states and equal postcard bytes,
//!   and save -> restore -> save gives the same bytes again.
//! - `Vfs::restore_state` checks the state against the image and against itself
//!   (inode ranges, kinds, names, link counts, parent pointers, reachability of every
//!   linked directory from the root, references, byte accounting) and rejects anything
//!   a `Vfs` could not have produced, so a corrupt or foreign state gives an error
//!   instead of a `Vfs` that misbehaves later.
//! - The state file's bytes are not this type's serde form: forkbox-snapshot has
//!   its own persisted shape of it (one per format version that changed it) and
//!   converts; an older layout is upgraded there before it gets here.

use std::collections::{HashMap, HashSet};
use std::fmt;
use std::sync::Arc;

use forkbox_image::{Image, NodeKind};
use serde::{Deserialize, Deserializer, Serialize, Serializer};

use super::node::{Body, FileData, Node};
use super::{DevKind, FileType, Ino, Layers, Vfs, FIRST_OVERLAY_INO, NAME_MAX, ROOT_INO};

/// Everything in a `Vfs` except the image itself (referenced by `image_id`).
/// Serialize it with serde (postcard is compact and canonical for it).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct VfsState {
    /// `Image::id()` of the lower layer.
    pub image_id: String,
    /// `VfsState::VERSION` when saved.
    pub version: u32,
    /// Next inode number for a new overlay node (>= `FIRST_OVERLAY_INO`).
    pub next_ino: Ino,
    /// `Vfs::quota`.
    pub quota: u64,
    /// `Vfs::overlay_bytes` (checked against the nodes on restore).
    pub overlay_bytes: u64,
    /// Overlay nodes, strictly sorted by inode number.
    pub nodes: Vec<NodeState>,
    /// References taken by `open` / `hold` and not yet released: (inode, count >= 1),
    /// strictly sorted by inode number.
    pub refs: Vec<(Ino, u32)>,
}

impl VfsState {
    /// The package layers the state's files refer to (to open before `restore_state_with`).
    pub fn layer_ids(&self) -> std::collections::BTreeSet<String> {
        self.nodes
            .iter()
            .filter_map(|n| match &n.body {
                BodyState::File(FileState::Layer { layer, .. }) => Some(layer.clone()),
                _ => None,
            })
            .collect()
    }

    /// Layout version written by this code; `restore_state` accepts only this one.
    /// 2: FIFO and socket nodes, /dev/tty, atime.
    /// 3: directory entries are charged to `overlay_bytes` (`entry_cost`).
    pub const VERSION: u32 = 3;
}

/// One overlay node: a copy-up of image inode `ino` (< `Image::inode_count`) or a new
/// inode (`FIRST_OVERLAY_INO <= ino < next_ino`).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct NodeState {
    pub ino: Ino,
    /// Permission bits (07777).
    pub perm: u32,
    pub mtime_ns: i128,
    pub atime_ns: i128,
    /// Names referring to the node (directories: 1, or 0 once removed); 0 = unlinked,
    /// kept alive by references.
    pub nlink: u32,
    pub body: BodyState,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub enum BodyState {
    Dir {
        /// ".." (the root's is the root).
        parent: Ino,
        /// Strictly sorted by name.
        entries: Vec<(Vec<u8>, Ino)>,
    },
    File(FileState),
    Symlink(Vec<u8>),
    CharDev(DevKind),
    Fifo,
    Socket,
    /// A deleted image inode (hides the image's node of that number).
    Gone,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub enum FileState {
    /// Still the image's bytes of this (image) inode: a metadata-only copy-up.
    Image,
    /// The overlay's own bytes.
    Owned(FileBytes),
    /// The bytes of file inode `ino` of the package layer whose id is `layer`
    /// (a reference: the layer is on disk, content-addressed, shared).
    Layer { layer: String, ino: u32 },
}

/// File contents, shared with the `Vfs` they were saved from or restored into.
/// Serialized as one byte string (postcard: length + raw bytes).
#[derive(Clone, PartialEq, Eq)]
pub struct FileBytes(pub Arc<Vec<u8>>);

impl fmt::Debug for FileBytes {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "FileBytes({} bytes)", self.0.len())
    }
}

impl Serialize for FileBytes {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_bytes(&self.0)
    }
}

impl<'de> Deserialize<'de> for FileBytes {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct BytesVisitor;
        impl<'de> serde::de::Visitor<'de> for BytesVisitor {
            type Value = Vec<u8>;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("a byte string")
            }
            fn visit_bytes<E: serde::de::Error>(self, v: &[u8]) -> Result<Vec<u8>, E> {
                Ok(v.to_vec())
            }
            fn visit_byte_buf<E: serde::de::Error>(self, v: Vec<u8>) -> Result<Vec<u8>, E> {
                Ok(v)
            }
            // Formats without a byte-string type (e.g. JSON) write a sequence.
            fn visit_seq<A: serde::de::SeqAccess<'de>>(self, mut seq: A) -> Result<Vec<u8>, A::Error> {
                let mut v = Vec::with_capacity(seq.size_hint().unwrap_or(0).min(1 << 16));
                while let Some(b) = seq.next_element::<u8>()? {
                    v.push(b);
                }
                Ok(v)
            }
        }
        d.deserialize_byte_buf(BytesVisitor).map(|v| FileBytes(Arc::new(v)))
    }
}

#[derive(Debug, thiserror::Error)]
pub enum VfsStateError {
    #[error("VFS state belongs to image {state}, not to image {image}")]
    WrongImage { state: String, image: String },
    #[error("VFS state has layout version {0}, this build reads version {expected}", expected = VfsState::VERSION)]
    Version(u32),
    #[error("inconsistent VFS state: {0}")]
    Inconsistent(String),
    /// A file refers to a package layer that was not provided (deleted from disk?).
    #[error("VFS state refers to package layer {0}, which is not available")]
    MissingLayer(String),
}

macro_rules! bad {
    ($($arg:tt)*) => {
        return Err(VfsStateError::Inconsistent(format!($($arg)*)))
    };
}

impl Vfs {
    /// Everything but the image, for `restore_state`. Copies no file bytes (see the
    /// module documentation).
    pub fn save_state(&self) -> VfsState {
        let mut nodes: Vec<NodeState> = self.nodes.iter().map(|(&ino, n)| save_node(ino, n)).collect();
        nodes.sort_unstable_by_key(|n| n.ino);
        let mut refs: Vec<(Ino, u32)> = self.refs.iter().map(|(&i, &c)| (i, c)).collect();
        refs.sort_unstable();
        VfsState {
            image_id: self.image.id().to_owned(),
            version: VfsState::VERSION,
            next_ino: self.next_ino,
            quota: self.quota,
            overlay_bytes: self.used,
            nodes,
            refs,
        }
    }

    /// The `Vfs` that `state` was saved from, over `image` (which must be the image it
    /// was saved with). Errors: another image id, another layout version, or a state no
    /// `Vfs` could have produced (dangling entries, wrong link counts or parents,
    /// unreachable directories, references to missing inodes, wrong byte count, ...).
    pub fn restore_state(image: Arc<Image>, state: VfsState) -> Result<Vfs, VfsStateError> {
        Vfs::restore_state_with(image, state, &Layers::new())
    }

    /// `restore_state` for a state whose files may refer to package layers:
    /// `layers` has each of them by id (see `VfsState::layer_ids`).
    pub fn restore_state_with(image: Arc<Image>, state: VfsState, layers: &Layers) -> Result<Vfs, VfsStateError> {
        if state.image_id != image.id() {
            return Err(VfsStateError::WrongImage { state: state.image_id, image: image.id().to_owned() });
        }
        if state.version != VfsState::VERSION {
            return Err(VfsStateError::Version(state.version));
        }
        Check::new(&image, &state).run()?;
        let VfsState { next_ino, quota, overlay_bytes, nodes: saved, refs: saved_refs, .. } = state;
        let mut nodes = imbl::HashMap::new();
        let mut used = 0u64;
        for n in saved {
            let body = match n.body {
                BodyState::Dir { parent, entries } => Body::Dir { entries: entries.into_iter().collect(), parent },
                // `Check` made sure `ino` is an image file.
                BodyState::File(FileState::Image) => Body::File(FileData::Image(n.ino as u32)),
                BodyState::File(FileState::Owned(b)) => Body::File(FileData::Owned(b.0)),
                BodyState::File(FileState::Layer { layer, ino }) => {
                    let l = layers.get(&layer).ok_or_else(|| VfsStateError::MissingLayer(layer.clone()))?;
                    if l.id() != layer || l.meta(ino).map(|m| m.kind) != Some(NodeKind::File) {
                        bad!("node {}: inode {ino} of package layer {layer} is no file", n.ino);
                    }
                    Body::File(FileData::Layer(l.clone(), ino))
                }
                BodyState::Symlink(t) => Body::Symlink(Arc::from(t)),
                BodyState::CharDev(d) => Body::CharDev(d),
                BodyState::Fifo => Body::Fifo,
                BodyState::Socket => Body::Socket,
                BodyState::Gone => Body::Gone,
            };
            let node = Node { body, perm: n.perm, mtime_ns: n.mtime_ns, atime_ns: n.atime_ns, nlink: n.nlink };
            used = used.saturating_add(node.cost());
            nodes.insert(n.ino, node);
        }
        if used != overlay_bytes {
            bad!("overlay bytes recorded as {overlay_bytes} but the nodes hold {used}");
        }
        let refs = saved_refs.into_iter().collect();
        Ok(Vfs {
            image,
            nodes,
            refs,
            next_ino,
            used,
            quota,
            owners: imbl::HashMap::new(),
            generation: 0,
            journal: None,
        })
    }
}

fn save_node(ino: Ino, n: &Node) -> NodeState {
    let body = match &n.body {
        Body::Dir { entries, parent } => {
            BodyState::Dir { parent: *parent, entries: entries.iter().map(|(k, v)| (k.clone(), *v)).collect() }
        }
        Body::File(FileData::Image(_)) => BodyState::File(FileState::Image),
        Body::File(FileData::Owned(v)) => BodyState::File(FileState::Owned(FileBytes(v.clone()))),
        Body::File(FileData::Layer(l, i)) => BodyState::File(FileState::Layer { layer: l.id().to_owned(), ino: *i }),
        Body::Symlink(t) => BodyState::Symlink(t.to_vec()),
        Body::CharDev(d) => BodyState::CharDev(*d),
        Body::Fifo => BodyState::Fifo,
        Body::Socket => BodyState::Socket,
        Body::Gone => BodyState::Gone,
    };
    NodeState { ino, perm: n.perm, mtime_ns: n.mtime_ns, atime_ns: n.atime_ns, nlink: n.nlink, body }
}

fn kind_of(body: &BodyState) -> Option<FileType> {
    Some(match body {
        BodyState::Dir { .. } => FileType::Dir,
        BodyState::File(_) => FileType::File,
        BodyState::Symlink(_) => FileType::Symlink,
        BodyState::CharDev(_) => FileType::CharDev,
        BodyState::Fifo => FileType::Fifo,
        BodyState::Socket => FileType::Socket,
        BodyState::Gone => return None,
    })
}

fn image_file_type(k: NodeKind) -> FileType {
    match k {
        NodeKind::Dir => FileType::Dir,
        NodeKind::File => FileType::File,
        NodeKind::Symlink => FileType::Symlink,
    }
}

fn valid_name(name: &[u8]) -> bool {
    !name.is_empty()
        && name.len() <= NAME_MAX
        && name != b"."
        && name != b".."
        && !name.contains(&b'/')
        && !name.contains(&0)
}

/// Validation of a state against its image. Works on the state as saved (sorted
/// vectors, binary search) and touches only the image nodes the overlay involves.
struct Check<'a> {
    image: &'a Image,
    n_img: u64,
    s: &'a VfsState,
}

impl<'a> Check<'a> {
    fn new(image: &'a Image, s: &'a VfsState) -> Self {
        Check { image, n_img: u64::from(image.inode_count()), s }
    }

    fn node(&self, ino: Ino) -> Option<&'a NodeState> {
        let nodes = &self.s.nodes;
        nodes.binary_search_by_key(&ino, |n| n.ino).ok().map(|i| &nodes[i])
    }

    fn overlaid(&self, ino: Ino) -> bool {
        self.node(ino).is_some()
    }

    fn image_kind(&self, ino: Ino) -> Option<FileType> {
        if ino >= self.n_img {
            return None;
        }
        self.image.meta(ino as u32).map(|m| image_file_type(m.kind))
    }

    /// Kind of a live inode; None for no such inode (or a deleted one).
    fn kind(&self, ino: Ino) -> Option<FileType> {
        match self.node(ino) {
            Some(n) => kind_of(&n.body),
            None => self.image_kind(ino),
        }
    }

    /// A number that was or is an inode: an image inode or an allocated overlay one.
    fn in_range(&self, ino: Ino) -> bool {
        ino < self.n_img || (FIRST_OVERLAY_INO..self.s.next_ino).contains(&ino)
    }

    /// The image directory listing `ino` (image inodes other than the root).
    fn image_parent(&self, ino: Ino) -> Option<Ino> {
        (ino != ROOT_INO && ino < self.n_img).then(|| Ino::from(self.image.parent(ino as u32)))
    }

    /// The image directory that still lists `ino`: its image parent, unless that
    /// directory has an overlay node (whose entries then replace the image's).
    fn image_link(&self, ino: Ino) -> Option<Ino> {
        self.image_parent(ino).filter(|&p| !self.overlaid(p))
    }

    /// ".." of a live directory.
    fn parent_of(&self, dir: Ino) -> Option<Ino> {
        match self.node(dir) {
            Some(NodeState { body: BodyState::Dir { parent, .. }, .. }) => Some(*parent),
            Some(_) => None,
            None => (self.image_kind(dir) == Some(FileType::Dir)).then(|| Ino::from(self.image.parent(dir as u32))),
        }
    }

    fn run(&self) -> Result<(), VfsStateError> {
        let s = self.s;
        if s.next_ino < FIRST_OVERLAY_INO {
            bad!("next inode number {} is below {FIRST_OVERLAY_INO}", s.next_ino);
        }
        self.check_nodes()?;
        self.check_refs()?;
        let (counts, container) = self.count_entries()?;
        self.check_links(&counts)?;
        self.check_parents(&container)?;
        self.check_reachable(&container)?;
        // The byte count is checked by `restore_state` with `Node::cost`.
        Ok(())
    }

    /// Each node on its own: number, kind against the image, permission bits, names.
    fn check_nodes(&self) -> Result<(), VfsStateError> {
        let mut prev: Option<Ino> = None;
        for n in &self.s.nodes {
            let ino = n.ino;
            if prev.is_some_and(|p| p >= ino) {
                bad!("nodes not strictly sorted by inode number at {ino}");
            }
            prev = Some(ino);
            if !self.in_range(ino) {
                bad!("node {ino} is neither an image inode nor an allocated overlay inode");
            }
            if n.perm & !0o7777 != 0 {
                bad!("node {ino}: permission bits {:#o}", n.perm);
            }
            match (&n.body, self.image_kind(ino)) {
                (BodyState::Gone, Some(_)) if n.nlink != 0 || n.perm != 0 || n.mtime_ns != 0 || n.atime_ns != 0 => {
                    bad!("node {ino}: deleted image inode with metadata")
                }
                (BodyState::Gone, Some(_)) => {}
                (BodyState::Gone, None) => bad!("node {ino}: only image inodes can be marked deleted"),
                (BodyState::File(FileState::Image), k) if k != Some(FileType::File) => {
                    bad!("node {ino}: refers to image file contents but image inode {ino} is no file")
                }
                (BodyState::File(FileState::Layer { .. }), Some(_)) => {
                    bad!("node {ino}: an image inode with a package layer's contents")
                }
                (body, Some(k)) if kind_of(body) != Some(k) => {
                    bad!("node {ino}: a {:?} over an image {k:?}", kind_of(body))
                }
                _ => {}
            }
            if let BodyState::Dir { entries, .. } = &n.body {
                if n.nlink > 1 {
                    bad!("directory {ino} has link count {}", n.nlink);
                }
                if n.nlink == 0 && !entries.is_empty() {
                    bad!("removed directory {ino} still has entries");
                }
                let mut prev: Option<&[u8]> = None;
                for (name, _) in entries {
                    if !valid_name(name) {
                        bad!("directory {ino}: invalid entry name {:?}", String::from_utf8_lossy(name));
                    }
                    if prev.is_some_and(|p| p >= name.as_slice()) {
                        bad!("directory {ino}: entries not strictly sorted by name");
                    }
                    prev = Some(name);
                }
            }
            if ino == ROOT_INO {
                match &n.body {
                    BodyState::Dir { parent: ROOT_INO, .. } if n.nlink == 1 => {}
                    _ => bad!("the root must be a linked directory whose parent is itself"),
                }
            }
        }
        Ok(())
    }

    fn check_refs(&self) -> Result<(), VfsStateError> {
        let mut prev: Option<Ino> = None;
        for &(ino, count) in &self.s.refs {
            if prev.is_some_and(|p| p >= ino) {
                bad!("references not strictly sorted by inode number at {ino}");
            }
            prev = Some(ino);
            if count == 0 {
                bad!("zero reference count recorded for inode {ino}");
            }
            if self.kind(ino).is_none() {
                bad!("reference to inode {ino}, which does not exist");
            }
        }
        Ok(())
    }

    fn held(&self, ino: Ino) -> bool {
        self.s.refs.binary_search_by_key(&ino, |&(i, _)| i).is_ok()
    }

    /// Overlay directory entries: how many point at each inode, and which directory
    /// holds the (only) entry of each directory they name.
    #[allow(clippy::type_complexity)]
    fn count_entries(&self) -> Result<(HashMap<Ino, u64>, HashMap<Ino, Ino>), VfsStateError> {
        let mut counts: HashMap<Ino, u64> = HashMap::new();
        let mut container: HashMap<Ino, Ino> = HashMap::new();
        for n in &self.s.nodes {
            let BodyState::Dir { entries, .. } = &n.body else { continue };
            for (name, child) in entries {
                let child = *child;
                let Some(kind) = self.kind(child) else {
                    bad!(
                        "entry {:?} of directory {} points at inode {child}, which does not exist",
                        String::from_utf8_lossy(name),
                        n.ino
                    );
                };
                if child == ROOT_INO {
                    bad!("directory {} has an entry for the root", n.ino);
                }
                *counts.entry(child).or_insert(0) += 1;
                if kind == FileType::Dir && container.insert(child, n.ino).is_some() {
                    bad!("directory {child} has more than one name");
                }
            }
        }
        Ok((counts, container))
    }

    /// Link counts equal the names found; unlinked nodes are held; no image inode lost
    /// its name without a node saying so.
    fn check_links(&self, counts: &HashMap<Ino, u64>) -> Result<(), VfsStateError> {
        let names = |ino: Ino| counts.get(&ino).copied().unwrap_or(0) + u64::from(self.image_link(ino).is_some());
        for n in &self.s.nodes {
            let found = names(n.ino);
            if n.ino == ROOT_INO {
                continue; // no names (an entry for it was refused above), link count 1
            }
            if u64::from(n.nlink) != found {
                bad!("inode {}: link count {} but {found} names", n.ino, n.nlink);
            }
            if n.nlink == 0 && kind_of(&n.body).is_some() && !self.held(n.ino) {
                bad!("inode {} has neither names nor references", n.ino);
            }
        }
        for &ino in counts.keys() {
            if ino < self.n_img && !self.overlaid(ino) && names(ino) != 1 {
                bad!("image inode {ino} has {} names", names(ino));
            }
        }
        // The image entries of a changed image directory are replaced by the overlay's:
        // every image child must still have a name or an overlay node saying otherwise.
        for n in &self.s.nodes {
            if self.image_kind(n.ino) != Some(FileType::Dir) {
                continue;
            }
            for (_, child) in self.image.children(n.ino as u32) {
                let child = Ino::from(child);
                if !self.overlaid(child) && names(child) == 0 {
                    bad!("image inode {child} has no name left and no overlay node");
                }
            }
        }
        Ok(())
    }

    /// Every linked directory's ".." is the directory holding its name; a removed one's
    /// is a directory or a deleted inode.
    fn check_parents(&self, container: &HashMap<Ino, Ino>) -> Result<(), VfsStateError> {
        for n in &self.s.nodes {
            let BodyState::Dir { parent, .. } = n.body else { continue };
            if n.ino == ROOT_INO {
                continue; // checked in check_nodes
            }
            match self.kind(parent) {
                Some(FileType::Dir) => {}
                Some(k) => bad!("directory {}: parent {parent} is a {k:?}, not a directory", n.ino),
                None if n.nlink == 0 && self.in_range(parent) => {}
                None => bad!("directory {}: parent {parent} does not exist", n.ino),
            }
            if n.nlink == 1 {
                let holder = container.get(&n.ino).copied().or_else(|| self.image_link(n.ino));
                if holder != Some(parent) {
                    bad!("directory {}: parent {parent} but its name is in {holder:?}", n.ino);
                }
            }
        }
        for (&dir, &holder) in container {
            if !self.overlaid(dir) && self.image_parent(dir) != Some(holder) {
                bad!("image directory {dir} is named in {holder} but its parent is {:?}", self.image_parent(dir));
            }
        }
        Ok(())
    }

    /// Following ".." from every linked directory the overlay involves ends at the root
    /// (no detached cycles).
    fn check_reachable(&self, container: &HashMap<Ino, Ino>) -> Result<(), VfsStateError> {
        let linked_dirs = self
            .s
            .nodes
            .iter()
            .filter(|n| n.nlink == 1 && matches!(n.body, BodyState::Dir { .. }))
            .map(|n| n.ino)
            .chain(container.keys().copied());
        let mut good: HashSet<Ino> = HashSet::from([ROOT_INO]);
        let mut path: Vec<Ino> = Vec::new();
        let mut on_path: HashSet<Ino> = HashSet::new();
        for start in linked_dirs {
            path.clear();
            on_path.clear();
            let mut cur = start;
            while !good.contains(&cur) {
                if !on_path.insert(cur) {
                    bad!("directory {start} is not reachable from the root (cycle through {cur})");
                }
                path.push(cur);
                match self.parent_of(cur) {
                    Some(p) => cur = p,
                    None => bad!("directory {start}: ancestor {cur} is not a directory"),
                }
            }
            good.extend(path.iter().copied());
        }
        Ok(())
    }
}
