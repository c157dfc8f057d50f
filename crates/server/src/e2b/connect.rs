//! The Connect protocol (v1) as envd speaks it, JSON only: unary calls are a
//! plain JSON body (`application/json`); server streams take one enveloped
//! request message and answer `application/connect+json` envelopes
//! (1 flag byte, 4-byte big-endian length, JSON), ending with an
//! end-of-stream envelope (flag 0x02) that carries `{}` or `{"error": ...}`.

use axum::body::{Body, Bytes};
use axum::http::{header, HeaderMap, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use futures_util::StreamExt;
use serde::de::DeserializeOwned;
use serde_json::json;
use tokio::sync::mpsc;

use super::error::{Code, ConnectError};

/// Flag of a compressed message (refused: the SDKs never compress).
const COMPRESSED: u8 = 0x01;
/// Flag of the end-of-stream message.
pub const END_STREAM: u8 = 0x02;
/// Largest request message (envd requests are small JSON objects).
pub const MAX_MESSAGE: usize = 1 << 20;

/// One envelope.
pub fn envelope(flag: u8, body: &[u8]) -> Bytes {
    let len = u32::try_from(body.len()).unwrap_or(u32::MAX);
    let mut v = Vec::with_capacity(5 + body.len());
    v.push(flag);
    v.extend_from_slice(&len.to_be_bytes());
    v.extend_from_slice(body);
    Bytes::from(v)
}

/// A stream message.
pub fn message(v: &serde_json::Value) -> Bytes {
    envelope(0, v.to_string().as_bytes())
}

/// The end-of-stream message, with the error the stream ended with.
pub fn end(err: Option<&ConnectError>) -> Bytes {
    let body = match err {
        None => json!({}),
        Some(e) => json!({ "error": e.json() }),
    };
    envelope(END_STREAM, body.to_string().as_bytes())
}

fn content_type(headers: &HeaderMap) -> String {
    headers
        .get(header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .map(|s| s.split(';').next().unwrap_or("").trim().to_ascii_lowercase())
        .unwrap_or_default()
}

/// The request message of a call: a unary JSON body, or the single enveloped message of a stream.
pub fn request<T: DeserializeOwned>(headers: &HeaderMap, body: &[u8]) -> Result<T, ConnectError> {
    let ct = content_type(headers);
    let json: &[u8] = match ct.as_str() {
        "application/json" | "" => body,
        "application/connect+json" => unenvelope(body)?,
        other => {
            return Err(ConnectError::invalid(format!(
                "content type {other:?} is not served: envd here speaks Connect with JSON only"
            )))
        }
    };
    let json: &[u8] = if json.iter().all(u8::is_ascii_whitespace) { b"{}" } else { json };
    serde_json::from_slice(json).map_err(|e| ConnectError::invalid(format!("request message: {e}")))
}

/// The messages of a client stream's body (`StreamInput`): each envelope's
/// JSON, in order, up to the end-of-stream envelope if one is sent.
pub fn messages<T: DeserializeOwned>(body: &[u8]) -> Result<Vec<T>, ConnectError> {
    let mut out = Vec::new();
    let mut rest = body;
    while !rest.is_empty() {
        let (head, tail) =
            rest.split_first_chunk::<5>().ok_or_else(|| ConnectError::invalid("malformed envelope: under 5 bytes"))?;
        if head[0] & COMPRESSED != 0 {
            return Err(ConnectError::invalid("compressed messages are not accepted"));
        }
        let len = u32::from_be_bytes([head[1], head[2], head[3], head[4]]) as usize;
        if len > MAX_MESSAGE || len > tail.len() {
            return Err(ConnectError::invalid(format!("malformed envelope: it announces {len} bytes")));
        }
        if head[0] & END_STREAM != 0 {
            break;
        }
        let json = &tail[..len];
        let json: &[u8] = if json.iter().all(u8::is_ascii_whitespace) { b"{}" } else { json };
        out.push(serde_json::from_slice(json).map_err(|e| ConnectError::invalid(format!("request message: {e}")))?);
        rest = &tail[len..];
    }
    Ok(out)
}

/// The single message of an enveloped request body.
fn unenvelope(body: &[u8]) -> Result<&[u8], ConnectError> {
    let (head, rest) =
        body.split_first_chunk::<5>().ok_or_else(|| ConnectError::invalid("malformed envelope: under 5 bytes"))?;
    let flag = head[0];
    if flag & COMPRESSED != 0 {
        return Err(ConnectError::invalid("compressed messages are not accepted"));
    }
    if flag & END_STREAM != 0 {
        return Err(ConnectError::invalid("malformed envelope: an end-of-stream flag on a request"));
    }
    let len = u32::from_be_bytes([head[1], head[2], head[3], head[4]]) as usize;
    if len > MAX_MESSAGE {
        return Err(ConnectError::new(Code::ResourceExhausted, format!("request message over {MAX_MESSAGE} bytes")));
    }
    if rest.len() != len {
        return Err(ConnectError::invalid(format!(
            "malformed envelope: it announces {len} bytes, the body has {} after the prefix",
            rest.len()
        )));
    }
    Ok(rest)
}

/// A unary answer.
pub fn unary(v: serde_json::Value) -> Response {
    (StatusCode::OK, axum::Json(v)).into_response()
}

/// A streaming answer over what `rx` yields (each item an envelope; the sender
/// ends the stream with [`end`]). Errors of a stream always travel in the end-of-stream
/// message, so the status is 200.
pub fn stream(rx: mpsc::Receiver<Bytes>) -> Response {
    let body = Body::from_stream(tokio_stream_of(rx).map(Ok::<Bytes, std::convert::Infallible>));
    let mut resp = Response::new(body);
    resp.headers_mut().insert(header::CONTENT_TYPE, HeaderValue::from_static("application/connect+json"));
    resp
}

/// A stream that is only its end: how a streaming call fails before it starts.
pub fn stream_error(e: ConnectError) -> Response {
    let (tx, rx) = mpsc::channel(1);
    let _ = tx.try_send(end(Some(&e)));
    stream(rx)
}

fn tokio_stream_of(rx: mpsc::Receiver<Bytes>) -> impl futures_util::Stream<Item = Bytes> {
    futures_util::stream::unfold(rx, |mut rx| async move { rx.recv().await.map(|b| (b, rx)) })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_client_stream_body_is_its_messages_in_order_up_to_its_end() {
        let mut body = Vec::new();
        body.extend_from_slice(&envelope(0, br#"{"start":{"process":{"pid":7}}}"#));
        body.extend_from_slice(&envelope(0, br#"{"data":{"input":{"stdin":"YQ=="}}}"#));
        body.extend_from_slice(&envelope(0, b""));
        body.extend_from_slice(&envelope(END_STREAM, b"{}"));
        let msgs: Vec<serde_json::Value> = messages(&body).expect("well-formed");
        assert_eq!(msgs.len(), 3);
        assert_eq!(msgs[0]["start"]["process"]["pid"], 7);
        assert_eq!(msgs[1]["data"]["input"]["stdin"], "YQ==");
        assert_eq!(msgs[2], serde_json::json!({}));
        // A length past the body, a short prefix, compression: refused.
        let mut bad = envelope(0, b"{}").to_vec();
        bad[4] = 9;
        assert!(messages::<serde_json::Value>(&bad).is_err());
        assert!(messages::<serde_json::Value>(&[0, 0]).is_err());
        assert!(messages::<serde_json::Value>(&envelope(COMPRESSED, b"{}")).is_err());
    }

    fn headers(ct: &str) -> HeaderMap {
        let mut h = HeaderMap::new();
        h.insert(header::CONTENT_TYPE, HeaderValue::from_str(ct).unwrap());
        h
    }

    #[test]
    fn envelopes_round_trip_and_bad_ones_are_refused() {
        let h = headers("application/connect+json");
        let b = message(&json!({"path": "/x"}));
        let v: serde_json::Value = request(&h, &b).unwrap();
        assert_eq!(v["path"], "/x");
        let e = end(None);
        assert_eq!(e[0], END_STREAM);
        assert_eq!(&e[5..], b"{}");
        for bad in [
            &b"\x00\x00\x00"[..],
            &b"\x00\x00\x00\x00\x09{}"[..],
            &b"\x01\x00\x00\x00\x02{}"[..],
            &b"\x02\x00\x00\x00\x02{}"[..],
        ] {
            let r: Result<serde_json::Value, _> = request(&h, bad);
            assert_eq!(r.unwrap_err().code, Code::InvalidArgument, "{bad:?}");
        }
        let big = [0u8, 0xff, 0xff, 0xff, 0xff];
        let r: Result<serde_json::Value, _> = request(&h, &big);
        assert_eq!(r.unwrap_err().code, Code::ResourceExhausted);
        let r: Result<serde_json::Value, _> = request(&headers("application/proto"), b"x");
        assert_eq!(r.unwrap_err().code, Code::InvalidArgument);
        let v: serde_json::Value = request(&headers("application/json"), b"").unwrap();
        assert!(v.as_object().unwrap().is_empty());
    }
}
