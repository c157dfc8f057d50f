//! Final touches on the OpenAPI document that the routes produce (utoipa):
//! bearer auth by default, and the error responses every authenticated route
//! can give (auth, rate limit, quota, bad body, overload) on every operation,
//! so clients and schema checkers know each status a route may answer with.

use utoipa::openapi::path::Operation;
use utoipa::openapi::schema::Ref;
use utoipa::openapi::security::SecurityRequirement;
use utoipa::openapi::{Content, OpenApi, RefOr, Response, ResponseBuilder};

/// Errors any authenticated `/v1` route may return, whatever it does.
const COMMON: &[(&str, &str)] = &[
    ("400", "Malformed JSON (`malformed_json`) or invalid arguments (`invalid_request`)"),
    ("401", "Missing or unknown API key (`unauthorized`)"),
    ("403", "The key's session or disk quota is used up (`quota_exceeded`)"),
    ("404", "No such session, checkpoint or instruction of this tenant"),
    ("413", "Request body or code over the size limit"),
    ("429", "The key is over its requests/s (`rate_limited`, with Retry-After)"),
    ("503", "Every exec slot is busy and the wait queue is full (`overloaded`), or the object store holding the checkpoints or the PostgreSQL metadata database is unreachable (`storage_unavailable`), or (a cluster) the session is moving between nodes (`session_moved`); with Retry-After"),
];

fn error_response(description: &str) -> RefOr<Response> {
    ResponseBuilder::new()
        .description(description)
        .content("application/json", Content::new(Some(Ref::from_schema_name("ErrorBody"))))
        .into()
}

fn operations(item: &mut utoipa::openapi::PathItem) -> impl Iterator<Item = &mut Operation> {
    [&mut item.get, &mut item.put, &mut item.post, &mut item.delete, &mut item.patch]
        .into_iter()
        .filter_map(|o| o.as_mut())
}

pub fn finish(doc: &mut OpenApi) {
    // axum's wildcard `{*path}` is an ordinary `{path}` parameter in OpenAPI.
    let wild: Vec<String> = doc.paths.paths.keys().filter(|p| p.contains("{*")).cloned().collect();
    for p in wild {
        if let Some(item) = doc.paths.paths.remove(&p) {
            doc.paths.paths.insert(p.replace("{*", "{"), item);
        }
    }
    doc.security = Some(vec![SecurityRequirement::new("bearer", Vec::<String>::new())]);
    for item in doc.paths.paths.values_mut() {
        for op in operations(item) {
            // `security(())` on a route marks it as open (health, metrics, this document).
            let open = op.security.as_ref().is_some_and(|s| s.iter().all(|r| *r == SecurityRequirement::default()));
            if !open {
                for (status, description) in COMMON {
                    op.responses.responses.entry(status.to_string()).or_insert_with(|| error_response(description));
                }
            }
            op.responses.responses.entry("default".into()).or_insert_with(|| error_response("Any other error"));
        }
    }
}
