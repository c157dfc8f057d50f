//! Request bodies that can be large (file uploads): streamed to an unnamed
//! temporary file beside the sessions' checkpoints as they arrive, the size
//! cap checked on every chunk (and on `Content-Length` before anything is
//! read), so this process holds at most one [`SPOOL_BUF`] of an upload at a
//! time; the sandbox then reads the file a chunk at a time into its own file
//! system. And the per-key caps on the requests that move many bytes at once
//! (uploads, package installs): 429 `rate_limited` past them.

use std::fs::File;
use std::io::Write;
use std::path::PathBuf;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use axum::body::Body;
use axum::http::{header, HeaderMap};
use forkbox_api::ErrorCode;
use futures_util::StreamExt;

use crate::auth::Caller;
use crate::error::ApiError;
use crate::keys::KeyInfo;

/// What of an upload this process holds before writing it to the temporary file.
pub const SPOOL_BUF: usize = 1 << 20;

/// 413 `file_too_large` for an upload over `limit` bytes.
pub fn too_large(limit: u64) -> ApiError {
    ApiError::new(ErrorCode::FileTooLarge, format!("the upload is over the file size limit of {limit} bytes"))
}

/// What of a refused upload is still read (and thrown away) after the 413
/// went out, and for how long at most. A client that sends its whole body
/// before it reads the answer (most do: no `Expect: 100-continue`) would
/// otherwise see a broken pipe instead of the error; past these bounds the
/// connection is closed on it.
const DRAIN_BYTES: u64 = 64 << 20;
const DRAIN_TIME: std::time::Duration = std::time::Duration::from_secs(10);

/// Refusing a request: its body is read and thrown away beside the answer (which goes out
/// at once), within [`DRAIN_BYTES`] and [`DRAIN_TIME`], so that the connection closes only
/// after the client had the chance to read the error — a web server's lingering close.
pub fn refuse_body(body: Body) {
    tokio::spawn(drain(body.into_data_stream()));
}

/// Read and discard what is left of a refused body, within [`DRAIN_BYTES`] and [`DRAIN_TIME`].
async fn drain(mut stream: axum::body::BodyDataStream) {
    let read = async {
        let mut seen = 0u64;
        while let Some(Ok(chunk)) = stream.next().await {
            seen = seen.saturating_add(chunk.len() as u64);
            if seen > DRAIN_BYTES {
                break;
            }
        }
    };
    let _ = tokio::time::timeout(DRAIN_TIME, read).await;
}

/// Refuse a body whose `Content-Length` is over `limit` before reading any of it.
pub fn check_length(headers: &HeaderMap, limit: u64) -> Result<(), ApiError> {
    let declared =
        headers.get(header::CONTENT_LENGTH).and_then(|v| v.to_str().ok()).and_then(|v| v.parse::<u64>().ok());
    match declared {
        Some(n) if n > limit => Err(too_large(limit)),
        _ => Ok(()),
    }
}

fn storage(what: &str, e: impl std::fmt::Display) -> ApiError {
    ApiError::new(ErrorCode::StorageError, format!("{what}: {e}"))
}

/// Write `buf` at the end of `file` on a blocking thread; both come back.
async fn flush(mut file: File, buf: Vec<u8>) -> Result<(File, Vec<u8>), ApiError> {
    tokio::task::spawn_blocking(move || {
        file.write_all(&buf).map(|()| {
            let mut buf = buf;
            buf.clear();
            (file, buf)
        })
    })
    .await?
    .map_err(|e| storage("writing the upload", e))
}

/// Stream `body` into a new unnamed file under `dir` (gone when the last
/// descriptor closes, also after a crash), refusing it (413) once it passes
/// `limit` bytes. Returns the file, opened again read-only (what a sandbox
/// worker is handed), and its length.
pub async fn spool(dir: PathBuf, body: Body, limit: u64) -> Result<(File, u64), ApiError> {
    let mut stream = body.into_data_stream();
    match spool_stream(dir, &mut stream, limit).await {
        Err(e) if e.code == ErrorCode::FileTooLarge => {
            tokio::spawn(drain(stream));
            Err(e)
        }
        r => r,
    }
}

/// [`spool`] of any stream of chunks (a multipart body's part, say); past `limit`
/// it stops reading and answers 413 (what is left is the caller's to drain).
pub async fn spool_stream<S, E>(dir: PathBuf, stream: &mut S, limit: u64) -> Result<(File, u64), ApiError>
where
    S: futures_util::Stream<Item = Result<axum::body::Bytes, E>> + Unpin,
    E: std::fmt::Display,
{
    let mut file = tokio::task::spawn_blocking(move || {
        std::fs::create_dir_all(&dir)?;
        tempfile::tempfile_in(&dir)
    })
    .await?
    .map_err(|e| storage("creating the upload's temporary file", e))?;
    let mut buf: Vec<u8> = Vec::with_capacity(SPOOL_BUF);
    let mut total = 0u64;
    while let Some(chunk) = stream.next().await {
        let chunk = chunk.map_err(|e| ApiError::invalid(format!("reading the request body: {e}")))?;
        total = total.saturating_add(chunk.len() as u64);
        if total > limit {
            return Err(too_large(limit));
        }
        if !buf.is_empty() && buf.len().saturating_add(chunk.len()) > SPOOL_BUF {
            (file, buf) = flush(file, buf).await?;
        }
        buf.extend_from_slice(&chunk);
    }
    if !buf.is_empty() {
        (file, _) = flush(file, buf).await?;
    }
    let file = tokio::task::spawn_blocking(move || {
        use std::os::fd::AsRawFd;
        // A read-only description of its own (offset 0), so whoever reads it cannot write it.
        File::open(format!("/proc/self/fd/{}", file.as_raw_fd())).unwrap_or(file)
    })
    .await?;
    Ok((file, total))
}

/// An upload received into its temporary file (and its place under the
/// key's cap, held until this is dropped). A cluster's forwarding layer puts
/// it into the request's extensions: the handler then uses it as it is.
#[derive(Clone)]
pub struct Spooled {
    pub file: Arc<File>,
    pub len: u64,
    _held: Option<Arc<Held>>,
}

/// Receive an upload: `Content-Length` checked, the caller's upload cap
/// taken, the body streamed to a temporary file (see [`spool`]).
pub async fn receive(
    state: &crate::AppState,
    headers: &HeaderMap,
    caller: Option<&Caller>,
    body: Body,
) -> Result<Spooled, ApiError> {
    let limit = state.config.files_limit as u64;
    if let Err(e) = check_length(headers, limit) {
        refuse_body(body);
        return Err(e);
    }
    let held = match caller {
        Some(c) => hold(c, Transfer::Upload, state.config.key_uploads)?,
        None => None,
    };
    let (file, len) = spool(state.runtime.home().join("sessions"), body, limit).await?;
    Ok(Spooled { file: Arc::new(file), len, _held: held.map(Arc::new) })
}

/// The bytes of an upload's file again, [`SPOOL_BUF`] at a time (a forward's body).
pub fn stream(
    file: Arc<File>,
    len: u64,
) -> impl futures_util::Stream<Item = std::io::Result<axum::body::Bytes>> + Send + 'static {
    futures_util::stream::try_unfold(0u64, move |at| {
        let file = file.clone();
        async move {
            if at >= len {
                return Ok(None);
            }
            let n = usize::try_from(len - at).unwrap_or(SPOOL_BUF).min(SPOOL_BUF);
            let buf = tokio::task::spawn_blocking(move || {
                let mut buf = vec![0u8; n];
                std::os::unix::fs::FileExt::read_exact_at(&*file, &mut buf, at).map(|()| buf)
            })
            .await
            .map_err(std::io::Error::other)??;
            Ok(Some((axum::body::Bytes::from(buf), at + n as u64)))
        }
    })
}

/// Which per-key cap a [`Held`] counts against.
#[derive(Clone, Copy, Debug)]
pub enum Transfer {
    Upload,
    Install,
}

/// One request of a key counted against its cap until dropped.
pub struct Held {
    key: Arc<KeyInfo>,
    kind: Transfer,
}

fn counter(key: &KeyInfo, kind: Transfer) -> &AtomicUsize {
    match kind {
        Transfer::Upload => &key.uploads,
        Transfer::Install => &key.installs,
    }
}

impl Drop for Held {
    fn drop(&mut self) {
        counter(&self.key, self.kind).fetch_sub(1, Ordering::SeqCst);
    }
}

/// Count this request against the caller's key's cap of `kind` (at most
/// `max` at once; 0: no cap), or 429 `rate_limited`. Callers without a key
/// (an embedded router) are not counted.
pub fn hold(caller: &Caller, kind: Transfer, max: usize) -> Result<Option<Held>, ApiError> {
    let Some(key) = caller.key.clone() else { return Ok(None) };
    if max == 0 {
        return Ok(None);
    }
    let n = counter(&key, kind).fetch_add(1, Ordering::SeqCst);
    let held = Held { key, kind };
    if n >= max {
        let what = match kind {
            Transfer::Upload => "file uploads",
            Transfer::Install => "package installs",
        };
        let mut e = ApiError::new(
            ErrorCode::RateLimited,
            format!("this API key has {max} {what} in progress, the most it may have at once; retry when one is done"),
        );
        e.retry_after = Some(1);
        drop(held);
        return Err(e);
    }
    Ok(Some(held))
}
