//! Sandbox workers: the VMM — of one-shot execs and of sessions —
//! runs in worker processes separate from the API process, each jailed
//! before it reads any guest input.
//!
//! Place in the flow: runtime -> **worker** (supervisor side) -> worker process
//! (child side) -> engine -> vmm/linux -> guest. For sessions the supervisor
//! side is the sessions' `SandboxHost` (runtime -> sessions -> host trait,
//! implemented here: the edge points down, from this crate to `sessions`).
//!
//! - [`supervisor`]: one exec worker per exec thread, started by a launcher
//!   thread, restarted when it dies; an exec it held fails with `sandbox_crashed`.
//! - [`sessions`]: session workers, one per tenant, one socket and thread per
//!   sandbox; checkpoint files passed as descriptors.
//! - [`protocol`]: typed, length-prefixed JSON frames on Unix sockets (with
//!   SCM_RIGHTS descriptors from the API process to a session worker).
//! - [`child`]: the worker's main (`forkbox __worker`): jail, then serve.
//! - [`broker`]: the egress broker (API process side: the policy of each
//!   sandbox, host sockets opened and passed back) and the worker's brokered egress.
//! - [`jail`]: cgroup, namespaces, pivot_root, an unprivileged uid, no
//!   capabilities, NO_NEW_PRIVS, rlimits; then the engine's worker seccomp filter.
//!
//! What a worker gets: the template's image and snapshot, read-only, by path
//! inside its jail (the data directory's `images`, `templates` and `packages`
//! only); limits and code in the request; for sessions, the descriptors of
//! the checkpoint files one request needs (read-only ones to bring a
//! checkpoint back, new temp files to write one into). What it never has:
//! `keys.db`, a path of the sessions directory, the listening socket, a file
//! it can write that it was not given.

pub mod broker;
pub mod child;
pub mod jail;
pub mod protocol;
mod session_child;
pub mod sessions;
pub mod supervisor;

pub use protocol::{NetDelta, Role, TemplateRef, WireError, TEST_FORBIDDEN_SYSCALL};
pub use sessions::{SessionWorkers, EXEC_CODES};
pub use supervisor::{Config, Remote, WorkerError, WorkerInfo, Workers};
