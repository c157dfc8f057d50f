//! Cluster: ForeverVM's REPL WebSocket (`/v1/machine/{name}/repl`) of a
//! machine another node has resident. A WebSocket cannot be forwarded as one
//! request: this node opens a WebSocket to the owner first (same path, the
//! client's headers, [`FORWARDED_BY`]: one hop), so that a refusal there
//! (an unknown key, a session of another tenant) reaches the client as the
//! owner's HTTP answer; only then does it accept the client's upgrade and
//! relay messages both ways until either side closes. The owner runs every
//! instruction (one numbering, one result store per machine); an owner that
//! does not answer is waited out as for an HTTP forward ([`OwnerWait`]: its
//! lease runs out, then this node takes the session and serves the REPL itself). If the
//! owner goes away mid-conversation the client's socket is closed (going
//! away, 1001); a reconnect is routed again.

use std::time::Duration;

use axum::extract::ws::{CloseFrame as AxumClose, Message as AxumMessage, WebSocket};
use axum::http::{HeaderMap, Uri};
use axum::response::{IntoResponse, Response};
use forkbox_runtime::SessionRoute;
use futures_util::{SinkExt, StreamExt};
use tokio_tungstenite::tungstenite::client::IntoClientRequest;
use tokio_tungstenite::tungstenite::protocol::frame::coding::CloseCode;
use tokio_tungstenite::tungstenite::protocol::CloseFrame;
use tokio_tungstenite::tungstenite::{Error as WsError, Message};

use super::{passed_on, OwnerWait, Unreachable, FORWARDED_BY};
use crate::error::ApiError;
use crate::AppState;

/// The owner's side of a relayed REPL.
pub(crate) type OwnerSocket =
    tokio_tungstenite::WebSocketStream<tokio_tungstenite::MaybeTlsStream<tokio::net::TcpStream>>;

/// How long connecting to the owner may take before it counts as unreachable.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(2);

/// Where the REPL of machine `id` is served: None here (no cluster, a
/// forwarded request, or the session is this node's or nobody's), or a
/// socket already open to its owner. `Err`: the answer to give the client
/// instead of upgrading (the owner's refusal, `session_moved`, a store error).
pub(crate) async fn owner_socket(
    state: &AppState,
    id: &str,
    uri: &Uri,
    headers: &HeaderMap,
) -> Result<Option<OwnerSocket>, Response> {
    let Some(me) = state.runtime.node_id().map(str::to_owned) else { return Ok(None) };
    if headers.contains_key(FORWARDED_BY) {
        return Ok(None);
    }
    let owner = OwnerWait::new(state, id);
    loop {
        let SessionRoute::Node { node, url } = owner.route().await.map_err(IntoResponse::into_response)? else {
            return Ok(None);
        };
        match connect(&me, &url, uri, headers).await {
            Ok(socket) => {
                crate::metrics::forwarded();
                return Ok(Some(socket));
            }
            Err(Connect::Refused(resp)) => return Err(resp),
            Err(Connect::Unreachable(why)) => {
                owner.unreachable(&node, why).await.map_err(IntoResponse::into_response)?
            }
        }
    }
}

enum Connect {
    /// The owner answered the upgrade with this (an HTTP error): passed on as it is.
    Refused(Response),
    Unreachable(Unreachable),
}

/// Open the REPL WebSocket at the node `base` (`http://host:port`).
async fn connect(me: &str, base: &str, uri: &Uri, headers: &HeaderMap) -> Result<OwnerSocket, Connect> {
    let unreachable = |why: String| Connect::Unreachable(Unreachable(why));
    let path = uri.path_and_query().map_or(uri.path(), |p| p.as_str());
    let base = base.trim_end_matches('/');
    let ws_base = match base.split_once("://") {
        Some(("https", rest)) => format!("wss://{rest}"),
        Some((_, rest)) => format!("ws://{rest}"),
        None => format!("ws://{base}"),
    };
    let mut req = format!("{ws_base}{path}").into_client_request().map_err(|e| unreachable(e.to_string()))?;
    for (k, v) in headers {
        // The handshake's own headers are the client library's to set.
        if passed_on(k) && !k.as_str().starts_with("sec-websocket-") {
            req.headers_mut().insert(k.clone(), v.clone());
        }
    }
    if let Ok(v) = me.parse() {
        req.headers_mut().insert(FORWARDED_BY, v);
    }
    // What the relay buffers of the owner's messages (output chunks and
    // results, each bounded by the exec's output limit) is bounded by
    // tungstenite's defaults: 64 MiB a message, 16 MiB a frame.
    let connecting = tokio_tungstenite::connect_async_with_config(req, None, true);
    match tokio::time::timeout(CONNECT_TIMEOUT, connecting).await {
        Err(_) => Err(unreachable(format!("no answer within {CONNECT_TIMEOUT:?}"))),
        Ok(Ok((socket, _))) => Ok(socket),
        Ok(Err(WsError::Http(resp))) => {
            let status =
                axum::http::StatusCode::from_u16(resp.status().as_u16()).unwrap_or(axum::http::StatusCode::BAD_GATEWAY);
            let mut out = Response::builder().status(status);
            for (k, v) in resp.headers() {
                if passed_on(k) {
                    out = out.header(k, v);
                }
            }
            let body = resp.into_body().unwrap_or_default();
            Err(Connect::Refused(
                out.body(axum::body::Body::from(body)).unwrap_or_else(|e| {
                    ApiError::internal(format!("passing on the owner's answer: {e}")).into_response()
                }),
            ))
        }
        Ok(Err(e)) => Err(unreachable(e.to_string())),
    }
}

/// Relay messages between the client's socket and the owner's until either closes.
pub(crate) async fn relay(client: WebSocket, owner: OwnerSocket) {
    let (mut to_client, mut from_client) = client.split();
    let (mut to_owner, mut from_owner) = owner.split();
    let upstream = async {
        while let Some(Ok(m)) = from_client.next().await {
            let m = match m {
                AxumMessage::Text(t) => Message::text(t.as_str()),
                AxumMessage::Binary(b) => Message::binary(b),
                AxumMessage::Close(_) => break,
                // Pings are answered by each side's own library.
                AxumMessage::Ping(_) | AxumMessage::Pong(_) => continue,
            };
            if to_owner.send(m).await.is_err() {
                break;
            }
        }
        let _ = to_owner.close().await;
    };
    let downstream = async {
        let mut code = axum::extract::ws::close_code::AWAY;
        while let Some(m) = from_owner.next().await {
            let m = match m {
                Ok(Message::Text(t)) => AxumMessage::Text(t.as_str().into()),
                Ok(Message::Binary(b)) => AxumMessage::Binary(b),
                Ok(Message::Close(f)) => {
                    code = f.map_or(axum::extract::ws::close_code::NORMAL, |f: CloseFrame| {
                        if f.code == CloseCode::Normal {
                            axum::extract::ws::close_code::NORMAL
                        } else {
                            axum::extract::ws::close_code::AWAY
                        }
                    });
                    break;
                }
                Ok(_) => continue,
                Err(_) => break,
            };
            if to_client.send(m).await.is_err() {
                return;
            }
        }
        let reason =
            if code == axum::extract::ws::close_code::NORMAL { "" } else { "the node that has the machine went away" };
        let _ = to_client.send(AxumMessage::Close(Some(AxumClose { code, reason: reason.into() }))).await;
    };
    // Either side ending ends the relay (dropping the other closes its socket).
    tokio::select! {
        _ = upstream => {}
        _ = downstream => {}
    }
}
