//! Checkpoint files in an S3-compatible object store (`--objects s3://bucket/prefix`).
//!
//! Every file of a checkpoint (layer, state, pack, flat layer) is uploaded as
//! `<prefix>/<sha256 of its contents>` before the checkpoint's metadata
//! commits, and the `objects` table of the store (name in the layers
//! directory -> SHA-256) is committed in the same transaction: a committed
//! checkpoint is always readable from the bucket. The layers directory becomes
//! a cache in front of the bucket: a file a resume needs that is not there is
//! fetched (and its hash verified) first; files that are uploaded and not in
//! use may be removed, least recently used first, once the directory holds
//! more than the bound (`--object-cache-mb`).
//!
//! The object store's client is async: it runs on a small private tokio
//! runtime owned by [`Objects`]; callers (exec threads, blocking code) wait on
//! a channel, so calling from inside another runtime is fine too.
//!
//! Endpoint and credentials come from the usual environment: `AWS_ENDPOINT_URL`,
//! `AWS_ACCESS_KEY_ID`, `AWS_SECRET_ACCESS_KEY`, `AWS_REGION` (and the other
//! `AWS_*` keys `object_store` reads). Plain http is allowed for a loopback
//! endpoint (or with `AWS_ALLOW_HTTP=true`).

use std::collections::HashMap;
use std::future::Future;
use std::io::{Read, Write};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use futures_util::StreamExt;
use object_store::aws::AmazonS3Builder;
use object_store::path::Path as ObjectPath;
use object_store::{BackoffConfig, ClientOptions, ObjectStore, ObjectStoreExt, PutPayload, RetryConfig};
use sha2::{Digest, Sha256};

use crate::store::{Store, StoreError, StoredObject};

/// Where checkpoint files go besides the local directory.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ObjectsConfig {
    /// `s3://bucket/prefix` (the prefix may be empty).
    pub url: String,
    /// At most this many bytes of checkpoint files in the local directory
    /// (files in use or not uploaded yet excepted); None: no bound.
    pub cache_bytes: Option<u64>,
    /// Time limit of one request to the object store (an upload of a part, a download).
    pub timeout: Duration,
    /// The endpoint (`http://127.0.0.1:9000`); None: `AWS_ENDPOINT_URL` (or AWS's).
    pub endpoint: Option<String>,
    /// Credentials (access key id, secret access key); None: `AWS_ACCESS_KEY_ID`/`AWS_SECRET_ACCESS_KEY`.
    pub credentials: Option<(String, String)>,
}

impl ObjectsConfig {
    pub fn new(url: impl Into<String>) -> ObjectsConfig {
        ObjectsConfig {
            url: url.into(),
            cache_bytes: None,
            timeout: DEFAULT_TIMEOUT,
            endpoint: None,
            credentials: None,
        }
    }
}

/// Default [`ObjectsConfig::timeout`].
pub const DEFAULT_TIMEOUT: Duration = Duration::from_secs(30);

/// Numbers the temp files of fetches.
static FETCH_SEQ: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);

/// Files up to this size are uploaded in one request; larger ones in parts of this size.
const PART: usize = 16 << 20;

#[derive(Debug, thiserror::Error)]
pub enum ObjectError {
    /// `--objects` (or the environment) is not usable.
    #[error("object store {url:?}: {why}")]
    Config { url: String, why: String },
    /// A request failed (the store is down, refused it, or the network failed).
    #[error("object store unavailable: {op} {key}: {source}")]
    Unavailable {
        op: &'static str,
        key: String,
        #[source]
        source: object_store::Error,
    },
    #[error("object store unavailable: {op} {key}: no answer within {secs} s")]
    Timeout { op: &'static str, key: String, secs: u64 },
    /// The object of a committed checkpoint's file is not in the bucket.
    #[error("object {key} (checkpoint file {name}) is not in the object store")]
    Missing { key: String, name: String },
    #[error("object {key} (checkpoint file {name}) does not match its SHA-256 ({got}, {bytes} bytes)")]
    Corrupt { key: String, name: String, got: String, bytes: u64 },
    /// Reading or writing a checkpoint file in the local directory.
    #[error("checkpoint file {name}: {what}: {source}")]
    Io {
        what: &'static str,
        name: String,
        #[source]
        source: std::io::Error,
    },
    /// A checkpoint file is only in the object store and none is configured.
    #[error(
        "checkpoint file {0} is in the object store only (not in the local directory): start the server with --objects"
    )]
    NotConfigured(String),
    #[error("object store runtime: {0}")]
    Runtime(String),
    #[error(transparent)]
    Store(#[from] StoreError),
}

impl ObjectError {
    /// The API's error code: the store unreachable is `storage_unavailable`
    /// (503, retry later); anything else (a lost or corrupt object, the local
    /// disk) is `storage_error`.
    pub fn error_code(&self) -> forkbox_api::ErrorCode {
        match self {
            ObjectError::Unavailable { .. } | ObjectError::Timeout { .. } => forkbox_api::ErrorCode::StorageUnavailable,
            _ => forkbox_api::ErrorCode::StorageError,
        }
    }
}

fn io<'a>(what: &'static str, name: &'a str) -> impl FnOnce(std::io::Error) -> ObjectError + 'a {
    move |source| ObjectError::Io { what, name: name.to_string(), source }
}

/// The `s3://bucket/prefix` of `--objects`: (bucket, prefix).
pub fn parse_url(url: &str) -> Result<(String, String), ObjectError> {
    let bad = |why: &str| ObjectError::Config { url: url.to_string(), why: why.to_string() };
    let rest = url.strip_prefix("s3://").ok_or_else(|| bad("must be s3://bucket/prefix"))?;
    let (bucket, prefix) = rest.split_once('/').unwrap_or((rest, ""));
    if bucket.is_empty() || !bucket.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'.') {
        return Err(bad("the bucket name must be letters, digits, '-' and '.'"));
    }
    let prefix = prefix.trim_matches('/');
    if prefix.split('/').any(|s| (s.is_empty() && !prefix.is_empty()) || s == "." || s == "..") {
        return Err(bad("the prefix must not have empty, '.' or '..' segments"));
    }
    Ok((bucket.to_string(), prefix.to_string()))
}

/// Whether `endpoint` (an `AWS_ENDPOINT_URL`) is plain http to a loopback address.
fn is_loopback_http(endpoint: &str) -> bool {
    let Some(rest) = endpoint.strip_prefix("http://") else { return false };
    let authority = rest.split('/').next().unwrap_or("");
    let host = match authority.strip_prefix('[') {
        Some(v6) => v6.split(']').next().unwrap_or(""),
        None => authority.rsplit_once(':').map_or(authority, |(h, _)| h),
    };
    host == "localhost" || host.parse::<std::net::IpAddr>().is_ok_and(|ip| ip.is_loopback())
}

/// The local copies of checkpoint files: their sizes, last use and pins.
#[derive(Default)]
struct Cache {
    /// Files in the layers directory that checkpoints name.
    files: HashMap<String, Entry>,
    total: u64,
    clock: u64,
    /// Files a resume (or an upload) is using now: never removed.
    pins: HashMap<String, u32>,
}

struct Entry {
    bytes: u64,
    used: u64,
    /// In the object store (may be removed locally).
    uploaded: bool,
}

impl Cache {
    fn put(&mut self, name: &str, bytes: u64, uploaded: bool) {
        self.clock += 1;
        let used = self.clock;
        match self.files.get_mut(name) {
            Some(e) => {
                self.total = self.total.saturating_sub(e.bytes).saturating_add(bytes);
                *e = Entry { bytes, used, uploaded: uploaded || e.uploaded };
            }
            None => {
                self.total = self.total.saturating_add(bytes);
                self.files.insert(name.to_string(), Entry { bytes, used, uploaded });
            }
        }
    }

    fn remove(&mut self, name: &str) {
        if let Some(e) = self.files.remove(name) {
            self.total = self.total.saturating_sub(e.bytes);
        }
    }
}

/// Files pinned in the cache until dropped.
pub struct Pinned<'a> {
    objects: &'a Objects,
    names: Vec<String>,
}

impl Drop for Pinned<'_> {
    fn drop(&mut self) {
        let mut c = self.objects.cache.lock().unwrap_or_else(|e| e.into_inner());
        for n in &self.names {
            if let Some(p) = c.pins.get_mut(n) {
                *p -= 1;
                if *p == 0 {
                    c.pins.remove(n);
                }
            }
        }
    }
}

/// The objects of a checkpoint, uploaded and not committed yet: while this
/// lives, gc does not delete objects of the same hashes.
pub struct Uploaded<'a> {
    objects: &'a Objects,
    pub stored: Vec<StoredObject>,
}

impl Drop for Uploaded<'_> {
    fn drop(&mut self) {
        let mut f = self.objects.inflight.lock().unwrap_or_else(|e| e.into_inner());
        for o in &self.stored {
            if let Some(n) = f.get_mut(&o.sha256) {
                *n -= 1;
                if *n == 0 {
                    f.remove(&o.sha256);
                }
            }
        }
    }
}

/// Counters for tests and the bench.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ObjectStats {
    pub uploads: u64,
    pub uploaded_bytes: u64,
    pub fetches: u64,
    pub fetched_bytes: u64,
    pub deletes: u64,
    pub evicted: u64,
    /// Bytes of checkpoint files in the local directory now.
    pub cached_bytes: u64,
}

pub struct Objects {
    rt: tokio::runtime::Runtime,
    store: Arc<dyn ObjectStore>,
    prefix: String,
    dir: PathBuf,
    config: ObjectsConfig,
    cache: Mutex<Cache>,
    /// SHA-256s being uploaded for checkpoints not committed yet (count per hash).
    inflight: Mutex<HashMap<String, usize>>,
    stats: Mutex<ObjectStats>,
}

impl Objects {
    /// The object store of `config`, in front of the layers directory `dir`
    /// (its files scanned: those in `uploaded` may be removed when over the bound).
    pub fn open(config: &ObjectsConfig, dir: &Path, uploaded: &[StoredObject]) -> Result<Objects, ObjectError> {
        let (bucket, prefix) = parse_url(&config.url)?;
        let cfg_err = |why: String| ObjectError::Config { url: config.url.clone(), why };
        let endpoint = config.endpoint.clone().or_else(|| std::env::var("AWS_ENDPOINT_URL").ok()).unwrap_or_default();
        let allow_http = is_loopback_http(&endpoint)
            || std::env::var("AWS_ALLOW_HTTP").is_ok_and(|v| v.eq_ignore_ascii_case("true") || v == "1");
        let client = ClientOptions::new()
            .with_timeout(config.timeout)
            .with_connect_timeout(Duration::from_secs(3))
            .with_allow_http(allow_http);
        // A few quick retries: an exec waits for its upload, so an outage must
        // become a clear error within seconds, not minutes.
        let retry = RetryConfig {
            backoff: BackoffConfig {
                init_backoff: Duration::from_millis(50),
                max_backoff: Duration::from_secs(1),
                base: 2.0,
            },
            max_retries: 2,
            retry_timeout: config.timeout,
        };
        let mut builder =
            AmazonS3Builder::from_env().with_bucket_name(&bucket).with_client_options(client).with_retry(retry);
        if std::env::var_os("AWS_REGION").is_none() && std::env::var_os("AWS_DEFAULT_REGION").is_none() {
            builder = builder.with_region("us-east-1");
        }
        if let Some(e) = &config.endpoint {
            builder = builder.with_endpoint(e);
        }
        if let Some((id, secret)) = &config.credentials {
            builder = builder.with_access_key_id(id).with_secret_access_key(secret);
        }
        let s3 = builder.build().map_err(|e| cfg_err(e.to_string()))?;
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .thread_name("forkbox-objects")
            .enable_all()
            .build()
            .map_err(|e| ObjectError::Runtime(e.to_string()))?;
        let mut cache = Cache::default();
        let up: std::collections::HashSet<&str> = uploaded.iter().map(|o| o.name.as_str()).collect();
        let mut found: Vec<(std::time::SystemTime, String, u64)> = Vec::new();
        if let Ok(rd) = std::fs::read_dir(dir) {
            for e in rd.flatten() {
                let Ok(md) = e.metadata() else { continue };
                if md.is_file() {
                    let t = md.accessed().or_else(|_| md.modified()).unwrap_or(std::time::UNIX_EPOCH);
                    found.push((t, e.file_name().to_string_lossy().into_owned(), md.len()));
                }
            }
        }
        found.sort();
        for (_, name, bytes) in found {
            let uploaded = up.contains(name.as_str());
            cache.put(&name, bytes, uploaded);
        }
        Ok(Objects {
            rt,
            store: Arc::new(s3),
            prefix,
            dir: dir.to_path_buf(),
            config: config.clone(),
            cache: Mutex::new(cache),
            inflight: Mutex::new(HashMap::new()),
            stats: Mutex::new(ObjectStats::default()),
        })
    }

    /// The object key of a hash.
    pub fn key(&self, sha256: &str) -> String {
        if self.prefix.is_empty() {
            sha256.to_string()
        } else {
            format!("{}/{sha256}", self.prefix)
        }
    }

    pub fn stats(&self) -> ObjectStats {
        let mut s = *self.stats.lock().unwrap_or_else(|e| e.into_inner());
        s.cached_bytes = self.cache.lock().unwrap_or_else(|e| e.into_inner()).total;
        s
    }

    pub fn config(&self) -> &ObjectsConfig {
        &self.config
    }

    /// Run `fut` on the private runtime and wait for it (never on the caller's runtime).
    fn run<T: Send + 'static>(
        &self,
        op: &'static str,
        key: &str,
        fut: impl Future<Output = Result<T, object_store::Error>> + Send + 'static,
    ) -> Result<T, ObjectError> {
        let (tx, rx) = std::sync::mpsc::sync_channel(1);
        let limit = self.config.timeout.saturating_mul(4);
        self.rt.spawn(async move {
            let r = tokio::time::timeout(limit, fut).await;
            let _ = tx.send(r);
        });
        match rx.recv() {
            Ok(Ok(r)) => r.map_err(|source| match source {
                object_store::Error::NotFound { .. } => {
                    ObjectError::Missing { key: key.to_string(), name: String::new() }
                }
                source => ObjectError::Unavailable { op, key: key.to_string(), source },
            }),
            Ok(Err(_)) => Err(ObjectError::Timeout { op, key: key.to_string(), secs: limit.as_secs() }),
            Err(_) => Err(ObjectError::Runtime("the object store's runtime stopped".into())),
        }
    }

    /// SHA-256 (hex) and size of a local file.
    fn hash_file(path: &Path, name: &str) -> Result<(String, u64), ObjectError> {
        let mut f = std::fs::File::open(path).map_err(io("open", name))?;
        let mut h = Sha256::new();
        let mut buf = vec![0u8; 1 << 20];
        let mut n = 0u64;
        loop {
            let k = f.read(&mut buf).map_err(io("read", name))?;
            if k == 0 {
                break;
            }
            h.update(&buf[..k]);
            n += k as u64;
        }
        Ok((hex::encode(h.finalize()), n))
    }

    /// Upload the files `names` of the layers directory (those that exist: a
    /// checkpoint without changed files has no pack), each as
    /// `<prefix>/<sha256>`; a hash some committed file has already is not
    /// uploaded again. All or nothing: on an error the caller must not commit.
    pub fn upload(&self, store: &Store, names: &[&str]) -> Result<Uploaded<'_>, ObjectError> {
        let mut todo = Vec::with_capacity(names.len());
        for name in names {
            let path = self.dir.join(name);
            if !path.is_file() {
                continue;
            }
            let (sha256, bytes) = Self::hash_file(&path, name)?;
            todo.push((path, StoredObject { name: name.to_string(), sha256, bytes }));
        }
        // Registered before the dedup check, so that gc cannot delete an object
        // this checkpoint is about to refer to.
        {
            let mut f = self.inflight.lock().unwrap_or_else(|e| e.into_inner());
            for (_, o) in &todo {
                *f.entry(o.sha256.clone()).or_insert(0) += 1;
            }
        }
        let up = Uploaded { objects: self, stored: todo.iter().map(|(_, o)| o.clone()).collect() };
        let mut seen = std::collections::HashSet::new();
        let mut jobs = Vec::new();
        for (path, o) in &todo {
            if !seen.insert(o.sha256.clone()) || store.has_object(&o.sha256)? {
                continue;
            }
            jobs.push((path.clone(), o.clone()));
        }
        let mut bytes = 0;
        if !jobs.is_empty() {
            let keys: Vec<String> = jobs.iter().map(|(_, o)| self.key(&o.sha256)).collect();
            let shown = keys.join(", ");
            let s3 = self.store.clone();
            let all = async move {
                let mut set = tokio::task::JoinSet::new();
                for ((path, o), key) in jobs.into_iter().zip(keys) {
                    let s3 = s3.clone();
                    set.spawn(async move { put_file(&*s3, &path, &key, o.bytes).await });
                }
                let mut total = 0;
                while let Some(r) = set.join_next().await {
                    match r {
                        Ok(Ok(n)) => total += n,
                        Ok(Err(e)) => return Err(e),
                        Err(e) => return Err(object_store::Error::Generic { store: "S3", source: Box::new(e) }),
                    }
                }
                Ok(total)
            };
            bytes = self.run("put", &shown, all)?;
        }
        let mut st = self.stats.lock().unwrap_or_else(|e| e.into_inner());
        st.uploads += 1;
        st.uploaded_bytes += bytes;
        drop(st);
        Ok(up)
    }

    /// Upload the file `path` (`bytes` long) as the object `<prefix>/<key>`
    /// (for objects that are not checkpoint files: `crate::artifacts`).
    pub(crate) fn put_key(&self, path: &Path, key: &str, bytes: u64) -> Result<u64, ObjectError> {
        let (s3, path, full) = (self.store.clone(), path.to_path_buf(), self.key(key));
        self.run("put", &full.clone(), async move { put_file(&*s3, &path, &full, bytes).await })
    }

    /// Download the object `<prefix>/<key>` into the new file `dest`: its
    /// SHA-256 (hex) and size (checked by the caller). On an error `dest` is removed.
    pub(crate) fn get_key(&self, key: &str, dest: &Path) -> Result<(String, u64), ObjectError> {
        let (s3, tmp, full) = (self.store.clone(), dest.to_path_buf(), self.key(key));
        let r = self.run("get", &full.clone(), async move { get_file(&*s3, &full, &tmp).await });
        if r.is_err() {
            let _ = std::fs::remove_file(dest);
        }
        r
    }

    /// The checkpoint of `up` is committed: its files are in the cache (uploaded), then trim.
    pub fn committed(&self, up: Uploaded<'_>) {
        {
            let mut c = self.cache.lock().unwrap_or_else(|e| e.into_inner());
            for o in &up.stored {
                c.put(&o.name, o.bytes, true);
            }
        }
        drop(up);
        self.trim();
    }

    /// The checkpoint of `up` was not committed: delete the objects no
    /// committed file refers to (best effort).
    pub fn abandon(&self, store: &Store, up: Uploaded<'_>) {
        let shas: Vec<String> = up.stored.iter().map(|o| o.sha256.clone()).collect();
        drop(up);
        let unreferenced: Vec<String> =
            shas.into_iter().filter(|s| store.has_object(s).is_ok_and(|has| !has)).collect();
        self.delete(unreferenced);
    }

    /// Make the files `names` local (fetched from the object store if they are
    /// not, hash verified) and pin them until the guard is dropped. A file that
    /// is neither local nor uploaded is left to the reader's error.
    pub fn ensure_local(&self, store: &Store, names: &[String]) -> Result<Pinned<'_>, ObjectError> {
        {
            let mut c = self.cache.lock().unwrap_or_else(|e| e.into_inner());
            for n in names {
                *c.pins.entry(n.clone()).or_insert(0) += 1;
            }
        }
        let pinned = Pinned { objects: self, names: names.to_vec() };
        let mut missing = Vec::new();
        for name in names {
            let path = self.dir.join(name);
            if let Ok(md) = std::fs::metadata(&path) {
                let known = self.cache.lock().unwrap_or_else(|e| e.into_inner()).files.contains_key(name.as_str());
                // (A file the cache does not know yet: uploaded if it has an object.)
                let uploaded = known || store.object(name)?.is_some();
                self.cache.lock().unwrap_or_else(|e| e.into_inner()).put(name, md.len(), uploaded && !known);
                continue;
            }
            if let Some(o) = store.object(name)? {
                if !missing.iter().any(|m: &StoredObject| m.name == o.name) {
                    missing.push(o);
                }
            }
        }
        self.fetch(&missing)?;
        Ok(pinned)
    }

    /// Those of `names` that are only in the object store, with one query for all.
    pub fn remote_only(&self, store: &Store, names: &[String]) -> Result<Vec<String>, ObjectError> {
        let missing: Vec<String> = names.iter().filter(|n| !self.dir.join(n).exists()).cloned().collect();
        Ok(store.objects_named(&missing)?.into_iter().map(|o| o.name).collect())
    }

    /// Download the objects of `objects` into the layers directory (up to 8
    /// at a time; each to a temp file, its hash verified, then renamed into
    /// place). All or nothing: on an error no temp file is left.
    fn fetch(&self, objects: &[StoredObject]) -> Result<(), ObjectError> {
        if objects.is_empty() {
            return Ok(());
        }
        let jobs: Vec<(String, PathBuf)> = objects
            .iter()
            .map(|o| {
                // Unique: two resumes may fetch the same file at once.
                let n = FETCH_SEQ.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                (self.key(&o.sha256), self.dir.join(format!(".fetch-{}-{}-{n}", o.name, std::process::id())))
            })
            .collect();
        let tmps: Vec<PathBuf> = jobs.iter().map(|(_, t)| t.clone()).collect();
        let remove_tmps = || {
            for t in &tmps {
                let _ = std::fs::remove_file(t);
            }
        };
        let s3 = self.store.clone();
        let shown = jobs.first().map(|(k, _)| k.clone()).unwrap_or_default();
        let all = async move {
            let got: Vec<Result<(String, u64), object_store::Error>> = futures_util::stream::iter(jobs)
                .map(|(k, t)| {
                    let s3 = s3.clone();
                    async move { get_file(&*s3, &k, &t).await }
                })
                .buffered(8)
                .collect()
                .await;
            Ok(got)
        };
        let got = match self.run("get", &shown, all) {
            Ok(v) => v,
            Err(e) => {
                remove_tmps();
                return Err(e);
            }
        };
        let mut bytes_total = 0;
        for (o, r) in objects.iter().zip(got) {
            let key = self.key(&o.sha256);
            let (sha, bytes) = match r {
                Ok(v) => v,
                Err(object_store::Error::NotFound { .. }) => {
                    remove_tmps();
                    return Err(ObjectError::Missing { key, name: o.name.clone() });
                }
                Err(source) => {
                    remove_tmps();
                    return Err(ObjectError::Unavailable { op: "get", key, source });
                }
            };
            if sha != o.sha256 || bytes != o.bytes {
                remove_tmps();
                return Err(ObjectError::Corrupt { key, name: o.name.clone(), got: sha, bytes });
            }
            bytes_total += bytes;
        }
        for (o, tmp) in objects.iter().zip(&tmps) {
            if let Err(e) = std::fs::rename(tmp, self.dir.join(&o.name)) {
                remove_tmps();
                return Err(ObjectError::Io { what: "rename", name: o.name.clone(), source: e });
            }
            self.cache.lock().unwrap_or_else(|e| e.into_inner()).put(&o.name, o.bytes, true);
        }
        let mut st = self.stats.lock().unwrap_or_else(|e| e.into_inner());
        st.fetches += objects.len() as u64;
        st.fetched_bytes += bytes_total;
        drop(st);
        tracing::debug!(files = objects.len(), bytes = bytes_total, "fetched checkpoint files from the object store");
        self.trim();
        Ok(())
    }

    /// Files of the layers directory removed (gc): no longer cached.
    pub fn removed(&self, names: &[String]) {
        let mut c = self.cache.lock().unwrap_or_else(|e| e.into_inner());
        for n in names {
            c.remove(n);
        }
    }

    /// Record files that exist locally as uploaded (after [`Self::upload`] of older files).
    pub fn mark_uploaded(&self, stored: &[StoredObject]) {
        let mut c = self.cache.lock().unwrap_or_else(|e| e.into_inner());
        for o in stored {
            c.put(&o.name, o.bytes, true);
        }
    }

    /// Delete the objects of `shas` (no committed file refers to them), except
    /// those a checkpoint being committed uploads. Best effort: a failure is
    /// logged and the object stays (unreferenced). Returns how many went.
    pub fn delete(&self, shas: Vec<String>) -> usize {
        if shas.is_empty() {
            return 0;
        }
        // Held while deleting, so that an upload of one of these hashes waits
        // and re-creates the object after (the deletes run concurrently: short).
        let f = self.inflight.lock().unwrap_or_else(|e| e.into_inner());
        let keys: Vec<String> = shas.iter().filter(|s| !f.contains_key(*s)).map(|s| self.key(s)).collect();
        let s3 = self.store.clone();
        let shown = format!("{} objects", keys.len());
        let all = async move {
            let results: Vec<(String, Result<(), object_store::Error>)> = futures_util::stream::iter(keys)
                .map(|k| {
                    let s3 = s3.clone();
                    async move {
                        let r = s3.delete(&ObjectPath::from(k.as_str())).await;
                        (k, r)
                    }
                })
                .buffer_unordered(16)
                .collect()
                .await;
            Ok(results)
        };
        let mut n = 0;
        match self.run("delete", &shown, all) {
            Ok(results) => {
                for (key, r) in results {
                    match r {
                        Ok(()) | Err(object_store::Error::NotFound { .. }) => n += 1,
                        Err(e) => tracing::warn!("deleting unreferenced checkpoint object {key}: {e}"),
                    }
                }
            }
            Err(e) => tracing::warn!("deleting unreferenced checkpoint objects: {e}"),
        }
        drop(f);
        self.stats.lock().unwrap_or_else(|e| e.into_inner()).deletes += n as u64;
        n
    }

    /// Remove uploaded, unpinned files, least recently used first, until the
    /// local directory is within the bound. Returns how many were removed.
    pub fn trim(&self) -> usize {
        let Some(bound) = self.config.cache_bytes else { return 0 };
        let mut c = self.cache.lock().unwrap_or_else(|e| e.into_inner());
        if c.total <= bound {
            return 0;
        }
        let mut cand: Vec<(u64, String)> = c
            .files
            .iter()
            .filter(|(n, e)| e.uploaded && !c.pins.contains_key(n.as_str()))
            .map(|(n, e)| (e.used, n.clone()))
            .collect();
        cand.sort_unstable();
        let mut n = 0;
        for (_, name) in cand {
            if c.total <= bound {
                break;
            }
            match std::fs::remove_file(self.dir.join(&name)) {
                Ok(()) => n += 1,
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
                Err(e) => {
                    tracing::warn!("removing cached checkpoint file {name}: {e}");
                    continue;
                }
            }
            c.remove(&name);
        }
        drop(c);
        if n > 0 {
            self.stats.lock().unwrap_or_else(|e| e.into_inner()).evicted += n as u64;
        }
        n
    }
}

/// GET one object into the file `tmp`: its SHA-256 (hex) and size.
async fn get_file(s3: &dyn ObjectStore, key: &str, tmp: &Path) -> Result<(String, u64), object_store::Error> {
    let io_err = |e: std::io::Error| object_store::Error::Generic { store: "local", source: Box::new(e) };
    let r = s3.get(&ObjectPath::from(key)).await?;
    let mut stream = r.into_stream();
    let mut f = std::fs::File::create(tmp).map_err(io_err)?;
    let mut h = Sha256::new();
    let mut n = 0u64;
    while let Some(chunk) = stream.next().await {
        let chunk = chunk?;
        h.update(&chunk);
        n += chunk.len() as u64;
        f.write_all(&chunk).map_err(io_err)?;
    }
    f.flush().map_err(io_err)?;
    Ok((hex::encode(h.finalize()), n))
}

/// PUT one file: in one request up to [`PART`] bytes, else a multipart upload.
async fn put_file(s3: &dyn ObjectStore, path: &Path, key: &str, bytes: u64) -> Result<u64, object_store::Error> {
    let io_err = |e: std::io::Error| object_store::Error::Generic { store: "local", source: Box::new(e) };
    let location = ObjectPath::from(key);
    if bytes <= PART as u64 {
        let data = std::fs::read(path).map_err(io_err)?;
        let n = data.len() as u64;
        s3.put(&location, PutPayload::from(data)).await?;
        return Ok(n);
    }
    let upload = s3.put_multipart(&location).await?;
    let mut w = object_store::WriteMultipart::new_with_chunk_size(upload, PART);
    let mut f = std::fs::File::open(path).map_err(io_err)?;
    let mut buf = vec![0u8; PART];
    let mut n = 0u64;
    loop {
        let k = f.read(&mut buf).map_err(io_err)?;
        if k == 0 {
            break;
        }
        w.wait_for_capacity(4).await?;
        w.write(&buf[..k]);
        n += k as u64;
    }
    w.finish().await?;
    Ok(n)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn urls() {
        assert_eq!(parse_url("s3://b/p/q").unwrap(), ("b".into(), "p/q".into()));
        assert_eq!(parse_url("s3://b").unwrap(), ("b".into(), "".into()));
        assert_eq!(parse_url("s3://b/p/").unwrap(), ("b".into(), "p".into()));
        assert!(parse_url("http://b/p").is_err());
        assert!(parse_url("s3:///p").is_err());
        assert!(parse_url("s3://b/a//c").is_err());
        assert!(parse_url("s3://b/../c").is_err());
        assert!(is_loopback_http("http://127.0.0.1:9000"));
        assert!(is_loopback_http("http://localhost:9000/"));
        assert!(is_loopback_http("http://[::1]:9000"));
        assert!(!is_loopback_http("http://10.0.0.1:9000"));
        assert!(!is_loopback_http("https://127.0.0.1:9000"));
    }

    #[test]
    fn cache_accounting() {
        let mut c = Cache::default();
        c.put("a", 10, true);
        c.put("b", 5, false);
        c.put("a", 20, false);
        assert_eq!(c.total, 25);
        assert!(c.files["a"].uploaded, "uploaded stays uploaded");
        c.remove("a");
        c.remove("zz");
        assert_eq!(c.total, 5);
    }
}
