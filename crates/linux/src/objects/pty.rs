//! Pseudo-terminals as objects: the master holds the terminal
//! (`crate::tty`), a slave names its master.

use crate::errno::Errno;

use super::{ObjKind, Objects};

impl Objects {
    /// The terminal behind a master or slave object (EIO: the master is gone).
    pub fn pty_mut(&mut self, id: u64) -> Result<&mut crate::tty::Pty, Errno> {
        let master = match self.get(id)?.kind {
            ObjKind::PtySlave(m) => m,
            _ => id,
        };
        match self.map.get_mut(&master).map(|o| &mut o.kind) {
            Some(ObjKind::PtyMaster(p)) => Ok(p),
            Some(_) => Err(Errno::ENOTTY),
            None => Err(Errno::EIO),
        }
    }

    pub fn pty(&self, id: u64) -> Result<&crate::tty::Pty, Errno> {
        let master = match self.get(id)?.kind {
            ObjKind::PtySlave(m) => m,
            _ => id,
        };
        match self.map.get(&master).map(|o| &o.kind) {
            Some(ObjKind::PtyMaster(p)) => Ok(p),
            Some(_) => Err(Errno::ENOTTY),
            None => Err(Errno::EIO),
        }
    }

    /// A new pseudo-terminal (the lowest free index): its master's object.
    pub fn new_pty(&mut self) -> Result<u64, Errno> {
        let used: std::collections::BTreeSet<u32> = self.ptys().map(|(_, p)| p.index).collect();
        let index = (0..crate::tty::MAX_PTYS).find(|i| !used.contains(i)).ok_or(Errno::ENOSPC)?;
        Ok(self.add(ObjKind::PtyMaster(Box::new(crate::tty::Pty::new(index)))))
    }

    /// Every open pseudo-terminal: (master object, terminal).
    pub fn ptys(&self) -> impl Iterator<Item = (u64, &crate::tty::Pty)> + '_ {
        self.map.iter().filter_map(|(id, o)| match &o.kind {
            ObjKind::PtyMaster(p) => Some((*id, &**p)),
            _ => None,
        })
    }

    /// The slave object of pty `master` (made on its first open).
    pub fn pty_slave(&mut self, master: u64) -> Result<u64, Errno> {
        if let Some(s) = self.pty(master)?.slave {
            return Ok(s);
        }
        let s = self.add(ObjKind::PtySlave(master));
        let p = self.pty_mut(master)?;
        p.slave = Some(s);
        p.slave_closed = false;
        Ok(s)
    }
}
