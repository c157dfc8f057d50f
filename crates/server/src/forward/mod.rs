//! Cluster: a request about a session goes to the node that has it resident.
//! Several `forkbox serve` share one database and one bucket; a
//! session is resident on one node at a time (a lease in the database, see
//! `forkbox_sessions::lease`). Any node may receive any request (a load
//! balancer in front of them picks one): for a route that acts on a session's
//! live state (exec and its stream, commands, files, interrupt, revert,
//! packages, the session itself, ForeverVM's exec and result), this layer asks
//! where the session is and, if another node has it, forwards the request
//! there and streams the answer back. Everything else (creating and listing
//! sessions, checkpoints, the tree of states, forks, one-shot execs) is
//! served by whichever node received it.
//!
//! Why forward rather than move the session: a moved session pays an
//! eviction and a resume (10-100 ms) per hop, and clients spread over the
//! nodes would move it on every call; a forward costs one loopback-or-LAN
//! round trip and keeps the session warm where it is.
//!
//! - At most one hop: a forwarded request carries [`FORWARDED_BY`]; the
//!   receiving node serves it or answers `session_moved` (503, retry).
//! - The owner does not answer (killed, cut off): its lease runs out within
//!   the lease time (its heartbeat stopped), then this node takes the session
//!   and serves the request here, at the session's last committed checkpoint.
//!   The request waits for that (at most the lease time plus a second).
//! - A race (another node took the session between the look-up and the
//!   exec): the exec is refused before it runs (`Elsewhere`, carried in the
//!   response's extensions as [`MovedTo`]) and forwarded once.
//! - The client's `Authorization` is passed on: keys live in the shared
//!   database, so the owner authenticates the request itself; rate limits and
//!   CPU budgets are counted by each node that serves a request.
//! - A WebSocket upgrade (ForeverVM's REPL) is not forwarded by this layer:
//!   its handler connects to the owner and relays messages ([`websocket`]).

use std::time::{Duration, Instant};

use axum::body::{Body, Bytes};
use axum::extract::{OriginalUri, Request, State};
use axum::http::{header, HeaderMap, HeaderName, Method, Uri};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use forkbox_api::ErrorCode;
use forkbox_runtime::SessionRoute;
use percent_encoding::{percent_decode_str, percent_encode, AsciiSet, NON_ALPHANUMERIC};

use crate::error::ApiError;
use crate::AppState;

pub(crate) mod websocket;

/// Set on a forwarded request (the forwarding node's id): never forwarded again.
pub const FORWARDED_BY: &str = "x-forkbox-forwarded-by";

/// In a response's extensions (never sent): the session of this request is
/// resident on the node at this URL; forward the request there.
#[derive(Clone, Debug)]
pub struct MovedTo(pub String);

/// How long a forward may take to connect before the owner counts as unreachable.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(2);

/// The session whose live state the request acts on, if it does (see the module doc).
pub fn owner_bound_session<'a>(method: &Method, path: &'a str) -> Option<&'a str> {
    let path = path.strip_prefix("/v1").unwrap_or(path);
    let mut parts = path.trim_start_matches('/').split('/');
    match (parts.next()?, parts.next()) {
        ("sessions", Some(id)) if !id.is_empty() => {
            let rest: Vec<&str> = parts.collect();
            let bound = match rest.as_slice() {
                // GET (its `resident` is the owner's to say), PATCH, DELETE.
                [] => true,
                ["exec"] | ["exec", "stream"] | ["commands"] | ["commands", "stream"] => true,
                ["interrupt"] | ["revert"] | ["packages"] => true,
                ["files", ..] => true,
                _ => false,
            };
            bound.then_some(id)
        }
        ("machine", Some(name)) if !name.is_empty() => {
            let rest: Vec<&str> = parts.collect();
            // Not `repl` (a WebSocket).
            let bound = matches!(rest.as_slice(), ["exec"] | ["exec", _, "result"]) && *method != Method::OPTIONS;
            bound.then_some(name)
        }
        _ => None,
    }
}

/// The middleware (after auth): see the module doc.
pub(crate) async fn forward(State(state): State<AppState>, req: Request, next: Next) -> Response {
    let Some(me) = state.runtime.node_id().map(str::to_owned) else { return next.run(req).await };
    let original = req.extensions().get::<OriginalUri>().map_or_else(|| req.uri().clone(), |o| o.0.clone());
    let Some(id) = owner_bound_session(req.method(), original.path()).map(str::to_owned) else {
        return next.run(req).await;
    };
    // Checked here, before any forward: the owner gets exactly this route's session and file path.
    let target = match forwarded_path(&original) {
        Ok(t) => t,
        Err(e) => return e.into_response(),
    };
    if req.headers().contains_key(FORWARDED_BY) || req.headers().contains_key(header::UPGRADE) {
        return next.run(req).await;
    }
    let (mut parts, body) = req.into_parts();
    let body = if is_upload(&parts.method, original.path()) {
        // Streamed into a temporary file as it arrives (never collected here); the
        // handler takes it from the extensions if the session is here.
        let caller = parts.extensions.get::<crate::auth::Caller>().cloned();
        match crate::uploads::receive(&state, &parts.headers, caller.as_ref(), body).await {
            Ok(u) => {
                parts.extensions.insert(u.clone());
                Payload::File(u)
            }
            Err(e) => return e.into_response(),
        }
    } else {
        match axum::body::to_bytes(body, state.config.body_limit).await {
            Ok(b) => Payload::Bytes(b),
            Err(_) => {
                return ApiError::new(ErrorCode::PayloadTooLarge, "the request body is over the size limit")
                    .into_response()
            }
        }
    };
    let (method, headers) = (parts.method.clone(), parts.headers.clone());
    let mut local = Some(parts);
    let owner = OwnerWait::new(&state, &id);
    loop {
        let route = match owner.route().await {
            Ok(r) => r,
            Err(e) => return e.into_response(),
        };
        match route {
            SessionRoute::Here => {
                let Some(parts) = local.take() else {
                    return moving(&id, "the session moved while this request was forwarded").into_response();
                };
                let local_body = match &body {
                    Payload::Bytes(b) => Body::from(b.clone()),
                    Payload::File(_) => Body::empty(),
                };
                let resp = next.clone().run(Request::from_parts(parts, local_body)).await;
                let Some(MovedTo(url)) = resp.extensions().get::<MovedTo>().cloned() else { return resp };
                // Taken by another node since the look-up (nothing ran here): forward once.
                return match send(&state, &me, &url, &method, &target, &headers, &body).await {
                    Ok(r) => r,
                    Err(_) => resp,
                };
            }
            SessionRoute::Node { node, url } => {
                match send(&state, &me, &url, &method, &target, &headers, &body).await {
                    Ok(r) => return r,
                    Err(why) => {
                        if let Err(e) = owner.unreachable(&node, why).await {
                            return e.into_response();
                        }
                    }
                }
            }
        }
    }
}

/// A request's body as the forward holds it: small bodies in memory, a file
/// upload in its temporary file (read again for each attempt).
enum Payload {
    Bytes(Bytes),
    File(crate::uploads::Spooled),
}

/// `PUT /v1/sessions/{id}/files/{path}`.
fn is_upload(method: &Method, path: &str) -> bool {
    let path = path.strip_prefix("/v1").unwrap_or(path);
    let mut parts = path.trim_start_matches('/').split('/');
    *method == Method::PUT
        && parts.next() == Some("sessions")
        && parts.next().is_some()
        && parts.next() == Some("files")
        && parts.next().is_some_and(|p| !p.is_empty())
}

/// Where a session is, asked again until its owner answers: an owner that
/// does not answer (killed, cut off) loses its lease within the lease time
/// if it is really gone, and then this node takes the session (`Here`).
/// Shared by HTTP forwards and the REPL relay ([`websocket`]).
pub(crate) struct OwnerWait<'a> {
    state: &'a AppState,
    id: &'a str,
    deadline: Instant,
}

impl<'a> OwnerWait<'a> {
    pub(crate) fn new(state: &'a AppState, id: &'a str) -> OwnerWait<'a> {
        let lease = state.runtime.lease_time().unwrap_or(Duration::from_secs(10));
        OwnerWait { state, id, deadline: Instant::now() + lease + Duration::from_secs(1) }
    }

    /// Where the session is now.
    pub(crate) async fn route(&self) -> Result<SessionRoute, ApiError> {
        let rt = self.state.runtime.clone();
        let sid = self.id.to_string();
        match tokio::task::spawn_blocking(move || rt.route_session(&sid)).await {
            Ok(r) => r.map_err(ApiError::from),
            Err(e) => Err(ApiError::from(e)),
        }
    }

    /// The owner `node` did not answer: wait a little before asking again,
    /// or `session_moved` once its lease should have run out.
    pub(crate) async fn unreachable(&self, node: &str, Unreachable(why): Unreachable) -> Result<(), ApiError> {
        if Instant::now() >= self.deadline {
            return Err(moving(self.id, &format!("node {node} does not answer ({why}) and still holds the session")));
        }
        tracing::debug!(session = %self.id, node = %node, "owner unreachable ({why}); waiting for its lease to run out");
        tokio::time::sleep(Duration::from_millis(250)).await;
        Ok(())
    }
}

fn moving(id: &str, why: &str) -> ApiError {
    ApiError::new(ErrorCode::SessionMoved, format!("session {id}: {why}; retry"))
}

/// The owner could not be reached (nothing was sent).
pub(crate) struct Unreachable(String);

/// Bytes of a path segment sent as they are; everything else is percent-encoded.
const SEGMENT: &AsciiSet = &NON_ALPHANUMERIC.remove(b'-').remove(b'.').remove(b'_').remove(b'~');

/// The path and query a forward sends for `uri`: each path segment decoded
/// and encoded again (so the HTTP client's URL parser, which resolves `.` and
/// `..` segments, also percent-encoded ones, and reads `\` as `/`, sends
/// exactly the route that was checked here), and 400 `invalid_path` for a
/// segment that is `.` or `..` once decoded: `files/../../../../v1/...`
/// names another route of the owner.
pub fn forwarded_path(uri: &Uri) -> Result<String, ApiError> {
    let mut out = String::with_capacity(uri.path().len());
    for (i, seg) in uri.path().split('/').enumerate() {
        let raw: Vec<u8> = percent_decode_str(seg).collect();
        if raw == b"." || raw == b".." {
            return Err(ApiError::new(ErrorCode::InvalidPath, "a path may not contain `.` or `..` segments"));
        }
        if i > 0 {
            out.push('/');
        }
        out.extend(percent_encode(&raw, SEGMENT));
    }
    if let Some(q) = uri.query() {
        out.push('?');
        out.push_str(q);
    }
    Ok(out)
}

/// Hop-by-hop headers (RFC 9110 7.6.1) and those the client library sets itself.
fn passed_on(name: &HeaderName) -> bool {
    !matches!(
        name.as_str(),
        "connection"
            | "keep-alive"
            | "proxy-connection"
            | "te"
            | "trailer"
            | "transfer-encoding"
            | "upgrade"
            | "host"
            | "content-length"
    )
}

/// Forward the request to the node at `base` and stream its answer back.
async fn send(
    state: &AppState,
    me: &str,
    base: &str,
    method: &Method,
    target: &str,
    headers: &HeaderMap,
    body: &Payload,
) -> Result<Response, Unreachable> {
    let url = format!("{}{target}", base.trim_end_matches('/'));
    let body = match body {
        Payload::Bytes(b) => reqwest::Body::from(b.clone()),
        Payload::File(u) => reqwest::Body::wrap_stream(crate::uploads::stream(u.file.clone(), u.len)),
    };
    let mut req = state.peers.request(method.clone(), &url).body(body).header(FORWARDED_BY, me);
    for (k, v) in headers {
        if passed_on(k) {
            req = req.header(k, v);
        }
    }
    let resp = match req.send().await {
        Ok(r) => r,
        Err(e) if e.is_connect() => return Err(Unreachable(e.to_string())),
        // Sent, but no answer: it may have run there; the client decides.
        Err(e) => {
            return Ok(ApiError::new(
                ErrorCode::SessionMoved,
                format!("the node that has the session failed to answer: {e}; retry"),
            )
            .into_response())
        }
    };
    crate::metrics::forwarded();
    let mut out = Response::builder().status(resp.status().as_u16());
    for (k, v) in resp.headers() {
        if passed_on(k) {
            out = out.header(k, v);
        }
    }
    match out.body(Body::from_stream(resp.bytes_stream())) {
        Ok(r) => Ok(r),
        Err(e) => Ok(ApiError::internal(format!("forwarding the answer: {e}")).into_response()),
    }
}

/// The HTTP client the nodes forward with (no proxy from the environment,
/// no overall timeout: an exec is as long as its own time limit).
pub(crate) fn peers() -> reqwest::Client {
    reqwest::Client::builder()
        .connect_timeout(CONNECT_TIMEOUT)
        .no_proxy()
        .build()
        .unwrap_or_else(|_| reqwest::Client::new())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn owner_bound_routes() {
        let get = Method::GET;
        let post = Method::POST;
        for p in [
            "/v1/sessions/s_1",
            "/v1/sessions/s_1/exec",
            "/v1/sessions/s_1/exec/stream",
            "/v1/sessions/s_1/commands",
            "/v1/sessions/s_1/commands/stream",
            "/v1/sessions/s_1/interrupt",
            "/v1/sessions/s_1/revert",
            "/v1/sessions/s_1/packages",
            "/v1/sessions/s_1/files",
            "/v1/sessions/s_1/files/a/b.txt",
            "/sessions/s_1/exec",
        ] {
            assert_eq!(owner_bound_session(&post, p), Some("s_1"), "{p}");
        }
        assert_eq!(owner_bound_session(&post, "/v1/machine/s_2/exec"), Some("s_2"));
        assert_eq!(owner_bound_session(&get, "/v1/machine/s_2/exec/3/result"), Some("s_2"));
        for p in [
            "/v1/sessions",
            "/v1/sessions/",
            "/v1/sessions/s_1/checkpoints",
            "/v1/sessions/s_1/tree",
            "/v1/sessions/s_1/explore",
            "/v1/sessions/s_1/diff",
            "/v1/sessions/s_1/fork",
            "/v1/sessions/s_1/checkpoints/2/variables",
            "/v1/machine/s_2/repl",
            "/v1/machine/new",
            "/v1/exec",
            "/healthz",
        ] {
            assert_eq!(owner_bound_session(&post, p), None, "{p}");
        }
    }

    #[test]
    fn forwarded_paths_are_the_checked_route() {
        let f = |p: &str| forwarded_path(&p.parse::<Uri>().unwrap()).map_err(|e| e.code);
        assert_eq!(f("/v1/sessions/s_1/files/a/b.txt").unwrap(), "/v1/sessions/s_1/files/a/b.txt");
        assert_eq!(f("/v1/sessions/s_1/files?dir=/output").unwrap(), "/v1/sessions/s_1/files?dir=/output");
        // Encoded the same way whatever the client sent; a `\` stays a byte of the name.
        assert_eq!(f("/v1/sessions/s_1/files/a%20b\\c").unwrap(), "/v1/sessions/s_1/files/a%20b%5Cc");
        assert_eq!(f("/v1/sessions/s_1/files/%2e%2e%2Fx").unwrap(), "/v1/sessions/s_1/files/..%2Fx");
        for bad in [
            "/v1/sessions/S/files/../../../../v1/whoami",
            "/v1/sessions/S/files/%2e%2e/%2E%2E/v1/sessions",
            "/v1/sessions/S/files/.%2e/x",
            "/v1/sessions/S/./exec",
        ] {
            assert_eq!(f(bad), Err(ErrorCode::InvalidPath), "{bad}");
        }
    }
}
