//! Checkpoints in an object store (`--objects`), over HTTP against a real
//! S3-compatible server on loopback: the `s3s-fs` crate's binary, started here
//! (scripts/test installs it under target/tools and names it in
//! `$FORKBOX_S3S_FS`). A missing binary is a failure, never a skip. The real
//! server over real KVM guests (fails without /dev/kvm).
#![allow(clippy::unwrap_used)] // a test may unwrap: a panic is its failure

use std::collections::BTreeSet;
use std::path::PathBuf;

use forkbox_runtime::ObjectsConfig;
use forkbox_server_testkit::TestServer;
use forkbox_testkit::s3::S3;
use reqwest::StatusCode;
use serde_json::json;
use sha2::{Digest, Sha256};

/// A server of this binary whose checkpoints go to `objects`.
async fn start(objects: ObjectsConfig) -> TestServer {
    TestServer::options()
        .prefix("forkbox-objects-test-")
        .config(move |cfg| cfg.runtime.sessions.objects = Some(objects))
        .start()
        .await
}

/// What these tests look at beside the API: the local checkpoint directory.
trait Layers {
    async fn evict(&self, id: &str);
    fn layers(&self) -> PathBuf;
    fn local_files(&self) -> Vec<(String, String, u64)>;
    fn wipe_cache(&self) -> usize;
}

impl Layers for TestServer {
    /// Drop the session's sandbox (a revert to its own head): its next exec resumes from its files.
    async fn evict(&self, id: &str) {
        let (st, v) = self.get(&format!("/v1/sessions/{id}")).await;
        assert_eq!(st, StatusCode::OK, "{v}");
        let head = v["checkpoint"].as_i64().expect("the session's checkpoint");
        let (st, v) = self.post(&format!("/v1/sessions/{id}/revert"), json!({ "checkpoint": head })).await;
        assert_eq!(st, StatusCode::OK, "{v}");
    }

    fn layers(&self) -> PathBuf {
        self.home().join("sessions/layers")
    }

    /// Name -> SHA-256 of every checkpoint file in the local directory.
    fn local_files(&self) -> Vec<(String, String, u64)> {
        let mut v = Vec::new();
        for e in std::fs::read_dir(self.layers()).unwrap().flatten() {
            let name = e.file_name().to_string_lossy().into_owned();
            if name.starts_with('.') || !e.path().is_file() {
                continue;
            }
            let data = std::fs::read(e.path()).unwrap();
            v.push((name, hex::encode(Sha256::digest(&data)), data.len() as u64));
        }
        v.sort();
        v
    }

    /// Remove every checkpoint file of the local directory (a cold cache).
    fn wipe_cache(&self) -> usize {
        let mut n = 0;
        for e in std::fs::read_dir(self.layers()).unwrap().flatten() {
            std::fs::remove_file(e.path()).unwrap();
            n += 1;
        }
        n
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn checkpoints_land_in_the_bucket_and_a_wiped_cache_resumes_from_it() {
    let s3 = S3::start();
    let s = start(s3.config()).await;
    let id = s.create_session(json!({})).await;
    assert_eq!(s.sexec(&id, "x = 41").await["checkpoint"], 1);
    // A file written in the session: its bytes go in a pack (`.files`) of checkpoint 2.
    let code = "open('/tmp/note.txt', 'w').write('kept in a pack')\ny = [1, 2, 3]";
    assert_eq!(s.sexec(&id, code).await["checkpoint"], 2);
    // Every local file is an object of the bucket, under the SHA-256 of its contents.
    let local = s.local_files();
    assert!(local.iter().any(|(n, _, _)| n.ends_with(".files")), "no pack among {local:?}");
    let remote = s3.objects();
    for (name, sha, _) in &local {
        assert!(remote.contains(sha), "{name} ({sha}) is not in the bucket: {remote:?}");
    }
    // A cold cache: the session comes back from the bucket, state and files intact.
    s.evict(&id).await;
    assert!(s.wipe_cache() >= 5);
    let v = s.sexec(&id, "(x + 1, y, open('/tmp/note.txt').read())").await;
    assert_eq!(v["value"], "(42, [1, 2, 3], 'kept in a pack')", "{v}");
    assert_eq!(v["checkpoint"], 3);
    // The files it needed are local again, verified against their hashes.
    let again = s.local_files();
    for (name, sha, _) in &again {
        assert!(s3.objects().contains(sha), "{name}");
    }
    // A fork of checkpoint 1 with a cold cache, too.
    s.evict(&id).await;
    s.wipe_cache();
    let (st, f) = s.post(&format!("/v1/sessions/{id}/fork"), json!({ "checkpoint": 1 })).await;
    assert_eq!(st, StatusCode::CREATED, "{f}");
    let fid = f["id"].as_str().unwrap().to_string();
    let v = s.sexec(&fid, "(x, 'y' in globals())").await;
    assert_eq!(v["value"], "(41, False)", "{v}");
    // Deleting the sessions deletes their objects (gc), down to an empty prefix.
    for sid in [&fid, &id] {
        let (st, v) = s.delete(&format!("/v1/sessions/{sid}")).await;
        assert_eq!(st, StatusCode::NO_CONTENT, "{v}");
    }
    assert_eq!(s3.objects(), BTreeSet::new(), "objects left after the sessions were deleted");
    assert!(s.local_files().is_empty());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn object_store_down_is_503_storage_unavailable_and_the_session_stays_at_its_checkpoint() {
    let mut s3 = S3::start();
    let s = start(s3.config()).await;
    let id = s.create_session(json!({})).await;
    assert_eq!(s.sexec(&id, "x = 1").await["checkpoint"], 1);
    let files_before = s.local_files();
    let objects_before = s3.objects();
    s3.stop();
    let (st, v) = s.exec(&id, "x = 2").await;
    assert_eq!(st, StatusCode::SERVICE_UNAVAILABLE, "{v}");
    assert_eq!(v["error"]["code"], "storage_unavailable", "{v}");
    assert_eq!(v["error"]["checkpoint"], 1, "the session stays at checkpoint 1: {v}");
    let msg = v["error"]["message"].as_str().unwrap();
    assert!(msg.contains("not committed"), "{msg}");
    assert!(!msg.contains(&s.home().display().to_string()), "host path in {msg}");
    // Nothing of the refused checkpoint is left locally or recorded.
    assert_eq!(s.local_files(), files_before);
    let (_, cps) = s.get(&format!("/v1/sessions/{id}/checkpoints")).await;
    assert_eq!(cps.as_array().map(Vec::len).or_else(|| cps["checkpoints"].as_array().map(Vec::len)), Some(1), "{cps}");
    // Still down: refused again, same state.
    let (st, v) = s.exec(&id, "x = 3").await;
    assert_eq!((st, v["error"]["code"].clone()), (StatusCode::SERVICE_UNAVAILABLE, json!("storage_unavailable")));
    // Back up: execs work again from checkpoint 1, nothing is corrupt.
    s3.restart();
    let v = s.sexec(&id, "x").await;
    assert_eq!((v["value"].clone(), v["checkpoint"].clone()), (json!("1"), json!(2)), "{v}");
    assert!(objects_before.is_subset(&s3.objects()));
    s.evict(&id).await;
    s.wipe_cache();
    let v = s.sexec(&id, "x + 10").await;
    assert_eq!(v["value"], "11", "{v}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_local_cache_stays_within_its_bound() {
    let s3 = S3::start();
    let bound = 2u64 << 20;
    let s = start(ObjectsConfig { cache_bytes: Some(bound), ..s3.config() }).await;
    let id = s.create_session(json!({})).await;
    s.sexec(&id, "import random\nbufs = []").await;
    // Each exec dirties ~1 MiB of fresh, incompressible pages: a checkpoint of over 1 MiB.
    for i in 0..6 {
        s.sexec(&id, &format!("bufs.append(random.randbytes(1 << 20))\nmark{i} = {i}")).await;
        let local: u64 = s.local_files().iter().map(|(_, _, b)| b).sum();
        assert!(local <= bound, "exec {i}: {local} bytes in the local directory, bound {bound}");
    }
    // The checkpoints are all in the bucket, more than the local directory holds.
    let local = s.local_files();
    assert!(s3.objects().len() > local.len(), "{} objects, {} local files", s3.objects().len(), local.len());
    // Resuming needs the whole chain: fetched from the bucket, state intact.
    s.evict(&id).await;
    let v = s.sexec(&id, "(len(bufs), [len(b) for b in bufs][:2], mark5)").await;
    assert_eq!(v["value"], "(6, [1048576, 1048576], 5)", "{v}");
    // Once the resume's pins are gone, the checkpoint of that exec trimmed the directory again.
    let local: u64 = s.local_files().iter().map(|(_, _, b)| b).sum();
    assert!(local <= bound, "{local} bytes in the local directory after the resume, bound {bound}");
}
