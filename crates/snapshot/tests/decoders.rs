//! Property tests of the snapshot decoders: the state file
//! decoder (`state::decode`, every readable version), the layer reader
//! (`Layer::read`), the pack-file reader (`FileTable::validate` +
//! `PackReader::read_into`) and the template bundle reader (`bundle::unpack_from`,
//! a bundle comes from a bucket) on random bytes, truncations, bit flips, byte
//! overwrites and insertions of the committed golden files — also "resealed"
//! (length fields and checksum recomputed after the mutation, so the payload
//! decoders behind the checksum are reached). Each must return a clean typed
//! error or a valid value, never panic, and never allocate from an untrusted
//! length before checking it against the input: a counting allocator bounds
//! the largest single allocation made while decoding.
//!
//! Longer run: `PROPTEST_CASES=20000 cargo test --release -p forkbox-snapshot --test decoders`.
#![allow(clippy::unwrap_used)] // a test may unwrap: a panic is its failure

use std::alloc::{GlobalAlloc, Layout, System};
use std::cell::Cell;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicUsize, Ordering};

use forkbox_snapshot::bundle::{self, BUNDLE_HEADER};
use forkbox_snapshot::files::{FileTable, PackReader, StoredChunk, StoredFile, PACK_HEADER, PACK_MAGIC, PACK_VERSION};
use forkbox_snapshot::{state, Layer, StateError};
use proptest::prelude::*;
use sha2::{Digest, Sha256};

// ---------------------------------------------------------------------------
// The largest single allocation made by this thread while `tracking` is on.

struct Counting;

thread_local! {
    static TRACKING: Cell<bool> = const { Cell::new(false) };
}
static LARGEST: AtomicUsize = AtomicUsize::new(0);

// SAFETY: every call is passed on unchanged to the system allocator; only sizes are recorded.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, l: Layout) -> *mut u8 {
        if TRACKING.with(|t| t.get()) {
            LARGEST.fetch_max(l.size(), Ordering::Relaxed);
        }
        // SAFETY: forwarded as is.
        unsafe { System.alloc(l) }
    }
    unsafe fn dealloc(&self, p: *mut u8, l: Layout) {
        // SAFETY: forwarded as is.
        unsafe { System.dealloc(p, l) }
    }
    unsafe fn realloc(&self, p: *mut u8, l: Layout, new: usize) -> *mut u8 {
        if TRACKING.with(|t| t.get()) {
            LARGEST.fetch_max(new, Ordering::Relaxed);
        }
        // SAFETY: forwarded as is.
        unsafe { System.realloc(p, l, new) }
    }
}

#[global_allocator]
static ALLOC: Counting = Counting;

/// Run `f`, and fail if one allocation in it was larger than `bound`.
fn bounded<T>(bound: usize, what: &str, f: impl FnOnce() -> T) -> T {
    // Only this thread's allocations count (tests run on several threads).
    LARGEST.store(0, Ordering::Relaxed);
    TRACKING.with(|t| t.set(true));
    let r = f();
    TRACKING.with(|t| t.set(false));
    let largest = LARGEST.load(Ordering::Relaxed);
    assert!(largest <= bound, "{what}: one allocation of {largest} bytes (bound {bound})");
    r
}

/// What a decoder of `input_len` bytes may allocate at once: a copy or two of
/// its input, plus serde's cautious 1 MiB preallocation for a sequence.
fn bound_for(input_len: usize) -> usize {
    2 * input_len + (2 << 20)
}

// ---------------------------------------------------------------------------

fn golden_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/golden")
}

fn golden(name: &str) -> Vec<u8> {
    std::fs::read(golden_dir().join(name)).unwrap_or_else(|e| panic!("golden file {name}: {e}"))
}

const STATE_FILES: &[&str] =
    &["template-state-v4.bin", "template-state-v5.bin", "session-state-v4.bin", "session-state-v5.bin"];

#[derive(Clone, Debug)]
enum Mutation {
    Truncate(usize),
    Flip(usize, u8),
    Set(usize, u8),
    Insert(usize, Vec<u8>),
    Remove(usize, usize),
    /// Overwrite 8 bytes with a chosen u64 (lengths, counts).
    Word(usize, u64),
}

fn mutation() -> impl Strategy<Value = Mutation> {
    prop_oneof![
        any::<usize>().prop_map(Mutation::Truncate),
        (any::<usize>(), 0u8..8).prop_map(|(i, b)| Mutation::Flip(i, b)),
        (any::<usize>(), any::<u8>()).prop_map(|(i, v)| Mutation::Set(i, v)),
        (any::<usize>(), prop::collection::vec(any::<u8>(), 1..16)).prop_map(|(i, v)| Mutation::Insert(i, v)),
        (any::<usize>(), 1usize..64).prop_map(|(i, n)| Mutation::Remove(i, n)),
        (
            any::<usize>(),
            prop_oneof![
                Just(u64::MAX),
                Just(u64::MAX - 7),
                Just(1u64 << 32),
                Just(1u64 << 63),
                any::<u64>(),
                0u64..300
            ]
        )
            .prop_map(|(i, v)| Mutation::Word(i, v)),
    ]
}

/// Apply `muts` to `bytes` from offset `from` on (indices wrap into range).
fn mutate(mut bytes: Vec<u8>, from: usize, muts: &[Mutation]) -> Vec<u8> {
    for m in muts {
        let n = bytes.len().saturating_sub(from);
        if n == 0 {
            break;
        }
        let at = |i: usize| from + i % n;
        match m {
            Mutation::Truncate(i) => bytes.truncate(at(*i)),
            Mutation::Flip(i, b) => bytes[at(*i)] ^= 1 << b,
            Mutation::Set(i, v) => bytes[at(*i)] = *v,
            Mutation::Insert(i, v) => {
                let p = at(*i);
                bytes.splice(p..p, v.iter().copied());
            }
            Mutation::Remove(i, k) => {
                let p = at(*i);
                let e = (p + k).min(bytes.len());
                bytes.drain(p..e);
            }
            Mutation::Word(i, v) => {
                let p = at(*i);
                let e = (p + 8).min(bytes.len());
                let w = v.to_le_bytes();
                bytes[p..e].copy_from_slice(&w[..e - p]);
            }
        }
    }
    bytes
}

/// The state header (magic, version, length, SHA-256) recomputed over `payload`.
fn seal_state(version: [u8; 4], payload: &[u8]) -> Vec<u8> {
    let mut out = Vec::new();
    out.extend_from_slice(forkbox_snapshot::MAGIC);
    out.extend_from_slice(&version);
    out.extend_from_slice(&(payload.len() as u64).to_le_bytes());
    out.extend_from_slice(&Sha256::digest(payload));
    out.extend_from_slice(payload);
    out
}

const STATE_HEADER: usize = 8 + 4 + 8 + 32;
const LAYER_HEADER: usize = 8 + 4 + 8 + 4 + 8;

fn check_state(bytes: &[u8]) {
    let r = bounded(bound_for(bytes.len()), "state::decode", || state::decode(bytes));
    match r {
        Ok(s) => {
            // A valid value: it encodes again, and that decodes to the same encoding.
            let again = state::encode(&s);
            let back = state::decode(&again).expect("a decoded state re-encodes to a decodable one");
            assert_eq!(state::encode(&back), again);
        }
        Err(StateError::Corrupt(_) | StateError::BadMagic | StateError::BadVersion(_)) => {}
        Err(e) => panic!("unexpected error kind from decode: {e:?}"),
    }
}

fn layer_from(bytes: &[u8]) -> Result<Layer, StateError> {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("x.layer");
    std::fs::write(&path, bytes).unwrap();
    bounded(bound_for(bytes.len()), "Layer::read", || Layer::read(&path))
}

/// The layer header's CRC-32 (of the body) and, optionally, its lengths recomputed.
fn seal_layer(mut bytes: Vec<u8>, fix_lengths: bool) -> Vec<u8> {
    if bytes.len() < LAYER_HEADER {
        return bytes;
    }
    if fix_lengths {
        let count =
            u64::from_le_bytes(bytes[12..20].try_into().unwrap()).min(((bytes.len() - LAYER_HEADER) / 8) as u64);
        let data_len = (bytes.len() - LAYER_HEADER) as u64 - count * 8;
        bytes[12..20].copy_from_slice(&count.to_le_bytes());
        bytes[24..32].copy_from_slice(&data_len.to_le_bytes());
    }
    let crc = crc32fast::hash(&bytes[LAYER_HEADER..]);
    bytes[20..24].copy_from_slice(&crc.to_le_bytes());
    bytes
}

fn check_layer(bytes: &[u8]) {
    match layer_from(bytes) {
        Ok(l) => {
            // Every page of a layer that read cleanly applies to a zero base without a panic.
            let base = vec![0u8; 64 << 10];
            for i in 0..l.pages.len() {
                let _ = l.page(i, &base);
            }
        }
        Err(StateError::Corrupt(_)) => {}
        Err(e) => panic!("unexpected error kind from Layer::read: {e:?}"),
    }
}

/// Found by `layer_read_of_mutated_golden_files` in CI: a page number near
/// u64::MAX behind a valid checksum overflowed `page * PAGE_SIZE`.
#[test]
fn layer_with_a_huge_page_number_is_corrupt() {
    let mut g = golden("layer-v3.bin");
    let count = u64::from_le_bytes(g[12..20].try_into().unwrap()) as usize;
    assert!(count >= 1, "the golden layer has pages");
    let last = LAYER_HEADER + (count - 1) * 8;
    g[last..last + 8].copy_from_slice(&(u64::MAX / 2).to_le_bytes());
    match layer_from(&seal_layer(g, false)) {
        Err(StateError::Corrupt(why)) => assert!(why.contains("beyond"), "{why}"),
        Err(e) => panic!("a page past 64 GiB must be refused as corrupt, got {e:?}"),
        Ok(l) => panic!("a page past 64 GiB must be refused as corrupt, read pages {:?}", l.pages),
    }
}

/// Unpack `bytes` as a template bundle into a fresh directory: a clean typed
/// error (and no file left), or files that pack back to exactly `bytes` (the
/// encoding is canonical, so whatever the reader accepts is what a writer writes).
fn check_bundle(bytes: &[u8]) {
    let dir = tempfile::tempdir().unwrap();
    let r = bounded(bound_for(bytes.len()), "bundle::unpack_from", || {
        bundle::unpack_from(bytes, bytes.len() as u64, dir.path())
    });
    match r {
        Ok(info) => {
            assert_eq!(info.bytes, bytes.len() as u64);
            assert_eq!(info.sha256, hex::encode(Sha256::digest(bytes)));
            let again = dir.path().join("again");
            let packed = bundle::pack(dir.path(), &again).expect("an unpacked bundle packs again");
            assert_eq!(packed, info);
            assert!(std::fs::read(&again).unwrap() == bytes, "a bundle that unpacks packs back to other bytes");
        }
        Err(StateError::Corrupt(_)) => {
            let left: Vec<_> = std::fs::read_dir(dir.path()).unwrap().flatten().map(|e| e.file_name()).collect();
            assert!(left.is_empty(), "a refused bundle left files: {left:?}");
        }
        Err(e) => panic!("unexpected error kind from bundle::unpack_from: {e:?}"),
    }
}

/// The bundle's trailer (SHA-256 of everything before it) recomputed.
fn seal_bundle(mut bytes: Vec<u8>) -> Vec<u8> {
    if bytes.len() < 32 {
        return bytes;
    }
    let n = bytes.len() - 32;
    let sum = Sha256::digest(&bytes[..n]);
    bytes[n..].copy_from_slice(&sum);
    bytes
}

/// A bundle header (48 bytes) with chosen fields.
fn bundle_header(state_len: u64, memory_size: u64, runs: u64, pages: u64) -> Vec<u8> {
    let mut b = bundle::BUNDLE_MAGIC.to_vec();
    b.extend_from_slice(&bundle::BUNDLE_VERSION.to_le_bytes());
    b.extend_from_slice(&0u32.to_le_bytes());
    for v in [state_len, memory_size, runs, pages] {
        b.extend_from_slice(&v.to_le_bytes());
    }
    b
}

#[test]
fn the_golden_bundle_unpacks_and_packs_back() {
    let g = golden("template-bundle-v1.bin");
    let dir = tempfile::tempdir().unwrap();
    bundle::unpack_from(&g[..], g.len() as u64, dir.path()).unwrap();
    check_bundle(&g);
}

/// Lengths near u64::MAX behind a valid trailer: refused before anything is
/// allocated or written from them.
#[test]
fn bundle_lengths_near_u64_max_are_corrupt_not_a_panic() {
    for (state_len, memory, runs, pages) in [
        (u64::MAX, 4096, 0, 0),
        (0, u64::MAX - 4095, 1, 1),
        (0, 1 << 30, u64::MAX / 16 + 1, u64::MAX / 16 + 1),
        (0, 1 << 30, 1, u64::MAX / 4096 + 1),
        (u64::MAX - 100, 1 << 30, 1, 1),
    ] {
        let mut b = bundle_header(state_len, memory, runs, pages);
        b.extend_from_slice(&[7u8; 4096 + 16]);
        b.extend_from_slice(&[0u8; 32]);
        let b = seal_bundle(b);
        let dir = tempfile::tempdir().unwrap();
        let r = bounded(1 << 20, "bundle::unpack_from", || bundle::unpack_from(&b[..], b.len() as u64, dir.path()));
        assert!(matches!(r, Err(StateError::Corrupt(_))), "{r:?}");
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 400, ..ProptestConfig::default() })]

    #[test]
    fn bundle_unpack_of_mutated_golden_files(muts in prop::collection::vec(mutation(), 1..6)) {
        let g = golden("template-bundle-v1.bin");
        // Raw (the trailer must catch it) ...
        check_bundle(&mutate(g.clone(), 0, &muts));
        // ... resealed, for the checks behind the trailer ...
        check_bundle(&seal_bundle(mutate(g.clone(), 0, &muts)));
        // ... and header fields only (lengths, counts), body intact, resealed.
        check_bundle(&seal_bundle(mutate(g, 16, &muts[..1])));
    }

    #[test]
    fn bundle_unpack_of_random_bodies(
        state_len in prop_oneof![0u64..64, any::<u64>()],
        memory_pages in prop_oneof![0u64..64, any::<u64>()],
        runs in prop::collection::vec((0u64..70, 0u64..4), 0..5),
        data in prop::collection::vec(any::<u8>(), 0..64),
        page_fill in any::<u8>(),
    ) {
        let pages: u64 = runs.iter().map(|r| r.1).sum();
        let mut b = bundle_header(state_len, memory_pages.wrapping_mul(4096), runs.len() as u64, pages);
        let state: Vec<u8> = data.iter().copied().cycle().take((state_len % 64) as usize).collect();
        b.extend_from_slice(&state);
        for (first, n) in &runs {
            b.extend_from_slice(&first.to_le_bytes());
            b.extend_from_slice(&n.to_le_bytes());
        }
        for p in 0..pages {
            b.extend(std::iter::repeat_n(page_fill.wrapping_add(p as u8), 4096));
        }
        b.extend_from_slice(&[0u8; 32]);
        check_bundle(&b);
        check_bundle(&seal_bundle(b));
        prop_assert!(BUNDLE_HEADER == 48);
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 400, ..ProptestConfig::default() })]

    #[test]
    fn state_decode_of_random_bytes(bytes in prop::collection::vec(any::<u8>(), 0..2048), magic in any::<bool>()) {
        let mut b = bytes;
        if magic && b.len() >= 12 {
            b[..8].copy_from_slice(forkbox_snapshot::MAGIC);
            b[8..12].copy_from_slice(&5u32.to_le_bytes());
        }
        check_state(&b);
        if b.len() > STATE_HEADER {
            check_state(&seal_state(5u32.to_le_bytes(), &b[STATE_HEADER..]));
            check_state(&seal_state(4u32.to_le_bytes(), &b[STATE_HEADER..]));
        }
    }

    #[test]
    fn state_decode_of_mutated_golden_files(file in 0..STATE_FILES.len(), muts in prop::collection::vec(mutation(), 1..6)) {
        let g = golden(STATE_FILES[file]);
        // Raw (the checksum must catch it) ...
        check_state(&mutate(g.clone(), 0, &muts));
        // ... and resealed: the mutated payload behind a valid header, for the postcard decoders.
        let version: [u8; 4] = g[8..12].try_into().unwrap();
        let payload = mutate(g[STATE_HEADER..].to_vec(), 0, &muts);
        check_state(&seal_state(version, &payload));
    }

    #[test]
    fn layer_read_of_mutated_golden_files(muts in prop::collection::vec(mutation(), 1..6), fix in any::<bool>()) {
        let g = golden("layer-v3.bin");
        check_layer(&mutate(g.clone(), 0, &muts));
        check_layer(&seal_layer(mutate(g.clone(), 0, &muts), fix));
        // Header fields only (counts, lengths), body intact and resealed.
        check_layer(&seal_layer(mutate(g, 12, &muts[..1]), false));
    }

    #[test]
    fn layer_read_of_random_bytes(bytes in prop::collection::vec(any::<u8>(), 0..1024), count in any::<u64>(), data_len in any::<u64>()) {
        let mut b = b"FBXLAYER".to_vec();
        b.extend_from_slice(&3u32.to_le_bytes());
        b.extend_from_slice(&count.to_le_bytes());
        b.extend_from_slice(&0u32.to_le_bytes());
        b.extend_from_slice(&data_len.to_le_bytes());
        b.extend_from_slice(&bytes);
        check_layer(&b);
        check_layer(&seal_layer(b.clone(), false));
        check_layer(&seal_layer(b, true));
    }

    #[test]
    fn pack_reader_of_random_tables(
        packs in prop::collection::vec(prop_oneof![Just("p1.files".to_string()), Just("../x".to_string()), "[a-z./]{0,6}"], 0..3),
        chunks in prop::collection::vec((0u32..4, any::<u64>(), prop_oneof![0u32..600, any::<u32>()], any::<u32>()), 0..8),
        pack_bytes in prop::collection::vec(any::<u8>(), 0..512),
        good_magic in any::<bool>(),
    ) {
        let dir = tempfile::tempdir().unwrap();
        let mut body = Vec::new();
        if good_magic {
            body.extend_from_slice(PACK_MAGIC);
            body.extend_from_slice(&PACK_VERSION.to_le_bytes());
        }
        body.extend_from_slice(&pack_bytes);
        std::fs::write(dir.path().join("p1.files"), &body).unwrap();
        let chunks: Vec<StoredChunk> = chunks
            .into_iter()
            .map(|(pack, offset, len, crc)| {
                // Some chunks point into the pack, with their real checksum.
                let off = if offset % 2 == 0 { PACK_HEADER + offset % 64 } else { offset };
                let real = body.get(off as usize..(off as usize).saturating_add(len as usize)).map(crc32fast::hash);
                StoredChunk { pack, offset: off, len, crc: if crc % 2 == 0 { real.unwrap_or(crc) } else { crc } }
            })
            .collect();
        let len = chunks.iter().fold(0u64, |a, c| a.saturating_add(u64::from(c.len)));
        let table = FileTable { packs, files: vec![StoredFile { ino: 9, len, chunks }] };
        let valid = table.validate();
        let mut reader = PackReader::new(dir.path());
        // Read every chunk, valid table or not: the reader checks what it relies on itself.
        for c in &table.files[0].chunks {
            let mut out = Vec::new();
            let r = bounded(bound_for(body.len()) + forkbox_snapshot::files::CHUNK, "PackReader::read_into", || {
                reader.read_into(&table, c, &mut out)
            });
            match r {
                Ok(()) => {
                    prop_assert_eq!(out.len(), c.len as usize);
                    prop_assert_eq!(crc32fast::hash(&out), c.crc);
                }
                Err(StateError::Corrupt(_) | StateError::Io { .. }) => {}
                Err(e) => panic!("unexpected error kind: {e:?}"),
            }
        }
        if valid.is_ok() {
            prop_assert!(table.files[0].chunks.iter().all(|c| c.len as usize <= forkbox_snapshot::files::CHUNK));
        }
    }
}

#[test]
fn the_golden_files_decode_unmutated() {
    for f in STATE_FILES {
        state::decode(&golden(f)).unwrap_or_else(|e| panic!("{f}: {e}"));
    }
    layer_from(&golden("layer-v3.bin")).unwrap();
}

/// Regression: a layer header whose data length is near u64::MAX overflowed
/// `count * 8 + data_len` (a panic: this crate builds with overflow checks).
#[test]
fn a_layer_data_length_near_u64_max_is_corrupt_not_a_panic() {
    let mut g = golden("layer-v3.bin");
    g[24..32].copy_from_slice(&(u64::MAX - 3).to_le_bytes());
    assert!(matches!(layer_from(&g), Err(StateError::Corrupt(_))));
}

/// Regression: a chunk longer than `CHUNK` in a table that was not validated made
/// `read_into` allocate its length (up to 4 GiB) before reading a byte.
#[test]
fn an_oversized_chunk_is_refused_before_allocating() {
    let dir = tempfile::tempdir().unwrap();
    let mut body = PACK_MAGIC.to_vec();
    body.extend_from_slice(&PACK_VERSION.to_le_bytes());
    body.extend_from_slice(b"hello");
    std::fs::write(dir.path().join("p"), &body).unwrap();
    let c = StoredChunk { pack: 0, offset: PACK_HEADER, len: u32::MAX, crc: 0 };
    let table = FileTable {
        packs: vec!["p".into()],
        files: vec![StoredFile { ino: 1, len: u64::from(u32::MAX), chunks: vec![c] }],
    };
    let mut out = Vec::new();
    let r = bounded(1 << 20, "read_into", || PackReader::new(dir.path()).read_into(&table, &c, &mut out));
    assert!(matches!(r, Err(StateError::Corrupt(_))), "{r:?}");
}
