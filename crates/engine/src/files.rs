//! Files of a sandbox, seen from the host: upload, download and listing through
//! the guest's in-memory file system (never the host's), and the `/output`
//! folder whose new or changed files come back with each exec.

use std::collections::BTreeMap;

use forkbox_linux::vfs::{FileType, Ino, Vfs, NAME_MAX, PATH_MAX, ROOT_INO};
use forkbox_linux::Errno;
use serde::{Serialize, Serializer};

use crate::error::EngineError;
use forkbox_api::ErrorCode;

/// The folder whose files an exec returns.
pub const OUTPUT_DIR: &str = "/output";
/// An output file's bytes are returned up to this size...
pub const OUTPUT_FILE_MAX: u64 = 4 << 20;
/// ... and up to this much in total per exec (past it, only path, size and mime).
pub const OUTPUT_TOTAL_MAX: u64 = 8 << 20;
/// Bounds of the `/output` walk (a guest can fill the folder with anything).
const OUTPUT_MAX_FILES: usize = 1000;
const OUTPUT_MAX_DEPTH: usize = 8;

/// One entry of `Sandbox::list_dir`. (Deserialize: a sandbox worker sends it.)
#[derive(Clone, Debug, PartialEq, Eq, Serialize, serde::Deserialize)]
pub struct FileEntry {
    pub name: String,
    /// Absolute guest path.
    pub path: String,
    pub size: u64,
    pub is_dir: bool,
    pub mtime_ms: i64,
}

/// A file under `/output` that an exec created or changed.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct OutputFile {
    pub path: String,
    pub size: u64,
    pub mime: &'static str,
    /// The bytes (None past `OUTPUT_FILE_MAX` / `OUTPUT_TOTAL_MAX`); JSON: a base64 string `base64`.
    #[serde(rename = "base64", serialize_with = "as_base64", skip_serializing_if = "Option::is_none")]
    pub data: Option<Vec<u8>>,
}

/// The JSON form back (a sandbox worker's result): the MIME type is named
/// again from the path, as `collect` names it, never taken from the sender.
impl<'de> serde::Deserialize<'de> for OutputFile {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<OutputFile, D::Error> {
        use base64::Engine as _;
        #[derive(serde::Deserialize)]
        struct Wire {
            path: String,
            size: u64,
            base64: Option<String>,
        }
        let w = Wire::deserialize(d)?;
        let data = match w.base64 {
            Some(b) => Some(base64::engine::general_purpose::STANDARD.decode(b).map_err(serde::de::Error::custom)?),
            None => None,
        };
        Ok(OutputFile { mime: mime_of(&w.path), path: w.path, size: w.size, data })
    }
}

fn as_base64<S: Serializer>(data: &Option<Vec<u8>>, s: S) -> Result<S::Ok, S::Error> {
    use base64::Engine as _;
    match data {
        Some(d) => s.serialize_str(&base64::engine::general_purpose::STANDARD.encode(d)),
        None => s.serialize_none(),
    }
}

/// The MIME type for an output file, by extension.
pub fn mime_of(path: &str) -> &'static str {
    let ext = path.rsplit_once('.').map(|(_, e)| e.to_ascii_lowercase()).unwrap_or_default();
    match ext.as_str() {
        "png" => "image/png",
        "jpg" | "jpeg" => "image/jpeg",
        "gif" => "image/gif",
        "svg" => "image/svg+xml",
        "csv" => "text/csv",
        "json" => "application/json",
        "txt" => "text/plain",
        "html" | "htm" => "text/html",
        "pdf" => "application/pdf",
        _ => "application/octet-stream",
    }
}

pub(crate) fn file_error(code: ErrorCode, message: impl Into<String>) -> EngineError {
    EngineError::File { code, message: message.into() }
}

pub(crate) fn invalid(message: impl Into<String>) -> EngineError {
    file_error(ErrorCode::InvalidPath, message)
}

/// Turn a client's path into a normalised absolute guest path ("/a/b"):
/// absolute, or relative to `cwd`; "." and empty components dropped, ".."
/// resolved lexically and never above the root; no NUL; bounded lengths.
pub fn normalize(path: &str, cwd: &[u8]) -> Result<String, EngineError> {
    if path.is_empty() {
        return Err(invalid("empty path"));
    }
    if path.contains('\0') {
        return Err(invalid("path contains a NUL byte"));
    }
    if path.len() >= PATH_MAX {
        return Err(invalid(format!("path is {} bytes, the limit is {}", path.len(), PATH_MAX - 1)));
    }
    let mut parts: Vec<&str> = Vec::new();
    let cwd = std::str::from_utf8(cwd).map_err(|_| invalid("the guest's working directory is not UTF-8"))?;
    let base = if path.starts_with('/') { "" } else { cwd };
    for comp in base.split('/').chain(path.split('/')) {
        match comp {
            "" | "." => {}
            ".." => {
                if parts.pop().is_none() {
                    return Err(invalid(format!("{path:?} escapes the root directory")));
                }
            }
            name if name.len() > NAME_MAX => {
                return Err(invalid(format!("a component of {path:?} is longer than {NAME_MAX} bytes")))
            }
            name => parts.push(name),
        }
    }
    let out = format!("/{}", parts.join("/"));
    if out.len() >= PATH_MAX {
        return Err(invalid("path too long after resolution"));
    }
    Ok(out)
}

fn not_found(path: &str) -> EngineError {
    file_error(ErrorCode::FileNotFound, format!("{path}: no such file or directory"))
}

/// Map a VFS error on `path` to the file API's codes.
pub(crate) fn vfs_error(path: &str, e: Errno) -> EngineError {
    match e {
        Errno::ENOENT | Errno::ENOTDIR => not_found(path),
        Errno::EISDIR => file_error(ErrorCode::IsADirectory, format!("{path} is a directory")),
        Errno::ENOSPC => file_error(ErrorCode::QuotaExceeded, format!("{path}: the sandbox's disk quota is exhausted")),
        Errno::ELOOP => invalid(format!("{path}: too many levels of symbolic links")),
        Errno::ENAMETOOLONG => invalid(format!("{path}: name too long")),
        e => invalid(format!("{path}: {e:?}")),
    }
}

pub(crate) fn mtime_ms(ns: i128) -> i64 {
    (ns / 1_000_000).clamp(i64::MIN as i128, i64::MAX as i128) as i64
}

/// Trees the sandbox generates (/proc, refreshed whole) or whose files are
/// devices (/dev): an upload there would be thrown away or store nothing.
const GENERATED_DIRS: &[&str] = &["/proc", "/sys", "/dev"];

pub(crate) fn in_generated(path: &str) -> Option<&'static str> {
    GENERATED_DIRS.iter().copied().find(|d| path == *d || path.strip_prefix(d).is_some_and(|r| r.starts_with('/')))
}

/// Symlinks followed when finding where a write lands (Linux's MAXSYMLINKS).
const MAX_SYMLINKS: usize = 40;

/// Where a write of `path` (absolute, normalised) lands, as the guest's
/// `open(O_CREAT)` would find it: the symlinks of its existing parent
/// directories and a symlink at its end resolved; missing parents appended as
/// they will be created.
fn landing_path(vfs: &Vfs, path: &str) -> Result<String, EngineError> {
    let mut path = path.to_string();
    for _ in 0..MAX_SYMLINKS {
        let (parent, name) = path.rsplit_once('/').unwrap_or(("", path.as_str()));
        // The real path of the deepest existing ancestor ("" is the root), then what is missing.
        let mut real = String::new();
        let mut dir = String::new();
        let mut missing = false;
        for comp in parent.split('/').filter(|c| !c.is_empty()) {
            if !missing {
                dir.push('/');
                dir.push_str(comp);
                match vfs.resolve(ROOT_INO, dir.as_bytes(), true) {
                    Ok(ino) => {
                        let p = vfs.dir_path(ino).map_err(|e| match e {
                            Errno::ENOTDIR => invalid(format!("{dir} is not a directory")),
                            e => vfs_error(&dir, e),
                        })?;
                        real = String::from_utf8(p).map_err(|_| invalid(format!("{dir}: not UTF-8")))?;
                        if real == "/" {
                            real.clear();
                        }
                        continue;
                    }
                    Err(Errno::ENOENT) => missing = true,
                    Err(e) => return Err(vfs_error(&dir, e)),
                }
            }
            real.push('/');
            real.push_str(comp);
        }
        let full = format!("{real}/{name}");
        if !missing {
            if let Ok(ino) = vfs.resolve(ROOT_INO, full.as_bytes(), false) {
                if vfs.file_type(ino) == Ok(FileType::Symlink) {
                    let target = vfs.readlink_ino(ino).map_err(|e| vfs_error(&full, e))?;
                    let target = std::str::from_utf8(&target).map_err(|_| invalid(format!("{full}: not UTF-8")))?;
                    let base = if real.is_empty() { "/" } else { real.as_str() };
                    path = normalize(target, base.as_bytes())?;
                    continue;
                }
            }
        }
        return Ok(full);
    }
    Err(invalid(format!("{path}: too many levels of symbolic links")))
}

/// Write `data` to `path` (absolute, normalised), creating missing parent directories (0755) and
/// the file (0644), replacing its content if it exists.
pub fn write_file(vfs: &mut Vfs, path: &str, data: &[u8]) -> Result<(), EngineError> {
    write_file_from(vfs, path, &mut &data[..], data.len() as u64)
}

/// How much of an upload is read at a time (the only buffer besides the file itself).
const COPY_CHUNK: usize = 1 << 20;

/// [`write_file`] of `len` bytes read from `src` (an upload's temporary file):
/// the file is sized once (exactly `len`, charged to the quota before
/// anything is read) and filled a chunk at a time, so nothing but the
/// guest's file holds the bytes. `src` must give exactly `len` bytes.
pub fn write_file_from(vfs: &mut Vfs, path: &str, src: &mut dyn std::io::Read, len: u64) -> Result<(), EngineError> {
    if path == "/" {
        return Err(file_error(ErrorCode::IsADirectory, "/ is a directory"));
    }
    let landing = landing_path(vfs, path)?;
    if let Some(dir) = in_generated(&landing) {
        return Err(invalid(format!(
            "{path}: {dir} is generated by the sandbox (its files are not stored); upload elsewhere, e.g. /tmp"
        )));
    }
    let (parent, _) = path.rsplit_once('/').unwrap_or(("", path));
    // Quota check up front, so a refused upload leaves nothing behind. The
    // VFS checks again (an overwrite frees the old bytes, so this is conservative).
    let need = len.saturating_add(forkbox_linux::vfs::NODE_COST);
    let old = match vfs.resolve(ROOT_INO, path.as_bytes(), true) {
        Ok(ino) if vfs.file_type(ino) == Ok(FileType::File) => vfs.stat(ino).map_or(0, |s| s.size),
        _ => 0,
    };
    if vfs.overlay_bytes().saturating_sub(old).saturating_add(need) > vfs.quota() {
        return Err(file_error(
            ErrorCode::QuotaExceeded,
            format!(
                "{path}: {len} bytes do not fit in the sandbox's disk quota ({} of {} bytes used)",
                vfs.overlay_bytes(),
                vfs.quota()
            ),
        ));
    }
    make_dirs(vfs, parent)?;
    let ino = vfs
        .open(ROOT_INO, path.as_bytes(), libc::O_CREAT | libc::O_WRONLY | libc::O_TRUNC, 0o644)
        .map_err(|e| vfs_error(path, e))?;
    let r = fill(vfs, path, ino, src, len).and_then(|()| vfs.chmod(ino, 0o644).map_err(|e| vfs_error(path, e)));
    if r.is_err() {
        // What was written of it is dropped (the file stays, empty).
        let _ = vfs.truncate(ino, 0);
    }
    vfs.release(ino);
    r
}

/// Create the directory `dir` (absolute, normalised) and its missing parents, mode 0755.
pub(crate) fn make_dirs(vfs: &mut Vfs, dir: &str) -> Result<(), EngineError> {
    let mut at = String::new();
    for comp in dir.split('/').filter(|c| !c.is_empty()) {
        at.push('/');
        at.push_str(comp);
        match vfs.resolve(ROOT_INO, at.as_bytes(), true) {
            Ok(ino) if vfs.is_dir(ino).unwrap_or(false) => {}
            Ok(_) => return Err(invalid(format!("{at} is not a directory"))),
            Err(Errno::ENOENT) => vfs.mkdir(ROOT_INO, at.as_bytes(), 0o755).map_err(|e| vfs_error(&at, e))?,
            Err(e) => return Err(vfs_error(&at, e)),
        }
    }
    Ok(())
}

/// Size the open file `ino` to `len` (one allocation, charged once) and copy `src` into it.
fn fill(vfs: &mut Vfs, path: &str, ino: Ino, src: &mut dyn std::io::Read, len: u64) -> Result<(), EngineError> {
    vfs.truncate(ino, len).map_err(|e| vfs_error(path, e))?;
    let mut buf = vec![0u8; COPY_CHUNK.min(usize::try_from(len).unwrap_or(COPY_CHUNK)).max(1)];
    let mut at = 0u64;
    while at < len {
        let want = usize::try_from(len - at).unwrap_or(usize::MAX).min(buf.len());
        let n = match src.read(&mut buf[..want]) {
            Ok(0) => {
                return Err(file_error(ErrorCode::StorageError, format!("the upload ended after {at} of {len} bytes")))
            }
            Ok(n) => n,
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
            Err(e) => return Err(file_error(ErrorCode::StorageError, format!("reading the upload: {e}"))),
        };
        vfs.write(ino, at, &buf[..n]).map_err(|e| vfs_error(path, e))?;
        at += n as u64;
    }
    Ok(())
}

/// The bytes of the regular file at `path` (absolute, normalised; symlinks followed), at most `max`.
pub fn read_file(vfs: &Vfs, path: &str, max: usize) -> Result<Vec<u8>, EngineError> {
    let ino = vfs.resolve(ROOT_INO, path.as_bytes(), true).map_err(|e| vfs_error(path, e))?;
    match vfs.file_type(ino).map_err(|e| vfs_error(path, e))? {
        FileType::File => {}
        FileType::Dir => return Err(file_error(ErrorCode::IsADirectory, format!("{path} is a directory"))),
        _ => return Err(invalid(format!("{path} is not a regular file"))),
    }
    let bytes = vfs.file_bytes(ino).map_err(|e| vfs_error(path, e))?;
    if bytes.len() > max {
        return Err(file_error(
            ErrorCode::FileTooLarge,
            format!("{path} is {} bytes, more than the {max}-byte limit", bytes.len()),
        ));
    }
    Ok(bytes.to_vec())
}

/// The entries of the directory at `path` (absolute, normalised), sorted by name.
pub fn list_dir(vfs: &Vfs, path: &str) -> Result<Vec<FileEntry>, EngineError> {
    let ino = vfs.resolve(ROOT_INO, path.as_bytes(), true).map_err(|e| vfs_error(path, e))?;
    if !vfs.is_dir(ino).map_err(|e| vfs_error(path, e))? {
        return Err(invalid(format!("{path} is not a directory")));
    }
    let mut out = Vec::new();
    for e in vfs.readdir(ino).map_err(|e| vfs_error(path, e))? {
        if e.name == b"." || e.name == b".." {
            continue;
        }
        let Ok(st) = vfs.stat(e.ino) else { continue };
        let name = String::from_utf8_lossy(&e.name).into_owned();
        let full = if path == "/" { format!("/{name}") } else { format!("{path}/{name}") };
        let size = if st.kind == FileType::Dir { 0 } else { st.size };
        out.push(FileEntry {
            name,
            path: full,
            size,
            is_dir: st.kind == FileType::Dir,
            mtime_ms: mtime_ms(st.mtime_ns),
        });
    }
    Ok(out)
}

/// What identifies one version of a file under `/output`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct FileSig {
    ino: Ino,
    size: u64,
    mtime_ns: i128,
}

/// The files under `/output` as of a VFS generation: compared after an exec
/// to find what it created or changed. The walk only happens when the
/// generation moved, so an exec that writes no file costs nothing here.
#[derive(Clone, Debug, Default)]
pub(crate) struct OutputIndex {
    generation: Option<u64>,
    files: BTreeMap<String, FileSig>,
}

impl OutputIndex {
    /// Bring the index up to the VFS's current state (before an exec).
    pub fn refresh(&mut self, vfs: &Vfs) {
        if self.generation != Some(vfs.generation()) {
            self.files = scan(vfs);
            self.generation = Some(vfs.generation());
        }
    }

    /// Files created or changed since the last `refresh`/`collect` (after an exec).
    pub fn collect(&mut self, vfs: &Vfs) -> Vec<OutputFile> {
        if self.generation == Some(vfs.generation()) {
            return Vec::new();
        }
        let now = scan(vfs);
        let mut out = Vec::new();
        let mut total = 0u64;
        for (path, sig) in &now {
            if self.files.get(path) == Some(sig) {
                continue;
            }
            let mut data = None;
            if sig.size <= OUTPUT_FILE_MAX && total + sig.size <= OUTPUT_TOTAL_MAX {
                if let Ok(b) = vfs.file_bytes(sig.ino) {
                    total += b.len() as u64;
                    data = Some(b.to_vec());
                }
            }
            out.push(OutputFile { path: path.clone(), size: sig.size, mime: mime_of(path), data });
        }
        self.files = now;
        self.generation = Some(vfs.generation());
        out
    }
}

/// Regular files under `/output` (bounded; symlinks not followed).
fn scan(vfs: &Vfs) -> BTreeMap<String, FileSig> {
    let mut files = BTreeMap::new();
    let Ok(root) = vfs.resolve(ROOT_INO, OUTPUT_DIR.as_bytes(), false) else { return files };
    let mut stack = vec![(root, OUTPUT_DIR.to_string(), 0usize)];
    while let Some((dir, path, depth)) = stack.pop() {
        let Ok(entries) = vfs.readdir(dir) else { continue };
        for e in entries {
            if e.name == b"." || e.name == b".." {
                continue;
            }
            let Ok(name) = std::str::from_utf8(&e.name) else { continue };
            let full = format!("{path}/{name}");
            match e.kind {
                FileType::File => {
                    if files.len() >= OUTPUT_MAX_FILES {
                        return files;
                    }
                    if let Ok(st) = vfs.stat(e.ino) {
                        files.insert(full, FileSig { ino: e.ino, size: st.size, mtime_ns: st.mtime_ns });
                    }
                }
                FileType::Dir if depth + 1 < OUTPUT_MAX_DEPTH => stack.push((e.ino, full, depth + 1)),
                _ => {}
            }
        }
    }
    files
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn paths_normalise_inside_the_root() {
        assert_eq!(normalize("/a/./b//c/", b"/").unwrap(), "/a/b/c");
        assert_eq!(normalize("x/../y", b"/root").unwrap(), "/root/y");
        assert_eq!(normalize("..", b"/root").unwrap(), "/");
        assert_eq!(normalize("/", b"/tmp").unwrap(), "/");
        for bad in ["", "/../etc", "../../x", "a\0b", "/a/../../b"] {
            let e = normalize(bad, b"/").unwrap_err();
            assert_eq!(e.code(), "invalid_path", "{bad:?}");
        }
        assert_eq!(normalize(&"a/".repeat(3000), b"/").unwrap_err().code(), "invalid_path");
        assert_eq!(normalize(&"n".repeat(300), b"/").unwrap_err().code(), "invalid_path");
    }

    #[test]
    fn mime_by_extension() {
        assert_eq!(mime_of("/output/plot.PNG"), "image/png");
        assert_eq!(mime_of("/output/a.jpeg"), "image/jpeg");
        assert_eq!(mime_of("/output/data.csv"), "text/csv");
        assert_eq!(mime_of("/output/noext"), "application/octet-stream");
    }

    #[test]
    fn output_files_serialise_their_bytes_as_base64() {
        let f = OutputFile { path: "/output/a.txt".into(), size: 3, mime: "text/plain", data: Some(b"hi!".to_vec()) };
        let v = serde_json::to_value(&f).unwrap();
        assert_eq!(v["base64"], "aGkh");
        let f = OutputFile { data: None, ..f };
        assert!(serde_json::to_value(&f).unwrap().get("base64").is_none());
    }
}
