//! Opening the registry's database and keeping its schema current.
//!
//! SQLite: WAL, foreign keys, a busy timeout so concurrent writers wait
//! instead of failing; the schema version is `PRAGMA user_version`.
//! PostgreSQL: the schema version is the one row of `keel_schema`; the
//! migration runs under a transaction-scoped advisory lock, so replicas
//! starting together migrate once. Both refuse a schema newer than this
//! build knows. The two schemas are the same tables, columns and rules
//! in each database's own dialect (64-bit integers, text compared
//! byte-wise: `COLLATE "C"` on PostgreSQL, SQLite's default), so every
//! query the registry makes returns the same rows in the same order.
//!
//! Immutability is enforced by the database itself: triggers refuse any
//! change to a version once it has left `PENDING_REGISTRATION` but to its
//! description (metadata; schema 2), any change
//! to its files, and any update or delete of an alias or audit event. The
//! hash chains catch what gets past them (someone dropping the triggers).

use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use rusqlite::Connection;

use crate::storage::{Db, PgTarget, Postgres, Sqlite, Storage};
use crate::RegistryError;

/// SQLite's migrations: each entry moves the schema from version `i` to
/// `i + 1`.
const MIGRATIONS: &[&str] = &[
    r#"
CREATE TABLE meta (
    key   TEXT PRIMARY KEY,
    value TEXT NOT NULL
);
CREATE TABLE models (
    id          INTEGER PRIMARY KEY,
    name        TEXT NOT NULL UNIQUE,
    description TEXT NOT NULL DEFAULT '',
    created_ms  INTEGER NOT NULL,
    created_by  TEXT NOT NULL,
    updated_ms  INTEGER NOT NULL
);
CREATE TABLE model_tags (
    model_id INTEGER NOT NULL REFERENCES models(id),
    key      TEXT NOT NULL,
    value    TEXT NOT NULL,
    PRIMARY KEY (model_id, key)
);
CREATE TABLE versions (
    id              INTEGER PRIMARY KEY,
    model_id        INTEGER NOT NULL REFERENCES models(id),
    number          INTEGER NOT NULL CHECK (number >= 1),
    status          TEXT NOT NULL CHECK (status IN ('PENDING_REGISTRATION', 'READY', 'FAILED_REGISTRATION')),
    status_message  TEXT NOT NULL DEFAULT '',
    source          TEXT NOT NULL,
    artifact_url    TEXT,
    manifest_digest TEXT,
    description     TEXT NOT NULL DEFAULT '',
    run_id          TEXT,
    lineage         TEXT NOT NULL,
    created_ms      INTEGER NOT NULL,
    created_by      TEXT NOT NULL,
    updated_ms      INTEGER NOT NULL,
    UNIQUE (model_id, number)
);
CREATE TABLE version_files (
    version_id INTEGER NOT NULL REFERENCES versions(id),
    name       TEXT NOT NULL,
    size       INTEGER NOT NULL,
    sha256     TEXT NOT NULL,
    PRIMARY KEY (version_id, name)
);
CREATE TABLE version_tags (
    version_id INTEGER NOT NULL REFERENCES versions(id),
    key        TEXT NOT NULL,
    value      TEXT NOT NULL,
    PRIMARY KEY (version_id, key)
);
CREATE TABLE aliases (
    model_id INTEGER NOT NULL REFERENCES models(id),
    alias    TEXT NOT NULL,
    version  INTEGER NOT NULL,
    PRIMARY KEY (model_id, alias)
);
CREATE TABLE alias_events (
    seq         INTEGER PRIMARY KEY,
    time_ms     INTEGER NOT NULL,
    actor       TEXT NOT NULL,
    model       TEXT NOT NULL,
    alias       TEXT NOT NULL,
    action      TEXT NOT NULL,
    old_version INTEGER,
    new_version INTEGER,
    reason      TEXT NOT NULL,
    prev_hash   TEXT NOT NULL,
    hash        TEXT NOT NULL
);
CREATE INDEX alias_events_by_model ON alias_events (model, alias, seq);
CREATE TABLE audit_events (
    seq       INTEGER PRIMARY KEY,
    time_ms   INTEGER NOT NULL,
    actor     TEXT NOT NULL,
    action    TEXT NOT NULL,
    target    TEXT NOT NULL,
    detail    TEXT NOT NULL,
    prev_hash TEXT NOT NULL,
    hash      TEXT NOT NULL
);
CREATE TABLE signatures (
    id             INTEGER PRIMARY KEY,
    version_id     INTEGER NOT NULL REFERENCES versions(id),
    bundle         TEXT NOT NULL,
    public_key_pem TEXT NOT NULL,
    key_hint       TEXT NOT NULL,
    created_ms     INTEGER NOT NULL,
    created_by     TEXT NOT NULL
);
CREATE TABLE api_keys (
    id         INTEGER PRIMARY KEY,
    name       TEXT NOT NULL UNIQUE,
    sha256     TEXT NOT NULL UNIQUE,
    role       TEXT NOT NULL CHECK (role IN ('read', 'write')),
    created_ms INTEGER NOT NULL,
    created_by TEXT NOT NULL,
    revoked_ms INTEGER
);

CREATE TRIGGER versions_immutable BEFORE UPDATE ON versions
WHEN OLD.status <> 'PENDING_REGISTRATION'
BEGIN SELECT RAISE(ABORT, 'model version is immutable once registered'); END;
CREATE TRIGGER versions_no_delete BEFORE DELETE ON versions
BEGIN SELECT RAISE(ABORT, 'model versions are never deleted'); END;
CREATE TRIGGER version_files_only_while_pending BEFORE INSERT ON version_files
WHEN (SELECT status FROM versions WHERE id = NEW.version_id) <> 'PENDING_REGISTRATION'
BEGIN SELECT RAISE(ABORT, 'model version is immutable once registered'); END;
CREATE TRIGGER version_files_no_update BEFORE UPDATE ON version_files
BEGIN SELECT RAISE(ABORT, 'model version files are immutable'); END;
CREATE TRIGGER version_files_no_delete BEFORE DELETE ON version_files
BEGIN SELECT RAISE(ABORT, 'model version files are immutable'); END;
CREATE TRIGGER alias_events_no_update BEFORE UPDATE ON alias_events
BEGIN SELECT RAISE(ABORT, 'alias history is append-only'); END;
CREATE TRIGGER alias_events_no_delete BEFORE DELETE ON alias_events
BEGIN SELECT RAISE(ABORT, 'alias history is append-only'); END;
CREATE TRIGGER audit_events_no_update BEFORE UPDATE ON audit_events
BEGIN SELECT RAISE(ABORT, 'audit log is append-only'); END;
CREATE TRIGGER audit_events_no_delete BEFORE DELETE ON audit_events
BEGIN SELECT RAISE(ABORT, 'audit log is append-only'); END;
CREATE TRIGGER signatures_no_update BEFORE UPDATE ON signatures
BEGIN SELECT RAISE(ABORT, 'signatures are append-only'); END;
"#,
    r#"
DROP TRIGGER versions_immutable;
CREATE TRIGGER versions_immutable BEFORE UPDATE ON versions
WHEN OLD.status <> 'PENDING_REGISTRATION' AND (
    NEW.id IS NOT OLD.id OR NEW.model_id IS NOT OLD.model_id OR NEW.number IS NOT OLD.number
    OR NEW.status IS NOT OLD.status OR NEW.status_message IS NOT OLD.status_message
    OR NEW.source IS NOT OLD.source OR NEW.artifact_url IS NOT OLD.artifact_url
    OR NEW.manifest_digest IS NOT OLD.manifest_digest OR NEW.run_id IS NOT OLD.run_id
    OR NEW.lineage IS NOT OLD.lineage OR NEW.created_ms IS NOT OLD.created_ms
    OR NEW.created_by IS NOT OLD.created_by)
BEGIN SELECT RAISE(ABORT, 'model version is immutable once registered: only its description may change'); END;
"#,
    // 3: a stored signature can no longer be deleted either (it could be
    // only edited before), as on PostgreSQL.
    r#"
CREATE TRIGGER signatures_no_delete BEFORE DELETE ON signatures
BEGIN SELECT RAISE(ABORT, 'signatures are append-only'); END;
"#,
];

/// The schema version this build writes.
pub const SCHEMA_VERSION: i64 = MIGRATIONS.len() as i64;

/// The PostgreSQL schema as of version 2 (SQLite's first two migrations
/// in PostgreSQL's dialect): a new PostgreSQL registry starts here.
const PG_BASELINE_VERSION: i64 = 2;
const PG_BASELINE: &str = r#"
CREATE TABLE meta (
    key   TEXT COLLATE "C" PRIMARY KEY,
    value TEXT COLLATE "C" NOT NULL
);
CREATE TABLE models (
    id          BIGINT GENERATED BY DEFAULT AS IDENTITY PRIMARY KEY,
    name        TEXT COLLATE "C" NOT NULL UNIQUE,
    description TEXT COLLATE "C" NOT NULL DEFAULT '',
    created_ms  BIGINT NOT NULL,
    created_by  TEXT COLLATE "C" NOT NULL,
    updated_ms  BIGINT NOT NULL
);
CREATE TABLE model_tags (
    model_id BIGINT NOT NULL REFERENCES models(id),
    key      TEXT COLLATE "C" NOT NULL,
    value    TEXT COLLATE "C" NOT NULL,
    PRIMARY KEY (model_id, key)
);
CREATE TABLE versions (
    id              BIGINT GENERATED BY DEFAULT AS IDENTITY PRIMARY KEY,
    model_id        BIGINT NOT NULL REFERENCES models(id),
    number          BIGINT NOT NULL CHECK (number >= 1),
    status          TEXT COLLATE "C" NOT NULL CHECK (status IN ('PENDING_REGISTRATION', 'READY', 'FAILED_REGISTRATION')),
    status_message  TEXT COLLATE "C" NOT NULL DEFAULT '',
    source          TEXT COLLATE "C" NOT NULL,
    artifact_url    TEXT COLLATE "C",
    manifest_digest TEXT COLLATE "C",
    description     TEXT COLLATE "C" NOT NULL DEFAULT '',
    run_id          TEXT COLLATE "C",
    lineage         TEXT COLLATE "C" NOT NULL,
    created_ms      BIGINT NOT NULL,
    created_by      TEXT COLLATE "C" NOT NULL,
    updated_ms      BIGINT NOT NULL,
    UNIQUE (model_id, number)
);
CREATE TABLE version_files (
    version_id BIGINT NOT NULL REFERENCES versions(id),
    name       TEXT COLLATE "C" NOT NULL,
    size       BIGINT NOT NULL,
    sha256     TEXT COLLATE "C" NOT NULL,
    PRIMARY KEY (version_id, name)
);
CREATE TABLE version_tags (
    version_id BIGINT NOT NULL REFERENCES versions(id),
    key        TEXT COLLATE "C" NOT NULL,
    value      TEXT COLLATE "C" NOT NULL,
    PRIMARY KEY (version_id, key)
);
CREATE TABLE aliases (
    model_id BIGINT NOT NULL REFERENCES models(id),
    alias    TEXT COLLATE "C" NOT NULL,
    version  BIGINT NOT NULL,
    PRIMARY KEY (model_id, alias)
);
CREATE TABLE alias_events (
    seq         BIGINT PRIMARY KEY,
    time_ms     BIGINT NOT NULL,
    actor       TEXT COLLATE "C" NOT NULL,
    model       TEXT COLLATE "C" NOT NULL,
    alias       TEXT COLLATE "C" NOT NULL,
    action      TEXT COLLATE "C" NOT NULL,
    old_version BIGINT,
    new_version BIGINT,
    reason      TEXT COLLATE "C" NOT NULL,
    prev_hash   TEXT COLLATE "C" NOT NULL,
    hash        TEXT COLLATE "C" NOT NULL
);
CREATE INDEX alias_events_by_model ON alias_events (model, alias, seq);
CREATE TABLE audit_events (
    seq       BIGINT PRIMARY KEY,
    time_ms   BIGINT NOT NULL,
    actor     TEXT COLLATE "C" NOT NULL,
    action    TEXT COLLATE "C" NOT NULL,
    target    TEXT COLLATE "C" NOT NULL,
    detail    TEXT COLLATE "C" NOT NULL,
    prev_hash TEXT COLLATE "C" NOT NULL,
    hash      TEXT COLLATE "C" NOT NULL
);
CREATE TABLE signatures (
    id             BIGINT GENERATED BY DEFAULT AS IDENTITY PRIMARY KEY,
    version_id     BIGINT NOT NULL REFERENCES versions(id),
    bundle         TEXT COLLATE "C" NOT NULL,
    public_key_pem TEXT COLLATE "C" NOT NULL,
    key_hint       TEXT COLLATE "C" NOT NULL,
    created_ms     BIGINT NOT NULL,
    created_by     TEXT COLLATE "C" NOT NULL
);
CREATE TABLE api_keys (
    id         BIGINT GENERATED BY DEFAULT AS IDENTITY PRIMARY KEY,
    name       TEXT COLLATE "C" NOT NULL UNIQUE,
    sha256     TEXT COLLATE "C" NOT NULL UNIQUE,
    role       TEXT COLLATE "C" NOT NULL CHECK (role IN ('read', 'write')),
    created_ms BIGINT NOT NULL,
    created_by TEXT COLLATE "C" NOT NULL,
    revoked_ms BIGINT
);

-- The head row every write transaction locks (storage.rs).
INSERT INTO meta (key, value) VALUES ('audit_head', '0000000000000000000000000000000000000000000000000000000000000000');

CREATE FUNCTION keel_refuse() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN RAISE EXCEPTION '%', TG_ARGV[0]; END $$;
CREATE FUNCTION keel_files_only_while_pending() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    IF (SELECT status FROM versions WHERE id = NEW.version_id) <> 'PENDING_REGISTRATION' THEN
        RAISE EXCEPTION 'model version is immutable once registered';
    END IF;
    RETURN NEW;
END $$;

CREATE TRIGGER versions_immutable BEFORE UPDATE ON versions FOR EACH ROW
WHEN (OLD.status <> 'PENDING_REGISTRATION' AND (
    NEW.id IS DISTINCT FROM OLD.id OR NEW.model_id IS DISTINCT FROM OLD.model_id
    OR NEW.number IS DISTINCT FROM OLD.number OR NEW.status IS DISTINCT FROM OLD.status
    OR NEW.status_message IS DISTINCT FROM OLD.status_message OR NEW.source IS DISTINCT FROM OLD.source
    OR NEW.artifact_url IS DISTINCT FROM OLD.artifact_url
    OR NEW.manifest_digest IS DISTINCT FROM OLD.manifest_digest OR NEW.run_id IS DISTINCT FROM OLD.run_id
    OR NEW.lineage IS DISTINCT FROM OLD.lineage OR NEW.created_ms IS DISTINCT FROM OLD.created_ms
    OR NEW.created_by IS DISTINCT FROM OLD.created_by))
EXECUTE FUNCTION keel_refuse('model version is immutable once registered: only its description may change');
CREATE TRIGGER versions_no_delete BEFORE DELETE ON versions FOR EACH ROW
EXECUTE FUNCTION keel_refuse('model versions are never deleted');
CREATE TRIGGER version_files_only_while_pending BEFORE INSERT ON version_files FOR EACH ROW
EXECUTE FUNCTION keel_files_only_while_pending();
CREATE TRIGGER version_files_no_update BEFORE UPDATE ON version_files FOR EACH ROW
EXECUTE FUNCTION keel_refuse('model version files are immutable');
CREATE TRIGGER version_files_no_delete BEFORE DELETE ON version_files FOR EACH ROW
EXECUTE FUNCTION keel_refuse('model version files are immutable');
CREATE TRIGGER alias_events_no_update BEFORE UPDATE ON alias_events FOR EACH ROW
EXECUTE FUNCTION keel_refuse('alias history is append-only');
CREATE TRIGGER alias_events_no_delete BEFORE DELETE ON alias_events FOR EACH ROW
EXECUTE FUNCTION keel_refuse('alias history is append-only');
CREATE TRIGGER audit_events_no_update BEFORE UPDATE ON audit_events FOR EACH ROW
EXECUTE FUNCTION keel_refuse('audit log is append-only');
CREATE TRIGGER audit_events_no_delete BEFORE DELETE ON audit_events FOR EACH ROW
EXECUTE FUNCTION keel_refuse('audit log is append-only');
CREATE TRIGGER signatures_no_update BEFORE UPDATE ON signatures FOR EACH ROW
EXECUTE FUNCTION keel_refuse('signatures are append-only');
-- TRUNCATE skips row triggers: refuse it on what is append-only.
CREATE TRIGGER versions_no_truncate BEFORE TRUNCATE ON versions
EXECUTE FUNCTION keel_refuse('model versions are never deleted');
CREATE TRIGGER version_files_no_truncate BEFORE TRUNCATE ON version_files
EXECUTE FUNCTION keel_refuse('model version files are immutable');
CREATE TRIGGER alias_events_no_truncate BEFORE TRUNCATE ON alias_events
EXECUTE FUNCTION keel_refuse('alias history is append-only');
CREATE TRIGGER audit_events_no_truncate BEFORE TRUNCATE ON audit_events
EXECUTE FUNCTION keel_refuse('audit log is append-only');
"#;

/// PostgreSQL's migrations after the baseline: `(to, sql)` moves the
/// schema from `to - 1` to `to`. Each new SQLite migration gets its
/// PostgreSQL twin here, so both stores are at the same version.
const PG_MIGRATIONS: &[(i64, &str)] = &[(
    3,
    r#"
CREATE TRIGGER signatures_no_delete BEFORE DELETE ON signatures FOR EACH ROW
EXECUTE FUNCTION keel_refuse('signatures are append-only');
CREATE TRIGGER signatures_no_truncate BEFORE TRUNCATE ON signatures
EXECUTE FUNCTION keel_refuse('signatures are append-only');
"#,
)];

/// The advisory lock a PostgreSQL migration holds (transaction-scoped):
/// "keel-reg" in ASCII.
const PG_MIGRATION_LOCK: i64 = 0x6b65_656c_2d72_6567;

/// Opens (creating if needed) and migrates a database file.
pub(crate) fn open(path: &Path) -> Result<Db, RegistryError> {
    let open_err = |source: rusqlite::Error| RegistryError::Open {
        path: path.to_owned(),
        source: source.into(),
    };
    if let Some(parent) = path.parent().filter(|p| !p.as_os_str().is_empty()) {
        std::fs::create_dir_all(parent).map_err(|source| RegistryError::Io {
            op: "create the directory",
            path: parent.to_owned(),
            source,
        })?;
    }
    let conn = Connection::open(path).map_err(open_err)?;
    setup(&conn).map_err(open_err)?;
    let conn = migrate(conn, path)?;
    Ok(Db(Box::new(Sqlite::new(conn, path, true))))
}

/// An in-memory database (unit tests).
pub(crate) fn open_in_memory() -> Result<Db, RegistryError> {
    let conn = Connection::open_in_memory().map_err(RegistryError::db("opening memory"))?;
    setup(&conn).map_err(RegistryError::db("setting up"))?;
    let conn = migrate(conn, Path::new(":memory:"))?;
    Ok(Db(Box::new(Sqlite::new(
        conn,
        Path::new(":memory:"),
        false,
    ))))
}

/// A read-only connection to a database file already created and
/// migrated: reads on it neither wait for writers nor hold them up (WAL).
pub(crate) fn open_sqlite_reader(path: &Path) -> Result<Sqlite, RegistryError> {
    let open_err = |source: rusqlite::Error| RegistryError::Open {
        path: path.to_owned(),
        source: source.into(),
    };
    let conn = Connection::open_with_flags(
        path,
        rusqlite::OpenFlags::SQLITE_OPEN_READ_WRITE
            | rusqlite::OpenFlags::SQLITE_OPEN_NO_MUTEX
            | rusqlite::OpenFlags::SQLITE_OPEN_URI,
    )
    .map_err(open_err)?;
    conn.busy_timeout(Duration::from_secs(30))
        .map_err(open_err)?;
    conn.pragma_update(None, "query_only", true)
        .map_err(open_err)?;
    Ok(Sqlite::new(conn, path, true))
}

/// Connects to a PostgreSQL registry and migrates its schema.
pub(crate) fn open_postgres(target: Arc<PgTarget>) -> Result<Db, RegistryError> {
    let location = target.location().to_owned();
    let pg = Postgres::connect(target).map_err(|source| RegistryError::Connect {
        location: location.display().to_string(),
        source,
    })?;
    migrate_postgres(&pg)?;
    Ok(Db(Box::new(pg)))
}

/// The schema version a PostgreSQL registry is at (0: none yet).
fn pg_version(pg: &Postgres) -> Result<i64, RegistryError> {
    let rows = pg
        .query("SELECT version FROM keel_schema", &[])
        .map_err(RegistryError::db("reading the schema version"))?;
    Ok(rows
        .first()
        .map(|r| r.get::<i64>(0))
        .transpose()
        .map_err(RegistryError::db("reading the schema version"))?
        .unwrap_or(0))
}

fn migrate_postgres(pg: &Postgres) -> Result<(), RegistryError> {
    let ctx = "migrating the schema";
    pg.begin(crate::storage::TxMode::Schema)
        .map_err(RegistryError::db(ctx))?;
    let out = (|| {
        pg.execute_batch(&format!(
            "SELECT pg_advisory_xact_lock({PG_MIGRATION_LOCK})"
        ))
        .map_err(RegistryError::db(ctx))?;
        pg.execute_batch("CREATE TABLE IF NOT EXISTS keel_schema (version BIGINT NOT NULL)")
            .map_err(RegistryError::db(ctx))?;
        let found = pg_version(pg)?;
        if found > SCHEMA_VERSION {
            return Err(RegistryError::SchemaTooNew {
                path: pg.location().to_owned(),
                found,
                known: SCHEMA_VERSION,
            });
        }
        let mut at = found;
        if at == 0 {
            pg.execute_batch(PG_BASELINE)
                .map_err(RegistryError::db(ctx))?;
            pg.execute("INSERT INTO keel_schema (version) VALUES (0)", &[])
                .map_err(RegistryError::db(ctx))?;
            at = PG_BASELINE_VERSION;
        }
        let from = at;
        for (to, sql) in PG_MIGRATIONS.iter().filter(|(to, _)| *to > from) {
            pg.execute_batch(sql).map_err(RegistryError::db(ctx))?;
            at = *to;
        }
        if at != found {
            pg.execute(
                "UPDATE keel_schema SET version = ?1",
                crate::storage::params![at],
            )
            .map_err(RegistryError::db(ctx))?;
        }
        Ok(())
    })();
    match out {
        Ok(()) => pg.commit().map_err(RegistryError::db(ctx)),
        Err(e) => {
            pg.rollback();
            Err(e)
        }
    }
}

fn setup(conn: &Connection) -> rusqlite::Result<()> {
    // Concurrent registrations from several processes wait for each other
    // (BEGIN IMMEDIATE takes the write lock up front) rather than fail.
    conn.busy_timeout(Duration::from_secs(30))?;
    conn.pragma_update(None, "journal_mode", "WAL")?;
    conn.pragma_update(None, "synchronous", "FULL")?;
    conn.pragma_update(None, "foreign_keys", "ON")?;
    Ok(())
}

fn migrate(mut conn: Connection, path: &Path) -> Result<Connection, RegistryError> {
    let tx = conn
        .transaction_with_behavior(rusqlite::TransactionBehavior::Immediate)
        .map_err(RegistryError::db("starting the migration"))?;
    let found: i64 = tx
        .query_row("PRAGMA user_version", [], |r| r.get(0))
        .map_err(RegistryError::db("reading the schema version"))?;
    if found > SCHEMA_VERSION {
        return Err(RegistryError::SchemaTooNew {
            path: path.to_owned(),
            found,
            known: SCHEMA_VERSION,
        });
    }
    for (i, sql) in MIGRATIONS.iter().enumerate().skip(found as usize) {
        tx.execute_batch(sql)
            .map_err(RegistryError::db("migrating the schema"))?;
        tx.pragma_update(None, "user_version", i as i64 + 1)
            .map_err(RegistryError::db("migrating the schema"))?;
    }
    tx.commit()
        .map_err(RegistryError::db("migrating the schema"))?;
    Ok(conn)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every SQLite migration after the PostgreSQL baseline has its
    /// PostgreSQL twin, numbered in order: both stores end at the same
    /// schema version.
    #[test]
    fn postgres_migrations_reach_the_same_schema_version() {
        let mut at = PG_BASELINE_VERSION;
        for (to, _) in PG_MIGRATIONS {
            assert_eq!(*to, at + 1, "PostgreSQL migrations are numbered in order");
            at = *to;
        }
        assert_eq!(at, SCHEMA_VERSION);
    }
}
