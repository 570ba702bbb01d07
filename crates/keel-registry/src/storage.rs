//! The storage under every registry operation: one trait, [`Storage`],
//! with SQLite ([`Sqlite`]) and PostgreSQL ([`Postgres`]) behind it.
//!
//! The registry's logic (numbering, hash chains, immutability checks,
//! searches) is written once, in `registry.rs`, as SQL that both databases
//! run unchanged: numbered `?N` parameters (rewritten to PostgreSQL's `$N`
//! here), integers as 64-bit, text, NULL, no dialect functions. What
//! differs lives here and in `db.rs`: opening, schema and migrations, and
//! how a write transaction is serialised.
//!
//! - SQLite: `BEGIN IMMEDIATE` takes the database's one write lock up front.
//! - PostgreSQL: `BEGIN` (read committed), then `SELECT ... FOR UPDATE` of
//!   the audit chain's head row in `meta`. Every change appends to the
//!   audit log, one hash chain per database, so every write transaction
//!   must follow the one before it anyway: the head row is that order made
//!   explicit. Every statement after the lock sees what the previous
//!   writer committed, so `MAX(number) + 1` is gapless and unique and both
//!   chains link to their true heads, whichever replica writes. A row lock,
//!   not an advisory lock: it lives in the registry's own data (no key
//!   space shared with other applications on the database), and it ends
//!   with the transaction, also when the connection dies (a replica killed
//!   mid-write: the server rolls the transaction back).
//!
//! Reads in a snapshot are `BEGIN DEFERRED` (SQLite, WAL) or `REPEATABLE
//! READ, READ ONLY` (PostgreSQL): every query of one request sees the same
//! committed state and waits for no writer.

use std::cell::{Cell, RefCell};
use std::collections::HashMap;
use std::fmt;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use crate::RegistryError;

/// A parameter of a statement.
#[derive(Debug, Clone, Copy)]
pub(crate) enum Param<'a> {
    Null,
    Int(i64),
    Text(&'a str),
}

/// What can be a statement parameter.
pub(crate) trait ToParam {
    fn param(&self) -> Param<'_>;
}

impl ToParam for i64 {
    fn param(&self) -> Param<'_> {
        Param::Int(*self)
    }
}

impl ToParam for str {
    fn param(&self) -> Param<'_> {
        Param::Text(self)
    }
}

impl ToParam for String {
    fn param(&self) -> Param<'_> {
        Param::Text(self)
    }
}

impl ToParam for Value {
    fn param(&self) -> Param<'_> {
        match self {
            Value::Null => Param::Null,
            Value::Int(v) => Param::Int(*v),
            Value::Text(s) => Param::Text(s),
        }
    }
}

impl<T: ToParam + ?Sized> ToParam for &T {
    fn param(&self) -> Param<'_> {
        (**self).param()
    }
}

impl<T: ToParam> ToParam for Option<T> {
    fn param(&self) -> Param<'_> {
        match self {
            Some(v) => v.param(),
            None => Param::Null,
        }
    }
}

/// `params![a, b]`: a statement's parameters, in order (`?1`, `?2`).
macro_rules! params {
    ($($x:expr),* $(,)?) => {
        &[$($crate::storage::ToParam::param(&$x)),*] as &[$crate::storage::Param<'_>]
    };
}
pub(crate) use params;

/// A value read from a row.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Value {
    Null,
    Int(i64),
    Text(String),
}

/// One row of a result.
#[derive(Debug, Clone)]
pub(crate) struct Row(pub(crate) Vec<Value>);

impl Row {
    /// Column `i` as `T`.
    pub(crate) fn get<T: FromValue>(&self, i: usize) -> Result<T, DbError> {
        let v = self
            .0
            .get(i)
            .ok_or_else(|| DbError::Value(format!("no column {i}")))?;
        T::from_value(v)
            .ok_or_else(|| DbError::Value(format!("column {i} holds {v:?}, not the type expected")))
    }
}

/// What a column can be read as.
pub(crate) trait FromValue: Sized {
    fn from_value(v: &Value) -> Option<Self>;
}

impl FromValue for i64 {
    fn from_value(v: &Value) -> Option<Self> {
        match v {
            Value::Int(i) => Some(*i),
            _ => None,
        }
    }
}

impl FromValue for String {
    fn from_value(v: &Value) -> Option<Self> {
        match v {
            Value::Text(s) => Some(s.clone()),
            _ => None,
        }
    }
}

impl FromValue for Value {
    fn from_value(v: &Value) -> Option<Self> {
        Some(v.clone())
    }
}

impl<T: FromValue> FromValue for Option<T> {
    fn from_value(v: &Value) -> Option<Self> {
        match v {
            Value::Null => Some(None),
            v => T::from_value(v).map(Some),
        }
    }
}

/// A database failure, from either store.
#[derive(Debug, thiserror::Error)]
pub enum DbError {
    #[error("SQLite: {0}")]
    Sqlite(#[from] rusqlite::Error),
    #[error("PostgreSQL: {}", pg_message(.0))]
    Postgres(#[from] postgres::Error),
    /// A row that does not have the shape the registry wrote.
    #[error("unexpected stored value: {0}")]
    Value(String),
    /// A statement found the connection unusable (lost inside a
    /// transaction, which cannot be resumed on another).
    #[error("the database connection was lost")]
    Lost,
    /// A statement returned no row where one was expected.
    #[error("no row found")]
    NoRow,
    /// The database's host did not answer in time.
    #[error("the database {location} {what} within {timeout:?}")]
    Unanswered {
        location: String,
        what: String,
        timeout: Duration,
    },
}

/// PostgreSQL's own message where the server sent one (the client's
/// `Display` says only "db error").
fn pg_message(e: &postgres::Error) -> String {
    match e.as_db_error() {
        Some(d) => format!("{}: {} ({})", d.severity(), d.message(), d.code().code()),
        None => {
            use std::error::Error as _;
            match e.source() {
                Some(s) => format!("{e}: {s}"),
                None => e.to_string(),
            }
        }
    }
}

impl DbError {
    /// Whether the failure is the database being unreachable, busy past
    /// its bounds or restarting, rather than the request: worth a retry
    /// (HTTP 503).
    pub fn is_unavailable(&self) -> bool {
        match self {
            DbError::Lost | DbError::Unanswered { .. } => true,
            DbError::Sqlite(e) => matches!(
                e.sqlite_error_code(),
                Some(rusqlite::ErrorCode::DatabaseBusy | rusqlite::ErrorCode::DatabaseLocked)
            ),
            DbError::Postgres(e) => pg_unavailable(e),
            DbError::Value(_) | DbError::NoRow => false,
        }
    }
}

fn pg_unavailable(e: &postgres::Error) -> bool {
    if e.is_closed() {
        return true;
    }
    if let Some(code) = e.code() {
        let c = code.code();
        // Class 08: connection exceptions; 57P01-57P03: the server shutting
        // down or starting; 57014: statement_timeout; 55P03:
        // lock_timeout; 53300: too many connections; 40001/40P01:
        // serialization failure and deadlock (retryable).
        return c.starts_with("08")
            || matches!(
                c,
                "57P01" | "57P02" | "57P03" | "57014" | "55P03" | "53300" | "40001" | "40P01"
            );
    }
    use std::error::Error as _;
    // No server error: the client could not connect, lost the socket or
    // timed out.
    e.source().is_some_and(|s| s.is::<std::io::Error>())
        || e.to_string().starts_with("timeout")
        || e.to_string().starts_with("error connecting")
        || e.to_string().starts_with("error communicating")
        || e.to_string().starts_with("error performing TLS")
}

/// Which kind of transaction to start.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum TxMode {
    /// Serialised with every other writer, on every replica.
    Write,
    /// One consistent snapshot, read-only.
    Read,
    /// A schema migration: a plain transaction (PostgreSQL: the caller
    /// takes its own lock; there may be no `meta` table yet).
    Schema,
}

/// Which database a storage is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Backend {
    Sqlite,
    Postgres,
}

/// One connection to the registry's database.
pub(crate) trait Storage: Send + fmt::Debug {
    fn backend(&self) -> Backend;
    /// Where the database is, for messages: a path, or a URL without
    /// its password.
    fn location(&self) -> &Path;
    fn query(&self, sql: &str, params: &[Param<'_>]) -> Result<Vec<Row>, DbError>;
    fn execute(&self, sql: &str, params: &[Param<'_>]) -> Result<u64, DbError>;
    /// Several statements without parameters (schema changes).
    fn execute_batch(&self, sql: &str) -> Result<(), DbError>;
    fn begin(&self, mode: TxMode) -> Result<(), DbError>;
    fn commit(&self) -> Result<(), DbError>;
    /// Ends a transaction without keeping anything; never fails (a
    /// connection that cannot roll back is dropped, which does the same).
    fn rollback(&self);
    /// Whether other connections can reach this database (a file, a
    /// server; not an in-memory SQLite).
    fn another_possible(&self) -> bool;
    /// The PostgreSQL server this connection is to.
    fn pg_target(&self) -> Option<&Arc<PgTarget>> {
        None
    }
    /// After rows were copied with their ids: the next id of each table
    /// follows the largest copied one (PostgreSQL's identity sequences).
    fn ids_follow_rows(&self, tables: &[&str]) -> Result<(), DbError>;
    /// The SQLite connection, for SQLite's own backup and restore.
    fn sqlite(&self) -> Option<&rusqlite::Connection> {
        None
    }
    fn sqlite_mut(&mut self) -> Option<&mut rusqlite::Connection> {
        None
    }
}

/// A connection with typed helpers over [`Storage`].
#[derive(Debug)]
pub(crate) struct Db(pub(crate) Box<dyn Storage>);

impl Db {
    pub(crate) fn backend(&self) -> Backend {
        self.0.backend()
    }

    pub(crate) fn execute(&self, sql: &str, params: &[Param<'_>]) -> Result<u64, DbError> {
        self.0.execute(sql, params)
    }

    /// Every row, each through `f`.
    pub(crate) fn query_map<T>(
        &self,
        sql: &str,
        params: &[Param<'_>],
        f: impl FnMut(&Row) -> Result<T, DbError>,
    ) -> Result<Vec<T>, DbError> {
        self.0.query(sql, params)?.iter().map(f).collect()
    }

    /// The first row through `f`, or [`DbError::NoRow`].
    pub(crate) fn query_row<T>(
        &self,
        sql: &str,
        params: &[Param<'_>],
        f: impl FnOnce(&Row) -> Result<T, DbError>,
    ) -> Result<T, DbError> {
        self.query_opt(sql, params, f)?.ok_or(DbError::NoRow)
    }

    /// The first row through `f`, if there is one.
    pub(crate) fn query_opt<T>(
        &self,
        sql: &str,
        params: &[Param<'_>],
        f: impl FnOnce(&Row) -> Result<T, DbError>,
    ) -> Result<Option<T>, DbError> {
        match self.0.query(sql, params)?.first() {
            Some(r) => f(r).map(Some),
            None => Ok(None),
        }
    }

    /// Starts a transaction; it rolls back when dropped uncommitted.
    pub(crate) fn begin(&self, mode: TxMode) -> Result<Tx<'_>, DbError> {
        self.0.begin(mode)?;
        Ok(Tx {
            db: self,
            done: false,
        })
    }
}

/// An open transaction on a [`Db`]: rolled back unless committed.
#[derive(Debug)]
pub(crate) struct Tx<'a> {
    db: &'a Db,
    done: bool,
}

impl Tx<'_> {
    pub(crate) fn commit(mut self) -> Result<(), DbError> {
        self.done = true;
        self.db.0.commit()
    }
}

impl std::ops::Deref for Tx<'_> {
    type Target = Db;
    fn deref(&self) -> &Db {
        self.db
    }
}

impl Drop for Tx<'_> {
    fn drop(&mut self) {
        if !self.done {
            self.db.0.rollback();
        }
    }
}

// ----- SQLite ------------------------------------------------------------

/// A SQLite connection.
#[derive(Debug)]
pub(crate) struct Sqlite {
    pub(crate) conn: rusqlite::Connection,
    path: PathBuf,
    /// Whether other connections can reach the database (a file).
    shared: bool,
}

impl Sqlite {
    pub(crate) fn new(conn: rusqlite::Connection, path: &Path, shared: bool) -> Self {
        conn.set_prepared_statement_cache_capacity(64);
        Self {
            conn,
            path: path.to_owned(),
            shared,
        }
    }
}

impl rusqlite::ToSql for Param<'_> {
    fn to_sql(&self) -> rusqlite::Result<rusqlite::types::ToSqlOutput<'_>> {
        use rusqlite::types::{ToSqlOutput, ValueRef};
        Ok(match self {
            Param::Null => ToSqlOutput::Borrowed(ValueRef::Null),
            Param::Int(v) => ToSqlOutput::Borrowed(ValueRef::Integer(*v)),
            Param::Text(s) => ToSqlOutput::Borrowed(ValueRef::Text(s.as_bytes())),
        })
    }
}

impl Storage for Sqlite {
    fn backend(&self) -> Backend {
        Backend::Sqlite
    }

    fn location(&self) -> &Path {
        &self.path
    }

    fn query(&self, sql: &str, params: &[Param<'_>]) -> Result<Vec<Row>, DbError> {
        use rusqlite::types::ValueRef;
        let mut st = self.conn.prepare_cached(sql)?;
        let n = st.column_count();
        let mut rows = st.query(rusqlite::params_from_iter(params.iter()))?;
        let mut out = Vec::new();
        while let Some(r) = rows.next()? {
            let mut row = Vec::with_capacity(n);
            for i in 0..n {
                row.push(match r.get_ref(i)? {
                    ValueRef::Null => Value::Null,
                    ValueRef::Integer(v) => Value::Int(v),
                    ValueRef::Text(t) => Value::Text(
                        std::str::from_utf8(t)
                            .map_err(|_| DbError::Value(format!("column {i} is not UTF-8")))?
                            .to_owned(),
                    ),
                    ValueRef::Real(_) | ValueRef::Blob(_) => {
                        return Err(DbError::Value(format!(
                            "column {i} holds a number or blob the registry never writes"
                        )))
                    }
                });
            }
            out.push(Row(row));
        }
        Ok(out)
    }

    fn execute(&self, sql: &str, params: &[Param<'_>]) -> Result<u64, DbError> {
        let mut st = self.conn.prepare_cached(sql)?;
        Ok(st.execute(rusqlite::params_from_iter(params.iter()))? as u64)
    }

    fn execute_batch(&self, sql: &str) -> Result<(), DbError> {
        Ok(self.conn.execute_batch(sql)?)
    }

    fn begin(&self, mode: TxMode) -> Result<(), DbError> {
        Ok(self.conn.execute_batch(match mode {
            TxMode::Write | TxMode::Schema => "BEGIN IMMEDIATE",
            TxMode::Read => "BEGIN DEFERRED",
        })?)
    }

    fn commit(&self) -> Result<(), DbError> {
        Ok(self.conn.execute_batch("COMMIT")?)
    }

    fn rollback(&self) {
        if !self.conn.is_autocommit() {
            let _ = self.conn.execute_batch("ROLLBACK");
        }
    }

    fn another_possible(&self) -> bool {
        self.shared
    }

    fn ids_follow_rows(&self, _tables: &[&str]) -> Result<(), DbError> {
        // INTEGER PRIMARY KEY: the next rowid is always past the largest.
        Ok(())
    }

    fn sqlite(&self) -> Option<&rusqlite::Connection> {
        Some(&self.conn)
    }

    fn sqlite_mut(&mut self) -> Option<&mut rusqlite::Connection> {
        Some(&mut self.conn)
    }
}

// ----- PostgreSQL --------------------------------------------------------

/// How to reach a PostgreSQL registry.
#[derive(Clone)]
pub struct PgOptions {
    /// `postgres://USER@HOST:PORT/DB` (a password in it is refused).
    pub url: String,
    /// The password (from a file or the environment, never the URL).
    pub password: Option<String>,
    /// A PEM file of the CA that signed the server's certificate: TLS is
    /// then required and the server's name checked against it.
    pub ca_file: Option<PathBuf>,
    /// The most connections one process opens (its pool).
    pub pool_size: usize,
    /// The longest any one wait lasts: for a connection from the pool, to
    /// connect, for the write lock, and for one statement to finish.
    pub timeout: Duration,
}

impl fmt::Debug for PgOptions {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("PgOptions")
            .field("url", &self.url)
            .field("password", &self.password.as_ref().map(|_| "***"))
            .field("ca_file", &self.ca_file)
            .field("pool_size", &self.pool_size)
            .field("timeout", &self.timeout)
            .finish()
    }
}

impl PgOptions {
    /// The defaults: a pool of 8 and 5 s bounds.
    pub fn new(url: &str) -> Self {
        Self {
            url: url.to_owned(),
            password: None,
            ca_file: None,
            pool_size: 8,
            timeout: Duration::from_secs(5),
        }
    }
}

/// Whether a database setting names PostgreSQL (`postgres://` or
/// `postgresql://`).
pub fn is_postgres_url(s: &str) -> bool {
    s.starts_with("postgres://") || s.starts_with("postgresql://")
}

/// Everything needed to open more connections to one database.
pub(crate) struct PgTarget {
    config: postgres::Config,
    tls: Option<Arc<rustls::ClientConfig>>,
    /// The URL without its password, for messages.
    location: PathBuf,
    pub(crate) pool_size: usize,
    pub(crate) timeout: Duration,
    /// Connects under way (some may hang on a host that does not answer).
    connecting: Arc<AtomicUsize>,
}

impl fmt::Debug for PgTarget {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("PgTarget")
            .field("location", &self.location)
            .field("tls", &self.tls.is_some())
            .finish()
    }
}

impl PgTarget {
    /// Checks the options and prepares TLS; connects to nothing yet.
    pub(crate) fn new(o: &PgOptions) -> Result<Self, RegistryError> {
        let bad = |reason: String| RegistryError::Invalid {
            what: "database URL",
            value: redact(&o.url),
            reason,
        };
        if !is_postgres_url(&o.url) {
            return Err(bad("a PostgreSQL URL starts with postgres://".into()));
        }
        let mut config: postgres::Config = o
            .url
            .parse()
            .map_err(|e: postgres::Error| bad(format!("{e}: {}", pg_message(&e))))?;
        if config.get_password().is_some() {
            return Err(bad("a password in the URL would show in process lists, shell history and logs: put it in model.db_password_file (mode 0600) or KEEL_MODEL_DB_PASSWORD".into()));
        }
        if config.get_user().is_none() {
            return Err(bad(
                "name the user: postgres://USER@HOST:PORT/DATABASE".into()
            ));
        }
        if o.pool_size == 0 {
            return Err(RegistryError::Invalid {
                what: "pool size",
                value: "0".into(),
                reason: "at least 1".into(),
            });
        }
        if let Some(p) = &o.password {
            config.password(p.as_bytes());
        }
        let ms = o.timeout.as_millis().max(1);
        config
            .connect_timeout(o.timeout)
            // A server that stops answering (a lost network, not a closed
            // socket) fails a statement instead of hanging it.
            .tcp_user_timeout(o.timeout * 2)
            .keepalives(true)
            .keepalives_idle(Duration::from_secs(30))
            .application_name("keel-registry")
            .options(&format!(
                "-c statement_timeout={ms} -c lock_timeout={ms} -c idle_in_transaction_session_timeout={}",
                ms * 6
            ));
        let tls = match &o.ca_file {
            Some(ca) => {
                config.ssl_mode(postgres::config::SslMode::Require);
                Some(Arc::new(tls_with_ca(ca)?))
            }
            None if config.get_ssl_mode() == postgres::config::SslMode::Require => {
                Some(Arc::new(tls_with_system_roots()?))
            }
            None => None,
        };
        Ok(Self {
            config,
            tls,
            location: PathBuf::from(redact(&o.url)),
            pool_size: o.pool_size,
            timeout: o.timeout,
            connecting: Arc::default(),
        })
    }

    pub(crate) fn location(&self) -> &Path {
        &self.location
    }

    /// A new connection within the timeout, TCP, TLS and PostgreSQL's
    /// start-up together. The client bounds only the TCP connect: a host
    /// that accepts and never answers (a hung proxy, a half-dead host)
    /// would hold its start-up forever. So the connect runs on a thread of
    /// its own, and the caller waits for it at most the timeout. A connect
    /// left hanging ends when its socket does (TCP keepalive and
    /// `tcp_user_timeout` end one to a dead host; a proxy that restarts
    /// resets it); meanwhile it holds one of `2 * pool_size + 4` places,
    /// and with none left a new connect is not tried, so a silent host
    /// costs a bounded number of threads.
    fn connect(&self) -> Result<postgres::Client, DbError> {
        let unanswered = |what: String| DbError::Unanswered {
            location: self.location.display().to_string(),
            what,
            timeout: self.timeout,
        };
        let taken = self.connecting.fetch_add(1, Ordering::SeqCst);
        if taken >= 2 * self.pool_size + 4 {
            self.connecting.fetch_sub(1, Ordering::SeqCst);
            return Err(unanswered(format!(
                "did not answer {taken} earlier connection attempts, still waiting"
            )));
        }
        let (config, tls, connecting) = (
            self.config.clone(),
            self.tls.clone(),
            self.connecting.clone(),
        );
        let (tx, rx) = std::sync::mpsc::channel();
        let spawned = std::thread::Builder::new()
            .name("keel-pg-connect".into())
            .spawn(move || {
                let client = match tls {
                    Some(t) => config.connect(tls::MakeRustls(t)),
                    None => config.connect(postgres::NoTls),
                };
                connecting.fetch_sub(1, Ordering::SeqCst);
                // A caller that gave up has gone: the client is dropped.
                let _ = tx.send(client);
            });
        if let Err(e) = spawned {
            self.connecting.fetch_sub(1, Ordering::SeqCst);
            return Err(unanswered(format!("could not be connected to ({e})")));
        }
        blocking(|| match rx.recv_timeout(self.timeout) {
            Ok(client) => Ok(client?),
            Err(_) => Err(unanswered("did not finish the connection".into())),
        })
    }
}

/// `postgres://user:secret@host/db` -> `postgres://user@host/db`.
pub(crate) fn redact(url: &str) -> String {
    let Some((scheme, rest)) = url.split_once("://") else {
        return url.to_owned();
    };
    let (auth, tail) = match rest.find(['/', '?']) {
        Some(i) => rest.split_at(i),
        None => (rest, ""),
    };
    match auth.rsplit_once('@') {
        Some((user, host)) => {
            let user = user.split(':').next().unwrap_or_default();
            format!("{scheme}://{user}@{host}{tail}")
        }
        None => url.to_owned(),
    }
}

fn tls_with_ca(ca: &Path) -> Result<rustls::ClientConfig, RegistryError> {
    let bad = |reason: String| RegistryError::Invalid {
        what: "database CA file",
        value: ca.display().to_string(),
        reason,
    };
    let pem = keel_fs::read_regular(ca, keel_fs::MAX_CONFIG_BYTES).map_err(|source| {
        RegistryError::Io {
            op: "read the database CA file",
            path: ca.to_owned(),
            source,
        }
    })?;
    let mut roots = rustls::RootCertStore::empty();
    let mut n = 0;
    for item in rustls::pki_types::pem::PemObject::pem_slice_iter(&pem) {
        let cert: rustls::pki_types::CertificateDer<'static> =
            item.map_err(|e| bad(format!("not PEM certificates: {e:?}")))?;
        roots
            .add(cert)
            .map_err(|e| bad(format!("a certificate rustls refuses: {e}")))?;
        n += 1;
    }
    if n == 0 {
        return Err(bad("no CERTIFICATE block in it".into()));
    }
    client_config(roots).map_err(bad)
}

fn tls_with_system_roots() -> Result<rustls::ClientConfig, RegistryError> {
    let mut roots = rustls::RootCertStore::empty();
    for c in rustls_native_certs::load_native_certs().certs {
        let _ = roots.add(c);
    }
    client_config(roots).map_err(|reason| RegistryError::Invalid {
        what: "TLS",
        value: "system roots".into(),
        reason,
    })
}

fn client_config(roots: rustls::RootCertStore) -> Result<rustls::ClientConfig, String> {
    Ok(rustls::ClientConfig::builder_with_provider(Arc::new(
        rustls::crypto::aws_lc_rs::default_provider(),
    ))
    .with_safe_default_protocol_versions()
    .map_err(|e| e.to_string())?
    .with_root_certificates(roots)
    .with_no_client_auth())
}

/// Runs blocking client work: as is on a plain thread (the server runs
/// every registry call on tokio's blocking pool), through
/// `block_in_place` on a worker of a multi-threaded runtime (a caller
/// that calls the registry from async code), where the blocking client
/// could not otherwise drive its own runtime.
fn blocking<T>(f: impl FnOnce() -> T) -> T {
    match tokio::runtime::Handle::try_current() {
        Ok(h) if h.runtime_flavor() == tokio::runtime::RuntimeFlavor::MultiThread => {
            tokio::task::block_in_place(f)
        }
        _ => f(),
    }
}

/// `?N` -> `$N`, outside string literals and quoted names.
pub(crate) fn pg_placeholders(sql: &str) -> String {
    let mut out = String::with_capacity(sql.len());
    let mut quote: Option<char> = None;
    let mut chars = sql.chars().peekable();
    while let Some(c) = chars.next() {
        match quote {
            Some(q) => {
                if c == q {
                    quote = None;
                }
                out.push(c);
            }
            None => match c {
                '\'' | '"' => {
                    quote = Some(c);
                    out.push(c);
                }
                '?' if chars.peek().is_some_and(|d| d.is_ascii_digit()) => out.push('$'),
                _ => out.push(c),
            },
        }
    }
    out
}

struct PgConn {
    client: postgres::Client,
    statements: HashMap<String, postgres::Statement>,
}

/// A PostgreSQL connection, opened when first needed and again after it
/// is lost (between transactions only: a transaction whose connection is
/// lost fails, and its work is rolled back by the server).
pub(crate) struct Postgres {
    target: Arc<PgTarget>,
    conn: RefCell<Option<PgConn>>,
    in_tx: Cell<bool>,
}

impl Drop for Postgres {
    fn drop(&mut self) {
        // The client owns a small runtime of its own, which may not be
        // dropped on a runtime's worker either.
        let conn = self.conn.get_mut().take();
        blocking(|| drop(conn));
    }
}

impl fmt::Debug for Postgres {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Postgres")
            .field("target", &self.target)
            .field("in_tx", &self.in_tx.get())
            .finish()
    }
}

impl Postgres {
    /// A connection to `target`, connected now (so that a database that
    /// cannot be reached is an error at once).
    pub(crate) fn connect(target: Arc<PgTarget>) -> Result<Self, DbError> {
        let p = Self {
            target,
            conn: RefCell::new(None),
            in_tx: Cell::new(false),
        };
        p.ensure()?;
        Ok(p)
    }

    /// Connects unless connected; never inside a transaction.
    fn ensure(&self) -> Result<(), DbError> {
        let mut c = self.conn.borrow_mut();
        if c.as_ref().is_some_and(|c| !c.client.is_closed()) {
            return Ok(());
        }
        if self.in_tx.get() {
            *c = None;
            return Err(DbError::Lost);
        }
        *c = Some(PgConn {
            client: self.target.connect()?,
            statements: HashMap::new(),
        });
        Ok(())
    }

    /// Runs `f` with the connection and a prepared statement for `sql`;
    /// a connection that fails is dropped (the next use reconnects).
    fn with_statement<T>(
        &self,
        sql: &str,
        f: impl FnOnce(&mut postgres::Client, &postgres::Statement) -> Result<T, postgres::Error>,
    ) -> Result<T, DbError> {
        blocking(|| self.with_statement_now(sql, f))
    }

    fn with_statement_now<T>(
        &self,
        sql: &str,
        f: impl FnOnce(&mut postgres::Client, &postgres::Statement) -> Result<T, postgres::Error>,
    ) -> Result<T, DbError> {
        self.ensure()?;
        let mut guard = self.conn.borrow_mut();
        let Some(c) = guard.as_mut() else {
            return Err(DbError::Lost);
        };
        let st = match c.statements.get(sql) {
            Some(st) => st.clone(),
            None => {
                let st = match c.client.prepare(&pg_placeholders(sql)) {
                    Ok(st) => st,
                    Err(e) => {
                        if session_over(&c.client, &e) {
                            *guard = None;
                        }
                        return Err(e.into());
                    }
                };
                c.statements.insert(sql.to_owned(), st.clone());
                st
            }
        };
        let out = f(&mut c.client, &st);
        if out.as_ref().is_err_and(|e| session_over(&c.client, e)) {
            *guard = None;
        }
        Ok(out?)
    }

    fn simple(&self, sql: &str) -> Result<(), DbError> {
        blocking(|| self.simple_now(sql))
    }

    fn simple_now(&self, sql: &str) -> Result<(), DbError> {
        self.ensure()?;
        let mut guard = self.conn.borrow_mut();
        let Some(c) = guard.as_mut() else {
            return Err(DbError::Lost);
        };
        let out = c.client.batch_execute(sql);
        if out.as_ref().is_err_and(|e| session_over(&c.client, e)) {
            *guard = None;
        }
        Ok(out?)
    }
}

/// Whether a failed statement ended the connection's session: the client
/// saw it close, or the server sent a FATAL (or PANIC) error, after which
/// it ends the session (`pg_terminate_backend`, a shutdown), though the
/// client may not have seen the socket close yet.
fn session_over(c: &postgres::Client, e: &postgres::Error) -> bool {
    c.is_closed()
        || e.as_db_error()
            .is_some_and(|d| matches!(d.severity(), "FATAL" | "PANIC"))
}

fn pg_params<'a>(params: &'a [Param<'a>]) -> Vec<&'a (dyn postgres::types::ToSql + Sync)> {
    params
        .iter()
        .map(|p| p as &(dyn postgres::types::ToSql + Sync))
        .collect()
}

impl postgres::types::ToSql for Param<'_> {
    fn to_sql(
        &self,
        ty: &postgres::types::Type,
        out: &mut bytes::BytesMut,
    ) -> Result<postgres::types::IsNull, Box<dyn std::error::Error + Sync + Send>> {
        use postgres::types::Type;
        match self {
            Param::Null => Ok(postgres::types::IsNull::Yes),
            Param::Int(v) => match *ty {
                Type::INT8 => v.to_sql(ty, out),
                Type::INT4 => i32::try_from(*v)?.to_sql(ty, out),
                Type::INT2 => i16::try_from(*v)?.to_sql(ty, out),
                _ => Err(format!("an integer for a {ty} parameter").into()),
            },
            Param::Text(s) => match *ty {
                Type::TEXT | Type::VARCHAR | Type::BPCHAR | Type::NAME | Type::UNKNOWN => {
                    s.to_sql(ty, out)
                }
                _ => Err(format!("text for a {ty} parameter").into()),
            },
        }
    }

    fn accepts(ty: &postgres::types::Type) -> bool {
        use postgres::types::Type;
        matches!(
            *ty,
            Type::INT8
                | Type::INT4
                | Type::INT2
                | Type::TEXT
                | Type::VARCHAR
                | Type::BPCHAR
                | Type::NAME
                | Type::UNKNOWN
        )
    }

    postgres::types::to_sql_checked!();
}

fn pg_row(r: &postgres::Row) -> Result<Row, DbError> {
    use postgres::types::Type;
    let mut out = Vec::with_capacity(r.len());
    for (i, col) in r.columns().iter().enumerate() {
        let v = match *col.type_() {
            Type::INT8 => r.try_get::<_, Option<i64>>(i)?.map(Value::Int),
            Type::INT4 => r
                .try_get::<_, Option<i32>>(i)?
                .map(|v| Value::Int(v.into())),
            Type::INT2 => r
                .try_get::<_, Option<i16>>(i)?
                .map(|v| Value::Int(v.into())),
            Type::BOOL => r
                .try_get::<_, Option<bool>>(i)?
                .map(|v| Value::Int(v.into())),
            Type::TEXT | Type::VARCHAR | Type::BPCHAR | Type::NAME => {
                r.try_get::<_, Option<String>>(i)?.map(Value::Text)
            }
            ref t => {
                return Err(DbError::Value(format!(
                    "column {} has type {t}, which the registry never uses",
                    col.name()
                )))
            }
        };
        out.push(v.unwrap_or(Value::Null));
    }
    Ok(Row(out))
}

impl Storage for Postgres {
    fn backend(&self) -> Backend {
        Backend::Postgres
    }

    fn location(&self) -> &Path {
        self.target.location()
    }

    fn query(&self, sql: &str, params: &[Param<'_>]) -> Result<Vec<Row>, DbError> {
        let rows = self.with_statement(sql, |c, st| c.query(st, &pg_params(params)))?;
        rows.iter().map(pg_row).collect()
    }

    fn execute(&self, sql: &str, params: &[Param<'_>]) -> Result<u64, DbError> {
        self.with_statement(sql, |c, st| c.execute(st, &pg_params(params)))
    }

    fn execute_batch(&self, sql: &str) -> Result<(), DbError> {
        self.simple(sql)
    }

    fn begin(&self, mode: TxMode) -> Result<(), DbError> {
        let sql = match mode {
            TxMode::Write | TxMode::Schema => "BEGIN",
            TxMode::Read => "BEGIN ISOLATION LEVEL REPEATABLE READ, READ ONLY",
        };
        // An idle connection the server closed since its last use (a
        // restart) is found out here, before anything of the request ran:
        // once more on a new connection.
        let had = self.conn.borrow().is_some();
        if let Err(e) = self.simple(sql) {
            if !had || !e.is_unavailable() || self.conn.borrow().is_some() {
                return Err(e);
            }
            self.simple(sql)?;
        }
        self.in_tx.set(true);
        if mode == TxMode::Write {
            // The write lock: the audit chain's head (module docs).
            let locked = self.query(
                "SELECT value FROM meta WHERE key = 'audit_head' FOR UPDATE",
                &[],
            );
            if let Err(e) = locked {
                self.rollback();
                return Err(e);
            }
        }
        Ok(())
    }

    fn commit(&self) -> Result<(), DbError> {
        let out = self.simple("COMMIT");
        self.in_tx.set(false);
        out
    }

    fn rollback(&self) {
        if self.conn.borrow().is_some() && self.simple("ROLLBACK").is_err() {
            *self.conn.borrow_mut() = None;
        }
        self.in_tx.set(false);
    }

    fn another_possible(&self) -> bool {
        true
    }

    fn pg_target(&self) -> Option<&Arc<PgTarget>> {
        Some(&self.target)
    }

    fn ids_follow_rows(&self, tables: &[&str]) -> Result<(), DbError> {
        for t in tables {
            self.query(
                &format!(
                    "SELECT setval(pg_get_serial_sequence('{t}', 'id'), COALESCE((SELECT MAX(id) FROM {t}), 0) + 1, false)"
                ),
                &[],
            )?;
        }
        Ok(())
    }
}

/// TLS for tokio-postgres over tokio-rustls, with the server's
/// certificate and name always verified (libpq's `verify-full`).
mod tls {
    use std::future::Future;
    use std::io;
    use std::pin::Pin;
    use std::sync::Arc;
    use std::task::{Context, Poll};

    use postgres::tls::{ChannelBinding, MakeTlsConnect, TlsConnect, TlsStream};
    use postgres::Socket;
    use rustls::pki_types::ServerName;
    use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};

    #[derive(Clone)]
    pub(crate) struct MakeRustls(pub(crate) Arc<rustls::ClientConfig>);

    pub(crate) struct Connect {
        config: Arc<rustls::ClientConfig>,
        name: ServerName<'static>,
    }

    impl MakeTlsConnect<Socket> for MakeRustls {
        type Stream = Stream;
        type TlsConnect = Connect;
        type Error = rustls::pki_types::InvalidDnsNameError;

        fn make_tls_connect(&mut self, domain: &str) -> Result<Connect, Self::Error> {
            Ok(Connect {
                config: self.0.clone(),
                name: ServerName::try_from(domain.to_owned())?,
            })
        }
    }

    impl TlsConnect<Socket> for Connect {
        type Stream = Stream;
        type Error = io::Error;
        type Future = Pin<Box<dyn Future<Output = io::Result<Stream>> + Send>>;

        fn connect(self, socket: Socket) -> Self::Future {
            Box::pin(async move {
                let s = tokio_rustls::TlsConnector::from(self.config)
                    .connect(self.name, socket)
                    .await?;
                Ok(Stream(Box::new(s)))
            })
        }
    }

    pub(crate) struct Stream(Box<tokio_rustls::client::TlsStream<Socket>>);

    impl AsyncRead for Stream {
        fn poll_read(
            mut self: Pin<&mut Self>,
            cx: &mut Context<'_>,
            buf: &mut ReadBuf<'_>,
        ) -> Poll<io::Result<()>> {
            Pin::new(&mut *self.0).poll_read(cx, buf)
        }
    }

    impl AsyncWrite for Stream {
        fn poll_write(
            mut self: Pin<&mut Self>,
            cx: &mut Context<'_>,
            buf: &[u8],
        ) -> Poll<io::Result<usize>> {
            Pin::new(&mut *self.0).poll_write(cx, buf)
        }

        fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
            Pin::new(&mut *self.0).poll_flush(cx)
        }

        fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
            Pin::new(&mut *self.0).poll_shutdown(cx)
        }
    }

    impl TlsStream for Stream {
        fn channel_binding(&self) -> ChannelBinding {
            // SCRAM without channel binding (SCRAM-SHA-256, not -PLUS).
            ChannelBinding::none()
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn placeholders_are_rewritten_outside_quotes_only() {
        assert_eq!(
            pg_placeholders("SELECT a FROM t WHERE b = ?1 AND c = '?2' AND d > ?12"),
            "SELECT a FROM t WHERE b = $1 AND c = '?2' AND d > $12"
        );
        assert_eq!(pg_placeholders("SELECT \"x?1\", ?"), "SELECT \"x?1\", ?");
    }

    #[test]
    fn urls_lose_their_password_in_messages() {
        assert_eq!(
            redact("postgres://u:secret@h:5432/db?sslmode=require"),
            "postgres://u@h:5432/db?sslmode=require"
        );
        assert_eq!(redact("postgres://u@h/db"), "postgres://u@h/db");
        assert_eq!(redact("postgres://h/db"), "postgres://h/db");
    }

    #[test]
    fn passwords_in_urls_and_missing_users_are_refused() {
        let e = PgTarget::new(&PgOptions::new("postgres://u:pw@127.0.0.1:1/db")).expect_err("pw");
        let msg = e.to_string();
        assert!(msg.contains("db_password_file"), "{msg}");
        assert!(!msg.contains("pw@"), "the password is not repeated: {msg}");
        let e = PgTarget::new(&PgOptions::new("postgres://127.0.0.1:1/db")).expect_err("user");
        assert!(e.to_string().contains("name the user"), "{e}");
        let mut o = PgOptions::new("postgres://u@127.0.0.1:1/db");
        o.pool_size = 0;
        assert!(PgTarget::new(&o).is_err());
    }
}
