//! `forkbox mcp install`: the configuration snippet that makes an MCP client
//! (Claude Desktop, Cursor, Windsurf, Goose) run `forkbox mcp`, and merging it into the
//! client's config file without touching the other servers configured there; for
//! Claude Code, the `claude mcp add` command that registers it.

use std::path::{Path, PathBuf};

use serde_json::{json, Value};

/// The MCP clients `forkbox mcp install` knows.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum McpClient {
    Claude,
    Cursor,
    Windsurf,
    Goose,
    /// Claude Code: configured by its own command (`claude mcp add`), not by a file written here.
    ClaudeCode,
}

/// How the client should start forkbox.
#[derive(Clone, Debug)]
pub struct Launch {
    /// Absolute path of the `forkbox` binary.
    pub program: PathBuf,
    /// `--home` to pass, if not the default data directory.
    pub home: Option<PathBuf>,
    /// Remote server (`--url`).
    pub url: Option<String>,
    /// The API key for `url` (`FORKBOX_API_KEY` of the entry); None: a placeholder to fill in.
    pub key: Option<String>,
}

/// The placeholder written for the key when none was given.
pub const KEY_PLACEHOLDER: &str = "<your forkbox API key>";

#[derive(Debug, thiserror::Error)]
pub enum InstallError {
    #[error("reading {path}: {source}")]
    Read { path: PathBuf, source: std::io::Error },
    #[error("{path} is not valid {format}: {message}; fix or move it, nothing was written")]
    Parse { path: PathBuf, format: &'static str, message: String },
    #[error("{path}: {what} is not a {expected}; nothing was written")]
    Shape { path: PathBuf, what: String, expected: &'static str },
    #[error("writing {path}: {source}")]
    Write { path: PathBuf, source: std::io::Error },
    #[error("no home directory to find the client's config file in")]
    NoHome,
    #[error("Claude Code keeps its own configuration: run the `claude mcp add` command instead")]
    NoFile,
}

/// The server's name in the client's config.
pub const SERVER_NAME: &str = "forkbox";

impl McpClient {
    /// The client's config file under the user's home directory.
    /// None for Claude Code (its `claude` command keeps its configuration).
    pub fn config_path(self, user_home: &Path) -> Option<PathBuf> {
        match self {
            McpClient::Claude => Some(user_home.join(".config/Claude/claude_desktop_config.json")),
            McpClient::Cursor => Some(user_home.join(".cursor/mcp.json")),
            McpClient::Windsurf => Some(user_home.join(".codeium/windsurf/mcp_config.json")),
            McpClient::Goose => Some(user_home.join(".config/goose/config.yaml")),
            McpClient::ClaudeCode => None,
        }
    }
}

impl Launch {
    fn args(&self) -> Vec<String> {
        let mut a = Vec::new();
        if let Some(h) = &self.home {
            a.push("--home".to_string());
            a.push(h.display().to_string());
        }
        a.push("mcp".to_string());
        if let Some(u) = &self.url {
            a.push("--url".to_string());
            a.push(u.clone());
        }
        a
    }

    fn env(&self) -> Value {
        if self.url.is_some() {
            json!({ "FORKBOX_API_KEY": self.key.as_deref().unwrap_or(KEY_PLACEHOLDER) })
        } else {
            json!({})
        }
    }

    /// `claude mcp add ...` for Claude Code, as argv (without the leading `claude`).
    pub fn claude_code_args(&self) -> Vec<String> {
        let mut a: Vec<String> = ["mcp", "add", "--scope", "user"].iter().map(|s| s.to_string()).collect();
        if self.url.is_some() {
            a.push("-e".into());
            a.push(format!("FORKBOX_API_KEY={}", self.key.as_deref().unwrap_or(KEY_PLACEHOLDER)));
        }
        a.push(SERVER_NAME.into());
        a.push("--".into());
        a.push(self.program.display().to_string());
        a.extend(self.args());
        a
    }

    /// The server entry for Claude Desktop / Cursor (`mcpServers.forkbox`).
    fn json_entry(&self) -> Value {
        let mut e = json!({ "command": self.program.display().to_string(), "args": self.args() });
        if self.url.is_some() {
            e["env"] = self.env();
        }
        e
    }

    /// The extension entry for Goose (`extensions.forkbox`).
    fn goose_entry(&self) -> yaml_serde::Value {
        let v = json!({
            "name": SERVER_NAME,
            "type": "stdio",
            "cmd": self.program.display().to_string(),
            "args": self.args(),
            "envs": self.env(),
            "enabled": true,
            "timeout": 300,
            "description": "Run Python in forkbox sandboxes",
        });
        yaml_serde::to_value(v).unwrap_or(yaml_serde::Value::Null)
    }
}

/// The snippet to paste into the client's config (what `install` prints).
pub fn snippet(client: McpClient, launch: &Launch) -> String {
    match client {
        McpClient::ClaudeCode => {
            let words: Vec<String> = std::iter::once("claude".to_string())
                .chain(launch.claude_code_args())
                .map(|w| shell_quote(&w))
                .collect();
            words.join(" ") + "\n"
        }
        McpClient::Claude | McpClient::Cursor | McpClient::Windsurf => {
            let v = json!({ "mcpServers": { SERVER_NAME: launch.json_entry() } });
            serde_json::to_string_pretty(&v).unwrap_or_default()
        }
        McpClient::Goose => {
            let mut ext = yaml_serde::Mapping::new();
            ext.insert(SERVER_NAME.into(), launch.goose_entry());
            let mut top = yaml_serde::Mapping::new();
            top.insert("extensions".into(), yaml_serde::Value::Mapping(ext));
            yaml_serde::to_string(&top).unwrap_or_default()
        }
    }
}

/// `existing` (the config file's text, if any) with the forkbox entry added or
/// replaced; every other key and server is kept.
pub fn merge(client: McpClient, existing: Option<&str>, launch: &Launch, path: &Path) -> Result<String, InstallError> {
    let text = existing.filter(|t| !t.trim().is_empty());
    match client {
        McpClient::ClaudeCode => Err(InstallError::NoFile),
        McpClient::Claude | McpClient::Cursor | McpClient::Windsurf => {
            let mut root: Value = match text {
                Some(t) => serde_json::from_str(t).map_err(|e| InstallError::Parse {
                    path: path.into(),
                    format: "JSON",
                    message: e.to_string(),
                })?,
                None => json!({}),
            };
            let obj = root.as_object_mut().ok_or_else(|| shape(path, "the top level", "JSON object"))?;
            let servers = obj.entry("mcpServers").or_insert_with(|| json!({}));
            let servers = servers.as_object_mut().ok_or_else(|| shape(path, "`mcpServers`", "JSON object"))?;
            servers.insert(SERVER_NAME.into(), launch.json_entry());
            Ok(serde_json::to_string_pretty(&root).unwrap_or_default() + "\n")
        }
        McpClient::Goose => {
            let mut root: yaml_serde::Value = match text {
                Some(t) => yaml_serde::from_str(t).map_err(|e| InstallError::Parse {
                    path: path.into(),
                    format: "YAML",
                    message: e.to_string(),
                })?,
                None => yaml_serde::Value::Mapping(Default::default()),
            };
            let top = root.as_mapping_mut().ok_or_else(|| shape(path, "the top level", "YAML mapping"))?;
            let exts = top.entry("extensions".into()).or_insert_with(|| yaml_serde::Value::Mapping(Default::default()));
            if exts.is_null() {
                *exts = yaml_serde::Value::Mapping(Default::default());
            }
            let exts = exts.as_mapping_mut().ok_or_else(|| shape(path, "`extensions`", "YAML mapping"))?;
            exts.insert(SERVER_NAME.into(), launch.goose_entry());
            yaml_serde::to_string(&root).map_err(|e| InstallError::Parse {
                path: path.into(),
                format: "YAML",
                message: e.to_string(),
            })
        }
    }
}

/// `w` as one word of a POSIX shell command line.
pub fn shell_quote(w: &str) -> String {
    if !w.is_empty() && w.chars().all(|c| c.is_ascii_alphanumeric() || "-_./=:@%+,".contains(c)) {
        w.to_string()
    } else {
        format!("'{}'", w.replace('\'', "'\\''"))
    }
}

/// Whether `program` is a cargo build output (under a `target/` directory cargo made),
/// which `cargo clean` or the next build removes or replaces.
pub fn is_build_output(program: &Path) -> bool {
    program.ancestors().skip(1).any(|a| {
        a.file_name().is_some_and(|n| n == "target")
            && (a.join("CACHEDIR.TAG").exists() || a.join(".rustc_info.json").exists())
    })
}

fn shape(path: &Path, what: &str, expected: &'static str) -> InstallError {
    InstallError::Shape { path: path.into(), what: what.into(), expected }
}

/// What [`write`] did.
#[derive(Debug)]
pub struct Written {
    pub path: PathBuf,
    /// The previous file, copied before writing (None if there was none).
    pub backup: Option<PathBuf>,
}

/// Merge the forkbox entry into the client's config file at `path`: the old
/// file is copied to `<path>.bak` (or `.bak.N` if that exists) first, the new
/// one is written to a temporary file and renamed over it.
pub fn write(client: McpClient, path: &Path, launch: &Launch) -> Result<Written, InstallError> {
    let existing = match std::fs::read_to_string(path) {
        Ok(t) => Some(t),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => None,
        Err(e) => return Err(InstallError::Read { path: path.into(), source: e }),
    };
    let merged = merge(client, existing.as_deref(), launch, path)?;
    let werr = |source| InstallError::Write { path: path.into(), source };
    if let Some(dir) = path.parent() {
        std::fs::create_dir_all(dir).map_err(werr)?;
    }
    let backup = match &existing {
        Some(_) => {
            let mut b = path.with_extension(ext_plus(path, "bak"));
            let mut n = 1;
            while b.exists() {
                b = path.with_extension(ext_plus(path, &format!("bak.{n}")));
                n += 1;
            }
            std::fs::copy(path, &b).map_err(werr)?;
            Some(b)
        }
        None => None,
    };
    let tmp = path.with_extension(ext_plus(path, "forkbox-tmp"));
    std::fs::write(&tmp, merged).map_err(werr)?;
    std::fs::rename(&tmp, path).map_err(werr)?;
    Ok(Written { path: path.into(), backup })
}

/// `config.json` + `bak` -> `json.bak` (so `with_extension` gives `config.json.bak`).
fn ext_plus(path: &Path, suffix: &str) -> String {
    match path.extension() {
        Some(e) => format!("{}.{suffix}", e.to_string_lossy()),
        None => suffix.to_string(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn launch(url: Option<&str>) -> Launch {
        Launch { program: "/usr/local/bin/forkbox".into(), home: None, url: url.map(str::to_owned), key: None }
    }

    fn p() -> PathBuf {
        PathBuf::from("/x/config")
    }

    #[test]
    fn json_merge_keeps_other_servers_and_keys() {
        let existing = r#"{"theme": "dark", "mcpServers": {"other": {"command": "other-mcp", "args": ["-v"]}, "forkbox": {"command": "old"}}}"#;
        let out = merge(McpClient::Claude, Some(existing), &launch(None), &p()).unwrap_or_else(|e| panic!("{e}"));
        let v: Value = serde_json::from_str(&out).unwrap_or_default();
        assert_eq!(v["theme"], "dark");
        assert_eq!(v["mcpServers"]["other"], json!({"command": "other-mcp", "args": ["-v"]}));
        assert_eq!(v["mcpServers"]["forkbox"], json!({"command": "/usr/local/bin/forkbox", "args": ["mcp"]}));
    }

    #[test]
    fn json_remote_entry_names_url_and_key_variable() {
        let out =
            merge(McpClient::Cursor, None, &launch(Some("https://fb.example")), &p()).unwrap_or_else(|e| panic!("{e}"));
        let v: Value = serde_json::from_str(&out).unwrap_or_default();
        assert_eq!(v["mcpServers"]["forkbox"]["args"], json!(["mcp", "--url", "https://fb.example"]));
        assert!(v["mcpServers"]["forkbox"]["env"]["FORKBOX_API_KEY"].is_string());
    }

    #[test]
    fn a_given_key_is_written_and_claude_code_gets_its_command() {
        let mut l = launch(Some("https://fb.example"));
        l.key = Some("fbk_abc".into());
        let out = merge(McpClient::Windsurf, None, &l, &p()).unwrap_or_else(|e| panic!("{e}"));
        let v: Value = serde_json::from_str(&out).unwrap_or_default();
        assert_eq!(v["mcpServers"]["forkbox"]["env"]["FORKBOX_API_KEY"], "fbk_abc");
        assert_eq!(
            snippet(McpClient::ClaudeCode, &l).trim_end(),
            "claude mcp add --scope user -e FORKBOX_API_KEY=fbk_abc forkbox -- /usr/local/bin/forkbox mcp --url https://fb.example"
        );
        l.program = "/opt/my tools/forkbox".into();
        l.url = None;
        assert_eq!(
            snippet(McpClient::ClaudeCode, &l).trim_end(),
            "claude mcp add --scope user forkbox -- '/opt/my tools/forkbox' mcp"
        );
        assert!(matches!(merge(McpClient::ClaudeCode, None, &l, &p()), Err(InstallError::NoFile)));
        assert_eq!(shell_quote("it's"), "'it'\\''s'");
    }

    #[test]
    fn build_outputs_are_recognised() {
        let dir = tempfile::tempdir().unwrap_or_else(|e| panic!("{e}"));
        let target = dir.path().join("repo/target");
        std::fs::create_dir_all(target.join("release")).unwrap_or_else(|e| panic!("{e}"));
        assert!(!is_build_output(&target.join("release/forkbox")));
        std::fs::write(target.join("CACHEDIR.TAG"), "Signature: 8a477f597d28d172789f06886806bc55")
            .unwrap_or_else(|e| panic!("{e}"));
        assert!(is_build_output(&target.join("release/forkbox")));
        assert!(!is_build_output(Path::new("/usr/local/bin/forkbox")));
    }

    #[test]
    fn json_merge_refuses_what_it_cannot_merge() {
        assert!(matches!(
            merge(McpClient::Claude, Some("{not json"), &launch(None), &p()),
            Err(InstallError::Parse { .. })
        ));
        assert!(matches!(merge(McpClient::Claude, Some("[1]"), &launch(None), &p()), Err(InstallError::Shape { .. })));
        assert!(matches!(
            merge(McpClient::Claude, Some(r#"{"mcpServers": 3}"#), &launch(None), &p()),
            Err(InstallError::Shape { .. })
        ));
    }

    #[test]
    fn goose_merge_keeps_other_extensions_and_settings() {
        let existing =
            "GOOSE_PROVIDER: anthropic\nextensions:\n  developer:\n    enabled: true\n    name: developer\n    type: builtin\n";
        let out = merge(McpClient::Goose, Some(existing), &launch(None), &p()).unwrap_or_else(|e| panic!("{e}"));
        let v: yaml_serde::Value = yaml_serde::from_str(&out).unwrap_or(yaml_serde::Value::Null);
        assert_eq!(v["GOOSE_PROVIDER"].as_str(), Some("anthropic"));
        assert_eq!(v["extensions"]["developer"]["type"].as_str(), Some("builtin"));
        assert_eq!(v["extensions"]["forkbox"]["cmd"].as_str(), Some("/usr/local/bin/forkbox"));
        assert_eq!(v["extensions"]["forkbox"]["type"].as_str(), Some("stdio"));
        assert_eq!(v["extensions"]["forkbox"]["args"][0].as_str(), Some("mcp"));
        // An empty `extensions:` (null) is filled in, not an error.
        let out = merge(McpClient::Goose, Some("extensions:\n"), &launch(None), &p()).unwrap_or_else(|e| panic!("{e}"));
        assert!(out.contains("forkbox"), "{out}");
    }

    #[test]
    fn write_backs_up_and_never_clobbers() {
        let dir = tempfile::tempdir().unwrap_or_else(|e| panic!("{e}"));
        let path = dir.path().join("Claude/claude_desktop_config.json");
        // No file yet: created, no backup.
        let w = write(McpClient::Claude, &path, &launch(None)).unwrap_or_else(|e| panic!("{e}"));
        assert!(w.backup.is_none() && path.exists());
        // Another server added by the user, then install again: kept, and the old file backed up.
        let mut v: Value =
            serde_json::from_str(&std::fs::read_to_string(&path).unwrap_or_default()).unwrap_or_default();
        v["mcpServers"]["mine"] = json!({"command": "mine"});
        std::fs::write(&path, v.to_string()).unwrap_or_else(|e| panic!("{e}"));
        let w = write(McpClient::Claude, &path, &launch(None)).unwrap_or_else(|e| panic!("{e}"));
        let backup = w.backup.unwrap_or_default();
        assert_eq!(backup, dir.path().join("Claude/claude_desktop_config.json.bak"));
        assert_eq!(std::fs::read_to_string(&backup).unwrap_or_default(), v.to_string());
        let now: Value = serde_json::from_str(&std::fs::read_to_string(&path).unwrap_or_default()).unwrap_or_default();
        assert_eq!(now["mcpServers"]["mine"], json!({"command": "mine"}));
        assert!(now["mcpServers"]["forkbox"].is_object());
        // A second backup does not overwrite the first.
        let w = write(McpClient::Claude, &path, &launch(None)).unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(w.backup.unwrap_or_default(), dir.path().join("Claude/claude_desktop_config.json.bak.1"));
        // An unparsable file is left alone.
        std::fs::write(&path, "{oops").unwrap_or_else(|e| panic!("{e}"));
        assert!(write(McpClient::Claude, &path, &launch(None)).is_err());
        assert_eq!(std::fs::read_to_string(&path).unwrap_or_default(), "{oops");
    }
}
