//! The two stores every registry test runs against: SQLite (a file, or
//! memory) and PostgreSQL (a throwaway database on the server of
//! `scripts/services/postgres`), and the few things a test does beneath
//! the registry (tampering, a schema version) in each one's dialect.

#![allow(dead_code)]

use std::path::PathBuf;
use std::sync::Arc;

use keel_registry::{Clock, PgOptions, Registry};
use keel_testkit::pg::PgDb;

/// Where a test's registry lives.
pub enum Store {
    Sqlite {
        _dir: tempfile::TempDir,
        path: PathBuf,
    },
    Memory,
    Postgres(PgDb),
}

impl Store {
    pub fn sqlite() -> Self {
        let dir = tempfile::tempdir().expect("tmp");
        let path = dir.path().join("reg.db");
        Store::Sqlite { _dir: dir, path }
    }

    pub fn memory() -> Self {
        Store::Memory
    }

    pub fn postgres() -> Self {
        Store::Postgres(PgDb::create())
    }

    pub fn is_postgres(&self) -> bool {
        matches!(self, Store::Postgres(_))
    }

    /// The options keel would be given for this PostgreSQL database
    /// (password, the server's CA: TLS).
    pub fn pg_options(&self) -> Option<PgOptions> {
        match self {
            Store::Postgres(db) => {
                let mut o = PgOptions::new(&db.url);
                o.password = Some(db.password.clone());
                o.ca_file = Some(db.ca.clone());
                Some(o)
            }
            _ => None,
        }
    }

    /// Opens (creating and migrating) the registry.
    pub fn open(&self, clock: Arc<dyn Clock>) -> Registry {
        self.try_open(clock).expect("open the registry")
    }

    pub fn try_open(
        &self,
        clock: Arc<dyn Clock>,
    ) -> Result<Registry, keel_registry::RegistryError> {
        match self {
            Store::Sqlite { path, .. } => Registry::open(path, clock),
            Store::Memory => Registry::open_in_memory(clock),
            Store::Postgres(_) => Registry::open_postgres(&self.pg_options().expect("pg"), clock),
        }
    }

    /// Runs `stmt` beneath the registry, after dropping the named
    /// trigger `(trigger, table)` when one is given (what someone with
    /// the database's password could do).
    pub fn tamper(&self, trigger: Option<(&str, &str)>, stmt: &str) -> Result<(), String> {
        let drop = match (self, trigger) {
            (_, None) => String::new(),
            (Store::Postgres(_), Some((t, table))) => format!("DROP TRIGGER {t} ON {table};"),
            (_, Some((t, _))) => format!("DROP TRIGGER {t};"),
        };
        self.sql(&format!("{drop}{stmt}"))
    }

    /// Statements on the database, the server's message on error.
    pub fn sql(&self, sql: &str) -> Result<(), String> {
        match self {
            Store::Sqlite { path, .. } => rusqlite::Connection::open(path)
                .and_then(|c| c.execute_batch(sql))
                .map_err(|e| e.to_string()),
            Store::Memory => panic!("an in-memory registry has no other connection"),
            Store::Postgres(db) => db.execute(sql),
        }
    }

    /// One text value (`SELECT ...`), or None.
    pub fn text(&self, sql: &str) -> Option<String> {
        match self {
            Store::Sqlite { path, .. } => rusqlite::Connection::open(path)
                .expect("open")
                .query_row(sql, [], |r| r.get::<_, Option<String>>(0))
                .expect("query"),
            Store::Memory => panic!("an in-memory registry has no other connection"),
            Store::Postgres(db) => db.query_text(sql).expect("query"),
        }
    }

    /// Marks the schema as version `v` (as a newer keel would).
    pub fn set_schema_version(&self, v: i64) {
        match self {
            Store::Postgres(_) => self.sql(&format!("UPDATE keel_schema SET version = {v}")),
            _ => self.sql(&format!("PRAGMA user_version = {v}")),
        }
        .expect("set the schema version")
    }
}

/// `name::sqlite` and `name::postgres`: the test `name(store)` on each
/// store (the PostgreSQL one needs the server: scripts/test starts it).
#[macro_export]
macro_rules! on_both_stores {
    ($($name:ident),* $(,)?) => {$(
        mod $name {
            #[test]
            fn sqlite() {
                super::$name(super::common::Store::sqlite())
            }
            #[test]
            #[ignore = "needs PostgreSQL: scripts/services/postgres (scripts/test starts it)"]
            fn postgres() {
                super::$name(super::common::Store::postgres())
            }
        }
    )*};
}

/// [`on_both_stores`] for async tests (SQLite in memory, as a server
/// test keeps it, or PostgreSQL).
#[macro_export]
macro_rules! on_both_stores_async {
    ($($name:ident),* $(,)?) => {$(
        mod $name {
            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn sqlite() {
                super::$name(super::common::Store::memory()).await
            }
            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            #[ignore = "needs PostgreSQL: scripts/services/postgres (scripts/test starts it)"]
            async fn postgres() {
                super::$name(super::common::Store::postgres()).await
            }
        }
    )*};
}
