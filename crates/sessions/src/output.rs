//! What a call showed, kept with the checkpoint it made (`checkpoints.output`,
//! JSON, see [`CallOutput`]): its stdout and stderr, its value (repr and rich
//! forms), its exception, what it displayed (matplotlib figures as PNG, ...) and
//! the names of the `/output` files it wrote (their bytes are in the
//! checkpoint's file system). So a session's history can be shown again after
//! eviction, a revert or a restart.
//!
//! Bounded: at most [`OUTPUT_MAX`] bytes of JSON a checkpoint. Each text at most
//! [`TEXT_MAX`] bytes, its head and tail kept, and shorter still while the texts
//! together take more than half the record; then the rich outputs in order while
//! they fit (one that does not is left out). `truncated` is set when anything
//! was cut or left out. The stored
//! size is charged to the tenant's disk quota with the checkpoint
//! (`checkpoints.output_bytes`).

use forkbox_engine::{ExecResult, MimeBundle, PyError};
use serde::{Deserialize, Serialize};

/// Most bytes of JSON kept for one call.
pub const OUTPUT_MAX: usize = 1 << 20;
/// Most bytes kept of each text (stdout, stderr, the value's repr, the traceback).
pub const TEXT_MAX: usize = 256 << 10;

/// The version of [`CallOutput`]'s JSON written now (`v`). A reader refuses
/// (shows no output for) a newer one.
pub const OUTPUT_VERSION: u32 = 1;

/// A file under `/output` a call created or changed (its name and size only).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct OutputFileMeta {
    pub path: String,
    pub size: u64,
    pub mime: String,
}

/// The persisted output of one call (one definition: the store writes and
/// reads this JSON, the API shows it).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct CallOutput {
    /// Format version ([`OUTPUT_VERSION`]).
    pub v: u32,
    #[serde(default)]
    pub stdout: String,
    #[serde(default)]
    pub stderr: String,
    /// repr() of the last expression, if not None.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub value: Option<String>,
    /// The value's rich forms (MIME type -> data).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub value_data: Option<MimeBundle>,
    /// What it displayed, in order, as MIME bundles.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub display: Vec<MimeBundle>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub error: Option<PyError>,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub outputs: Vec<OutputFileMeta>,
    #[serde(default)]
    pub runtime_ms: f64,
    /// Something was cut or left out to keep within [`OUTPUT_MAX`].
    #[serde(default)]
    pub truncated: bool,
}

#[derive(Debug, thiserror::Error)]
pub enum OutputError {
    #[error("stored call output: {0}")]
    Json(#[from] serde_json::Error),
    #[error("stored call output has format version {0}, newer than this build reads ({OUTPUT_VERSION})")]
    TooNew(u32),
}

/// `s` cut to at most `max` bytes (on character boundaries): its head and its
/// tail around a note saying how much was left out. True if cut.
fn cut_text(s: &mut String, max: usize) -> bool {
    if s.len() <= max {
        return false;
    }
    let note_room = 64;
    let half = max.saturating_sub(note_room) / 2;
    let mut head = half;
    while !s.is_char_boundary(head) {
        head -= 1;
    }
    let mut tail = s.len() - half;
    while !s.is_char_boundary(tail) {
        tail += 1;
    }
    let cut = tail - head;
    *s = format!("{}\n[... {cut} bytes not kept ...]\n{}", &s[..head], &s[tail..]);
    true
}

fn json_len<T: Serialize>(v: &T) -> usize {
    serde_json::to_vec(v).map_or(usize::MAX, |b| b.len())
}

impl CallOutput {
    /// The bounded record of an exec's result.
    pub fn of(r: &ExecResult) -> CallOutput {
        let mut o = CallOutput {
            v: OUTPUT_VERSION,
            stdout: r.stdout.clone(),
            stderr: r.stderr.clone(),
            value: r.value.clone(),
            value_data: None,
            display: Vec::new(),
            error: r.error.clone(),
            outputs: r
                .outputs
                .iter()
                .take(256)
                .map(|f| OutputFileMeta { path: f.path.clone(), size: f.size, mime: f.mime.to_string() })
                .collect(),
            runtime_ms: if r.runtime_ms.is_finite() { r.runtime_ms } else { 0.0 },
            truncated: r.outputs.len() > 256,
        };
        // The texts take at most half the record (the rest is for rich outputs):
        // each cut shorter until they fit (JSON escaping can make a text six times longer).
        for cap in [TEXT_MAX, TEXT_MAX / 2, TEXT_MAX / 4, TEXT_MAX / 8, TEXT_MAX / 16] {
            o.cut_texts(cap);
            if json_len(&o) <= OUTPUT_MAX / 2 {
                break;
            }
        }
        // Rich outputs in order while they fit; one that does not is left out
        // (a later, smaller one may still fit).
        let mut used = json_len(&o);
        // (",\"value_data\":" and ",\"display\":[]" and commas)
        let overhead = 32;
        if let Some(b) = &r.value_data {
            let n = json_len(b);
            if used.saturating_add(n).saturating_add(overhead) <= OUTPUT_MAX {
                o.value_data = Some(b.clone());
                used += n + overhead;
            } else {
                o.truncated = true;
            }
        }
        for b in &r.display {
            let n = json_len(b);
            if used.saturating_add(n).saturating_add(overhead) <= OUTPUT_MAX {
                o.display.push(b.clone());
                used += n + overhead;
            } else {
                o.truncated = true;
            }
        }
        o
    }

    fn cut_texts(&mut self, max: usize) {
        let mut cut = cut_text(&mut self.stdout, max);
        cut |= cut_text(&mut self.stderr, max);
        if let Some(v) = self.value.as_mut() {
            cut |= cut_text(v, max);
        }
        if let Some(e) = self.error.as_mut() {
            cut |= cut_text(&mut e.traceback, max);
            cut |= cut_text(&mut e.message, max);
            cut |= cut_text(&mut e.kind, 256);
        }
        for f in &mut self.outputs {
            cut |= cut_text(&mut f.path, 4096);
        }
        self.truncated |= cut;
    }

    /// The JSON stored (at most [`OUTPUT_MAX`] bytes for a record made by [`Self::of`]).
    pub fn to_json(&self) -> Result<String, OutputError> {
        Ok(serde_json::to_string(self)?)
    }

    /// A stored record back; [`OutputError::TooNew`] for a later format.
    pub fn from_json(s: &str) -> Result<CallOutput, OutputError> {
        #[derive(Deserialize)]
        struct Version {
            v: u32,
        }
        let v: Version = serde_json::from_str(s)?;
        if v.v > OUTPUT_VERSION {
            return Err(OutputError::TooNew(v.v));
        }
        Ok(serde_json::from_str(s)?)
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    fn result() -> ExecResult {
        ExecResult {
            value: Some("42".into()),
            stdout: "hello\n".into(),
            stderr: String::new(),
            error: None,
            runtime_ms: 1.5,
            wall_ms: 2.0,
            syscalls: 3,
            outputs: Vec::new(),
            value_data: None,
            display: Vec::new(),
        }
    }

    fn png(bytes: usize) -> MimeBundle {
        let mut b = MimeBundle::new();
        b.insert("image/png".into(), serde_json::Value::String("A".repeat(bytes)));
        b.insert("text/plain".into(), serde_json::Value::String("<Figure>".into()));
        b
    }

    #[test]
    fn a_small_result_is_kept_whole_and_reads_back() {
        let mut r = result();
        r.display = vec![png(1000)];
        let o = CallOutput::of(&r);
        assert!(!o.truncated);
        let back = CallOutput::from_json(&o.to_json().unwrap()).unwrap();
        assert_eq!(back, o);
        assert_eq!(back.display.len(), 1);
        assert_eq!(back.value.as_deref(), Some("42"));
    }

    #[test]
    fn big_outputs_are_bounded_and_marked() {
        let mut r = result();
        r.stdout = "x".repeat(3 << 20);
        r.stderr = "\u{1}".repeat(1 << 20); // six bytes of JSON each
        r.value = Some("é".repeat(1 << 20));
        r.display = vec![png(700 << 10), png(700 << 10), png(10)];
        let o = CallOutput::of(&r);
        let json = o.to_json().unwrap();
        assert!(json.len() <= OUTPUT_MAX, "{} bytes", json.len());
        assert!(o.truncated);
        assert!(o.stdout.len() <= TEXT_MAX && o.stdout.contains("bytes not kept"));
        // The first figure did not fit beside the texts or the second did not: a later small one still did.
        assert!(o.display.iter().any(|b| b["image/png"].as_str().is_some_and(|s| s.len() == 10)));
        assert!(o.display.len() < 3);
    }

    #[test]
    fn a_newer_format_is_refused() {
        assert!(matches!(CallOutput::from_json(r#"{"v": 99}"#), Err(OutputError::TooNew(99))));
        assert!(CallOutput::from_json("not json").is_err());
    }
}
