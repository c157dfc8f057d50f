//! API keys: `fbk_` + 32 random hex bytes, given to the user once; only the
//! SHA-256 of a key is stored (`<home>/server/keys.db`, SQLite), with its tenant.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::Mutex;

use anyhow::Context;
use rusqlite::{params, Connection, OptionalExtension};
use sha2::{Digest, Sha256};

pub fn keys_path(home: &Path) -> PathBuf {
    home.join("server").join("keys.db")
}

fn open_db(home: &Path) -> anyhow::Result<Connection> {
    let path = keys_path(home);
    if let Some(dir) = path.parent() {
        std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
    }
    let conn = Connection::open(&path).with_context(|| format!("opening {}", path.display()))?;
    conn.busy_timeout(std::time::Duration::from_secs(5))?;
    conn.execute_batch(
        "CREATE TABLE IF NOT EXISTS api_keys (
             hash TEXT PRIMARY KEY,
             tenant TEXT NOT NULL,
             created_ms INTEGER NOT NULL
         );",
    )?;
    Ok(conn)
}

pub fn hash_key(key: &str) -> String {
    hex::encode(Sha256::digest(key.as_bytes()))
}

fn random_hex(n: usize) -> anyhow::Result<String> {
    let mut b = vec![0u8; n];
    // SAFETY: getrandom into a local buffer of the given length.
    let got = unsafe { libc::getrandom(b.as_mut_ptr() as *mut libc::c_void, b.len(), 0) };
    anyhow::ensure!(got == n as isize, "getrandom failed: {}", std::io::Error::last_os_error());
    Ok(hex::encode(b))
}

fn valid_tenant(tenant: &str) -> bool {
    !tenant.is_empty() && tenant.len() <= 64 && tenant.bytes().all(|c| c.is_ascii_alphanumeric() || b"-_.".contains(&c))
}

/// Create an API key for `tenant` (letters, digits, `-_.`; at most 64) and return it.
/// The key itself is not stored: show it to the user now. Safe while a server runs.
pub fn create_key(home: &Path, tenant: &str) -> anyhow::Result<String> {
    anyhow::ensure!(valid_tenant(tenant), "invalid tenant name {tenant:?} (letters, digits, '-', '_', '.'; at most 64)");
    let key = format!("fbk_{}", random_hex(32)?);
    let conn = open_db(home)?;
    conn.execute(
        "INSERT INTO api_keys (hash, tenant, created_ms) VALUES (?1, ?2, ?3)",
        params![hash_key(&key), tenant, forkbox_sessions::manager::now_ms()],
    )?;
    Ok(key)
}

/// How many keys exist.
pub fn count_keys(home: &Path) -> anyhow::Result<u64> {
    let conn = open_db(home)?;
    Ok(conn.query_row("SELECT COUNT(*) FROM api_keys", [], |r| r.get::<_, i64>(0))? as u64)
}

/// The server's view of the keys: looks up hashes (keys created while it runs work at once).
pub struct KeyStore {
    conn: Mutex<Connection>,
    cache: Mutex<HashMap<String, String>>,
}

impl KeyStore {
    pub fn open(home: &Path) -> anyhow::Result<KeyStore> {
        Ok(KeyStore { conn: Mutex::new(open_db(home)?), cache: Mutex::new(HashMap::new()) })
    }

    /// The tenant of a key seen before (no I/O: safe on async threads).
    pub fn cached(&self, key: &str) -> Option<String> {
        self.cache.lock().unwrap_or_else(|e| e.into_inner()).get(&hash_key(key)).cloned()
    }

    /// The tenant of a key, if the key is known (may query SQLite).
    pub fn tenant(&self, key: &str) -> anyhow::Result<Option<String>> {
        let h = hash_key(key);
        if let Some(t) = self.cache.lock().unwrap_or_else(|e| e.into_inner()).get(&h) {
            return Ok(Some(t.clone()));
        }
        let conn = self.conn.lock().unwrap_or_else(|e| e.into_inner());
        let t: Option<String> =
            conn.query_row("SELECT tenant FROM api_keys WHERE hash = ?1", params![h], |r| r.get(0)).optional()?;
        if let Some(t) = &t {
            self.cache.lock().unwrap_or_else(|e| e.into_inner()).insert(h, t.clone());
        }
        Ok(t)
    }
}
