//! A real PostgreSQL server for the metadata-store tests: Debian's
//! `postgresql` (scripts/test installs it), one private server per test on a
//! loopback port, its data directory copied from a cluster made once by
//! `initdb` (kept under the temp directory, reused by later runs). Runs as the
//! `postgres` user (the server refuses root). A missing installation is a
//! failure with a message, never a skip.

use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

/// The user the tests connect as (a superuser); `trust` authentication on loopback.
pub const USER: &str = "forkbox";

/// The directory of PostgreSQL's server binaries: `$FORKBOX_PG_BIN`, else the
/// newest `/usr/lib/postgresql/<version>/bin` that has `postgres`.
pub fn bin_dir() -> PathBuf {
    if let Some(p) = std::env::var_os("FORKBOX_PG_BIN") {
        return PathBuf::from(p);
    }
    let mut found: Vec<(u32, PathBuf)> = std::fs::read_dir("/usr/lib/postgresql")
        .into_iter()
        .flatten()
        .flatten()
        .filter_map(|e| {
            let v = e.file_name().to_string_lossy().parse::<u32>().ok()?;
            let bin = e.path().join("bin");
            bin.join("postgres").is_file().then_some((v, bin))
        })
        .collect();
    found.sort();
    match found.pop() {
        Some((_, bin)) => bin,
        None => panic!(
            "PostgreSQL is missing: no /usr/lib/postgresql/<version>/bin/postgres \
             (scripts/test installs Debian's postgresql; or set FORKBOX_PG_BIN)"
        ),
    }
}

/// uid and gid of the `postgres` user.
fn postgres_user() -> (u32, u32) {
    let name = c"postgres";
    // SAFETY: getpwnam with a NUL-terminated name; the result is read at once.
    let pw = unsafe { libc::getpwnam(name.as_ptr()) };
    assert!(!pw.is_null(), "no `postgres` user (Debian's postgresql package creates it)");
    // SAFETY: non-null passwd entry from getpwnam.
    unsafe { ((*pw).pw_uid, (*pw).pw_gid) }
}

fn chown(path: &Path, (uid, gid): (u32, u32)) {
    std::os::unix::fs::chown(path, Some(uid), Some(gid)).unwrap_or_else(|e| panic!("chown {}: {e}", path.display()));
}

/// A cluster made by `initdb` once, copied for every server.
fn template(bin: &Path, user: (u32, u32)) -> PathBuf {
    let version =
        bin.parent().and_then(|p| p.file_name()).map(|n| n.to_string_lossy().into_owned()).unwrap_or_default();
    let dir = std::env::temp_dir().join(format!("forkbox-pg-template-{version}"));
    if dir.join("PG_VERSION").is_file() {
        return dir;
    }
    let work = std::env::temp_dir().join(format!("forkbox-pg-template-{version}.{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&work);
    std::fs::create_dir_all(&work).expect("template directory");
    chown(&work, user);
    let out = Command::new(bin.join("initdb"))
        .args(["--no-sync", "--auth=trust", "--encoding=UTF8", "--locale=C", "-U", USER, "-D"])
        .arg(&work)
        .uid(user.0)
        .gid(user.1)
        .output()
        .expect("running initdb");
    assert!(out.status.success(), "initdb failed: {}", String::from_utf8_lossy(&out.stderr));
    // Another test may have made it meanwhile: either copy will do.
    if std::fs::rename(&work, &dir).is_err() {
        let _ = std::fs::remove_dir_all(&work);
    }
    dir
}

/// A private PostgreSQL server on a loopback port; stopped when dropped.
pub struct Postgres {
    child: Option<std::process::Child>,
    pub port: u16,
    dir: tempfile::TempDir,
    bin: PathBuf,
    user: (u32, u32),
}

impl Postgres {
    pub fn start() -> Postgres {
        let bin = bin_dir();
        let user = postgres_user();
        let template = template(&bin, user);
        let dir = tempfile::tempdir().expect("temp dir");
        chown(dir.path(), user);
        let status = Command::new("cp")
            .arg("-a")
            .arg(&template)
            .arg(dir.path().join("data"))
            .status()
            .expect("copying the template cluster");
        assert!(status.success(), "copying the template cluster failed");
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .and_then(|l| l.local_addr())
            .expect("a free loopback port")
            .port();
        let mut pg = Postgres { child: None, port, dir, bin, user };
        pg.restart();
        pg
    }

    /// `postgres://forkbox@127.0.0.1:PORT/postgres` (the database initdb makes).
    pub fn url(&self) -> String {
        format!("postgres://{USER}@127.0.0.1:{}/postgres", self.port)
    }

    /// (Re)start the server on the same port and data; returns once it accepts connections.
    pub fn restart(&mut self) {
        let data = self.dir.path().join("data");
        let child = Command::new(self.bin.join("postgres"))
            .arg("-D")
            .arg(&data)
            .args(["-p", &self.port.to_string(), "-c", "listen_addresses=127.0.0.1", "-k"])
            .arg(self.dir.path())
            // No fsync: a test survives the server's crash (`stop`), not the machine's.
            // (Commits stay synchronous: a commit's WAL is written before it returns.)
            .args(["-c", "fsync=off", "-c", "full_page_writes=off"])
            .uid(self.user.0)
            .gid(self.user.1)
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("starting postgres");
        self.child = Some(child);
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            let ready = Command::new(self.bin.join("pg_isready"))
                .args(["-q", "-h", "127.0.0.1", "-p", &self.port.to_string(), "-U", USER])
                .status()
                .is_ok_and(|s| s.success());
            if ready {
                return;
            }
            if let Some(Ok(Some(status))) = self.child.as_mut().map(|c| c.try_wait()) {
                panic!("postgres exited at start: {status}");
            }
            assert!(Instant::now() < deadline, "postgres did not become ready on port {}", self.port);
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    /// Immediate shutdown (SIGQUIT: the server and its backends stop at once).
    pub fn stop(&mut self) {
        if let Some(mut c) = self.child.take() {
            if let Ok(pid) = i32::try_from(c.id()) {
                // SAFETY: signalling our own child.
                unsafe { libc::kill(pid, libc::SIGQUIT) };
            }
            let deadline = Instant::now() + Duration::from_secs(10);
            while matches!(c.try_wait(), Ok(None)) && Instant::now() < deadline {
                std::thread::sleep(Duration::from_millis(20));
            }
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

impl Drop for Postgres {
    fn drop(&mut self) {
        self.stop();
    }
}
