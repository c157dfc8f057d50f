use std::time::Duration;

use forkbox_linux::net::NetConfig;

/// Per-sandbox limits, all enforced by the VMM.
#[derive(Clone, Debug, serde::Serialize, serde::Deserialize)]
pub struct Limits {
    /// Guest memory the process may map (mmap + brk + stack + loaded files).
    pub memory_bytes: u64,
    /// Wall-clock time for one exec.
    pub timeout: Duration,
    /// Captured bytes per stream (stdout, stderr) per exec; the rest is dropped and counted.
    pub output_bytes: usize,
    /// Bytes the guest may write into its file-system overlay.
    pub disk_bytes: u64,
    /// Largest code string accepted.
    pub code_bytes: usize,
    /// Egress policy layers, the resolver's static host map, socket and byte
    /// limits. Default: no network (`forkbox serve` defaults to public).
    pub network: NetConfig,
}

impl Default for Limits {
    fn default() -> Self {
        Limits {
            memory_bytes: 2 << 30,
            timeout: Duration::from_secs(30),
            output_bytes: 1 << 20,
            disk_bytes: 1 << 30,
            code_bytes: 1 << 20,
            network: NetConfig::default(),
        }
    }
}
