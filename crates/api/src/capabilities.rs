//! What a caller may do on a server (`GET /v1/capabilities`): the templates it
//! may use with their packages (and the names of their secrets), whether and
//! what it may install at run time, its egress policy, its key's secrets (names
//! and destinations, never values) and its limits. The MCP server writes its instructions from it.

use serde::{Deserialize, Serialize};

#[derive(Clone, Debug, Default, Serialize, Deserialize, PartialEq)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct Capabilities {
    /// The templates the caller may use.
    pub templates: Vec<TemplateCapability>,
    /// The default template's name.
    pub default_template: String,
    pub packages: PackagesCapability,
    pub network: NetworkCapability,
    /// The secrets of the caller's key, which every sandbox it makes gets (as
    /// placeholders in environment variables of these names): names and destinations only.
    #[serde(default)]
    pub secrets: Vec<SecretCapability>,
    pub limits: LimitsCapability,
}

/// A secret a sandbox gets: its environment variable holds a placeholder that
/// the server replaces with the value in HTTP headers sent to `hosts` (and
/// `ports`; with `tls`, in HTTPS too). Never the value.
#[derive(Clone, Debug, Default, Serialize, Deserialize, PartialEq)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct SecretCapability {
    pub name: String,
    pub hosts: Vec<String>,
    /// Empty: any port.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub ports: Vec<u16>,
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub tls: bool,
}

#[derive(Clone, Debug, Default, Serialize, Deserialize, PartialEq)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct TemplateCapability {
    pub name: String,
    pub description: String,
    /// `ready`, `available` (built on first use), `building`, `failed`.
    pub status: String,
    /// `shipped`, `custom` or `checkpoint`.
    pub source: String,
    /// Its Debian packages (shipped and custom templates).
    pub packages: Vec<String>,
    /// Its pip requirement specs (custom templates).
    pub pip: Vec<String>,
    /// The names of its secrets (every sandbox forked from it gets them; a
    /// session's or the key's of the same name: the template's wins over the key's).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub secrets: Vec<String>,
}

/// Installing packages into a session at run time (`install_packages`, `%pip install`).
#[derive(Clone, Debug, Default, Serialize, Deserialize, PartialEq)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct PackagesCapability {
    pub allowed: bool,
    /// Only these packages (and their dependencies) may be installed; empty: any.
    pub allow: Vec<String>,
    /// These never.
    pub deny: Vec<String>,
    /// Where the wheels come from, for people (`PyPI`, an index URL, a wheelhouse).
    pub source: String,
}

/// The caller's outbound network: the server's layer and the key's (a request only narrows them).
#[derive(Clone, Debug, Default, Serialize, Deserialize, PartialEq)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct NetworkCapability {
    /// `none` if any layer is `none`, else `allowlist` if any layer is, else `public`.
    pub mode: String,
    /// Each layer for people: `server: public, allow 127.0.0.1:8000`.
    pub layers: Vec<String>,
}

#[derive(Clone, Debug, Default, Serialize, Deserialize, PartialEq)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct LimitsCapability {
    /// Default and largest time limit of an exec, seconds.
    pub timeout_seconds: f64,
    pub max_timeout_seconds: f64,
    /// Default and largest memory of a sandbox, MiB.
    pub memory_mb: u64,
    pub max_memory_mb: u64,
    /// Captured stdout/stderr per stream and exec, bytes.
    pub output_bytes: u64,
    /// The key's: sessions at once, requests per second, CPU seconds per hour (None: no limit).
    pub max_sessions: Option<u64>,
    pub rate_limit: Option<u64>,
    pub cpu_seconds_per_hour: Option<u64>,
}
