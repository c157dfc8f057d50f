//! The route handlers: HTTP in, a typed runtime operation, HTTP out. They
//! parse and shape; the runtime validates, runs and enforces quotas.

pub(crate) mod commands;
pub(crate) mod console;
pub(crate) mod exec;
pub(crate) mod files;
pub(crate) mod forevervm;
pub(crate) mod health;
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
