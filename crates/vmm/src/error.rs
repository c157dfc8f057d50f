use thiserror::Error;

/// Errors of the VMM layer; each names the failing ioctl or syscall.
#[derive(Debug, Error)]
pub enum VmmError {
    #[error("cannot open /dev/kvm: {0} (forkbox needs KVM: is /dev/kvm present and accessible?)")]
    OpenKvm(#[source] kvm_ioctls::Error),
    #[error("{ioctl} failed: {source}")]
    Kvm {
        ioctl: &'static str,
        #[source]
        source: kvm_ioctls::Error,
    },
    #[error("{call} failed: {source}")]
    Sys {
        call: &'static str,
        #[source]
        source: std::io::Error,
    },
    #[error("guest RAM size {0:#x} is invalid (must be a multiple of 1 GiB, 1..=64 GiB)")]
    BadRamSize(u64),
    #[error("guest address range {addr:#x}+{len:#x} is outside guest memory")]
    OutOfRange { addr: u64, len: u64 },
}

impl VmmError {
    pub(crate) fn kvm(ioctl: &'static str) -> impl FnOnce(kvm_ioctls::Error) -> VmmError {
        move |source| VmmError::Kvm { ioctl, source }
    }
    pub(crate) fn last_os(call: &'static str) -> VmmError {
        VmmError::Sys { call, source: std::io::Error::last_os_error() }
    }
}

pub type Result<T> = std::result::Result<T, VmmError>;
