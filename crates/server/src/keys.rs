//! API keys: `fbk_` + 32 random hex bytes, given to the user once; only the
//! SHA-256 of a key is stored (`<home>/server/keys.db`, SQLite), with its tenant,
//! its limits (requests/s, sessions, disk, concurrent execs, CPU seconds per
//! hour, longest timeout; NULL = unlimited, see [`KeyLimits`]), whether it
//! is an admin key (may read `/metrics`) and its egress policy layer (JSON;
//! NULL = the server's policy alone).

use forkbox_runtime::NetPolicy;

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

use anyhow::Context;
use rusqlite::{params, Connection, OptionalExtension};
use sha2::{Digest, Sha256};

use crate::quota::{CpuBudget, KeyLimits, RateLimiter};

pub fn keys_path(home: &Path) -> PathBuf {
    home.join("server").join("keys.db")
}

/// Columns added after the first release, added in place to older keys.db files.
const LIMIT_COLUMNS: &[(&str, &str)] = &[
    ("rate_limit", "INTEGER"),
    ("max_sessions", "INTEGER"),
    ("max_disk_mb", "INTEGER"),
    ("max_concurrency", "INTEGER"),
    ("cpu_seconds_per_hour", "INTEGER"),
    ("max_timeout_seconds", "INTEGER"),
    ("admin", "INTEGER NOT NULL DEFAULT 0"),
    ("egress", "TEXT"),
];

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
    migrate(&conn).with_context(|| format!("migrating {}", path.display()))?;
    Ok(conn)
}

fn migrate(conn: &Connection) -> anyhow::Result<()> {
    let have: Vec<String> = conn
        .prepare("SELECT name FROM pragma_table_info('api_keys')")?
        .query_map([], |r| r.get(0))?
        .collect::<Result<_, _>>()?;
    for (col, ty) in LIMIT_COLUMNS {
        if !have.iter().any(|h| h == col) {
            // Two processes may race here; a duplicate column from the other one is fine.
            match conn.execute_batch(&format!("ALTER TABLE api_keys ADD COLUMN {col} {ty}")) {
                Ok(()) => {}
                Err(e) if e.to_string().contains("duplicate column") => {}
                Err(e) => return Err(e.into()),
            }
        }
    }
    Ok(())
}

pub fn hash_key(key: &str) -> String {
    hex::encode(Sha256::digest(key.as_bytes()))
}

fn random_hex(n: usize) -> anyhow::Result<String> {
    use std::io::Read;
    let mut b = vec![0u8; n];
    // The kernel's CSPRNG (what getrandom(2) reads), without unsafe code in this crate.
    std::fs::File::open("/dev/urandom")
        .and_then(|mut f| f.read_exact(&mut b))
        .map_err(|e| anyhow::anyhow!("reading /dev/urandom: {e}"))?;
    Ok(hex::encode(b))
}

fn valid_tenant(tenant: &str) -> bool {
    !tenant.is_empty() && tenant.len() <= 64 && tenant.bytes().all(|c| c.is_ascii_alphanumeric() || b"-_.".contains(&c))
}

/// Create an API key for `tenant` (letters, digits, `-_.`; at most 64) with
/// the default limits ([`KeyLimits::defaults`]) and return it.
/// The key itself is not stored: show it to the user now. Safe while a server runs.
pub fn create_key(home: &Path, tenant: &str) -> anyhow::Result<String> {
    create_key_with(home, tenant, &KeyLimits::defaults())
}

/// [`create_key`] with per-key limits.
pub fn create_key_with(home: &Path, tenant: &str, limits: &KeyLimits) -> anyhow::Result<String> {
    create_key_full(home, tenant, limits, false)
}

/// [`create_key_with`], as an admin key or not (admin keys may read `/metrics`).
pub fn create_key_full(home: &Path, tenant: &str, limits: &KeyLimits, admin: bool) -> anyhow::Result<String> {
    anyhow::ensure!(
        valid_tenant(tenant),
        "invalid tenant name {tenant:?} (letters, digits, '-', '_', '.'; at most 64)"
    );
    for (name, v) in [
        ("rate limit", limits.rate_limit),
        ("max sessions", limits.max_sessions),
        ("max disk MiB", limits.max_disk_mb),
        ("CPU seconds per hour", limits.cpu_seconds_per_hour),
        ("max timeout seconds", limits.max_timeout_seconds),
    ] {
        anyhow::ensure!(v.is_none_or(|v| v > 0 && v <= i64::MAX as u64), "{name} must be a positive number");
    }
    anyhow::ensure!(limits.max_concurrency.is_none_or(|v| v <= 1 << 20), "max concurrency is too large");
    anyhow::ensure!(limits.rate_limit.is_none_or(|r| r <= u32::MAX as u64), "rate limit is too large");
    if let Some(p) = &limits.egress {
        anyhow::ensure!(p.allow.len() <= 256 && p.deny.len() <= 256, "at most 256 egress rules each");
    }
    let egress = limits.egress.as_ref().map(serde_json::to_string).transpose()?;
    let key = format!("fbk_{}", random_hex(32)?);
    let conn = open_db(home)?;
    let as_i64 = |v: Option<u64>| v.map(|v| v as i64);
    conn.execute(
        "INSERT INTO api_keys (hash, tenant, created_ms, rate_limit, max_sessions, max_disk_mb, \
         max_concurrency, cpu_seconds_per_hour, max_timeout_seconds, admin, egress) \
         VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8, ?9, ?10, ?11)",
        params![
            hash_key(&key),
            tenant,
            now_ms(),
            as_i64(limits.rate_limit),
            as_i64(limits.max_sessions),
            as_i64(limits.max_disk_mb),
            as_i64(limits.max_concurrency),
            as_i64(limits.cpu_seconds_per_hour),
            as_i64(limits.max_timeout_seconds),
            admin as i64,
            egress
        ],
    )?;
    Ok(key)
}

/// Delete `key` (if it exists). Safe while a server runs: a server that cached it keeps it until restart.
pub fn delete_key(home: &Path, key: &str) -> anyhow::Result<bool> {
    let conn = open_db(home)?;
    Ok(conn.execute("DELETE FROM api_keys WHERE hash = ?1", params![hash_key(key)])? > 0)
}

/// How many keys exist.
pub fn count_keys(home: &Path) -> anyhow::Result<u64> {
    let conn = open_db(home)?;
    Ok(conn.query_row("SELECT COUNT(*) FROM api_keys", [], |r| r.get::<_, i64>(0))? as u64)
}

/// What a known key stands for. Its rate limiter lives as long as the server
/// caches the key (the process), so the bucket is per key, in memory.
pub struct KeyInfo {
    pub tenant: String,
    pub limits: KeyLimits,
    pub limiter: Option<RateLimiter>,
    /// The key's CPU-seconds bucket (in memory, like the rate limiter).
    pub cpu: Option<CpuBudget>,
    /// Execs of this key running at once (see `KeyLimits::max_concurrency`),
    /// created by the server on first use with its default share.
    pub running: std::sync::OnceLock<Arc<tokio::sync::Semaphore>>,
    /// Requests of this key waiting for its permits.
    pub queued: std::sync::atomic::AtomicUsize,
    /// May read `/metrics`.
    pub admin: bool,
}

/// The server's view of the keys: looks up hashes (keys created while it runs work at once).
pub struct KeyStore {
    conn: Mutex<Connection>,
    cache: Mutex<HashMap<String, Arc<KeyInfo>>>,
}

impl KeyStore {
    pub fn open(home: &Path) -> anyhow::Result<KeyStore> {
        Ok(KeyStore { conn: Mutex::new(open_db(home)?), cache: Mutex::new(HashMap::new()) })
    }

    /// A key seen before (no I/O: safe on async threads).
    pub fn cached(&self, key: &str) -> Option<Arc<KeyInfo>> {
        self.cache.lock().unwrap_or_else(|e| e.into_inner()).get(&hash_key(key)).cloned()
    }

    /// A key's tenant and limits, if the key is known (may query SQLite).
    pub fn lookup(&self, key: &str) -> anyhow::Result<Option<Arc<KeyInfo>>> {
        let h = hash_key(key);
        if let Some(t) = self.cache.lock().unwrap_or_else(|e| e.into_inner()).get(&h) {
            return Ok(Some(t.clone()));
        }
        let conn = self.conn.lock().unwrap_or_else(|e| e.into_inner());
        type Limits = [Option<i64>; 6];
        let row: Option<(String, Limits, bool, Option<String>)> = conn
            .query_row(
                "SELECT tenant, rate_limit, max_sessions, max_disk_mb, max_concurrency, cpu_seconds_per_hour, \
                 max_timeout_seconds, admin, egress FROM api_keys WHERE hash = ?1",
                params![h],
                |r| {
                    let limits = [r.get(1)?, r.get(2)?, r.get(3)?, r.get(4)?, r.get(5)?, r.get(6)?];
                    Ok((r.get(0)?, limits, r.get::<_, i64>(7)? != 0, r.get(8)?))
                },
            )
            .optional()?;
        let Some((tenant, [rate, sessions, disk, conc, cpu, timeout], admin, egress)) = row else { return Ok(None) };
        // A policy that does not parse (a hand-edited row) fails closed: no network for the key.
        let egress = egress.map(|j| {
            serde_json::from_str::<NetPolicy>(&j).unwrap_or_else(|e| {
                tracing::warn!(
                    "keys.db: the egress policy of a key of tenant {tenant} does not parse ({e}): no network"
                );
                NetPolicy::none()
            })
        });
        let positive = |v: Option<i64>| v.filter(|v| *v > 0).map(|v| v as u64);
        let limits = KeyLimits {
            rate_limit: positive(rate),
            max_sessions: positive(sessions),
            max_disk_mb: positive(disk),
            max_concurrency: conc.filter(|v| *v >= 0).map(|v| v as u64),
            cpu_seconds_per_hour: positive(cpu),
            max_timeout_seconds: positive(timeout),
            egress,
        };
        let info = Arc::new(KeyInfo {
            tenant,
            limiter: limits.rate_limit.and_then(RateLimiter::per_second),
            cpu: limits.cpu_seconds_per_hour.map(CpuBudget::new),
            running: std::sync::OnceLock::new(),
            queued: Default::default(),
            admin,
            limits,
        });
        let mut cache = self.cache.lock().unwrap_or_else(|e| e.into_inner());
        Ok(Some(cache.entry(h).or_insert(info).clone()))
    }

    /// The tenant of a key, if the key is known (may query SQLite).
    pub fn tenant(&self, key: &str) -> anyhow::Result<Option<String>> {
        Ok(self.lookup(key)?.map(|i| i.tenant.clone()))
    }
}

fn now_ms() -> i64 {
    std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_millis() as i64)
}
