//! The PostgreSQL that `scripts/services/postgres start` runs, found from
//! `KEEL_TEST_POSTGRES_URL` (a superuser's URL, without password),
//! `KEEL_TEST_POSTGRES_PASSWORD` and `KEEL_TEST_POSTGRES_CA` (the CA of its
//! server certificate). [`PgDb::create`] makes a throwaway database for one
//! test (dropped, with its connections, when the value is dropped), so tests
//! running at once never see each other's rows.

use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering};

pub const URL_VAR: &str = "KEEL_TEST_POSTGRES_URL";
pub const PASSWORD_VAR: &str = "KEEL_TEST_POSTGRES_PASSWORD";
pub const CA_VAR: &str = "KEEL_TEST_POSTGRES_CA";

/// A database of one's own on the test server.
#[derive(Debug)]
pub struct PgDb {
    /// `postgres://keel@127.0.0.1:PORT/NAME`, without the password.
    pub url: String,
    pub password: String,
    /// The CA of the server's certificate (PEM).
    pub ca: PathBuf,
    pub name: String,
    admin: String,
}

fn env(var: &str) -> String {
    std::env::var(var).ok().filter(|v| !v.is_empty()).unwrap_or_else(|| {
        panic!("{var} is not set: run `eval \"$(scripts/services/postgres start)\"` (scripts/test does)")
    })
}

fn connect(url: &str, password: &str) -> Result<postgres::Client, String> {
    let mut c: postgres::Config = url.parse().map_err(|e| format!("{e}"))?;
    c.password(password);
    c.connect(postgres::NoTls).map_err(|e| message(&e))
}

/// Blocking client work, legal also from a multi-threaded runtime's
/// worker (an async test), where the blocking client could not drive its
/// own runtime otherwise.
pub fn blocking<T>(f: impl FnOnce() -> T) -> T {
    match tokio::runtime::Handle::try_current() {
        Ok(h) if h.runtime_flavor() == tokio::runtime::RuntimeFlavor::MultiThread => {
            tokio::task::block_in_place(f)
        }
        _ => f(),
    }
}

/// The server's message for an error (the client's own says only "db
/// error").
pub fn message(e: &postgres::Error) -> String {
    match e.as_db_error() {
        Some(d) => d.message().to_owned(),
        None => e.to_string(),
    }
}

impl PgDb {
    /// Whether the test server is configured.
    pub fn available() -> bool {
        std::env::var(URL_VAR).is_ok_and(|v| !v.is_empty())
    }

    /// A new, empty database; panics with what to run when the server is
    /// not configured or does not answer.
    pub fn create() -> PgDb {
        static N: AtomicU64 = AtomicU64::new(0);
        let admin = env(URL_VAR);
        let password = env(PASSWORD_VAR);
        let name = format!(
            "keel_test_{}_{}_{}",
            std::process::id(),
            N.fetch_add(1, Ordering::Relaxed),
            std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map(|d| d.subsec_nanos())
                .unwrap_or(0)
        );
        blocking(|| {
            let mut c =
                connect(&admin, &password).unwrap_or_else(|e| panic!("{URL_VAR}={admin}: {e}"));
            c.batch_execute(&format!("CREATE DATABASE {name}"))
                .unwrap_or_else(|e| panic!("create database {name}: {}", message(&e)));
        });
        let base = admin
            .rsplit_once('/')
            .map(|(b, _)| b.to_owned())
            .unwrap_or_else(|| admin.clone());
        PgDb {
            url: format!("{base}/{name}"),
            password,
            ca: PathBuf::from(env(CA_VAR)),
            name,
            admin,
        }
    }

    /// Runs statements on this database as the superuser (to tamper with
    /// it, or to look under the registry); the server's message on error.
    pub fn execute(&self, sql: &str) -> Result<(), String> {
        blocking(|| {
            let mut c = connect(&self.url, &self.password)?;
            c.batch_execute(sql).map_err(|e| message(&e))
        })
    }

    /// One column of one row, as text (`SELECT x::text ...`).
    pub fn query_text(&self, sql: &str) -> Result<Option<String>, String> {
        blocking(|| {
            let mut c = connect(&self.url, &self.password)?;
            let rows = c.query(sql, &[]).map_err(|e| message(&e))?;
            Ok(rows.first().and_then(|r| r.get::<_, Option<String>>(0)))
        })
    }

    /// A connection as the superuser to this database.
    pub fn client(&self) -> postgres::Client {
        connect(&self.url, &self.password).unwrap_or_else(|e| panic!("connect: {e}"))
    }

    /// A connection as the superuser to the server's default database.
    pub fn admin(&self) -> postgres::Client {
        connect(&self.admin, &self.password).unwrap_or_else(|e| panic!("connect: {e}"))
    }
}

impl Drop for PgDb {
    fn drop(&mut self) {
        blocking(|| {
            if let Ok(mut c) = connect(&self.admin, &self.password) {
                let _ = c.batch_execute(&format!(
                    "DROP DATABASE IF EXISTS {} WITH (FORCE)",
                    self.name
                ));
            }
        })
    }
}
