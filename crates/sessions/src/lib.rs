//! Sessions that live forever: stateful REPL sessions whose history is a tree
//! of checkpoints (layers over a template snapshot).
//!
//! Place in the flow request -> runtime -> **sessions** -> engine -> vmm/linux -> guest:
//! checkpoints in SQLite or PostgreSQL and layer files over the engine's templates; used only
//! by forkbox-runtime (the front ends never see the store).

pub mod artifacts;
pub mod db;
pub mod host;
pub mod keys;
pub mod lease;
pub mod manager;
pub mod node;
pub mod objects;
pub mod output;
pub mod store;
