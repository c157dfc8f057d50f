//! Sandbox workers (issue 16): the VMM of one-shot execs runs in worker
//! processes separate from the API process, each jailed before it reads any
//! guest input.
//!
//! Place in the flow: runtime -> **worker** (supervisor side) -> worker process
//! (child side) -> engine -> vmm/linux -> guest.
//!
//! - [`supervisor`]: one worker per exec thread, started by a launcher thread,
//!   restarted when it dies; an exec it held fails with `sandbox_crashed`.
//! - [`protocol`]: typed, length-prefixed JSON frames on a Unix socket.
//! - [`child`]: the worker's main (`forkbox __worker`): jail, then serve.
//! - [`jail`]: cgroup, namespaces, pivot_root, an unprivileged uid, no
//!   capabilities, NO_NEW_PRIVS, rlimits; then the engine's seccomp filter.
//!
//! What a worker gets: the template's image and snapshot, read-only, by path
//! inside its jail (the data directory's `images`, `templates` and `packages`
//! only); limits and code in the request. What it never has: `keys.db`, the
//! sessions directory, the listening socket, write access to any file.

pub mod child;
pub mod jail;
pub mod protocol;
pub mod supervisor;

pub use protocol::{NetDelta, TemplateRef, WireError, TEST_FORBIDDEN_SYSCALL};
pub use supervisor::{Config, Remote, WorkerError, WorkerInfo, Workers};
