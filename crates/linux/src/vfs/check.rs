//! The VFS invariant check on a live `Vfs`: its saved state must pass every
//! consistency check `restore_state` makes (entries, link counts, parents,
//! reachability, byte accounting). The syscall fuzzer runs it after every chunk.

use super::{Vfs, VfsStateError};

impl Vfs {
    /// `Ok` when the overlay is one a restore would accept.
    pub fn check_invariants(&self) -> Result<(), VfsStateError> {
        Vfs::restore_state(self.image.clone(), self.save_state()).map(|_| ())
    }
}
