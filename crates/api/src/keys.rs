//! The admin key routes' own vocabulary (`/v1/admin/keys`): the limits a new
//! key is given and how a key's limits are shown, and one page of the key list.
//! A key's secrets are shown as names and destinations only, never values.

use serde::{Deserialize, Serialize};

/// The most keys one page of `GET /v1/admin/keys` holds (also its default).
pub const KEYS_PAGE_MAX: usize = 1000;

/// The limits of a new key (`POST /v1/admin/keys`), as `forkbox key create`
/// takes them: each one not given takes its default (20 requests/s, 100
/// sessions, 1024 MiB of checkpoints, the server's share of its exec slots,
/// 3600 CPU seconds per hour, 60 s timeouts), or none with `unlimited`.
#[derive(Clone, Debug, Default, Serialize, Deserialize, PartialEq, Eq)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(deny_unknown_fields)]
pub struct NewKeyLimits {
    /// Requests per second (token bucket; also the burst), 1 to 4294967295.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub rate_limit: Option<u64>,
    /// Sessions the tenant may have at once (at least 1).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_sessions: Option<u64>,
    /// Checkpoint disk of the tenant's sessions, MiB (at least 1).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_disk_mb: Option<u64>,
    /// Execs of the key running at once; 0: every exec slot (at most 1048576).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_concurrency: Option<u64>,
    /// Guest CPU seconds per hour (at least 1).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cpu_seconds_per_hour: Option<u64>,
    /// Largest `timeout_seconds` the key may ask for (at least 1).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_timeout_seconds: Option<u64>,
    /// No limits but those given here (default false).
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub unlimited: bool,
}

/// A key's limits as stored: null is no limit (`max_concurrency` null: the
/// server's default share of its exec slots; 0: every slot).
#[derive(Clone, Debug, Default, Serialize, Deserialize, PartialEq, Eq)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct KeyLimitsView {
    pub rate_limit: Option<u64>,
    pub max_sessions: Option<u64>,
    pub max_disk_mb: Option<u64>,
    pub max_concurrency: Option<u64>,
    pub cpu_seconds_per_hour: Option<u64>,
    pub max_timeout_seconds: Option<u64>,
}
