//! The cluster's shared templates, images and package layers
//! (`forkbox_catalog::shared`) over the cluster's bucket and database: a node
//! with `--database postgres://...` and `--objects s3://bucket/prefix` hands
//! a [`BucketArtifacts`] to its catalog.
//!
//! - Bytes: the object `<prefix>/artifacts/<sha256>` (apart from the
//!   checkpoint files' `<prefix>/<sha256>`, which their gc deletes; nothing
//!   deletes an artifact).
//! - Records: the `artifacts` table (store migration 5): (kind, id) -> SHA-256,
//!   size, what a template needs; the first record of an id wins. An object is
//!   uploaded before its record commits, so a recorded artifact is always
//!   downloadable.
//! - Build locks: a PostgreSQL advisory lock per (kind, id), on a connection
//!   of its own, held while a node builds it (`Store::lock_artifact`).
//! - Template names: the `template_records` table (store migration 7), the
//!   catalog's record of each custom or checkpoint template by key, so that a
//!   name made on one node is known to all of them.

use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use forkbox_catalog::shared::{Artifact, ArtifactKind, BuildLock, SharedArtifacts, SharedError};

use crate::objects::{ObjectError, Objects, ObjectsConfig};
use crate::store::{Store, StoreError};

/// How long a node waits for another one building the same artifact (a cold
/// `data` template: apt downloads, a 519 MiB image, a boot) before it gives up.
pub const BUILD_WAIT: Duration = Duration::from_secs(30 * 60);

/// Shortest time limit of one request for an artifact: images are hundreds
/// of MiB in one GET.
const MIN_TIMEOUT: Duration = Duration::from_secs(120);

#[derive(Debug, thiserror::Error)]
pub enum ArtifactsError {
    #[error("shared templates: the database: {0}")]
    Store(#[from] StoreError),
    #[error("shared templates: the bucket: {0}")]
    Objects(#[from] ObjectError),
    #[error("shared templates need a PostgreSQL database (--database postgres://...) and a bucket (--objects)")]
    NotACluster,
}

impl ArtifactsError {
    /// `storage_unavailable` when the bucket or the database is down, else `storage_error`.
    pub fn error_code(&self) -> forkbox_api::ErrorCode {
        SharedError::from(self).error_code()
    }
}

impl From<&ArtifactsError> for SharedError {
    fn from(e: &ArtifactsError) -> SharedError {
        match e {
            ArtifactsError::Store(s) if s.is_unavailable() => SharedError::Unavailable(e.to_string()),
            ArtifactsError::Objects(o) if o.error_code() == forkbox_api::ErrorCode::StorageUnavailable => {
                SharedError::Unavailable(e.to_string())
            }
            _ => SharedError::Failed(e.to_string()),
        }
    }
}

impl From<StoreError> for SharedError {
    fn from(e: StoreError) -> SharedError {
        SharedError::from(&ArtifactsError::Store(e))
    }
}

impl From<ObjectError> for SharedError {
    fn from(e: ObjectError) -> SharedError {
        SharedError::from(&ArtifactsError::Objects(e))
    }
}

/// [`SharedArtifacts`] over a cluster's bucket and PostgreSQL database.
pub struct BucketArtifacts {
    /// Its own connection to the cluster's database (not the session store's).
    store: Store,
    objects: Objects,
}

impl BucketArtifacts {
    /// The shared artifacts of the cluster whose database is `database`
    /// (`postgres://...`) and bucket `objects`, for the data directory `home`.
    pub fn open(objects: &ObjectsConfig, database: &str, home: &Path) -> Result<BucketArtifacts, ArtifactsError> {
        if !crate::db::is_postgres_url(database) {
            return Err(ArtifactsError::NotACluster);
        }
        let store = Store::open_postgres(database)?;
        let mut config = objects.clone();
        config.timeout = config.timeout.max(MIN_TIMEOUT);
        // Downloads go to files the catalog names; this directory is never read.
        config.cache_bytes = None;
        let objects = Objects::open(&config, &home.join("tmp").join("shared"), &[])?;
        Ok(BucketArtifacts { store, objects })
    }

    /// [`Self::open`], as the engine's trait object.
    pub fn shared(
        objects: &ObjectsConfig,
        database: &str,
        home: &Path,
    ) -> Result<Arc<dyn SharedArtifacts>, ArtifactsError> {
        Ok(Arc::new(BucketArtifacts::open(objects, database, home)?))
    }

    /// Every published artifact (tests, the bench).
    pub fn all(&self) -> Result<Vec<Artifact>, StoreError> {
        self.store.all_artifacts()
    }

    fn key(sha256: &str) -> String {
        format!("artifacts/{sha256}")
    }
}

fn valid_sha256(s: &str) -> bool {
    s.len() == 64 && s.bytes().all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b))
}

impl SharedArtifacts for BucketArtifacts {
    fn lookup(&self, kind: ArtifactKind, id: &str) -> Result<Option<Artifact>, SharedError> {
        let a = self.store.artifact(kind, id)?;
        if let Some(a) = &a {
            // The record names an object key: never let it name anything else.
            if !valid_sha256(&a.sha256) {
                return Err(SharedError::Corrupt {
                    kind: kind.as_str(),
                    id: id.to_string(),
                    why: "its record has no valid SHA-256".into(),
                });
            }
        }
        Ok(a)
    }

    fn download(&self, a: &Artifact, dest: &Path) -> Result<(), SharedError> {
        let key = Self::key(&a.sha256);
        let (sha, bytes) = self.objects.get_key(&key, dest).map_err(|e| match e {
            ObjectError::Missing { .. } => SharedError::Corrupt {
                kind: a.kind.as_str(),
                id: a.id.clone(),
                why: format!("its object {key} is not in the bucket"),
            },
            e => e.into(),
        })?;
        if sha != a.sha256 || bytes != a.bytes {
            let _ = std::fs::remove_file(dest);
            return Err(SharedError::Corrupt {
                kind: a.kind.as_str(),
                id: a.id.clone(),
                why: format!(
                    "the object {key} does not match its SHA-256 (got {sha}, {bytes} bytes; published {} bytes): refused",
                    a.bytes
                ),
            });
        }
        Ok(())
    }

    fn publish(&self, a: &Artifact, src: &Path) -> Result<Artifact, SharedError> {
        if !valid_sha256(&a.sha256) {
            return Err(SharedError::Failed(format!("publishing {} {}: not a SHA-256", a.kind.as_str(), a.id)));
        }
        if let Some(won) = self.store.artifact(a.kind, &a.id)? {
            return Ok(won);
        }
        // The bytes first: a record always names an object that is there.
        self.objects.put_key(src, &Self::key(&a.sha256), a.bytes)?;
        Ok(self.store.publish_artifact(a, crate::manager::now_ms())?)
    }

    fn lock(&self, kind: ArtifactKind, id: &str) -> Result<BuildLock, SharedError> {
        let lock = self.store.lock_artifact(kind, id, BUILD_WAIT).map_err(|e| match e {
            StoreError::LockTimeout { .. } => SharedError::Failed(e.to_string()),
            e => e.into(),
        })?;
        Ok(BuildLock::new(lock))
    }

    fn template_records(&self) -> Result<Vec<(String, String)>, SharedError> {
        Ok(self.store.template_records()?)
    }

    fn put_template_record(&self, key: &str, record: &str, replace: bool) -> Result<bool, SharedError> {
        Ok(self.store.put_template_record(key, record, replace, crate::manager::now_ms())?)
    }

    fn delete_template_record(&self, key: &str) -> Result<(), SharedError> {
        Ok(self.store.delete_template_record(key)?)
    }
}
