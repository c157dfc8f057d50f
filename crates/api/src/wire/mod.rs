//! The request and response bodies of forkbox's own `/v1` HTTP API, defined
//! once: the server takes and returns them (and derives its OpenAPI document
//! from them, with the `openapi` feature), the client sends and reads them.
//! Fields and defaults are the server's wire behaviour; the ForeverVM and E2B
//! protocols keep their own types beside their handlers.

pub mod commands;
pub mod errors;
pub mod exec;
pub mod files;
pub mod network;
pub mod packages;
pub mod processes;
pub mod server;
pub mod sessions;
pub mod templates;
pub mod tree;
