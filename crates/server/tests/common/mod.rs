//! The real server (`Server::bind`, as `forkbox serve` runs it) on a loopback
//! port, for the tests that start and stop whole nodes (PostgreSQL, clusters).
#![allow(dead_code)] // each test binary uses its own part

use std::time::Duration;

use forkbox_server::{Server, ServerConfig};
use reqwest::StatusCode;
use serde_json::Value;

/// A running server, stopped by [`Node::stop_within`].
pub struct Node {
    pub url: String,
    pub key: String,
    stop: tokio::sync::oneshot::Sender<()>,
    run: tokio::task::JoinHandle<anyhow::Result<()>>,
    http: reqwest::Client,
}

impl Node {
    /// `key`: one the node knows already (from its database), else the one the server made.
    pub async fn start(cfg: ServerConfig, key: Option<String>) -> Node {
        let server = Server::bind(cfg).await.expect("bind");
        let key = key.or(server.created_key.clone()).expect("a key");
        let addr = server.local_addr().expect("the bound address");
        let (stop, rx) = tokio::sync::oneshot::channel::<()>();
        let run = tokio::spawn(server.run(async move {
            let _ = rx.await;
        }));
        Node { url: format!("http://{addr}"), key, stop, run, http: reqwest::Client::new() }
    }

    /// A graceful stop, which must end within `limit`.
    pub async fn stop_within(self, limit: Duration) {
        self.stop.send(()).expect("the server is running");
        tokio::time::timeout(limit, self.run).await.expect("shutdown in time").expect("join").expect("run");
    }

    /// A request with the node's key: (status, JSON body; a non-JSON body as a string, none as null).
    pub async fn call(&self, method: reqwest::Method, path: &str, body: Option<Value>) -> (StatusCode, Value) {
        let mut req = self.http.request(method, format!("{}{path}", self.url)).bearer_auth(&self.key);
        if let Some(b) = body {
            req = req.json(&b);
        }
        let resp = req.send().await.expect("request");
        let status = resp.status();
        let text = resp.text().await.expect("the body");
        (status, if text.is_empty() { Value::Null } else { serde_json::from_str(&text).unwrap_or(Value::String(text)) })
    }
}
