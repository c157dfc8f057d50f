//! API keys: `fbk_` + 32 random hex bytes, given to the user once; only the
//! SHA-256 of a key is stored, with its tenant, its limits (requests/s,
//! sessions, disk, concurrent execs, CPU seconds per hour, longest timeout;
//! NULL = unlimited, see [`KeyLimits`]), whether it is an admin key (may read
//! `/metrics` and the admin routes) and its egress policy layer (JSON; NULL =
//! the server's policy alone) and its secrets (JSON, each value sealed with
//! the server's secrets key; NULL = none). The records live where the session metadata
//! does ([`KeyDb`]): `<home>/server/keys.db`, or the PostgreSQL database of
//! `--database` (shared by the nodes of a cluster).

use forkbox_runtime::keys::{KeyDb, KeyRecord};
use forkbox_runtime::net_secrets::SealedSecret;
use forkbox_runtime::NetPolicy;

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

use sha2::{Digest, Sha256};

use crate::quota::{CpuBudget, KeyLimits, RateLimiter};

pub use forkbox_runtime::keys::keys_path;

pub fn hash_key(key: &str) -> String {
    hex::encode(Sha256::digest(key.as_bytes()))
}

/// `n` bytes of the kernel's CSPRNG (getrandom(2)) as hex: API keys, signing secrets, E2B ids.
pub(crate) fn random_hex(n: usize) -> anyhow::Result<String> {
    forkbox_runtime::random_hex(n).map_err(|e| anyhow::anyhow!("no host entropy: {e:?}"))
}

pub(crate) fn valid_tenant(tenant: &str) -> bool {
    !tenant.is_empty() && tenant.len() <= 64 && tenant.bytes().all(|c| c.is_ascii_alphanumeric() || b"-_.".contains(&c))
}

/// Where keys are: a data directory (its `keys.db`) or an open [`KeyDb`]
/// (the shared database of a cluster).
pub trait KeysAt {
    fn with_db<T>(self, f: impl FnOnce(&KeyDb) -> anyhow::Result<T>) -> anyhow::Result<T>;
}

impl KeysAt for &KeyDb {
    fn with_db<T>(self, f: impl FnOnce(&KeyDb) -> anyhow::Result<T>) -> anyhow::Result<T> {
        f(self)
    }
}

impl KeysAt for &Path {
    fn with_db<T>(self, f: impl FnOnce(&KeyDb) -> anyhow::Result<T>) -> anyhow::Result<T> {
        f(&KeyDb::open(self, None)?)
    }
}

impl KeysAt for &PathBuf {
    fn with_db<T>(self, f: impl FnOnce(&KeyDb) -> anyhow::Result<T>) -> anyhow::Result<T> {
        self.as_path().with_db(f)
    }
}

/// Create an API key for `tenant` (letters, digits, `-_.`; at most 64) with
/// the default limits ([`KeyLimits::defaults`]) and return it.
/// The key itself is not stored: show it to the user now. Safe while a server runs.
pub fn create_key(at: impl KeysAt, tenant: &str) -> anyhow::Result<String> {
    create_key_with(at, tenant, &KeyLimits::defaults())
}

/// [`create_key`] with per-key limits.
pub fn create_key_with(at: impl KeysAt, tenant: &str, limits: &KeyLimits) -> anyhow::Result<String> {
    create_key_full(at, tenant, limits, false)
}

/// [`create_key_with`], as an admin key or not (admin keys may read `/metrics`).
pub fn create_key_full(at: impl KeysAt, tenant: &str, limits: &KeyLimits, admin: bool) -> anyhow::Result<String> {
    create_key_with_secrets(at, tenant, limits, admin, &[])
}

/// Whether `limits` may be stored (what `forkbox key create` and `POST
/// /v1/admin/keys` refuse, and why).
pub fn check_limits(limits: &KeyLimits) -> Result<(), String> {
    for (name, v) in [
        ("rate_limit", limits.rate_limit),
        ("max_sessions", limits.max_sessions),
        ("max_disk_mb", limits.max_disk_mb),
        ("cpu_seconds_per_hour", limits.cpu_seconds_per_hour),
        ("max_timeout_seconds", limits.max_timeout_seconds),
    ] {
        if v.is_some_and(|v| v == 0 || v > i64::MAX as u64) {
            return Err(format!("{name} must be a positive number"));
        }
    }
    if limits.max_concurrency.is_some_and(|v| v > 1 << 20) {
        return Err("max_concurrency is too large (at most 1048576; 0: every exec slot)".into());
    }
    if limits.rate_limit.is_some_and(|r| r > u64::from(u32::MAX)) {
        return Err("rate_limit is too large (at most 4294967295)".into());
    }
    if let Some(p) = &limits.egress {
        if p.allow.len() > 256 || p.deny.len() > 256 {
            return Err("at most 256 egress rules each".into());
        }
    }
    Ok(())
}

/// The JSON a key's sealed secrets are stored as (None: none).
fn secrets_json(secrets: &[SealedSecret]) -> anyhow::Result<Option<String>> {
    anyhow::ensure!(
        secrets.len() <= forkbox_runtime::net_secrets::SECRETS_MAX,
        "at most {} secrets per key",
        forkbox_runtime::net_secrets::SECRETS_MAX
    );
    Ok(if secrets.is_empty() { None } else { Some(serde_json::to_string(secrets)?) })
}

/// A key's stored secrets; a column that does not parse (a hand-edited row) reads as none.
fn secrets_of(tenant: &str, json: Option<String>) -> Vec<SealedSecret> {
    json.map(|j| {
        serde_json::from_str(&j).unwrap_or_else(|e| {
            tracing::warn!("the secrets of a key of tenant {tenant} do not parse ({e}): none");
            Vec::new()
        })
    })
    .unwrap_or_default()
}

/// [`create_key_full`] with secrets (sealed with the server's key: see
/// [`crate::schema::seal_secrets`]) that every sandbox of the key gets.
pub fn create_key_with_secrets(
    at: impl KeysAt,
    tenant: &str,
    limits: &KeyLimits,
    admin: bool,
    secrets: &[SealedSecret],
) -> anyhow::Result<String> {
    anyhow::ensure!(
        valid_tenant(tenant),
        "invalid tenant name {tenant:?} (letters, digits, '-', '_', '.'; at most 64)"
    );
    check_limits(limits).map_err(anyhow::Error::msg)?;
    let egress = limits.egress.as_ref().map(serde_json::to_string).transpose()?;
    let secrets = secrets_json(secrets)?;
    let key = format!("fbk_{}", random_hex(32)?);
    // (Checked above: every limit fits in an i64.)
    let as_i64 = |v: Option<u64>| v.map(|v| v as i64);
    let rec = KeyRecord {
        hash: hash_key(&key),
        tenant: tenant.to_string(),
        created_ms: now_ms(),
        rate_limit: as_i64(limits.rate_limit),
        max_sessions: as_i64(limits.max_sessions),
        max_disk_mb: as_i64(limits.max_disk_mb),
        max_concurrency: as_i64(limits.max_concurrency),
        cpu_seconds_per_hour: as_i64(limits.cpu_seconds_per_hour),
        max_timeout_seconds: as_i64(limits.max_timeout_seconds),
        admin,
        egress,
        secrets,
    };
    at.with_db(|db| Ok(db.insert(&rec)?))?;
    Ok(key)
}

/// Delete `key` (if it exists). Safe while a server runs: a server that
/// cached it drops it within [`RECHECK_EVERY`] (see [`KeyStore::recheck`]).
pub fn delete_key(at: impl KeysAt, key: &str) -> anyhow::Result<bool> {
    at.with_db(|db| Ok(db.delete(&hash_key(key))?))
}

/// How often a server checks the keys it has cached against the store: a
/// key deleted by `forkbox key revoke` or by another node of a cluster stops
/// working within this, and secrets changed there reach new sandboxes.
pub const RECHECK_EVERY: std::time::Duration = std::time::Duration::from_secs(1);

/// How many keys exist.
pub fn count_keys(at: impl KeysAt) -> anyhow::Result<u64> {
    at.with_db(|db| Ok(db.count()?))
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
    /// File uploads of this key in progress (see `ServerConfig::key_uploads`).
    pub uploads: std::sync::atomic::AtomicUsize,
    /// Package installs of this key in progress (see `ServerConfig::key_installs`).
    pub installs: std::sync::atomic::AtomicUsize,
    /// May read `/metrics`.
    pub admin: bool,
    /// SHA-256 of the key (hex): how the admin routes name it.
    pub id: String,
    /// Its secrets, sealed: every new sandbox of the key gets them. Replaced
    /// in place when they are changed through this server.
    pub secrets: std::sync::RwLock<Arc<Vec<SealedSecret>>>,
}

impl KeyInfo {
    /// The key's secrets now.
    pub fn secrets(&self) -> Arc<Vec<SealedSecret>> {
        self.secrets.read().unwrap_or_else(|e| e.into_inner()).clone()
    }
}

/// The server's view of the keys: looks up hashes (keys created while it runs work at once).
pub struct KeyStore {
    db: Arc<KeyDb>,
    cache: Mutex<HashMap<String, Arc<KeyInfo>>>,
}

impl KeyStore {
    pub fn new(db: Arc<KeyDb>) -> KeyStore {
        KeyStore { db, cache: Mutex::new(HashMap::new()) }
    }

    /// Where the records are (to create or delete keys beside the cache).
    pub fn db(&self) -> &KeyDb {
        &self.db
    }

    /// A key seen before (no I/O: safe on async threads).
    pub fn cached(&self, key: &str) -> Option<Arc<KeyInfo>> {
        self.cache.lock().unwrap_or_else(|e| e.into_inner()).get(&hash_key(key)).cloned()
    }

    /// A key's tenant and limits, if the key is known (may query the database).
    pub fn lookup(&self, key: &str) -> anyhow::Result<Option<Arc<KeyInfo>>> {
        let h = hash_key(key);
        if let Some(t) = self.cache.lock().unwrap_or_else(|e| e.into_inner()).get(&h) {
            return Ok(Some(t.clone()));
        }
        let Some(rec) = self.db.get(&h)? else { return Ok(None) };
        let KeyRecord {
            tenant,
            egress,
            admin,
            secrets,
            rate_limit: rate,
            max_sessions: sessions,
            max_disk_mb: disk,
            max_concurrency: conc,
            cpu_seconds_per_hour: cpu,
            max_timeout_seconds: timeout,
            ..
        } = rec;
        // A policy that does not parse (a hand-edited row) fails closed: no network for the key.
        let egress = egress.map(|j| {
            serde_json::from_str::<NetPolicy>(&j).unwrap_or_else(|e| {
                tracing::warn!("the egress policy of a key of tenant {tenant} does not parse ({e}): no network");
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
        let secrets = std::sync::RwLock::new(Arc::new(secrets_of(&tenant, secrets)));
        let info = Arc::new(KeyInfo {
            tenant,
            limiter: limits.rate_limit.and_then(RateLimiter::per_second),
            cpu: limits.cpu_seconds_per_hour.map(CpuBudget::new),
            running: std::sync::OnceLock::new(),
            queued: Default::default(),
            uploads: Default::default(),
            installs: Default::default(),
            admin,
            secrets,
            id: h.clone(),
            limits,
        });
        let mut cache = self.cache.lock().unwrap_or_else(|e| e.into_inner());
        Ok(Some(cache.entry(h).or_insert(info).clone()))
    }

    /// Replace the secrets of the key whose hash is `id` (the record and, if
    /// this server has it cached, its cache entry: new sandboxes of the key
    /// get them at once). Its record, or None if there is no such key.
    pub fn set_secrets(&self, id: &str, secrets: Vec<SealedSecret>) -> anyhow::Result<Option<KeyRecord>> {
        let json = secrets_json(&secrets)?;
        if !self.db.set_secrets(id, json.as_deref())? {
            return Ok(None);
        }
        let rec = self.db.get(id)?;
        if let Some(info) = self.cache.lock().unwrap_or_else(|e| e.into_inner()).get(id) {
            *info.secrets.write().unwrap_or_else(|e| e.into_inner()) = Arc::new(secrets);
        }
        Ok(rec)
    }

    /// Delete the key whose hash is `id` (its record and this server's cache
    /// entry: it stops working here at once; see [`KeyStore::recheck`] for
    /// the other servers on the store). False if there was no such key.
    pub fn revoke(&self, id: &str) -> anyhow::Result<bool> {
        let gone = self.db.delete(id)?;
        self.cache.lock().unwrap_or_else(|e| e.into_inner()).remove(id);
        Ok(gone)
    }

    /// Check the cached keys against the store (every [`RECHECK_EVERY`]): a
    /// key that is no longer there is dropped (its next request is 401), the
    /// secrets of the others are refreshed. Blocking: a query per 500 keys.
    pub fn recheck(&self) -> anyhow::Result<()> {
        let cached: Vec<String> = self.cache.lock().unwrap_or_else(|e| e.into_inner()).keys().cloned().collect();
        for chunk in cached.chunks(500) {
            let present: HashMap<String, Option<String>> = self.db.present(chunk)?.into_iter().collect();
            let mut cache = self.cache.lock().unwrap_or_else(|e| e.into_inner());
            for id in chunk {
                match present.get(id) {
                    None => {
                        if cache.remove(id).is_some() {
                            tracing::info!("API key {} was revoked: dropped", &id[..id.len().min(12)]);
                        }
                    }
                    Some(json) => {
                        if let Some(info) = cache.get(id) {
                            let secrets = secrets_of(&info.tenant, json.clone());
                            let mut now = info.secrets.write().unwrap_or_else(|e| e.into_inner());
                            if **now != secrets {
                                *now = Arc::new(secrets);
                            }
                        }
                    }
                }
            }
        }
        Ok(())
    }

    /// The tenant of a key, if the key is known (may query the database).
    pub fn tenant(&self, key: &str) -> anyhow::Result<Option<String>> {
        Ok(self.lookup(key)?.map(|i| i.tenant.clone()))
    }
}

fn now_ms() -> i64 {
    std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_millis() as i64)
}
