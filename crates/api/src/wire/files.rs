//! A session's files (`/v1/sessions/{id}/files`).

use serde::{Deserialize, Serialize};

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct FileWritten {
    /// The guest path written.
    pub path: String,
    pub size: u64,
    /// Seq of the checkpoint that recorded the upload.
    pub checkpoint: i64,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct FileEntryBody {
    pub name: String,
    /// Absolute guest path.
    pub path: String,
    pub size: u64,
    pub is_dir: bool,
    pub mtime_ms: i64,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct FileList {
    pub files: Vec<FileEntryBody>,
}
