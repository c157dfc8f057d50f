//! Tool results as MCP content: structured content for programs, a text
//! rendering for the model, images for the PNGs the code wrote to `/output`,
//! and tool errors (`isError: true`) that carry the API's code and message.

use base64::Engine as _;
use forkbox_client::{Checkpoint, ClientError, CommandResult, ExecResult, FileEntry, FileWritten, Session};
use rmcp::model::{CallToolResult, ContentBlock};
use serde_json::{json, Value};

/// Image types MCP clients display; other `/output` files are listed, not attached.
const IMAGE_MIMES: &[&str] = &["image/png", "image/jpeg", "image/gif", "image/webp"];

/// An exec result: `{value, stdout, stderr, error, checkpoint?, runtime_ms, outputs}` plus
/// a text rendering and one image block per image file the code wrote to `/output`.
pub fn exec_result(r: &ExecResult) -> CallToolResult {
    let outputs: Vec<Value> = r
        .outputs
        .iter()
        .map(|o| json!({ "path": o.path, "size": o.size, "mime": o.mime, "inline": o.base64.is_some() }))
        .collect();
    let mut structured = json!({
        "value": r.value,
        "stdout": r.stdout,
        "stderr": r.stderr,
        "error": r.error,
        "runtime_ms": r.runtime_ms,
        "outputs": outputs,
    });
    if let Some(cp) = r.checkpoint {
        structured["checkpoint"] = json!(cp);
    }
    if !r.display.is_empty() {
        // Images go as image content below; here what else each item was.
        let shown: Vec<Value> = r
            .display
            .iter()
            .map(|b| json!({ "mimes": b.0.keys().collect::<Vec<_>>(), "text": b.text("text/plain") }))
            .collect();
        structured["display"] = json!(shown);
    }
    let mut content = vec![ContentBlock::text(exec_text(r))];
    // Displayed objects: images as image content; tables and other rich text as text
    // (markdown or plain: an LLM reads those better than HTML).
    for b in &r.display {
        match b.image() {
            Some((mime, _)) => {
                content.extend(b.text(mime).map(|b64| ContentBlock::image(b64.to_string(), mime.to_string())))
            }
            None => content.extend(
                b.text("text/markdown")
                    .or_else(|| b.text("text/plain"))
                    .map(|t| ContentBlock::text(format!("display:\n{t}"))),
            ),
        }
    }
    // The value as an image too (a PIL image); its text is in the text above.
    if let Some((mime, _)) = r.value_data.as_ref().and_then(|b| b.image()) {
        content.extend(
            r.value_data
                .as_ref()
                .and_then(|b| b.text(mime))
                .map(|b64| ContentBlock::image(b64.to_string(), mime.to_string())),
        );
    }
    for o in &r.outputs {
        let Some(b64) = &o.base64 else { continue };
        // Only pass on what really decodes: the data came from the guest.
        if IMAGE_MIMES.contains(&o.mime.as_str()) && base64::engine::general_purpose::STANDARD.decode(b64).is_ok() {
            content.push(ContentBlock::image(b64.clone(), o.mime.clone()));
        }
    }
    let mut out = CallToolResult::success(content);
    out.structured_content = Some(structured);
    out
}

fn exec_text(r: &ExecResult) -> String {
    let mut t = String::new();
    if !r.stdout.is_empty() {
        t.push_str("stdout:\n");
        t.push_str(&r.stdout);
        if !r.stdout.ends_with('\n') {
            t.push('\n');
        }
    }
    if !r.stderr.is_empty() {
        t.push_str("stderr:\n");
        t.push_str(&r.stderr);
        if !r.stderr.ends_with('\n') {
            t.push('\n');
        }
    }
    if let Some(v) = &r.value {
        t.push_str(&format!("value: {v}\n"));
    }
    if let Some(e) = &r.error {
        t.push_str(&format!("exception: {}: {}\n", e.kind, e.message));
        if !e.traceback.is_empty() {
            t.push_str(&e.traceback);
            if !e.traceback.ends_with('\n') {
                t.push('\n');
            }
        }
    }
    for o in &r.outputs {
        t.push_str(&format!("output file: {} ({} bytes, {})\n", o.path, o.size, o.mime));
    }
    if let Some(cp) = r.checkpoint {
        t.push_str(&format!("checkpoint: {cp}\n"));
    }
    if t.is_empty() {
        t.push_str("(no output)\n");
    }
    t
}

/// A command's result: `{stdout, stderr, exit_code, checkpoint?, runtime_ms, outputs}` plus a text rendering.
pub fn command_result(r: &CommandResult) -> CallToolResult {
    let outputs: Vec<Value> =
        r.outputs.iter().map(|o| json!({ "path": o.path, "size": o.size, "mime": o.mime })).collect();
    let mut structured = json!({
        "stdout": r.stdout,
        "stderr": r.stderr,
        "exit_code": r.exit_code,
        "runtime_ms": r.runtime_ms,
        "outputs": outputs,
    });
    let mut t = String::new();
    for (name, text) in [("stdout", &r.stdout), ("stderr", &r.stderr)] {
        if !text.is_empty() {
            t.push_str(&format!("{name}:\n{text}"));
            if !text.ends_with('\n') {
                t.push('\n');
            }
        }
    }
    t.push_str(&format!("exit_code: {}\n", r.exit_code));
    for o in &r.outputs {
        t.push_str(&format!("output file: {} ({} bytes, {})\n", o.path, o.size, o.mime));
    }
    if let Some(cp) = r.checkpoint {
        structured["checkpoint"] = json!(cp);
        t.push_str(&format!("checkpoint: {cp}\n"));
    }
    let mut content = vec![ContentBlock::text(t)];
    for o in &r.outputs {
        let Some(b64) = &o.base64 else { continue };
        if IMAGE_MIMES.contains(&o.mime.as_str()) && base64::engine::general_purpose::STANDARD.decode(b64).is_ok() {
            content.push(ContentBlock::image(b64.clone(), o.mime.clone()));
        }
    }
    let mut out = CallToolResult::success(content);
    out.structured_content = Some(structured);
    out
}

/// A session, structured and as one line of text.
pub fn session(s: &Session, what: &str) -> CallToolResult {
    let mut out = CallToolResult::success(vec![ContentBlock::text(format!("{what}: {}", session_line(s)))]);
    out.structured_content = Some(session_json(s));
    out
}

/// The names of a session's secrets (the server lists names and destinations, never values).
fn secret_names(s: &Session) -> Vec<String> {
    s.secrets.iter().map(|x| x.name.clone()).collect()
}

fn session_json(s: &Session) -> Value {
    json!({
        "secrets": secret_names(s),
        "session_id": s.id,
        "checkpoint": s.checkpoint,
        "forked_from": s.forked_from,
        "tags": s.tags,
        "created_ms": s.created_ms,
        "last_used_ms": s.last_used_ms,
        "limits": s.limits,
    })
}

fn session_line(s: &Session) -> String {
    let at = match (&s.checkpoint, &s.forked_from) {
        (Some(cp), _) => format!("at checkpoint {cp}"),
        (None, Some(f)) => format!("forked from {} checkpoint {}", f.session, f.checkpoint),
        (None, None) => "no execs yet".to_string(),
    };
    let names = secret_names(s);
    let secrets = if names.is_empty() { String::new() } else { format!(", secrets ${}", names.join(", $")) };
    format!(
        "session {} ({at}; memory {} MiB, timeout {} s per exec, network {}{secrets})",
        s.id,
        s.limits.memory_mb,
        s.limits.timeout_seconds,
        s.limits.network_mode().unwrap_or("unknown")
    )
}

pub fn sessions(list: &[Session]) -> CallToolResult {
    let text = if list.is_empty() {
        "no sessions".to_string()
    } else {
        list.iter().map(session_line).collect::<Vec<_>>().join("\n")
    };
    let mut out = CallToolResult::success(vec![ContentBlock::text(text)]);
    out.structured_content = Some(json!({ "sessions": list.iter().map(session_json).collect::<Vec<_>>() }));
    out
}

pub fn checkpoints(id: &str, list: &[Checkpoint]) -> CallToolResult {
    let mut text = format!("checkpoints of session {id} (oldest first; * = current):\n");
    for c in list {
        let code: String = c.code.lines().next().unwrap_or("").chars().take(80).collect();
        let more = if c.code.lines().count() > 1 || code.len() < c.code.lines().next().unwrap_or("").len() {
            " ..."
        } else {
            ""
        };
        text.push_str(&format!(
            "{} {:>3}  parent {:<4} {code}{more}\n",
            if c.head { "*" } else { " " },
            c.seq,
            c.parent.map_or("-".to_string(), |p| p.to_string())
        ));
    }
    let items: Vec<Value> = list
        .iter()
        .map(|c| json!({ "checkpoint": c.seq, "parent": c.parent, "code": c.code, "current": c.head }))
        .collect();
    let mut out = CallToolResult::success(vec![ContentBlock::text(text)]);
    out.structured_content = Some(json!({ "session_id": id, "checkpoints": items }));
    out
}

pub fn deleted(id: &str) -> CallToolResult {
    let mut out = CallToolResult::success(vec![ContentBlock::text(format!("deleted session {id}"))]);
    out.structured_content = Some(json!({ "session_id": id, "deleted": true }));
    out
}

pub fn uploaded(w: &FileWritten) -> CallToolResult {
    let mut out = CallToolResult::success(vec![ContentBlock::text(format!(
        "wrote {} ({} bytes) (checkpoint {})",
        w.path, w.size, w.checkpoint
    ))]);
    out.structured_content = Some(json!({ "path": w.path, "size": w.size, "checkpoint": w.checkpoint }));
    out
}

/// A package install: pip's output and the checkpoint.
pub fn packages(p: &forkbox_client::Packages) -> CallToolResult {
    let cp = p.checkpoint.map_or("nothing new, no checkpoint".to_string(), |c| format!("checkpoint {c}"));
    let mut out = CallToolResult::success(vec![ContentBlock::text(format!("{}({cp})", p.output))]);
    out.structured_content = Some(json!({ "packages": p.packages, "output": p.output, "checkpoint": p.checkpoint }));
    out
}

/// A downloaded file: text if `base64` is Some(false) or (None and) it is UTF-8, else base64.
/// Err: text was asked for and the file is not UTF-8.
pub fn downloaded(path: &str, data: Vec<u8>, base64: Option<bool>) -> Result<CallToolResult, CallToolResult> {
    let size = data.len();
    let (encoding, content) = match (base64, String::from_utf8(data)) {
        (Some(false) | None, Ok(t)) => ("text", t),
        (Some(false), Err(_)) => {
            return Err(error(
                "invalid_arguments",
                &format!("{path} is not UTF-8 text; download it with encoding \"base64\" (or omit encoding)"),
            ))
        }
        (_, Ok(t)) => ("base64", base64::engine::general_purpose::STANDARD.encode(t.as_bytes())),
        (_, Err(e)) => ("base64", base64::engine::general_purpose::STANDARD.encode(e.as_bytes())),
    };
    let text = format!("{path} ({size} bytes, {encoding}):\n{content}");
    let mut out = CallToolResult::success(vec![ContentBlock::text(text)]);
    out.structured_content = Some(json!({ "path": path, "size": size, "encoding": encoding, "content": content }));
    Ok(out)
}

pub fn files(dir: &str, list: &[FileEntry]) -> CallToolResult {
    let mut text = if list.is_empty() { format!("{dir} is empty") } else { format!("{dir}:\n") };
    for f in list {
        if f.is_dir {
            text.push_str(&format!("  {}/  (directory)\n", f.path));
        } else {
            text.push_str(&format!("  {}  {} bytes\n", f.path, f.size));
        }
    }
    let items: Vec<Value> =
        list.iter().map(|f| json!({ "name": f.name, "path": f.path, "size": f.size, "is_dir": f.is_dir })).collect();
    let mut out = CallToolResult::success(vec![ContentBlock::text(text)]);
    out.structured_content = Some(json!({ "dir": dir, "files": items }));
    out
}

fn process_json(p: &forkbox_client::ProcessInfo) -> Value {
    json!({
        "pid": p.pid, "state": p.state, "exit_code": p.exit_code, "signal": p.signal, "argv": p.argv,
        "cpu_seconds": p.cpu_seconds, "stdout_bytes": p.stdout_bytes, "stderr_bytes": p.stderr_bytes,
    })
}

fn process_line(p: &forkbox_client::ProcessInfo) -> String {
    let state = match (p.state.as_str(), p.exit_code, p.signal) {
        ("running", ..) => "running".to_string(),
        (_, _, Some(s)) => format!("killed by signal {s}"),
        (_, Some(c), _) => format!("exited {c}"),
        (s, ..) => s.to_string(),
    };
    format!(
        "pid {} {state}, {:.2} CPU s, {} + {} bytes of output: {}",
        p.pid,
        p.cpu_seconds,
        p.stdout_bytes,
        p.stderr_bytes,
        p.argv.join(" ")
    )
}

/// A background process just started.
pub fn process_started(id: &str, p: &forkbox_client::ProcessInfo) -> CallToolResult {
    let text = format!("started pid {} in session {id}; read its output with read_process_output", p.pid);
    let mut out = CallToolResult::success(vec![ContentBlock::text(text)]);
    out.structured_content = Some(json!({ "session_id": id, "pid": p.pid, "process": process_json(p) }));
    out
}

/// A background process as it is.
pub fn process_info(id: &str, p: &forkbox_client::ProcessInfo) -> CallToolResult {
    let mut out = CallToolResult::success(vec![ContentBlock::text(process_line(p))]);
    out.structured_content = Some(json!({ "session_id": id, "process": process_json(p) }));
    out
}

/// A session's background processes.
pub fn processes(id: &str, list: &[forkbox_client::ProcessInfo]) -> CallToolResult {
    let text = if list.is_empty() {
        format!("no background processes in session {id}")
    } else {
        list.iter().map(process_line).collect::<Vec<_>>().join("\n")
    };
    let mut out = CallToolResult::success(vec![ContentBlock::text(text)]);
    out.structured_content =
        Some(json!({ "session_id": id, "processes": list.iter().map(process_json).collect::<Vec<_>>() }));
    out
}

/// What a background process wrote from the offsets asked for.
pub fn process_output(
    id: &str,
    p: &forkbox_client::ProcessInfo,
    out: &forkbox_client::ProcessOutput,
    err: &forkbox_client::ProcessOutput,
) -> CallToolResult {
    let mut text = process_line(p);
    for (name, o) in [("stdout", out), ("stderr", err)] {
        if o.dropped > 0 {
            text.push_str(&format!("\n[{} bytes of {name} before this were dropped]", o.dropped));
        }
        if !o.data.is_empty() {
            text.push_str(&format!("\n--- {name} ---\n{}", o.data));
        }
    }
    let mut r = CallToolResult::success(vec![ContentBlock::text(text)]);
    r.structured_content = Some(json!({
        "session_id": id, "process": process_json(p), "running": p.state == "running",
        "exit_code": p.exit_code, "stdout": out.data, "stderr": err.data,
        "stdout_next_offset": out.next_offset, "stderr_next_offset": err.next_offset,
        "stdout_dropped": out.dropped, "stderr_dropped": err.dropped,
    }));
    r
}

pub fn interrupted(id: &str, interrupted: bool) -> CallToolResult {
    let text = if interrupted {
        format!(
            "interrupted the exec running in session {id}: it returns KeyboardInterrupt; the session keeps its state"
        )
    } else {
        format!("no exec was running in session {id}")
    };
    let mut out = CallToolResult::success(vec![ContentBlock::text(text)]);
    out.structured_content = Some(json!({ "session_id": id, "interrupted": interrupted }));
    out
}

/// What a model can do about an error code (the API's, or this crate's `invalid_arguments`).
fn hint(code: &str) -> &'static str {
    use forkbox_client::ErrorCode as C;
    if code == "invalid_arguments" {
        return " Check the tool's input schema.";
    }
    match code.parse::<C>() {
        Ok(C::SessionNotFound) => {
            " Call list_sessions to see the sessions that exist, or create_session for a new one."
        }
        Ok(C::CheckpointNotFound) => " Call list_checkpoints to see this session's checkpoints.",
        Ok(C::Timeout | C::GuestCrashed | C::GuestExited | C::GuestKilled | C::SandboxUnusable | C::Interrupted) => {
            " In a session, the state is back at the last checkpoint (as before this exec); fix the code and retry."
        }
        Ok(C::SessionBusy) => {
            " Another exec is running in this session; wait for it, or fork_session to work in parallel."
        }
        Ok(C::Overloaded | C::RateLimited) => " The server is busy; retry in a moment.",
        Ok(C::QuotaExceeded) => " Delete sessions you no longer need (delete_session).",
        Ok(C::FileNotFound) => " Call list_files to see what is there.",
        Ok(C::FileTooLarge) => " Work on the file with exec instead (read a part of it, or summarize it there).",
        Ok(C::InvalidRequest) => " Check the tool's input schema.",
        _ => "",
    }
}

/// A tool error: `isError: true`, structured `{error: {code, message}}`, and the same as text.
pub fn error(code: &str, message: &str) -> CallToolResult {
    let mut out = CallToolResult::error(vec![ContentBlock::text(format!("error {code}: {message}.{}", hint(code)))]);
    out.structured_content = Some(json!({ "error": { "code": code, "message": message } }));
    out
}

pub fn client_error(e: &ClientError) -> CallToolResult {
    error(e.code(), &e.message())
}

#[cfg(test)]
mod tests {
    use super::*;
    use forkbox_client::OutputFile;

    fn result(outputs: Vec<OutputFile>) -> ExecResult {
        serde_json::from_value::<ExecResult>(
            json!({ "value": "3", "stdout": "hi\n", "stderr": "", "error": null, "checkpoint": 2,
                    "exit_code": 0, "runtime_ms": 1.0, "wall_ms": 1.5, "syscalls": 3 }),
        )
        .map(|mut r| {
            r.outputs = outputs;
            r
        })
        .unwrap_or_else(|e| panic!("{e}"))
    }

    #[test]
    fn images_come_back_as_image_blocks_other_files_only_as_text() {
        let png =
            OutputFile { path: "/output/a.png".into(), size: 3, mime: "image/png".into(), base64: Some("iVBO".into()) };
        let csv =
            OutputFile { path: "/output/b.csv".into(), size: 3, mime: "text/csv".into(), base64: Some("YSxi".into()) };
        let big = OutputFile { path: "/output/c.png".into(), size: 9 << 20, mime: "image/png".into(), base64: None };
        let bad =
            OutputFile { path: "/output/d.png".into(), size: 3, mime: "image/png".into(), base64: Some("***".into()) };
        let r = exec_result(&result(vec![png, csv, big, bad]));
        let images: Vec<_> = r.content.iter().filter_map(|c| c.as_image()).collect();
        assert_eq!(images.len(), 1);
        assert_eq!((images[0].data.as_str(), images[0].mime_type.as_str()), ("iVBO", "image/png"));
        let text = r.content[0].as_text().map(|t| t.text.clone()).unwrap_or_default();
        assert!(
            text.contains("stdout:\nhi\n") && text.contains("value: 3") && text.contains("/output/b.csv"),
            "{text}"
        );
        let s = r.structured_content.unwrap_or_default();
        assert_eq!(s["checkpoint"], 2);
        assert_eq!(s["outputs"].as_array().map(Vec::len), Some(4));
        assert_eq!(r.is_error, Some(false));
    }

    /// A session as the server sends it (every field it always sends), with `extra` fields.
    fn session_body(id: &str, extra: serde_json::Value) -> Session {
        let mut v = json!({
            "id": id, "tags": {}, "created_ms": 1, "last_used_ms": 2, "resident": true,
            "checkpoint": null, "forked_from": null, "template": null, "template_id": "t1", "last_code": null,
            "limits": { "memory_mb": 512, "timeout_seconds": 30.0, "network": { "mode": "public" } },
        });
        if let (Some(o), Some(e)) = (v.as_object_mut(), extra.as_object()) {
            o.extend(e.clone());
        }
        serde_json::from_value(v).unwrap_or_else(|e| panic!("{e}"))
    }

    #[test]
    fn a_session_names_its_secrets_never_a_value() {
        let s = session_body(
            "s_1",
            json!({ "secrets": [{ "name": "OPENAI_API_KEY", "hosts": ["api.openai.com"] }, { "name": "GH", "hosts": ["github.com"] }] }),
        );
        let r = session(&s, "created");
        let text = r.content[0].as_text().map(|t| t.text.clone()).unwrap_or_default();
        assert!(text.ends_with(", secrets $OPENAI_API_KEY, $GH)"), "{text}");
        assert_eq!(r.structured_content.unwrap_or_default()["secrets"], json!(["OPENAI_API_KEY", "GH"]));
        let bare = session_body("s_2", json!({}));
        let text = sessions(&[bare]).content[0].as_text().map(|t| t.text.clone()).unwrap_or_default();
        assert!(!text.contains("secrets"), "{text}");
    }

    #[test]
    fn errors_carry_code_and_message() {
        let r = client_error(&ClientError::Api {
            status: 404,
            code: "session_not_found".into(),
            message: "no session s_1".into(),
            output: None,
        });
        assert_eq!(r.is_error, Some(true));
        assert_eq!(
            r.structured_content,
            Some(json!({ "error": { "code": "session_not_found", "message": "no session s_1" } }))
        );
    }
}
