//! The route handlers: HTTP in, a typed runtime operation, HTTP out. They
//! parse and shape; the runtime validates, runs and enforces quotas.

pub(crate) mod capabilities;
pub(crate) mod commands;
pub(crate) mod console;
pub(crate) mod exec;
pub(crate) mod files;
pub(crate) mod forevervm;
pub(crate) mod health;
pub(crate) mod keys;
pub(crate) mod processes;
pub(crate) mod sessions;
pub(crate) mod stream;
pub(crate) mod templates;
pub(crate) mod tree;

use forkbox_runtime::Runtime;

use crate::error::ApiError;
use crate::AppState;

/// Run a blocking runtime call (SQLite, files) on tokio's blocking pool.
pub(crate) async fn blocking<T: Send + 'static>(
    state: &AppState,
    f: impl FnOnce(&Runtime) -> Result<T, ApiError> + Send + 'static,
) -> Result<T, ApiError> {
    let rt = state.runtime.clone();
    tokio::task::spawn_blocking(move || f(&rt)).await?
}

/// How often a request waiting for a template asks again.
const TEMPLATE_POLL: std::time::Duration = std::time::Duration::from_millis(500);

/// Wait, up to the server's `template_wait`, for the template `name` (None: the default,
/// always open) that `tenant` asked for: a request on a template whose (first) build is
/// running waits for it instead of failing at once. Past the wait: 409 `template_not_ready`
/// with `Retry-After`. Any other error is left to the request itself.
pub(crate) async fn wait_for_template(state: &AppState, tenant: &str, name: Option<&str>) -> Result<(), ApiError> {
    let Some(name) = name else { return Ok(()) };
    let deadline = std::time::Instant::now() + state.config.template_wait;
    loop {
        let (rt, t, n) = (state.runtime.clone(), tenant.to_string(), name.to_string());
        let e = match tokio::task::spawn_blocking(move || rt.template(&t, Some(&n)).map(|_| ())).await? {
            Ok(()) => return Ok(()),
            Err(e) => ApiError::from(e),
        };
        if e.code != forkbox_api::ErrorCode::TemplateNotReady {
            return Ok(());
        }
        if std::time::Instant::now() >= deadline {
            return Err(e);
        }
        tokio::time::sleep(TEMPLATE_POLL).await;
    }
}
