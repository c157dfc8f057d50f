//! Checkpoints in an object store, through the session manager against a real
//! S3-compatible server (`s3s-fs`, see forkbox_testkit::s3): a restart on a
//! wiped local directory keeps every checkpoint and resumes from the bucket;
//! without `--objects` such a home says what is missing; an object whose bytes
//! changed in the bucket is refused by its hash.
//!
//! Needs /dev/kvm and the s3s-fs binary (FAILS without them, never skips).
#![allow(clippy::unwrap_used)] // a test may unwrap: a panic is its failure

mod common;

use common::*;
use forkbox_sessions::manager::Config;
use forkbox_testkit::s3::{BUCKET, PREFIX, S3};

fn wipe(dir: &std::path::Path) -> usize {
    let mut n = 0;
    for e in std::fs::read_dir(dir).unwrap().flatten() {
        std::fs::remove_file(e.path()).unwrap();
        n += 1;
    }
    n
}

#[test]
fn a_restart_on_a_wiped_directory_keeps_every_checkpoint_and_resumes_from_the_bucket() {
    let s3 = S3::start();
    let home = fresh_home();
    let with = || Config { objects: Some(s3.config()), ..Config::default() };
    let id = {
        let m = open(home.path(), with());
        let s = m.create(TENANT, Default::default(), &Default::default()).unwrap();
        m.exec(TENANT, &s.id, "x = 1").unwrap();
        m.exec(TENANT, &s.id, "open('/tmp/f', 'w').write('pack')\ny = x + 1").unwrap();
        let st = m.object_stats().unwrap();
        assert_eq!(st.uploads, 2, "{st:?}");
        s.id
    };
    // Another node's view: no local files at all.
    assert!(wipe(&home.layers()) >= 5);
    // Without an object store the checkpoints stay (recovery does not drop
    // them) and a resume says where the files are.
    {
        let m = open(home.path(), Config::default());
        assert_eq!(m.checkpoints(TENANT, &id).unwrap().len(), 2);
        let e = m.exec(TENANT, &id, "y").unwrap_err();
        assert_eq!(e.code(), "storage_error", "{e}");
        assert!(e.to_string().contains("--objects"), "{e}");
    }
    let m = open(home.path(), with());
    assert_eq!(m.checkpoints(TENANT, &id).unwrap().len(), 2);
    let out = m.exec(TENANT, &id, "(x, y, open('/tmp/f').read())").unwrap();
    assert_eq!(out.result.value.as_deref(), Some("(1, 2, 'pack')"));
    assert!(m.object_stats().unwrap().fetches >= 3);
    drop(m);

    // An object whose bytes changed in the bucket: refused by its SHA-256.
    wipe(&home.layers());
    let dir = s3.root.path().join(BUCKET).join(PREFIX);
    for e in std::fs::read_dir(&dir).unwrap().flatten() {
        if e.file_name().len() == 64 {
            let mut b = std::fs::read(e.path()).unwrap();
            if let Some(x) = b.last_mut() {
                *x ^= 0xff;
            }
            std::fs::write(e.path(), b).unwrap();
        }
    }
    let m = open(home.path(), with());
    let e = m.exec(TENANT, &id, "x").unwrap_err();
    assert_eq!(e.code(), "storage_error", "{e}");
    assert!(e.to_string().contains("does not match"), "{e}");
    assert!(!std::fs::read_dir(home.layers())
        .unwrap()
        .flatten()
        .any(|f| f.file_name().to_string_lossy().starts_with(".fetch")));
}

#[test]
fn a_home_from_before_objects_is_uploaded_when_opened_with_them() {
    let s3 = S3::start();
    let home = fresh_home();
    let id = {
        let m = open(home.path(), Config::default());
        let s = m.create(TENANT, Default::default(), &Default::default()).unwrap();
        m.exec(TENANT, &s.id, "z = 'old'").unwrap();
        s.id
    };
    assert!(s3.objects().is_empty());
    let with = || Config { objects: Some(s3.config()), ..Config::default() };
    drop(open(home.path(), with()));
    let local = std::fs::read_dir(home.layers()).unwrap().count();
    assert!(s3.objects().len() >= 2 && s3.objects().len() <= local, "{:?}", s3.objects());
    // Uploaded: a wiped directory resumes from the bucket.
    wipe(&home.layers());
    let m = open(home.path(), with());
    assert_eq!(m.exec(TENANT, &id, "z").unwrap().result.value.as_deref(), Some("'old'"));
}

#[test]
fn forks_resume_at_once_from_a_cold_cache() {
    let s3 = S3::start();
    let home = fresh_home();
    let m = open(home.path(), Config { objects: Some(s3.config()), ..Config::default() });
    let s = m.create(TENANT, Default::default(), &Default::default()).unwrap();
    m.exec(TENANT, &s.id, "base = list(range(1000))").unwrap();
    let forks: Vec<String> = (0..4).map(|_| m.fork(TENANT, &s.id, None, Default::default()).unwrap().id).collect();
    m.evict(&s.id);
    wipe(&home.layers());
    // Every fork fetches the same files at the same time.
    std::thread::scope(|sc| {
        for (i, f) in forks.iter().enumerate() {
            let m = &m;
            sc.spawn(move || {
                let out = m.exec(TENANT, f, &format!("sum(base) + {i}")).unwrap();
                assert_eq!(out.result.value, Some((499500 + i).to_string()));
            });
        }
    });
    assert!(!std::fs::read_dir(home.layers())
        .unwrap()
        .flatten()
        .any(|f| f.file_name().to_string_lossy().starts_with(".fetch")));
}
