//! inotify instances as objects (their watches and events are the file system's).

use serde::{Deserialize, Serialize};

/// An inotify instance's object: which change journal holds its watches
/// (the journal's number; 0: none yet). A state file keeps only this, so an
/// instance restored from a checkpoint has no watches.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Inotify {
    pub epoch: u64,
}

/// Open inotify instances in a sandbox (Linux's max_user_instances default): EMFILE past it.
pub const MAX_INOTIFY_INSTANCES: usize = 128;
