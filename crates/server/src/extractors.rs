//! Request extractors whose rejections come in the API's error shape.

use axum::body::Bytes;
use axum::extract::{FromRequest, FromRequestParts, Path, Request};
use axum::http::request::Parts;
use axum::http::StatusCode;
use forkbox_api::ErrorCode;
use serde::de::DeserializeOwned;

use crate::error::ApiError;

/// A JSON body. Any content type is accepted; an empty body is `{}`. Errors
/// come in the API's shape: 400 `malformed_json`, 400 `invalid_request` (wrong
/// shape), 413 `payload_too_large` (over the body limit).
pub struct ApiJson<T>(pub T);

impl<S: Send + Sync, T: DeserializeOwned> FromRequest<S> for ApiJson<T> {
    type Rejection = ApiError;

    async fn from_request(req: Request, state: &S) -> Result<Self, ApiError> {
        let bytes = Bytes::from_request(req, state).await.map_err(|rej| {
            if rej.status() == StatusCode::PAYLOAD_TOO_LARGE {
                ApiError::new(ErrorCode::PayloadTooLarge, "request body is over the size limit")
            } else {
                ApiError::new(ErrorCode::MalformedJson, rej.body_text())
            }
        })?;
        let body: &[u8] = if bytes.iter().all(u8::is_ascii_whitespace) { b"{}" } else { &bytes };
        serde_json::from_slice(body).map(ApiJson).map_err(|e| match e.classify() {
            serde_json::error::Category::Data => ApiError::invalid(format!("invalid request body: {e}")),
            _ => ApiError::new(ErrorCode::MalformedJson, format!("request body is not valid JSON: {e}")),
        })
    }
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

/// A raw request body; over the route's limit is 413 `file_too_large`.
pub struct RawBody(pub Bytes);

impl<S: Send + Sync> FromRequest<S> for RawBody {
    type Rejection = ApiError;

    async fn from_request(req: Request, state: &S) -> Result<Self, ApiError> {
        Bytes::from_request(req, state).await.map(RawBody).map_err(|rej| {
            if rej.status() == StatusCode::PAYLOAD_TOO_LARGE {
                ApiError::new(ErrorCode::FileTooLarge, "the upload is over the file size limit")
            } else {
                ApiError::invalid(format!("reading the request body: {}", rej.body_text()))
            }
        })
    }
}

/// `key=value` pairs of a query string (400 `invalid_request` if it does not parse).
pub fn query_pairs(q: Option<&str>) -> Result<Vec<(String, String)>, ApiError> {
    serde_urlencoded::from_str(q.unwrap_or("")).map_err(|e| ApiError::invalid(format!("query string: {e}")))
}
