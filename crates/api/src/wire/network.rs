//! A sandbox's outbound network as requests ask for it (`network` of execs,
//! commands, sessions and templates).

use serde::{Deserialize, Serialize};

/// A sandbox's outbound network. `"none"`: no network; `"public"`: the
/// public internet, every non-public address (loopback, private, link-local
/// and the metadata endpoints, CGNAT, multicast, the host's own addresses)
/// refused; `{"allow": [...], "deny": [...]}`: only what `allow` names (rules:
/// `10.0.0.0/8`, `1.2.3.4`, `[::1]:8080`, `example.com`, `*.example.com:443`,
/// `*:25`); `{"mode": "none" | "public", "max_bytes_per_second": N}`: a mode
/// with a bandwidth limit (`max_bytes_per_second` also goes with `allow`): bytes
/// per second through the sandbox's host sockets, both directions together.
/// It only narrows the server's policy (the default: the server's,
/// `public` unless `forkbox serve --egress` says otherwise); a host-name rule
/// never opens a non-public address; the smallest bandwidth of all layers holds.
#[derive(Clone, Debug, PartialEq, Eq, Deserialize, Serialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(untagged, deny_unknown_fields)]
pub enum NetworkSetting {
    Mode(NetworkMode),
    Rules {
        allow: Vec<String>,
        #[serde(default, skip_serializing_if = "Vec::is_empty")]
        deny: Vec<String>,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        max_bytes_per_second: Option<u64>,
    },
    Limited {
        mode: NetworkMode,
        max_bytes_per_second: u64,
    },
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Deserialize, Serialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(rename_all = "lowercase")]
pub enum NetworkMode {
    None,
    Public,
}

impl NetworkSetting {
    pub const NONE: NetworkSetting = NetworkSetting::Mode(NetworkMode::None);
    pub const PUBLIC: NetworkSetting = NetworkSetting::Mode(NetworkMode::Public);

    /// Only what `allow` names (minus `deny`).
    pub fn allowlist(allow: impl IntoIterator<Item = impl Into<String>>) -> NetworkSetting {
        NetworkSetting::Rules {
            allow: allow.into_iter().map(Into::into).collect(),
            deny: Vec::new(),
            max_bytes_per_second: None,
        }
    }

    /// This setting with a bandwidth limit (bytes per second); None: without one.
    pub fn with_rate(self, bytes_per_second: Option<u64>) -> NetworkSetting {
        match (self, bytes_per_second) {
            (NetworkSetting::Mode(mode) | NetworkSetting::Limited { mode, .. }, Some(r)) => {
                NetworkSetting::Limited { mode, max_bytes_per_second: r }
            }
            (NetworkSetting::Mode(mode) | NetworkSetting::Limited { mode, .. }, None) => NetworkSetting::Mode(mode),
            (NetworkSetting::Rules { allow, deny, .. }, r) => {
                NetworkSetting::Rules { allow, deny, max_bytes_per_second: r }
            }
        }
    }

    /// A setting from command-line style parts: `mode` `none`, `public` or
    /// `allowlist`, and rules (which need `allowlist`; rules without a mode
    /// mean `allowlist`). None when nothing is given. Add a bandwidth with
    /// [`NetworkSetting::with_rate`].
    pub fn from_parts(mode: Option<&str>, allow: &[String], deny: &[String]) -> Result<Option<NetworkSetting>, String> {
        let rules = !allow.is_empty() || !deny.is_empty();
        match mode {
            None if !rules => Ok(None),
            None | Some("allowlist") => Ok(Some(NetworkSetting::Rules {
                allow: allow.to_vec(),
                deny: deny.to_vec(),
                max_bytes_per_second: None,
            })),
            Some(m @ ("none" | "public")) if rules => {
                Err(format!("network {m} takes no allow/deny rules (rules mean an allowlist)"))
            }
            Some("none") => Ok(Some(NetworkSetting::NONE)),
            Some("public") => Ok(Some(NetworkSetting::PUBLIC)),
            Some(other) => Err(format!("unknown network mode {other:?} (none, public, allowlist)")),
        }
    }
}
