//! The session metadata store: sessions, their tags and limits, and the tree of
//! checkpoints, in one SQLite database (WAL, foreign keys on; the default) or
//! in PostgreSQL (`Store::open_postgres`, shared by several nodes). The SQL is
//! written once for both (see `crate::db`); only the migrations differ.
//!
//! # Schema
//!
//! - `sessions`: one row per live session. `sid` is an internal, never reused
//!   key (`AUTOINCREMENT`); `id` is the public, unique name. `head` references
//!   `checkpoints(id)` (NULL = resume from the template).
//! - `session_tags(sid, key, value)`: tags, cascade-deleted with the session;
//!   indexed by `(key, value)`. Tag filters are `EXISTS` sub-queries in SQL.
//! - `checkpoints`: the history tree. `owner` is the `sid` of the session that
//!   created the checkpoint and `session_id` its name (kept for display after
//!   the session is deleted). There is deliberately no foreign key from
//!   `checkpoints` to `sessions`: checkpoints outlive their session while
//!   another session (a fork) still needs them. Because ownership is by `sid`,
//!   a new session that reuses a deleted session's name does not inherit the
//!   old checkpoints.
//!
//! # Deleting checkpoints
//!
//! `checkpoints.parent` and `sessions.head` are plain (immediate, `NO ACTION`)
//! foreign keys: nothing cascades. Deleting a checkpoint that is still the
//! parent of a checkpoint that is not deleted with it, or the head of a live
//! session, is refused: [`Store::delete_checkpoints`] checks first and returns
//! [`StoreError::HasChildren`] / [`StoreError::InUse`] (the foreign keys are the
//! backstop). Checkpoint ids are never reused (`AUTOINCREMENT`) and a parent
//! always exists before its child, so `parent < id` always holds; deletes run
//! in descending id order, children before parents.
//!
//! # Migrations
//!
//! SQLite: [`MIGRATIONS`] is applied in order, driven by `PRAGMA user_version`,
//! each step in its own `BEGIN IMMEDIATE` transaction together with the version
//! bump, so concurrent openers and crashes mid-migration are safe. PostgreSQL:
//! [`PG_MIGRATIONS`], driven by the `forkbox_schema` table, all pending steps
//! in one transaction (which holds the writers' lock, see `crate::db`). Add new
//! steps at the end; never edit a released step. Steps that rebuild a table
//! (rather than `ALTER TABLE ... ADD COLUMN`) must follow SQLite's 12-step
//! procedure, since foreign keys are on.
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::{Mutex, MutexGuard};
use std::time::Duration;

use forkbox_catalog::shared::{Artifact, ArtifactKind};

use crate::db::{vals, Backend, Conn, DbError, Row, Value};

/// How long a statement waits for another connection's lock before failing.
pub const BUSY_TIMEOUT: Duration = Duration::from_secs(10);

/// How hard a commit waits for the disk (SQLite's `PRAGMA synchronous`; the
/// database is always in WAL mode).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Synchronous {
    /// `NORMAL`: a committed transaction survives the process being killed
    /// (SIGKILL) at any point; after an OS crash or power loss the database is
    /// still consistent but the last few commits may be rolled back. No fsync
    /// per commit (the WAL is fsynced at WAL checkpoints only).
    #[default]
    Normal,
    /// `FULL`: the WAL is fsynced at every commit, so a commit also survives
    /// power loss. Costs one fsync per write (about 0.3-1 ms here).
    Full,
}

/// Schema migrations of SQLite; `PRAGMA user_version` = number of steps applied.
pub const MIGRATIONS: &[&str] = &[
    // 1: initial schema.
    r#"
    CREATE TABLE checkpoints (
        id         INTEGER PRIMARY KEY AUTOINCREMENT,
        owner      INTEGER NOT NULL,
        session_id TEXT    NOT NULL,
        seq        INTEGER NOT NULL,
        parent     INTEGER REFERENCES checkpoints(id),
        code       TEXT    NOT NULL,
        created_ms INTEGER NOT NULL,
        layer      TEXT    NOT NULL,
        state      TEXT    NOT NULL,
        pages      INTEGER NOT NULL CHECK (pages >= 0),
        bytes      INTEGER NOT NULL CHECK (bytes >= 0),
        checksum   TEXT    NOT NULL,
        flat       TEXT,
        UNIQUE (owner, seq)
    );
    CREATE INDEX checkpoints_parent ON checkpoints(parent);
    CREATE INDEX checkpoints_session_id ON checkpoints(session_id);

    CREATE TABLE sessions (
        sid          INTEGER PRIMARY KEY AUTOINCREMENT,
        id           TEXT    NOT NULL UNIQUE,
        tenant       TEXT    NOT NULL,
        template_id  TEXT    NOT NULL,
        memory_bytes INTEGER NOT NULL,
        timeout_ms   INTEGER NOT NULL,
        output_bytes INTEGER NOT NULL,
        disk_bytes   INTEGER NOT NULL,
        head         INTEGER REFERENCES checkpoints(id),
        created_ms   INTEGER NOT NULL,
        last_used_ms INTEGER NOT NULL,
        last_seq     INTEGER NOT NULL DEFAULT 0
    );
    CREATE INDEX sessions_tenant_created ON sessions(tenant, created_ms);
    CREATE INDEX sessions_created ON sessions(created_ms);
    CREATE INDEX sessions_head ON sessions(head);

    CREATE TABLE session_tags (
        sid   INTEGER NOT NULL REFERENCES sessions(sid) ON DELETE CASCADE,
        key   TEXT    NOT NULL,
        value TEXT    NOT NULL,
        PRIMARY KEY (sid, key)
    ) WITHOUT ROWID;
    CREATE INDEX session_tags_key_value ON session_tags(key, value);
    "#,
    // 2: the session's network configuration (egress policy layers, host map,
    // limits) as JSON; NULL for sessions from before it (no network).
    r#"
    ALTER TABLE sessions ADD COLUMN network TEXT;
    "#,
    // 3: one tree per lineage. A lineage is a session and every session forked
    // from it (transitively); its checkpoints are numbered by one counter
    // (`lineages.last_seq`), so a checkpoint number names one checkpoint in
    // the whole tree and a fork continues its source's numbering. Sessions
    // from before this step keep their numbers: each is its own lineage.
    // `sessions.origin`: the checkpoint a session was forked at (NULL: made
    // from the template). `checkpoints.summary`: a one-line result summary.
    r#"
    CREATE TABLE lineages (
        id       INTEGER PRIMARY KEY AUTOINCREMENT,
        last_seq INTEGER NOT NULL DEFAULT 0
    );
    ALTER TABLE sessions ADD COLUMN lineage INTEGER;
    ALTER TABLE sessions ADD COLUMN origin INTEGER;
    ALTER TABLE checkpoints ADD COLUMN lineage INTEGER;
    ALTER TABLE checkpoints ADD COLUMN summary TEXT;
    INSERT INTO lineages (id, last_seq)
        SELECT s.sid, MAX(s.last_seq, COALESCE((SELECT MAX(c.seq) FROM checkpoints c WHERE c.owner = s.sid), 0))
        FROM sessions s;
    UPDATE sessions SET lineage = sid, origin = head
        WHERE head IS NOT NULL AND head NOT IN (SELECT c.id FROM checkpoints c WHERE c.owner = sessions.sid);
    UPDATE sessions SET lineage = sid WHERE lineage IS NULL;
    UPDATE checkpoints SET lineage = owner;
    CREATE INDEX checkpoints_lineage_seq ON checkpoints(lineage, seq);
    CREATE INDEX sessions_lineage ON sessions(lineage);
    "#,
    // 4: checkpoint files in an object store (`--objects`): each file of a
    // checkpoint (layer, state, pack, flat layer), by its name in the layers
    // directory, with the SHA-256 of its contents, which is its object's key
    // (`<prefix>/<sha256>`). A row exists only once the object is uploaded; it
    // is committed with the checkpoint (or the flat layer) it belongs to. No
    // rows without `--objects`: the local directory is then the only copy.
    r#"
    CREATE TABLE objects (
        name   TEXT    PRIMARY KEY,
        sha256 TEXT    NOT NULL,
        bytes  INTEGER NOT NULL CHECK (bytes >= 0)
    ) WITHOUT ROWID;
    CREATE INDEX objects_sha256 ON objects(sha256);
    "#,
    // 5: nodes and session leases (a cluster of nodes sharing one database, see
    // `crate::lease`). `nodes`: one row per node that ever served, with its
    // advertised URL, its state (`active`, `draining`) and its last heartbeat
    // on the database's clock. `sessions.owner_node`: the node that has the
    // session resident (NULL: none); `lease_token`: bumped at every
    // acquisition, the fencing token a checkpoint commit must still hold.
    // SQLite databases are one node's, but keep the same schema.
    r#"
    CREATE TABLE nodes (
        id           TEXT    PRIMARY KEY,
        url          TEXT    NOT NULL,
        state        TEXT    NOT NULL,
        heartbeat_ms INTEGER NOT NULL,
        started_ms   INTEGER NOT NULL
    ) WITHOUT ROWID;
    ALTER TABLE sessions ADD COLUMN owner_node TEXT;
    ALTER TABLE sessions ADD COLUMN lease_token INTEGER NOT NULL DEFAULT 0;
    CREATE INDEX sessions_owner_node ON sessions(owner_node);
    "#,
    // 6: artifacts shared by the nodes of a cluster (templates, images,
    // package layers), each published once: (kind, id) -> the SHA-256 of its
    // object (`<prefix>/artifacts/<sha256>` in the bucket), its size, what it
    // needs (a template: its image id) and a digest to compare a local copy
    // with (a template: its state file's SHA-256). The first record of an id
    // wins; rows are never changed. Unused (empty) on a single node.
    r#"
    CREATE TABLE artifacts (
        kind       TEXT    NOT NULL,
        id         TEXT    NOT NULL,
        sha256     TEXT    NOT NULL,
        bytes      INTEGER NOT NULL CHECK (bytes >= 0),
        needs      TEXT,
        digest     TEXT,
        created_ms INTEGER NOT NULL,
        PRIMARY KEY (kind, id)
    ) WITHOUT ROWID;
    "#,
    // 7: the named templates of a cluster (custom and checkpoint templates),
    // so that a name made on one node is known to every node: the catalog's
    // versioned record (JSON) by catalog key (`<tenant>/<name>`, or the name
    // of a template shared by every tenant). Unused (empty) on a single node.
    r#"
    CREATE TABLE template_records (
        key        TEXT    PRIMARY KEY,
        record     TEXT    NOT NULL,
        updated_ms INTEGER NOT NULL
    ) WITHOUT ROWID;
    "#,
    // 8: the package layers each lineage mounts (`%pip install`, `POST
    // /v1/sessions/{id}/packages`), with their size: a key's disk quota
    // counts each layer its live sessions use once, and a layer no lineage
    // refers to any more can be removed.
    r#"
    CREATE TABLE package_refs (
        lineage BIGINT NOT NULL,
        tenant  TEXT   NOT NULL,
        layer   TEXT   NOT NULL,
        bytes   BIGINT NOT NULL CHECK (bytes >= 0),
        PRIMARY KEY (lineage, layer)
    );
    CREATE INDEX package_refs_tenant ON package_refs(tenant);
    "#,
    // 9: what each call showed (`crate::output::CallOutput` as JSON, bounded;
    // NULL: not recorded, e.g. an upload or a checkpoint from before this
    // step) and its size, which the tenant's disk quota counts with the
    // checkpoint's files.
    r#"
    ALTER TABLE checkpoints ADD COLUMN output_bytes INTEGER NOT NULL DEFAULT 0 CHECK (output_bytes >= 0);
    ALTER TABLE checkpoints ADD COLUMN output TEXT;
    "#,
];

/// Schema migrations of PostgreSQL; the row of `forkbox_schema` = number of
/// steps applied. Step 1 is the schema SQLite has after its step 4 (a
/// PostgreSQL database starts there); later steps are added to both lists.
pub const PG_MIGRATIONS: &[&str] = &[
    // 1: sessions, checkpoints, tags, lineages, objects (see the module doc).
    r#"
    CREATE TABLE checkpoints (
        id         BIGINT GENERATED BY DEFAULT AS IDENTITY PRIMARY KEY,
        owner      BIGINT NOT NULL,
        session_id TEXT   NOT NULL,
        seq        BIGINT NOT NULL,
        parent     BIGINT REFERENCES checkpoints(id),
        code       TEXT   NOT NULL,
        created_ms BIGINT NOT NULL,
        layer      TEXT   NOT NULL,
        state      TEXT   NOT NULL,
        pages      BIGINT NOT NULL CHECK (pages >= 0),
        bytes      BIGINT NOT NULL CHECK (bytes >= 0),
        checksum   TEXT   NOT NULL,
        flat       TEXT,
        lineage    BIGINT,
        summary    TEXT,
        UNIQUE (owner, seq)
    );
    CREATE INDEX checkpoints_parent ON checkpoints(parent);
    CREATE INDEX checkpoints_session_id ON checkpoints(session_id);
    CREATE INDEX checkpoints_lineage_seq ON checkpoints(lineage, seq);

    CREATE TABLE sessions (
        sid          BIGINT GENERATED BY DEFAULT AS IDENTITY PRIMARY KEY,
        id           TEXT   NOT NULL UNIQUE,
        tenant       TEXT   NOT NULL,
        template_id  TEXT   NOT NULL,
        memory_bytes BIGINT NOT NULL,
        timeout_ms   BIGINT NOT NULL,
        output_bytes BIGINT NOT NULL,
        disk_bytes   BIGINT NOT NULL,
        head         BIGINT REFERENCES checkpoints(id),
        created_ms   BIGINT NOT NULL,
        last_used_ms BIGINT NOT NULL,
        last_seq     BIGINT NOT NULL DEFAULT 0,
        network      TEXT,
        lineage      BIGINT,
        origin       BIGINT
    );
    CREATE INDEX sessions_tenant_created ON sessions(tenant, created_ms);
    CREATE INDEX sessions_created ON sessions(created_ms);
    CREATE INDEX sessions_head ON sessions(head);
    CREATE INDEX sessions_lineage ON sessions(lineage);

    CREATE TABLE session_tags (
        sid   BIGINT NOT NULL REFERENCES sessions(sid) ON DELETE CASCADE,
        key   TEXT   NOT NULL,
        value TEXT   NOT NULL,
        PRIMARY KEY (sid, key)
    );
    CREATE INDEX session_tags_key_value ON session_tags(key, value);

    CREATE TABLE lineages (
        id       BIGINT GENERATED BY DEFAULT AS IDENTITY PRIMARY KEY,
        last_seq BIGINT NOT NULL DEFAULT 0
    );

    CREATE TABLE objects (
        name   TEXT   PRIMARY KEY,
        sha256 TEXT   NOT NULL,
        bytes  BIGINT NOT NULL CHECK (bytes >= 0)
    );
    CREATE INDEX objects_sha256 ON objects(sha256);
    "#,
    // 2: SQLite's step 5 (nodes, session leases), and the API keys, which a
    // cluster's nodes share (see `crate::keys`; SQLite keeps them in the
    // data directory's own `server/keys.db`).
    r#"
    CREATE TABLE nodes (
        id           TEXT   PRIMARY KEY,
        url          TEXT   NOT NULL,
        state        TEXT   NOT NULL,
        heartbeat_ms BIGINT NOT NULL,
        started_ms   BIGINT NOT NULL
    );
    ALTER TABLE sessions ADD COLUMN owner_node TEXT;
    ALTER TABLE sessions ADD COLUMN lease_token BIGINT NOT NULL DEFAULT 0;
    CREATE INDEX sessions_owner_node ON sessions(owner_node);

    CREATE TABLE api_keys (
        hash                 TEXT   PRIMARY KEY,
        tenant               TEXT   NOT NULL,
        created_ms           BIGINT NOT NULL,
        rate_limit           BIGINT,
        max_sessions         BIGINT,
        max_disk_mb          BIGINT,
        max_concurrency      BIGINT,
        cpu_seconds_per_hour BIGINT,
        max_timeout_seconds  BIGINT,
        admin                BIGINT NOT NULL DEFAULT 0,
        egress               TEXT
    );
    "#,
    // 3: artifacts shared by the nodes of a cluster (SQLite's step 6).
    r#"
    CREATE TABLE artifacts (
        kind       TEXT   NOT NULL,
        id         TEXT   NOT NULL,
        sha256     TEXT   NOT NULL,
        bytes      BIGINT NOT NULL CHECK (bytes >= 0),
        needs      TEXT,
        digest     TEXT,
        created_ms BIGINT NOT NULL,
        PRIMARY KEY (kind, id)
    );
    "#,
    // 4: the named templates of a cluster (SQLite's step 7).
    r#"
    CREATE TABLE template_records (
        key        TEXT   PRIMARY KEY,
        record     TEXT   NOT NULL,
        updated_ms BIGINT NOT NULL
    );
    "#,
    // 5: SQLite's step 8 (package layers of lineages).
    r#"
    CREATE TABLE package_refs (
        lineage BIGINT NOT NULL,
        tenant  TEXT   NOT NULL,
        layer   TEXT   NOT NULL,
        bytes   BIGINT NOT NULL CHECK (bytes >= 0),
        PRIMARY KEY (lineage, layer)
    );
    CREATE INDEX package_refs_tenant ON package_refs(tenant);
    "#,
    // 6: SQLite's step 9 (what each call showed).
    r#"
    ALTER TABLE checkpoints ADD COLUMN output_bytes BIGINT NOT NULL DEFAULT 0 CHECK (output_bytes >= 0);
    ALTER TABLE checkpoints ADD COLUMN output TEXT;
    "#,
    // 7: an API key's secrets (sealed, JSON), as keys.db's `secrets` column.
    r#"
    ALTER TABLE api_keys ADD COLUMN secrets TEXT;
    "#,
];

/// A checkpoint file that is in the object store (migration 4's `objects`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StoredObject {
    /// The file's name in the layers directory.
    pub name: String,
    /// SHA-256 of its contents (hex): its object's key under the prefix.
    pub sha256: String,
    pub bytes: u64,
}

#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    #[error("session store: {op}: {source}")]
    Database {
        /// The statement or operation that failed.
        op: &'static str,
        #[source]
        source: DbError,
    },
    #[error("session store: creating directory {path}: {source}")]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("session {0:?} already exists")]
    Exists(String),
    #[error("no session {0:?}")]
    NoSuchSession(String),
    #[error("no checkpoint {0}")]
    NoSuchCheckpoint(i64),
    #[error("checkpoint {id} still has child checkpoint {child}")]
    HasChildren { id: i64, child: i64 },
    #[error("checkpoint {id} is the head of session {session:?}")]
    InUse { id: i64, session: String },
    #[error("{field} = {value} does not fit in a signed 64-bit integer")]
    TooLarge { field: &'static str, value: u64 },
    #[error("session database schema version {found} is newer than this build supports ({supported})")]
    SchemaTooNew { found: i64, supported: i64 },
    #[error("session store: {0}")]
    Setup(String),
    #[error("the session database is in use by another forkbox node (start it with --objects to share the database as a cluster)")]
    Claimed,
    /// A checkpoint commit's fencing token no longer holds: another node
    /// took the session (this node's lease ran out).
    #[error("session {0:?} was taken over by another node; this node's checkpoint was not committed")]
    LeaseLost(String),
    #[error("waited {secs} s for another node to finish building {what}")]
    LockTimeout { what: String, secs: u64 },
}

impl StoreError {
    /// The database could not be reached (see [`DbError::is_unavailable`]).
    pub fn is_unavailable(&self) -> bool {
        matches!(self, StoreError::Database { source, .. } if source.is_unavailable())
    }
}

pub(crate) trait Op<T> {
    fn op(self, op: &'static str) -> Result<T, StoreError>;
}

impl<T, E: Into<DbError>> Op<T> for Result<T, E> {
    fn op(self, op: &'static str) -> Result<T, StoreError> {
        self.map_err(|e| StoreError::Database { op, source: e.into() })
    }
}

#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Limits {
    pub memory_bytes: u64,
    pub timeout_ms: u64,
    pub output_bytes: u64,
    pub disk_bytes: u64,
    /// The network configuration as JSON (`forkbox_linux::net::NetConfig`); `None`: no network.
    pub network: Option<String>,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SessionRecord {
    pub id: String,
    pub tenant: String,
    pub template_id: String,
    pub tags: BTreeMap<String, String>,
    pub limits: Limits,
    /// The checkpoint the session resumes from; `None` = the template.
    pub head: Option<i64>,
    pub created_ms: i64,
    pub last_used_ms: i64,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CheckpointRecord {
    pub id: i64,
    /// The session that created it (it may since have been deleted).
    pub session_id: String,
    /// 1, 2, 3... per creating session.
    pub seq: i64,
    /// `None` = directly over the template.
    pub parent: Option<i64>,
    pub code: String,
    pub created_ms: i64,
    pub layer: String,
    pub state: String,
    pub pages: u64,
    pub bytes: u64,
    pub checksum: String,
    /// A compacted layer covering template -> this checkpoint.
    pub flat: Option<String>,
    /// One line about the call's result (its value, or the exception), if recorded.
    pub summary: Option<String>,
    /// Bytes of the call's stored output (`crate::output`; 0: none recorded).
    pub output_bytes: u64,
}

#[derive(Debug, Clone, Copy)]
pub struct NewCheckpoint<'a> {
    pub session_id: &'a str,
    pub parent: Option<i64>,
    pub code: &'a str,
    pub layer: &'a str,
    pub state: &'a str,
    pub pages: u64,
    pub bytes: u64,
    pub checksum: &'a str,
    /// What the call showed (`crate::output::CallOutput` JSON); None: not recorded.
    pub output: Option<&'a str>,
}

/// A session head moved by [`Store::drop_checkpoints_and_rewind`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HeadMove {
    pub session: String,
    pub from: i64,
    pub to: Option<i64>,
}

/// What [`Store::drop_checkpoints_and_rewind`] did.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Rewind {
    /// Every checkpoint deleted: the ones asked for plus all their
    /// descendants, by id. Their files can now be removed.
    pub deleted: Vec<CheckpointRecord>,
    /// Sessions whose head was deleted, with their new head.
    pub moved: Vec<HeadMove>,
}

/// A live session of a lineage (see [`Store::lineage_tree`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LineageSession {
    pub id: String,
    pub head: Option<i64>,
    /// The checkpoint it was forked at (None: made from the template).
    pub origin: Option<i64>,
    pub created_ms: i64,
}

/// Every checkpoint of a lineage and its live sessions.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct LineageTree {
    pub checkpoints: Vec<CheckpointRecord>,
    pub sessions: Vec<LineageSession>,
}

/// The metadata store. One connection behind a mutex: `Send + Sync`; several
/// `Store`s (or processes) may open the same database.
pub struct Store {
    conn: Mutex<Conn>,
    /// The PostgreSQL URL, to connect again after the server closed the connection.
    url: Option<String>,
    /// [`Store::claim`] succeeded: a new connection must claim again before use.
    claimed: std::sync::atomic::AtomicBool,
}

/// The PostgreSQL advisory lock (session level) of the one node that uses a
/// database, see [`Store::claim`].
const NODE_LOCK: i64 = crate::db::WRITER_LOCK + 1;

const CP_COLS: &str = "c.id, c.session_id, c.seq, c.parent, c.code, c.created_ms, c.layer, \
                       c.state, c.pages, c.bytes, c.checksum, c.flat, c.summary, c.output_bytes";

const SESSION_COLS: &str = "s.sid, s.id, s.tenant, s.template_id, s.memory_bytes, s.timeout_ms, \
                            s.output_bytes, s.disk_bytes, s.head, s.created_ms, s.last_used_ms, s.network";

fn to_i64(field: &'static str, value: u64) -> Result<i64, StoreError> {
    i64::try_from(value).map_err(|_| StoreError::TooLarge { field, value })
}

fn checkpoint_row(row: &Row) -> Result<CheckpointRecord, DbError> {
    Ok(CheckpointRecord {
        id: row.i64(0)?,
        session_id: row.text(1)?,
        seq: row.i64(2)?,
        parent: row.opt_i64(3)?,
        code: row.text(4)?,
        created_ms: row.i64(5)?,
        layer: row.text(6)?,
        state: row.text(7)?,
        pages: row.u64(8)?,
        bytes: row.u64(9)?,
        checksum: row.text(10)?,
        flat: row.opt_text(11)?,
        summary: row.opt_text(12)?,
        output_bytes: row.u64(13)?,
    })
}

fn checkpoints(
    conn: &mut Conn,
    sql: &str,
    params: &[Value],
    op: &'static str,
) -> Result<Vec<CheckpointRecord>, StoreError> {
    conn.query(sql, params).op(op)?.iter().map(checkpoint_row).collect::<Result<_, _>>().op(op)
}

fn one_checkpoint(
    conn: &mut Conn,
    sql: &str,
    params: &[Value],
    op: &'static str,
) -> Result<Option<CheckpointRecord>, StoreError> {
    conn.query_opt(sql, params).op(op)?.as_ref().map(checkpoint_row).transpose().op(op)
}

/// The first column of the first row, an integer (or NULL); `None` if no row.
fn scalar(conn: &mut Conn, sql: &str, params: &[Value], op: &'static str) -> Result<Option<Option<i64>>, StoreError> {
    conn.query_opt(sql, params).op(op)?.map(|r| r.opt_i64(0)).transpose().op(op)
}

impl Store {
    /// Opens (creating it and its directory if needed) the SQLite database at
    /// `path` and brings its schema up to date. [`Synchronous::Normal`].
    pub fn open(path: &Path) -> Result<Store, StoreError> {
        Self::open_with(path, Synchronous::default())
    }

    /// [`Store::open`] with a chosen durability.
    pub fn open_with(path: &Path, sync: Synchronous) -> Result<Store, StoreError> {
        if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
            std::fs::create_dir_all(dir).map_err(|source| StoreError::Io { path: dir.to_path_buf(), source })?;
        }
        let conn = rusqlite::Connection::open(path).op("open database")?;
        Self::init_sqlite(conn, Some(sync))
    }

    /// A private in-memory SQLite database (no WAL), for tests.
    pub fn open_in_memory() -> Result<Store, StoreError> {
        let conn = rusqlite::Connection::open_in_memory().op("open in-memory database")?;
        Self::init_sqlite(conn, None)
    }

    /// Connects to the PostgreSQL database at `url` (`postgres://user@host:port/db`)
    /// and brings its schema up to date (one migration at a time for all
    /// nodes: under an advisory lock).
    pub fn open_postgres(url: &str) -> Result<Store, StoreError> {
        let mut conn = Conn::postgres(url).op("connect to PostgreSQL")?;
        migrate_postgres(&mut conn)?;
        Ok(Store { conn: Mutex::new(conn), url: Some(url.to_owned()), claimed: false.into() })
    }

    /// Which database engine holds the metadata.
    pub fn backend(&self) -> Backend {
        self.conn().backend()
    }

    /// `sync`: `None` for an in-memory database (no WAL).
    fn init_sqlite(mut conn: rusqlite::Connection, sync: Option<Synchronous>) -> Result<Store, StoreError> {
        conn.busy_timeout(BUSY_TIMEOUT).op("set busy_timeout")?;
        if let Some(sync) = sync {
            let mode: String = conn
                .pragma_update_and_check(None, "journal_mode", "WAL", |r| r.get(0))
                .op("PRAGMA journal_mode = WAL")?;
            if !mode.eq_ignore_ascii_case("wal") {
                return Err(StoreError::Setup(format!("PRAGMA journal_mode = WAL: journal_mode is {mode}, not wal")));
            }
            let level = match sync {
                Synchronous::Normal => "NORMAL",
                Synchronous::Full => "FULL",
            };
            conn.pragma_update(None, "synchronous", level).op("PRAGMA synchronous")?;
        }
        conn.pragma_update(None, "foreign_keys", true).op("PRAGMA foreign_keys = ON")?;
        let fk: bool = conn.query_row("PRAGMA foreign_keys", [], |r| r.get(0)).op("PRAGMA foreign_keys")?;
        if !fk {
            return Err(StoreError::Setup("PRAGMA foreign_keys = ON: not supported by this SQLite".into()));
        }
        migrate_sqlite(&mut conn)?;
        Ok(Store { conn: Mutex::new(Conn::Sqlite(conn)), url: None, claimed: false.into() })
    }

    /// Makes this store the only user of its PostgreSQL database until it is
    /// dropped (a session-level advisory lock, claimed again on every new
    /// connection): [`StoreError::Claimed`] if another node holds it. One node
    /// per database until sessions are leased to nodes; SQLite is
    /// claimed by the sessions directory's lock instead (a no-op here).
    pub fn claim(&self) -> Result<(), StoreError> {
        let mut conn = self.conn();
        if conn.backend() == Backend::Sqlite {
            return Ok(());
        }
        claim_node(&mut conn)?;
        self.claimed.store(true, std::sync::atomic::Ordering::SeqCst);
        Ok(())
    }

    pub(crate) fn conn(&self) -> MutexGuard<'_, Conn> {
        // A panic while holding the lock dropped its transaction guard, which
        // rolled back, so the connection is still consistent.
        let mut c = self.conn.lock().unwrap_or_else(|e| e.into_inner());
        // A new connection is claimed again if this store had claimed the database.
        let claimed = self.claimed.load(std::sync::atomic::Ordering::SeqCst);
        c.reopen_if_closed(self.url.as_deref(), |fresh| !claimed || claim_node(fresh).is_ok());
        c
    }

    /// The schema version: the number of migration steps of this engine applied.
    pub fn schema_version(&self) -> Result<i64, StoreError> {
        let mut conn = self.conn();
        let sql = match conn.backend() {
            Backend::Sqlite => "PRAGMA user_version",
            Backend::Postgres => "SELECT version FROM forkbox_schema",
        };
        Ok(scalar(&mut conn, sql, &[], "schema version")?.flatten().unwrap_or(0))
    }

    // ---------------------------------------------------------------- sessions

    /// Inserts a session (with its tags). `s.head` may name an existing
    /// checkpoint (a fork). Session ids are unique across all tenants:
    /// [`StoreError::Exists`] if the id is taken.
    pub fn create_session(&self, s: &SessionRecord) -> Result<(), StoreError> {
        let memory = to_i64("memory_bytes", s.limits.memory_bytes)?;
        let timeout = to_i64("timeout_ms", s.limits.timeout_ms)?;
        let output = to_i64("output_bytes", s.limits.output_bytes)?;
        let disk = to_i64("disk_bytes", s.limits.disk_bytes)?;
        let mut conn = self.conn();
        let mut tx = conn.begin().op("create_session: begin")?;
        if tx.exists("SELECT 1 FROM sessions WHERE id = ?1", vals![&s.id]).op("create_session: check id")? {
            return Err(StoreError::Exists(s.id.clone()));
        }
        if let Some(head) = s.head {
            if !checkpoint_exists(&mut tx, head)? {
                return Err(StoreError::NoSuchCheckpoint(head));
            }
        }
        // A fork joins the lineage of the checkpoint it starts at; a new session starts one.
        let lineage = match s.head {
            Some(head) => scalar(
                &mut tx,
                "SELECT lineage FROM checkpoints WHERE id = ?1",
                vals![head],
                "create_session: lineage of the head",
            )?
            .flatten(),
            None => None,
        };
        let lineage = match lineage {
            Some(l) => l,
            None => scalar(
                &mut tx,
                "INSERT INTO lineages (last_seq) VALUES (0) RETURNING id",
                &[],
                "create_session: new lineage",
            )?
            .flatten()
            .ok_or(StoreError::Setup("create_session: a new lineage has no id".into()))?,
        };
        let sid = scalar(
            &mut tx,
            "INSERT INTO sessions (id, tenant, template_id, memory_bytes, timeout_ms, \
             output_bytes, disk_bytes, head, created_ms, last_used_ms, network, lineage, origin) \
             VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8, ?9, ?10, ?11, ?12, ?8) RETURNING sid",
            vals![
                &s.id,
                &s.tenant,
                &s.template_id,
                memory,
                timeout,
                output,
                disk,
                s.head,
                s.created_ms,
                s.last_used_ms,
                &s.limits.network,
                lineage
            ],
            "create_session: insert session",
        )?
        .flatten()
        .ok_or(StoreError::Setup("create_session: the new session has no sid".into()))?;
        for (k, v) in &s.tags {
            tx.execute("INSERT INTO session_tags (sid, key, value) VALUES (?1, ?2, ?3)", vals![sid, k, v])
                .op("create_session: insert tag")?;
        }
        tx.commit().op("create_session: commit")
    }

    /// The session `id` of `tenant`; other tenants' sessions are invisible.
    pub fn session(&self, tenant: &str, id: &str) -> Result<Option<SessionRecord>, StoreError> {
        let mut conn = self.conn();
        let mut v = load_sessions(&mut conn, "s.tenant = ?1 AND s.id = ?2", vals![tenant, id], "session")?;
        Ok(v.pop())
    }

    /// The tenant's sessions carrying all of `tags`, oldest first.
    pub fn list_sessions(&self, tenant: &str, tags: &[(String, String)]) -> Result<Vec<SessionRecord>, StoreError> {
        let mut filter = String::from("s.tenant = ?1");
        let mut args: Vec<Value> = vec![tenant.into()];
        for (k, v) in tags {
            let n = args.len();
            filter.push_str(&format!(
                " AND EXISTS (SELECT 1 FROM session_tags f WHERE f.sid = s.sid \
                 AND f.key = ?{} AND f.value = ?{})",
                n + 1,
                n + 2
            ));
            args.push(k.into());
            args.push(v.into());
        }
        let mut conn = self.conn();
        load_sessions(&mut conn, &filter, &args, "list_sessions")
    }

    /// Every session of every tenant, oldest first (start-up recovery).
    pub fn all_sessions(&self) -> Result<Vec<SessionRecord>, StoreError> {
        let mut conn = self.conn();
        load_sessions(&mut conn, "1 = 1", &[], "all_sessions")
    }

    /// Number of sessions of `tenant`, or of all tenants.
    pub fn count_sessions(&self, tenant: Option<&str>) -> Result<u64, StoreError> {
        let mut conn = self.conn();
        let n = match tenant {
            Some(t) => {
                scalar(&mut conn, "SELECT COUNT(*) FROM sessions WHERE tenant = ?1", vals![t], "count_sessions")?
            }
            None => scalar(&mut conn, "SELECT COUNT(*) FROM sessions", &[], "count_sessions")?,
        };
        Ok(n.flatten().unwrap_or(0).max(0) as u64)
    }

    /// Sets `last_used_ms`. [`StoreError::NoSuchSession`] if absent.
    pub fn touch(&self, id: &str, now_ms: i64) -> Result<(), StoreError> {
        let n = self
            .conn()
            .execute("UPDATE sessions SET last_used_ms = ?2 WHERE id = ?1", vals![id, now_ms])
            .op("touch")?;
        if n == 0 {
            return Err(StoreError::NoSuchSession(id.to_owned()));
        }
        Ok(())
    }

    /// Changes the session's tags (replaced as a whole when `tags` is Some)
    /// and/or its memory and time limits, in one transaction. `false` if the
    /// tenant has no such session.
    pub fn update_session(
        &self,
        tenant: &str,
        id: &str,
        tags: Option<&BTreeMap<String, String>>,
        memory_bytes: Option<u64>,
        timeout_ms: Option<u64>,
    ) -> Result<bool, StoreError> {
        let memory = memory_bytes.map(|m| to_i64("memory_bytes", m)).transpose()?;
        let timeout = timeout_ms.map(|t| to_i64("timeout_ms", t)).transpose()?;
        let mut conn = self.conn();
        let mut tx = conn.begin().op("update_session: begin")?;
        let sid = scalar(
            &mut tx,
            "SELECT sid FROM sessions WHERE tenant = ?1 AND id = ?2",
            vals![tenant, id],
            "update_session: find",
        )?
        .flatten();
        let Some(sid) = sid else { return Ok(false) };
        tx.execute(
            "UPDATE sessions SET memory_bytes = COALESCE(?2, memory_bytes), \
             timeout_ms = COALESCE(?3, timeout_ms) WHERE sid = ?1",
            vals![sid, memory, timeout],
        )
        .op("update_session: limits")?;
        if let Some(tags) = tags {
            tx.execute("DELETE FROM session_tags WHERE sid = ?1", vals![sid]).op("update_session: delete tags")?;
            for (k, v) in tags {
                tx.execute("INSERT INTO session_tags (sid, key, value) VALUES (?1, ?2, ?3)", vals![sid, k, v])
                    .op("update_session: insert tag")?;
            }
        }
        tx.commit().op("update_session: commit")?;
        Ok(true)
    }

    /// Moves the session's head (revert). The checkpoint must exist; whether
    /// it belongs to the session's history is the caller's business.
    pub fn set_head(&self, id: &str, head: Option<i64>) -> Result<(), StoreError> {
        let mut conn = self.conn();
        let mut tx = conn.begin().op("set_head: begin")?;
        if let Some(h) = head {
            if !checkpoint_exists(&mut tx, h)? {
                return Err(StoreError::NoSuchCheckpoint(h));
            }
        }
        let n = tx.execute("UPDATE sessions SET head = ?2 WHERE id = ?1", vals![id, head]).op("set_head: update")?;
        if n == 0 {
            return Err(StoreError::NoSuchSession(id.to_owned()));
        }
        tx.commit().op("set_head: commit")
    }

    /// Deletes the session and its tags; its checkpoints stay until
    /// [`Store::unreferenced_checkpoints`] reports them. `false` if the tenant
    /// has no such session.
    pub fn delete_session(&self, tenant: &str, id: &str) -> Result<bool, StoreError> {
        let n = self
            .conn()
            .execute("DELETE FROM sessions WHERE tenant = ?1 AND id = ?2", vals![tenant, id])
            .op("delete_session")?;
        Ok(n > 0)
    }

    // ------------------------------------------------------------- checkpoints

    /// Inserts the checkpoint and makes it the session's head (also setting
    /// `last_used_ms = now_ms`), in one transaction. `seq` = the session's
    /// highest seq + 1, never reusing a number whose checkpoint was deleted;
    /// `created_ms` = `now_ms`. The parent is not required to be the current
    /// head (the caller passes the checkpoint the exec actually ran on).
    pub fn commit_checkpoint(&self, c: &NewCheckpoint<'_>, now_ms: i64) -> Result<CheckpointRecord, StoreError> {
        self.commit_checkpoint_as(c, None, None, now_ms)
    }

    /// The next number of the session's lineage, taken now (so an exec can be
    /// told its checkpoint number before it runs): never handed out again,
    /// also if no checkpoint ends up with it.
    pub fn reserve_seq(&self, session: &str) -> Result<i64, StoreError> {
        let mut conn = self.conn();
        let mut tx = conn.begin().op("reserve_seq: begin")?;
        let seq = next_seq(&mut tx, session)?;
        tx.commit().op("reserve_seq: commit")?;
        Ok(seq)
    }

    /// Give back a number from [`Self::reserve_seq`] that no checkpoint got (a
    /// failed exec), if it is still the lineage's last: numbers stay dense when
    /// nothing else took one meanwhile. True if it was given back.
    pub fn release_seq(&self, session: &str, seq: i64) -> Result<bool, StoreError> {
        let n = self
            .conn()
            .execute(
                "UPDATE lineages SET last_seq = last_seq - 1 \
                 WHERE id = (SELECT lineage FROM sessions WHERE id = ?1) AND last_seq = ?2",
                vals![session, seq],
            )
            .op("release_seq")?;
        Ok(n > 0)
    }

    /// [`Self::commit_checkpoint`] with a number from [`Self::reserve_seq`]
    /// (None: the lineage's next) and a result summary.
    pub fn commit_checkpoint_as(
        &self,
        c: &NewCheckpoint<'_>,
        reserved: Option<i64>,
        summary: Option<&str>,
        now_ms: i64,
    ) -> Result<CheckpointRecord, StoreError> {
        self.commit_checkpoint_with(c, reserved, summary, now_ms, &[])
    }

    /// [`Self::commit_checkpoint_as`] that also records `objects` (the
    /// checkpoint's files uploaded to the object store) in the same transaction.
    pub fn commit_checkpoint_with(
        &self,
        c: &NewCheckpoint<'_>,
        reserved: Option<i64>,
        summary: Option<&str>,
        now_ms: i64,
        objects: &[StoredObject],
    ) -> Result<CheckpointRecord, StoreError> {
        self.commit_checkpoint_fenced(c, reserved, summary, now_ms, objects, None)
    }

    /// [`Self::commit_checkpoint_with`] that commits only while `fence` (the
    /// committing node's lease of the session, see `crate::lease`) still holds:
    /// [`StoreError::LeaseLost`] otherwise, and nothing is written.
    pub fn commit_checkpoint_fenced(
        &self,
        c: &NewCheckpoint<'_>,
        reserved: Option<i64>,
        summary: Option<&str>,
        now_ms: i64,
        objects: &[StoredObject],
        fence: Option<&crate::lease::Lease>,
    ) -> Result<CheckpointRecord, StoreError> {
        let pages = to_i64("pages", c.pages)?;
        let bytes = to_i64("bytes", c.bytes)?;
        let output_bytes = to_i64("output_bytes", c.output.map_or(0, |o| o.len() as u64))?;
        let mut conn = self.conn();
        let mut tx = conn.begin().op("commit_checkpoint: begin")?;
        let sid = scalar(
            &mut tx,
            "SELECT sid FROM sessions WHERE id = ?1",
            vals![c.session_id],
            "commit_checkpoint: find session",
        )?
        .flatten()
        .ok_or_else(|| StoreError::NoSuchSession(c.session_id.to_owned()))?;
        if let Some(lease) = fence {
            let holds = tx
                .exists(
                    "SELECT 1 FROM sessions WHERE sid = ?1 AND owner_node = ?2 AND lease_token = ?3",
                    vals![sid, &lease.node, lease.token],
                )
                .op("commit_checkpoint: check the lease")?;
            if !holds {
                return Err(StoreError::LeaseLost(c.session_id.to_owned()));
            }
        }
        if let Some(p) = c.parent {
            if !checkpoint_exists(&mut tx, p)? {
                return Err(StoreError::NoSuchCheckpoint(p));
            }
        }
        // The lineage's counter: numbers are unique in the whole tree and never
        // reused (also after the newest checkpoints were dropped).
        let seq = match reserved {
            Some(n) => n,
            None => next_seq(&mut tx, c.session_id)?,
        };
        let id = scalar(
            &mut tx,
            "INSERT INTO checkpoints (owner, session_id, seq, parent, code, created_ms, layer, \
             state, pages, bytes, checksum, flat, lineage, summary, output, output_bytes) \
             VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8, ?9, ?10, ?11, NULL, \
             (SELECT lineage FROM sessions WHERE sid = ?1), ?12, ?13, ?14) RETURNING id",
            vals![
                sid,
                c.session_id,
                seq,
                c.parent,
                c.code,
                now_ms,
                c.layer,
                c.state,
                pages,
                bytes,
                c.checksum,
                summary,
                c.output,
                output_bytes
            ],
            "commit_checkpoint: insert checkpoint",
        )?
        .flatten()
        .ok_or(StoreError::Setup("commit_checkpoint: the new checkpoint has no id".into()))?;
        tx.execute(
            "UPDATE sessions SET head = ?2, last_used_ms = ?3, last_seq = ?4 WHERE sid = ?1",
            vals![sid, id, now_ms, seq],
        )
        .op("commit_checkpoint: set head")?;
        insert_objects(&mut tx, objects)?;
        tx.commit().op("commit_checkpoint: commit")?;
        Ok(CheckpointRecord {
            id,
            session_id: c.session_id.to_owned(),
            seq,
            parent: c.parent,
            code: c.code.to_owned(),
            created_ms: now_ms,
            layer: c.layer.to_owned(),
            state: c.state.to_owned(),
            pages: c.pages,
            bytes: c.bytes,
            checksum: c.checksum.to_owned(),
            flat: None,
            summary: summary.map(str::to_owned),
            output_bytes: output_bytes as u64,
        })
    }

    /// The stored output of checkpoint `id` (None: none recorded, or no such checkpoint).
    pub fn checkpoint_output(&self, id: i64) -> Result<Option<String>, StoreError> {
        let op = "checkpoint_output";
        let row = self.conn().query_opt("SELECT output FROM checkpoints WHERE id = ?1", vals![id]).op(op)?;
        row.map(|r| r.opt_text(0)).transpose().op(op).map(Option::flatten)
    }

    /// The stored outputs of the checkpoints `ids` that have one, by id.
    pub fn checkpoint_outputs(&self, ids: &[i64]) -> Result<Vec<(i64, String)>, StoreError> {
        if ids.is_empty() {
            return Ok(Vec::new());
        }
        let op = "checkpoint_outputs";
        self.conn()
            .query(
                "SELECT id, output FROM checkpoints WHERE id IN_LIST(?1) AND output IS NOT NULL ORDER BY id",
                vals![ids],
            )
            .op(op)?
            .iter()
            .map(|r| Ok((r.i64(0)?, r.text(1)?)))
            .collect::<Result<_, DbError>>()
            .op(op)
    }

    pub fn checkpoint(&self, id: i64) -> Result<Option<CheckpointRecord>, StoreError> {
        let sql = format!("SELECT {CP_COLS} FROM checkpoints c WHERE c.id = ?1");
        one_checkpoint(&mut self.conn(), &sql, vals![id], "checkpoint")
    }

    /// Root-first chain from the template to `id` (inclusive): the first
    /// element has `parent == None`. [`StoreError::NoSuchCheckpoint`] if `id`
    /// does not exist.
    pub fn ancestry(&self, id: i64) -> Result<Vec<CheckpointRecord>, StoreError> {
        let sql = format!(
            "WITH RECURSIVE up(id, depth) AS ( \
                SELECT CAST(?1 AS BIGINT), 0 \
                UNION ALL \
                SELECT c.parent, up.depth + 1 FROM checkpoints c JOIN up ON c.id = up.id \
                WHERE c.parent IS NOT NULL \
             ) \
             SELECT {CP_COLS} FROM up JOIN checkpoints c ON c.id = up.id \
             ORDER BY up.depth DESC"
        );
        let v = checkpoints(&mut self.conn(), &sql, vals![id], "ancestry")?;
        if v.is_empty() {
            return Err(StoreError::NoSuchCheckpoint(id));
        }
        Ok(v)
    }

    /// Every checkpoint created by the (live) session `id`, all branches, by
    /// seq. A fork's starting checkpoint belongs to the source session and is
    /// not included.
    pub fn session_checkpoints(&self, id: &str) -> Result<Vec<CheckpointRecord>, StoreError> {
        let sql = format!(
            "SELECT {CP_COLS} FROM checkpoints c JOIN sessions s ON c.owner = s.sid \
             WHERE s.id = ?1 ORDER BY c.seq"
        );
        checkpoints(&mut self.conn(), &sql, vals![id], "session_checkpoints")
    }

    /// The (live) session's checkpoint number `seq`.
    pub fn checkpoint_by_seq(&self, session: &str, seq: i64) -> Result<Option<CheckpointRecord>, StoreError> {
        // Any checkpoint of the session's lineage (its own first: sessions from
        // before lineages were recorded may share numbers with their source).
        let sql = format!(
            "SELECT {CP_COLS} FROM checkpoints c JOIN sessions s ON s.id = ?1 \
             WHERE c.seq = ?2 AND (c.owner = s.sid OR c.lineage = s.lineage) \
             ORDER BY c.owner = s.sid DESC LIMIT 1"
        );
        one_checkpoint(&mut self.conn(), &sql, vals![session, seq], "checkpoint_by_seq")
    }

    /// The tree a session belongs to: every checkpoint of its lineage (by id,
    /// so parents come first) and the lineage's live sessions. `None`: no such
    /// session of the tenant.
    pub fn lineage_tree(&self, tenant: &str, id: &str) -> Result<Option<LineageTree>, StoreError> {
        let mut conn = self.conn();
        let lineage = scalar(
            &mut conn,
            "SELECT lineage FROM sessions WHERE tenant = ?1 AND id = ?2",
            vals![tenant, id],
            "lineage_tree: session",
        )?;
        let Some(lineage) = lineage else { return Ok(None) };
        let Some(lineage) = lineage else { return Ok(Some(LineageTree::default())) };
        let sql = format!("SELECT {CP_COLS} FROM checkpoints c WHERE c.lineage = ?1 ORDER BY c.id");
        let checkpoints = checkpoints(&mut conn, &sql, vals![lineage], "lineage_tree: checkpoints")?;
        let op = "lineage_tree: sessions";
        let sessions = conn
            .query(
                "SELECT s.id, s.head, s.origin, s.created_ms FROM sessions s \
                 WHERE s.lineage = ?1 AND s.tenant = ?2 ORDER BY s.created_ms, s.sid",
                vals![lineage, tenant],
            )
            .op(op)?
            .iter()
            .map(|r| {
                Ok(LineageSession { id: r.text(0)?, head: r.opt_i64(1)?, origin: r.opt_i64(2)?, created_ms: r.i64(3)? })
            })
            .collect::<Result<_, DbError>>()
            .op(op)?;
        Ok(Some(LineageTree { checkpoints, sessions }))
    }

    /// Records (or clears) the compacted layer of a checkpoint.
    pub fn set_flat(&self, id: i64, flat: Option<&str>) -> Result<(), StoreError> {
        self.set_flat_with(id, flat, None)
    }

    /// [`Self::set_flat`], recording the flat layer's object in the same transaction.
    pub fn set_flat_with(&self, id: i64, flat: Option<&str>, object: Option<&StoredObject>) -> Result<(), StoreError> {
        let mut conn = self.conn();
        let mut tx = conn.begin().op("set_flat: begin")?;
        let n = tx.execute("UPDATE checkpoints SET flat = ?2 WHERE id = ?1", vals![id, flat]).op("set_flat")?;
        if n == 0 {
            return Err(StoreError::NoSuchCheckpoint(id));
        }
        if let Some(o) = object {
            insert_objects(&mut tx, std::slice::from_ref(o))?;
        }
        tx.commit().op("set_flat: commit")
    }

    // ----------------------------------------------------------------- objects

    /// The object of the file `name` of the layers directory, if it was uploaded.
    pub fn object(&self, name: &str) -> Result<Option<StoredObject>, StoreError> {
        let row = self
            .conn()
            .query_opt("SELECT name, sha256, bytes FROM objects WHERE name = ?1", vals![name])
            .op("object")?;
        row.as_ref().map(object_row).transpose().op("object")
    }

    /// The objects of those of `names` that were uploaded, by name (one query).
    pub fn objects_named(&self, names: &[String]) -> Result<Vec<StoredObject>, StoreError> {
        if names.is_empty() {
            return Ok(Vec::new());
        }
        let op = "objects_named";
        let rows = self
            .conn()
            .query("SELECT name, sha256, bytes FROM objects WHERE name IN_LIST(?1) ORDER BY name", vals![names])
            .op(op)?;
        rows.iter().map(object_row).collect::<Result<_, _>>().op(op)
    }

    /// Every uploaded file, by name.
    pub fn all_objects(&self) -> Result<Vec<StoredObject>, StoreError> {
        let rows = self.conn().query("SELECT name, sha256, bytes FROM objects ORDER BY name", &[]).op("all_objects")?;
        rows.iter().map(object_row).collect::<Result<_, _>>().op("all_objects")
    }

    /// Whether some file's contents have this SHA-256 (its object is in the store).
    pub fn has_object(&self, sha256: &str) -> Result<bool, StoreError> {
        self.conn().exists("SELECT 1 FROM objects WHERE sha256 = ?1", vals![sha256]).op("has_object")
    }

    /// Records objects of files that exist already (an upload of older files).
    pub fn add_objects(&self, objects: &[StoredObject]) -> Result<(), StoreError> {
        let mut conn = self.conn();
        let mut tx = conn.begin().op("add_objects: begin")?;
        insert_objects(&mut tx, objects)?;
        tx.commit().op("add_objects: commit")
    }

    /// Forgets the objects of the files `names` (deleted checkpoints' files) and
    /// returns the SHA-256s no file refers to any more: those objects can be
    /// deleted from the object store. One transaction.
    pub fn forget_objects(&self, names: &[String]) -> Result<Vec<String>, StoreError> {
        if names.is_empty() {
            return Ok(Vec::new());
        }
        let mut conn = self.conn();
        let mut tx = conn.begin().op("forget_objects: begin")?;
        let mut gone = Vec::new();
        for n in names {
            let row = tx
                .query_opt("DELETE FROM objects WHERE name = ?1 RETURNING sha256", vals![n])
                .op("forget_objects: delete")?;
            if let Some(r) = row {
                gone.push(r.text(0).op("forget_objects: delete")?);
            }
        }
        gone.sort_unstable();
        gone.dedup();
        let mut unreferenced = Vec::with_capacity(gone.len());
        for sha in gone {
            if !tx.exists("SELECT 1 FROM objects WHERE sha256 = ?1", vals![&sha]).op("forget_objects: check")? {
                unreferenced.push(sha);
            }
        }
        tx.commit().op("forget_objects: commit")?;
        Ok(unreferenced)
    }

    // --------------------------------------------------------------- artifacts

    /// The published artifact (`kind`, `id`) (migration 5's `artifacts`).
    pub fn artifact(&self, kind: ArtifactKind, id: &str) -> Result<Option<Artifact>, StoreError> {
        let row = self
            .conn()
            .query_opt(
                "SELECT kind, id, sha256, bytes, needs, digest FROM artifacts WHERE kind = ?1 AND id = ?2",
                vals![kind.as_str(), id],
            )
            .op("artifact")?;
        row.as_ref().map(artifact_row).transpose().op("artifact")
    }

    /// Every published artifact (tests, the bench).
    pub fn all_artifacts(&self) -> Result<Vec<Artifact>, StoreError> {
        let op = "all_artifacts";
        let rows = self
            .conn()
            .query("SELECT kind, id, sha256, bytes, needs, digest FROM artifacts ORDER BY kind, id", &[])
            .op(op)?;
        rows.iter().map(artifact_row).collect::<Result<_, _>>().op(op)
    }

    /// Records `a` unless (`a.kind`, `a.id`) is recorded already, and returns
    /// the record: `a`, or the earlier one (the first publisher wins; a record
    /// never changes).
    pub fn publish_artifact(&self, a: &Artifact, now_ms: i64) -> Result<Artifact, StoreError> {
        let op = "publish_artifact";
        let mut conn = self.conn();
        let mut tx = conn.begin().op("publish_artifact: begin")?;
        tx.execute(
            "INSERT INTO artifacts (kind, id, sha256, bytes, needs, digest, created_ms) \
             VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7) ON CONFLICT (kind, id) DO NOTHING",
            vals![a.kind.as_str(), &a.id, &a.sha256, to_i64("bytes", a.bytes)?, &a.needs, &a.digest, now_ms],
        )
        .op(op)?;
        let row = tx
            .query_opt(
                "SELECT kind, id, sha256, bytes, needs, digest FROM artifacts WHERE kind = ?1 AND id = ?2",
                vals![a.kind.as_str(), &a.id],
            )
            .op(op)?;
        let won = row.as_ref().map(artifact_row).transpose().op(op)?;
        tx.commit().op("publish_artifact: commit")?;
        won.ok_or_else(|| {
            StoreError::Setup(format!("artifact {} {} was recorded and is not there", a.kind.as_str(), a.id))
        })
    }

    // ------------------------------------------------------------ package layers

    /// Record that the lineage of session `id` mounts the package layers
    /// `layers` ((id, bytes); once per lineage and layer).
    pub fn add_package_refs(&self, id: &str, layers: &[(String, u64)]) -> Result<(), StoreError> {
        let mut conn = self.conn();
        for (layer, bytes) in layers {
            conn.execute(
                "INSERT INTO package_refs (lineage, tenant, layer, bytes) \
                 SELECT lineage, tenant, ?2, ?3 FROM sessions WHERE id = ?1 AND lineage IS NOT NULL \
                 ON CONFLICT (lineage, layer) DO NOTHING",
                vals![id, layer, i64::try_from(*bytes).unwrap_or(i64::MAX)],
            )
            .op("add_package_refs")?;
        }
        Ok(())
    }

    /// The package layers the tenant's live sessions use, each once: (id, bytes).
    pub fn tenant_package_layers(&self, tenant: &str) -> Result<Vec<(String, u64)>, StoreError> {
        let op = "tenant_package_layers";
        let rows = self
            .conn()
            .query(
                "SELECT r.layer, MAX(r.bytes) FROM package_refs r WHERE r.tenant = ?1 \
                 AND EXISTS (SELECT 1 FROM sessions s WHERE s.lineage = r.lineage) GROUP BY r.layer ORDER BY r.layer",
                vals![tenant],
            )
            .op(op)?;
        rows.iter().map(|r| Ok((r.text(0)?, r.i64(1)?.max(0) as u64))).collect::<Result<_, DbError>>().op(op)
    }

    /// Every package layer a lineage still refers to (it has a live session or
    /// a checkpoint); the records of the other lineages are dropped first.
    pub fn referenced_package_layers(&self) -> Result<std::collections::BTreeSet<String>, StoreError> {
        let op = "referenced_package_layers";
        let mut conn = self.conn();
        conn.execute(
            "DELETE FROM package_refs WHERE \
             NOT EXISTS (SELECT 1 FROM sessions s WHERE s.lineage = package_refs.lineage) \
             AND NOT EXISTS (SELECT 1 FROM checkpoints c WHERE c.lineage = package_refs.lineage)",
            &[],
        )
        .op(op)?;
        let rows = conn.query("SELECT DISTINCT layer FROM package_refs", &[]).op(op)?;
        rows.iter().map(|r| r.text(0)).collect::<Result<_, DbError>>().op(op)
    }

    // -------------------------------------------------------- template records

    /// Every named template's record (migration 7's `template_records`): (key, record).
    pub fn template_records(&self) -> Result<Vec<(String, String)>, StoreError> {
        let op = "template_records";
        let rows = self.conn().query("SELECT key, record FROM template_records ORDER BY key", &[]).op(op)?;
        rows.iter().map(|r| Ok((r.text(0)?, r.text(1)?))).collect::<Result<_, DbError>>().op(op)
    }

    /// Record the named template `key`. `replace`: over an existing record;
    /// otherwise only if `key` has none (false: it has one, nothing changed).
    pub fn put_template_record(&self, key: &str, record: &str, replace: bool, now_ms: i64) -> Result<bool, StoreError> {
        let sql = if replace {
            "INSERT INTO template_records (key, record, updated_ms) VALUES (?1, ?2, ?3) \
             ON CONFLICT (key) DO UPDATE SET record = excluded.record, updated_ms = excluded.updated_ms"
        } else {
            "INSERT INTO template_records (key, record, updated_ms) VALUES (?1, ?2, ?3) ON CONFLICT (key) DO NOTHING"
        };
        let n = self.conn().execute(sql, vals![key, record, now_ms]).op("put_template_record")?;
        Ok(n == 1)
    }

    /// Forget the named template `key` (nothing if it has no record).
    pub fn delete_template_record(&self, key: &str) -> Result<(), StoreError> {
        self.conn().execute("DELETE FROM template_records WHERE key = ?1", vals![key]).op("delete_template_record")?;
        Ok(())
    }

    /// The cluster-wide lock of artifact (`kind`, `id`), waiting up to `wait`
    /// for the node that holds it: a PostgreSQL session-level advisory lock on
    /// a connection of its own (so the store's connection stays free while a
    /// template builds), released when the guard drops or that connection
    /// dies with its node. SQLite (one node): no lock to take.
    pub fn lock_artifact(&self, kind: ArtifactKind, id: &str, wait: Duration) -> Result<ArtifactLock, StoreError> {
        let Some(url) = self.url.as_deref() else { return Ok(ArtifactLock { conn: None, key: 0 }) };
        let key = artifact_lock_key(kind, id);
        let mut conn = Conn::postgres(url).op("lock_artifact: connect")?;
        let deadline = std::time::Instant::now() + wait;
        let mut logged = false;
        loop {
            let got =
                scalar(&mut conn, "SELECT pg_try_advisory_lock(?1)", vals![key], "lock_artifact")?.flatten() == Some(1);
            if got {
                return Ok(ArtifactLock { conn: Some(conn), key });
            }
            if std::time::Instant::now() >= deadline {
                return Err(StoreError::LockTimeout { what: format!("{} {id}", kind.as_str()), secs: wait.as_secs() });
            }
            if !logged {
                tracing::info!(kind = kind.as_str(), id, "another node is building it; waiting");
                logged = true;
            }
            std::thread::sleep(Duration::from_millis(100));
        }
    }

    /// Checkpoints no live session needs, by id: not owned by a live session,
    /// not a live session's head, and not an ancestor of either. The set is
    /// closed under descendants, so it can be passed to
    /// [`Store::delete_checkpoints`] as is.
    pub fn unreferenced_checkpoints(&self) -> Result<Vec<CheckpointRecord>, StoreError> {
        unreferenced(&mut self.conn())
    }

    /// [`Store::unreferenced_checkpoints`] and [`Store::delete_checkpoints`] in
    /// one transaction, so a concurrent fork cannot resurrect a checkpoint in
    /// between. Returns what was deleted; remove the files afterwards.
    pub fn delete_unreferenced_checkpoints(&self) -> Result<Vec<CheckpointRecord>, StoreError> {
        let mut conn = self.conn();
        let mut tx = conn.begin().op("delete_unreferenced_checkpoints: begin")?;
        let v = unreferenced(&mut tx)?;
        let ids: Vec<i64> = v.iter().map(|c| c.id).collect();
        delete_ids(&mut tx, &ids)?;
        tx.commit().op("delete_unreferenced_checkpoints: commit")?;
        Ok(v)
    }

    /// Deletes the checkpoints `ids` (absent ids are ignored), all or none.
    /// Refused with [`StoreError::InUse`] if one is a live session's head, and
    /// with [`StoreError::HasChildren`] if one is the parent of a checkpoint
    /// not in `ids`. Nothing cascades.
    pub fn delete_checkpoints(&self, ids: &[i64]) -> Result<(), StoreError> {
        if ids.is_empty() {
            return Ok(());
        }
        let mut conn = self.conn();
        let mut tx = conn.begin().op("delete_checkpoints: begin")?;
        let op = "delete_checkpoints: check heads";
        let in_use = tx.query_opt("SELECT id, head FROM sessions WHERE head IN_LIST(?1) LIMIT 1", vals![ids]).op(op)?;
        if let Some(r) = in_use {
            return Err(StoreError::InUse { id: r.i64(1).op(op)?, session: r.text(0).op(op)? });
        }
        let op = "delete_checkpoints: check children";
        let child = tx
            .query_opt(
                "SELECT parent, id FROM checkpoints WHERE parent IN_LIST(?1) AND id NOT_IN_LIST(?1) LIMIT 1",
                vals![ids],
            )
            .op(op)?;
        if let Some(r) = child {
            return Err(StoreError::HasChildren { id: r.i64(0).op(op)?, child: r.i64(1).op(op)? });
        }
        delete_ids(&mut tx, ids)?;
        tx.commit().op("delete_checkpoints: commit")
    }

    /// Every checkpoint, by id.
    pub fn all_checkpoints(&self) -> Result<Vec<CheckpointRecord>, StoreError> {
        let sql = format!("SELECT {CP_COLS} FROM checkpoints c ORDER BY c.id");
        checkpoints(&mut self.conn(), &sql, &[], "all_checkpoints")
    }

    /// Start-up recovery for checkpoints whose files are missing or corrupt:
    /// deletes `ids` **and all their descendants** (their layers are deltas
    /// over a dropped one), after moving the head of every session that
    /// pointed into that set to the nearest surviving ancestor (or `None` =
    /// the template). One transaction. Returns what was deleted and moved.
    pub fn drop_checkpoints_and_rewind(&self, ids: &[i64]) -> Result<Rewind, StoreError> {
        if ids.is_empty() {
            return Ok(Rewind::default());
        }
        let mut conn = self.conn();
        let mut tx = conn.begin().op("drop_checkpoints_and_rewind: begin")?;
        let sql = format!(
            "WITH RECURSIVE doomed(id) AS ( \
                SELECT c.id FROM checkpoints c WHERE c.id IN_LIST(?1) \
                UNION \
                SELECT c.id FROM checkpoints c JOIN doomed d ON c.parent = d.id \
             ) \
             SELECT {CP_COLS} FROM checkpoints c WHERE c.id IN (SELECT id FROM doomed) ORDER BY c.id"
        );
        let deleted = checkpoints(&mut tx, &sql, vals![ids], "drop_checkpoints_and_rewind: descendants")?;
        let doomed: Vec<i64> = deleted.iter().map(|c| c.id).collect();
        let op = "drop_checkpoints_and_rewind: affected sessions";
        let heads = tx
            .query("SELECT id, head FROM sessions WHERE head IN_LIST(?1) ORDER BY sid", vals![&doomed[..]])
            .op(op)?
            .iter()
            .map(|r| Ok((r.text(0)?, r.i64(1)?)))
            .collect::<Result<Vec<(String, i64)>, DbError>>()
            .op(op)?;
        let mut moved = Vec::with_capacity(heads.len());
        for (session, from) in heads {
            let to = scalar(
                &mut tx,
                "WITH RECURSIVE up(id, depth) AS ( \
                    SELECT CAST(?1 AS BIGINT), 0 \
                    UNION ALL \
                    SELECT c.parent, up.depth + 1 FROM checkpoints c JOIN up ON c.id = up.id \
                    WHERE c.parent IS NOT NULL \
                 ) \
                 SELECT id FROM up WHERE id NOT_IN_LIST(?2) ORDER BY depth LIMIT 1",
                vals![from, &doomed[..]],
                "drop_checkpoints_and_rewind: nearest survivor",
            )?
            .flatten();
            tx.execute("UPDATE sessions SET head = ?2 WHERE id = ?1", vals![&session, to])
                .op("drop_checkpoints_and_rewind: move head")?;
            moved.push(HeadMove { session, from, to });
        }
        delete_ids(&mut tx, &doomed)?;
        tx.commit().op("drop_checkpoints_and_rewind: commit")?;
        Ok(Rewind { deleted, moved })
    }

    /// Sum of `bytes` and `output_bytes` of the checkpoints the (live) session
    /// created (0 for an unknown session). Flat (compacted) layers are not counted.
    pub fn disk_bytes(&self, session: &str) -> Result<u64, StoreError> {
        let n = scalar(
            &mut self.conn(),
            "SELECT CAST(COALESCE(SUM(c.bytes + c.output_bytes), 0) AS BIGINT) FROM checkpoints c \
             JOIN sessions s ON c.owner = s.sid WHERE s.id = ?1",
            vals![session],
            "disk_bytes",
        )?;
        Ok(n.flatten().unwrap_or(0).max(0) as u64)
    }

    /// Sum of `bytes` and `output_bytes` of the checkpoints owned by the
    /// tenant's live sessions (what a per-tenant disk quota counts; flat layers
    /// are not counted).
    pub fn tenant_disk_bytes(&self, tenant: &str) -> Result<u64, StoreError> {
        let n = scalar(
            &mut self.conn(),
            "SELECT CAST(COALESCE(SUM(c.bytes + c.output_bytes), 0) AS BIGINT) FROM checkpoints c \
             JOIN sessions s ON c.owner = s.sid WHERE s.tenant = ?1",
            vals![tenant],
            "tenant_disk_bytes",
        )?;
        Ok(n.flatten().unwrap_or(0).max(0) as u64)
    }
}

fn migrate_sqlite(conn: &mut rusqlite::Connection) -> Result<(), StoreError> {
    let supported = MIGRATIONS.len() as i64;
    loop {
        let tx = conn.transaction_with_behavior(rusqlite::TransactionBehavior::Immediate).op("migrate: begin")?;
        let version: i64 = tx.query_row("PRAGMA user_version", [], |r| r.get(0)).op("migrate: PRAGMA user_version")?;
        if version > supported {
            return Err(StoreError::SchemaTooNew { found: version, supported });
        }
        if version == supported {
            return Ok(()); // dropping tx rolls back the (empty) transaction
        }
        tx.execute_batch(MIGRATIONS[version as usize]).op("migrate: apply step")?;
        tx.pragma_update(None, "user_version", version + 1).op("migrate: set user_version")?;
        tx.commit().op("migrate: commit")?;
    }
}

/// All pending steps in one transaction (PostgreSQL's DDL is transactional),
/// which holds the writers' lock, so nodes starting at once migrate once.
pub(crate) fn migrate_postgres(conn: &mut Conn) -> Result<(), StoreError> {
    let supported = PG_MIGRATIONS.len() as i64;
    let mut tx = conn.begin().op("migrate: begin")?;
    tx.batch("CREATE TABLE IF NOT EXISTS forkbox_schema (version BIGINT NOT NULL)").op("migrate: version table")?;
    let version = match scalar(&mut tx, "SELECT version FROM forkbox_schema", &[], "migrate: version")?.flatten() {
        Some(v) => v,
        None => {
            tx.execute("INSERT INTO forkbox_schema (version) VALUES (0)", &[]).op("migrate: version row")?;
            0
        }
    };
    if version > supported {
        return Err(StoreError::SchemaTooNew { found: version, supported });
    }
    for step in &PG_MIGRATIONS[version as usize..] {
        tx.batch(step).op("migrate: apply step")?;
    }
    tx.execute("UPDATE forkbox_schema SET version = ?1", vals![supported]).op("migrate: set version")?;
    tx.commit().op("migrate: commit")
}

fn claim_node(conn: &mut Conn) -> Result<(), StoreError> {
    let got = scalar(conn, "SELECT pg_try_advisory_lock(?1)", vals![NODE_LOCK], "claim the database")?.flatten();
    if got != Some(1) {
        return Err(StoreError::Claimed);
    }
    Ok(())
}

/// A held [`Store::lock_artifact`]: unlocked (and its connection closed) when dropped.
pub struct ArtifactLock {
    conn: Option<Conn>,
    key: i64,
}

impl Drop for ArtifactLock {
    fn drop(&mut self) {
        if let Some(conn) = self.conn.as_mut() {
            // Closing the connection releases it too, should this fail.
            let _ = conn.execute("SELECT pg_advisory_unlock(?1)", vals![self.key]);
        }
    }
}

/// The advisory-lock key of an artifact: 64 bits of SHA-256 of its kind and id.
fn artifact_lock_key(kind: ArtifactKind, id: &str) -> i64 {
    use sha2::{Digest, Sha256};
    let mut h = Sha256::new();
    h.update(b"forkbox artifact\0");
    h.update(kind.as_str().as_bytes());
    h.update(b"\0");
    h.update(id.as_bytes());
    let d = h.finalize();
    i64::from_le_bytes([d[0], d[1], d[2], d[3], d[4], d[5], d[6], d[7]])
}

fn artifact_row(row: &Row) -> Result<Artifact, DbError> {
    let kind = row.text(0)?;
    Ok(Artifact {
        kind: ArtifactKind::parse(&kind).ok_or(DbError::Type { col: 0, want: "an artifact kind", found: kind })?,
        id: row.text(1)?,
        sha256: row.text(2)?,
        bytes: row.u64(3)?,
        needs: row.opt_text(4)?,
        digest: row.opt_text(5)?,
    })
}

fn object_row(row: &Row) -> Result<StoredObject, DbError> {
    Ok(StoredObject { name: row.text(0)?, sha256: row.text(1)?, bytes: row.u64(2)? })
}

fn insert_objects(conn: &mut Conn, objects: &[StoredObject]) -> Result<(), StoreError> {
    for o in objects {
        conn.execute(
            "INSERT INTO objects (name, sha256, bytes) VALUES (?1, ?2, ?3) \
             ON CONFLICT (name) DO UPDATE SET sha256 = excluded.sha256, bytes = excluded.bytes",
            vals![&o.name, &o.sha256, to_i64("bytes", o.bytes)?],
        )
        .op("insert object")?;
    }
    Ok(())
}

/// Takes the next number of the session's lineage.
fn next_seq(conn: &mut Conn, session: &str) -> Result<i64, StoreError> {
    scalar(
        conn,
        "UPDATE lineages SET last_seq = last_seq + 1 \
         WHERE id = (SELECT lineage FROM sessions WHERE id = ?1) RETURNING last_seq",
        vals![session],
        "next seq",
    )?
    .flatten()
    .ok_or_else(|| StoreError::NoSuchSession(session.to_owned()))
}

fn checkpoint_exists(conn: &mut Conn, id: i64) -> Result<bool, StoreError> {
    conn.exists("SELECT 1 FROM checkpoints WHERE id = ?1", vals![id]).op("check checkpoint exists")
}

fn unreferenced(conn: &mut Conn) -> Result<Vec<CheckpointRecord>, StoreError> {
    let sql = format!(
        "WITH RECURSIVE keep(id) AS ( \
            SELECT c.id FROM checkpoints c WHERE c.owner IN (SELECT sid FROM sessions) \
            UNION \
            SELECT head FROM sessions WHERE head IS NOT NULL \
            UNION \
            SELECT c.parent FROM checkpoints c JOIN keep k ON c.id = k.id \
            WHERE c.parent IS NOT NULL \
         ) \
         SELECT {CP_COLS} FROM checkpoints c WHERE c.id NOT IN (SELECT id FROM keep) ORDER BY c.id"
    );
    checkpoints(conn, &sql, &[], "unreferenced_checkpoints")
}

/// Deletes `ids` children first (a child's id is always greater than its
/// parent's), so the immediate parent foreign key holds after every statement.
fn delete_ids(conn: &mut Conn, ids: &[i64]) -> Result<(), StoreError> {
    let mut sorted = ids.to_vec();
    sorted.sort_unstable_by(|a, b| b.cmp(a));
    sorted.dedup();
    for id in sorted {
        conn.execute("DELETE FROM checkpoints WHERE id = ?1", vals![id]).op("delete checkpoint")?;
    }
    Ok(())
}

/// Sessions matching `filter` (over alias `s`) with their tags, oldest first.
fn load_sessions(
    conn: &mut Conn,
    filter: &str,
    args: &[Value],
    op: &'static str,
) -> Result<Vec<SessionRecord>, StoreError> {
    let sql = format!(
        "SELECT {SESSION_COLS}, t.key, t.value FROM sessions s \
         LEFT JOIN session_tags t ON t.sid = s.sid \
         WHERE {filter} ORDER BY s.created_ms, s.sid, t.key"
    );
    let rows = conn.query(&sql, args).op(op)?;
    let mut out: Vec<SessionRecord> = Vec::new();
    let mut last_sid: Option<i64> = None;
    for row in &rows {
        let sid = row.i64(0).op(op)?;
        if last_sid != Some(sid) {
            last_sid = Some(sid);
            out.push(session_row(row).op(op)?);
        }
        if let (Some(key), Some(rec)) = (row.opt_text(12).op(op)?, out.last_mut()) {
            rec.tags.insert(key, row.text(13).op(op)?);
        }
    }
    Ok(out)
}

fn session_row(row: &Row) -> Result<SessionRecord, DbError> {
    Ok(SessionRecord {
        id: row.text(1)?,
        tenant: row.text(2)?,
        template_id: row.text(3)?,
        tags: BTreeMap::new(),
        limits: Limits {
            memory_bytes: row.u64(4)?,
            timeout_ms: row.u64(5)?,
            output_bytes: row.u64(6)?,
            disk_bytes: row.u64(7)?,
            network: row.opt_text(11)?,
        },
        head: row.opt_i64(8)?,
        created_ms: row.i64(9)?,
        last_used_ms: row.i64(10)?,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use rusqlite::{params, Connection};
    use std::sync::Arc;
    use std::time::Instant;

    /// The tests marked `on_both_engines!` run once on each.
    #[derive(Clone, Copy)]
    enum Kind {
        Sqlite,
        Postgres,
    }

    /// A test database: a SQLite file in a temp dir, or a private PostgreSQL server.
    enum Db {
        Sqlite(tempfile::TempDir),
        Postgres(forkbox_testkit::postgres::Postgres),
    }

    impl Db {
        fn new(kind: Kind) -> Db {
            match kind {
                Kind::Sqlite => Db::Sqlite(tempfile::tempdir().unwrap()),
                Kind::Postgres => Db::Postgres(forkbox_testkit::postgres::Postgres::start()),
            }
        }

        /// Another `Store` on the same database (its own connection).
        fn open(&self) -> Store {
            match self {
                Db::Sqlite(d) => Store::open(&d.path().join("db").join("sessions.db")).unwrap(),
                Db::Postgres(pg) => Store::open_postgres(&pg.url()).unwrap(),
            }
        }
    }

    fn tmp_on(kind: Kind) -> (Db, Store) {
        let db = Db::new(kind);
        let store = db.open();
        (db, store)
    }

    fn tmp() -> (Db, Store) {
        tmp_on(Kind::Sqlite)
    }

    /// `f` on the SQLite connection under a store (for the SQLite-only tests).
    fn sqlite<T>(s: &Store, f: impl FnOnce(&mut Connection) -> T) -> T {
        match &mut *s.conn() {
            Conn::Sqlite(c) => f(c),
            Conn::Postgres(_) => panic!("not a SQLite store"),
        }
    }

    macro_rules! on_both_engines {
        ($($name:ident),* $(,)?) => {
            mod on_sqlite {
                $( #[test] fn $name() { super::$name(super::Kind::Sqlite) } )*
            }
            mod on_postgres {
                $( #[test] fn $name() { super::$name(super::Kind::Postgres) } )*
            }
        };
    }

    on_both_engines!(
        create_get_list_tags_tenants,
        commit_increments_seq_and_sets_head,
        ancestry_across_fork,
        revert_then_commit_branches,
        delete_source_of_fork_keeps_needed_checkpoints,
        unreferenced_and_delete_checkpoints,
        drop_checkpoints_and_rewind,
        reopen_persists,
        update_session_changes_tags_and_limits_of_the_tenants_session_only,
        concurrent_four_threads,
        tenant_disk_bytes_sums_the_tenants_live_sessions,
        objects_round_trip,
        leases_move_sessions_between_nodes_and_fence_commits,
        nodes_heartbeat_drain_and_are_forgotten,
        artifacts_are_published_once,
        template_records_are_added_once_replaced_and_deleted,
        call_outputs_are_kept_counted_and_deleted_with_their_checkpoint,
    );

    fn call_outputs_are_kept_counted_and_deleted_with_their_checkpoint(kind: Kind) {
        let (_d, s) = tmp_on(kind);
        s.create_session(&session("a", "t", 1, &[])).unwrap();
        let out = r#"{"v":1,"stdout":"hi\n"}"#;
        let c1 =
            s.commit_checkpoint(&NewCheckpoint { output: Some(out), ..new_checkpoint("a", None, "l1") }, 2).unwrap();
        let c2 = s.commit_checkpoint(&new_checkpoint("a", Some(c1.id), "l2"), 3).unwrap();
        assert_eq!((c1.output_bytes, c2.output_bytes), (out.len() as u64, 0));
        // Read back as committed; the light columns carry its size.
        assert_eq!(s.checkpoint(c1.id).unwrap().unwrap(), c1);
        assert_eq!(s.checkpoint_output(c1.id).unwrap().as_deref(), Some(out));
        assert_eq!(s.checkpoint_output(c2.id).unwrap(), None);
        assert_eq!(s.checkpoint_output(9999).unwrap(), None);
        assert_eq!(s.checkpoint_outputs(&[c1.id, c2.id, 9999]).unwrap(), vec![(c1.id, out.to_string())]);
        // Charged to the session and its tenant with the checkpoints' files.
        assert_eq!(s.disk_bytes("a").unwrap(), 2 + out.len() as u64);
        assert_eq!(s.tenant_disk_bytes("t").unwrap(), 2 + out.len() as u64);
        // Gone with the session's checkpoints.
        s.delete_session("t", "a").unwrap();
        s.delete_unreferenced_checkpoints().unwrap();
        assert_eq!(s.checkpoint_outputs(&[c1.id]).unwrap(), vec![]);
        assert_eq!(s.tenant_disk_bytes("t").unwrap(), 0);
    }

    /// Node `id`'s heartbeat `ms` older (as if it had stopped beating that long ago).
    fn age_node(s: &Store, id: &str, ms: i64) {
        s.conn().execute("UPDATE nodes SET heartbeat_ms = heartbeat_ms - ?2 WHERE id = ?1", vals![id, ms]).unwrap();
    }

    fn new_checkpoint<'a>(sid: &'a str, parent: Option<i64>, layer: &'a str) -> NewCheckpoint<'a> {
        NewCheckpoint {
            session_id: sid,
            parent,
            code: "c",
            layer,
            state: "st",
            pages: 1,
            bytes: 1,
            checksum: "0",
            output: None,
        }
    }

    fn leases_move_sessions_between_nodes_and_fence_commits(kind: Kind) {
        use crate::lease::{Acquired, Lease};
        let (db, a) = tmp_on(kind);
        let b = db.open();
        a.register_node("a", "http://a").unwrap();
        b.register_node("b", "http://b").unwrap();
        a.create_session(&session("s", "t", 1, &[])).unwrap();
        const LEASE: i64 = 10_000;
        // Nobody has it: a takes it (token 1); b sees a as its live owner.
        let Acquired::Mine(la) = a.acquire_lease("s", "a", LEASE).unwrap() else { panic!("a should get it") };
        assert_eq!(la, Lease { node: "a".into(), token: 1 });
        let owner = match b.acquire_lease("s", "b", LEASE).unwrap() {
            Acquired::Held(o) => o,
            other => panic!("{other:?}"),
        };
        assert_eq!((owner.node.as_str(), owner.url.as_str()), ("a", "http://a"));
        assert!(owner.expires_in_ms > 0 && owner.expires_in_ms <= LEASE, "{owner:?}");
        assert_eq!(b.session_owner("s", "b", LEASE).unwrap().map(|o| o.node), Some("a".into()));
        assert_eq!(a.session_owner("s", "a", LEASE).unwrap(), None, "its own node is not 'another'");
        assert!(matches!(b.acquire_lease("nope", "b", LEASE), Err(StoreError::NoSuchSession(_))));
        // a commits under its lease.
        let c1 = a.commit_checkpoint_fenced(&new_checkpoint("s", None, "l1"), None, None, 2, &[], Some(&la)).unwrap();
        assert!(a.lease_holds("s", &la).unwrap());
        // a stops heartbeating for longer than the lease: b takes the session (token 2).
        age_node(&a, "a", LEASE + 1);
        assert_eq!(b.session_owner("s", "b", LEASE).unwrap(), None);
        let Acquired::Mine(lb) = b.acquire_lease("s", "b", LEASE).unwrap() else { panic!("b should take it") };
        assert_eq!(lb.token, 2);
        assert!(!a.lease_holds("s", &la).unwrap());
        // a's late commit is refused by the fencing token; nothing of it is written.
        let late = a.commit_checkpoint_fenced(&new_checkpoint("s", Some(c1.id), "late"), None, None, 3, &[], Some(&la));
        assert!(matches!(late, Err(StoreError::LeaseLost(ref id)) if id == "s"), "{late:?}");
        assert_eq!(a.session_checkpoints("s").unwrap().len(), 1);
        assert_eq!(a.session("t", "s").unwrap().unwrap().head, Some(c1.id));
        let c2 =
            b.commit_checkpoint_fenced(&new_checkpoint("s", Some(c1.id), "l2"), None, None, 4, &[], Some(&lb)).unwrap();
        assert_eq!(c2.seq, 2);
        // a comes back: b's lease is fresh, so a must forward.
        a.heartbeat("a").unwrap();
        assert!(matches!(a.acquire_lease("s", "a", LEASE).unwrap(), Acquired::Held(o) if o.node == "b"));
        // b gives it back (evicted); a stale lease cannot release it again.
        assert!(!b.release_lease("s", &la).unwrap());
        assert!(b.release_lease("s", &lb).unwrap());
        assert_eq!(a.owned_sessions("b").unwrap(), Vec::<String>::new());
        let Acquired::Mine(la2) = a.acquire_lease("s", "a", LEASE).unwrap() else { panic!("free again") };
        assert_eq!(la2.token, 3, "every acquisition bumps the token");
        assert_eq!(a.owned_sessions("a").unwrap(), ["s"]);
        // A node that starts again holds nothing.
        a.register_node("a", "http://a2").unwrap();
        assert!(a.owned_sessions("a").unwrap().is_empty());
        assert!(!a.lease_holds("s", &la2).unwrap());
        // Two nodes racing for a free session: exactly one wins, the other sees it as the owner.
        std::thread::scope(|sc| {
            let ra = sc.spawn(|| a.acquire_lease("s", "a", LEASE).unwrap());
            let rb = sc.spawn(|| b.acquire_lease("s", "b", LEASE).unwrap());
            let (ra, rb) = (ra.join().unwrap(), rb.join().unwrap());
            match (&ra, &rb) {
                (Acquired::Mine(l), Acquired::Held(o)) => assert_eq!((l.node.as_str(), o.node.as_str()), ("a", "a")),
                (Acquired::Held(o), Acquired::Mine(l)) => assert_eq!((l.node.as_str(), o.node.as_str()), ("b", "b")),
                other => panic!("both or neither won: {other:?}"),
            }
        });
        // A commit without a fence (a single node) is not checked.
        a.commit_checkpoint_fenced(&new_checkpoint("s", Some(c2.id), "l3"), None, None, 5, &[], None).unwrap();
    }

    fn nodes_heartbeat_drain_and_are_forgotten(kind: Kind) {
        use crate::lease::NodeState;
        let (_db, s) = tmp_on(kind);
        // The database's clock: NOW_MS() is the Unix time.
        let now = scalar(&mut s.conn(), "SELECT NOW_MS()", &[], "now").unwrap().flatten().unwrap();
        assert!((now - crate::manager::now_ms()).abs() < 2_000, "{now}");
        assert_eq!(s.heartbeat("a").unwrap(), None, "not registered");
        s.register_node("a", "http://a").unwrap();
        s.register_node("b", "http://b").unwrap();
        assert_eq!(s.heartbeat("a").unwrap(), Some(NodeState::Active));
        assert!(s.set_node_state("a", NodeState::Draining).unwrap());
        assert!(!s.set_node_state("zz", NodeState::Draining).unwrap());
        assert_eq!(s.heartbeat("a").unwrap(), Some(NodeState::Draining));
        s.create_session(&session("s", "t", 1, &[])).unwrap();
        s.acquire_lease("s", "b", 10_000).unwrap();
        let nodes = s.nodes().unwrap();
        assert_eq!(
            nodes.iter().map(|n| (n.id.as_str(), n.state, n.sessions)).collect::<Vec<_>>(),
            [("a", NodeState::Draining, 0), ("b", NodeState::Active, 1)]
        );
        assert!(nodes.iter().all(|n| (0..5_000).contains(&n.heartbeat_age_ms)), "{nodes:?}");
        // Registering again makes a node active.
        s.register_node("a", "http://a").unwrap();
        assert_eq!(s.heartbeat("a").unwrap(), Some(NodeState::Active));
        // Long-dead nodes are forgotten unless they still own a session.
        age_node(&s, "a", 100_000);
        age_node(&s, "b", 100_000);
        assert_eq!(s.forget_nodes(50_000).unwrap(), 1);
        assert_eq!(s.nodes().unwrap().into_iter().map(|n| n.id).collect::<Vec<_>>(), ["b"]);
    }

    fn session(id: &str, tenant: &str, created: i64, tags: &[(&str, &str)]) -> SessionRecord {
        SessionRecord {
            id: id.into(),
            tenant: tenant.into(),
            template_id: "python".into(),
            tags: tags.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect(),
            limits: Limits {
                memory_bytes: 256 << 20,
                timeout_ms: 30_000,
                output_bytes: 1 << 20,
                disk_bytes: 1 << 30,
                network: Some(r#"{"layers":[{"mode":"public"}],"max_sockets":128,"max_bytes":1073741824}"#.into()),
            },
            head: None,
            created_ms: created,
            last_used_ms: created,
        }
    }

    /// Commits a checkpoint over the session's current head.
    fn exec(store: &Store, sid: &str, code: &str, now: i64) -> CheckpointRecord {
        let head = store.all_sessions().unwrap().into_iter().find(|s| s.id == sid).unwrap().head;
        let layer = format!("{sid}-{now}.layer");
        store
            .commit_checkpoint(
                &NewCheckpoint {
                    session_id: sid,
                    parent: head,
                    code,
                    layer: &layer,
                    state: "state",
                    pages: 10,
                    bytes: 40960,
                    checksum: "abcd",
                    output: None,
                },
                now,
            )
            .unwrap()
    }

    fn ids(v: &[CheckpointRecord]) -> Vec<i64> {
        v.iter().map(|c| c.id).collect()
    }

    fn tags(v: &[(&str, &str)]) -> Vec<(String, String)> {
        v.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect()
    }

    #[test]
    fn store_is_send_sync() {
        fn f<T: Send + Sync>() {}
        f::<Store>();
    }

    fn create_get_list_tags_tenants(kind: Kind) {
        let (_d, s) = tmp_on(kind);
        s.create_session(&session("a", "local", 3, &[("env", "dev"), ("team", "x")])).unwrap();
        s.create_session(&session("b", "local", 1, &[("env", "prod"), ("team", "x")])).unwrap();
        s.create_session(&session("c", "local", 2, &[])).unwrap();
        s.create_session(&session("d", "other", 0, &[("env", "dev")])).unwrap();

        let a = s.session("local", "a").unwrap().unwrap();
        assert_eq!(a, session("a", "local", 3, &[("env", "dev"), ("team", "x")]));
        assert_eq!(s.session("other", "a").unwrap(), None);
        assert_eq!(s.session("local", "d").unwrap(), None);
        assert!(s.session("other", "d").unwrap().is_some());

        let names = |v: Vec<SessionRecord>| v.into_iter().map(|s| s.id).collect::<Vec<_>>();
        assert_eq!(names(s.list_sessions("local", &[]).unwrap()), ["b", "c", "a"]);
        assert_eq!(names(s.list_sessions("local", &tags(&[("team", "x")])).unwrap()), ["b", "a"]);
        assert_eq!(names(s.list_sessions("local", &tags(&[("team", "x"), ("env", "dev")])).unwrap()), ["a"]);
        assert_eq!(
            names(s.list_sessions("local", &tags(&[("env", "dev"), ("env", "prod")])).unwrap()),
            Vec::<String>::new()
        );
        assert_eq!(names(s.list_sessions("other", &tags(&[("env", "dev")])).unwrap()), ["d"]);
        assert_eq!(names(s.list_sessions("nobody", &[]).unwrap()), Vec::<String>::new());
        // Tags come back complete even when filtering on one of them.
        let listed = s.list_sessions("local", &tags(&[("env", "dev")])).unwrap();
        assert_eq!(listed[0].tags.len(), 2);

        assert_eq!(s.count_sessions(None).unwrap(), 4);
        assert_eq!(s.count_sessions(Some("local")).unwrap(), 3);
        assert_eq!(s.count_sessions(Some("other")).unwrap(), 1);

        // Ids are unique across tenants.
        assert!(matches!(
            s.create_session(&session("a", "other", 9, &[])),
            Err(StoreError::Exists(id)) if id == "a"
        ));
        // A head that does not exist.
        let mut e = session("e", "local", 9, &[]);
        e.head = Some(42);
        assert!(matches!(s.create_session(&e), Err(StoreError::NoSuchCheckpoint(42))));
        // Out-of-range limits.
        let mut f = session("f", "local", 9, &[]);
        f.limits.timeout_ms = u64::MAX;
        assert!(matches!(s.create_session(&f), Err(StoreError::TooLarge { field: "timeout_ms", .. })));
        assert_eq!(s.count_sessions(None).unwrap(), 4);

        s.touch("a", 100).unwrap();
        assert_eq!(s.session("local", "a").unwrap().unwrap().last_used_ms, 100);
        assert!(matches!(s.touch("zz", 1), Err(StoreError::NoSuchSession(_))));

        // Deleting is tenant-scoped and removes tags.
        assert!(!s.delete_session("other", "a").unwrap());
        assert!(s.delete_session("local", "a").unwrap());
        assert!(!s.delete_session("local", "a").unwrap());
        assert_eq!(names(s.list_sessions("local", &tags(&[("env", "dev")])).unwrap()), Vec::<String>::new());
        let n = s.conn().query("SELECT COUNT(*) FROM session_tags", &[]).unwrap()[0].i64(0).unwrap();
        assert_eq!(n, 3);
    }

    fn commit_increments_seq_and_sets_head(kind: Kind) {
        let (_d, s) = tmp_on(kind);
        s.create_session(&session("a", "local", 1, &[])).unwrap();
        let c1 = exec(&s, "a", "x = 1", 10);
        let c2 = exec(&s, "a", "x += 1", 20);
        let c3 = exec(&s, "a", "import os", 30);
        assert_eq!((c1.seq, c2.seq, c3.seq), (1, 2, 3));
        assert_eq!((c1.parent, c2.parent, c3.parent), (None, Some(c1.id), Some(c2.id)));
        assert_eq!(c3.created_ms, 30);
        let a = s.session("local", "a").unwrap().unwrap();
        assert_eq!(a.head, Some(c3.id));
        assert_eq!(a.last_used_ms, 30);
        assert_eq!(s.checkpoint(c2.id).unwrap().unwrap(), c2);
        assert_eq!(s.checkpoint(9999).unwrap(), None);
        assert_eq!(s.checkpoint_by_seq("a", 2).unwrap().unwrap(), c2);
        assert_eq!(s.checkpoint_by_seq("a", 4).unwrap(), None);
        assert_eq!(s.session_checkpoints("a").unwrap(), vec![c1.clone(), c2.clone(), c3.clone()]);
        assert_eq!(s.disk_bytes("a").unwrap(), 3 * 40960);
        assert_eq!(s.disk_bytes("nope").unwrap(), 0);

        s.set_flat(c3.id, Some("flat-3")).unwrap();
        assert_eq!(s.checkpoint(c3.id).unwrap().unwrap().flat.as_deref(), Some("flat-3"));
        s.set_flat(c3.id, None).unwrap();
        assert_eq!(s.checkpoint(c3.id).unwrap().unwrap().flat, None);
        assert!(matches!(s.set_flat(9999, None), Err(StoreError::NoSuchCheckpoint(9999))));

        let bad = NewCheckpoint {
            session_id: "nope",
            parent: None,
            code: "",
            layer: "l",
            state: "s",
            pages: 0,
            bytes: 0,
            checksum: "",
            output: None,
        };
        assert!(matches!(s.commit_checkpoint(&bad, 1), Err(StoreError::NoSuchSession(_))));
        let bad = NewCheckpoint { session_id: "a", parent: Some(9999), ..bad };
        assert!(matches!(s.commit_checkpoint(&bad, 1), Err(StoreError::NoSuchCheckpoint(9999))));
        // Failed commits left nothing behind.
        assert_eq!(s.all_checkpoints().unwrap().len(), 3);
        assert_eq!(s.session("local", "a").unwrap().unwrap().head, Some(c3.id));
    }

    fn ancestry_across_fork(kind: Kind) {
        let (_d, s) = tmp_on(kind);
        s.create_session(&session("a", "local", 1, &[])).unwrap();
        let a1 = exec(&s, "a", "a1", 10);
        let a2 = exec(&s, "a", "a2", 20);
        let a3 = exec(&s, "a", "a3", 30);
        // Fork A's checkpoint 2 into B.
        let fork = s.checkpoint_by_seq("a", 2).unwrap().unwrap();
        let mut b = session("b", "local", 40, &[]);
        b.head = Some(fork.id);
        s.create_session(&b).unwrap();
        let b1 = exec(&s, "b", "b1", 50);
        let b2 = exec(&s, "b", "b2", 60);
        // A fork continues its lineage's numbering: A had 1-3.
        assert_eq!((b1.seq, b1.parent, b1.session_id.as_str()), (4, Some(a2.id), "b"));
        assert_eq!(b2.seq, 5);
        // B reaches its own checkpoints and the ones of its lineage by number.
        assert_eq!(s.checkpoint_by_seq("b", 2).unwrap().unwrap().id, a2.id);
        assert_eq!(s.checkpoint_by_seq("b", 5).unwrap().unwrap().id, b2.id);
        assert_eq!(s.checkpoint_by_seq("a", 5).unwrap().unwrap().id, b2.id);
        // A new exec in A takes the next number of the lineage.
        let a4 = exec(&s, "a", "a4", 70);
        assert_eq!(a4.seq, 6);
        // One tree: every checkpoint of the lineage, both sessions with heads and origins.
        let t = s.lineage_tree("local", "b").unwrap().unwrap();
        assert_eq!(t.checkpoints.iter().map(|c| c.seq).collect::<Vec<_>>(), [1, 2, 3, 4, 5, 6]);
        let origins: Vec<_> = t.sessions.iter().map(|x| (x.id.as_str(), x.origin)).collect();
        assert_eq!(origins, [("a", None), ("b", Some(a2.id))]);
        assert_eq!(s.lineage_tree("other", "b").unwrap(), None);
        // A session of its own starts a lineage of its own.
        s.create_session(&session("c", "local", 80, &[])).unwrap();
        assert_eq!(exec(&s, "c", "c1", 90).seq, 1);
        assert_eq!(s.checkpoint_by_seq("c", 2).unwrap(), None);
        // A reserved number is given back only while it is the lineage's last.
        assert_eq!(s.reserve_seq("c").unwrap(), 2);
        assert!(s.release_seq("c", 2).unwrap());
        assert_eq!(s.reserve_seq("c").unwrap(), 2);
        assert_eq!(s.reserve_seq("c").unwrap(), 3);
        assert!(!s.release_seq("c", 2).unwrap());
        assert_eq!(exec(&s, "c", "c4", 95).seq, 4);
        assert_eq!(ids(&s.ancestry(b2.id).unwrap()), [a1.id, a2.id, b1.id, b2.id]);
        assert_eq!(ids(&s.ancestry(a3.id).unwrap()), [a1.id, a2.id, a3.id]);
        assert_eq!(ids(&s.ancestry(a1.id).unwrap()), [a1.id]);
        assert!(matches!(s.ancestry(9999), Err(StoreError::NoSuchCheckpoint(9999))));
        assert_eq!(ids(&s.session_checkpoints("b").unwrap()), [b1.id, b2.id]);
        assert_eq!(ids(&s.session_checkpoints("a").unwrap()), [a1.id, a2.id, a3.id, a4.id]);
        assert_eq!(s.disk_bytes("b").unwrap(), 2 * 40960);
    }

    fn revert_then_commit_branches(kind: Kind) {
        let (_d, s) = tmp_on(kind);
        s.create_session(&session("a", "local", 1, &[])).unwrap();
        let c: Vec<_> = (1..=6).map(|i| exec(&s, "a", &format!("c{i}"), i * 10)).collect();
        s.set_head("a", Some(c[2].id)).unwrap();
        assert_eq!(s.session("local", "a").unwrap().unwrap().head, Some(c[2].id));
        let c7 = exec(&s, "a", "c7", 70);
        assert_eq!((c7.seq, c7.parent), (7, Some(c[2].id)));
        assert_eq!(ids(&s.ancestry(c7.id).unwrap()), [c[0].id, c[1].id, c[2].id, c7.id]);
        assert_eq!(s.session_checkpoints("a").unwrap().len(), 7);
        // Revert to the template.
        s.set_head("a", None).unwrap();
        let c8 = exec(&s, "a", "c8", 80);
        assert_eq!((c8.seq, c8.parent), (8, None));
        assert!(matches!(s.set_head("a", Some(9999)), Err(StoreError::NoSuchCheckpoint(9999))));
        assert!(matches!(s.set_head("zz", Some(c7.id)), Err(StoreError::NoSuchSession(_))));
        assert!(matches!(s.set_head("zz", None), Err(StoreError::NoSuchSession(_))));
        assert_eq!(s.session("local", "a").unwrap().unwrap().head, Some(c8.id));
    }

    fn delete_source_of_fork_keeps_needed_checkpoints(kind: Kind) {
        let (_d, s) = tmp_on(kind);
        s.create_session(&session("a", "local", 1, &[])).unwrap();
        let a1 = exec(&s, "a", "a1", 10);
        let a2 = exec(&s, "a", "a2", 20);
        let a3 = exec(&s, "a", "a3", 30);
        let a4 = exec(&s, "a", "a4", 40);
        let mut b = session("b", "local", 50, &[]);
        b.head = Some(a2.id);
        s.create_session(&b).unwrap();
        // B has not exec'd yet: its head is A's checkpoint.
        assert!(s.unreferenced_checkpoints().unwrap().is_empty());
        assert!(s.delete_session("local", "a").unwrap());
        // a1, a2 are B's ancestry; a3, a4 nobody needs.
        assert_eq!(ids(&s.unreferenced_checkpoints().unwrap()), [a3.id, a4.id]);
        let b1 = exec(&s, "b", "b1", 60);
        assert_eq!(b1.parent, Some(a2.id));
        assert_eq!(ids(&s.unreferenced_checkpoints().unwrap()), [a3.id, a4.id]);
        // Checkpoints survive their owner; the record keeps its name.
        assert_eq!(s.checkpoint(a2.id).unwrap().unwrap().session_id, "a");
        assert_eq!(ids(&s.ancestry(b1.id).unwrap()), [a1.id, a2.id, b1.id]);
        // A new session reusing the name does not inherit old checkpoints.
        s.create_session(&session("a", "local", 70, &[])).unwrap();
        assert!(s.session_checkpoints("a").unwrap().is_empty());
        assert_eq!(s.disk_bytes("a").unwrap(), 0);
        let n1 = exec(&s, "a", "new", 80);
        assert_eq!((n1.seq, n1.parent), (1, None));
        assert_eq!(s.checkpoint_by_seq("a", 1).unwrap().unwrap().id, n1.id);
        assert_eq!(ids(&s.unreferenced_checkpoints().unwrap()), [a3.id, a4.id]);

        let gone = s.delete_unreferenced_checkpoints().unwrap();
        assert_eq!(ids(&gone), [a3.id, a4.id]);
        assert!(s.unreferenced_checkpoints().unwrap().is_empty());
        // Deleting B now frees a1, a2 and b1.
        assert!(s.delete_session("local", "b").unwrap());
        assert_eq!(ids(&s.unreferenced_checkpoints().unwrap()), [a1.id, a2.id, b1.id]);
    }

    fn unreferenced_and_delete_checkpoints(kind: Kind) {
        let (_d, s) = tmp_on(kind);
        s.create_session(&session("a", "local", 1, &[])).unwrap();
        let a1 = exec(&s, "a", "a1", 10);
        let a2 = exec(&s, "a", "a2", 20);
        s.create_session(&session("b", "local", 2, &[])).unwrap();
        let b1 = exec(&s, "b", "b1", 30);

        // Refusals: live head; children kept; both leave everything intact.
        assert!(matches!(
            s.delete_checkpoints(&[a2.id]),
            Err(StoreError::InUse { id, ref session }) if id == a2.id && session == "a"
        ));
        s.set_head("a", Some(a1.id)).unwrap();
        // a1 is the head now.
        assert!(matches!(s.delete_checkpoints(&[a1.id]), Err(StoreError::InUse { .. })));
        s.set_head("a", None).unwrap();
        assert!(matches!(
            s.delete_checkpoints(&[a1.id]),
            Err(StoreError::HasChildren { id, child }) if id == a1.id && child == a2.id
        ));
        assert_eq!(s.all_checkpoints().unwrap().len(), 3);
        // The foreign keys are the backstop even without the checks.
        let fk = s.conn().execute("DELETE FROM checkpoints WHERE id = ?1", vals![a1.id]).unwrap_err();
        let fk = format!("{fk:?}").to_lowercase();
        assert!(fk.contains("foreign key"), "{fk}");

        // Parent and child together, given in either order.
        s.delete_checkpoints(&[a1.id, a2.id, 9999]).unwrap();
        assert_eq!(ids(&s.all_checkpoints().unwrap()), [b1.id]);
        s.delete_checkpoints(&[]).unwrap();

        // Unreferenced after the owner is gone; delete what GC reports.
        let b2 = exec(&s, "b", "b2", 40);
        let b3 = exec(&s, "b", "b3", 50);
        assert!(s.unreferenced_checkpoints().unwrap().is_empty());
        s.delete_session("local", "b").unwrap();
        let unref = s.unreferenced_checkpoints().unwrap();
        assert_eq!(ids(&unref), [b1.id, b2.id, b3.id]);
        s.delete_checkpoints(&ids(&unref)).unwrap();
        assert!(s.all_checkpoints().unwrap().is_empty());

        // Ids are never reused.
        let c = exec(&s, "a", "again", 60);
        assert!(c.id > b3.id);
    }

    fn drop_checkpoints_and_rewind(kind: Kind) {
        let (_d, s) = tmp_on(kind);
        s.create_session(&session("a", "local", 1, &[])).unwrap();
        let a1 = exec(&s, "a", "a1", 10);
        let a2 = exec(&s, "a", "a2", 20);
        let a3 = exec(&s, "a", "a3", 30);
        let a4 = exec(&s, "a", "a4", 40);
        // B forked from a2 and went on; C forked from a3; D sits on a1.
        let mut b = session("b", "local", 2, &[]);
        b.head = Some(a2.id);
        s.create_session(&b).unwrap();
        let b1 = exec(&s, "b", "b1", 50);
        let mut c = session("c", "local", 3, &[]);
        c.head = Some(a3.id);
        s.create_session(&c).unwrap();
        let mut d = session("d", "local", 4, &[]);
        d.head = Some(a1.id);
        s.create_session(&d).unwrap();

        // a2's files are corrupt: a2, a3, a4 (descendants) and b1 go.
        let r = s.drop_checkpoints_and_rewind(&[a2.id]).unwrap();
        assert_eq!(ids(&r.deleted), [a2.id, a3.id, a4.id, b1.id]);
        assert_eq!(
            r.moved,
            vec![
                HeadMove { session: "a".into(), from: a4.id, to: Some(a1.id) },
                HeadMove { session: "b".into(), from: b1.id, to: Some(a1.id) },
                HeadMove { session: "c".into(), from: a3.id, to: Some(a1.id) },
            ]
        );
        assert_eq!(ids(&s.all_checkpoints().unwrap()), [a1.id]);
        for id in ["a", "b", "c", "d"] {
            assert_eq!(s.session("local", id).unwrap().unwrap().head, Some(a1.id));
        }
        // Next exec continues after the rewind point; seq numbers are not reused
        // (the lineage's: b1 had 5).
        let a5 = exec(&s, "a", "a5", 60);
        assert_eq!((a5.seq, a5.parent), (6, Some(a1.id)));

        // Dropping the root rewinds to the template.
        let r = s.drop_checkpoints_and_rewind(&[a1.id, 9999]).unwrap();
        assert_eq!(ids(&r.deleted), [a1.id, a5.id]);
        assert_eq!(r.moved.len(), 4);
        assert!(r.moved.iter().all(|m| m.to.is_none()));
        assert!(s.all_checkpoints().unwrap().is_empty());
        assert!(s.all_sessions().unwrap().iter().all(|x| x.head.is_none()));
        assert_eq!(s.drop_checkpoints_and_rewind(&[]).unwrap(), Rewind::default());
    }

    fn reopen_persists(kind: Kind) {
        let db = Db::new(kind);
        let (c1, c2);
        {
            let s = db.open();
            s.create_session(&session("a", "local", 1, &[("k", "v")])).unwrap();
            c1 = exec(&s, "a", "x = 1", 10);
            c2 = exec(&s, "a", "y = 2", 20);
            s.set_flat(c2.id, Some("flat")).unwrap();
        }
        let s = db.open();
        let a = s.session("local", "a").unwrap().unwrap();
        assert_eq!(a.tags.get("k").map(String::as_str), Some("v"));
        assert_eq!(a.head, Some(c2.id));
        assert_eq!(a.last_used_ms, 20);
        let all = s.all_checkpoints().unwrap();
        assert_eq!(all[0], c1);
        assert_eq!(all[1].flat.as_deref(), Some("flat"));
        assert_eq!(exec(&s, "a", "z = 3", 30).seq, 3);
    }

    fn update_session_changes_tags_and_limits_of_the_tenants_session_only(kind: Kind) {
        let (d, s) = tmp_on(kind);
        s.create_session(&session("a", "local", 1, &[("env", "dev"), ("team", "x")])).unwrap();
        let before = s.session("local", "a").unwrap().unwrap();
        // Another tenant cannot touch it; an unknown id is false.
        assert!(!s.update_session("other", "a", None, Some(1), None).unwrap());
        assert!(!s.update_session("local", "zz", None, Some(1), None).unwrap());
        assert_eq!(s.session("local", "a").unwrap().unwrap(), before);
        // Limits only: the tags stay.
        assert!(s.update_session("local", "a", None, Some(256 << 20), Some(2500)).unwrap());
        let a = s.session("local", "a").unwrap().unwrap();
        assert_eq!(
            (a.limits.memory_bytes, a.limits.timeout_ms, a.tags.clone()),
            (256 << 20, 2500, before.tags.clone())
        );
        assert_eq!(
            (a.limits.output_bytes, a.limits.disk_bytes),
            (before.limits.output_bytes, before.limits.disk_bytes)
        );
        // Tags are replaced as a whole; the limits stay; the tag index follows.
        let tags: BTreeMap<String, String> = [("env".to_string(), "prod".to_string())].into();
        assert!(s.update_session("local", "a", Some(&tags), None, None).unwrap());
        let a = s.session("local", "a").unwrap().unwrap();
        assert_eq!((a.tags.clone(), a.limits.timeout_ms), (tags.clone(), 2500));
        assert!(s.list_sessions("local", &[("team".into(), "x".into())]).unwrap().is_empty());
        assert_eq!(s.list_sessions("local", &[("env".into(), "prod".into())]).unwrap().len(), 1);
        // Out of range for SQLite's integers: refused, nothing changed.
        assert!(matches!(s.update_session("local", "a", None, Some(u64::MAX), None), Err(StoreError::TooLarge { .. })));
        // Persisted: a reopened store sees it.
        drop(s);
        let s = d.open();
        assert_eq!(s.session("local", "a").unwrap().unwrap(), a);
    }

    #[test]
    fn migrations_idempotent() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("sessions.db");
        let s1 = Store::open(&path).unwrap();
        assert_eq!(s1.schema_version().unwrap(), MIGRATIONS.len() as i64);
        s1.create_session(&session("a", "local", 1, &[])).unwrap();
        // A second open while the first is still open, then a third after.
        let s2 = Store::open(&path).unwrap();
        assert_eq!(s2.schema_version().unwrap(), MIGRATIONS.len() as i64);
        assert_eq!(s2.count_sessions(None).unwrap(), 1);
        drop((s1, s2));
        let s3 = Store::open(&path).unwrap();
        assert_eq!(s3.count_sessions(None).unwrap(), 1);
        let mode: String = sqlite(&s3, |c| c.query_row("PRAGMA journal_mode", [], |r| r.get(0)).unwrap());
        assert_eq!(mode, "wal");
        // A database from a newer build is refused.
        sqlite(&s3, |c| c.pragma_update(None, "user_version", MIGRATIONS.len() as i64 + 1).unwrap());
        drop(s3);
        assert!(matches!(Store::open(&path), Err(StoreError::SchemaTooNew { .. })));
        // Full durability opens the same database.
        let f = Store::open_with(&dir.path().join("full.db"), Synchronous::Full).unwrap();
        let level: i64 = sqlite(&f, |c| c.query_row("PRAGMA synchronous", [], |r| r.get(0)).unwrap());
        assert_eq!(level, 2);
        f.create_session(&session("a", "local", 1, &[])).unwrap();
        exec(&f, "a", "x", 2);
        // In memory works too.
        let m = Store::open_in_memory().unwrap();
        assert_eq!(m.schema_version().unwrap(), MIGRATIONS.len() as i64);
    }

    #[test]
    fn migration_3_gives_old_sessions_a_lineage_each_and_keeps_their_numbers() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("sessions.db");
        {
            // A database at version 2 with a session (seq 1, 2) and an old fork of it (seq 1).
            let conn = Connection::open(&path).unwrap();
            conn.execute_batch(MIGRATIONS[0]).unwrap();
            conn.execute_batch(MIGRATIONS[1]).unwrap();
            conn.pragma_update(None, "user_version", 2).unwrap();
            conn.execute_batch(
                "INSERT INTO sessions (id, tenant, template_id, memory_bytes, timeout_ms, output_bytes, disk_bytes, \
                 created_ms, last_used_ms, last_seq) VALUES ('a', 't', 'p', 1, 1, 1, 1, 1, 1, 2), \
                 ('b', 't', 'p', 1, 1, 1, 1, 2, 2, 1), ('c', 't', 'p', 1, 1, 1, 1, 3, 3, 0); \
                 INSERT INTO checkpoints (owner, session_id, seq, parent, code, created_ms, layer, state, pages, bytes, checksum) \
                 VALUES (1, 'a', 1, NULL, 'x=1', 1, 'l1', 's1', 0, 0, ''), (1, 'a', 2, 1, 'x=2', 1, 'l2', 's2', 0, 0, ''), \
                 (2, 'b', 1, 1, 'y=1', 2, 'l3', 's3', 0, 0, ''); \
                 UPDATE sessions SET head = 2 WHERE id = 'a'; UPDATE sessions SET head = 3 WHERE id = 'b'; \
                 UPDATE sessions SET head = 2 WHERE id = 'c';",
            )
            .unwrap();
        }
        let s = Store::open(&path).unwrap();
        assert_eq!(s.schema_version().unwrap(), MIGRATIONS.len() as i64);
        // Old numbers stay where they were; each old session numbers on from its own.
        assert_eq!(s.checkpoint_by_seq("a", 2).unwrap().unwrap().code, "x=2");
        assert_eq!(s.checkpoint_by_seq("b", 1).unwrap().unwrap().code, "y=1");
        assert_eq!(exec(&s, "a", "x=3", 10).seq, 3);
        assert_eq!(exec(&s, "b", "y=2", 11).seq, 2);
        // c (an old fork that never ran) records where it came from.
        let t = s.lineage_tree("t", "c").unwrap().unwrap();
        assert_eq!(t.sessions.iter().map(|x| x.origin).collect::<Vec<_>>(), [Some(2)]);
        // A new fork of a's checkpoint joins a's lineage.
        let mut d = session("d", "t", 20, &[]);
        d.head = Some(2);
        s.create_session(&d).unwrap();
        assert_eq!(exec(&s, "d", "z", 21).seq, 4);
    }

    #[test]
    fn migration_4_adds_objects_and_keeps_checkpoints() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("sessions.db");
        {
            // A database at version 3 with a session at checkpoint 1 (no objects: local files only).
            let conn = Connection::open(&path).unwrap();
            for m in &MIGRATIONS[..3] {
                conn.execute_batch(m).unwrap();
            }
            conn.pragma_update(None, "user_version", 3).unwrap();
            conn.execute_batch(
                "INSERT INTO lineages (id, last_seq) VALUES (1, 1); \
                 INSERT INTO sessions (id, tenant, template_id, memory_bytes, timeout_ms, output_bytes, disk_bytes, \
                 created_ms, last_used_ms, last_seq, lineage) VALUES ('a', 't', 'p', 1, 1, 1, 1, 1, 1, 1, 1); \
                 INSERT INTO checkpoints (owner, session_id, seq, parent, code, created_ms, layer, state, pages, bytes, \
                 checksum, lineage) VALUES (1, 'a', 1, NULL, 'x=1', 1, 'l1', 's1', 0, 0, '', 1); \
                 UPDATE sessions SET head = 1 WHERE id = 'a';",
            )
            .unwrap();
        }
        let s = Store::open(&path).unwrap();
        assert_eq!(s.schema_version().unwrap(), MIGRATIONS.len() as i64, "migrated to the latest");
        assert_eq!(s.checkpoint_by_seq("a", 1).unwrap().unwrap().layer, "l1");
        assert!(s.all_objects().unwrap().is_empty());
        // A checkpoint commits with its objects; two files of one content share an object.
        let o = |n: &str, h: &str| StoredObject { name: n.into(), sha256: h.into(), bytes: 3 };
        let c = NewCheckpoint {
            session_id: "a",
            parent: Some(1),
            code: "x=2",
            layer: "l2",
            state: "s2",
            pages: 0,
            bytes: 6,
            checksum: "",
            output: None,
        };
        let c2 = s.commit_checkpoint_with(&c, None, None, 5, &[o("l2", "aa"), o("s2", "bb")]).unwrap();
        assert_eq!(c2.seq, 2);
        s.set_flat_with(c2.id, Some("f2"), Some(&o("f2", "aa"))).unwrap();
        assert_eq!(s.object("s2").unwrap(), Some(o("s2", "bb")));
        assert!(s.has_object("aa").unwrap() && !s.has_object("cc").unwrap());
        // Forgetting a file frees its object only once no other file has the same contents.
        assert_eq!(s.forget_objects(&["l2".into()]).unwrap(), Vec::<String>::new());
        assert_eq!(s.forget_objects(&["f2".into(), "s2".into(), "nope".into()]).unwrap(), ["aa", "bb"]);
        assert!(s.all_objects().unwrap().is_empty());
        // A failed commit records no objects.
        let bad = NewCheckpoint { session_id: "zz", ..c };
        assert!(s.commit_checkpoint_with(&bad, None, None, 6, &[o("l9", "dd")]).is_err());
        assert!(s.object("l9").unwrap().is_none());
    }

    #[test]
    fn performance_1000_sessions_5000_checkpoints() {
        let (_d, s) = tmp();
        let t = Instant::now();
        let mut heads = Vec::new();
        for i in 0..1000 {
            let id = format!("s{i:04}");
            let team = format!("t{}", i % 10);
            s.create_session(&session(&id, "local", i, &[("team", &team), ("n", &i.to_string())])).unwrap();
            heads.push(None::<i64>);
        }
        // 5,000 checkpoints: 5 per session, plus one session with a long chain.
        for round in 0..5 {
            for (i, head) in heads.iter_mut().enumerate() {
                let id = format!("s{i:04}");
                let c = s
                    .commit_checkpoint(
                        &NewCheckpoint {
                            session_id: &id,
                            parent: *head,
                            code: "x += 1",
                            layer: "l",
                            state: "s",
                            pages: 3,
                            bytes: 12288,
                            checksum: "00",
                            output: None,
                        },
                        10_000 + round,
                    )
                    .unwrap();
                *head = Some(c.id);
            }
        }
        let write = t.elapsed();
        let t = Instant::now();
        assert_eq!(s.list_sessions("local", &[]).unwrap().len(), 1000);
        assert_eq!(s.list_sessions("local", &tags(&[("team", "t3")])).unwrap().len(), 100);
        assert_eq!(s.list_sessions("local", &tags(&[("team", "t3"), ("n", "13")])).unwrap().len(), 1);
        assert_eq!(s.ancestry(heads[500].unwrap()).unwrap().len(), 5);
        assert_eq!(s.session_checkpoints("s0500").unwrap().len(), 5);
        assert!(s.unreferenced_checkpoints().unwrap().is_empty());
        for i in 0..500 {
            s.delete_session("local", &format!("s{i:04}")).unwrap();
        }
        assert_eq!(s.unreferenced_checkpoints().unwrap().len(), 2500);
        assert_eq!(s.delete_unreferenced_checkpoints().unwrap().len(), 2500);
        assert_eq!(s.all_checkpoints().unwrap().len(), 2500);
        let read = t.elapsed();
        eprintln!("perf: 1000 sessions + 5000 checkpoints written in {write:?}; queries + GC in {read:?}");
        assert!(write.as_secs_f64() < 10.0, "writes took {write:?}");
        assert!(read.as_secs_f64() < 5.0, "reads took {read:?}");

        // A long chain: ancestry of depth 2,000.
        let t = Instant::now();
        s.create_session(&session("deep", "local", 5000, &[])).unwrap();
        // Insert directly in one transaction (the fsync per commit is not the point here).
        let parent = sqlite(&s, |conn| {
            conn.execute_batch("BEGIN").unwrap();
            let sid: i64 = conn.query_row("SELECT sid FROM sessions WHERE id = 'deep'", [], |r| r.get(0)).unwrap();
            let mut parent: Option<i64> = None;
            for seq in 1..=2000 {
                conn.execute(
                    "INSERT INTO checkpoints (owner, session_id, seq, parent, code, created_ms, \
                     layer, state, pages, bytes, checksum) VALUES (?1, 'deep', ?2, ?3, '', 0, '', '', 0, 0, '')",
                    params![sid, seq, parent],
                )
                .unwrap();
                parent = Some(conn.last_insert_rowid());
            }
            conn.execute_batch("COMMIT").unwrap();
            parent
        });
        s.set_head("deep", parent).unwrap();
        let chain = s.ancestry(parent.unwrap()).unwrap();
        assert_eq!(chain.len(), 2000);
        assert_eq!(chain[0].parent, None);
        assert_eq!(chain[1999].id, parent.unwrap());
        let r = s.drop_checkpoints_and_rewind(&[chain[1000].id]).unwrap();
        assert_eq!(r.deleted.len(), 1000);
        assert_eq!(r.moved[0].to, Some(chain[999].id));
        eprintln!("perf: 2000-deep chain ancestry + rewind in {:?}", t.elapsed());
        assert!(t.elapsed().as_secs_f64() < 5.0);
    }

    fn concurrent_four_threads(kind: Kind) {
        let db = Db::new(kind);
        let shared = Arc::new(db.open());
        let mut handles = Vec::new();
        for t in 0..4 {
            // Two threads share one Store; two open their own connection.
            let store = if t < 2 { shared.clone() } else { Arc::new(db.open()) };
            handles.push(std::thread::spawn(move || {
                for i in 0..25 {
                    let id = format!("t{t}-{i}");
                    store.create_session(&session(&id, &format!("tenant{t}"), i, &[("t", &t.to_string())])).unwrap();
                    let mut head = None;
                    for n in 0..4 {
                        let c = store
                            .commit_checkpoint(
                                &NewCheckpoint {
                                    session_id: &id,
                                    parent: head,
                                    code: "pass",
                                    layer: "l",
                                    state: "s",
                                    pages: 1,
                                    bytes: 4096,
                                    checksum: "",
                                    output: None,
                                },
                                n,
                            )
                            .unwrap();
                        assert_eq!(c.seq, n + 1);
                        head = Some(c.id);
                    }
                    assert_eq!(store.ancestry(head.unwrap()).unwrap().len(), 4);
                    store.touch(&id, 99).unwrap();
                    if i % 5 == 0 {
                        assert!(store.delete_session(&format!("tenant{t}"), &id).unwrap());
                        store.delete_unreferenced_checkpoints().unwrap();
                    }
                    let _ = store.list_sessions(&format!("tenant{t}"), &[]).unwrap();
                }
            }));
        }
        for h in handles {
            h.join().unwrap();
        }
        assert_eq!(shared.count_sessions(None).unwrap(), 80);
        for t in 0..4 {
            assert_eq!(shared.count_sessions(Some(&format!("tenant{t}"))).unwrap(), 20);
        }
        assert!(shared.unreferenced_checkpoints().unwrap().is_empty());
        assert_eq!(shared.all_checkpoints().unwrap().len(), 80 * 4);
    }

    fn tenant_disk_bytes_sums_the_tenants_live_sessions(kind: Kind) {
        let (_d, s) = tmp_on(kind);
        s.create_session(&session("a", "t1", 1, &[])).unwrap();
        s.create_session(&session("b", "t1", 2, &[])).unwrap();
        s.create_session(&session("c", "t2", 3, &[])).unwrap();
        exec(&s, "a", "x = 1", 10);
        exec(&s, "a", "x = 2", 11);
        exec(&s, "b", "y = 1", 12);
        exec(&s, "c", "z = 1", 13);
        assert_eq!(s.tenant_disk_bytes("t1").unwrap(), 3 * 40960);
        assert_eq!(s.tenant_disk_bytes("t2").unwrap(), 40960);
        assert_eq!(s.tenant_disk_bytes("nobody").unwrap(), 0);
        s.delete_session("t1", "a").unwrap();
        assert_eq!(s.tenant_disk_bytes("t1").unwrap(), 40960);
    }

    fn objects_round_trip(kind: Kind) {
        let (_d, s) = tmp_on(kind);
        s.create_session(&session("a", "local", 1, &[])).unwrap();
        let obj = |name: &str, sha: &str| StoredObject { name: name.into(), sha256: sha.into(), bytes: 7 };
        let c = s
            .commit_checkpoint_with(
                &NewCheckpoint {
                    session_id: "a",
                    parent: None,
                    code: "x = 1",
                    layer: "c1.layer",
                    state: "c1.state",
                    pages: 1,
                    bytes: 4096,
                    checksum: "",
                    output: None,
                },
                None,
                Some("1"),
                5,
                &[obj("c1.layer", "aa"), obj("c1.state", "bb")],
            )
            .unwrap();
        assert_eq!(s.checkpoint(c.id).unwrap().unwrap(), c);
        assert_eq!(s.object("c1.layer").unwrap(), Some(obj("c1.layer", "aa")));
        assert_eq!(s.object("nope").unwrap(), None);
        let named = s.objects_named(&["nope".into(), "c1.state".into(), "c1.layer".into()]).unwrap();
        assert_eq!(named, [obj("c1.layer", "aa"), obj("c1.state", "bb")]);
        assert!(s.objects_named(&[]).unwrap().is_empty());
        // The same contents under a second name; a name recorded again is replaced.
        s.add_objects(&[obj("c1.files", "aa"), obj("c1.state", "cc")]).unwrap();
        assert!(s.has_object("aa").unwrap() && s.has_object("cc").unwrap() && !s.has_object("bb").unwrap());
        s.set_flat_with(c.id, Some("c1.flat"), Some(&obj("c1.flat", "dd"))).unwrap();
        assert!(matches!(s.set_flat_with(999, Some("x"), None), Err(StoreError::NoSuchCheckpoint(999))));
        let names: Vec<String> = s.all_objects().unwrap().into_iter().map(|o| o.name).collect();
        assert_eq!(names, ["c1.files", "c1.flat", "c1.layer", "c1.state"]);
        // "aa" is still the object of c1.files: only "cc" and "dd" are unreferenced.
        let gone = s.forget_objects(&["c1.layer".into(), "c1.state".into(), "c1.flat".into(), "nope".into()]).unwrap();
        assert_eq!(gone, ["cc", "dd"]);
        assert_eq!(s.forget_objects(&["c1.files".into()]).unwrap(), ["aa"]);
        assert!(s.all_objects().unwrap().is_empty());
    }

    fn template_records_are_added_once_replaced_and_deleted(kind: Kind) {
        let (db, s) = tmp_on(kind);
        assert!(s.template_records().unwrap().is_empty());
        assert!(s.put_template_record("t/a", "{\"v\":1}", false, 1).unwrap());
        // Another node adding the same key: refused, the first record stays.
        assert!(!db.open().put_template_record("t/a", "{\"v\":2}", false, 2).unwrap());
        assert!(s.put_template_record("b", "{}", false, 3).unwrap());
        assert_eq!(s.template_records().unwrap(), [("b".into(), "{}".into()), ("t/a".into(), "{\"v\":1}".into())]);
        // Replacing (a build recorded its template id).
        assert!(s.put_template_record("t/a", "{\"v\":3}", true, 4).unwrap());
        assert_eq!(db.open().template_records().unwrap()[1], ("t/a".to_string(), "{\"v\":3}".to_string()));
        s.delete_template_record("t/a").unwrap();
        s.delete_template_record("t/none").unwrap();
        assert_eq!(s.template_records().unwrap(), [("b".to_string(), "{}".to_string())]);
    }

    fn artifacts_are_published_once(kind: Kind) {
        let (db, s) = tmp_on(kind);
        let art = |id: &str, sha: &str| Artifact {
            kind: ArtifactKind::Template,
            id: id.into(),
            sha256: sha.into(),
            bytes: 45 << 20,
            needs: Some("img".into()),
            digest: Some("d".into()),
        };
        assert_eq!(s.artifact(ArtifactKind::Template, "t1").unwrap(), None);
        assert_eq!(s.publish_artifact(&art("t1", "aa"), 1).unwrap(), art("t1", "aa"));
        // Another node's copy of the same id: the first record wins, unchanged.
        let other = s.publish_artifact(&art("t1", "bb"), 2).unwrap();
        assert_eq!(other, art("t1", "aa"));
        assert_eq!(db.open().artifact(ArtifactKind::Template, "t1").unwrap(), Some(art("t1", "aa")));
        // Kinds are separate name spaces.
        let img = Artifact { kind: ArtifactKind::Image, needs: None, digest: None, ..art("t1", "cc") };
        assert_eq!(s.publish_artifact(&img, 3).unwrap(), img);
        assert_eq!(s.all_artifacts().unwrap(), [img, art("t1", "aa")]);
        // The build lock: exclusive between nodes (PostgreSQL), released on drop.
        let held = s.lock_artifact(ArtifactKind::Template, "t1", Duration::from_secs(1)).unwrap();
        let other = db.open();
        match kind {
            Kind::Postgres => {
                let t0 = Instant::now();
                let e = other.lock_artifact(ArtifactKind::Template, "t1", Duration::from_millis(300)).err();
                assert!(matches!(e, Some(StoreError::LockTimeout { .. })), "{e:?}");
                assert!(t0.elapsed() >= Duration::from_millis(300));
                // Another id is another lock.
                drop(other.lock_artifact(ArtifactKind::Template, "t2", Duration::from_millis(300)).unwrap());
                drop(held);
                drop(other.lock_artifact(ArtifactKind::Template, "t1", Duration::from_millis(300)).unwrap());
            }
            Kind::Sqlite => {
                drop(other.lock_artifact(ArtifactKind::Template, "t1", Duration::from_millis(300)).unwrap());
                drop(held);
            }
        }
    }

    #[test]
    fn postgres_migrates_once_refuses_a_newer_schema_and_reconnects() {
        let mut pg = forkbox_testkit::postgres::Postgres::start();
        let a = Store::open_postgres(&pg.url()).unwrap();
        assert_eq!(a.backend(), Backend::Postgres);
        assert_eq!(a.schema_version().unwrap(), PG_MIGRATIONS.len() as i64);
        a.create_session(&session("a", "local", 1, &[("k", "v")])).unwrap();
        // Two more nodes opening at once: the schema is migrated once, the data stays.
        let opened: Vec<Store> = std::thread::scope(|sc| {
            let hs: Vec<_> = (0..2).map(|_| sc.spawn(|| Store::open_postgres(&pg.url()).unwrap())).collect();
            hs.into_iter().map(|h| h.join().unwrap()).collect()
        });
        for s in &opened {
            assert_eq!(s.schema_version().unwrap(), PG_MIGRATIONS.len() as i64);
            assert_eq!(s.count_sessions(None).unwrap(), 1);
        }
        // One node claims the database; a second cannot while the first lives.
        a.claim().unwrap();
        assert!(matches!(opened[0].claim(), Err(StoreError::Claimed)));
        // The server restarts: the next statement connects again (and claims again).
        pg.stop();
        assert!(a.count_sessions(None).is_err_and(|e| e.is_unavailable()));
        pg.restart();
        assert_eq!(a.session("local", "a").unwrap().unwrap().tags.get("k").map(String::as_str), Some("v"));
        let b = Store::open_postgres(&pg.url()).unwrap();
        assert!(matches!(b.claim(), Err(StoreError::Claimed)));
        // The claim goes with its node's connection (the server notices the close at once or soon).
        drop(a);
        let deadline = Instant::now() + Duration::from_secs(10);
        while let Err(e) = b.claim() {
            assert!(Instant::now() < deadline, "the claim of a dropped store stayed: {e}");
            std::thread::sleep(Duration::from_millis(20));
        }
        // A database from a newer build is refused.
        b.conn().execute("UPDATE forkbox_schema SET version = ?1", vals![PG_MIGRATIONS.len() as i64 + 1]).unwrap();
        assert!(matches!(Store::open_postgres(&pg.url()), Err(StoreError::SchemaTooNew { .. })));
        // Not a PostgreSQL URL, or nothing listening: a clear error.
        let e = Store::open_postgres("mysql://x").err().unwrap();
        assert!(e.to_string().contains("not a PostgreSQL URL"), "{e}");
        let port = pg.port;
        drop(pg);
        let e = Store::open_postgres(&format!("postgres://forkbox@127.0.0.1:{port}/forkbox")).err().unwrap();
        assert!(e.to_string().contains("connect to PostgreSQL"), "{e}");
    }
}
