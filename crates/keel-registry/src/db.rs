//! The SQLite database: opening (WAL, foreign keys, a busy timeout so
//! concurrent writers wait instead of failing) and schema migrations,
//! numbered by `PRAGMA user_version`.
//!
//! Immutability is enforced by the database itself: triggers refuse any
//! change to a version once it has left `PENDING_REGISTRATION` but to its
//! description (metadata; schema 2), any change
//! to its files, and any update or delete of an alias or audit event. The
//! hash chains catch what gets past them (someone dropping the triggers).

use std::path::Path;
use std::time::Duration;

use rusqlite::Connection;

use crate::RegistryError;

/// Each entry moves the schema from version `i` to `i + 1`.
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
];

/// The schema version this build writes.
pub const SCHEMA_VERSION: i64 = MIGRATIONS.len() as i64;

/// Opens (creating if needed) and migrates a database file.
pub(crate) fn open(path: &Path) -> Result<Connection, RegistryError> {
    let open_err = |source| RegistryError::Open {
        path: path.to_owned(),
        source,
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
    migrate(conn, path)
}

/// An in-memory database (unit tests).
pub(crate) fn open_in_memory() -> Result<Connection, RegistryError> {
    let conn = Connection::open_in_memory().map_err(RegistryError::db("opening memory"))?;
    setup(&conn).map_err(RegistryError::db("setting up"))?;
    migrate(conn, Path::new(":memory:"))
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
