//! A real S3-compatible server for the object-store tests: the `s3s-fs`
//! crate's binary (scripts/test installs it under target/tools and names it in
//! `$FORKBOX_S3S_FS`), on a loopback port, storing under a temp directory. A
//! missing binary is a failure with a message, never a skip.

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use forkbox_runtime::ObjectsConfig;

pub const BUCKET: &str = "forkbox";
pub const PREFIX: &str = "ckpt/test";
pub const KEY_ID: &str = "forkbox-test";
pub const SECRET: &str = "forkbox-test-secret";

/// The s3s-fs binary: `$FORKBOX_S3S_FS`, else where scripts/test installs it.
pub fn s3s_fs() -> PathBuf {
    let p = std::env::var_os("FORKBOX_S3S_FS")
        .map(PathBuf::from)
        .unwrap_or_else(|| Path::new(env!("CARGO_MANIFEST_DIR")).join("../../target/tools/bin/s3s-fs"));
    assert!(
        p.is_file(),
        "the S3-compatible test server is missing: {} (scripts/test installs it: \
         cargo install --locked --root target/tools --version 0.14.1 --features binary s3s-fs; \
         or set FORKBOX_S3S_FS)",
        p.display()
    );
    p
}

/// A real S3-compatible server on a loopback port, storing under `root`.
pub struct S3 {
    child: Option<std::process::Child>,
    pub port: u16,
    pub root: tempfile::TempDir,
}

impl S3 {
    pub fn start() -> S3 {
        let root = tempfile::tempdir().expect("temp dir");
        std::fs::create_dir_all(root.path().join(BUCKET)).expect("bucket directory");
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .and_then(|l| l.local_addr())
            .expect("a free loopback port")
            .port();
        let mut s = S3 { child: None, port, root };
        s.restart();
        s
    }

    pub fn endpoint(&self) -> String {
        format!("http://127.0.0.1:{}", self.port)
    }

    /// (Re)start the server on the same port and directory; returns once it accepts connections.
    pub fn restart(&mut self) {
        let child = std::process::Command::new(s3s_fs())
            .args(["--host", "127.0.0.1", "--port", &self.port.to_string()])
            .args(["--access-key", KEY_ID, "--secret-key", SECRET])
            .arg(self.root.path())
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::null())
            .spawn()
            .expect("starting s3s-fs");
        self.child = Some(child);
        let deadline = Instant::now() + Duration::from_secs(20);
        while std::net::TcpStream::connect(("127.0.0.1", self.port)).is_err() {
            assert!(Instant::now() < deadline, "s3s-fs did not listen on port {}", self.port);
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    pub fn stop(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }

    /// The object keys (hashes) under the test prefix.
    pub fn objects(&self) -> BTreeSet<String> {
        let mut out = BTreeSet::new();
        let dir = self.root.path().join(BUCKET).join(PREFIX);
        if let Ok(rd) = std::fs::read_dir(dir) {
            for e in rd.flatten() {
                let n = e.file_name().to_string_lossy().into_owned();
                if n.len() == 64 && n.bytes().all(|b| b.is_ascii_hexdigit()) && e.path().is_file() {
                    out.insert(n);
                }
            }
        }
        out
    }

    pub fn config(&self) -> ObjectsConfig {
        ObjectsConfig {
            endpoint: Some(self.endpoint()),
            credentials: Some((KEY_ID.into(), SECRET.into())),
            timeout: Duration::from_secs(5),
            ..ObjectsConfig::new(format!("s3://{BUCKET}/{PREFIX}"))
        }
    }
}

impl Drop for S3 {
    fn drop(&mut self) {
        self.stop();
    }
}
