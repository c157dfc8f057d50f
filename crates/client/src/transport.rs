//! Where requests go: a forkbox server over HTTP, or an API router in this
//! process (no socket). Both give back a status, a content type and the body as
//! a byte stream, so everything above behaves (and fails) the same way.

use std::pin::Pin;

use axum::body::Body;
use axum::http::{header, Method, Request};
use bytes::Bytes;
use futures_util::{Stream, StreamExt, TryStreamExt};
use tower::ServiceExt;

use crate::error::ClientError;

/// How to reach the API.
#[derive(Clone)]
pub enum Transport {
    /// A server at `base_url` (e.g. `http://127.0.0.1:8080`), authenticated with
    /// `key` (`Authorization: Bearer`) when there is one.
    Http { base_url: String, key: Option<String> },
    /// An axum router in this process (`forkbox_server::embedded_router`, or the
    /// API router itself when the caller supplies a key): requests are served
    /// by `tower::ServiceExt::oneshot`, without a socket.
    InProcess(axum::Router),
}

impl std::fmt::Debug for Transport {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            // Never print the key.
            Transport::Http { base_url, key } => f
                .debug_struct("Http")
                .field("base_url", base_url)
                .field("key", &key.as_ref().map(|_| "<redacted>"))
                .finish(),
            Transport::InProcess(_) => f.write_str("InProcess"),
        }
    }
}

pub(crate) type ByteStream = Pin<Box<dyn Stream<Item = Result<Bytes, ClientError>> + Send>>;

/// A request body.
pub(crate) enum Payload {
    None,
    Json(Vec<u8>),
    Raw(Vec<u8>),
}

/// A response whose body has not been read yet.
pub(crate) struct RawResponse {
    pub status: u16,
    pub content_type: String,
    pub body: ByteStream,
}

impl RawResponse {
    pub async fn bytes(self) -> Result<Vec<u8>, ClientError> {
        let mut out = Vec::new();
        let mut body = self.body;
        while let Some(chunk) = body.next().await {
            out.extend_from_slice(&chunk?);
        }
        Ok(out)
    }
}

/// Sends one request. `path_and_query` starts with `/` and is already percent-encoded.
pub(crate) struct Sender {
    pub transport: Transport,
    /// Overrides the transport's key (see `Client::with_key`).
    pub key: Option<String>,
    pub http: reqwest::Client,
}

impl Sender {
    fn key(&self) -> Option<&str> {
        match (&self.key, &self.transport) {
            (Some(k), _) => Some(k),
            (None, Transport::Http { key, .. }) => key.as_deref(),
            (None, Transport::InProcess(_)) => None,
        }
    }

    pub async fn send(
        &self,
        method: Method,
        path_and_query: &str,
        payload: Payload,
    ) -> Result<RawResponse, ClientError> {
        let (content_type, body) = match payload {
            Payload::None => (None, Vec::new()),
            Payload::Json(b) => (Some("application/json"), b),
            Payload::Raw(b) => (Some("application/octet-stream"), b),
        };
        match &self.transport {
            Transport::Http { base_url, .. } => {
                let url = format!("{}{path_and_query}", base_url.trim_end_matches('/'));
                let mut req = self.http.request(method, &url);
                if let Some(k) = self.key() {
                    req = req.bearer_auth(k);
                }
                if let Some(ct) = content_type {
                    req = req.header(header::CONTENT_TYPE, ct).body(body);
                }
                let resp = req.send().await.map_err(|e| ClientError::Http { url: url.clone(), source: e })?;
                let status = resp.status().as_u16();
                let content_type = content_type_of(resp.headers());
                let body = resp.bytes_stream().map_err(move |e| ClientError::Http { url: url.clone(), source: e });
                Ok(RawResponse { status, content_type, body: Box::pin(body) })
            }
            Transport::InProcess(router) => {
                let mut req = Request::builder().method(method).uri(path_and_query);
                if let Some(k) = self.key() {
                    req = req.header(header::AUTHORIZATION, format!("Bearer {k}"));
                }
                if let Some(ct) = content_type {
                    req = req.header(header::CONTENT_TYPE, ct);
                }
                let req = req
                    .body(Body::from(body))
                    .map_err(|e| ClientError::InvalidArgument(format!("building the request: {e}")))?;
                let resp = match router.clone().oneshot(req).await {
                    Ok(r) => r,
                    Err(never) => match never {},
                };
                let status = resp.status().as_u16();
                let content_type = content_type_of(resp.headers());
                let body = resp.into_body().into_data_stream().map_err(|e| ClientError::Body(e.to_string()));
                Ok(RawResponse { status, content_type, body: Box::pin(body) })
            }
        }
    }
}

fn content_type_of(h: &axum::http::HeaderMap) -> String {
    h.get(header::CONTENT_TYPE).and_then(|v| v.to_str().ok()).unwrap_or("").to_ascii_lowercase()
}
