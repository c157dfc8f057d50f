//! File-system operations a client asks of a sandbox from outside (stat, a
//! bounded walk, make a directory, move, remove), done on the guest's
//! in-memory file system by the host: no guest code runs, so reading costs no
//! exec and no checkpoint, and nothing the guest defined can answer instead of
//! the file system. Paths are absolute and normalised ([`crate::files::normalize`]).

use forkbox_api::ErrorCode;
use forkbox_linux::vfs::{FileType, Ino, Vfs, ROOT_INO};
use forkbox_linux::Errno;
use serde::{Deserialize, Serialize};

use crate::error::EngineError;
use crate::files::{file_error, in_generated, invalid, make_dirs, mtime_ms, vfs_error};

/// Most entries one walk returns, whatever the caller asks.
pub const WALK_MAX_ENTRIES: usize = 10_000;
/// Deepest walk.
pub const WALK_MAX_DEPTH: u32 = 64;
/// Most entries one recursive remove deletes (a bound on the host's work for one request).
const REMOVE_MAX_ENTRIES: usize = 1_000_000;

/// One operation. (Serialized: a session worker receives it.)
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "op", rename_all = "snake_case")]
pub enum FileOp {
    /// The entry at `path` (a symlink: itself, with its target's type and size if it has one).
    Stat { path: String },
    /// The entries under the directory `path`, `depth` levels down (1: its own entries), sorted
    /// by name, directories before their contents, symlinked directories not entered.
    Walk { path: String, depth: u32 },
    /// Create the directory `path` and missing parents (`file_exists` if `path` exists).
    MakeDir { path: String },
    /// Rename `from` to `to` (replacing a file there), creating `to`'s missing parents.
    Move { from: String, to: String },
    /// Remove `path`: a file or symlink, or a directory and everything in it.
    Remove { path: String },
}

impl FileOp {
    /// Whether the operation changes the file system (a session checkpoints after it).
    pub fn changes(&self) -> bool {
        !matches!(self, FileOp::Stat { .. } | FileOp::Walk { .. })
    }

    /// Its paths, normalised against the guest's working directory `cwd`.
    pub fn normalized(&self, cwd: &[u8]) -> Result<FileOp, EngineError> {
        let n = |p: &str| crate::files::normalize(p, cwd);
        Ok(match self {
            FileOp::Stat { path } => FileOp::Stat { path: n(path)? },
            FileOp::Walk { path, depth } => FileOp::Walk { path: n(path)?, depth: *depth },
            FileOp::MakeDir { path } => FileOp::MakeDir { path: n(path)? },
            FileOp::Move { from, to } => FileOp::Move { from: n(from)?, to: n(to)? },
            FileOp::Remove { path } => FileOp::Remove { path: n(path)? },
        })
    }

    /// A one-line label (what a checkpoint made by it is called).
    pub fn label(&self) -> String {
        match self {
            FileOp::Stat { path } => format!("stat {path}"),
            FileOp::Walk { path, .. } => format!("list {path}"),
            FileOp::MakeDir { path } => format!("mkdir {path}"),
            FileOp::Move { from, to } => format!("move {from} {to}"),
            FileOp::Remove { path } => format!("remove {path}"),
        }
    }
}

/// What an entry is.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum EntryKind {
    File,
    Dir,
    Symlink,
    /// A device, FIFO or socket.
    Other,
}

/// One entry, as a client sees it.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct EntryInfo {
    pub name: String,
    /// Absolute guest path.
    pub path: String,
    /// What the name is (`symlink` for a link, whatever it points at).
    pub kind: EntryKind,
    /// A symlink's target's kind (None: dangling, or not a symlink).
    pub target_kind: Option<EntryKind>,
    /// A symlink's target as stored.
    pub link_target: Option<String>,
    /// Bytes (of the target, for a symlink to a file); 0 for a directory.
    pub size: u64,
    /// Permission bits (07777).
    pub perm: u32,
    /// Owner and group: their names in the guest's /etc/passwd and /etc/group, else the number.
    pub owner: String,
    pub group: String,
    pub mtime_ms: i64,
}

/// What an operation answers.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "kind", content = "value", rename_all = "snake_case")]
pub enum FileOpOutcome {
    Entry(EntryInfo),
    Entries(Vec<EntryInfo>),
    Removed,
}

/// Names of ids, read from the guest's own /etc/passwd or /etc/group (bounded; none if it is
/// missing or unreadable: the numbers are shown).
struct Names(std::collections::HashMap<u32, String>);

impl Names {
    const MAX_FILE: usize = 1 << 20;

    fn read(vfs: &Vfs, path: &str) -> Names {
        let text = crate::files::read_file(vfs, path, Self::MAX_FILE).unwrap_or_default();
        let map = String::from_utf8_lossy(&text)
            .lines()
            .filter_map(|l| {
                let mut f = l.split(':');
                let name = f.next()?;
                let id = f.nth(1)?.parse().ok()?;
                Some((id, name.to_string()))
            })
            .collect();
        Names(map)
    }

    fn of(&self, id: u32) -> String {
        self.0.get(&id).cloned().unwrap_or_else(|| id.to_string())
    }
}

/// What an operation needs besides the file system: the names of owners and groups.
struct Ctx {
    users: Names,
    groups: Names,
}

/// Run `op` (paths already normalised) on `vfs`.
pub fn apply(vfs: &mut Vfs, op: &FileOp) -> Result<FileOpOutcome, EngineError> {
    let cx = Ctx { users: Names::read(vfs, "/etc/passwd"), groups: Names::read(vfs, "/etc/group") };
    let cx = &cx;
    match op {
        FileOp::Stat { path } => Ok(FileOpOutcome::Entry(stat(vfs, cx, path)?)),
        FileOp::Walk { path, depth } => Ok(FileOpOutcome::Entries(walk(vfs, cx, path, *depth)?)),
        FileOp::MakeDir { path } => {
            writable(path)?;
            if vfs.resolve(ROOT_INO, path.as_bytes(), false).is_ok() {
                return Err(file_error(ErrorCode::FileExists, format!("{path} already exists")));
            }
            make_dirs(vfs, path)?;
            Ok(FileOpOutcome::Entry(stat(vfs, cx, path)?))
        }
        FileOp::Move { from, to } => {
            writable(from)?;
            writable(to)?;
            vfs.resolve(ROOT_INO, from.as_bytes(), false).map_err(|e| vfs_error(from, e))?;
            make_dirs(vfs, to.rsplit_once('/').map_or("", |(p, _)| p))?;
            vfs.rename(ROOT_INO, from.as_bytes(), ROOT_INO, to.as_bytes(), 0).map_err(|e| match e {
                Errno::EINVAL => invalid(format!("{from} cannot be moved into itself ({to})")),
                Errno::ENOTEMPTY => file_error(ErrorCode::FileExists, format!("{to} is a directory that is not empty")),
                Errno::EISDIR => file_error(ErrorCode::IsADirectory, format!("{to} is a directory")),
                Errno::EBUSY => invalid(format!("{from} or {to} cannot be moved")),
                e => vfs_error(to, e),
            })?;
            Ok(FileOpOutcome::Entry(stat(vfs, cx, to)?))
        }
        FileOp::Remove { path } => {
            writable(path)?;
            if path == "/" {
                return Err(invalid("/ cannot be removed"));
            }
            remove(vfs, path)?;
            Ok(FileOpOutcome::Removed)
        }
    }
}

/// Refuse changes under the trees the sandbox generates.
fn writable(path: &str) -> Result<(), EngineError> {
    match in_generated(path) {
        Some(dir) => Err(invalid(format!("{path}: {dir} is generated by the sandbox and cannot be changed"))),
        None => Ok(()),
    }
}

fn kind_of(t: FileType) -> EntryKind {
    match t {
        FileType::File => EntryKind::File,
        FileType::Dir => EntryKind::Dir,
        FileType::Symlink => EntryKind::Symlink,
        _ => EntryKind::Other,
    }
}

/// The entry `ino` named `name` at `path`.
fn info(vfs: &Vfs, cx: &Ctx, ino: Ino, name: String, path: String) -> Result<EntryInfo, EngineError> {
    let st = vfs.stat(ino).map_err(|e| vfs_error(&path, e))?;
    let kind = kind_of(st.kind);
    let (mut size, mut target_kind, mut link_target) = (st.size, None, None);
    if kind == EntryKind::Symlink {
        let t = vfs.readlink_ino(ino).map_err(|e| vfs_error(&path, e))?;
        link_target = Some(String::from_utf8_lossy(&t).into_owned());
        size = 0;
        if let Ok(target) = vfs.resolve(ROOT_INO, path.as_bytes(), true) {
            if let Ok(ts) = vfs.stat(target) {
                target_kind = Some(kind_of(ts.kind));
                if ts.kind == FileType::File {
                    size = ts.size;
                }
            }
        }
    } else if kind == EntryKind::Dir {
        size = 0;
    }
    Ok(EntryInfo {
        name,
        path,
        kind,
        target_kind,
        link_target,
        size,
        perm: st.perm,
        owner: cx.users.of(st.uid),
        group: cx.groups.of(st.gid),
        mtime_ms: mtime_ms(st.mtime_ns),
    })
}

fn stat(vfs: &Vfs, cx: &Ctx, path: &str) -> Result<EntryInfo, EngineError> {
    let ino = vfs.resolve(ROOT_INO, path.as_bytes(), false).map_err(|e| vfs_error(path, e))?;
    let name = path.rsplit('/').next().filter(|n| !n.is_empty()).unwrap_or("/").to_string();
    info(vfs, cx, ino, name, path.to_string())
}

fn child_path(dir: &str, name: &str) -> String {
    if dir == "/" {
        format!("/{name}")
    } else {
        format!("{dir}/{name}")
    }
}

/// The entries of `dir` (symlinks followed to find it), sorted by name.
fn entries(vfs: &Vfs, dir: &str) -> Result<Vec<(String, Ino)>, EngineError> {
    let ino = vfs.resolve(ROOT_INO, dir.as_bytes(), true).map_err(|e| vfs_error(dir, e))?;
    if !vfs.is_dir(ino).map_err(|e| vfs_error(dir, e))? {
        return Err(invalid(format!("{dir} is not a directory")));
    }
    let mut out: Vec<(String, Ino)> = vfs
        .readdir(ino)
        .map_err(|e| vfs_error(dir, e))?
        .into_iter()
        .filter(|e| e.name != b"." && e.name != b"..")
        .map(|e| (String::from_utf8_lossy(&e.name).into_owned(), e.ino))
        .collect();
    out.sort();
    Ok(out)
}

fn walk(vfs: &Vfs, cx: &Ctx, path: &str, depth: u32) -> Result<Vec<EntryInfo>, EngineError> {
    let depth = depth.clamp(1, WALK_MAX_DEPTH);
    let mut out = Vec::new();
    // Depth first, in name order, without recursion: (directory, level, its remaining entries reversed).
    let mut first = entries(vfs, path)?;
    first.reverse();
    let mut stack = vec![(path.to_string(), 1u32, first)];
    while let Some((dir, level, rest)) = stack.last_mut() {
        let Some((name, ino)) = rest.pop() else {
            stack.pop();
            continue;
        };
        if out.len() >= WALK_MAX_ENTRIES {
            break;
        }
        let (dir, level) = (dir.clone(), *level);
        let p = child_path(&dir, &name);
        let e = info(vfs, cx, ino, name, p.clone())?;
        let descend = level < depth && e.kind == EntryKind::Dir;
        out.push(e);
        if descend {
            let mut sub = entries(vfs, &p)?;
            sub.reverse();
            stack.push((p, level + 1, sub));
        }
    }
    Ok(out)
}

/// Remove `path`: a non-directory by unlink; a directory after its contents, depth first,
/// without recursion (a guest can nest directories thousands deep).
fn remove(vfs: &mut Vfs, path: &str) -> Result<(), EngineError> {
    let ino = vfs.resolve(ROOT_INO, path.as_bytes(), false).map_err(|e| vfs_error(path, e))?;
    if vfs.file_type(ino).map_err(|e| vfs_error(path, e))? != FileType::Dir {
        return vfs.unlink(ROOT_INO, path.as_bytes()).map_err(|e| vfs_error(path, e));
    }
    let mut removed = 0usize;
    // (directory, its contents already handled): a directory is listed once, its files
    // unlinked and its subdirectories stacked above it; met again, it is empty.
    let mut stack = vec![(path.to_string(), false)];
    while let Some((dir, done)) = stack.pop() {
        if done {
            vfs.rmdir(ROOT_INO, dir.as_bytes()).map_err(|e| vfs_error(&dir, e))?;
            continue;
        }
        stack.push((dir.clone(), true));
        for (name, ino) in entries(vfs, &dir)? {
            removed += 1;
            if removed > REMOVE_MAX_ENTRIES {
                return Err(invalid(format!("{path} holds more than {REMOVE_MAX_ENTRIES} entries")));
            }
            let p = child_path(&dir, &name);
            if vfs.file_type(ino).map_err(|e| vfs_error(&p, e))? == FileType::Dir {
                stack.push((p, false));
            } else {
                vfs.unlink(ROOT_INO, p.as_bytes()).map_err(|e| vfs_error(&p, e))?;
            }
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use forkbox_image::{pack_dir, Image};

    use super::*;

    /// A VFS over a small packed image: /etc/hostname, /home/user/notes.txt, /home/user/link -> notes.txt.
    fn vfs() -> (tempfile::TempDir, Vfs) {
        let dir = tempfile::tempdir().unwrap();
        let root = dir.path().join("root");
        std::fs::create_dir_all(root.join("etc")).unwrap();
        std::fs::create_dir_all(root.join("home/user")).unwrap();
        std::fs::write(root.join("etc/hostname"), "box\n").unwrap();
        std::fs::write(root.join("etc/passwd"), "root:x:0:0:root:/root:/bin/bash\n").unwrap();
        std::fs::write(root.join("home/user/notes.txt"), "hello").unwrap();
        std::os::unix::fs::symlink("notes.txt", root.join("home/user/link")).unwrap();
        std::os::unix::fs::symlink("/nowhere", root.join("home/user/dangling")).unwrap();
        pack_dir(&root, &dir.path().join("img")).unwrap();
        let image = Arc::new(Image::open(&dir.path().join("img")).unwrap());
        (dir, Vfs::new(image))
    }

    fn entry(v: &mut Vfs, path: &str) -> EntryInfo {
        match apply(v, &FileOp::Stat { path: path.into() }).unwrap() {
            FileOpOutcome::Entry(e) => e,
            o => panic!("{o:?}"),
        }
    }

    fn names(v: &mut Vfs, path: &str, depth: u32) -> Vec<String> {
        match apply(v, &FileOp::Walk { path: path.into(), depth }).unwrap() {
            FileOpOutcome::Entries(es) => es.into_iter().map(|e| e.path).collect(),
            o => panic!("{o:?}"),
        }
    }

    fn code(r: Result<FileOpOutcome, EngineError>) -> String {
        r.unwrap_err().code().to_string()
    }

    #[test]
    fn stat_tells_files_directories_and_symlinks_apart() {
        let (_d, mut v) = vfs();
        let f = entry(&mut v, "/home/user/notes.txt");
        assert_eq!((f.name.as_str(), f.kind, f.size, f.link_target), ("notes.txt", EntryKind::File, 5, None));
        // Names from the guest's /etc/passwd; a group file it lacks shows the number.
        assert_eq!((f.owner.as_str(), f.group.as_str()), ("root", "0"));
        let l = entry(&mut v, "/home/user/link");
        assert_eq!((l.kind, l.target_kind, l.size), (EntryKind::Symlink, Some(EntryKind::File), 5));
        assert_eq!(l.link_target.as_deref(), Some("notes.txt"));
        let d = entry(&mut v, "/home/user/dangling");
        assert_eq!((d.kind, d.target_kind), (EntryKind::Symlink, None));
        let h = entry(&mut v, "/home");
        assert_eq!((h.kind, h.size), (EntryKind::Dir, 0));
        assert_eq!(entry(&mut v, "/").name, "/");
        assert_eq!(code(apply(&mut v, &FileOp::Stat { path: "/home/nobody".into() })), "file_not_found");
    }

    #[test]
    fn walk_is_depth_first_in_name_order_and_bounded_by_depth() {
        let (_d, mut v) = vfs();
        assert_eq!(names(&mut v, "/home", 1), ["/home/user"]);
        assert_eq!(
            names(&mut v, "/home", 2),
            ["/home/user", "/home/user/dangling", "/home/user/link", "/home/user/notes.txt"]
        );
        // The VFS adds the mount points the sandbox serves (/dev, /proc) and its own /root and /tmp.
        assert_eq!(names(&mut v, "/", 1), ["/dev", "/etc", "/home", "/proc", "/root", "/tmp"]);
        assert_eq!(code(apply(&mut v, &FileOp::Walk { path: "/etc/hostname".into(), depth: 1 })), "invalid_path");
        assert_eq!(code(apply(&mut v, &FileOp::Walk { path: "/missing".into(), depth: 1 })), "file_not_found");
    }

    #[test]
    fn make_dir_creates_parents_and_refuses_an_existing_name() {
        let (_d, mut v) = vfs();
        let e = match apply(&mut v, &FileOp::MakeDir { path: "/data/a/b".into() }).unwrap() {
            FileOpOutcome::Entry(e) => e,
            o => panic!("{o:?}"),
        };
        assert_eq!((e.path.as_str(), e.kind, e.perm), ("/data/a/b", EntryKind::Dir, 0o755));
        assert_eq!(code(apply(&mut v, &FileOp::MakeDir { path: "/data/a".into() })), "file_exists");
        assert_eq!(code(apply(&mut v, &FileOp::MakeDir { path: "/etc/hostname".into() })), "file_exists");
        assert_eq!(code(apply(&mut v, &FileOp::MakeDir { path: "/proc/x".into() })), "invalid_path");
    }

    #[test]
    fn move_renames_into_new_parents_and_replaces_a_file() {
        let (_d, mut v) = vfs();
        apply(&mut v, &FileOp::Move { from: "/home/user/notes.txt".into(), to: "/archive/2026/n.txt".into() }).unwrap();
        assert_eq!(entry(&mut v, "/archive/2026/n.txt").size, 5);
        assert_eq!(code(apply(&mut v, &FileOp::Stat { path: "/home/user/notes.txt".into() })), "file_not_found");
        apply(&mut v, &FileOp::Move { from: "/archive/2026/n.txt".into(), to: "/etc/hostname".into() }).unwrap();
        assert_eq!(entry(&mut v, "/etc/hostname").size, 5);
        assert_eq!(
            code(apply(&mut v, &FileOp::Move { from: "/home".into(), to: "/home/user/x".into() })),
            "invalid_path"
        );
        assert_eq!(code(apply(&mut v, &FileOp::Move { from: "/nope".into(), to: "/x".into() })), "file_not_found");
    }

    #[test]
    fn remove_takes_a_file_a_symlink_or_a_whole_deep_tree() {
        let (_d, mut v) = vfs();
        apply(&mut v, &FileOp::Remove { path: "/home/user/link".into() }).unwrap();
        assert_eq!(entry(&mut v, "/home/user/notes.txt").size, 5, "the link's target stays");
        let mut deep = String::from("/deep");
        for i in 0..300 {
            deep.push_str(&format!("/d{i}"));
        }
        apply(&mut v, &FileOp::MakeDir { path: deep.clone() }).unwrap();
        for i in 0..50 {
            crate::files::write_file(&mut v, &format!("/deep/f{i}"), b"x").unwrap();
        }
        apply(&mut v, &FileOp::Remove { path: "/deep".into() }).unwrap();
        assert_eq!(code(apply(&mut v, &FileOp::Stat { path: "/deep".into() })), "file_not_found");
        assert_eq!(code(apply(&mut v, &FileOp::Remove { path: "/".into() })), "invalid_path");
        assert_eq!(code(apply(&mut v, &FileOp::Remove { path: "/gone".into() })), "file_not_found");
    }

    #[test]
    fn only_changes_are_marked_as_changes_and_paths_are_normalised() {
        assert!(!FileOp::Stat { path: "/".into() }.changes());
        assert!(!FileOp::Walk { path: "/".into(), depth: 1 }.changes());
        assert!(FileOp::Remove { path: "/x".into() }.changes());
        let op = FileOp::Move { from: "a/../b".into(), to: "c".into() }.normalized(b"/home/user").unwrap();
        assert_eq!(op, FileOp::Move { from: "/home/user/b".into(), to: "/home/user/c".into() });
        assert!(FileOp::Stat { path: "../../..".into() }.normalized(b"/home").is_err());
    }
}
