//! A process' credentials: real, effective, saved and file-system user and
//! group ids and the supplementary groups, with Linux's rules for changing
//! them (kernel/sys.c: setuid, setreuid, setresuid, setfsuid and the gid
//! forms, setgroups).
//!
//! The sandbox's own model: every process starts as root (all ids 0, no
//! supplementary groups); a process is privileged (CAP_SETUID/CAP_SETGID)
//! while its effective uid is 0, which is what Linux's capability rules come
//! to without file capabilities or securebits (permitted capabilities go when
//! no uid is 0 any more, effective ones while the euid is not 0). Credentials
//! are inherited by fork, kept by execve (no set-user-id programs) and
//! reported (get*id, /proc/self/status, AT_UID..AT_EGID); the file system has
//! one owner (0:0) and checks no access against them.

use std::sync::Arc;

use crate::errno::Errno;

/// Most supplementary groups a process may have (Linux's NGROUPS_MAX).
pub const NGROUPS_MAX: usize = 65536;
/// The id argument that means "leave it as it is" ((uid_t)-1), and is no id.
pub const KEEP: u32 = u32::MAX;

/// One kind of id (user or group): real, effective, saved set-id, file system.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Ids {
    pub real: u32,
    pub effective: u32,
    pub saved: u32,
    pub fs: u32,
}

impl Ids {
    fn is_current(&self, id: u32) -> bool {
        id == self.real || id == self.effective || id == self.saved
    }

    /// setuid/setgid: a privileged caller sets real, effective and saved;
    /// another may set the effective id to its real or saved one.
    pub fn set(&mut self, id: u32, privileged: bool) -> Result<(), Errno> {
        if id == KEEP {
            return Err(Errno::EINVAL);
        }
        if privileged {
            self.real = id;
            self.saved = id;
        } else if id != self.real && id != self.saved {
            return Err(Errno::EPERM);
        }
        self.effective = id;
        self.fs = id;
        Ok(())
    }

    /// setreuid/setregid (`KEEP`: unchanged). Unprivileged, the real id may
    /// become the real or effective one and the effective id any of the three.
    /// The saved id follows the new effective id when the real id is set or
    /// the effective one becomes other than the old real id.
    pub fn set_re(&mut self, real: u32, effective: u32, privileged: bool) -> Result<(), Errno> {
        let old = *self;
        let mut new = old;
        if real != KEEP {
            if !privileged && real != old.real && real != old.effective {
                return Err(Errno::EPERM);
            }
            new.real = real;
        }
        if effective != KEEP {
            if !privileged && !old.is_current(effective) {
                return Err(Errno::EPERM);
            }
            new.effective = effective;
        }
        if real != KEEP || (effective != KEEP && effective != old.real) {
            new.saved = new.effective;
        }
        new.fs = new.effective;
        *self = new;
        Ok(())
    }

    /// setresuid/setresgid (`KEEP`: unchanged). Unprivileged, each new id
    /// must be one of the current real, effective and saved ids.
    pub fn set_res(&mut self, real: u32, effective: u32, saved: u32, privileged: bool) -> Result<(), Errno> {
        let asked = [real, effective, saved];
        if !privileged && asked.iter().any(|&id| id != KEEP && !self.is_current(id)) {
            return Err(Errno::EPERM);
        }
        for (slot, id) in [&mut self.real, &mut self.effective, &mut self.saved].into_iter().zip(asked) {
            if id != KEEP {
                *slot = id;
            }
        }
        self.fs = self.effective;
        Ok(())
    }

    /// setfsuid/setfsgid: always returns the old file-system id; sets it if
    /// privileged or if it is one of the real, effective, saved or fs ids.
    pub fn set_fs(&mut self, id: u32, privileged: bool) -> u32 {
        let old = self.fs;
        if id != KEEP && (privileged || self.is_current(id) || id == self.fs) {
            self.fs = id;
        }
        old
    }
}

#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Creds {
    pub uid: Ids,
    pub gid: Ids,
    /// Supplementary groups, sorted (as Linux keeps them; getgroups returns this order).
    pub groups: Arc<[u32]>,
}

impl Creds {
    /// CAP_SETUID and CAP_SETGID: held while the effective uid is 0.
    pub fn privileged(&self) -> bool {
        self.uid.effective == 0
    }

    /// setgroups: privileged only (EPERM first, as Linux); at most `NGROUPS_MAX`.
    pub fn set_groups(&mut self, mut groups: Vec<u32>) -> Result<(), Errno> {
        if !self.privileged() {
            return Err(Errno::EPERM);
        }
        if groups.len() > NGROUPS_MAX {
            return Err(Errno::EINVAL);
        }
        groups.sort_unstable();
        self.groups = groups.into();
        Ok(())
    }

    /// Check credentials read from a state file.
    pub fn validate(&self) -> Result<(), String> {
        if self.groups.len() > NGROUPS_MAX {
            return Err(format!("{} supplementary groups", self.groups.len()));
        }
        if self.groups.windows(2).any(|w| w[0] > w[1]) {
            return Err("supplementary groups not sorted".into());
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ids(real: u32, effective: u32, saved: u32) -> Ids {
        Ids { real, effective, saved, fs: effective }
    }

    #[test]
    fn setuid_as_root_sets_all_and_unprivileged_only_the_effective_id() {
        let mut u = Ids::default();
        u.set(65534, true).unwrap();
        assert_eq!(u, ids(65534, 65534, 65534));
        // Not privileged any more: only real/saved ids, and -1 is no id.
        assert_eq!(u.set(0, false), Err(Errno::EPERM));
        assert_eq!(u.set(KEEP, true), Err(Errno::EINVAL));
        let mut u = ids(1000, 0, 2000);
        u.set(2000, false).unwrap();
        assert_eq!(u, ids(1000, 2000, 2000));
        assert_eq!(u.set(3000, false), Err(Errno::EPERM));
        assert_eq!(u, ids(1000, 2000, 2000), "a refused call changes nothing");
    }

    #[test]
    fn setreuid_rules_and_the_saved_id() {
        // Root drops its effective uid only: the saved id keeps 0, so it can come back.
        let mut u = Ids::default();
        u.set_re(KEEP, 1000, true).unwrap();
        assert_eq!(u, ids(0, 1000, 1000), "euid other than the old ruid sets the saved id");
        let mut u = Ids::default();
        u.set_re(KEEP, 0, true).unwrap();
        assert_eq!(u, ids(0, 0, 0));
        // Swapping real and effective (the classic unprivileged use).
        let mut u = ids(1000, 2000, 2000);
        u.set_re(2000, 1000, false).unwrap();
        assert_eq!(u, ids(2000, 1000, 1000));
        // Unprivileged: the real id may not become the saved one, nor anything else.
        let mut u = ids(1000, 2000, 3000);
        assert_eq!(u.set_re(3000, KEEP, false), Err(Errno::EPERM));
        assert_eq!(u.set_re(KEEP, 4000, false), Err(Errno::EPERM));
        u.set_re(KEEP, 3000, false).unwrap();
        assert_eq!(u, ids(1000, 3000, 3000));
        assert_eq!(u.fs, 3000);
    }

    #[test]
    fn setresuid_rules() {
        let mut u = Ids::default();
        u.set_res(1, 2, 3, true).unwrap();
        assert_eq!(u, ids(1, 2, 3));
        assert_eq!(u.set_res(0, KEEP, KEEP, false), Err(Errno::EPERM));
        u.set_res(3, 1, KEEP, false).unwrap();
        assert_eq!(u, ids(3, 1, 3));
        u.set_res(KEEP, KEEP, KEEP, false).unwrap();
        assert_eq!(u, ids(3, 1, 3));
    }

    #[test]
    fn setfsuid_returns_the_old_id() {
        let mut u = ids(1000, 1000, 1000);
        assert_eq!(u.set_fs(0, false), 1000);
        assert_eq!(u.fs, 1000, "not privileged and 0 is none of its ids");
        assert_eq!(u.set_fs(KEEP, false), 1000);
        let mut r = Ids::default();
        assert_eq!(r.set_fs(5, true), 0);
        assert_eq!(r.set_fs(0, true), 5);
    }

    #[test]
    fn setgroups_needs_privilege_and_is_bounded() {
        let mut c = Creds::default();
        c.set_groups(vec![30, 10, 20, 10]).unwrap();
        assert_eq!(&*c.groups, &[10, 10, 20, 30]);
        assert_eq!(c.set_groups(vec![0; NGROUPS_MAX + 1]), Err(Errno::EINVAL));
        c.uid.set(1000, true).unwrap();
        assert_eq!(c.set_groups(vec![]), Err(Errno::EPERM));
        assert_eq!(c.set_groups(vec![0; NGROUPS_MAX + 1]), Err(Errno::EPERM), "privilege is checked first");
        assert_eq!(&*c.groups, &[10, 10, 20, 30]);
        c.validate().unwrap();
        c.groups = vec![2, 1].into();
        assert!(c.validate().is_err());
    }
}
