//! The running server of a data directory: `<home>/server.json`.
//!
//! One process at a time owns a data directory's sessions. `forkbox serve`
//! writes this file once it serves (and removes it when it stops), so that a
//! CLI command run without `--url` on the same directory uses that server
//! instead of waiting for the directory's lock. The file holds a key of the
//! CLI's own tenant made for this run of the server (mode 0600, like the rest of
//! the directory it is readable only by its owner); the server deletes that key
//! when it stops, and the next start deletes a stale one.
//!
//! A persisted format: [`ServerFile::VERSION`] is checked on read, a golden
//! file in `tests/golden/` pins the shape.

use std::io::Write;
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

/// The tenant of the CLI's embedded mode (`forkbox session ...` without `--url`):
/// the key in the file is one of it, so the CLI sees the same sessions through the server.
pub const CLI_TENANT: &str = "local";

/// What `<home>/server.json` holds.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ServerFile {
    pub version: u32,
    /// Where the server listens, e.g. `http://127.0.0.1:8080`.
    pub url: String,
    /// The server's process id (a file whose process is gone is stale).
    pub pid: u32,
    /// A key of the CLI's tenant, valid while this server runs.
    pub key: String,
}

#[derive(Debug, thiserror::Error)]
pub enum HandoffError {
    #[error("writing {what}: {source}")]
    Write { what: &'static str, source: std::io::Error },
    #[error("reading server.json: {0}")]
    Read(std::io::Error),
    #[error("server.json is not a forkbox server file: {0}")]
    Format(String),
    #[error("server.json has version {0}; this forkbox reads version {ver}", ver = ServerFile::VERSION)]
    Version(u32),
}

impl ServerFile {
    pub const VERSION: u32 = 1;

    pub fn new(url: String, pid: u32, key: String) -> ServerFile {
        ServerFile { version: Self::VERSION, url, pid, key }
    }

    /// Where the file of `home` is.
    pub fn path(home: &Path) -> PathBuf {
        home.join("server.json")
    }

    /// Parse the file's bytes.
    pub fn parse(bytes: &[u8]) -> Result<ServerFile, HandoffError> {
        #[derive(Deserialize)]
        struct Versioned {
            version: u32,
        }
        let v: Versioned = serde_json::from_slice(bytes).map_err(|e| HandoffError::Format(e.to_string()))?;
        if v.version != Self::VERSION {
            return Err(HandoffError::Version(v.version));
        }
        serde_json::from_slice(bytes).map_err(|e| HandoffError::Format(e.to_string()))
    }

    /// The file of `home`, if there is one (`Ok(None)`: none).
    pub fn read(home: &Path) -> Result<Option<ServerFile>, HandoffError> {
        match std::fs::read(Self::path(home)) {
            Ok(b) => Self::parse(&b).map(Some),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
            Err(e) => Err(HandoffError::Read(e)),
        }
    }

    /// Is the process that wrote the file still there?
    pub fn process_alive(&self) -> bool {
        self.pid != 0 && Path::new("/proc").join(self.pid.to_string()).exists()
    }

    /// Write it to `home` atomically (a temporary file renamed over), mode 0600.
    pub fn write(&self, home: &Path) -> Result<(), HandoffError> {
        use std::os::unix::fs::OpenOptionsExt;
        let path = Self::path(home);
        let tmp = home.join(format!(".server.json.{}", std::process::id()));
        let err = |what| move |source| HandoffError::Write { what, source };
        let body = serde_json::to_vec_pretty(self).map_err(|e| HandoffError::Format(e.to_string()))?;
        let mut f = std::fs::OpenOptions::new()
            .write(true)
            .create(true)
            .truncate(true)
            .mode(0o600)
            .open(&tmp)
            .map_err(err("a temporary server file"))?;
        f.write_all(&body).and_then(|()| f.sync_all()).map_err(err("a temporary server file"))?;
        std::fs::rename(&tmp, &path).map_err(err("server.json"))
    }

    /// Remove `home`'s file if it is still this one (another server may have replaced it).
    pub fn remove_if_mine(&self, home: &Path) {
        if let Ok(Some(f)) = Self::read(home) {
            if &f == self {
                let _ = std::fs::remove_file(Self::path(home));
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const GOLDEN: &[u8] = include_bytes!("../tests/golden/server-v1.json");

    #[test]
    fn golden_file_reads_and_writes_the_same() {
        let f = ServerFile::parse(GOLDEN).expect("golden v1 parses");
        assert_eq!(f, ServerFile::new("http://127.0.0.1:8080".into(), 4242, format!("fbk_{}", "ab".repeat(32))));
        let dir = tempdir();
        f.write(&dir).unwrap();
        assert_eq!(std::fs::read(ServerFile::path(&dir)).unwrap(), GOLDEN.strip_suffix(b"\n").unwrap_or(GOLDEN));
        use std::os::unix::fs::PermissionsExt;
        let mode = std::fs::metadata(ServerFile::path(&dir)).unwrap().permissions().mode();
        assert_eq!(mode & 0o777, 0o600, "the file holds a key: owner only");
        std::fs::remove_dir_all(dir).ok();
    }

    #[test]
    fn other_versions_and_shapes_are_refused() {
        assert!(matches!(
            ServerFile::parse(br#"{"version": 2, "url": "u", "pid": 1, "key": "k"}"#),
            Err(HandoffError::Version(2))
        ));
        assert!(matches!(ServerFile::parse(b"not json"), Err(HandoffError::Format(_))));
        assert!(matches!(ServerFile::parse(br#"{"version": 1, "url": "u"}"#), Err(HandoffError::Format(_))));
        assert!(matches!(
            ServerFile::parse(br#"{"version": 1, "url": "u", "pid": 1, "key": "k", "extra": 1}"#),
            Err(HandoffError::Format(_))
        ));
    }

    #[test]
    fn missing_file_is_none_and_remove_spares_another_servers_file() {
        let dir = tempdir();
        assert_eq!(ServerFile::read(&dir).unwrap(), None);
        let mine = ServerFile::new("http://127.0.0.1:1".into(), std::process::id(), "fbk_a".into());
        assert!(mine.process_alive());
        let other = ServerFile::new("http://127.0.0.1:2".into(), 1, "fbk_b".into());
        other.write(&dir).unwrap();
        mine.remove_if_mine(&dir);
        assert_eq!(ServerFile::read(&dir).unwrap(), Some(other.clone()));
        other.remove_if_mine(&dir);
        assert_eq!(ServerFile::read(&dir).unwrap(), None);
        std::fs::remove_dir_all(dir).ok();
    }

    fn tempdir() -> PathBuf {
        let d = std::env::temp_dir().join(format!(
            "forkbox-handoff-{}-{:?}",
            std::process::id(),
            std::thread::current().id()
        ));
        std::fs::create_dir_all(&d).unwrap();
        d
    }
}
