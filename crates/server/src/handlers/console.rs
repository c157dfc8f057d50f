//! The web console: plain HTML, CSS and JavaScript built into the binary
//! (`crates/server/console/`), served without auth at `/` (to browsers: see
//! [`wants_html`]) and `/console/{file}`. It signs in with an API key kept in the
//! browser's session storage and calls only the public `/v1` API with it. Every
//! page and asset goes out with a strict Content-Security-Policy: scripts, styles
//! and fetches from this origin only (images also as `data:` URLs), no frames of
//! other origins, no plugins, no forms, no embedding; so nothing is requested from
//! anywhere else, and HTML from a guest (shown in a sandboxed `srcdoc` frame, which
//! inherits this policy) can run no script and load nothing.

use axum::extract::Path;
use axum::http::{header, HeaderMap, HeaderValue};
use axum::response::{IntoResponse, Response};
use forkbox_api::ErrorCode;

use crate::error::ApiError;

const INDEX_HTML: &str = include_str!("../../console/index.html");
const CONSOLE_JS: &str = include_str!("../../console/console.js");
const CONSOLE_CSS: &str = include_str!("../../console/console.css");
const ICON_SVG: &str = include_str!("../../console/icon.svg");

/// The policy of every console response.
pub const CSP: &str = "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self' data:; \
connect-src 'self'; frame-src 'self'; child-src 'self'; font-src 'none'; object-src 'none'; base-uri 'none'; \
form-action 'none'; frame-ancestors 'none'";

/// Whether an `Accept` header prefers an HTML page to JSON: `text/html` (or XHTML)
/// listed with a higher quality than what `application/json` gets (itself, `application/*`
/// or `*/*`). A browser's navigation does; `*/*`, no header and `application/json` do not.
pub(crate) fn wants_html(headers: &HeaderMap) -> bool {
    let Some(accept) = headers.get(header::ACCEPT).and_then(|v| v.to_str().ok()) else { return false };
    // (quality, specificity) of the best match for each side.
    type Best = Option<(f32, u8)>;
    let (mut html, mut json): (Best, Best) = (None, None);
    for part in accept.split(',').take(32) {
        let mut it = part.split(';');
        let media = it.next().unwrap_or("").trim().to_ascii_lowercase();
        let mut q = 1.0f32;
        for p in it {
            if let Some(v) = p.trim().strip_prefix("q=") {
                q = v.trim().parse::<f32>().ok().filter(|q| q.is_finite()).map_or(0.0, |q| q.clamp(0.0, 1.0));
            }
        }
        let better = |cur: Option<(f32, u8)>, spec: u8| cur.is_none_or(|(_, s)| spec > s);
        match media.as_str() {
            "text/html" | "application/xhtml+xml" if better(html, 2) => html = Some((q, 2)),
            "application/json" if better(json, 2) => json = Some((q, 2)),
            "application/*" if better(json, 1) => json = Some((q, 1)),
            "*/*" if better(json, 0) => json = Some((q, 0)),
            _ => {}
        }
    }
    match (html, json) {
        (Some((h, _)), Some((j, _))) => h > j,
        (Some((h, _)), None) => h > 0.0,
        _ => false,
    }
}

/// A console asset with its type and the console's security headers.
fn asset(content_type: &'static str, body: &'static str) -> Response {
    let mut r = body.into_response();
    let h = r.headers_mut();
    h.insert(header::CONTENT_TYPE, HeaderValue::from_static(content_type));
    h.insert(header::CONTENT_SECURITY_POLICY, HeaderValue::from_static(CSP));
    h.insert(header::X_CONTENT_TYPE_OPTIONS, HeaderValue::from_static("nosniff"));
    h.insert(header::X_FRAME_OPTIONS, HeaderValue::from_static("DENY"));
    h.insert(header::REFERRER_POLICY, HeaderValue::from_static("no-referrer"));
    h.insert(header::CACHE_CONTROL, HeaderValue::from_static("no-cache"));
    h.insert("cross-origin-opener-policy", HeaderValue::from_static("same-origin"));
    h.insert("cross-origin-resource-policy", HeaderValue::from_static("same-origin"));
    r
}

/// The console's page (what `GET /` answers a browser).
pub(crate) fn index() -> Response {
    let mut r = asset("text/html; charset=utf-8", INDEX_HTML);
    r.headers_mut().insert(header::VARY, HeaderValue::from_static("Accept"));
    r
}

/// `GET /console/{file}`: the console's script, style sheet and icon.
pub(crate) async fn file(Path(name): Path<String>) -> Result<Response, ApiError> {
    match name.as_str() {
        "console.js" => Ok(asset("text/javascript; charset=utf-8", CONSOLE_JS)),
        "console.css" => Ok(asset("text/css; charset=utf-8", CONSOLE_CSS)),
        "icon.svg" => Ok(asset("image/svg+xml", ICON_SVG)),
        "" | "index.html" => Ok(index()),
        _ => Err(ApiError::new(ErrorCode::NotFound, "no such console file")),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn accept(v: &str) -> HeaderMap {
        let mut h = HeaderMap::new();
        h.insert(header::ACCEPT, HeaderValue::from_str(v).unwrap());
        h
    }

    #[test]
    fn browsers_get_the_page_and_api_clients_json() {
        let chrome = "text/html,application/xhtml+xml,application/xml;q=0.9,image/avif,image/webp,*/*;q=0.8";
        let firefox = "text/html,application/xhtml+xml,application/xml;q=0.9,*/*;q=0.8";
        assert!(wants_html(&accept(chrome)) && wants_html(&accept(firefox)));
        assert!(wants_html(&accept("text/html")));
        assert!(!wants_html(&HeaderMap::new()));
        for v in [
            "*/*",
            "application/json",
            "application/json, text/html;q=0.5",
            "text/html;q=0.5, */*",
            "text/html;q=0",
            "text/html, application/json",
            "text/html;q=x, */*",
        ] {
            assert!(!wants_html(&accept(v)), "{v}");
        }
    }
}
