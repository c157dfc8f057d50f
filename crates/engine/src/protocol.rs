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
    /// First request after a fork: reseed in-memory RNGs.
    pub reseed: bool,
    /// Output is streamed: line-buffer stdout/stderr for this exec.
    pub stream: bool,
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
}

#[cfg(test)]
mod tests {
    use super::*;

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
    fn truncate_text_cuts_on_a_char_boundary() {
        let mut s = "aé".repeat(10);
        truncate_text(&mut s, 4, "value");
        assert!(s.starts_with("aéa") && s.contains("truncated, 30 bytes"), "{s}");
        let mut t = String::from("short");
        truncate_text(&mut t, 10, "value");
        assert_eq!(t, "short");
    }
}
