//! Packages installed into a session at run time (`POST /v1/sessions/{id}/packages`).

use serde::{Deserialize, Serialize};

/// `POST /v1/sessions/{id}/packages`: packages to install into the session.
#[derive(Clone, Debug, PartialEq, Deserialize, Serialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(deny_unknown_fields)]
pub struct InstallPackages {
    /// pip requirement specs: a name with optional extras and version
    /// constraints (`fbxdemo==1.0`, `requests[socks]>=2`); no options, paths or URLs.
    /// Binary wheels only, from the server's package index or wheelhouse.
    pub packages: Vec<String>,
}

/// One distribution of an install (the requested ones and their dependencies).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct InstalledPackage {
    pub name: String,
    pub version: String,
    /// The wheel's file name.
    pub wheel: String,
    /// The wheel's sha256: the id of the shared, read-only layer the session mounts.
    pub sha256: String,
    /// False: the session had it already (same version).
    pub installed: bool,
    /// Files the package added to the session's file system.
    pub files: u64,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct InstalledPackages {
    pub packages: Vec<InstalledPackage>,
    /// What pip would have printed.
    pub output: String,
    /// Seq of the checkpoint that records the install (null: nothing was new).
    pub checkpoint: Option<i64>,
}
