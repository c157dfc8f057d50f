//! MCP tools of the tree of states: `try_alternatives` (parallel alternatives from a
//! checkpoint), `inspect_checkpoint` (its variables) and `diff_checkpoints`.

use forkbox_client::tree::{Diff, Explored, Keep, Variables};
use rmcp::handler::server::wrapper::Parameters;
use rmcp::model::{CallToolResult, ContentBlock};
use rmcp::service::RequestContext;
use rmcp::{schemars, tool, tool_router, ErrorData, RoleServer};
use serde::Deserialize;
use serde_json::json;

use crate::render;
use crate::tools::{check_id, check_timeout, done, ForkboxMcp};

/// Longest value or message shown per alternative in the text rendering.
const SHOWN: usize = 400;

#[derive(Deserialize, schemars::JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct TryAlternativesArgs {
    /// The session to branch from (it is not changed).
    pub session_id: String,
    /// 1 to 64 alternative pieces of Python code; each runs on its own copy of the session's state.
    pub codes: Vec<String>,
    /// The checkpoint to start every alternative from; default: the session's current state.
    #[serde(default)]
    pub checkpoint: Option<i64>,
    /// Indices (into `codes`) of alternatives to keep as new sessions you can continue with exec; default: none.
    #[serde(default)]
    pub keep: Option<Vec<usize>>,
    /// Time limit of each alternative, in seconds (default: the session's).
    #[serde(default)]
    pub timeout_seconds: Option<f64>,
}

#[derive(Deserialize, schemars::JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct InspectArgs {
    pub session_id: String,
    /// The checkpoint to look at (see list_checkpoints; exec results name their checkpoint).
    pub checkpoint: i64,
}

#[derive(Deserialize, schemars::JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct DiffArgs {
    pub session_id: String,
    /// The earlier checkpoint.
    pub from: i64,
    /// The later checkpoint; default: the session's current state.
    #[serde(default)]
    pub to: Option<i64>,
}

fn cut(s: &str) -> String {
    let mut out: String = s.chars().take(SHOWN).collect();
    if out.len() < s.len() {
        out.push('…');
    }
    out
}

fn explored(id: &str, r: &Explored) -> CallToolResult {
    let from = r.from.map_or("the initial state".to_string(), |n| format!("checkpoint {n}"));
    let mut text =
        format!("{} alternatives of session {id} from {from} ({:.0} ms in all):\n", r.branches.len(), r.total_time_ms);
    for b in &r.branches {
        let what = match (&b.result, &b.failed) {
            (Some(x), _) => {
                let mut s = String::new();
                if !x.stdout.is_empty() {
                    s.push_str(&format!("stdout: {} ", cut(x.stdout.trim_end())));
                }
                match (&x.error, &x.value) {
                    (Some(e), _) => s.push_str(&format!("raised {}: {}", e.kind, cut(&e.message))),
                    (None, Some(v)) => s.push_str(&format!("value: {}", cut(v))),
                    (None, None) if s.is_empty() => s.push_str("ok (no value)"),
                    _ => {}
                }
                s
            }
            (None, Some(f)) => format!("failed {}: {}", f.error.code, cut(&f.error.message)),
            (None, None) => "no result".into(),
        };
        let kept = b.session.as_ref().map_or(String::new(), |s| format!(" [kept as session {s}]"));
        text.push_str(&format!("[{}] {what}{kept}\n", b.index));
    }
    let mut out = CallToolResult::success(vec![ContentBlock::text(text)]);
    out.structured_content = serde_json::to_value(r).ok().map(|mut v| {
        v["session_id"] = json!(id);
        v
    });
    out
}

fn variables(id: &str, v: &Variables) -> CallToolResult {
    let at = v.checkpoint.map_or("-".to_string(), |n| n.to_string());
    let mut text = format!("variables of session {id} at checkpoint {at}:\n");
    for x in &v.variables {
        text.push_str(&format!("{} ({}, {} bytes) = {}\n", x.name, x.kind, x.size, x.repr));
    }
    if v.omitted > 0 {
        text.push_str(&format!("... and {} more\n", v.omitted));
    }
    let mut out = CallToolResult::success(vec![ContentBlock::text(text)]);
    out.structured_content = serde_json::to_value(v).ok();
    out
}

fn diff(id: &str, d: &Diff) -> CallToolResult {
    let n = |x: Option<i64>| x.map_or("the initial state".to_string(), |n| format!("checkpoint {n}"));
    let mut text = format!("session {id}: {} -> {} (common ancestor: {})\n", n(d.from), n(d.to), n(d.common));
    for c in &d.undone {
        text.push_str(&format!("undone {}: {}\n", c.checkpoint, cut(c.code.lines().next().unwrap_or(""))));
    }
    for c in &d.calls {
        text.push_str(&format!("ran {}: {}\n", c.checkpoint, cut(c.code.lines().next().unwrap_or(""))));
    }
    for v in &d.variables_added {
        text.push_str(&format!("+ {} = {}\n", v.name, v.repr));
    }
    for v in &d.variables_removed {
        text.push_str(&format!("- {}\n", v.name));
    }
    for v in &d.variables_changed {
        text.push_str(&format!("~ {}: {} -> {}\n", v.name, v.before.repr, v.after.repr));
    }
    for f in &d.files_added {
        text.push_str(&format!("+ file {} ({} bytes)\n", f.path, f.size_after.unwrap_or(0)));
    }
    for f in &d.files_removed {
        text.push_str(&format!("- file {}\n", f.path));
    }
    for f in &d.files_changed {
        text.push_str(&format!(
            "~ file {} ({} -> {} bytes)\n",
            f.path,
            f.size_before.unwrap_or(0),
            f.size_after.unwrap_or(0)
        ));
    }
    let mut out = CallToolResult::success(vec![ContentBlock::text(text)]);
    out.structured_content = serde_json::to_value(d).ok();
    out
}

#[tool_router(router = tree_router, vis = "pub(crate)")]
impl ForkboxMcp {
    #[tool(description = "Try several alternatives at once from the same state: each piece of code runs in \
        parallel on its own copy of a session's state (a checkpoint, default: the current one), and you get every \
        result back in order. The session itself is not changed. Use it when you are unsure which approach works \
        (several parsers, models, parameters, fixes for an error) instead of trying them one exec at a time and \
        reverting: compare the results, then continue with the best, either by running it with exec or by keeping \
        it (`keep`: its index) as a new session. Up to 64 alternatives.")]
    async fn try_alternatives(
        &self,
        Parameters(a): Parameters<TryAlternativesArgs>,
        ctx: RequestContext<RoleServer>,
    ) -> Result<CallToolResult, ErrorData> {
        done(
            async {
                check_id(&a.session_id)?;
                check_timeout(a.timeout_seconds)?;
                let c = self.client(&ctx).await?;
                let keep = a.keep.map_or(Keep::None, Keep::Indices);
                c.explore(&a.session_id, &a.codes, a.checkpoint, &keep, a.timeout_seconds)
                    .await
                    .map(|r| explored(&a.session_id, &r))
                    .map_err(|e| render::client_error(&e))
            }
            .await,
        )
    }

    #[tool(description = "Look at a session's variables at a checkpoint (name, type, size, short repr) without \
        running anything in the session or changing it. Use it to see what state a checkpoint holds before \
        reverting to it or branching from it.")]
    async fn inspect_checkpoint(
        &self,
        Parameters(a): Parameters<InspectArgs>,
        ctx: RequestContext<RoleServer>,
    ) -> Result<CallToolResult, ErrorData> {
        done(
            async {
                check_id(&a.session_id)?;
                let c = self.client(&ctx).await?;
                c.variables(&a.session_id, a.checkpoint)
                    .await
                    .map(|v| variables(&a.session_id, &v))
                    .map_err(|e| render::client_error(&e))
            }
            .await,
        )
    }

    #[tool(description = "Compare two checkpoints of a session: variables added, removed and changed, files \
        added, removed and changed (with sizes), and the code of each exec between them. Use it to find out what \
        an exec (or a series of them) changed, e.g. which step broke a variable.")]
    async fn diff_checkpoints(
        &self,
        Parameters(a): Parameters<DiffArgs>,
        ctx: RequestContext<RoleServer>,
    ) -> Result<CallToolResult, ErrorData> {
        done(
            async {
                check_id(&a.session_id)?;
                let c = self.client(&ctx).await?;
                c.diff(&a.session_id, a.from, a.to)
                    .await
                    .map(|d| diff(&a.session_id, &d))
                    .map_err(|e| render::client_error(&e))
            }
            .await,
        )
    }
}

/// Which argument of a tree tool is wrong (None: not a tree tool).
pub(crate) fn argument_check(tool: &str) -> Option<fn(&rmcp::model::JsonObject) -> Option<String>> {
    fn check<T: serde::de::DeserializeOwned>(arguments: &rmcp::model::JsonObject) -> Option<String> {
        let v = serde_json::Value::Object(arguments.clone());
        serde_path_to_error::deserialize::<_, T>(v).err().map(|e| match e.path().to_string().as_str() {
            "." => e.inner().to_string(),
            path => format!("argument `{path}`: {}", e.inner()),
        })
    }
    match tool {
        "try_alternatives" => Some(check::<TryAlternativesArgs>),
        "inspect_checkpoint" => Some(check::<InspectArgs>),
        "diff_checkpoints" => Some(check::<DiffArgs>),
        _ => None,
    }
}
