//! The streaming exec endpoints' Server-Sent Events, as [`StreamEvent`]s.
//!
//! The server sends `stdout` / `stderr` events with data `{"data": "<text>"}`
//! as the code writes, then exactly one `result` (data = the exec result JSON)
//! or `error` (data = `{"error": {code, message}}`). The SSE framing itself
//! (lines, `data:` continuation, comments, chunk boundaries) is `sse-stream`'s.

use futures_util::stream::{self, Stream, StreamExt};
use serde_json::Value;
use sse_stream::SseStream;

use crate::error::ClientError;
use crate::transport::ByteStream;
use crate::types::{ApiErrorBody, ExecOutput};

/// One event of a streaming exec.
#[derive(Clone, Debug, PartialEq)]
pub enum StreamEvent {
    /// Text the code wrote to stdout, as it was written.
    Stdout(String),
    /// Text the code wrote to stderr.
    Stderr(String),
    /// The final result (the same JSON the non-streaming endpoint returns). Last event.
    Result(Value),
    /// The exec failed (timeout, crash, ...): the API's error code and message, and
    /// what it wrote before when it ran (also sent as `Stdout`/`Stderr` events). Last event.
    Error { code: String, message: String, output: Option<Box<ExecOutput>> },
}

impl StreamEvent {
    /// Whether this is the last event of its stream.
    pub fn is_final(&self) -> bool {
        matches!(self, StreamEvent::Result(_) | StreamEvent::Error { .. })
    }
}

fn bad(message: String) -> ClientError {
    ClientError::UnexpectedResponse { status: 200, message }
}

/// One SSE event as a [`StreamEvent`]; `None` for events this API does not send (ignored).
fn decode(event: Option<&str>, data: Option<&str>) -> Option<Result<StreamEvent, ClientError>> {
    let kind = event.unwrap_or("message");
    if !matches!(kind, "stdout" | "stderr" | "result" | "exit" | "error") {
        return None;
    }
    let json: Value = match serde_json::from_str(data.unwrap_or("")) {
        Ok(v) => v,
        Err(e) => return Some(Err(bad(format!("`{kind}` event data is not JSON: {e}")))),
    };
    let text = |json: &Value| json.get("data").and_then(Value::as_str).map(str::to_owned);
    Some(match kind {
        "stdout" => {
            text(&json).map(StreamEvent::Stdout).ok_or_else(|| bad("`stdout` event without a `data` string".into()))
        }
        "stderr" => {
            text(&json).map(StreamEvent::Stderr).ok_or_else(|| bad("`stderr` event without a `data` string".into()))
        }
        // A followed background process' end: its process info, the stream's result.
        "result" | "exit" => Ok(StreamEvent::Result(json)),
        _ => match json.get("error").cloned().map(serde_json::from_value::<ApiErrorBody>) {
            Some(Ok(e)) => {
                Ok(StreamEvent::Error { output: e.output().map(Box::new), code: e.code, message: e.message })
            }
            _ => Err(bad(format!("`error` event without error.code / error.message: {json}"))),
        },
    })
}

/// The events of an SSE body. Ends after the final event; a body that ends
/// before it yields [`ClientError::StreamEnded`] last.
pub(crate) fn events(body: ByteStream) -> impl Stream<Item = Result<StreamEvent, ClientError>> + Send {
    let sse = SseStream::from_bytes_stream(body);
    // State: the SSE stream, or None once a final event (or an error) was yielded.
    stream::unfold(Some(Box::pin(sse)), |state| async move {
        let mut sse = state?;
        loop {
            match sse.next().await {
                None => return Some((Err(ClientError::StreamEnded), None)),
                Some(Err(e)) => return Some((Err(bad(format!("malformed event stream: {e}"))), None)),
                Some(Ok(ev)) => match decode(ev.event.as_deref(), ev.data.as_deref()) {
                    None => continue,
                    Some(Ok(ev)) if ev.is_final() => return Some((Ok(ev), None)),
                    Some(Ok(ev)) => return Some((Ok(ev), Some(sse))),
                    Some(Err(e)) => return Some((Err(e), None)),
                },
            }
        }
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use bytes::Bytes;
    use serde_json::json;

    /// The events of a body delivered in the given chunks.
    async fn parse(chunks: &[&str]) -> Vec<Result<StreamEvent, String>> {
        let owned: Vec<Result<Bytes, ClientError>> = chunks.iter().map(|c| Ok(Bytes::from(c.to_string()))).collect();
        let body: ByteStream = Box::pin(stream::iter(owned));
        events(body).map(|r| r.map_err(|e| e.code().to_string())).collect().await
    }

    #[tokio::test]
    async fn output_then_result_across_chunk_boundaries() {
        let body = "event: stdout\ndata: {\"data\": \"hello\\n\"}\n\n: keep-alive comment\n\nevent: stderr\r\ndata: {\"data\": \"warn\"}\r\n\r\nevent: result\ndata: {\"value\": \"2\", \"stdout\": \"hello\\n\"}\n\n";
        // Every split point: the framing must not depend on how the bytes arrive.
        for cut in 1..body.len() {
            let got = parse(&[&body[..cut], &body[cut..]]).await;
            assert_eq!(
                got,
                vec![
                    Ok(StreamEvent::Stdout("hello\n".into())),
                    Ok(StreamEvent::Stderr("warn".into())),
                    Ok(StreamEvent::Result(json!({"value": "2", "stdout": "hello\n"}))),
                ],
                "split at {cut}"
            );
        }
    }

    #[tokio::test]
    async fn multi_line_data_and_error_event() {
        let got = parse(&[
            "event: error\ndata: {\"error\":\ndata:  {\"code\": \"timeout\", \"message\": \"ran past 1 s\"}}\n\n",
        ])
        .await;
        assert_eq!(
            got,
            vec![Ok(StreamEvent::Error { code: "timeout".into(), message: "ran past 1 s".into(), output: None })]
        );
        let got = parse(&[
            "event: error\ndata: {\"error\": {\"code\": \"timeout\", \"message\": \"m\", \"stdout\": \"a\\n\"}}\n\n",
        ])
        .await;
        let output = Some(Box::new(ExecOutput { stdout: "a\n".into(), stderr: String::new() }));
        assert_eq!(got, vec![Ok(StreamEvent::Error { code: "timeout".into(), message: "m".into(), output })]);
    }

    #[tokio::test]
    async fn stops_after_the_final_event() {
        let got = parse(&["event: result\ndata: {}\n\nevent: stdout\ndata: {\"data\": \"late\"}\n\n"]).await;
        assert_eq!(got, vec![Ok(StreamEvent::Result(json!({})))]);
    }

    #[tokio::test]
    async fn a_body_that_ends_early_is_an_error() {
        let got =
            parse(&["event: stdout\ndata: {\"data\": \"x\"}\n\nevent: result\ndata: {\"unterminated\": 1}"]).await;
        assert_eq!(got[0], Ok(StreamEvent::Stdout("x".into())));
        // The last event has no blank line after it: it was never completed.
        assert_eq!(got.last(), Some(&Err("stream_ended".to_string())), "{got:?}");
    }

    #[tokio::test]
    async fn unknown_events_are_skipped_and_bad_data_is_an_error() {
        let got = parse(&["event: ping\ndata: whatever\n\nevent: stdout\ndata: not json\n\n"]).await;
        assert_eq!(got, vec![Err("unexpected_response".to_string())]);
        let got = parse(&["event: error\ndata: {\"error\": {\"code\": 1}}\n\n"]).await;
        assert_eq!(got, vec![Err("unexpected_response".to_string())]);
    }
}
