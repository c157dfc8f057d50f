//! The session metadata store: sessions, their tags and limits, and the tree of
//! checkpoints, in one SQLite database (WAL, foreign keys on).
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
//! [`MIGRATIONS`] is applied in order, driven by `PRAGMA user_version`, each
//! step in its own `BEGIN IMMEDIATE` transaction together with the version
//! bump, so concurrent openers and crashes mid-migration are safe. Add new
//! steps at the end; never edit a released step. Steps that rebuild a table
//! (rather than `ALTER TABLE ... ADD COLUMN`) must follow SQLite's 12-step
//! procedure, since foreign keys are on.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::{Mutex, MutexGuard};
use std::time::Duration;

use rusqlite::{params, Connection, OptionalExtension, Row, TransactionBehavior};

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

/// Schema migrations; `PRAGMA user_version` = number of steps applied.
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
    Sqlite {
        /// The statement or operation that failed.
        op: &'static str,
        #[source]
        source: rusqlite::Error,
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
}

trait Op<T> {
    fn op(self, op: &'static str) -> Result<T, StoreError>;
}

impl<T> Op<T> for rusqlite::Result<T> {
    fn op(self, op: &'static str) -> Result<T, StoreError> {
        self.map_err(|source| StoreError::Sqlite { op, source })
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
/// `Store`s (or processes) may open the same file.
pub struct Store {
    conn: Mutex<Connection>,
}

const CP_COLS: &str = "c.id, c.session_id, c.seq, c.parent, c.code, c.created_ms, c.layer, \
                       c.state, c.pages, c.bytes, c.checksum, c.flat, c.summary";

const SESSION_COLS: &str = "s.sid, s.id, s.tenant, s.template_id, s.memory_bytes, s.timeout_ms, \
                            s.output_bytes, s.disk_bytes, s.head, s.created_ms, s.last_used_ms, s.network";

fn get_u64(row: &Row<'_>, idx: usize) -> rusqlite::Result<u64> {
    let v: i64 = row.get(idx)?;
    u64::try_from(v).map_err(|_| rusqlite::Error::IntegralValueOutOfRange(idx, v))
}

fn to_i64(field: &'static str, value: u64) -> Result<i64, StoreError> {
    i64::try_from(value).map_err(|_| StoreError::TooLarge { field, value })
}

fn checkpoint_row(row: &Row<'_>) -> rusqlite::Result<CheckpointRecord> {
    Ok(CheckpointRecord {
        id: row.get(0)?,
        session_id: row.get(1)?,
        seq: row.get(2)?,
        parent: row.get(3)?,
        code: row.get(4)?,
        created_ms: row.get(5)?,
        layer: row.get(6)?,
        state: row.get(7)?,
        pages: get_u64(row, 8)?,
        bytes: get_u64(row, 9)?,
        checksum: row.get(10)?,
        flat: row.get(11)?,
        summary: row.get(12)?,
    })
}

/// `[1,2,3]`, for `json_each(?)`: a list of ids as one parameter.
fn id_list(ids: &[i64]) -> String {
    let mut s = String::with_capacity(ids.len() * 8 + 2);
    s.push('[');
    for (i, id) in ids.iter().enumerate() {
        if i > 0 {
            s.push(',');
        }
        s.push_str(&id.to_string());
    }
    s.push(']');
    s
}

impl Store {
    /// Opens (creating it and its directory if needed) the database at `path`
    /// and brings its schema up to date. [`Synchronous::Normal`].
    pub fn open(path: &Path) -> Result<Store, StoreError> {
        Self::open_with(path, Synchronous::default())
    }

    /// [`Store::open`] with a chosen durability.
    pub fn open_with(path: &Path, sync: Synchronous) -> Result<Store, StoreError> {
        if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
            std::fs::create_dir_all(dir).map_err(|source| StoreError::Io { path: dir.to_path_buf(), source })?;
        }
        let conn = Connection::open(path).op("open database")?;
        Self::init(conn, Some(sync))
    }

    /// A private in-memory database (no WAL), for tests.
    pub fn open_in_memory() -> Result<Store, StoreError> {
        let conn = Connection::open_in_memory().op("open in-memory database")?;
        Self::init(conn, None)
    }

    /// `sync`: `None` for an in-memory database (no WAL).
    fn init(mut conn: Connection, sync: Option<Synchronous>) -> Result<Store, StoreError> {
        conn.busy_timeout(BUSY_TIMEOUT).op("set busy_timeout")?;
        if let Some(sync) = sync {
            let mode: String = conn
                .pragma_update_and_check(None, "journal_mode", "WAL", |r| r.get(0))
                .op("PRAGMA journal_mode = WAL")?;
            if !mode.eq_ignore_ascii_case("wal") {
                return Err(StoreError::Sqlite {
                    op: "PRAGMA journal_mode = WAL",
                    source: rusqlite::Error::InvalidParameterName(format!("journal_mode is {mode}, not wal")),
                });
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
            return Err(StoreError::Sqlite {
                op: "PRAGMA foreign_keys = ON",
                source: rusqlite::Error::InvalidParameterName("foreign keys are not supported by this SQLite".into()),
            });
        }
        migrate(&mut conn)?;
        Ok(Store { conn: Mutex::new(conn) })
    }

    fn conn(&self) -> MutexGuard<'_, Connection> {
        // A panic while holding the lock rolled back any open transaction
        // (Transaction's Drop), so the connection is still consistent.
        self.conn.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// The schema version (`PRAGMA user_version`).
    pub fn schema_version(&self) -> Result<i64, StoreError> {
        self.conn().query_row("PRAGMA user_version", [], |r| r.get(0)).op("PRAGMA user_version")
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
        let tx = conn.transaction_with_behavior(TransactionBehavior::Immediate).op("create_session: begin")?;
        let exists = tx
            .prepare_cached("SELECT 1 FROM sessions WHERE id = ?1")
            .and_then(|mut st| st.exists([&s.id]))
            .op("create_session: check id")?;
        if exists {
            return Err(StoreError::Exists(s.id.clone()));
        }
        if let Some(head) = s.head {
            if !checkpoint_exists(&tx, head)? {
                return Err(StoreError::NoSuchCheckpoint(head));
            }
        }
        // A fork joins the lineage of the checkpoint it starts at; a new session starts one.
        let lineage: Option<i64> = match s.head {
            Some(head) => tx
                .prepare_cached("SELECT lineage FROM checkpoints WHERE id = ?1")
                .and_then(|mut st| st.query_row([head], |r| r.get(0)))
                .op("create_session: lineage of the head")?,
            None => None,
        };
        let lineage = match lineage {
            Some(l) => l,
            None => {
                tx.prepare_cached("INSERT INTO lineages (last_seq) VALUES (0)")
                    .and_then(|mut st| st.execute([]))
                    .op("create_session: new lineage")?;
                tx.last_insert_rowid()
            }
        };
        tx.prepare_cached(
            "INSERT INTO sessions (id, tenant, template_id, memory_bytes, timeout_ms, \
             output_bytes, disk_bytes, head, created_ms, last_used_ms, network, lineage, origin) \
             VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8, ?9, ?10, ?11, ?12, ?8)",
        )
        .and_then(|mut st| {
            st.execute(params![
                s.id,
                s.tenant,
                s.template_id,
                memory,
                timeout,
                output,
                disk,
                s.head,
                s.created_ms,
                s.last_used_ms,
                s.limits.network,
                lineage
            ])
        })
        .op("create_session: insert session")?;
        let sid = tx.last_insert_rowid();
        {
            let mut st = tx
                .prepare_cached("INSERT INTO session_tags (sid, key, value) VALUES (?1, ?2, ?3)")
                .op("create_session: prepare insert tag")?;
            for (k, v) in &s.tags {
                st.execute(params![sid, k, v]).op("create_session: insert tag")?;
            }
        }
        tx.commit().op("create_session: commit")
    }

    /// The session `id` of `tenant`; other tenants' sessions are invisible.
    pub fn session(&self, tenant: &str, id: &str) -> Result<Option<SessionRecord>, StoreError> {
        let conn = self.conn();
        let mut v = load_sessions(&conn, "s.tenant = ?1 AND s.id = ?2", &[&tenant, &id], "session")?;
        Ok(v.pop())
    }

    /// The tenant's sessions carrying all of `tags`, oldest first.
    pub fn list_sessions(&self, tenant: &str, tags: &[(String, String)]) -> Result<Vec<SessionRecord>, StoreError> {
        let mut filter = String::from("s.tenant = ?1");
        let mut args: Vec<&dyn rusqlite::ToSql> = vec![&tenant];
        for (k, v) in tags {
            let n = args.len();
            filter.push_str(&format!(
                " AND EXISTS (SELECT 1 FROM session_tags f WHERE f.sid = s.sid \
                 AND f.key = ?{} AND f.value = ?{})",
                n + 1,
                n + 2
            ));
            args.push(k);
            args.push(v);
        }
        let conn = self.conn();
        load_sessions(&conn, &filter, &args, "list_sessions")
    }

    /// Every session of every tenant, oldest first (start-up recovery).
    pub fn all_sessions(&self) -> Result<Vec<SessionRecord>, StoreError> {
        let conn = self.conn();
        load_sessions(&conn, "1", &[], "all_sessions")
    }

    /// Number of sessions of `tenant`, or of all tenants.
    pub fn count_sessions(&self, tenant: Option<&str>) -> Result<u64, StoreError> {
        let conn = self.conn();
        let n: i64 = match tenant {
            Some(t) => conn
                .prepare_cached("SELECT COUNT(*) FROM sessions WHERE tenant = ?1")
                .and_then(|mut st| st.query_row([t], |r| r.get(0))),
            None => {
                conn.prepare_cached("SELECT COUNT(*) FROM sessions").and_then(|mut st| st.query_row([], |r| r.get(0)))
            }
        }
        .op("count_sessions")?;
        Ok(n as u64)
    }

    /// Sets `last_used_ms`. [`StoreError::NoSuchSession`] if absent.
    pub fn touch(&self, id: &str, now_ms: i64) -> Result<(), StoreError> {
        let conn = self.conn();
        let n = conn
            .prepare_cached("UPDATE sessions SET last_used_ms = ?2 WHERE id = ?1")
            .and_then(|mut st| st.execute(params![id, now_ms]))
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
        let tx = conn.transaction_with_behavior(TransactionBehavior::Immediate).op("update_session: begin")?;
        let sid: Option<i64> = tx
            .prepare_cached("SELECT sid FROM sessions WHERE tenant = ?1 AND id = ?2")
            .and_then(|mut st| st.query_row([tenant, id], |r| r.get(0)).optional())
            .op("update_session: find")?;
        let Some(sid) = sid else { return Ok(false) };
        tx.prepare_cached(
            "UPDATE sessions SET memory_bytes = COALESCE(?2, memory_bytes), \
             timeout_ms = COALESCE(?3, timeout_ms) WHERE sid = ?1",
        )
        .and_then(|mut st| st.execute(params![sid, memory, timeout]))
        .op("update_session: limits")?;
        if let Some(tags) = tags {
            tx.prepare_cached("DELETE FROM session_tags WHERE sid = ?1")
                .and_then(|mut st| st.execute([sid]))
                .op("update_session: delete tags")?;
            let mut st = tx
                .prepare_cached("INSERT INTO session_tags (sid, key, value) VALUES (?1, ?2, ?3)")
                .op("update_session: prepare insert tag")?;
            for (k, v) in tags {
                st.execute(params![sid, k, v]).op("update_session: insert tag")?;
            }
        }
        tx.commit().op("update_session: commit")?;
        Ok(true)
    }

    /// Moves the session's head (revert). The checkpoint must exist; whether
    /// it belongs to the session's history is the caller's business.
    pub fn set_head(&self, id: &str, head: Option<i64>) -> Result<(), StoreError> {
        let mut conn = self.conn();
        let tx = conn.transaction_with_behavior(TransactionBehavior::Immediate).op("set_head: begin")?;
        if let Some(h) = head {
            if !checkpoint_exists(&tx, h)? {
                return Err(StoreError::NoSuchCheckpoint(h));
            }
        }
        let n = tx
            .prepare_cached("UPDATE sessions SET head = ?2 WHERE id = ?1")
            .and_then(|mut st| st.execute(params![id, head]))
            .op("set_head: update")?;
        if n == 0 {
            return Err(StoreError::NoSuchSession(id.to_owned()));
        }
        tx.commit().op("set_head: commit")
    }

    /// Deletes the session and its tags; its checkpoints stay until
    /// [`Store::unreferenced_checkpoints`] reports them. `false` if the tenant
    /// has no such session.
    pub fn delete_session(&self, tenant: &str, id: &str) -> Result<bool, StoreError> {
        let conn = self.conn();
        let n = conn
            .prepare_cached("DELETE FROM sessions WHERE tenant = ?1 AND id = ?2")
            .and_then(|mut st| st.execute([tenant, id]))
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
        let tx = conn.transaction_with_behavior(TransactionBehavior::Immediate).op("reserve_seq: begin")?;
        let seq = next_seq(&tx, session)?;
        tx.commit().op("reserve_seq: commit")?;
        Ok(seq)
    }

    /// Give back a number from [`Self::reserve_seq`] that no checkpoint got (a
    /// failed exec), if it is still the lineage's last: numbers stay dense when
    /// nothing else took one meanwhile. True if it was given back.
    pub fn release_seq(&self, session: &str, seq: i64) -> Result<bool, StoreError> {
        let conn = self.conn();
        let n = conn
            .prepare_cached(
                "UPDATE lineages SET last_seq = last_seq - 1 \
                 WHERE id = (SELECT lineage FROM sessions WHERE id = ?1) AND last_seq = ?2",
            )
            .and_then(|mut st| st.execute(params![session, seq]))
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
        let pages = to_i64("pages", c.pages)?;
        let bytes = to_i64("bytes", c.bytes)?;
        let mut conn = self.conn();
        let tx = conn.transaction_with_behavior(TransactionBehavior::Immediate).op("commit_checkpoint: begin")?;
        let sid: i64 = tx
            .prepare_cached("SELECT sid FROM sessions WHERE id = ?1")
            .and_then(|mut st| st.query_row([c.session_id], |r| r.get(0)).optional())
            .op("commit_checkpoint: find session")?
            .ok_or_else(|| StoreError::NoSuchSession(c.session_id.to_owned()))?;
        if let Some(p) = c.parent {
            if !checkpoint_exists(&tx, p)? {
                return Err(StoreError::NoSuchCheckpoint(p));
            }
        }
        // The lineage's counter: numbers are unique in the whole tree and never
        // reused (also after the newest checkpoints were dropped).
        let seq = match reserved {
            Some(n) => n,
            None => next_seq(&tx, c.session_id)?,
        };
        tx.prepare_cached(
            "INSERT INTO checkpoints (owner, session_id, seq, parent, code, created_ms, layer, \
             state, pages, bytes, checksum, flat, lineage, summary) \
             VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8, ?9, ?10, ?11, NULL, \
             (SELECT lineage FROM sessions WHERE sid = ?1), ?12)",
        )
        .and_then(|mut st| {
            st.execute(params![
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
                summary
            ])
        })
        .op("commit_checkpoint: insert checkpoint")?;
        let id = tx.last_insert_rowid();
        tx.prepare_cached("UPDATE sessions SET head = ?2, last_used_ms = ?3, last_seq = ?4 WHERE sid = ?1")
            .and_then(|mut st| st.execute(params![sid, id, now_ms, seq]))
            .op("commit_checkpoint: set head")?;
        insert_objects(&tx, objects)?;
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
        })
    }

    pub fn checkpoint(&self, id: i64) -> Result<Option<CheckpointRecord>, StoreError> {
        let conn = self.conn();
        conn.prepare_cached(&format!("SELECT {CP_COLS} FROM checkpoints c WHERE c.id = ?1"))
            .and_then(|mut st| st.query_row([id], checkpoint_row).optional())
            .op("checkpoint")
    }

    /// Root-first chain from the template to `id` (inclusive): the first
    /// element has `parent == None`. [`StoreError::NoSuchCheckpoint`] if `id`
    /// does not exist.
    pub fn ancestry(&self, id: i64) -> Result<Vec<CheckpointRecord>, StoreError> {
        let conn = self.conn();
        let v: Vec<CheckpointRecord> = conn
            .prepare_cached(&format!(
                "WITH RECURSIVE up(id, depth) AS ( \
                    SELECT ?1, 0 \
                    UNION ALL \
                    SELECT c.parent, up.depth + 1 FROM checkpoints c JOIN up ON c.id = up.id \
                    WHERE c.parent IS NOT NULL \
                 ) \
                 SELECT {CP_COLS} FROM up JOIN checkpoints c ON c.id = up.id \
                 ORDER BY up.depth DESC"
            ))
            .and_then(|mut st| st.query_map([id], checkpoint_row)?.collect())
            .op("ancestry")?;
        if v.is_empty() {
            return Err(StoreError::NoSuchCheckpoint(id));
        }
        Ok(v)
    }

    /// Every checkpoint created by the (live) session `id`, all branches, by
    /// seq. A fork's starting checkpoint belongs to the source session and is
    /// not included.
    pub fn session_checkpoints(&self, id: &str) -> Result<Vec<CheckpointRecord>, StoreError> {
        let conn = self.conn();
        conn.prepare_cached(&format!(
            "SELECT {CP_COLS} FROM checkpoints c JOIN sessions s ON c.owner = s.sid \
             WHERE s.id = ?1 ORDER BY c.seq"
        ))
        .and_then(|mut st| st.query_map([id], checkpoint_row)?.collect())
        .op("session_checkpoints")
    }

    /// The (live) session's checkpoint number `seq`.
    pub fn checkpoint_by_seq(&self, session: &str, seq: i64) -> Result<Option<CheckpointRecord>, StoreError> {
        let conn = self.conn();
        // Any checkpoint of the session's lineage (its own first: sessions from
        // before lineages were recorded may share numbers with their source).
        conn.prepare_cached(&format!(
            "SELECT {CP_COLS} FROM checkpoints c JOIN sessions s ON s.id = ?1 \
             WHERE c.seq = ?2 AND (c.owner = s.sid OR c.lineage = s.lineage) \
             ORDER BY c.owner = s.sid DESC LIMIT 1"
        ))
        .and_then(|mut st| st.query_row(params![session, seq], checkpoint_row).optional())
        .op("checkpoint_by_seq")
    }

    /// The tree a session belongs to: every checkpoint of its lineage (by id,
    /// so parents come first) and the lineage's live sessions. `None`: no such
    /// session of the tenant.
    pub fn lineage_tree(&self, tenant: &str, id: &str) -> Result<Option<LineageTree>, StoreError> {
        let conn = self.conn();
        let lineage: Option<Option<i64>> = conn
            .prepare_cached("SELECT lineage FROM sessions WHERE tenant = ?1 AND id = ?2")
            .and_then(|mut st| st.query_row([tenant, id], |r| r.get(0)).optional())
            .op("lineage_tree: session")?;
        let Some(lineage) = lineage else { return Ok(None) };
        let Some(lineage) = lineage else { return Ok(Some(LineageTree::default())) };
        let checkpoints: Vec<CheckpointRecord> = conn
            .prepare_cached(&format!("SELECT {CP_COLS} FROM checkpoints c WHERE c.lineage = ?1 ORDER BY c.id"))
            .and_then(|mut st| st.query_map([lineage], checkpoint_row)?.collect())
            .op("lineage_tree: checkpoints")?;
        let sessions: Vec<LineageSession> = conn
            .prepare_cached(
                "SELECT s.id, s.head, s.origin, s.created_ms FROM sessions s \
                 WHERE s.lineage = ?1 AND s.tenant = ?2 ORDER BY s.created_ms, s.sid",
            )
            .and_then(|mut st| {
                st.query_map(params![lineage, tenant], |r| {
                    Ok(LineageSession { id: r.get(0)?, head: r.get(1)?, origin: r.get(2)?, created_ms: r.get(3)? })
                })?
                .collect()
            })
            .op("lineage_tree: sessions")?;
        Ok(Some(LineageTree { checkpoints, sessions }))
    }

    /// Records (or clears) the compacted layer of a checkpoint.
    pub fn set_flat(&self, id: i64, flat: Option<&str>) -> Result<(), StoreError> {
        self.set_flat_with(id, flat, None)
    }

    /// [`Self::set_flat`], recording the flat layer's object in the same transaction.
    pub fn set_flat_with(&self, id: i64, flat: Option<&str>, object: Option<&StoredObject>) -> Result<(), StoreError> {
        let mut conn = self.conn();
        let tx = conn.transaction_with_behavior(TransactionBehavior::Immediate).op("set_flat: begin")?;
        let n = tx
            .prepare_cached("UPDATE checkpoints SET flat = ?2 WHERE id = ?1")
            .and_then(|mut st| st.execute(params![id, flat]))
            .op("set_flat")?;
        if n == 0 {
            return Err(StoreError::NoSuchCheckpoint(id));
        }
        if let Some(o) = object {
            insert_objects(&tx, std::slice::from_ref(o))?;
        }
        tx.commit().op("set_flat: commit")
    }

    // ----------------------------------------------------------------- objects

    /// The object of the file `name` of the layers directory, if it was uploaded.
    pub fn object(&self, name: &str) -> Result<Option<StoredObject>, StoreError> {
        let conn = self.conn();
        conn.prepare_cached("SELECT name, sha256, bytes FROM objects WHERE name = ?1")
            .and_then(|mut st| st.query_row([name], object_row).optional())
            .op("object")
    }

    /// Every uploaded file, by name.
    pub fn all_objects(&self) -> Result<Vec<StoredObject>, StoreError> {
        let conn = self.conn();
        conn.prepare_cached("SELECT name, sha256, bytes FROM objects ORDER BY name")
            .and_then(|mut st| st.query_map([], object_row)?.collect())
            .op("all_objects")
    }

    /// Whether some file's contents have this SHA-256 (its object is in the store).
    pub fn has_object(&self, sha256: &str) -> Result<bool, StoreError> {
        let conn = self.conn();
        conn.prepare_cached("SELECT 1 FROM objects WHERE sha256 = ?1")
            .and_then(|mut st| st.exists([sha256]))
            .op("has_object")
    }

    /// Records objects of files that exist already (an upload of older files).
    pub fn add_objects(&self, objects: &[StoredObject]) -> Result<(), StoreError> {
        let mut conn = self.conn();
        let tx = conn.transaction_with_behavior(TransactionBehavior::Immediate).op("add_objects: begin")?;
        insert_objects(&tx, objects)?;
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
        let tx = conn.transaction_with_behavior(TransactionBehavior::Immediate).op("forget_objects: begin")?;
        let mut gone = Vec::new();
        {
            let mut del = tx
                .prepare_cached("DELETE FROM objects WHERE name = ?1 RETURNING sha256")
                .op("forget_objects: prepare")?;
            for n in names {
                let sha: Option<String> = del.query_row([n], |r| r.get(0)).optional().op("forget_objects: delete")?;
                gone.extend(sha);
            }
        }
        gone.sort_unstable();
        gone.dedup();
        let mut unreferenced = Vec::with_capacity(gone.len());
        {
            let mut st =
                tx.prepare_cached("SELECT 1 FROM objects WHERE sha256 = ?1").op("forget_objects: prepare check")?;
            for sha in gone {
                if !st.exists([&sha]).op("forget_objects: check")? {
                    unreferenced.push(sha);
                }
            }
        }
        tx.commit().op("forget_objects: commit")?;
        Ok(unreferenced)
    }

    /// Checkpoints no live session needs, by id: not owned by a live session,
    /// not a live session's head, and not an ancestor of either. The set is
    /// closed under descendants, so it can be passed to
    /// [`Store::delete_checkpoints`] as is.
    pub fn unreferenced_checkpoints(&self) -> Result<Vec<CheckpointRecord>, StoreError> {
        let conn = self.conn();
        unreferenced(&conn)
    }

    /// [`Store::unreferenced_checkpoints`] and [`Store::delete_checkpoints`] in
    /// one transaction, so a concurrent fork cannot resurrect a checkpoint in
    /// between. Returns what was deleted; remove the files afterwards.
    pub fn delete_unreferenced_checkpoints(&self) -> Result<Vec<CheckpointRecord>, StoreError> {
        let mut conn = self.conn();
        let tx = conn
            .transaction_with_behavior(TransactionBehavior::Immediate)
            .op("delete_unreferenced_checkpoints: begin")?;
        let v = unreferenced(&tx)?;
        let ids: Vec<i64> = v.iter().map(|c| c.id).collect();
        delete_ids(&tx, &ids)?;
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
        let tx = conn.transaction_with_behavior(TransactionBehavior::Immediate).op("delete_checkpoints: begin")?;
        let list = id_list(ids);
        let in_use: Option<(String, i64)> = tx
            .prepare_cached(
                "SELECT id, head FROM sessions \
                 WHERE head IN (SELECT value FROM json_each(?1)) LIMIT 1",
            )
            .and_then(|mut st| st.query_row([&list], |r| Ok((r.get(0)?, r.get(1)?))).optional())
            .op("delete_checkpoints: check heads")?;
        if let Some((session, id)) = in_use {
            return Err(StoreError::InUse { id, session });
        }
        let child: Option<(i64, i64)> = tx
            .prepare_cached(
                "SELECT parent, id FROM checkpoints \
                 WHERE parent IN (SELECT value FROM json_each(?1)) \
                   AND id NOT IN (SELECT value FROM json_each(?1)) LIMIT 1",
            )
            .and_then(|mut st| st.query_row([&list], |r| Ok((r.get(0)?, r.get(1)?))).optional())
            .op("delete_checkpoints: check children")?;
        if let Some((id, child)) = child {
            return Err(StoreError::HasChildren { id, child });
        }
        delete_ids(&tx, ids)?;
        tx.commit().op("delete_checkpoints: commit")
    }

    /// Every checkpoint, by id.
    pub fn all_checkpoints(&self) -> Result<Vec<CheckpointRecord>, StoreError> {
        let conn = self.conn();
        conn.prepare_cached(&format!("SELECT {CP_COLS} FROM checkpoints c ORDER BY c.id"))
            .and_then(|mut st| st.query_map([], checkpoint_row)?.collect())
            .op("all_checkpoints")
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
        let tx =
            conn.transaction_with_behavior(TransactionBehavior::Immediate).op("drop_checkpoints_and_rewind: begin")?;
        let deleted: Vec<CheckpointRecord> = tx
            .prepare_cached(&format!(
                "WITH RECURSIVE doomed(id) AS ( \
                    SELECT c.id FROM checkpoints c \
                    WHERE c.id IN (SELECT value FROM json_each(?1)) \
                    UNION \
                    SELECT c.id FROM checkpoints c JOIN doomed d ON c.parent = d.id \
                 ) \
                 SELECT {CP_COLS} FROM checkpoints c WHERE c.id IN doomed ORDER BY c.id"
            ))
            .and_then(|mut st| st.query_map([id_list(ids)], checkpoint_row)?.collect())
            .op("drop_checkpoints_and_rewind: descendants")?;
        let doomed: Vec<i64> = deleted.iter().map(|c| c.id).collect();
        let list = id_list(&doomed);
        let heads: Vec<(String, i64)> = tx
            .prepare_cached(
                "SELECT id, head FROM sessions \
                 WHERE head IN (SELECT value FROM json_each(?1)) ORDER BY sid",
            )
            .and_then(|mut st| st.query_map([&list], |r| Ok((r.get(0)?, r.get(1)?)))?.collect())
            .op("drop_checkpoints_and_rewind: affected sessions")?;
        let mut moved = Vec::with_capacity(heads.len());
        for (session, from) in heads {
            let to: Option<i64> = tx
                .prepare_cached(
                    "WITH RECURSIVE up(id, depth) AS ( \
                        SELECT ?1, 0 \
                        UNION ALL \
                        SELECT c.parent, up.depth + 1 FROM checkpoints c JOIN up ON c.id = up.id \
                        WHERE c.parent IS NOT NULL \
                     ) \
                     SELECT id FROM up WHERE id NOT IN (SELECT value FROM json_each(?2)) \
                     ORDER BY depth LIMIT 1",
                )
                .and_then(|mut st| st.query_row(params![from, &list], |r| r.get(0)).optional())
                .op("drop_checkpoints_and_rewind: nearest survivor")?;
            tx.prepare_cached("UPDATE sessions SET head = ?2 WHERE id = ?1")
                .and_then(|mut st| st.execute(params![session, to]))
                .op("drop_checkpoints_and_rewind: move head")?;
            moved.push(HeadMove { session, from, to });
        }
        delete_ids(&tx, &doomed)?;
        tx.commit().op("drop_checkpoints_and_rewind: commit")?;
        Ok(Rewind { deleted, moved })
    }

    /// Sum of `bytes` of the checkpoints the (live) session created (0 for an
    /// unknown session). Flat (compacted) layers are not counted.
    pub fn disk_bytes(&self, session: &str) -> Result<u64, StoreError> {
        let conn = self.conn();
        let n: i64 = conn
            .prepare_cached(
                "SELECT COALESCE(SUM(c.bytes), 0) FROM checkpoints c \
                 JOIN sessions s ON c.owner = s.sid WHERE s.id = ?1",
            )
            .and_then(|mut st| st.query_row([session], |r| r.get(0)))
            .op("disk_bytes")?;
        Ok(n as u64)
    }
}

impl Store {
    /// Sum of `bytes` of the checkpoints owned by the tenant's live sessions
    /// (what a per-tenant disk quota counts; flat layers are not counted).
    pub fn tenant_disk_bytes(&self, tenant: &str) -> Result<u64, StoreError> {
        let conn = self.conn();
        let n: i64 = conn
            .prepare_cached(
                "SELECT COALESCE(SUM(c.bytes), 0) FROM checkpoints c \
                 JOIN sessions s ON c.owner = s.sid WHERE s.tenant = ?1",
            )
            .and_then(|mut st| st.query_row([tenant], |r| r.get(0)))
            .op("tenant_disk_bytes")?;
        Ok(n.max(0) as u64)
    }
}

fn migrate(conn: &mut Connection) -> Result<(), StoreError> {
    let supported = MIGRATIONS.len() as i64;
    loop {
        let tx = conn.transaction_with_behavior(TransactionBehavior::Immediate).op("migrate: begin")?;
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

fn object_row(row: &Row<'_>) -> rusqlite::Result<StoredObject> {
    Ok(StoredObject { name: row.get(0)?, sha256: row.get(1)?, bytes: get_u64(row, 2)? })
}

fn insert_objects(conn: &Connection, objects: &[StoredObject]) -> Result<(), StoreError> {
    if objects.is_empty() {
        return Ok(());
    }
    let mut st = conn
        .prepare_cached("INSERT OR REPLACE INTO objects (name, sha256, bytes) VALUES (?1, ?2, ?3)")
        .op("insert objects: prepare")?;
    for o in objects {
        st.execute(params![o.name, o.sha256, to_i64("bytes", o.bytes)?]).op("insert object")?;
    }
    Ok(())
}

/// Takes the next number of the session's lineage.
fn next_seq(conn: &Connection, session: &str) -> Result<i64, StoreError> {
    conn.prepare_cached(
        "UPDATE lineages SET last_seq = last_seq + 1 \
         WHERE id = (SELECT lineage FROM sessions WHERE id = ?1) RETURNING last_seq",
    )
    .and_then(|mut st| st.query_row([session], |r| r.get(0)).optional())
    .op("next seq")?
    .ok_or_else(|| StoreError::NoSuchSession(session.to_owned()))
}

fn checkpoint_exists(conn: &Connection, id: i64) -> Result<bool, StoreError> {
    conn.prepare_cached("SELECT 1 FROM checkpoints WHERE id = ?1")
        .and_then(|mut st| st.exists([id]))
        .op("check checkpoint exists")
}

fn unreferenced(conn: &Connection) -> Result<Vec<CheckpointRecord>, StoreError> {
    conn.prepare_cached(&format!(
        "WITH RECURSIVE keep(id) AS ( \
            SELECT c.id FROM checkpoints c WHERE c.owner IN (SELECT sid FROM sessions) \
            UNION \
            SELECT head FROM sessions WHERE head IS NOT NULL \
            UNION \
            SELECT c.parent FROM checkpoints c JOIN keep k ON c.id = k.id \
            WHERE c.parent IS NOT NULL \
         ) \
         SELECT {CP_COLS} FROM checkpoints c WHERE c.id NOT IN keep ORDER BY c.id"
    ))
    .and_then(|mut st| st.query_map([], checkpoint_row)?.collect())
    .op("unreferenced_checkpoints")
}

/// Deletes `ids` children first (a child's id is always greater than its
/// parent's), so the immediate parent foreign key holds after every statement.
fn delete_ids(conn: &Connection, ids: &[i64]) -> Result<(), StoreError> {
    let mut sorted = ids.to_vec();
    sorted.sort_unstable_by(|a, b| b.cmp(a));
    sorted.dedup();
    let mut st = conn.prepare_cached("DELETE FROM checkpoints WHERE id = ?1").op("delete checkpoints: prepare")?;
    for id in sorted {
        st.execute([id]).op("delete checkpoint")?;
    }
    Ok(())
}

/// Sessions matching `filter` (over alias `s`) with their tags, oldest first.
fn load_sessions(
    conn: &Connection,
    filter: &str,
    args: &[&dyn rusqlite::ToSql],
    op: &'static str,
) -> Result<Vec<SessionRecord>, StoreError> {
    let sql = format!(
        "SELECT {SESSION_COLS}, t.key, t.value FROM sessions s \
         LEFT JOIN session_tags t ON t.sid = s.sid \
         WHERE {filter} ORDER BY s.created_ms, s.sid, t.key"
    );
    let mut st = conn.prepare_cached(&sql).op(op)?;
    let mut rows = st.query(args).op(op)?;
    let mut out: Vec<SessionRecord> = Vec::new();
    let mut last_sid: Option<i64> = None;
    while let Some(row) = rows.next().op(op)? {
        let sid: i64 = row.get(0).op(op)?;
        if last_sid != Some(sid) {
            last_sid = Some(sid);
            out.push(session_row(row).op(op)?);
        }
        let key: Option<String> = row.get(12).op(op)?;
        if let Some(key) = key {
            let value: String = row.get(13).op(op)?;
            out.last_mut().expect("pushed above").tags.insert(key, value);
        }
    }
    Ok(out)
}

fn session_row(row: &Row<'_>) -> rusqlite::Result<SessionRecord> {
    Ok(SessionRecord {
        id: row.get(1)?,
        tenant: row.get(2)?,
        template_id: row.get(3)?,
        tags: BTreeMap::new(),
        limits: Limits {
            memory_bytes: get_u64(row, 4)?,
            timeout_ms: get_u64(row, 5)?,
            output_bytes: get_u64(row, 6)?,
            disk_bytes: get_u64(row, 7)?,
            network: row.get(11)?,
        },
        head: row.get(8)?,
        created_ms: row.get(9)?,
        last_used_ms: row.get(10)?,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;
    use std::time::Instant;

    fn tmp() -> (tempfile::TempDir, Store) {
        let dir = tempfile::tempdir().unwrap();
        let store = Store::open(&dir.path().join("db").join("sessions.db")).unwrap();
        (dir, store)
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

    #[test]
    fn create_get_list_tags_tenants() {
        let (_d, s) = tmp();
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
        let n: i64 = s.conn().query_row("SELECT COUNT(*) FROM session_tags", [], |r| r.get(0)).unwrap();
        assert_eq!(n, 3);
    }

    #[test]
    fn commit_increments_seq_and_sets_head() {
        let (_d, s) = tmp();
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
        };
        assert!(matches!(s.commit_checkpoint(&bad, 1), Err(StoreError::NoSuchSession(_))));
        let bad = NewCheckpoint { session_id: "a", parent: Some(9999), ..bad };
        assert!(matches!(s.commit_checkpoint(&bad, 1), Err(StoreError::NoSuchCheckpoint(9999))));
        // Failed commits left nothing behind.
        assert_eq!(s.all_checkpoints().unwrap().len(), 3);
        assert_eq!(s.session("local", "a").unwrap().unwrap().head, Some(c3.id));
    }

    #[test]
    fn ancestry_across_fork() {
        let (_d, s) = tmp();
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

    #[test]
    fn revert_then_commit_branches() {
        let (_d, s) = tmp();
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

    #[test]
    fn delete_source_of_fork_keeps_needed_checkpoints() {
        let (_d, s) = tmp();
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

    #[test]
    fn unreferenced_and_delete_checkpoints() {
        let (_d, s) = tmp();
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
        let fk = s.conn().execute("DELETE FROM checkpoints WHERE id = ?1", [a1.id]).unwrap_err();
        assert!(fk.to_string().contains("FOREIGN KEY"), "{fk}");

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

    #[test]
    fn drop_checkpoints_and_rewind() {
        let (_d, s) = tmp();
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

    #[test]
    fn reopen_persists() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("sessions.db");
        let (c1, c2);
        {
            let s = Store::open(&path).unwrap();
            s.create_session(&session("a", "local", 1, &[("k", "v")])).unwrap();
            c1 = exec(&s, "a", "x = 1", 10);
            c2 = exec(&s, "a", "y = 2", 20);
            s.set_flat(c2.id, Some("flat")).unwrap();
        }
        let s = Store::open(&path).unwrap();
        let a = s.session("local", "a").unwrap().unwrap();
        assert_eq!(a.tags.get("k").map(String::as_str), Some("v"));
        assert_eq!(a.head, Some(c2.id));
        assert_eq!(a.last_used_ms, 20);
        let all = s.all_checkpoints().unwrap();
        assert_eq!(all[0], c1);
        assert_eq!(all[1].flat.as_deref(), Some("flat"));
        assert_eq!(exec(&s, "a", "z = 3", 30).seq, 3);
    }

    #[test]
    fn update_session_changes_tags_and_limits_of_the_tenants_session_only() {
        let (d, s) = tmp();
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
        let s = Store::open(&d.path().join("db").join("sessions.db")).unwrap();
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
        let mode: String = s3.conn().query_row("PRAGMA journal_mode", [], |r| r.get(0)).unwrap();
        assert_eq!(mode, "wal");
        // A database from a newer build is refused.
        s3.conn().pragma_update(None, "user_version", MIGRATIONS.len() as i64 + 1).unwrap();
        drop(s3);
        assert!(matches!(Store::open(&path), Err(StoreError::SchemaTooNew { .. })));
        // Full durability opens the same database.
        let f = Store::open_with(&dir.path().join("full.db"), Synchronous::Full).unwrap();
        let level: i64 = f.conn().query_row("PRAGMA synchronous", [], |r| r.get(0)).unwrap();
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
        assert_eq!(s.schema_version().unwrap(), 4);
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
        let conn = s.conn();
        // Insert directly in one transaction (the fsync per commit is not the point here).
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
        drop(conn);
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

    #[test]
    fn concurrent_four_threads() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("sessions.db");
        let shared = Arc::new(Store::open(&path).unwrap());
        let mut handles = Vec::new();
        for t in 0..4 {
            // Two threads share one Store; two open their own connection.
            let store = if t < 2 { shared.clone() } else { Arc::new(Store::open(&path).unwrap()) };
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

    #[test]
    fn tenant_disk_bytes_sums_the_tenants_live_sessions() {
        let (_d, s) = tmp();
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
}
