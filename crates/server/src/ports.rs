//! Ports: servers inside a session reachable through forkbox.
//!
//! `ANY /v1/sessions/{id}/ports/{port}/{path...}` reverse-proxies HTTP/1.1
//! (streamed bodies both ways, so SSE works) and WebSocket upgrades (bytes
//! relayed both ways after the 101) to the listener on `port` inside the
//! session's sandbox. The connection is one the sandbox accepts from its own
//! listener (`Runtime::connect_port`: a host socket pair, never a host port),
//! so nothing but that sandbox's server can be reached. A paused session is
//! resumed by the request.
//!
//! Who may: the session's tenant by its key (`Authorization: Bearer`; another
//! tenant gets 404 as on every session route), or anyone holding a signed,
//! expiring URL from `POST /v1/sessions/{id}/ports/{port}/url`. The URL's
//! `fbx_token` (HMAC-SHA256 with a secret of this server process, over the
//! tenant, session, port and expiry) is also set as a cookie scoped to the
//! port's prefix, so the page's own relative links and scripts work. With
//! `serve --sandbox-domain DOMAIN`, `Host: <port>-<session id>.<DOMAIN>` is
//! routed the same way (the cookie then scoped to that host).
//!
//! What the guest sees: the request with its path under the port prefix,
//! `Host: localhost:<port>`, hop-by-hop headers dropped and forkbox's own
//! credentials (the key, the token and its cookie) removed.

use std::time::{Duration, SystemTime, UNIX_EPOCH};

use axum::body::Body;
use axum::extract::{Path, Request, State};
use axum::http::{header, HeaderMap, HeaderValue, Method, StatusCode, Uri};
use axum::response::{IntoResponse, Response};
use axum::routing::any;
use axum::Router;
use base64::Engine as _;
use forkbox_api::ErrorCode;
use hmac::{KeyInit, Mac};
use hyper_util::rt::TokioIo;

use crate::auth::caller_for_key;
use crate::error::ApiError;
use crate::AppState;

/// The query parameter (and cookie) of a signed URL.
pub const TOKEN_PARAM: &str = "fbx_token";
/// Default and longest lifetime of a signed URL.
pub const DEFAULT_EXPIRES_S: u64 = 3600;
pub const MAX_EXPIRES_S: u64 = 7 * 86_400;
/// How long the sandbox's server may take to answer a request's head
/// (a streamed body may then run as long as it likes).
const HEAD_TIMEOUT: Duration = Duration::from_secs(60);

type HmacSha256 = hmac::Hmac<sha2_11::Sha256>;

/// Signs and checks port URLs with a secret of this server process (a
/// restart makes every URL handed out before invalid).
pub struct PortSigner {
    secret: Vec<u8>,
}

impl PortSigner {
    pub fn new() -> anyhow::Result<PortSigner> {
        Ok(PortSigner { secret: hex::decode(crate::keys::random_hex(32)?)? })
    }

    fn mac(&self, tenant: &str, id: &str, port: u16, exp: u64) -> HmacSha256 {
        // KeyInit takes a key of any length for HMAC.
        let mut m = <HmacSha256 as KeyInit>::new_from_slice(&self.secret).unwrap_or_else(|_| unreachable!());
        // Lengths first: no two (tenant, id) pairs sign the same bytes.
        for part in [tenant.as_bytes(), id.as_bytes()] {
            m.update(&(part.len() as u64).to_le_bytes());
            m.update(part);
        }
        m.update(&port.to_le_bytes());
        m.update(&exp.to_le_bytes());
        m
    }

    /// The token of a URL: `<exp>.<tenant, base64url>.<signature, hex>`.
    pub fn sign(&self, tenant: &str, id: &str, port: u16, exp: u64) -> String {
        let sig = hex::encode(self.mac(tenant, id, port, exp).finalize().into_bytes());
        let t = base64::engine::general_purpose::URL_SAFE_NO_PAD.encode(tenant);
        format!("{exp}.{t}.{sig}")
    }

    /// The tenant a token for session `id`, port `port` stands for: 403 if
    /// it was not made here for them, 401 once it expired.
    pub fn verify(&self, token: &str, id: &str, port: u16) -> Result<String, ApiError> {
        let forged =
            || ApiError::new(ErrorCode::Forbidden, "the port URL's token is not valid for this session and port");
        let mut parts = token.splitn(3, '.');
        let (Some(exp), Some(t), Some(sig)) = (parts.next(), parts.next(), parts.next()) else { return Err(forged()) };
        let exp: u64 = exp.parse().map_err(|_| forged())?;
        let tenant = base64::engine::general_purpose::URL_SAFE_NO_PAD.decode(t).map_err(|_| forged())?;
        let tenant = String::from_utf8(tenant).map_err(|_| forged())?;
        let sig = hex::decode(sig).map_err(|_| forged())?;
        // Constant time.
        self.mac(&tenant, id, port, exp).verify_slice(&sig).map_err(|_| forged())?;
        if exp < now_s() {
            return Err(ApiError::unauthorized("the port URL has expired: ask for a new one"));
        }
        Ok(tenant)
    }
}

fn now_s() -> u64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| d.as_secs())
}

/// The proxy's routes (outside the `/v1` auth layer: a signed URL has no key).
pub fn routes(state: AppState) -> Router {
    Router::new()
        .route("/v1/sessions/{id}/ports/{port}", any(by_path))
        .route("/v1/sessions/{id}/ports/{port}/", any(by_path))
        .route("/v1/sessions/{id}/ports/{port}/{*path}", any(by_path_rest))
        .with_state(state)
}

async fn by_path(State(state): State<AppState>, Path((id, port)): Path<(String, String)>, req: Request) -> Response {
    path_route(state, id, port, String::new(), req).await
}

async fn by_path_rest(
    State(state): State<AppState>,
    Path((id, port, path)): Path<(String, String, String)>,
    req: Request,
) -> Response {
    path_route(state, id, port, path, req).await
}

/// A port number a client gave: 1-65535.
pub fn parse_port(s: &str) -> Result<u16, ApiError> {
    match s.parse::<u16>() {
        Ok(p) if p > 0 => Ok(p),
        _ => Err(ApiError::invalid(format!("{s:?} is not a port (1-65535)"))),
    }
}

async fn path_route(state: AppState, id: String, port: String, rest: String, req: Request) -> Response {
    let port = match parse_port(&port) {
        Ok(p) => p,
        Err(e) => return e.into_response(),
    };
    // `POST .../ports/{port}/url` with a key hands out a signed URL (the
    // guest's own `/url` is reached with GET or through a signed URL).
    if rest == "url" && req.method() == Method::POST && bearer(req.headers()).is_some() {
        return match issue_url(&state, &id, port, req).await {
            Ok(r) => r,
            Err(e) => e.into_response(),
        };
    }
    let prefix = format!("/v1/sessions/{id}/ports/{port}");
    // The guest's path: the part after the prefix (raw, as the client sent it).
    let raw = req.uri().path();
    let guest_path = raw.strip_prefix(prefix.as_str()).filter(|p| p.starts_with('/')).unwrap_or("/").to_string();
    serve(state, id, port, guest_path, req, &prefix).await
}

/// The `<port>-<session id>` of `Host: <port>-<id>.<domain>` under `serve --sandbox-domain`.
pub fn host_target(headers: &HeaderMap, domain: &str) -> Option<(u16, String)> {
    let host = headers.get(header::HOST)?.to_str().ok()?.trim().to_ascii_lowercase();
    let host = host.as_str();
    // Without a port of the server (`...domain:8080`).
    let name = host.rsplit_once(':').filter(|(_, p)| p.bytes().all(|b| b.is_ascii_digit())).map_or(host, |(n, _)| n);
    let first = name.strip_suffix(domain)?.strip_suffix('.')?;
    if first.contains('.') {
        return None;
    }
    let (port, id) = first.split_once('-')?;
    let port = parse_port(port).ok()?;
    (!id.is_empty()).then(|| (port, id.to_string()))
}

/// A request for `Host: <port>-<id>.<domain>` (see [`host_target`]).
pub async fn by_host(state: AppState, port: u16, id: String, req: Request) -> Response {
    let path = req.uri().path().to_string();
    serve(state, id, port, path, req, "/").await
}

/// An E2B sandbox's port (`get_host(port)`): the caller checked the sandbox's token.
pub async fn for_e2b(state: AppState, tenant: String, port: u16, id: String, req: Request) -> Response {
    let path = req.uri().path().to_string();
    match proxy(&state, &tenant, &id, port, path, req, None).await {
        Ok(r) => r,
        Err(e) => e.into_response(),
    }
}

fn bearer(h: &HeaderMap) -> Option<&str> {
    let v = h.get(header::AUTHORIZATION)?.to_str().ok()?.trim();
    v.strip_prefix("Bearer ").or_else(|| v.strip_prefix("bearer ")).map(str::trim)
}

/// `fbx_token` from the query, else from the cookie.
fn token_of(req: &Request) -> (Option<String>, bool) {
    let from_query = crate::extractors::query_pairs(req.uri().query())
        .ok()
        .and_then(|q| q.into_iter().find(|(k, _)| k == TOKEN_PARAM).map(|(_, v)| v));
    if from_query.is_some() {
        return (from_query, true);
    }
    (cookie(req.headers(), TOKEN_PARAM), false)
}

fn cookie(h: &HeaderMap, name: &str) -> Option<String> {
    h.get_all(header::COOKIE).iter().filter_map(|v| v.to_str().ok()).flat_map(|v| v.split(';')).find_map(|c| {
        let (k, v) = c.trim().split_once('=')?;
        (k == name).then(|| v.to_string())
    })
}

/// Authenticate (a key, or a token in the query or cookie), then proxy.
async fn serve(state: AppState, id: String, port: u16, guest_path: String, req: Request, scope: &str) -> Response {
    let (tenant, set_cookie) = if let Some(key) = bearer(req.headers()) {
        match caller_for_key(&state, key).await {
            Ok(c) => (c.tenant, None),
            Err(e) => return e.into_response(),
        }
    } else {
        let (token, in_query) = token_of(&req);
        let Some(token) = token else {
            return ApiError::unauthorized(
                "missing credentials: send `Authorization: Bearer <key>`, or use a URL from POST /v1/sessions/{id}/ports/{port}/url",
            )
            .into_response();
        };
        match state.port_signer.verify(&token, &id, port) {
            // The page's own links carry no token: the cookie does, for this port's prefix only.
            Ok(t) => {
                let c = in_query.then(|| format!("{TOKEN_PARAM}={token}; Path={scope}; HttpOnly; SameSite=Lax"));
                (t, c.and_then(|c| HeaderValue::from_str(&c).ok()))
            }
            Err(e) => return e.into_response(),
        }
    };
    match proxy(&state, &tenant, &id, port, guest_path, req, set_cookie).await {
        Ok(r) => r,
        Err(e) => e.into_response(),
    }
}

/// Hop-by-hop headers (RFC 9110 7.6.1) and forkbox's credentials: never passed on.
const DROPPED: &[&str] = &[
    "connection",
    "keep-alive",
    "proxy-authenticate",
    "proxy-authorization",
    "proxy-connection",
    "te",
    "trailer",
    "transfer-encoding",
    "upgrade",
    "host",
    "authorization",
    "x-access-token",
    "x-api-key",
    "e2b-sandbox-id",
    "e2b-sandbox-port",
    "e2b-traffic-access-token",
];

/// `h` without hop-by-hop headers (also those its `Connection` names).
fn end_to_end(h: &HeaderMap) -> HeaderMap {
    let named: Vec<String> = h
        .get_all(header::CONNECTION)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(',').map(|s| s.trim().to_ascii_lowercase()))
        .collect();
    let mut out = HeaderMap::with_capacity(h.len());
    for (k, v) in h {
        let n = k.as_str();
        if DROPPED.contains(&n) || named.iter().any(|c| c == n) {
            continue;
        }
        out.append(k.clone(), v.clone());
    }
    out
}

/// The request's `Cookie` without forkbox's token.
fn cookies_without_token(h: &HeaderMap) -> Option<HeaderValue> {
    let kept: Vec<&str> = h
        .get_all(header::COOKIE)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(';'))
        .map(str::trim)
        .filter(|c| !c.is_empty() && c.split_once('=').is_none_or(|(k, _)| k != TOKEN_PARAM))
        .collect();
    (!kept.is_empty()).then(|| HeaderValue::from_str(&kept.join("; ")).ok()).flatten()
}

/// The query without `fbx_token` (the guest never sees it).
fn query_without_token(q: Option<&str>) -> Option<String> {
    let q = q?;
    let kept: Vec<&str> = q.split('&').filter(|p| p.split('=').next() != Some(TOKEN_PARAM) && !p.is_empty()).collect();
    (!kept.is_empty()).then(|| kept.join("&"))
}

fn wants_upgrade(h: &HeaderMap) -> bool {
    let conn_upgrade = h
        .get_all(header::CONNECTION)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .any(|v| v.split(',').any(|t| t.trim().eq_ignore_ascii_case("upgrade")));
    conn_upgrade && h.contains_key(header::UPGRADE)
}

fn bad_gateway(message: String) -> ApiError {
    ApiError::new(ErrorCode::PortNotListening, message)
}

/// Proxy `req` to the listener on `port` of session `id` of `tenant`.
async fn proxy(
    state: &AppState,
    tenant: &str,
    id: &str,
    port: u16,
    guest_path: String,
    mut req: Request,
    set_cookie: Option<HeaderValue>,
) -> Result<Response, ApiError> {
    let limit = state.config.body_limit;
    let declared = req.headers().get(header::CONTENT_LENGTH).and_then(|v| v.to_str().ok()?.parse::<u64>().ok());
    if declared.is_some_and(|n| n > limit as u64) {
        return Err(ApiError::new(ErrorCode::PayloadTooLarge, format!("the request body is over {limit} bytes")));
    }
    let upgrade = wants_upgrade(req.headers());
    let client_upgrade = upgrade.then(|| hyper::upgrade::on(&mut req));
    let stream = state.runtime.connect_port(tenant, id, port).await?;
    let stream = tokio::net::UnixStream::from_std(stream)
        .map_err(|e| ApiError::internal(format!("the port connection: {e}")))?;
    let (mut sender, conn) = hyper::client::conn::http1::handshake(TokioIo::new(stream))
        .await
        .map_err(|e| bad_gateway(format!("the sandbox's server on port {port}: {e}")))?;
    tokio::spawn(async move {
        if let Err(e) = conn.with_upgrades().await {
            tracing::debug!("a port connection: {e}");
        }
    });

    let (parts, body) = req.into_parts();
    let query = query_without_token(parts.uri.query());
    let pq = match &query {
        Some(q) => format!("{guest_path}?{q}"),
        None => guest_path,
    };
    let uri: Uri = pq.parse().map_err(|_| ApiError::invalid("the request's path is not a valid URI path"))?;
    let mut headers = end_to_end(&parts.headers);
    headers.remove(header::COOKIE);
    if let Some(c) = cookies_without_token(&parts.headers) {
        headers.insert(header::COOKIE, c);
    }
    if let Ok(h) = HeaderValue::from_str(&format!("localhost:{port}")) {
        headers.insert(header::HOST, h);
    }
    if upgrade {
        if let Some(u) = parts.headers.get(header::UPGRADE) {
            headers.insert(header::UPGRADE, u.clone());
        }
        headers.insert(header::CONNECTION, HeaderValue::from_static("upgrade"));
    }
    let mut out = hyper::Request::builder()
        .method(parts.method.clone())
        .uri(uri)
        .version(axum::http::Version::HTTP_11)
        .body(http_body_util::Limited::new(body, limit))
        .map_err(|e| ApiError::invalid(format!("the request: {e}")))?;
    *out.headers_mut() = headers;

    let resp = tokio::time::timeout(HEAD_TIMEOUT, sender.send_request(out))
        .await
        .map_err(|_| {
            ApiError::new(
                ErrorCode::Timeout,
                format!("the sandbox's server on port {port} did not answer within {} s", HEAD_TIMEOUT.as_secs()),
            )
        })?
        .map_err(|e| {
            if is_body_limit(&e) {
                ApiError::new(ErrorCode::PayloadTooLarge, format!("the request body is over {limit} bytes"))
            } else {
                bad_gateway(format!("the sandbox's server on port {port} closed the connection without an answer: {e}"))
            }
        })?;

    if resp.status() == StatusCode::SWITCHING_PROTOCOLS {
        let Some(client_upgrade) = client_upgrade else {
            return Err(bad_gateway(format!("the sandbox's server on port {port} switched protocols unasked")));
        };
        let (rparts, rbody) = resp.into_parts();
        let mut guest_resp = hyper::Response::from_parts(rparts.clone(), rbody);
        tokio::spawn(async move {
            let (Ok(guest), Ok(client)) = (hyper::upgrade::on(&mut guest_resp).await, client_upgrade.await) else {
                return;
            };
            let (mut g, mut c) = (TokioIo::new(guest), TokioIo::new(client));
            let _ = tokio::io::copy_bidirectional(&mut c, &mut g).await;
        });
        let mut r = Response::new(Body::empty());
        *r.status_mut() = StatusCode::SWITCHING_PROTOCOLS;
        let mut h = end_to_end(&rparts.headers);
        if let Some(u) = rparts.headers.get(header::UPGRADE) {
            h.insert(header::UPGRADE, u.clone());
        }
        h.insert(header::CONNECTION, HeaderValue::from_static("upgrade"));
        *r.headers_mut() = h;
        return Ok(r);
    }

    let (rparts, rbody) = resp.into_parts();
    let mut r = Response::new(Body::new(rbody));
    *r.status_mut() = rparts.status;
    let mut h = end_to_end(&rparts.headers);
    if let Some(c) = set_cookie {
        h.append(header::SET_COOKIE, c);
    }
    *r.headers_mut() = h;
    Ok(r)
}

fn is_body_limit(e: &hyper::Error) -> bool {
    let mut src: Option<&(dyn std::error::Error + 'static)> = std::error::Error::source(e);
    while let Some(s) = src {
        if s.is::<http_body_util::LengthLimitError>() {
            return true;
        }
        src = s.source();
    }
    false
}

/// `POST /v1/sessions/{id}/ports/{port}/url` `{"expires_in": s}`.
async fn issue_url(state: &AppState, id: &str, port: u16, req: Request) -> Result<Response, ApiError> {
    let Some(key) = bearer(req.headers()) else { return Err(ApiError::unauthorized("missing API key")) };
    let caller = caller_for_key(state, key).await?;
    let host = req.headers().get(header::HOST).and_then(|v| v.to_str().ok()).map(str::to_string);
    let body = axum::body::to_bytes(req.into_body(), 64 << 10)
        .await
        .map_err(|_| ApiError::new(ErrorCode::PayloadTooLarge, "the request body is over 64 KiB"))?;
    #[derive(serde::Deserialize)]
    #[serde(deny_unknown_fields)]
    struct UrlRequest {
        expires_in: Option<u64>,
    }
    let r: UrlRequest = if body.iter().all(u8::is_ascii_whitespace) {
        UrlRequest { expires_in: None }
    } else {
        serde_json::from_slice(&body).map_err(|e| ApiError::new(ErrorCode::MalformedJson, format!("{e}")))?
    };
    let expires_in = r.expires_in.unwrap_or(DEFAULT_EXPIRES_S);
    if !(1..=MAX_EXPIRES_S).contains(&expires_in) {
        return Err(ApiError::invalid(format!("expires_in must be 1-{MAX_EXPIRES_S} seconds")));
    }
    // The session must be the caller's (404 otherwise, as on every session route).
    let (rt, tenant, sid) = (state.runtime.clone(), caller.tenant.clone(), id.to_string());
    tokio::task::spawn_blocking(move || rt.session(&tenant, &sid))
        .await
        .map_err(|_| ApiError::internal("the session look-up failed"))??;
    let exp = now_s().saturating_add(expires_in);
    let token = state.port_signer.sign(&caller.tenant, id, port, exp);
    let base = match host {
        Some(h) if h.bytes().all(|b| b.is_ascii_graphic()) => {
            format!("http://{h}")
        }
        _ => format!("http://{}", state.config.listen),
    };
    let url = format!("{base}/v1/sessions/{id}/ports/{port}/?{TOKEN_PARAM}={token}");
    let mut domain_url = None;
    if let Some(d) = &state.config.sandbox_domain {
        domain_url = Some(format!("http://{port}-{id}.{d}/?{TOKEN_PARAM}={token}"));
    }
    let expires_at = humantime::format_rfc3339_seconds(UNIX_EPOCH + Duration::from_secs(exp)).to_string();
    Ok(axum::Json(serde_json::json!({
        "url": url,
        "host_url": domain_url,
        "token": token,
        "expires_at": expires_at,
    }))
    .into_response())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn signer() -> PortSigner {
        PortSigner::new().unwrap()
    }

    #[test]
    fn tokens_check_tenant_session_port_and_expiry() {
        let s = signer();
        let exp = now_s() + 60;
        let t = s.sign("acme", "s_1", 8000, exp);
        assert_eq!(s.verify(&t, "s_1", 8000).unwrap(), "acme");
        assert_eq!(s.verify(&t, "s_2", 8000).unwrap_err().code, ErrorCode::Forbidden);
        assert_eq!(s.verify(&t, "s_1", 8001).unwrap_err().code, ErrorCode::Forbidden);
        // Another tenant's name in a token signed for acme.
        let (e, rest) = t.split_once('.').unwrap();
        let sig = rest.split_once('.').unwrap().1;
        let other = base64::engine::general_purpose::URL_SAFE_NO_PAD.encode("evil");
        assert_eq!(s.verify(&format!("{e}.{other}.{sig}"), "s_1", 8000).unwrap_err().code, ErrorCode::Forbidden);
        // A later expiry with the old signature.
        let later = rest;
        assert_eq!(s.verify(&format!("{}.{later}", exp + 1000), "s_1", 8000).unwrap_err().code, ErrorCode::Forbidden);
        // Another server's secret.
        assert_eq!(signer().verify(&t, "s_1", 8000).unwrap_err().code, ErrorCode::Forbidden);
        let old = s.sign("acme", "s_1", 8000, now_s() - 1);
        assert_eq!(s.verify(&old, "s_1", 8000).unwrap_err().code, ErrorCode::Unauthorized);
        for junk in ["", "x", "1.2", "1.!!.00", "a.b.c"] {
            assert_eq!(s.verify(junk, "s_1", 8000).unwrap_err().code, ErrorCode::Forbidden, "{junk}");
        }
    }

    #[test]
    fn host_form_and_header_filters() {
        let mut h = HeaderMap::new();
        h.insert(header::HOST, HeaderValue::from_static("8000-s_abc.sb.example:8080"));
        assert_eq!(host_target(&h, "sb.example"), Some((8000, "s_abc".into())));
        h.insert(header::HOST, HeaderValue::from_static("8000-s_abc.evil.sb.example"));
        assert_eq!(host_target(&h, "sb.example"), None);
        h.insert(header::HOST, HeaderValue::from_static("0-s_abc.sb.example"));
        assert_eq!(host_target(&h, "sb.example"), None);
        h.insert(header::HOST, HeaderValue::from_static("sb.example"));
        assert_eq!(host_target(&h, "sb.example"), None);

        let mut h = HeaderMap::new();
        h.insert(header::AUTHORIZATION, HeaderValue::from_static("Bearer fbk_secret"));
        h.insert(header::CONNECTION, HeaderValue::from_static("keep-alive, x-hop"));
        h.insert("x-hop", HeaderValue::from_static("1"));
        h.insert("x-kept", HeaderValue::from_static("2"));
        h.insert(header::COOKIE, HeaderValue::from_static("a=1; fbx_token=secret; b=2"));
        let e = end_to_end(&h);
        assert!(
            e.get(header::AUTHORIZATION).is_none() && e.get("x-hop").is_none() && e.get(header::CONNECTION).is_none()
        );
        assert_eq!(e.get("x-kept").unwrap(), "2");
        assert_eq!(cookies_without_token(&h).unwrap(), "a=1; b=2");
        assert_eq!(query_without_token(Some("a=1&fbx_token=x&b=2")).as_deref(), Some("a=1&b=2"));
        assert_eq!(query_without_token(Some("fbx_token=x")), None);
    }
}
