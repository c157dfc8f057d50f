//! The agent protocol: frames of a 4-byte little-endian length and JSON.

use serde::{Deserialize, Serialize};

use crate::error::EngineError;

pub fn frame<T: Serialize>(msg: &T) -> Vec<u8> {
    let body = serde_json::to_vec(msg).unwrap_or_default();
    let mut out = Vec::with_capacity(body.len() + 4);
    out.extend_from_slice(&(body.len() as u32).to_le_bytes());
    out.extend_from_slice(&body);
    out
}

/// Split one complete frame off the front of what the agent wrote.
pub fn unframe(buf: &[u8]) -> Result<(serde_json::Value, usize), EngineError> {
    let len = buf.get(..4).ok_or_else(|| EngineError::Protocol(format!("short frame ({} bytes)", buf.len())))?;
    let n = u32::from_le_bytes([len[0], len[1], len[2], len[3]]) as usize;
    let body = buf
        .get(4..4 + n)
        .ok_or_else(|| EngineError::Protocol(format!("frame of {n} bytes, only {} present", buf.len() - 4)))?;
    let v = serde_json::from_slice(body).map_err(|e| EngineError::Protocol(format!("bad JSON from agent: {e}")))?;
    Ok((v, 4 + n))
}

/// Cut `s` to at most `max` bytes (on a character boundary), with a marker.
pub fn truncate_text(s: &mut String, max: usize, what: &str) {
    if s.len() <= max {
        return;
    }
    let total = s.len();
    let mut end = max;
    while end > 0 && !s.is_char_boundary(end) {
        end -= 1;
    }
    s.truncate(end);
    s.push_str(&format!("... [forkbox: {what} truncated, {total} bytes]"));
}

#[derive(Serialize)]
pub struct ExecRequest<'a> {
    pub op: &'static str,
    pub code: &'a str,
    pub value_limit: usize,
    /// First request after a fork: reseed in-memory RNGs from these 256 bits
    /// (hex, drawn by the host: the agent needs no getrandom exit for them).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub reseed: Option<String>,
    /// Output is streamed: line-buffer stdout/stderr for this exec.
    pub stream: bool,
    /// Names the code `<exec-N>` in tracebacks (absent: the agent's own count).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub exec_id: Option<i64>,
    /// Run before `code`, compiled on its own (see `ExecOptions::prelude`).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub prelude: Option<&'a str>,
}

/// A Python exception raised by the user's code.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct PyError {
    #[serde(rename = "type")]
    pub kind: String,
    pub message: String,
    pub traceback: String,
}

#[derive(Deserialize)]
pub struct ExecReply {
    pub value: Option<String>,
    pub error: Option<PyError>,
    pub runtime_ms: f64,
    /// The value's rich forms (`_repr_html_` ...), besides `value` (text/plain).
    #[serde(default)]
    pub value_data: Option<serde_json::Map<String, serde_json::Value>>,
    /// What `display()` showed and the figures left open, in order.
    #[serde(default)]
    pub display: Option<Vec<serde_json::Map<String, serde_json::Value>>>,
    /// Lengths of the stdout and stderr bytes that follow the frame: the
    /// agent's end-of-exec flush, sent with the reply (one write, one exit).
    #[serde(default)]
    pub held: Option<[u64; 2]>,
}

/// The stdout and stderr bytes that follow a reply frame (`ExecReply::held`):
/// exactly `held` bytes must follow, nothing else.
pub fn held_output(tail: &[u8], held: Option<[u64; 2]>) -> Result<(&[u8], &[u8]), EngineError> {
    let [a, b] = held.unwrap_or([0, 0]);
    let (a, b) = (usize::try_from(a).unwrap_or(usize::MAX), usize::try_from(b).unwrap_or(usize::MAX));
    if a.checked_add(b) != Some(tail.len()) {
        return Err(EngineError::Protocol(format!(
            "reply says {a} + {b} bytes of output follow it, {} do",
            tail.len()
        )));
    }
    Ok(tail.split_at(a))
}

/// One displayed object as MIME type -> data: text types as strings, images as
/// base64 strings, `application/json` as JSON (Jupyter's mime bundle).
pub type MimeBundle = std::collections::BTreeMap<String, serde_json::Value>;

/// Caps on rich outputs (the same as `/output` files: 4 MiB an item, 8 MiB in all).
pub const DISPLAY_ITEM_MAX: usize = 4 << 20;
pub const DISPLAY_TOTAL_MAX: usize = 8 << 20;
pub const DISPLAY_ITEMS_MAX: usize = 64;

/// A MIME type as the agent may name one: `type/subtype`, printable ASCII, short.
fn valid_mime(m: &str) -> bool {
    // type/subtype, each starting with a letter or digit (no "../x"), one slash.
    let starts_ok = |s: &str| s.bytes().next().is_some_and(|c| c.is_ascii_alphanumeric());
    m.len() <= 127
        && m.split_once('/').is_some_and(|(a, b)| starts_ok(a) && starts_ok(b) && !b.contains('/'))
        && m.bytes().all(|b| b.is_ascii_alphanumeric() || b"/+-.".contains(&b))
}

/// Check what the guest sent as bundles: known shapes only, within the caps (the
/// guest is not trusted to have applied them). `total` carries over between calls.
pub fn check_bundle(raw: serde_json::Map<String, serde_json::Value>, total: &mut usize) -> MimeBundle {
    let mut out = MimeBundle::new();
    for (mime, data) in raw {
        if !valid_mime(&mime) {
            continue;
        }
        let size = match &data {
            serde_json::Value::String(s) => s.len(),
            v if mime.ends_with("json") => serde_json::to_vec(v).map_or(usize::MAX, |b| b.len()),
            _ => continue,
        };
        if size > DISPLAY_ITEM_MAX || total.saturating_add(size) > DISPLAY_TOTAL_MAX {
            out.insert(
                "text/plain".into(),
                format!("[forkbox: {mime} of {size} bytes dropped, over the display cap]").into(),
            );
            continue;
        }
        *total += size;
        out.insert(mime, data);
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bundles_are_checked() {
        let mut total = 0;
        let raw = serde_json::json!({
            "text/plain": "x", "image/png": "aGk=", "application/json": {"a": [1]},
            "bad mime": "y", "text/html": 5, "../x": "z",
        });
        let b = check_bundle(raw.as_object().unwrap().clone(), &mut total);
        assert_eq!(b.keys().collect::<Vec<_>>(), ["application/json", "image/png", "text/plain"]);
        assert_eq!(total, 1 + 4 + 9);
        let big = serde_json::json!({"image/png": "A".repeat(DISPLAY_ITEM_MAX + 1)});
        let b = check_bundle(big.as_object().unwrap().clone(), &mut total);
        assert!(b["text/plain"].as_str().unwrap().contains("dropped"), "{b:?}");
        assert!(!b.contains_key("image/png"));
        let mut total = DISPLAY_TOTAL_MAX - 2;
        let b = check_bundle(serde_json::json!({"text/html": "abc"}).as_object().unwrap().clone(), &mut total);
        assert!(!b.contains_key("text/html"));
    }

    #[test]
    fn frames_round_trip_and_reject_short_input() {
        let f = frame(&serde_json::json!({"a": 1}));
        let (v, used) = unframe(&f).unwrap();
        assert_eq!(v["a"], 1);
        assert_eq!(used, f.len());
        assert!(unframe(&f[..f.len() - 1]).is_err());
        assert!(unframe(&[1, 0]).is_err());
        let mut bad = 3u32.to_le_bytes().to_vec();
        bad.extend_from_slice(b"{{{");
        assert!(unframe(&bad).is_err());
    }

    #[test]
    fn held_output_must_match_what_follows() {
        assert_eq!(held_output(b"", None).unwrap(), (&b""[..], &b""[..]));
        assert_eq!(held_output(b"2\nerr", Some([2, 3])).unwrap(), (&b"2\n"[..], &b"err"[..]));
        assert!(held_output(b"2\n", None).is_err());
        assert!(held_output(b"2\n", Some([2, 1])).is_err());
        assert!(held_output(b"2\n", Some([1, 0])).is_err());
        assert!(held_output(b"2\n", Some([u64::MAX, 3])).is_err());
    }

    #[test]
    fn truncate_text_cuts_on_a_char_boundary() {
        let mut s = "aé".repeat(10);
        truncate_text(&mut s, 4, "value");
        assert!(s.starts_with("aéa") && s.contains("truncated, 30 bytes"), "{s}");
        let mut t = String::from("short");
        truncate_text(&mut t, 10, "value");
        assert_eq!(t, "short");
    }
}
