//! The SQL connection under the session store: SQLite (the embedded default,
//! one file in the data directory) or PostgreSQL (`--database postgres://...`,
//! shared by the nodes of a cluster).
//!
//! The store's statements are written once, in the SQL both engines accept,
//! with SQLite's `?N` placeholders (rewritten to `$N` for PostgreSQL) and one
//! extension: `IN_LIST(?N)` / `NOT_IN_LIST(?N)` test membership in a list of ids
//! or names passed as one parameter ([`Value::Ids`], [`Value::Names`]), which SQLite spells with
//! `json_each` and PostgreSQL with `= ANY` / `<> ALL` of an array; and `NOW_MS()`, the
//! database server's clock in Unix milliseconds (the nodes of a cluster compare lease ages on
//! one clock, not on their own). Values cross
//! as [`Value`]s, rows come back as [`Row`]s of them, so no engine type leaks
//! into the store. Integers are 64-bit on both sides (PostgreSQL columns are
//! `BIGINT`; a sum is cast back to `BIGINT`).

use std::collections::HashMap;

/// A parameter or a column value.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Value {
    Null,
    Int(i64),
    Text(String),
    /// A list of ids, for `IN_LIST(?N)`.
    Ids(Vec<i64>),
    /// A list of names, for `IN_LIST(?N)`.
    Names(Vec<String>),
}

impl From<i64> for Value {
    fn from(v: i64) -> Value {
        Value::Int(v)
    }
}

impl From<&str> for Value {
    fn from(v: &str) -> Value {
        Value::Text(v.to_owned())
    }
}

impl From<&String> for Value {
    fn from(v: &String) -> Value {
        Value::Text(v.clone())
    }
}

impl From<Option<i64>> for Value {
    fn from(v: Option<i64>) -> Value {
        v.map_or(Value::Null, Value::Int)
    }
}

impl From<Option<&str>> for Value {
    fn from(v: Option<&str>) -> Value {
        v.map_or(Value::Null, Value::from)
    }
}

impl From<&Option<String>> for Value {
    fn from(v: &Option<String>) -> Value {
        v.as_deref().into()
    }
}

impl From<&[i64]> for Value {
    fn from(v: &[i64]) -> Value {
        Value::Ids(v.to_vec())
    }
}

impl From<&[String]> for Value {
    fn from(v: &[String]) -> Value {
        Value::Names(v.to_vec())
    }
}

/// `vals![a, b, ...]`: a parameter list.
macro_rules! vals {
    ($($v:expr),* $(,)?) => { &[$($crate::db::Value::from($v)),*][..] };
}
pub(crate) use vals;

#[derive(Debug, thiserror::Error)]
pub enum DbError {
    #[error("{0}")]
    Sqlite(#[from] rusqlite::Error),
    #[error("{0}")]
    Postgres(#[from] postgres::Error),
    #[error("column {col}: expected {want}, found {found}")]
    Type { col: usize, want: &'static str, found: String },
    #[error("unsupported column type {0}")]
    ColumnType(String),
    #[error("not a PostgreSQL URL (postgres://... or postgresql://...)")]
    NotPostgres,
}

impl DbError {
    /// The database could not be reached (refused, closed, shut down): the
    /// operation may succeed when it is back, unlike a refused statement.
    pub fn is_unavailable(&self) -> bool {
        match self {
            DbError::Postgres(e) => match e.as_db_error() {
                // Not from the server: connecting, I/O, a closed connection.
                None => true,
                // Connection exceptions (08) and operator intervention (57: shutdown).
                Some(db) => matches!(db.code().code().get(..2), Some("08" | "57")),
            },
            _ => false,
        }
    }
}

/// One result row.
#[derive(Debug)]
pub(crate) struct Row(Vec<Value>);

impl Row {
    fn at(&self, col: usize) -> Result<&Value, DbError> {
        self.0.get(col).ok_or(DbError::Type { col, want: "a column", found: "no such column".into() })
    }

    fn mismatch(&self, col: usize, want: &'static str) -> DbError {
        DbError::Type { col, want, found: format!("{:?}", self.0.get(col)) }
    }

    pub(crate) fn opt_i64(&self, col: usize) -> Result<Option<i64>, DbError> {
        match self.at(col)? {
            Value::Null => Ok(None),
            Value::Int(v) => Ok(Some(*v)),
            _ => Err(self.mismatch(col, "an integer")),
        }
    }

    pub(crate) fn i64(&self, col: usize) -> Result<i64, DbError> {
        self.opt_i64(col)?.ok_or_else(|| self.mismatch(col, "an integer"))
    }

    /// A non-negative integer.
    pub(crate) fn u64(&self, col: usize) -> Result<u64, DbError> {
        u64::try_from(self.i64(col)?).map_err(|_| self.mismatch(col, "a non-negative integer"))
    }

    pub(crate) fn opt_text(&self, col: usize) -> Result<Option<String>, DbError> {
        match self.at(col)? {
            Value::Null => Ok(None),
            Value::Text(v) => Ok(Some(v.clone())),
            _ => Err(self.mismatch(col, "text")),
        }
    }

    pub(crate) fn text(&self, col: usize) -> Result<String, DbError> {
        self.opt_text(col)?.ok_or_else(|| self.mismatch(col, "text"))
    }
}

/// Which database engine a connection talks to.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Backend {
    Sqlite,
    Postgres,
}

pub(crate) enum Conn {
    Sqlite(rusqlite::Connection),
    Postgres(Box<Pg>),
}

pub(crate) struct Pg {
    /// Dropped by `Pg`'s own `Drop` (see there).
    client: std::mem::ManuallyDrop<postgres::Client>,
    /// Prepared statements by their (rewritten) text.
    cache: HashMap<String, postgres::Statement>,
}

/// The PostgreSQL advisory lock every writing transaction holds ("forkbox" in ASCII).
pub const WRITER_LOCK: i64 = 0x66_6f72_6b62_6f78;

/// True if `url` names a PostgreSQL database.
pub fn is_postgres_url(url: &str) -> bool {
    url.starts_with("postgres://") || url.starts_with("postgresql://")
}

/// `url` with its database name replaced by `name` (query parameters kept).
fn with_database(url: &str, name: &str) -> Result<String, DbError> {
    let scheme_end = url.find("://").ok_or(DbError::NotPostgres)? + 3;
    let rest = &url[scheme_end..];
    let host_end = rest.find(['/', '?']).unwrap_or(rest.len());
    let query = rest[host_end..].find('?').map_or("", |q| &rest[host_end + q..]);
    Ok(format!("{}{}/{name}{query}", &url[..scheme_end], &rest[..host_end]))
}

/// A new, empty database `name` (dropped first if it exists) on the server
/// of `url`, which must allow `CREATE DATABASE`; returns its URL. For
/// benchmarks and tests that need several databases of one server.
pub fn scratch_database(url: &str, name: &str) -> Result<String, DbError> {
    let Conn::Postgres(mut pg) = Conn::postgres(url)? else { return Err(DbError::NotPostgres) };
    let ident = quote_ident(name);
    pg.client.batch_execute(&format!("DROP DATABASE IF EXISTS {ident}"))?;
    pg.client.batch_execute(&format!("CREATE DATABASE {ident}"))?;
    with_database(url, name)
}

/// Drops a database made by [`scratch_database`] (no one may be connected to it).
pub fn drop_database(url: &str, name: &str) -> Result<(), DbError> {
    let Conn::Postgres(mut pg) = Conn::postgres(url)? else { return Err(DbError::NotPostgres) };
    Ok(pg.client.batch_execute(&format!("DROP DATABASE IF EXISTS {}", quote_ident(name)))?)
}

/// A name from the caller as a PostgreSQL identifier (double quotes doubled).
fn quote_ident(name: &str) -> String {
    format!("\"{}\"", name.replace('"', "\"\""))
}

impl Conn {
    pub(crate) fn postgres(url: &str) -> Result<Conn, DbError> {
        if !is_postgres_url(url) {
            return Err(DbError::NotPostgres);
        }
        let client = postgres::Client::connect(url, postgres::NoTls)?;
        Ok(Conn::Postgres(Box::new(Pg { client: std::mem::ManuallyDrop::new(client), cache: HashMap::new() })))
    }

    pub(crate) fn backend(&self) -> Backend {
        match self {
            Conn::Sqlite(_) => Backend::Sqlite,
            Conn::Postgres(_) => Backend::Postgres,
        }
    }

    /// If the server closed this connection (a restart, a failover), a new one
    /// to `url`, set up by `setup` (e.g. a claim taken again); if that fails the
    /// closed one stays and the next statement reports the failure.
    pub(crate) fn reopen_if_closed(&mut self, url: Option<&str>, setup: impl FnOnce(&mut Conn) -> bool) {
        if !self.is_closed() {
            return;
        }
        if let Some(mut fresh) = url.and_then(|u| Conn::postgres(u).ok()) {
            if setup(&mut fresh) {
                *self = fresh;
            }
        }
    }

    /// True if the connection is gone for good (PostgreSQL: the server closed it).
    pub(crate) fn is_closed(&self) -> bool {
        match self {
            Conn::Sqlite(_) => false,
            Conn::Postgres(pg) => pg.client.is_closed(),
        }
    }

    /// Runs a statement; the number of rows it changed.
    pub(crate) fn execute(&mut self, sql: &str, params: &[Value]) -> Result<u64, DbError> {
        match self {
            Conn::Sqlite(c) => {
                let sql = sqlite_sql(sql);
                let mut st = c.prepare_cached(&sql)?;
                let n = st.execute(rusqlite::params_from_iter(params.iter().map(SqliteValue)))?;
                Ok(n as u64)
            }
            Conn::Postgres(pg) => {
                let st = pg.prepare(sql)?;
                let args = pg_args(params);
                Ok(pg.client.execute(&st, &pg_refs(&args))?)
            }
        }
    }

    /// Every row of a query.
    pub(crate) fn query(&mut self, sql: &str, params: &[Value]) -> Result<Vec<Row>, DbError> {
        match self {
            Conn::Sqlite(c) => {
                let sql = sqlite_sql(sql);
                let mut st = c.prepare_cached(&sql)?;
                let cols = st.column_count();
                let mut rows = st.query(rusqlite::params_from_iter(params.iter().map(SqliteValue)))?;
                let mut out = Vec::new();
                while let Some(r) = rows.next()? {
                    let mut v = Vec::with_capacity(cols);
                    for i in 0..cols {
                        v.push(match r.get_ref(i)? {
                            rusqlite::types::ValueRef::Null => Value::Null,
                            rusqlite::types::ValueRef::Integer(n) => Value::Int(n),
                            rusqlite::types::ValueRef::Text(t) => Value::Text(String::from_utf8_lossy(t).into_owned()),
                            other => return Err(DbError::ColumnType(format!("{:?}", other.data_type()))),
                        });
                    }
                    out.push(Row(v));
                }
                Ok(out)
            }
            Conn::Postgres(pg) => {
                let st = pg.prepare(sql)?;
                let args = pg_args(params);
                let rows = pg.client.query(&st, &pg_refs(&args))?;
                rows.iter().map(pg_row).collect()
            }
        }
    }

    /// The first row of a query, if any.
    pub(crate) fn query_opt(&mut self, sql: &str, params: &[Value]) -> Result<Option<Row>, DbError> {
        Ok(self.query(sql, params)?.into_iter().next())
    }

    /// Whether a query returns a row.
    pub(crate) fn exists(&mut self, sql: &str, params: &[Value]) -> Result<bool, DbError> {
        Ok(!self.query(sql, params)?.is_empty())
    }

    /// Several statements without parameters (migrations).
    pub(crate) fn batch(&mut self, sql: &str) -> Result<(), DbError> {
        match self {
            Conn::Sqlite(c) => Ok(c.execute_batch(sql)?),
            Conn::Postgres(pg) => Ok(pg.client.batch_execute(sql)?),
        }
    }

    /// Begins a transaction that writes. Writers are serialized, on both
    /// engines, so that a transaction's checks (a checkpoint exists, is no
    /// one's head) still hold when it commits: SQLite's `BEGIN IMMEDIATE`
    /// takes the write lock first; on PostgreSQL every writing transaction
    /// takes one transaction-level advisory lock ([`WRITER_LOCK`]), so the
    /// nodes sharing a database commit one at a time, as SQLite's writers do.
    /// Rolled back when the guard drops uncommitted.
    pub(crate) fn begin(&mut self) -> Result<Tx<'_>, DbError> {
        match self {
            Conn::Sqlite(c) => c.execute_batch("BEGIN IMMEDIATE")?,
            Conn::Postgres(pg) => {
                pg.client.batch_execute(&format!("BEGIN; SELECT pg_advisory_xact_lock({WRITER_LOCK})"))?
            }
        }
        Ok(Tx { conn: self, open: true })
    }
}

/// An open transaction on a [`Conn`].
pub(crate) struct Tx<'a> {
    conn: &'a mut Conn,
    open: bool,
}

impl Tx<'_> {
    pub(crate) fn commit(mut self) -> Result<(), DbError> {
        self.open = false;
        self.conn.batch("COMMIT")
    }
}

impl std::ops::Deref for Tx<'_> {
    type Target = Conn;
    fn deref(&self) -> &Conn {
        self.conn
    }
}

impl std::ops::DerefMut for Tx<'_> {
    fn deref_mut(&mut self) -> &mut Conn {
        self.conn
    }
}

impl Drop for Tx<'_> {
    fn drop(&mut self) {
        if self.open {
            // A failed rollback leaves nothing to undo here: SQLite rolls an
            // errored transaction back itself, a broken PostgreSQL connection
            // is replaced (`is_closed`).
            let _ = self.conn.batch("ROLLBACK");
        }
    }
}

impl Drop for Pg {
    fn drop(&mut self) {
        // SAFETY: the client is taken once, here, and never used again.
        let client = unsafe { std::mem::ManuallyDrop::take(&mut self.client) };
        // `postgres::Client` closes by blocking on its own runtime, which
        // panics on a thread that drives async tasks (a server's state dropped
        // there): close it on a thread of its own then.
        if tokio::runtime::Handle::try_current().is_ok() {
            if let Err(e) = std::thread::Builder::new().name("forkbox-pg-close".into()).spawn(move || drop(client)) {
                tracing::warn!("closing a PostgreSQL connection: {e}");
            }
        } else {
            drop(client);
        }
    }
}

impl Pg {
    fn prepare(&mut self, sql: &str) -> Result<postgres::Statement, DbError> {
        if let Some(st) = self.cache.get(sql) {
            return Ok(st.clone());
        }
        let st = self.client.prepare(&postgres_sql(sql))?;
        self.cache.insert(sql.to_owned(), st.clone());
        Ok(st)
    }
}

/// `NOW_MS()` in SQLite: the Unix time in milliseconds (julianday has sub-millisecond precision).
const SQLITE_NOW_MS: &str = "CAST((julianday('now') - 2440587.5) * 86400000.0 AS INTEGER)";
/// `NOW_MS()` in PostgreSQL: the wall clock at the statement (not the transaction's start).
const POSTGRES_NOW_MS: &str = "CAST(EXTRACT(EPOCH FROM clock_timestamp()) * 1000 AS BIGINT)";

/// The store's SQL for SQLite: `IN_LIST(?N)` as a `json_each` sub-query.
fn sqlite_sql(sql: &str) -> std::borrow::Cow<'_, str> {
    if !sql.contains("IN_LIST(") && !sql.contains("NOW_MS()") {
        return sql.into();
    }
    rewrite_lists(sql, |not, p| format!("{}IN (SELECT value FROM json_each({p}))", if not { "NOT " } else { "" }))
        .replace("NOW_MS()", SQLITE_NOW_MS)
        .into()
}

/// The store's SQL for PostgreSQL: `$N` placeholders, arrays for `IN_LIST`.
fn postgres_sql(sql: &str) -> String {
    let sql = rewrite_lists(sql, |not, p| if not { format!("<> ALL({p})") } else { format!("= ANY({p})") })
        .replace("NOW_MS()", POSTGRES_NOW_MS);
    let mut out = String::with_capacity(sql.len());
    let mut chars = sql.chars().peekable();
    while let Some(c) = chars.next() {
        if c == '?' && chars.peek().is_some_and(char::is_ascii_digit) {
            out.push('$');
        } else {
            out.push(c);
        }
    }
    out
}

/// Replaces every `NOT_IN_LIST(p)` / `IN_LIST(p)` by `f(not, p)`.
fn rewrite_lists(sql: &str, f: impl Fn(bool, &str) -> String) -> String {
    let mut out = String::with_capacity(sql.len() + 32);
    let mut rest = sql;
    while let Some(at) = rest.find("IN_LIST(") {
        let not = rest[..at].ends_with("NOT_");
        let head = if not { &rest[..at - 4] } else { &rest[..at] };
        out.push_str(head);
        let args = &rest[at + "IN_LIST(".len()..];
        let end = args.find(')').unwrap_or(args.len());
        out.push_str(&f(not, &args[..end]));
        rest = args.get(end + 1..).unwrap_or("");
    }
    out.push_str(rest);
    out
}

struct SqliteValue<'a>(&'a Value);

impl rusqlite::ToSql for SqliteValue<'_> {
    fn to_sql(&self) -> rusqlite::Result<rusqlite::types::ToSqlOutput<'_>> {
        use rusqlite::types::{ToSqlOutput, ValueRef};
        Ok(match self.0 {
            Value::Null => ToSqlOutput::Borrowed(ValueRef::Null),
            Value::Int(v) => ToSqlOutput::Borrowed(ValueRef::Integer(*v)),
            Value::Text(s) => ToSqlOutput::Borrowed(ValueRef::Text(s.as_bytes())),
            Value::Ids(ids) => {
                let list = ids.iter().map(i64::to_string).collect::<Vec<_>>().join(",");
                ToSqlOutput::Owned(rusqlite::types::Value::Text(format!("[{list}]")))
            }
            // A JSON array of strings, for json_each (serde_json escapes them).
            Value::Names(names) => ToSqlOutput::Owned(rusqlite::types::Value::Text(
                serde_json::to_string(names).map_err(|e| rusqlite::Error::ToSqlConversionFailure(Box::new(e)))?,
            )),
        })
    }
}

#[derive(Debug)]
struct PgValue<'a>(&'a Value);

impl postgres::types::ToSql for PgValue<'_> {
    fn to_sql(
        &self,
        ty: &postgres::types::Type,
        out: &mut bytes::BytesMut,
    ) -> Result<postgres::types::IsNull, Box<dyn std::error::Error + Sync + Send>> {
        use postgres::types::{IsNull, Type};
        match self.0 {
            Value::Null => Ok(IsNull::Yes),
            Value::Int(v) if *ty == Type::INT4 => i32::try_from(*v)?.to_sql(ty, out),
            Value::Int(v) => v.to_sql(ty, out),
            Value::Text(s) => s.as_str().to_sql(ty, out),
            Value::Ids(ids) => ids.to_sql(ty, out),
            Value::Names(names) => names.to_sql(ty, out),
        }
    }

    fn accepts(ty: &postgres::types::Type) -> bool {
        use postgres::types::Type;
        // Which of them fits is checked per value in `to_sql`.
        [Type::INT8, Type::INT4, Type::TEXT, Type::VARCHAR, Type::INT8_ARRAY, Type::TEXT_ARRAY].contains(ty)
    }

    postgres::types::to_sql_checked!();
}

fn pg_args(params: &[Value]) -> Vec<PgValue<'_>> {
    params.iter().map(PgValue).collect()
}

fn pg_refs<'a>(args: &'a [PgValue<'_>]) -> Vec<&'a (dyn postgres::types::ToSql + Sync)> {
    args.iter().map(|a| a as &(dyn postgres::types::ToSql + Sync)).collect()
}

fn pg_row(r: &postgres::Row) -> Result<Row, DbError> {
    use postgres::types::Type;
    let mut v = Vec::with_capacity(r.len());
    for (i, col) in r.columns().iter().enumerate() {
        let ty = col.type_();
        v.push(if *ty == Type::INT8 {
            r.try_get::<_, Option<i64>>(i)?.map_or(Value::Null, Value::Int)
        } else if *ty == Type::INT4 {
            r.try_get::<_, Option<i32>>(i)?.map_or(Value::Null, |n| Value::Int(n.into()))
        } else if *ty == Type::BOOL {
            r.try_get::<_, Option<bool>>(i)?.map_or(Value::Null, |b| Value::Int(b.into()))
        } else if *ty == Type::TEXT || *ty == Type::VARCHAR {
            r.try_get::<_, Option<String>>(i)?.map_or(Value::Null, Value::Text)
        } else {
            return Err(DbError::ColumnType(ty.name().to_owned()));
        });
    }
    Ok(Row(v))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn placeholders_and_id_lists_per_engine() {
        let sql = "SELECT id FROM t WHERE a = ?1 AND id IN_LIST(?2) AND parent NOT_IN_LIST(?2) AND b = '?'";
        assert_eq!(
            postgres_sql(sql),
            "SELECT id FROM t WHERE a = $1 AND id = ANY($2) AND parent <> ALL($2) AND b = '?'"
        );
        assert_eq!(
            sqlite_sql(sql),
            "SELECT id FROM t WHERE a = ?1 AND id IN (SELECT value FROM json_each(?2)) \
             AND parent NOT IN (SELECT value FROM json_each(?2)) AND b = '?'"
        );
        assert_eq!(sqlite_sql("SELECT 1"), "SELECT 1");
        assert_eq!(sqlite_sql("SELECT NOW_MS()"), format!("SELECT {SQLITE_NOW_MS}"));
        assert_eq!(postgres_sql("SELECT NOW_MS() - ?1"), format!("SELECT {POSTGRES_NOW_MS} - $1"));
    }

    #[test]
    fn sqlite_clock_is_the_unix_time_in_ms() {
        let mut c = Conn::Sqlite(rusqlite::Connection::open_in_memory().unwrap());
        let now = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap().as_millis() as i64;
        let db = c.query_opt("SELECT NOW_MS()", &[]).unwrap().unwrap().i64(0).unwrap();
        assert!((db - now).abs() < 1000, "{db} vs {now}");
    }

    #[test]
    fn database_names_in_urls() {
        assert_eq!(with_database("postgres://u@h:5/db", "x").unwrap(), "postgres://u@h:5/x");
        assert_eq!(
            with_database("postgres://u:p@h/db?sslmode=disable", "x").unwrap(),
            "postgres://u:p@h/x?sslmode=disable"
        );
        assert_eq!(with_database("postgresql://h", "x").unwrap(), "postgresql://h/x");
        assert_eq!(with_database("postgres://h?a=b", "x").unwrap(), "postgres://h/x?a=b");
    }

    #[test]
    fn sqlite_round_trip_and_rollback() {
        let mut c = Conn::Sqlite(rusqlite::Connection::open_in_memory().unwrap());
        c.batch("CREATE TABLE t (id INTEGER PRIMARY KEY, s TEXT)").unwrap();
        assert_eq!(c.execute("INSERT INTO t (id, s) VALUES (?1, ?2)", vals![1, "a"]).unwrap(), 1);
        c.execute("INSERT INTO t (id, s) VALUES (?1, ?2)", vals![2, None::<&str>]).unwrap();
        {
            let mut tx = c.begin().unwrap();
            tx.execute("DELETE FROM t", &[]).unwrap();
            // Dropped uncommitted: rolled back.
        }
        let rows = c.query("SELECT id, s FROM t WHERE id IN_LIST(?1) ORDER BY id", vals![&[1i64, 2][..]]).unwrap();
        let names = ["a".to_string(), "b\"',".to_string()];
        let by_name = c.query("SELECT id FROM t WHERE s IN_LIST(?1)", vals![&names[..]]).unwrap();
        assert_eq!(by_name.len(), 1);
        assert_eq!(rows.len(), 2);
        assert_eq!(rows[0].i64(0).unwrap(), 1);
        assert_eq!(rows[0].text(1).unwrap(), "a");
        assert_eq!(rows[1].opt_text(1).unwrap(), None);
        assert!(rows[1].text(1).is_err());
        assert!(rows[0].u64(1).is_err());
    }
}
