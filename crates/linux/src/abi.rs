//! Linux x86-64 structures the kernel writes into guest memory, as
//! `#[repr(C)]` types without implicit padding (explicit `_pad` fields), so
//! their bytes are their layout (`zerocopy::IntoBytes`). The tests check every
//! field's offset against the C definitions in the libc crate.

use zerocopy::{Immutable, IntoBytes};

/// `struct stat` (fstat, stat, lstat, newfstatat).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, IntoBytes, Immutable)]
#[repr(C)]
pub struct Stat {
    pub dev: u64,
    pub ino: u64,
    pub nlink: u64,
    pub mode: u32,
    pub uid: u32,
    pub gid: u32,
    pub _pad0: u32,
    pub rdev: u64,
    pub size: i64,
    pub blksize: i64,
    pub blocks: i64,
    pub atime: i64,
    pub atime_nsec: i64,
    pub mtime: i64,
    pub mtime_nsec: i64,
    pub ctime: i64,
    pub ctime_nsec: i64,
    pub _unused: [i64; 3],
}

/// `struct statfs` (statfs, fstatfs).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, IntoBytes, Immutable)]
#[repr(C)]
pub struct Statfs {
    pub fs_type: i64,
    pub bsize: i64,
    pub blocks: u64,
    pub bfree: u64,
    pub bavail: u64,
    pub files: u64,
    pub ffree: u64,
    pub fsid: [i32; 2],
    pub namelen: i64,
    pub frsize: i64,
    pub flags: i64,
    pub spare: [i64; 4],
}

/// `struct sysinfo`.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, IntoBytes, Immutable)]
#[repr(C)]
pub struct Sysinfo {
    pub uptime: i64,
    pub loads: [u64; 3],
    pub totalram: u64,
    pub freeram: u64,
    pub sharedram: u64,
    pub bufferram: u64,
    pub totalswap: u64,
    pub freeswap: u64,
    pub procs: u16,
    pub _pad: u16,
    pub _pad2: u32,
    pub totalhigh: u64,
    pub freehigh: u64,
    pub mem_unit: u32,
    pub _f: [u8; 4],
}

#[cfg(test)]
mod tests {
    use std::mem::{offset_of, size_of};

    use zerocopy::IntoBytes;

    use super::*;

    #[test]
    fn stat_matches_the_c_layout() {
        assert_eq!(size_of::<Stat>(), size_of::<libc::stat>());
        assert_eq!(size_of::<Stat>(), 144);
        assert_eq!(offset_of!(Stat, dev), offset_of!(libc::stat, st_dev));
        assert_eq!(offset_of!(Stat, ino), offset_of!(libc::stat, st_ino));
        assert_eq!(offset_of!(Stat, nlink), offset_of!(libc::stat, st_nlink));
        assert_eq!(offset_of!(Stat, mode), offset_of!(libc::stat, st_mode));
        assert_eq!(offset_of!(Stat, uid), offset_of!(libc::stat, st_uid));
        assert_eq!(offset_of!(Stat, gid), offset_of!(libc::stat, st_gid));
        assert_eq!(offset_of!(Stat, rdev), offset_of!(libc::stat, st_rdev));
        assert_eq!(offset_of!(Stat, size), offset_of!(libc::stat, st_size));
        assert_eq!(offset_of!(Stat, blksize), offset_of!(libc::stat, st_blksize));
        assert_eq!(offset_of!(Stat, blocks), offset_of!(libc::stat, st_blocks));
        assert_eq!(offset_of!(Stat, atime), offset_of!(libc::stat, st_atime));
        assert_eq!(offset_of!(Stat, atime_nsec), offset_of!(libc::stat, st_atime_nsec));
        assert_eq!(offset_of!(Stat, mtime), offset_of!(libc::stat, st_mtime));
        assert_eq!(offset_of!(Stat, mtime_nsec), offset_of!(libc::stat, st_mtime_nsec));
        assert_eq!(offset_of!(Stat, ctime), offset_of!(libc::stat, st_ctime));
        assert_eq!(offset_of!(Stat, ctime_nsec), offset_of!(libc::stat, st_ctime_nsec));
    }

    #[test]
    fn statfs_matches_the_c_layout() {
        assert_eq!(size_of::<Statfs>(), size_of::<libc::statfs>());
        assert_eq!(size_of::<Statfs>(), 120);
        assert_eq!(offset_of!(Statfs, fs_type), offset_of!(libc::statfs, f_type));
        assert_eq!(offset_of!(Statfs, bsize), offset_of!(libc::statfs, f_bsize));
        assert_eq!(offset_of!(Statfs, blocks), offset_of!(libc::statfs, f_blocks));
        assert_eq!(offset_of!(Statfs, bfree), offset_of!(libc::statfs, f_bfree));
        assert_eq!(offset_of!(Statfs, bavail), offset_of!(libc::statfs, f_bavail));
        assert_eq!(offset_of!(Statfs, files), offset_of!(libc::statfs, f_files));
        assert_eq!(offset_of!(Statfs, ffree), offset_of!(libc::statfs, f_ffree));
        assert_eq!(offset_of!(Statfs, fsid), offset_of!(libc::statfs, f_fsid));
        assert_eq!(offset_of!(Statfs, namelen), offset_of!(libc::statfs, f_namelen));
        assert_eq!(offset_of!(Statfs, frsize), offset_of!(libc::statfs, f_frsize));
    }

    #[test]
    fn sysinfo_matches_the_c_layout() {
        assert_eq!(size_of::<Sysinfo>(), size_of::<libc::sysinfo>());
        assert_eq!(size_of::<Sysinfo>(), 112);
        assert_eq!(offset_of!(Sysinfo, uptime), offset_of!(libc::sysinfo, uptime));
        assert_eq!(offset_of!(Sysinfo, loads), offset_of!(libc::sysinfo, loads));
        assert_eq!(offset_of!(Sysinfo, totalram), offset_of!(libc::sysinfo, totalram));
        assert_eq!(offset_of!(Sysinfo, freeram), offset_of!(libc::sysinfo, freeram));
        assert_eq!(offset_of!(Sysinfo, sharedram), offset_of!(libc::sysinfo, sharedram));
        assert_eq!(offset_of!(Sysinfo, bufferram), offset_of!(libc::sysinfo, bufferram));
        assert_eq!(offset_of!(Sysinfo, totalswap), offset_of!(libc::sysinfo, totalswap));
        assert_eq!(offset_of!(Sysinfo, freeswap), offset_of!(libc::sysinfo, freeswap));
        assert_eq!(offset_of!(Sysinfo, procs), offset_of!(libc::sysinfo, procs));
        assert_eq!(offset_of!(Sysinfo, totalhigh), offset_of!(libc::sysinfo, totalhigh));
        assert_eq!(offset_of!(Sysinfo, freehigh), offset_of!(libc::sysinfo, freehigh));
        assert_eq!(offset_of!(Sysinfo, mem_unit), offset_of!(libc::sysinfo, mem_unit));
    }

    #[test]
    fn the_bytes_are_little_endian_fields_at_their_offsets() {
        let st = Stat { ino: 0x1122, size: 4097, mode: 0o100644, ..Default::default() };
        let b = st.as_bytes();
        assert_eq!(&b[8..16], &0x1122u64.to_le_bytes());
        assert_eq!(&b[24..28], &0o100644u32.to_le_bytes());
        assert_eq!(&b[48..56], &4097i64.to_le_bytes());
        let si = Sysinfo { procs: 3, mem_unit: 1, ..Default::default() };
        assert_eq!(&si.as_bytes()[80..82], &3u16.to_le_bytes());
        assert_eq!(&si.as_bytes()[104..108], &1u32.to_le_bytes());
    }
}
