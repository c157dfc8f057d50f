//! API key records: the SHA-256 of each key (never the key), its tenant, its
//! limits and its egress policy layer. Where they live follows the session
//! metadata: the data directory's own `server/keys.db` (SQLite, the embedded
//! default), or the `api_keys` table of the PostgreSQL database a cluster's
//! nodes share (`--database`), so that a key works on every node. The SQL is
//! written once for both (see `crate::db`); what a key means (hashing, rate
//! limits, budgets) is the API server's.

use std::path::{Path, PathBuf};
use std::sync::{Mutex, MutexGuard};

use crate::db::{vals, Conn, Row};
use crate::store::{Op, StoreError, BUSY_TIMEOUT};

/// `<home>/server/keys.db`: the keys of a data directory without `--database`.
pub fn keys_path(home: &Path) -> PathBuf {
    home.join("server").join("keys.db")
}

/// Columns `keys.db` files got after the first release, added in place to older files.
const SQLITE_LIMIT_COLUMNS: &[(&str, &str)] = &[
    ("rate_limit", "INTEGER"),
    ("max_sessions", "INTEGER"),
    ("max_disk_mb", "INTEGER"),
    ("max_concurrency", "INTEGER"),
    ("cpu_seconds_per_hour", "INTEGER"),
    ("max_timeout_seconds", "INTEGER"),
    ("admin", "INTEGER NOT NULL DEFAULT 0"),
    ("egress", "TEXT"),
    ("secrets", "TEXT"),
];

/// One key as stored. Limits: `None` = unlimited.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct KeyRecord {
    /// SHA-256 of the key, hex.
    pub hash: String,
    pub tenant: String,
    pub created_ms: i64,
    pub rate_limit: Option<i64>,
    pub max_sessions: Option<i64>,
    pub max_disk_mb: Option<i64>,
    pub max_concurrency: Option<i64>,
    pub cpu_seconds_per_hour: Option<i64>,
    pub max_timeout_seconds: Option<i64>,
    /// May read `/metrics` and the admin routes.
    pub admin: bool,
    /// The key's egress policy layer as JSON.
    pub egress: Option<String>,
    /// The key's secrets as JSON, their values sealed (never in the clear).
    pub secrets: Option<String>,
}

const COLS: &str = "hash, tenant, created_ms, rate_limit, max_sessions, max_disk_mb, max_concurrency, \
                    cpu_seconds_per_hour, max_timeout_seconds, admin, egress, secrets";

fn key_row(r: &Row) -> Result<KeyRecord, crate::db::DbError> {
    Ok(KeyRecord {
        hash: r.text(0)?,
        tenant: r.text(1)?,
        created_ms: r.i64(2)?,
        rate_limit: r.opt_i64(3)?,
        max_sessions: r.opt_i64(4)?,
        max_disk_mb: r.opt_i64(5)?,
        max_concurrency: r.opt_i64(6)?,
        cpu_seconds_per_hour: r.opt_i64(7)?,
        max_timeout_seconds: r.opt_i64(8)?,
        admin: r.i64(9)? != 0,
        egress: r.opt_text(10)?,
        secrets: r.opt_text(11)?,
    })
}

/// The key records of a data directory or a cluster.
pub struct KeyDb {
    conn: Mutex<Conn>,
    /// PostgreSQL: to connect again after the server closed the connection.
    url: Option<String>,
}

impl KeyDb {
    /// The keys in PostgreSQL at `database` (schema migrated), else in `home`'s `keys.db`.
    pub fn open(home: &Path, database: Option<&str>) -> Result<KeyDb, StoreError> {
        match database {
            Some(url) => {
                let mut conn = Conn::postgres(url).op("connect to PostgreSQL")?;
                crate::store::migrate_postgres(&mut conn)?;
                let db = KeyDb { conn: Mutex::new(conn), url: Some(url.to_owned()) };
                db.import(home)?;
                Ok(db)
            }
            None => Self::open_sqlite(&keys_path(home)),
        }
    }

    fn open_sqlite(path: &Path) -> Result<KeyDb, StoreError> {
        if let Some(dir) = path.parent() {
            std::fs::create_dir_all(dir).map_err(|source| StoreError::Io { path: dir.to_path_buf(), source })?;
        }
        let conn = rusqlite::Connection::open(path).op("open keys.db")?;
        conn.busy_timeout(BUSY_TIMEOUT).op("keys.db: busy_timeout")?;
        conn.execute_batch(
            "CREATE TABLE IF NOT EXISTS api_keys (
                 hash TEXT PRIMARY KEY,
                 tenant TEXT NOT NULL,
                 created_ms INTEGER NOT NULL
             );",
        )
        .op("keys.db: create")?;
        let have: Vec<String> = conn
            .prepare("SELECT name FROM pragma_table_info('api_keys')")
            .and_then(|mut st| st.query_map([], |r| r.get(0))?.collect())
            .op("keys.db: columns")?;
        for (col, ty) in SQLITE_LIMIT_COLUMNS {
            if !have.iter().any(|h| h == col) {
                // Two processes may race here; a duplicate column from the other one is fine.
                match conn.execute_batch(&format!("ALTER TABLE api_keys ADD COLUMN {col} {ty}")) {
                    Err(e) if !e.to_string().contains("duplicate column") => {
                        return Err(e).op("keys.db: add a column");
                    }
                    _ => {}
                }
            }
        }
        Ok(KeyDb { conn: Mutex::new(Conn::Sqlite(conn)), url: None })
    }

    /// A data directory that moves to a shared database brings its keys
    /// along: copied from its `keys.db` while the database has none.
    fn import(&self, home: &Path) -> Result<(), StoreError> {
        if self.count()? > 0 || !keys_path(home).is_file() {
            return Ok(());
        }
        let local = Self::open_sqlite(&keys_path(home))?.all()?;
        for k in &local {
            self.insert(k)?;
        }
        if !local.is_empty() {
            tracing::info!(
                "copied {} API keys from the data directory's keys.db into the shared database",
                local.len()
            );
        }
        Ok(())
    }

    fn all(&self) -> Result<Vec<KeyRecord>, StoreError> {
        let rows =
            self.conn().query(&format!("SELECT {COLS} FROM api_keys ORDER BY created_ms, hash"), &[]).op("keys")?;
        rows.iter().map(key_row).collect::<Result<_, _>>().op("keys")
    }

    fn conn(&self) -> MutexGuard<'_, Conn> {
        let mut c = self.conn.lock().unwrap_or_else(|e| e.into_inner());
        c.reopen_if_closed(self.url.as_deref(), |_| true);
        c
    }

    /// Whether the keys are in a shared PostgreSQL database.
    pub fn is_shared(&self) -> bool {
        self.url.is_some()
    }

    pub fn insert(&self, k: &KeyRecord) -> Result<(), StoreError> {
        self.conn()
            .execute(
                &format!("INSERT INTO api_keys ({COLS}) VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8, ?9, ?10, ?11, ?12)"),
                vals![
                    &k.hash,
                    &k.tenant,
                    k.created_ms,
                    k.rate_limit,
                    k.max_sessions,
                    k.max_disk_mb,
                    k.max_concurrency,
                    k.cpu_seconds_per_hour,
                    k.max_timeout_seconds,
                    i64::from(k.admin),
                    &k.egress,
                    &k.secrets
                ],
            )
            .op("insert key")?;
        Ok(())
    }

    /// The record of the key with this hash.
    pub fn get(&self, hash: &str) -> Result<Option<KeyRecord>, StoreError> {
        let row =
            self.conn().query_opt(&format!("SELECT {COLS} FROM api_keys WHERE hash = ?1"), vals![hash]).op("key")?;
        row.as_ref().map(key_row).transpose().op("key")
    }

    /// Replace the secrets of the key with this hash (JSON, sealed; None:
    /// none). False if there was no such key.
    pub fn set_secrets(&self, hash: &str, secrets: Option<&str>) -> Result<bool, StoreError> {
        let n = self
            .conn()
            .execute("UPDATE api_keys SET secrets = ?2 WHERE hash = ?1", vals![hash, secrets])
            .op("set key secrets")?;
        Ok(n > 0)
    }

    /// At most `limit` records in the order of their hashes, those after
    /// `after` (`""`: from the first), of `tenant` only if given.
    pub fn page(&self, after: &str, limit: usize, tenant: Option<&str>) -> Result<Vec<KeyRecord>, StoreError> {
        let limit = i64::try_from(limit).unwrap_or(i64::MAX);
        let rows = match tenant {
            Some(t) => self.conn().query(
                &format!("SELECT {COLS} FROM api_keys WHERE hash > ?1 AND tenant = ?3 ORDER BY hash LIMIT ?2"),
                vals![after, limit, t],
            ),
            None => self.conn().query(
                &format!("SELECT {COLS} FROM api_keys WHERE hash > ?1 ORDER BY hash LIMIT ?2"),
                vals![after, limit],
            ),
        }
        .op("list keys")?;
        rows.iter().map(key_row).collect::<Result<_, _>>().op("list keys")
    }

    /// Which of `hashes` are keys still, each with its secrets (JSON): what a
    /// server that cached them checks them against (a key deleted by another
    /// process, or another node of a cluster, stops working).
    pub fn present(&self, hashes: &[String]) -> Result<Vec<(String, Option<String>)>, StoreError> {
        let rows = self
            .conn()
            .query("SELECT hash, secrets FROM api_keys WHERE hash IN_LIST(?1)", vals![hashes])
            .op("check keys")?;
        rows.iter()
            .map(|r| Ok((r.text(0)?, r.opt_text(1)?)))
            .collect::<Result<_, crate::db::DbError>>()
            .op("check keys")
    }

    /// False if there was no such key.
    pub fn delete(&self, hash: &str) -> Result<bool, StoreError> {
        Ok(self.conn().execute("DELETE FROM api_keys WHERE hash = ?1", vals![hash]).op("delete key")? > 0)
    }

    pub fn count(&self) -> Result<u64, StoreError> {
        let row = self.conn().query_opt("SELECT COUNT(*) FROM api_keys", &[]).op("count keys")?;
        Ok(row.map(|r| r.u64(0)).transpose().op("count keys")?.unwrap_or(0))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn record(hash: &str, admin: bool) -> KeyRecord {
        KeyRecord {
            hash: hash.into(),
            tenant: "t".into(),
            created_ms: 5,
            rate_limit: Some(10),
            max_concurrency: Some(0),
            admin,
            egress: Some("{\"allow\":[]}".into()),
            secrets: admin.then(|| "[]".into()),
            ..KeyRecord::default()
        }
    }

    fn round_trip(db: &KeyDb) {
        assert_eq!(db.count().unwrap(), 0);
        db.insert(&record("aa", true)).unwrap();
        db.insert(&record("bb", false)).unwrap();
        assert!(db.insert(&record("bb", false)).is_err(), "a hash is unique");
        assert_eq!(db.count().unwrap(), 2);
        assert_eq!(db.get("aa").unwrap(), Some(record("aa", true)));
        assert_eq!(db.get("bb").unwrap().map(|k| k.admin), Some(false));
        assert_eq!(db.get("cc").unwrap(), None);
        assert!(db.set_secrets("bb", Some("[{\"name\":\"K\"}]")).unwrap());
        assert_eq!(db.get("bb").unwrap().and_then(|k| k.secrets).as_deref(), Some("[{\"name\":\"K\"}]"));
        assert!(db.set_secrets("bb", None).unwrap());
        assert_eq!(db.get("bb").unwrap(), Some(record("bb", false)));
        assert!(!db.set_secrets("cc", None).unwrap());
        // Pages in the order of the hashes; by tenant.
        let hashes = |v: Vec<KeyRecord>| v.into_iter().map(|k| k.hash).collect::<Vec<_>>();
        assert_eq!(hashes(db.page("", 10, None).unwrap()), ["aa", "bb"]);
        assert_eq!(hashes(db.page("", 1, None).unwrap()), ["aa"]);
        assert_eq!(hashes(db.page("aa", 1, None).unwrap()), ["bb"]);
        assert!(db.page("bb", 10, None).unwrap().is_empty());
        assert_eq!(hashes(db.page("", 10, Some("t")).unwrap()), ["aa", "bb"]);
        assert!(db.page("", 10, Some("other")).unwrap().is_empty());
        let names = |v: &[&str]| v.iter().map(|s| s.to_string()).collect::<Vec<_>>();
        let mut present = db.present(&names(&["aa", "bb", "zz"])).unwrap();
        present.sort();
        assert_eq!(present, [("aa".to_string(), Some("[]".to_string())), ("bb".to_string(), None)]);
        assert!(db.present(&[]).unwrap().is_empty());
        assert!(db.delete("aa").unwrap());
        assert!(!db.delete("aa").unwrap());
        assert_eq!(db.count().unwrap(), 1);
    }

    #[test]
    fn keys_in_the_data_directory() {
        let home = tempfile::tempdir().unwrap();
        let db = KeyDb::open(home.path(), None).unwrap();
        assert!(!db.is_shared());
        round_trip(&db);
        assert!(keys_path(home.path()).is_file());
        // Opened again (a second process): the same keys.
        assert_eq!(KeyDb::open(home.path(), None).unwrap().count().unwrap(), 1);
    }

    #[test]
    fn an_old_keys_db_gets_the_new_columns() {
        let home = tempfile::tempdir().unwrap();
        let path = keys_path(home.path());
        std::fs::create_dir_all(path.parent().unwrap()).unwrap();
        let c = rusqlite::Connection::open(&path).unwrap();
        c.execute_batch(
            "CREATE TABLE api_keys (hash TEXT PRIMARY KEY, tenant TEXT NOT NULL, created_ms INTEGER NOT NULL); \
                         INSERT INTO api_keys VALUES ('old', 'o', 1);",
        )
        .unwrap();
        drop(c);
        let db = KeyDb::open(home.path(), None).unwrap();
        let old = db.get("old").unwrap().unwrap();
        assert_eq!((old.tenant.as_str(), old.rate_limit, old.admin, old.egress), ("o", None, false, None));
        assert_eq!(old.secrets, None);
    }

    #[test]
    fn keys_in_postgres_are_shared_by_every_node() {
        let pg = forkbox_testkit::postgres::Postgres::start();
        let a = KeyDb::open(Path::new("/nonexistent"), Some(&pg.url())).unwrap();
        assert!(a.is_shared());
        round_trip(&a);
        let b = KeyDb::open(Path::new("/nonexistent"), Some(&pg.url())).unwrap();
        assert_eq!(b.get("bb").unwrap(), Some(record("bb", false)));
        // A data directory joining a database that has keys keeps its own out.
        let home = tempfile::tempdir().unwrap();
        KeyDb::open(home.path(), None).unwrap().insert(&record("local", false)).unwrap();
        assert_eq!(KeyDb::open(home.path(), Some(&pg.url())).unwrap().get("local").unwrap(), None);
        // An empty database takes the keys of the first data directory that joins it.
        b.delete("bb").unwrap();
        let c = KeyDb::open(home.path(), Some(&pg.url())).unwrap();
        assert_eq!(c.get("local").unwrap(), Some(record("local", false)));
        // The sessions' store opens the same, migrated database.
        crate::store::Store::open_postgres(&pg.url()).unwrap();
        // A connection dropped on a thread that drives async tasks (a server's
        // state at shutdown) closes without panicking.
        let rt = tokio::runtime::Builder::new_current_thread().build().unwrap();
        let d = KeyDb::open(Path::new("/nonexistent"), Some(&pg.url())).unwrap();
        rt.block_on(async move { drop(d) });
        assert_eq!(c.count().unwrap(), 1);
    }
}
