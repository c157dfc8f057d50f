//! Snapshot files.
//!
//! A snapshot is two files:
//! - `memory`: guest RAM as a raw, sparse file of exactly the guest's RAM
//!   size (pages the guest never wrote are holes). Forks map it MAP_PRIVATE, so it
//!   is never modified after it is written; it is made read-only on disk.
//! - `state`: registers, FPU/XSAVE, XCR0 and the VMM's process state, framed by
//!   a magic, a format version, the payload length and a SHA-256 of the payload.
//!   The state also records the memory file's size and checksum, so a corrupt or
//!   truncated memory file is rejected before it is ever mapped.
//!   Its payload's shape is this crate's: one module per format version
//!   (`state/v4.rs` ... `state/v10.rs`) reads its own shape and upgrades it
//!   to the next; the current one converts to and from the live types of
//!   forkbox-linux (see `state`). The fd table and its objects are the one
//!   part still written as the serde form of forkbox-linux's types.
//!
//! - a template bundle (`bundle`): a template directory as one file, holes
//!   left out, to share it through an object store.
//!
//! Place in the flow request -> runtime -> sessions -> engine -> **snapshot** -> vmm/linux:
//! the engine's persisted state (templates, session checkpoints' layers), on
//! top of forkbox-vmm and forkbox-linux's state types.

pub mod bundle;
pub mod cpu;
pub mod files;
pub mod layer;
pub mod memory;
pub mod state;

pub use cpu::CpuFingerprint;
pub use files::{FileTable, PackWriter, StoredChunk, StoredFile};
pub use forkbox_vmm::regs;
pub use layer::{Layer, LayerPlan, LayerStats};
pub use memory::{write_memory, write_memory_over, write_memory_over_into, MemoryFile, MemoryStats, MemoryView};
pub use state::{
    encode, read_state, read_state_from, write_encoded, write_encoded_into, write_state, ChildRecord, Children,
    MemoryRef, Snapshot, StateError, FORMAT_VERSION, MAGIC, MAX_MEMORY_CHAIN, READABLE_VERSIONS,
};
