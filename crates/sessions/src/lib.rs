//! Sessions that live forever: stateful REPL sessions whose history is a tree
//! of checkpoints (layers over a template snapshot).

pub mod manager;
pub mod store;
