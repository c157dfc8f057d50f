//! Request extractors whose rejections come in the API's error shape.

use axum::body::Bytes;
use axum::extract::{FromRequest, FromRequestParts, Path, Request};
use axum::http::request::Parts;
use axum::http::StatusCode;
use forkbox_api::ErrorCode;
use serde::de::DeserializeOwned;

use crate::error::ApiError;

/// The body limits of a router, put into each request (so that 413s state them).
#[derive(Clone, Copy, Debug)]
pub struct BodyLimits {
    pub json: usize,
}

fn body_limit(req: &Request) -> Option<usize> {
    req.extensions().get::<BodyLimits>().map(|l| l.json)
}

/// A JSON body. Any content type is accepted; an empty body is `{}`. Errors
/// come in the API's shape: 400 `malformed_json`, 400 `invalid_request` (wrong
/// shape or an unknown field, naming the field's path, e.g.
/// `timeout_seconds: invalid type: string "x", expected f64`), 413
/// `payload_too_large` (over the body limit, which the message states).
pub struct ApiJson<T>(pub T);

impl<S: Send + Sync, T: DeserializeOwned> FromRequest<S> for ApiJson<T> {
    type Rejection = ApiError;

    async fn from_request(req: Request, state: &S) -> Result<Self, ApiError> {
        let limit = body_limit(&req);
        let bytes = Bytes::from_request(req, state).await.map_err(|rej| {
            if rej.status() == StatusCode::PAYLOAD_TOO_LARGE {
                let limit = limit.map_or(String::new(), |l| format!(" of {l} bytes"));
                ApiError::new(ErrorCode::PayloadTooLarge, format!("request body is over the size limit{limit}"))
            } else {
                ApiError::new(ErrorCode::MalformedJson, rej.body_text())
            }
        })?;
        let body: &[u8] = if bytes.iter().all(u8::is_ascii_whitespace) { b"{}" } else { &bytes };
        parse_json(body).map(ApiJson)
    }
}

/// `body` as a `T`; a data error names the path of the field it is about.
pub fn parse_json<T: DeserializeOwned>(body: &[u8]) -> Result<T, ApiError> {
    let de = &mut serde_json::Deserializer::from_slice(body);
    let r: Result<T, _> = serde_path_to_error::deserialize(de);
    let v = r.map_err(|e| {
        let mut path = e.path().to_string();
        let inner = e.into_inner();
        // serde_json appends " at line L column C": the field path says where.
        let mut msg = inner.to_string();
        let at = format!(" at line {} column {}", inner.line(), inner.column());
        if let Some(stripped) = msg.strip_suffix(at.as_str()) {
            msg = stripped.to_string();
        }
        // An unknown field's path ends with the field itself, which the message names: show where it is.
        if let Some(field) = msg.strip_prefix("unknown field `").and_then(|m| m.split('`').next()) {
            path = match path.strip_suffix(field) {
                Some("") => ".".to_string(),
                Some(parent) => parent.strip_suffix('.').unwrap_or(parent).to_string(),
                None => path,
            };
        }
        match inner.classify() {
            serde_json::error::Category::Data if path == "." => {
                ApiError::invalid(format!("invalid request body: {msg}"))
            }
            serde_json::error::Category::Data => ApiError::invalid(format!("invalid request body: {path}: {msg}")),
            _ => ApiError::new(ErrorCode::MalformedJson, format!("request body is not valid JSON: {inner}")),
        }
    })?;
    Ok(v)
}

/// A path parameter; a bad one (e.g. a number out of range) is 400 `invalid_request` in the API's shape.
pub struct ApiPath<T>(pub T);

impl<S: Send + Sync, T: DeserializeOwned + Send> FromRequestParts<S> for ApiPath<T> {
    type Rejection = ApiError;

    async fn from_request_parts(parts: &mut Parts, state: &S) -> Result<Self, ApiError> {
        Path::<T>::from_request_parts(parts, state)
            .await
            .map(|Path(v)| ApiPath(v))
            .map_err(|rej| ApiError::invalid(format!("invalid path parameter: {}", rej.body_text())))
    }
}

/// `key=value` pairs of a query string (400 `invalid_request` if it does not parse).
pub fn query_pairs(q: Option<&str>) -> Result<Vec<(String, String)>, ApiError> {
    serde_urlencoded::from_str(q.unwrap_or("")).map_err(|e| ApiError::invalid(format!("query string: {e}")))
}
