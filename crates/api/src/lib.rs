//! forkbox's wire vocabulary: [`ErrorCode`], the one table of the API's
//! machine-readable error codes, each with its HTTP status and a description.
//!
//! Place in the flow request -> runtime -> sessions -> engine -> vmm/linux -> guest:
//! none; it is a leaf (no forkbox dependency) that every layer may use. The
//! engine and the sessions name their failures with it, the runtime passes
//! them on, the server answers with `status()` and exports the table in its
//! OpenAPI document (schema `ErrorCode`, extension `x-codes`), the client and
//! the CLI read it back, and the Python SDK's table is checked against that
//! document in `tests/python/test_sdk_errors.py`.
//!
//! Also [`handoff::ServerFile`]: how a CLI finds the server running on its data directory;
//! [`capabilities`] (what a caller may do) and [`keys`] (the admin key routes' limits).

#![forbid(unsafe_code)]

pub mod capabilities;
pub mod handoff;
pub mod keys;
pub mod wire;

use std::fmt;
use std::str::FromStr;

macro_rules! codes {
    ($($(#[$doc:meta])* $variant:ident = ($name:literal, $status:literal, $desc:literal),)*) => {
        /// A machine-readable API error code: `{"error": {"code": "<this>", "message"}}`.
        /// Serialized as its snake_case name.
        #[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
        #[non_exhaustive]
        pub enum ErrorCode {
            $($(#[$doc])* #[doc = $desc] $variant,)*
        }

        impl ErrorCode {
            /// Every code, in the table's order.
            pub const ALL: &'static [ErrorCode] = &[$(ErrorCode::$variant,)*];

            /// The code as it appears on the wire.
            pub const fn as_str(self) -> &'static str {
                match self { $(ErrorCode::$variant => $name,)* }
            }

            /// The HTTP status the API answers with.
            pub const fn status(self) -> u16 {
                match self { $(ErrorCode::$variant => $status,)* }
            }

            /// What the code means, for people (and the OpenAPI document).
            pub const fn description(self) -> &'static str {
                match self { $(ErrorCode::$variant => $desc,)* }
            }
        }

        impl FromStr for ErrorCode {
            type Err = UnknownCode;
            fn from_str(s: &str) -> Result<ErrorCode, UnknownCode> {
                match s {
                    $($name => Ok(ErrorCode::$variant),)*
                    _ => Err(UnknownCode(s.to_string())),
                }
            }
        }
    };
}

codes! {
    MalformedJson = ("malformed_json", 400, "The request body is not JSON."),
    InvalidRequest = ("invalid_request", 400, "JSON of the wrong shape, or bad values (also a bad path or query parameter)."),
    InvalidPath = ("invalid_path", 400, "A file path the guest does not accept (relative, `..` above the root, too long)."),
    IsADirectory = ("is_a_directory", 400, "A file route names a directory."),
    Unauthorized = ("unauthorized", 401, "No API key, or an unknown one."),
    Forbidden = ("forbidden", 403, "The key may not do this (e.g. `/metrics` with a key that is not an admin key)."),
    QuotaExceeded = ("quota_exceeded", 403, "The key's session or disk quota (or the session's disk limit) is used up; a session exec whose checkpoint would pass the disk quota carries its `result` and the session stays at its previous checkpoint."),
    PackageNotAllowed = ("package_not_allowed", 403, "The server's package policy (an allow or deny list of names) does not let sessions install this package or one of its dependencies."),
    NotFound = ("not_found", 404, "No such endpoint."),
    SessionNotFound = ("session_not_found", 404, "No such session for this tenant."),
    CheckpointNotFound = ("checkpoint_not_found", 404, "The session has no checkpoint with that number."),
    InstructionNotFound = ("instruction_not_found", 404, "ForeverVM: the machine has no such instruction (or its result was dropped)."),
    FileNotFound = ("file_not_found", 404, "No such file in the session."),
    ProcessNotFound = ("process_not_found", 404, "The session has no background process with that pid (a checkpoint does not record background processes: after a revert, fork or eviction the session has none)."),
    TemplateNotFound = ("template_not_found", 404, "No template of that name (see GET /v1/templates), or the session's template is no longer in the data directory."),
    PackageNotFound = ("package_not_found", 404, "No such package (or version) in the server's package index or wheelhouse."),
    KeyNotFound = ("key_not_found", 404, "No API key with that id (admin key routes)."),
    MethodNotAllowed = ("method_not_allowed", 405, "The endpoint does not take this method."),
    Timeout = ("timeout", 408, "The code ran past its time limit (the sandbox is dropped; a session is rolled back)."),
    SessionBusy = ("session_busy", 409, "Another exec is running in that session (or its instruction queue is full)."),
    TemplateNotReady = ("template_not_ready", 409, "The template is being built (first use); retry when GET /v1/templates says it is ready."),
    TemplateExists = ("template_exists", 409, "A template of that name exists already for this tenant, is shipped with forkbox, or is shared by the server."),
    FileExists = ("file_exists", 409, "A file or directory of that name exists already in the session."),
    StdinClosed = ("stdin_closed", 409, "The background process has no stdin to write to: it was started without `stdin: true`, its stdin was closed, or it ended."),
    StdinFull = ("stdin_full", 409, "The background process did not read its stdin: the 256 KiB of unread input it holds had no room for the write within 5 s (nothing was written; retry later)."),
    PackageConflict = ("package_conflict", 409, "A file of the package is already in the session's file system (another version of it, or a file of the session's): nothing was installed."),
    PayloadTooLarge = ("payload_too_large", 413, "The request body is over the size limit."),
    CodeTooLarge = ("code_too_large", 413, "The code is over the code size limit."),
    FileTooLarge = ("file_too_large", 413, "A file upload or download is over the file size limit."),
    GuestCrashed = ("guest_crashed", 422, "The code crashed the guest (a fault); the request was well-formed."),
    GuestExited = ("guest_exited", 422, "The code made the guest exit (e.g. `os._exit(3)`)."),
    GuestKilled = ("guest_killed", 422, "The guest was killed by a signal."),
    SandboxUnusable = ("sandbox_unusable", 422, "The sandbox is no longer usable after an earlier failure."),
    Interrupted = ("interrupted", 422, "An interrupted exec did not stop within the grace period and was killed."),
    InspectFailed = ("inspect_failed", 422, "A checkpoint could not be inspected: reading its namespace raised, ran past its time limit or sent an unreadable report (nothing changed)."),
    Deadlock = ("deadlock", 422, "Every guest thread waited (a futex, a blocking read, poll ...) with no timeout for something nothing could ever do."),
    PackageNeedsBuild = ("package_needs_build", 422, "The package (named in the message) has no binary wheel for the guest (CPython 3.11, manylinux x86-64), only an sdist: packages are never built from source."),
    UpgradeRequired = ("upgrade_required", 426, "The route is a WebSocket and the request is not an upgrade."),
    RateLimited = ("rate_limited", 429, "The key is over its requests per second (a batch counts each exec) or its concurrent execs, file uploads or package installs (see Retry-After)."),
    CpuBudgetExceeded = ("cpu_budget_exceeded", 429, "The key has used its CPU seconds for now (see Retry-After)."),
    TooManyBuilds = ("too_many_builds", 429, "Too many template builds are pending (for this tenant or on the server); retry when one is done (see Retry-After)."),
    Internal = ("internal", 500, "A failure inside the server."),
    StorageError = ("storage_error", 500, "The session store or checkpoint files failed."),
    ProtocolError = ("protocol_error", 500, "The guest agent broke the host-guest protocol."),
    BootFailed = ("boot_failed", 500, "The guest failed to start."),
    CpuMismatch = ("cpu_mismatch", 500, "A template or checkpoint was made on a CPU whose features this host lacks (the data directory moved): the server refuses it rather than fault."),
    TemplateUnavailable = ("template_unavailable", 500, "The template's image or snapshot could not be built or opened on this server."),
    SandboxCrashed = ("sandbox_crashed", 502, "The sandbox worker process running the exec died (a crash, its seccomp filter, out of memory) or stopped answering: only what it held failed, a new worker is started; retry."),
    PortNotListening = ("port_not_listening", 502, "Nothing in the session's sandbox listens on that port (on 127.0.0.1, ::1 or a wildcard address), or the sandbox closed the proxied connection before it answered."),
    PackageFailed = ("package_failed", 502, "The server's pip could not download or unpack the package (index unreachable, a refused wheel ...); details are in the server's log."),
    Overloaded = ("overloaded", 503, "Every exec slot is busy and the bounded wait queue is full (see Retry-After)."),
    StorageUnavailable = ("storage_unavailable", 503, "The object store that holds the checkpoints, or the PostgreSQL database that holds the session metadata, could not be reached (or refused a read or write): a session exec's checkpoint was not committed and the session stays at its previous checkpoint; a resume needing a file only the object store has failed. Retry when it is back (see Retry-After)."),
    SessionMoved = ("session_moved", 503, "Cluster: the session is moving between nodes (its node stopped, is draining, or lost the session's lease while the exec ran: then nothing was committed and the session stays at its last checkpoint); retry (see Retry-After)."),
    InsufficientStorage = ("insufficient_storage", 507, "The disk is full (or down to the reserve kept for deletes and metadata): nothing was written, the session stays at its previous checkpoint."),
}

impl ErrorCode {
    /// Whether the code is a failure of the server itself (a 5xx), not of the request or the code it ran.
    pub const fn is_server_error(self) -> bool {
        self.status() >= 500
    }
}

/// A code string that is not in the table (e.g. from a newer server).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct UnknownCode(pub String);

impl fmt::Display for UnknownCode {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "unknown error code {:?}", self.0)
    }
}

impl std::error::Error for UnknownCode {}

impl fmt::Display for ErrorCode {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

impl PartialEq<str> for ErrorCode {
    fn eq(&self, other: &str) -> bool {
        self.as_str() == other
    }
}

impl PartialEq<&str> for ErrorCode {
    fn eq(&self, other: &&str) -> bool {
        self.as_str() == *other
    }
}

impl serde::Serialize for ErrorCode {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(self.as_str())
    }
}

impl<'de> serde::Deserialize<'de> for ErrorCode {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<ErrorCode, D::Error> {
        let s = <std::borrow::Cow<'de, str>>::deserialize(d)?;
        s.parse().map_err(serde::de::Error::custom)
    }
}

#[cfg(feature = "openapi")]
mod openapi {
    use super::ErrorCode;
    use utoipa::openapi::extensions::ExtensionsBuilder;
    use utoipa::openapi::schema::{ObjectBuilder, Schema, SchemaType, Type};
    use utoipa::openapi::RefOr;

    impl utoipa::PartialSchema for ErrorCode {
        /// A string enum of every code; `x-codes` maps each to its `{status, description}`.
        fn schema() -> RefOr<Schema> {
            let table: serde_json::Map<String, serde_json::Value> = ErrorCode::ALL
                .iter()
                .map(|c| {
                    (
                        c.as_str().to_string(),
                        serde_json::json!({ "status": c.status(), "description": c.description() }),
                    )
                })
                .collect();
            ObjectBuilder::new()
                .schema_type(SchemaType::Type(Type::String))
                .description(Some(
                    "Machine-readable error code. `x-codes` gives the HTTP status each is sent with and what it means.",
                ))
                .enum_values(Some(ErrorCode::ALL.iter().map(|c| c.as_str())))
                .extensions(Some(ExtensionsBuilder::new().add("x-codes", serde_json::Value::Object(table)).build()))
                .into()
        }
    }

    impl utoipa::ToSchema for ErrorCode {
        fn name() -> std::borrow::Cow<'static, str> {
            "ErrorCode".into()
        }
    }
}

#[cfg(test)]
mod tests {
    use super::ErrorCode;

    #[test]
    fn every_code_round_trips_through_its_name_and_json() {
        for &c in ErrorCode::ALL {
            assert_eq!(c.as_str().parse::<ErrorCode>(), Ok(c));
            let json = serde_json::to_string(&c).unwrap();
            assert_eq!(json, format!("\"{}\"", c.as_str()));
            assert_eq!(serde_json::from_str::<ErrorCode>(&json).unwrap(), c);
            assert!(c.as_str().bytes().all(|b| b.is_ascii_lowercase() || b == b'_'), "{c} is not snake_case");
            assert!((400..600).contains(&c.status()), "{c}");
        }
        assert!("nope".parse::<ErrorCode>().is_err());
        assert!(serde_json::from_str::<ErrorCode>("\"nope\"").is_err());
    }

    #[test]
    fn names_are_unique_and_only_internal_failures_are_5xx() {
        let mut names: Vec<&str> = ErrorCode::ALL.iter().map(|c| c.as_str()).collect();
        names.sort_unstable();
        names.dedup();
        assert_eq!(names.len(), ErrorCode::ALL.len());
        let five: Vec<&str> = ErrorCode::ALL.iter().filter(|c| c.is_server_error()).map(|c| c.as_str()).collect();
        assert_eq!(
            five,
            [
                "internal",
                "storage_error",
                "protocol_error",
                "boot_failed",
                "cpu_mismatch",
                "template_unavailable",
                "sandbox_crashed",
                "port_not_listening",
                "package_failed",
                "overloaded",
                "storage_unavailable",
                "session_moved",
                "insufficient_storage"
            ]
        );
        assert_eq!(ErrorCode::SessionNotFound, "session_not_found");
    }
}
