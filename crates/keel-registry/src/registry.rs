//! [`Registry`]: every operation on the database, written once over the
//! [`crate::storage`] trait for SQLite and PostgreSQL alike. Each mutating
//! operation is one write transaction (serialised with every other
//! writer, on every replica) that also appends its audit event (and alias
//! event), so either all of it is stored or none.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use serde_json::json;

use keel_store::{Digest, FileEntry, Manifest};

use crate::chain::{
    self, AliasRecord, AuditRecord, Break, ChainName, ChainReport, ALIAS_DOMAIN, AUDIT_DOMAIN,
    GENESIS,
};
use crate::storage::{params, Backend, Db, Param, Tx, TxMode};
use crate::types::{
    check_alias, check_model_name, AliasAction, AliasEvent, AliasTarget, ApiKey, AuditEvent,
    Lineage, Model, Role, SignatureRecord, Status, Tag, Version, VersionFile, VersionRef,
};
use crate::{Clock, RegistryError};

type Result<T> = std::result::Result<T, RegistryError>;

/// What a new version is, apart from its files.
#[derive(Debug, Clone, Default)]
pub struct NewVersion {
    pub model: String,
    /// Where it came from, as given (a directory, a URL, an MLflow source).
    pub source: String,
    pub description: String,
    pub lineage: Lineage,
    pub tags: Vec<Tag>,
    /// Create the model if it does not exist yet.
    pub create_model: bool,
}

/// A version's files as they go into the registry: where they live and the
/// manifest that lists them.
#[derive(Debug, Clone)]
pub struct Artifacts {
    /// The storage URL the file names are relative to.
    pub url: String,
    pub manifest: Manifest,
}

/// A version's searchable fields, without its files.
#[derive(Debug, Clone)]
pub struct VersionRow {
    id: i64,
    pub model: String,
    pub version: u64,
    pub run_id: Option<String>,
    /// The source as stored.
    pub source: String,
    pub artifact_url: Option<String>,
    pub created_ms: i64,
    pub updated_ms: i64,
    /// Empty unless asked for.
    pub tags: Vec<Tag>,
}

/// A model's searchable fields.
#[derive(Debug, Clone)]
pub struct ModelRow {
    id: i64,
    pub name: String,
    pub created_ms: i64,
    pub updated_ms: i64,
    /// Empty unless asked for.
    pub tags: Vec<Tag>,
}

/// The model registry on one SQLite or PostgreSQL database.
#[derive(Debug)]
pub struct Registry {
    conn: Db,
    clock: Arc<dyn Clock>,
    path: PathBuf,
}

const SECRET_PREFIX: &str = "keel_";

fn tags_json(tags: &[Tag]) -> serde_json::Value {
    tags.iter()
        .map(|t| (t.key.clone(), serde_json::Value::String(t.value.clone())))
        .collect::<serde_json::Map<_, _>>()
        .into()
}

/// The longest start of `s` that is at most `max` bytes and ends on a
/// character boundary.
fn head(s: &str, max: usize) -> &str {
    let mut end = max.min(s.len());
    while !s.is_char_boundary(end) {
        end -= 1;
    }
    &s[..end]
}

/// The longest strings the registry stores, in bytes (documented in
/// docs/model.md): no request can make every later read or search slow.
pub mod limits {
    /// A version's source.
    pub const SOURCE: usize = 4096;
    /// A model's or version's description.
    pub const DESCRIPTION: usize = 5000;
    /// A run id, a code commit, a data set's digest, an MLflow model id.
    pub const ID: usize = 256;
    /// A URI in the lineage (data set, checkpoint store).
    pub const URI: usize = 4096;
    /// Data sets in one version's lineage.
    pub const DATASETS: usize = 64;
    /// Tags given with one model or version.
    pub const TAGS: usize = 100;
    /// The reason given for an alias change.
    pub const REASON: usize = 1000;
    /// A failed version's status message (longer ones are cut).
    pub const STATUS_MESSAGE: usize = 2000;
}

/// Refuses a string over `max` bytes, quoting only its start.
fn check_len(what: &'static str, value: &str, max: usize) -> Result<()> {
    if value.len() <= max {
        return Ok(());
    }
    Err(RegistryError::Invalid {
        what,
        value: format!("{}...", head(value, 40)),
        reason: format!("at most {max} bytes, got {}", value.len()),
    })
}

fn check_lineage(l: &Lineage) -> Result<()> {
    for (what, v) in [
        ("run id", &l.run_id),
        ("code commit", &l.code_commit),
        ("MLflow model id", &l.mlflow_model_id),
    ] {
        if let Some(v) = v {
            check_len(what, v, limits::ID)?;
        }
    }
    if let Some(link) = &l.run_link {
        check_len("run link", link, limits::URI)?;
    }
    if l.datasets.len() > limits::DATASETS {
        return Err(RegistryError::Invalid {
            what: "lineage",
            value: format!("{} data sets", l.datasets.len()),
            reason: format!("at most {} data sets", limits::DATASETS),
        });
    }
    for d in &l.datasets {
        check_len("data set URI", &d.uri, limits::URI)?;
        if let Some(x) = &d.digest {
            check_len("data set digest", x, limits::ID)?;
        }
    }
    if let Some(c) = &l.checkpoint {
        check_len("checkpoint URL", &c.url, limits::URI)?;
        check_len("checkpoint run", &c.run, limits::ID)?;
        check_len("checkpoint digest", &c.manifest_digest, limits::ID)?;
    }
    Ok(())
}

fn check_tags(tags: &[Tag]) -> Result<()> {
    if tags.len() > limits::TAGS {
        return Err(RegistryError::Invalid {
            what: "tags",
            value: format!("{} tags", tags.len()),
            reason: format!("at most {} tags at once", limits::TAGS),
        });
    }
    tags.iter().try_for_each(check_tag)
}

fn check_tag(t: &Tag) -> Result<()> {
    if t.key.is_empty() || t.key.len() > 250 {
        return Err(RegistryError::Invalid {
            what: "tag key",
            value: head(&t.key, 100).to_owned(),
            reason: "tag keys are 1-250 characters".into(),
        });
    }
    if t.value.len() > 5000 {
        return Err(RegistryError::Invalid {
            what: "tag value",
            value: format!("{}...", head(&t.value, 40)),
            reason: "tag values are at most 5000 bytes".into(),
        });
    }
    Ok(())
}

/// Opens more connections to one registry's database (a pool's):
/// [`Registry::connector`].
#[derive(Debug, Clone)]
pub struct Connector {
    kind: ConnectorKind,
    clock: Arc<dyn Clock>,
    path: PathBuf,
}

#[derive(Debug, Clone)]
enum ConnectorKind {
    SqliteReader,
    Postgres(Arc<crate::storage::PgTarget>),
}

/// A SQLite registry's pool: this many read connections at most.
pub const SQLITE_POOL_SIZE: usize = 8;
/// How long a SQLite request waits for a read connection of the pool.
pub const SQLITE_POOL_WAIT: std::time::Duration = std::time::Duration::from_secs(5);

impl Connector {
    /// A new connection, as a registry (on SQLite, read-only).
    pub fn open(&self) -> Result<Registry> {
        let conn = match &self.kind {
            ConnectorKind::SqliteReader => Db(Box::new(crate::db::open_sqlite_reader(&self.path)?)),
            ConnectorKind::Postgres(t) => Db(Box::new(
                crate::storage::Postgres::connect(t.clone()).map_err(|source| {
                    RegistryError::Connect {
                        location: t.location().display().to_string(),
                        source,
                    }
                })?,
            )),
        };
        Ok(Registry {
            conn,
            clock: self.clock.clone(),
            path: self.path.clone(),
        })
    }

    /// The most connections a pool opens with this connector
    /// (PostgreSQL: the configured `db_pool_size`).
    pub fn pool_size(&self) -> usize {
        match &self.kind {
            ConnectorKind::SqliteReader => SQLITE_POOL_SIZE,
            ConnectorKind::Postgres(t) => t.pool_size,
        }
    }

    /// The longest a request waits for anything of the database: a
    /// connection of the pool, the write lock, one statement
    /// (PostgreSQL: the configured `db_timeout`).
    pub fn wait(&self) -> std::time::Duration {
        match &self.kind {
            ConnectorKind::SqliteReader => SQLITE_POOL_WAIT,
            ConnectorKind::Postgres(t) => t.timeout,
        }
    }
}

impl Registry {
    /// Opens (creating and migrating) the SQLite database at `path`.
    pub fn open(path: &Path, clock: Arc<dyn Clock>) -> Result<Self> {
        Ok(Self {
            conn: crate::db::open(path)?,
            clock,
            path: path.to_owned(),
        })
    }

    /// A registry in memory (tests).
    pub fn open_in_memory(clock: Arc<dyn Clock>) -> Result<Self> {
        Ok(Self {
            conn: crate::db::open_in_memory()?,
            clock,
            path: PathBuf::from(":memory:"),
        })
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    /// The clock this registry stamps changes with.
    /// The clock's time as the database keeps it (SQLite's integers).
    fn now_ms(&self) -> i64 {
        i64::try_from(self.clock.now_ms()).unwrap_or(i64::MAX)
    }

    pub fn clock(&self) -> Arc<dyn Clock> {
        self.clock.clone()
    }

    /// Connects to a PostgreSQL registry (creating and migrating its
    /// schema): the same registry as [`Registry::open`]'s, on a database
    /// several `keel model serve` replicas share.
    pub fn open_postgres(opts: &crate::PgOptions, clock: Arc<dyn Clock>) -> Result<Self> {
        let target = Arc::new(crate::storage::PgTarget::new(opts)?);
        let path = target.location().to_owned();
        Ok(Self {
            conn: crate::db::open_postgres(target)?,
            clock,
            path,
        })
    }

    /// The connection, for the registry's other modules.
    pub(crate) fn db(&self) -> &Db {
        &self.conn
    }

    /// Which database this registry is on.
    pub fn backend(&self) -> Backend {
        self.conn.backend()
    }

    /// A read-only registry on its own connection to the database file at
    /// `path` (already created and migrated by [`Registry::open`]): reads
    /// on it neither wait for writers nor hold them up (WAL).
    pub fn open_reader(path: &Path, clock: Arc<dyn Clock>) -> Result<Self> {
        Ok(Self {
            conn: Db(Box::new(crate::db::open_sqlite_reader(path)?)),
            clock,
            path: path.to_owned(),
        })
    }

    /// How to open more connections to this registry's database, for a
    /// pool of them: read-only ones on SQLite (in WAL they neither wait
    /// for the writer nor hold it up), full ones on PostgreSQL; `None`
    /// for an in-memory registry, which only its own connection sees.
    pub fn connector(&self) -> Option<Connector> {
        let kind = match self.conn.0.pg_target() {
            Some(t) => ConnectorKind::Postgres(t.clone()),
            None if self.conn.0.another_possible() => ConnectorKind::SqliteReader,
            None => return None,
        };
        Some(Connector {
            kind,
            clock: self.clock.clone(),
            path: self.path.clone(),
        })
    }

    /// Runs `f` in one read transaction: every query it makes sees the
    /// same committed state.
    pub fn snapshot<T>(&self, f: impl FnOnce(&Self) -> Result<T>) -> Result<T> {
        let tx = self
            .conn
            .begin(TxMode::Read)
            .map_err(RegistryError::db("starting a read"))?;
        let out = f(self);
        // A read has nothing to keep: ending it only releases its snapshot
        // (and a connection must never be left inside a transaction).
        if out.is_ok() {
            tx.commit().map_err(RegistryError::db("ending a read"))?;
        }
        out
    }

    fn begin(&mut self) -> Result<Tx<'_>> {
        self.conn
            .begin(TxMode::Write)
            .map_err(RegistryError::db("starting a write transaction"))
    }

    // ----- models -------------------------------------------------------

    /// Creates a model.
    pub fn create_model(
        &mut self,
        actor: &str,
        name: &str,
        description: &str,
        tags: &[Tag],
    ) -> Result<Model> {
        check_model_name(name)?;
        check_len("description", description, limits::DESCRIPTION)?;
        check_tags(tags)?;
        let now = self.now_ms();
        let tx = self.begin()?;
        if model_id(&tx, name)?.is_some() {
            return Err(RegistryError::ModelExists {
                name: name.to_owned(),
            });
        }
        insert_model(&tx, now, actor, name, description, tags)?;
        tx.commit().map_err(RegistryError::db("committing"))?;
        self.model(name)
    }

    /// A model with its tags, aliases and version count.
    pub fn model(&self, name: &str) -> Result<Model> {
        let id = model_id(&self.conn, name)?.ok_or_else(|| RegistryError::UnknownModel {
            name: name.to_owned(),
        })?;
        load_model(&self.conn, id)
    }

    /// Every model, by name.
    pub fn models(&self) -> Result<Vec<Model>> {
        let ids: Vec<i64> = self
            .conn
            .query_map("SELECT id FROM models ORDER BY name", params![], |r| {
                r.get(0)
            })
            .map_err(RegistryError::db("listing models"))?;
        ids.into_iter()
            .map(|id| load_model(&self.conn, id))
            .collect()
    }

    /// Models by name after `after` (exclusive), at most `limit`: one
    /// page of [`Registry::models`], so a reader never holds every model.
    pub fn models_after(&self, after: Option<&str>, limit: usize) -> Result<Vec<Model>> {
        let limit = i64::try_from(limit).unwrap_or(i64::MAX);
        let ids: Vec<i64> = {
            self.conn.query_map("SELECT id FROM models WHERE CAST(?1 AS TEXT) IS NULL OR name > ?1 ORDER BY name LIMIT ?2", params![after, limit], |r| r.get(0)).map_err(RegistryError::db("listing models"))?
        };
        ids.into_iter()
            .map(|id| load_model(&self.conn, id))
            .collect()
    }

    /// Deletes a model that has no versions (versions are never deleted,
    /// so neither is a model that has any).
    pub fn delete_model(&mut self, actor: &str, name: &str) -> Result<()> {
        let now = self.now_ms();
        let tx = self.begin()?;
        let id = require_model(&tx, name)?;
        let n: i64 = tx
            .query_row(
                "SELECT COUNT(*) FROM versions WHERE model_id = ?1",
                params![id],
                |r| r.get(0),
            )
            .map_err(RegistryError::db("counting versions"))?;
        if n > 0 {
            return Err(RegistryError::ModelHasVersions {
                name: name.to_owned(),
                versions: n as u64,
            });
        }
        for sql in [
            "DELETE FROM model_tags WHERE model_id = ?1",
            "DELETE FROM aliases WHERE model_id = ?1",
            "DELETE FROM models WHERE id = ?1",
        ] {
            tx.execute(sql, params![id])
                .map_err(RegistryError::db("deleting a model"))?;
        }
        audit(&tx, now, actor, "model.delete", name, json!({}))?;
        tx.commit().map_err(RegistryError::db("committing"))
    }

    /// Changes a model's description (metadata: audited).
    pub fn update_model(&mut self, actor: &str, name: &str, description: &str) -> Result<Model> {
        check_len("description", description, limits::DESCRIPTION)?;
        let now = self.now_ms();
        let tx = self.begin()?;
        let id = require_model(&tx, name)?;
        tx.execute(
            "UPDATE models SET description = ?2, updated_ms = CASE WHEN updated_ms > ?3 THEN updated_ms ELSE ?3 END WHERE id = ?1",
            params![id, description, now],
        )
        .map_err(RegistryError::db("updating a model"))?;
        audit(
            &tx,
            now,
            actor,
            "model.update",
            name,
            json!({"description": description}),
        )?;
        tx.commit().map_err(RegistryError::db("committing"))?;
        self.model(name)
    }

    /// Renames a model that has no versions and no alias history: the
    /// alias history and audit log name models by name and cannot be
    /// rewritten, and versions' artifact URLs hold the name.
    pub fn rename_model(&mut self, actor: &str, name: &str, new_name: &str) -> Result<Model> {
        check_model_name(new_name)?;
        let now = self.now_ms();
        let tx = self.begin()?;
        let id = require_model(&tx, name)?;
        if model_id(&tx, new_name)?.is_some() {
            return Err(RegistryError::ModelExists {
                name: new_name.to_owned(),
            });
        }
        let (versions, aliases): (i64, i64) = tx
            .query_row(
                "SELECT (SELECT COUNT(*) FROM versions WHERE model_id = ?1),
                        (SELECT COUNT(*) FROM alias_events WHERE model = ?2)",
                params![id, name],
                |r| Ok((r.get(0)?, r.get(1)?)),
            )
            .map_err(RegistryError::db("reading a model"))?;
        if versions > 0 || aliases > 0 {
            return Err(RegistryError::NoRename {
                name: name.to_owned(),
                reason: format!(
                    "it has {versions} version(s) and {aliases} alias event(s), which the append-only alias history, the audit log and the artifact URLs record under this name; register the versions under a new model instead (keel model register NEW --from ARTIFACT_URL)"
                ),
            });
        }
        tx.execute(
            "UPDATE models SET name = ?2, updated_ms = CASE WHEN updated_ms > ?3 THEN updated_ms ELSE ?3 END WHERE id = ?1",
            params![id, new_name, now],
        )
        .map_err(RegistryError::db("renaming a model"))?;
        audit(
            &tx,
            now,
            actor,
            "model.rename",
            name,
            json!({"new_name": new_name}),
        )?;
        tx.commit().map_err(RegistryError::db("committing"))?;
        self.model(new_name)
    }

    /// Sets (or with `value: None` deletes) a model tag.
    pub fn set_model_tag(
        &mut self,
        actor: &str,
        name: &str,
        key: &str,
        value: Option<&str>,
    ) -> Result<()> {
        if let Some(v) = value {
            check_tag(&Tag {
                key: key.into(),
                value: v.into(),
            })?;
        }
        let now = self.now_ms();
        let tx = self.begin()?;
        let id = require_model(&tx, name)?;
        match value {
            Some(v) => tx.execute(
                "INSERT INTO model_tags (model_id, key, value) VALUES (?1, ?2, ?3)
                 ON CONFLICT (model_id, key) DO UPDATE SET value = excluded.value",
                params![id, key, v],
            ),
            None => tx.execute(
                "DELETE FROM model_tags WHERE model_id = ?1 AND key = ?2",
                params![id, key],
            ),
        }
        .map_err(RegistryError::db("setting a tag"))?;
        touch_model(&tx, id, now)?;
        let action = if value.is_some() {
            "model.tag.set"
        } else {
            "model.tag.delete"
        };
        audit(
            &tx,
            now,
            actor,
            action,
            name,
            json!({"key": key, "value": value}),
        )?;
        tx.commit().map_err(RegistryError::db("committing"))
    }

    // ----- versions -----------------------------------------------------

    /// Reserves the next version number (PENDING_REGISTRATION), for a
    /// registration whose files are still to be uploaded.
    pub fn reserve_version(&mut self, actor: &str, new: &NewVersion) -> Result<Version> {
        self.insert_version(actor, new, None)
    }

    /// Registers a complete version in one step: READY, immutable. With
    /// `artifacts: None` only the source is recorded (MLflow's
    /// `model-versions/create`).
    pub fn register_version(
        &mut self,
        actor: &str,
        new: &NewVersion,
        artifacts: Option<&Artifacts>,
    ) -> Result<Version> {
        self.insert_version(actor, new, Some(artifacts))
    }

    fn insert_version(
        &mut self,
        actor: &str,
        new: &NewVersion,
        complete: Option<Option<&Artifacts>>,
    ) -> Result<Version> {
        crate::types::check_stored_model_name(&new.model)?;
        check_tags(&new.tags)?;
        check_len("source", &new.source, limits::SOURCE)?;
        check_len("description", &new.description, limits::DESCRIPTION)?;
        check_lineage(&new.lineage)?;
        if new.source.is_empty() {
            return Err(RegistryError::Invalid {
                what: "source",
                value: String::new(),
                reason: "a version needs a source".into(),
            });
        }
        let lineage = serde_json::to_string(&new.lineage).unwrap_or_default();
        let now = self.now_ms();
        let tx = self.begin()?;
        let id = match model_id(&tx, &new.model)? {
            Some(id) => id,
            None if new.create_model => {
                check_model_name(&new.model)?;
                insert_model(&tx, now, actor, &new.model, "", &[])?
            }
            None => {
                return Err(RegistryError::UnknownModel {
                    name: new.model.clone(),
                })
            }
        };
        if let Some(parent) = new.lineage.parent_version {
            version_row_id(&tx, id, &new.model, parent)?;
        }
        // The write lock is held from BEGIN IMMEDIATE: no other writer can
        // take the same number between this read and the insert.
        let number: i64 = tx
            .query_row(
                "SELECT COALESCE(MAX(number), 0) + 1 FROM versions WHERE model_id = ?1",
                params![id],
                |r| r.get(0),
            )
            .map_err(RegistryError::db("numbering a version"))?;
        let vid: i64 = tx.query_row(
            "INSERT INTO versions (model_id, number, status, source, description, run_id, lineage,
                                   created_ms, created_by, updated_ms)
             VALUES (?1, ?2, 'PENDING_REGISTRATION', ?3, ?4, ?5, ?6, ?7, ?8, ?7) RETURNING id",
            params![
                id,
                number,
                new.source,
                new.description,
                new.lineage.run_id,
                lineage,
                now,
                actor
            ],
            |r| r.get(0),
        )
        .map_err(RegistryError::db("inserting a version"))?;
        for t in &new.tags {
            tx.execute(
                "INSERT INTO version_tags (version_id, key, value) VALUES (?1, ?2, ?3)
                 ON CONFLICT (version_id, key) DO UPDATE SET value = excluded.value",
                params![vid, t.key, t.value],
            )
            .map_err(RegistryError::db("tagging a version"))?;
        }
        touch_model(&tx, id, now)?;
        let target = format!("{}:{number}", new.model);
        audit(
            &tx,
            now,
            actor,
            "version.create",
            &target,
            json!({
                "version": number,
                "source": new.source,
                "description": new.description,
                "lineage": new.lineage,
                "tags": tags_json(&new.tags),
            }),
        )?;
        if let Some(artifacts) = complete {
            finish(&tx, now, actor, vid, &target, artifacts)?;
        }
        tx.commit().map_err(RegistryError::db("committing"))?;
        self.version(&new.model, number as u64)
    }

    /// Completes a reserved version with its files: READY, immutable.
    pub fn complete_version(
        &mut self,
        actor: &str,
        model: &str,
        number: u64,
        artifacts: &Artifacts,
    ) -> Result<Version> {
        let now = self.now_ms();
        let tx = self.begin()?;
        let id = require_model(&tx, model)?;
        let vid = pending_version(&tx, id, model, number)?;
        finish(
            &tx,
            now,
            actor,
            vid,
            &format!("{model}:{number}"),
            Some(artifacts),
        )?;
        touch_model(&tx, id, now)?;
        tx.commit().map_err(RegistryError::db("committing"))?;
        self.version(model, number)
    }

    /// Marks a reserved version as failed; its number stays taken.
    pub fn fail_version(
        &mut self,
        actor: &str,
        model: &str,
        number: u64,
        message: &str,
    ) -> Result<Version> {
        let message = head(message, limits::STATUS_MESSAGE);
        let now = self.now_ms();
        let tx = self.begin()?;
        let id = require_model(&tx, model)?;
        let vid = pending_version(&tx, id, model, number)?;
        tx.execute(
            "UPDATE versions SET status = 'FAILED_REGISTRATION', status_message = ?2, updated_ms = ?3
             WHERE id = ?1",
            params![vid, message, now],
        )
        .map_err(RegistryError::db("failing a version"))?;
        audit(
            &tx,
            now,
            actor,
            "version.fail",
            &format!("{model}:{number}"),
            json!({"version": number, "message": message}),
        )?;
        tx.commit().map_err(RegistryError::db("committing"))?;
        self.version(model, number)
    }

    /// Sets (or with `value: None` deletes) a version tag. Tags are
    /// annotations, not part of the immutable version.
    pub fn set_version_tag(
        &mut self,
        actor: &str,
        model: &str,
        number: u64,
        key: &str,
        value: Option<&str>,
    ) -> Result<()> {
        if let Some(v) = value {
            check_tag(&Tag {
                key: key.into(),
                value: v.into(),
            })?;
        }
        let now = self.now_ms();
        let tx = self.begin()?;
        let id = require_model(&tx, model)?;
        let vid = version_row_id(&tx, id, model, number)?;
        match value {
            Some(v) => tx.execute(
                "INSERT INTO version_tags (version_id, key, value) VALUES (?1, ?2, ?3)
                 ON CONFLICT (version_id, key) DO UPDATE SET value = excluded.value",
                params![vid, key, v],
            ),
            None => tx.execute(
                "DELETE FROM version_tags WHERE version_id = ?1 AND key = ?2",
                params![vid, key],
            ),
        }
        .map_err(RegistryError::db("setting a tag"))?;
        let action = if value.is_some() {
            "version.tag.set"
        } else {
            "version.tag.delete"
        };
        audit(
            &tx,
            now,
            actor,
            action,
            &format!("{model}:{number}"),
            json!({"key": key, "value": value}),
        )?;
        tx.commit().map_err(RegistryError::db("committing"))
    }

    /// Changes a version's description: metadata, the one field of a
    /// version that may change after READY (audited).
    pub fn update_version(
        &mut self,
        actor: &str,
        model: &str,
        number: u64,
        description: &str,
    ) -> Result<Version> {
        check_len("description", description, limits::DESCRIPTION)?;
        let now = self.now_ms();
        let tx = self.begin()?;
        let id = require_model(&tx, model)?;
        let vid = version_row_id(&tx, id, model, number)?;
        tx.execute(
            "UPDATE versions SET description = ?2, updated_ms = CASE WHEN updated_ms > ?3 THEN updated_ms ELSE ?3 END WHERE id = ?1",
            params![vid, description, now],
        )
        .map_err(RegistryError::db("updating a version"))?;
        audit(
            &tx,
            now,
            actor,
            "version.update",
            &format!("{model}:{number}"),
            json!({"version": number, "description": description}),
        )?;
        tx.commit().map_err(RegistryError::db("committing"))?;
        self.version(model, number)
    }

    /// Versions are never deleted: this names the version and says so (an
    /// unknown version is reported as unknown).
    pub fn delete_version(&self, model: &str, number: u64) -> Result<()> {
        self.version(model, number)?;
        Err(RegistryError::VersionsAreKept {
            name: model.to_owned(),
            version: number,
        })
    }

    /// One version.
    pub fn version(&self, model: &str, number: u64) -> Result<Version> {
        let id = model_id(&self.conn, model)?.ok_or_else(|| RegistryError::UnknownModel {
            name: model.to_owned(),
        })?;
        let vid = version_row_id(&self.conn, id, model, number)?;
        load_version(&self.conn, vid)
    }

    /// Every version of a model, oldest first.
    pub fn versions(&self, model: &str) -> Result<Vec<Version>> {
        let id = model_id(&self.conn, model)?.ok_or_else(|| RegistryError::UnknownModel {
            name: model.to_owned(),
        })?;
        let ids = self.version_ids("WHERE v.model_id = ?1", params![id])?;
        load_versions(&self.conn, &ids)
    }

    /// A model's versions numbered above `after`, at most `limit`, oldest
    /// first: one page of [`Registry::versions`].
    pub fn versions_after(&self, model: &str, after: u64, limit: usize) -> Result<Vec<Version>> {
        let id = model_id(&self.conn, model)?.ok_or_else(|| RegistryError::UnknownModel {
            name: model.to_owned(),
        })?;
        let after = i64::try_from(after).unwrap_or(i64::MAX);
        let limit = i64::try_from(limit).unwrap_or(i64::MAX);
        let ids = self
            .version_ids(
                "WHERE v.model_id = ?1 AND v.number > ?2",
                params![id, after],
            )?
            .into_iter()
            .take(usize::try_from(limit).unwrap_or(usize::MAX))
            .collect::<Vec<_>>();
        load_versions(&self.conn, &ids)
    }

    /// Versions across models, optionally of one model and one run.
    pub fn search_versions(
        &self,
        model: Option<&str>,
        run_id: Option<&str>,
    ) -> Result<Vec<Version>> {
        let ids = self.version_ids(
            "WHERE (CAST(?1 AS TEXT) IS NULL OR m.name = ?1)
               AND (CAST(?2 AS TEXT) IS NULL OR v.run_id = ?2)",
            params![model, run_id],
        )?;
        load_versions(&self.conn, &ids)
    }

    /// Every version's searchable fields (one query, no files, tags only
    /// when asked for, in one more), optionally of one model: what a
    /// search filters and sorts before it loads the versions of one page.
    pub fn version_rows(
        &self,
        model: Option<&str>,
        run_id: Option<&str>,
        with_tags: bool,
    ) -> Result<Vec<VersionRow>> {
        let mut out = self
            .conn
            .query_map(
                "SELECT v.id, m.name, v.number, v.run_id, v.source, v.artifact_url, v.created_ms, v.updated_ms
                 FROM versions v JOIN models m ON m.id = v.model_id
                 WHERE (CAST(?1 AS TEXT) IS NULL OR m.name = ?1)
                   AND (CAST(?2 AS TEXT) IS NULL OR v.run_id = ?2)
                 ORDER BY v.id",
                params![model, run_id],
                |r| {
                    Ok(VersionRow {
                        id: r.get(0)?,
                        model: r.get(1)?,
                        version: r.get::<i64>(2)? as u64,
                        run_id: r.get(3)?,
                        source: r.get(4)?,
                        artifact_url: r.get(5)?,
                        created_ms: r.get(6)?,
                        updated_ms: r.get(7)?,
                        tags: Vec::new(),
                    })
                },
            )
            .map_err(RegistryError::db("listing versions"))?;
        if with_tags {
            let tags = self
                .conn
                .query_map(
                    "SELECT t.version_id, t.key, t.value FROM version_tags t
                     JOIN versions v ON v.id = t.version_id JOIN models m ON m.id = v.model_id
                     WHERE (CAST(?1 AS TEXT) IS NULL OR m.name = ?1)
                       AND (CAST(?2 AS TEXT) IS NULL OR v.run_id = ?2)
                     ORDER BY t.version_id, t.key",
                    params![model, run_id],
                    |r| {
                        Ok((
                            r.get::<i64>(0)?,
                            Tag {
                                key: r.get(1)?,
                                value: r.get(2)?,
                            },
                        ))
                    },
                )
                .map_err(RegistryError::db("reading tags"))?;
            attach_tags(&mut out, tags, |row| row.id, |row| &mut row.tags);
        }
        Ok(out)
    }

    /// The version a [`VersionRow`] describes.
    pub fn version_of_row(&self, row: &VersionRow) -> Result<Version> {
        load_version(&self.conn, row.id)
    }

    /// The versions these rows describe, in their order, with one query
    /// per table.
    pub fn versions_of_rows(&self, rows: &[VersionRow]) -> Result<Vec<Version>> {
        let ids: Vec<i64> = rows.iter().map(|r| r.id).collect();
        load_versions(&self.conn, &ids)
    }

    /// Every model's searchable fields (tags only when asked for).
    pub fn model_rows(&self, with_tags: bool) -> Result<Vec<ModelRow>> {
        let mut out = self
            .conn
            .query_map(
                "SELECT id, name, created_ms, updated_ms FROM models ORDER BY id",
                params![],
                |r| {
                    Ok(ModelRow {
                        id: r.get(0)?,
                        name: r.get(1)?,
                        created_ms: r.get(2)?,
                        updated_ms: r.get(3)?,
                        tags: Vec::new(),
                    })
                },
            )
            .map_err(RegistryError::db("listing models"))?;
        if with_tags {
            let tags = self
                .conn
                .query_map(
                    "SELECT model_id, key, value FROM model_tags ORDER BY model_id, key",
                    params![],
                    |r| {
                        Ok((
                            r.get::<i64>(0)?,
                            Tag {
                                key: r.get(1)?,
                                value: r.get(2)?,
                            },
                        ))
                    },
                )
                .map_err(RegistryError::db("reading tags"))?;
            attach_tags(&mut out, tags, |row| row.id, |row| &mut row.tags);
        }
        Ok(out)
    }

    fn version_ids(&self, filter: &str, args: &[Param<'_>]) -> Result<Vec<i64>> {
        let sql = format!(
            "SELECT v.id FROM versions v JOIN models m ON m.id = v.model_id {filter}
             ORDER BY m.name, v.number"
        );
        self.conn
            .query_map(&sql, args, |r| r.get(0))
            .map_err(RegistryError::db("listing versions"))
    }

    /// The version a reference names: an alias's target, a number, or the
    /// highest READY version.
    pub fn resolve(&self, r: &VersionRef) -> Result<Version> {
        match r {
            VersionRef::Number(m, n) => self.version(m, *n),
            VersionRef::Alias(m, a) => {
                let id = model_id(&self.conn, m)?
                    .ok_or_else(|| RegistryError::UnknownModel { name: m.clone() })?;
                let n = alias_target(&self.conn, id, a)?.ok_or_else(|| {
                    RegistryError::UnknownAlias {
                        name: m.clone(),
                        alias: a.clone(),
                    }
                })?;
                self.version(m, n)
            }
            VersionRef::Latest(m) => {
                let id = model_id(&self.conn, m)?
                    .ok_or_else(|| RegistryError::UnknownModel { name: m.clone() })?;
                let n: Option<i64> = self
                    .conn
                    .query_row(
                        "SELECT MAX(number) FROM versions WHERE model_id = ?1 AND status = 'READY'",
                        params![id],
                        |r| r.get(0),
                    )
                    .map_err(RegistryError::db("finding the latest version"))?;
                match n {
                    Some(n) => self.version(m, n as u64),
                    None => Err(RegistryError::Invalid {
                        what: "model",
                        value: m.clone(),
                        reason: "it has no READY version".into(),
                    }),
                }
            }
        }
    }

    // ----- aliases ------------------------------------------------------

    /// Points an alias at a READY version.
    pub fn set_alias(
        &mut self,
        actor: &str,
        model: &str,
        alias: &str,
        version: u64,
        reason: &str,
    ) -> Result<AliasEvent> {
        check_alias(alias)?;
        check_len("reason", reason, limits::REASON)?;
        let now = self.now_ms();
        let tx = self.begin()?;
        let id = require_model(&tx, model)?;
        let vid = version_row_id(&tx, id, model, version)?;
        let status: String = tx
            .query_row(
                "SELECT status FROM versions WHERE id = ?1",
                params![vid],
                |r| r.get(0),
            )
            .map_err(RegistryError::db("reading a version"))?;
        if status != "READY" {
            return Err(RegistryError::WrongStatus {
                name: model.to_owned(),
                version,
                status,
                expected: "READY",
            });
        }
        let old = alias_target(&tx, id, alias)?;
        let ev = move_alias(
            &tx,
            now,
            actor,
            id,
            model,
            alias,
            AliasAction::Set,
            old,
            Some(version),
            reason,
        )?;
        tx.commit().map_err(RegistryError::db("committing"))?;
        Ok(ev)
    }

    /// Removes an alias.
    pub fn delete_alias(
        &mut self,
        actor: &str,
        model: &str,
        alias: &str,
        reason: &str,
    ) -> Result<AliasEvent> {
        check_len("reason", reason, limits::REASON)?;
        let now = self.now_ms();
        let tx = self.begin()?;
        let id = require_model(&tx, model)?;
        let old = alias_target(&tx, id, alias)?.ok_or_else(|| RegistryError::UnknownAlias {
            name: model.to_owned(),
            alias: alias.to_owned(),
        })?;
        let ev = move_alias(
            &tx,
            now,
            actor,
            id,
            model,
            alias,
            AliasAction::Delete,
            Some(old),
            None,
            reason,
        )?;
        tx.commit().map_err(RegistryError::db("committing"))?;
        Ok(ev)
    }

    /// Checks an alias change without making it: what [`Self::set_alias`]
    /// (`target` given) or [`Self::delete_alias`] (`None`) would refuse,
    /// refused the same way; nothing is written.
    pub fn check_alias_change(
        &self,
        model: &str,
        alias: &str,
        target: Option<u64>,
        reason: &str,
    ) -> Result<()> {
        check_len("reason", reason, limits::REASON)?;
        let m = self.model(model)?;
        match target {
            Some(version) => {
                check_alias(alias)?;
                let v = self.version(model, version)?;
                if v.status != crate::types::Status::Ready {
                    return Err(RegistryError::WrongStatus {
                        name: model.to_owned(),
                        version,
                        status: v.status.as_str().to_owned(),
                        expected: "READY",
                    });
                }
            }
            None => {
                if !m.aliases.iter().any(|a| a.alias == alias) {
                    return Err(RegistryError::UnknownAlias {
                        name: model.to_owned(),
                        alias: alias.to_owned(),
                    });
                }
            }
        }
        Ok(())
    }

    /// Moves an alias back to what it pointed at before its last change.
    /// Rollbacks undo changes one at a time, like a stack: after `set 1`,
    /// `set 2`, `set 3`, rollbacks go to 2, then 1, then refuse.
    pub fn rollback(
        &mut self,
        actor: &str,
        model: &str,
        alias: &str,
        reason: &str,
    ) -> Result<AliasEvent> {
        check_alias(alias)?;
        check_len("reason", reason, limits::REASON)?;
        let now = self.now_ms();
        let tx = self.begin()?;
        let id = require_model(&tx, model)?;
        let events = alias_events(&tx, Some(model), Some(alias))?;
        let mut stack = replay_stack(&events);
        let current = alias_target(&tx, id, alias)?;
        if stack.last().copied().flatten() != current {
            // The state disagrees with its history: refuse to guess.
            return Err(RegistryError::Invalid {
                what: "alias",
                value: format!("{model}@{alias}"),
                reason:
                    "its current target does not match its history (run `keel model audit verify`)"
                        .into(),
            });
        }
        if current.is_none() && stack.is_empty() {
            return Err(RegistryError::UnknownAlias {
                name: model.to_owned(),
                alias: alias.to_owned(),
            });
        }
        stack.pop();
        let Some(&target) = stack.last() else {
            return Err(RegistryError::NothingToRollBack {
                name: model.to_owned(),
                alias: alias.to_owned(),
            });
        };
        let ev = move_alias(
            &tx,
            now,
            actor,
            id,
            model,
            alias,
            AliasAction::Rollback,
            current,
            target,
            reason,
        )?;
        tx.commit().map_err(RegistryError::db("committing"))?;
        Ok(ev)
    }

    /// A model's alias history (one alias, or all), oldest first.
    pub fn history(&self, model: &str, alias: Option<&str>) -> Result<Vec<AliasEvent>> {
        require_model(&self.conn, model)?;
        alias_events(&self.conn, Some(model), alias)
    }

    /// A model's alias history (one alias, or all) after sequence number
    /// `after`, at most `limit`, oldest first: one page of
    /// [`Registry::history`].
    pub fn history_after(
        &self,
        model: &str,
        alias: Option<&str>,
        after: i64,
        limit: usize,
    ) -> Result<Vec<AliasEvent>> {
        require_model(&self.conn, model)?;
        alias_events_after(&self.conn, Some(model), alias, after, Some(limit))
    }

    /// The audit log, oldest first.
    pub fn audit_log(&self) -> Result<Vec<AuditEvent>> {
        audit_events(&self.conn)
    }

    /// The audit log after sequence number `after`, at most `limit`: one
    /// page of [`Registry::audit_log`].
    pub fn audit_log_after(&self, after: i64, limit: usize) -> Result<Vec<AuditEvent>> {
        audit_events_after(&self.conn, after, Some(limit))
    }

    /// Checks both hash chains end to end, then the current state against
    /// them: every alias's target against its replayed history, and every
    /// READY version's files against its manifest digest and the digest
    /// its registration event recorded.
    pub fn verify_chains(&self) -> Result<ChainReport> {
        // Both chains are read a page at a time: a registry of any size is
        // checked in bounded memory (the replayed aliases and the digests
        // registrations recorded are kept, one entry per alias and per
        // version).
        const PAGE: usize = 1000;
        let mut breaks = Vec::new();
        let mut replayed: BTreeMap<(String, String), Vec<Option<u64>>> = BTreeMap::new();
        let mut alias_check = ChainCheck::new(ChainName::AliasHistory);
        let (mut after, mut alias_count) = (0i64, 0u64);
        loop {
            let page = alias_events_after(&self.conn, None, None, after, Some(PAGE))?;
            let Some(last) = page.last() else { break };
            after = last.seq;
            for e in &page {
                alias_count += 1;
                let rec = AliasRecord {
                    seq: e.seq,
                    time_ms: e.time_ms,
                    actor: &e.actor,
                    model: &e.model,
                    alias: &e.alias,
                    action: e.action.as_str(),
                    old_version: e.old_version.map(|v| v as i64),
                    new_version: e.new_version.map(|v| v as i64),
                    reason: &e.reason,
                };
                let computed = chain::link(ALIAS_DOMAIN, &e.prev_hash, &rec);
                alias_check.step(e.seq, &e.prev_hash, &e.hash, &computed, &mut breaks);
                let s = replayed
                    .entry((e.model.clone(), e.alias.clone()))
                    .or_default();
                match e.action {
                    AliasAction::Set | AliasAction::Delete => s.push(e.new_version),
                    AliasAction::Rollback => {
                        s.pop();
                    }
                }
            }
        }
        let alias_head = alias_check.finish(meta(&self.conn, "alias_head")?, &mut breaks);

        let mut registered: BTreeMap<String, Option<String>> = BTreeMap::new();
        let mut audit_check = ChainCheck::new(ChainName::AuditLog);
        let (mut after, mut audit_count) = (0i64, 0u64);
        loop {
            let page = audit_events_after(&self.conn, after, Some(PAGE))?;
            let Some(last) = page.last() else { break };
            after = last.seq;
            for e in &page {
                audit_count += 1;
                let rec = AuditRecord {
                    seq: e.seq,
                    time_ms: e.time_ms,
                    actor: &e.actor,
                    action: &e.action,
                    target: &e.target,
                    detail: &e.detail,
                };
                let computed = chain::link(AUDIT_DOMAIN, &e.prev_hash, &rec);
                audit_check.step(e.seq, &e.prev_hash, &e.hash, &computed, &mut breaks);
                if e.action == "version.register" {
                    let d: serde_json::Value = serde_json::from_str(&e.detail).unwrap_or_default();
                    registered.insert(
                        e.target.clone(),
                        d["manifest_digest"].as_str().map(str::to_owned),
                    );
                }
            }
        }
        let audit_head = audit_check.finish(meta(&self.conn, "audit_head")?, &mut breaks);

        // Aliases now versus their replayed history.
        let current: BTreeMap<(String, String), u64> = self
            .conn
            .query_map(
                "SELECT m.name, a.alias, a.version FROM aliases a JOIN models m ON m.id = a.model_id",
                params![],
                |r| Ok(((r.get(0)?, r.get(1)?), r.get::<i64>(2)? as u64)),
            )
            .map_err(RegistryError::db("reading aliases"))?
            .into_iter()
            .collect();
        let keys: std::collections::BTreeSet<_> =
            replayed.keys().chain(current.keys()).cloned().collect();
        for k in keys {
            let want = replayed.get(&k).and_then(|s| s.last().copied().flatten());
            let have = current.get(&k).copied();
            if want != have {
                let show =
                    |v: Option<u64>| v.map_or("nothing".to_owned(), |v| format!("version {v}"));
                breaks.push(Break {
                    chain: ChainName::State,
                    seq: 0,
                    what: format!(
                        "alias {}@{} points at {}, but its history says {}",
                        k.0,
                        k.1,
                        show(have),
                        show(want)
                    ),
                });
            }
        }

        // READY versions, one at a time: files against digest, digest
        // against the audit.
        let mut checked = 0u64;
        for vid in self.version_ids("WHERE v.status = 'READY'", &[])? {
            let v = load_version(&self.conn, vid)?;
            if v.status != Status::Ready {
                continue;
            }
            checked += 1;
            let target = format!("{}:{}", v.model, v.version);
            if let Some(d) = &v.manifest_digest {
                let mut h = keel_store::manifest::Hasher::new();
                let mut ok = true;
                for f in &v.files {
                    match Digest::from_hex(&f.sha256) {
                        Some(x) => h.update(&x.0),
                        None => ok = false,
                    }
                }
                if !ok || &h.finish().hex() != d {
                    breaks.push(Break {
                        chain: ChainName::State,
                        seq: 0,
                        what: format!("version {target}: its file digests do not add up to its manifest digest {d}"),
                    });
                }
            }
            match registered.get(&target) {
                None => breaks.push(Break {
                    chain: ChainName::State,
                    seq: 0,
                    what: format!("version {target} is READY but the audit log has no registration for it"),
                }),
                Some(d) if d != &v.manifest_digest => breaks.push(Break {
                    chain: ChainName::State,
                    seq: 0,
                    what: format!(
                        "version {target}: manifest digest {} differs from the {} its registration recorded",
                        v.manifest_digest.as_deref().unwrap_or("none"),
                        d.as_deref().unwrap_or("none")
                    ),
                }),
                Some(_) => {}
            }
        }
        if breaks.len() > MAX_BREAKS {
            let more = breaks.len() - MAX_BREAKS;
            breaks.truncate(MAX_BREAKS);
            breaks.push(Break {
                chain: ChainName::State,
                seq: 0,
                what: format!("and {more} more problem(s), not listed"),
            });
        }
        Ok(ChainReport {
            alias_events: alias_count,
            audit_events: audit_count,
            alias_head,
            audit_head,
            versions_checked: checked,
            breaks,
        })
    }

    // ----- signatures ---------------------------------------------------

    /// Attaches a signature bundle to a READY version. The caller has
    /// checked that the bundle signs this version's files.
    pub fn attach_signature(
        &mut self,
        actor: &str,
        model: &str,
        number: u64,
        bundle: &str,
        public_key_pem: &str,
        key_hint: &str,
    ) -> Result<SignatureRecord> {
        let now = self.now_ms();
        let tx = self.begin()?;
        let id = require_model(&tx, model)?;
        let vid = version_row_id(&tx, id, model, number)?;
        tx.execute(
            "INSERT INTO signatures (version_id, bundle, public_key_pem, key_hint, created_ms, created_by)
             VALUES (?1, ?2, ?3, ?4, ?5, ?6)",
            params![vid, bundle, public_key_pem, key_hint, now, actor],
        )
        .map_err(RegistryError::db("storing a signature"))?;
        audit(
            &tx,
            now,
            actor,
            "version.sign",
            &format!("{model}:{number}"),
            json!({"version": number, "key_hint": key_hint, "bundle_sha256": Digest::of(bundle.as_bytes()).hex()}),
        )?;
        tx.commit().map_err(RegistryError::db("committing"))?;
        self.signature(model, number)?
            .ok_or_else(|| RegistryError::UnknownVersion {
                name: model.to_owned(),
                version: number,
            })
    }

    /// The newest signature of a version, if any.
    pub fn signature(&self, model: &str, number: u64) -> Result<Option<SignatureRecord>> {
        let id = model_id(&self.conn, model)?.ok_or_else(|| RegistryError::UnknownModel {
            name: model.to_owned(),
        })?;
        let vid = version_row_id(&self.conn, id, model, number)?;
        self.conn
            .query_opt(
                "SELECT bundle, public_key_pem, key_hint, created_ms, created_by FROM signatures
                 WHERE version_id = ?1 ORDER BY id DESC LIMIT 1",
                params![vid],
                |r| {
                    Ok(SignatureRecord {
                        model: model.to_owned(),
                        version: number,
                        bundle: r.get(0)?,
                        public_key_pem: r.get(1)?,
                        key_hint: r.get(2)?,
                        created_ms: r.get(3)?,
                        created_by: r.get(4)?,
                    })
                },
            )
            .map_err(RegistryError::db("reading a signature"))
    }

    // ----- API keys -----------------------------------------------------

    /// Creates an API key from a secret the caller generated (see
    /// [`crate::auth::new_secret`]); only its SHA-256 is stored.
    pub fn create_api_key(
        &mut self,
        actor: &str,
        name: &str,
        role: Role,
        secret: &str,
    ) -> Result<ApiKey> {
        if name.is_empty()
            || name.len() > 64
            || !name
                .bytes()
                .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'.' | b'_' | b'-'))
        {
            return Err(RegistryError::Invalid {
                what: "key name",
                value: name.to_owned(),
                reason: "use 1-64 letters, digits, `.`, `_` and `-`".into(),
            });
        }
        if secret.len() < 32 {
            return Err(RegistryError::Invalid {
                what: "key secret",
                value: "***".into(),
                reason: "secrets must be at least 32 characters".into(),
            });
        }
        let hash = crate::auth::secret_hash(secret);
        let now = self.now_ms();
        let tx = self.begin()?;
        let exists: bool = tx
            .query_row(
                "SELECT COUNT(*) FROM api_keys WHERE name = ?1",
                params![name],
                |r| r.get::<i64>(0),
            )
            .map_err(RegistryError::db("reading keys"))?
            > 0;
        if exists {
            return Err(RegistryError::KeyExists {
                name: name.to_owned(),
            });
        }
        tx.execute(
            "INSERT INTO api_keys (name, sha256, role, created_ms, created_by) VALUES (?1, ?2, ?3, ?4, ?5)",
            params![name, hash, role.as_str(), now, actor],
        )
        .map_err(RegistryError::db("storing a key"))?;
        audit(
            &tx,
            now,
            actor,
            "key.create",
            &format!("key:{name}"),
            json!({"role": role.as_str(), "id": &hash[..12]}),
        )?;
        tx.commit().map_err(RegistryError::db("committing"))?;
        self.api_keys()?
            .into_iter()
            .find(|k| k.name == name)
            .ok_or_else(|| RegistryError::UnknownKey {
                name: name.to_owned(),
            })
    }

    pub fn api_keys(&self) -> Result<Vec<ApiKey>> {
        self.conn
            .query_map(
                "SELECT name, role, sha256, created_ms, created_by, revoked_ms FROM api_keys ORDER BY name",
                params![],
                key_row,
            )
            .map_err(RegistryError::db("reading keys"))
    }

    /// Revokes a key; it stops working at once.
    pub fn revoke_api_key(&mut self, actor: &str, name: &str) -> Result<ApiKey> {
        let now = self.now_ms();
        let tx = self.begin()?;
        let n = tx
            .execute(
                "UPDATE api_keys SET revoked_ms = COALESCE(revoked_ms, ?2) WHERE name = ?1",
                params![name, now],
            )
            .map_err(RegistryError::db("revoking a key"))?;
        if n == 0 {
            return Err(RegistryError::UnknownKey {
                name: name.to_owned(),
            });
        }
        audit(
            &tx,
            now,
            actor,
            "key.revoke",
            &format!("key:{name}"),
            json!({}),
        )?;
        tx.commit().map_err(RegistryError::db("committing"))?;
        self.api_keys()?
            .into_iter()
            .find(|k| k.name == name)
            .ok_or_else(|| RegistryError::UnknownKey {
                name: name.to_owned(),
            })
    }

    /// The live (not revoked) key whose secret this is.
    pub fn authenticate(&self, secret: &str) -> Result<Option<ApiKey>> {
        if !secret.starts_with(SECRET_PREFIX) {
            return Ok(None);
        }
        self.conn
            .query_opt(
                "SELECT name, role, sha256, created_ms, created_by, revoked_ms FROM api_keys
                 WHERE sha256 = ?1 AND revoked_ms IS NULL",
                params![crate::auth::secret_hash(secret)],
                key_row,
            )
            .map_err(RegistryError::db("checking a key"))
    }

    // ----- backup and restore -------------------------------------------

    /// Copies the registry to `dest`, a new SQLite file: on SQLite with its
    /// online backup (a consistent snapshot while others keep writing); on
    /// PostgreSQL by copying one snapshot of it into `dest` as `keel model
    /// migrate` does (both chains and every signature checked before the
    /// copy commits). A backup is the same file from either store; `dest`
    /// must not exist.
    pub fn backup_to(&self, dest: &Path) -> Result<()> {
        // Nothing at `dest`, not even a link to elsewhere.
        if std::fs::symlink_metadata(dest).is_ok() {
            return Err(RegistryError::Io {
                op: "back up into",
                path: dest.to_owned(),
                source: std::io::Error::from(std::io::ErrorKind::AlreadyExists),
            });
        }
        let made = match self.conn.0.sqlite() {
            Some(conn) => conn
                .backup(rusqlite::MAIN_DB, dest, None)
                .map_err(RegistryError::db("backing up")),
            None => Registry::open(dest, self.clock.clone()).and_then(|target| {
                crate::migrate::copy(self, &target)?;
                // One file: the write-ahead log folded in before it is
                // handed on.
                if let Some(conn) = target.conn.0.sqlite() {
                    conn.pragma_update(None, "journal_mode", "DELETE")
                        .map_err(RegistryError::db("finishing the backup"))?;
                }
                Ok(())
            }),
        };
        if made.is_err() {
            // No half backup left at `dest` (made by this call: nothing
            // was there).
            for suffix in ["", "-wal", "-shm", "-journal"] {
                let mut p = dest.as_os_str().to_owned();
                p.push(suffix);
                let _ = std::fs::remove_file(std::path::PathBuf::from(p));
            }
        }
        made
    }

    /// Replaces this database's content with a backup file's, after
    /// checking that the backup is a registry whose chains verify. Refuses
    /// to overwrite a registry that holds anything unless `force`.
    pub fn restore_from(&mut self, actor: &str, src: &Path, force: bool) -> Result<ChainReport> {
        self.restore_from_named(actor, src, &src.display().to_string(), force)
    }

    /// [`Registry::restore_from`], the audit event naming the backup as
    /// `from` (its URL) rather than the local copy's path.
    pub fn restore_from_named(
        &mut self,
        actor: &str,
        src: &Path,
        from: &str,
        force: bool,
    ) -> Result<ChainReport> {
        let bad = |reason: String| RegistryError::BadBackup {
            path: src.to_owned(),
            reason,
        };
        // Check the backup first, on its own connection.
        {
            let conn = rusqlite::Connection::open_with_flags(
                src,
                rusqlite::OpenFlags::SQLITE_OPEN_READ_ONLY,
            )
            .map_err(|e| bad(e.to_string()))?;
            let ok: String = conn
                .query_row("PRAGMA integrity_check", [], |r| r.get(0))
                .map_err(|e| bad(e.to_string()))?;
            if ok != "ok" {
                return Err(bad(format!("integrity check: {ok}")));
            }
            let v: i64 = conn
                .query_row("PRAGMA user_version", [], |r| r.get(0))
                .map_err(|e| bad(e.to_string()))?;
            if !(1..=crate::db::SCHEMA_VERSION).contains(&v) {
                return Err(bad(format!(
                    "schema version {v}, this keel reads 1 to {}",
                    crate::db::SCHEMA_VERSION
                )));
            }
        }
        let check = Registry {
            conn: Db(Box::new(crate::storage::Sqlite::new(
                rusqlite::Connection::open(src).map_err(|e| bad(e.to_string()))?,
                src,
                false,
            ))),
            clock: self.clock.clone(),
            path: src.to_owned(),
        };
        let report = check.verify_chains()?;
        if !report.ok() {
            return Err(bad(format!(
                "it does not verify: {}",
                report.breaks[0].what
            )));
        }
        drop(check);
        let events: i64 = self
            .conn
            .query_row("SELECT COUNT(*) FROM audit_events", params![], |r| r.get(0))
            .map_err(RegistryError::db("reading the audit log"))?;
        // PostgreSQL: the backup is copied in as `keel model migrate`
        // copies, into an empty database only. Its tables refuse every
        // delete, so a registry is never emptied to make room.
        let on_postgres = self.conn.0.sqlite().is_none();
        if events > 0 && on_postgres {
            return Err(RegistryError::Unsupported {
                what: "restoring over a registry that holds data",
                backend: "PostgreSQL",
                hint: "restore into a new, empty database (create it as for a new registry) and point model.db at it",
            });
        }
        if events > 0 && !force {
            return Err(RegistryError::NotEmpty {
                path: self.path.clone(),
            });
        }
        let now = self.now_ms();
        let detail =
            json!({"from": from, "audit_head": report.audit_head, "alias_head": report.alias_head});
        let restored = |tx: &Db| audit(tx, now, actor, "registry.restore", "registry", detail);
        if self.conn.0.sqlite().is_none() {
            let backup = Registry::open(src, self.clock.clone())?;
            crate::migrate::copy_then(&backup, self, restored)?;
            return Ok(report);
        }
        // SQLite: the backup is copied into a private staging file (and
        // migrated there, if from an older schema), its restore event
        // appended, and the result put in place with one online restore:
        // the registry never holds the backup's data without the event.
        let staged = self.staging()?;
        {
            let conn = rusqlite::Connection::open_with_flags(
                src,
                rusqlite::OpenFlags::SQLITE_OPEN_READ_ONLY,
            )
            .map_err(|e| bad(e.to_string()))?;
            // The copy is its owner's only, as the registry's content.
            use std::os::unix::fs::OpenOptionsExt;
            std::fs::OpenOptions::new()
                .write(true)
                .create_new(true)
                .mode(0o600)
                .open(staged.path())
                .map_err(|source| RegistryError::Io {
                    op: "create",
                    path: staged.path().to_owned(),
                    source,
                })?;
            conn.backup(rusqlite::MAIN_DB, staged.path(), None)
                .map_err(RegistryError::db("staging the backup"))?;
            let mut copy = Registry::open(staged.path(), self.clock.clone())?;
            let tx = copy.begin()?;
            restored(&tx)?;
            tx.commit().map_err(RegistryError::db("committing"))?;
            if let Some(conn) = copy.conn.0.sqlite() {
                conn.pragma_update(None, "journal_mode", "DELETE")
                    .map_err(RegistryError::db("staging the backup"))?;
            }
        }
        let Some(conn) = self.conn.0.sqlite_mut() else {
            unreachable!("checked above: a SQLite registry");
        };
        conn.restore(
            rusqlite::MAIN_DB,
            staged.path(),
            None::<fn(rusqlite::backup::Progress)>,
        )
        .map_err(RegistryError::db("restoring"))?;
        // Reopened (migrating a backup from an older schema), the old
        // connection closed first.
        self.conn = crate::db::open_in_memory()?;
        self.conn = if self.path == Path::new(":memory:") {
            crate::db::open_in_memory()?
        } else {
            crate::db::open(&self.path)?
        };
        Ok(report)
    }

    /// A private staging file for a copy of this registry: beside a SQLite
    /// database (on its file system), under the system's temporary
    /// directory for PostgreSQL or an in-memory database.
    pub fn staging(&self) -> Result<crate::staging::Staged> {
        let base = match self.backend() {
            Backend::Sqlite if self.path != Path::new(":memory:") => self
                .path
                .parent()
                .filter(|p| !p.as_os_str().is_empty())
                .unwrap_or(Path::new("."))
                .to_owned(),
            _ => std::env::temp_dir(),
        };
        crate::staging::Staged::under(&base)
    }
}

// ----- helpers on a connection or transaction ----------------------------

/// Gives each row its tags from `(owner id, tag)` pairs; rows and pairs
/// both in ascending id order.
fn attach_tags<R>(
    rows: &mut [R],
    tags: Vec<(i64, Tag)>,
    id: impl Fn(&R) -> i64,
    slot: impl Fn(&mut R) -> &mut Vec<Tag>,
) {
    let mut tags = tags.into_iter().peekable();
    for row in rows {
        let rid = id(row);
        while tags.peek().is_some_and(|(t, _)| *t < rid) {
            tags.next();
        }
        while let Some((_, tag)) = tags.next_if(|(t, _)| *t == rid) {
            slot(row).push(tag);
        }
    }
}

fn key_row(r: &crate::storage::Row) -> std::result::Result<ApiKey, crate::storage::DbError> {
    let role: String = r.get(1)?;
    let hash: String = r.get(2)?;
    Ok(ApiKey {
        name: r.get(0)?,
        role: if role == "write" {
            Role::Write
        } else {
            Role::Read
        },
        id: hash.chars().take(12).collect(),
        created_ms: r.get(3)?,
        created_by: r.get(4)?,
        revoked_ms: r.get(5)?,
    })
}

fn model_id(c: &Db, name: &str) -> Result<Option<i64>> {
    c.query_opt(
        "SELECT id FROM models WHERE name = ?1",
        params![name],
        |r| r.get(0),
    )
    .map_err(RegistryError::db("finding a model"))
}

fn require_model(c: &Db, name: &str) -> Result<i64> {
    model_id(c, name)?.ok_or_else(|| RegistryError::UnknownModel {
        name: name.to_owned(),
    })
}

fn version_row_id(c: &Db, model_id: i64, model: &str, number: u64) -> Result<i64> {
    c.query_opt(
        "SELECT id FROM versions WHERE model_id = ?1 AND number = ?2",
        params![model_id, number as i64],
        |r| r.get(0),
    )
    .map_err(RegistryError::db("finding a version"))?
    .ok_or_else(|| RegistryError::UnknownVersion {
        name: model.to_owned(),
        version: number,
    })
}

fn pending_version(c: &Db, model_id: i64, model: &str, number: u64) -> Result<i64> {
    let vid = version_row_id(c, model_id, model, number)?;
    let status: String = c
        .query_row(
            "SELECT status FROM versions WHERE id = ?1",
            params![vid],
            |r| r.get(0),
        )
        .map_err(RegistryError::db("reading a version"))?;
    if status != "PENDING_REGISTRATION" {
        return Err(RegistryError::WrongStatus {
            name: model.to_owned(),
            version: number,
            status,
            expected: "PENDING_REGISTRATION",
        });
    }
    Ok(vid)
}

fn insert_model(
    tx: &Db,
    now: i64,
    actor: &str,
    name: &str,
    description: &str,
    tags: &[Tag],
) -> Result<i64> {
    let id: i64 = tx
        .query_row(
            "INSERT INTO models (name, description, created_ms, created_by, updated_ms) VALUES (?1, ?2, ?3, ?4, ?3) RETURNING id",
            params![name, description, now, actor],
            |r| r.get(0),
        )
        .map_err(RegistryError::db("creating a model"))?;
    for t in tags {
        tx.execute(
            "INSERT INTO model_tags (model_id, key, value) VALUES (?1, ?2, ?3)
             ON CONFLICT (model_id, key) DO UPDATE SET value = excluded.value",
            params![id, t.key, t.value],
        )
        .map_err(RegistryError::db("tagging a model"))?;
    }
    audit(
        tx,
        now,
        actor,
        "model.create",
        name,
        json!({"description": description, "tags": tags_json(tags)}),
    )?;
    Ok(id)
}

/// The next sequence number of an event table (`alias_events`,
/// `audit_events`), inside the writing transaction.
fn next_seq(tx: &Db, table: &'static str, what: &'static str) -> Result<i64> {
    tx.query_row(
        &format!("SELECT COALESCE(MAX(seq), 0) + 1 FROM {table}"),
        params![],
        |r| r.get(0),
    )
    .map_err(RegistryError::db(what))
}

fn touch_model(c: &Db, id: i64, now: i64) -> Result<()> {
    c.execute(
        "UPDATE models SET updated_ms = CASE WHEN updated_ms > ?2 THEN updated_ms ELSE ?2 END WHERE id = ?1",
        params![id, now],
    )
    .map(|_| ())
    .map_err(RegistryError::db("updating a model"))
}

/// Stores a pending version's files and makes it READY.
fn finish(
    tx: &Db,
    now: i64,
    actor: &str,
    vid: i64,
    target: &str,
    artifacts: Option<&Artifacts>,
) -> Result<()> {
    let (url, digest, files, bytes) = match artifacts {
        Some(a) => {
            for f in a.manifest.files() {
                tx.execute(
                    "INSERT INTO version_files (version_id, name, size, sha256) VALUES (?1, ?2, ?3, ?4)",
                    params![vid, f.name, f.size as i64, f.sha256.hex()],
                )
                .map_err(RegistryError::db("storing version files"))?;
            }
            (
                Some(a.url.clone()),
                Some(a.manifest.subject_digest().hex()),
                a.manifest.files().len(),
                a.manifest.total_bytes(),
            )
        }
        None => (None, None, 0, 0),
    };
    tx.execute(
        "UPDATE versions SET status = 'READY', artifact_url = ?2, manifest_digest = ?3, updated_ms = ?4
         WHERE id = ?1",
        params![vid, url, digest, now],
    )
    .map_err(RegistryError::db("completing a version"))?;
    audit(
        tx,
        now,
        actor,
        "version.register",
        target,
        json!({"artifact_url": url, "manifest_digest": digest, "files": files, "bytes": bytes}),
    )
}

fn alias_target(c: &Db, model_id: i64, alias: &str) -> Result<Option<u64>> {
    c.query_opt(
        "SELECT version FROM aliases WHERE model_id = ?1 AND alias = ?2",
        params![model_id, alias],
        |r| r.get::<i64>(0),
    )
    .map(|v| v.map(|v| v as u64))
    .map_err(RegistryError::db("reading an alias"))
}

/// The targets an alias has had, as a stack: `set` and `delete` push,
/// `rollback` pops.
fn replay_stack(events: &[AliasEvent]) -> Vec<Option<u64>> {
    let mut stack = Vec::new();
    for e in events {
        match e.action {
            AliasAction::Set | AliasAction::Delete => stack.push(e.new_version),
            AliasAction::Rollback => {
                stack.pop();
            }
        }
    }
    stack
}

#[allow(clippy::too_many_arguments)]
fn move_alias(
    tx: &Db,
    now: i64,
    actor: &str,
    model_id: i64,
    model: &str,
    alias: &str,
    action: AliasAction,
    old: Option<u64>,
    new: Option<u64>,
    reason: &str,
) -> Result<AliasEvent> {
    match new {
        Some(v) => tx.execute(
            "INSERT INTO aliases (model_id, alias, version) VALUES (?1, ?2, ?3)
             ON CONFLICT (model_id, alias) DO UPDATE SET version = excluded.version",
            params![model_id, alias, v as i64],
        ),
        None => tx.execute(
            "DELETE FROM aliases WHERE model_id = ?1 AND alias = ?2",
            params![model_id, alias],
        ),
    }
    .map_err(RegistryError::db("moving an alias"))?;
    touch_model(tx, model_id, now)?;
    let prev = meta(tx, "alias_head")?.unwrap_or_else(|| GENESIS.to_owned());
    let seq = next_seq(tx, "alias_events", "numbering an alias event")?;
    let rec = AliasRecord {
        seq,
        time_ms: now,
        actor,
        model,
        alias,
        action: action.as_str(),
        old_version: old.map(|v| v as i64),
        new_version: new.map(|v| v as i64),
        reason,
    };
    let hash = chain::link(ALIAS_DOMAIN, &prev, &rec);
    tx.execute(
        "INSERT INTO alias_events (seq, time_ms, actor, model, alias, action, old_version, new_version, reason, prev_hash, hash)
         VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8, ?9, ?10, ?11)",
        params![seq, now, actor, model, alias, action.as_str(), rec.old_version, rec.new_version, reason, prev, hash],
    )
    .map_err(RegistryError::db("appending alias history"))?;
    set_meta(tx, "alias_head", &hash)?;
    let verb = format!("alias.{}", action.as_str());
    audit(
        tx,
        now,
        actor,
        &verb,
        &format!("{model}@{alias}"),
        json!({"old_version": old, "new_version": new, "reason": reason, "alias_event": seq}),
    )?;
    Ok(AliasEvent {
        seq,
        time_ms: now,
        actor: actor.to_owned(),
        model: model.to_owned(),
        alias: alias.to_owned(),
        action,
        old_version: old,
        new_version: new,
        reason: reason.to_owned(),
        prev_hash: prev,
        hash,
    })
}

fn audit(
    tx: &Db,
    now: i64,
    actor: &str,
    action: &str,
    target: &str,
    detail: serde_json::Value,
) -> Result<()> {
    let detail = detail.to_string();
    let prev = meta(tx, "audit_head")?.unwrap_or_else(|| GENESIS.to_owned());
    let seq = next_seq(tx, "audit_events", "numbering an audit event")?;
    let rec = AuditRecord {
        seq,
        time_ms: now,
        actor,
        action,
        target,
        detail: &detail,
    };
    let hash = chain::link(AUDIT_DOMAIN, &prev, &rec);
    tx.execute(
        "INSERT INTO audit_events (seq, time_ms, actor, action, target, detail, prev_hash, hash)
         VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8)",
        params![seq, now, actor, action, target, detail, prev, hash],
    )
    .map_err(RegistryError::db("appending to the audit log"))?;
    set_meta(tx, "audit_head", &hash)
}

fn meta(c: &Db, key: &str) -> Result<Option<String>> {
    c.query_opt("SELECT value FROM meta WHERE key = ?1", params![key], |r| {
        r.get(0)
    })
    .map_err(RegistryError::db("reading registry metadata"))
}

fn set_meta(c: &Db, key: &str, value: &str) -> Result<()> {
    c.execute(
        "INSERT INTO meta (key, value) VALUES (?1, ?2)
         ON CONFLICT (key) DO UPDATE SET value = excluded.value",
        params![key, value],
    )
    .map(|_| ())
    .map_err(RegistryError::db("writing registry metadata"))
}

/// Walks a chain, records its first break, returns its head hash.
/// The most problems a chain check lists (the count of the rest is
/// given): a tampered database could otherwise make the report itself
/// unbounded.
const MAX_BREAKS: usize = 1000;

/// One hash chain checked event by event, in sequence order.
struct ChainCheck {
    chain: ChainName,
    prev: String,
    expected_seq: i64,
    broken: bool,
}

impl ChainCheck {
    fn new(chain: ChainName) -> Self {
        ChainCheck {
            chain,
            prev: GENESIS.to_owned(),
            expected_seq: 1,
            broken: false,
        }
    }

    /// The next event: its number, stored links and the hash its content
    /// gives. Only a chain's first break is recorded.
    fn step(
        &mut self,
        seq: i64,
        prev_hash: &str,
        hash: &str,
        computed: &str,
        breaks: &mut Vec<Break>,
    ) {
        let what = if seq != self.expected_seq {
            Some(format!(
                "event #{seq} follows #{}: event(s) missing",
                self.expected_seq - 1
            ))
        } else if prev_hash != self.prev {
            Some(format!(
                "event #{seq} does not link to the event before it (an event was removed, reordered or rewritten)"
            ))
        } else if computed != hash {
            Some(format!(
                "event #{seq} was changed after it was written (its content no longer matches its hash)"
            ))
        } else {
            None
        };
        if let Some(what) = what {
            if !self.broken {
                breaks.push(Break {
                    chain: self.chain,
                    seq,
                    what,
                });
                self.broken = true;
            }
        }
        hash.clone_into(&mut self.prev);
        self.expected_seq = seq + 1;
    }

    /// The chain's head, checked against the one recorded.
    fn finish(self, head: Option<String>, breaks: &mut Vec<Break>) -> String {
        if !self.broken && head.as_deref().unwrap_or(GENESIS) != self.prev {
            breaks.push(Break {
                chain: self.chain,
                seq: self.expected_seq,
                what: format!(
                    "the chain ends at event #{} but the recorded head is later: event(s) removed from the end",
                    self.expected_seq - 1
                ),
            });
        }
        self.prev
    }
}

fn alias_events(c: &Db, model: Option<&str>, alias: Option<&str>) -> Result<Vec<AliasEvent>> {
    alias_events_after(c, model, alias, 0, None)
}

/// Alias events after sequence number `after`, at most `limit` (all
/// without one), oldest first.
fn alias_events_after(
    c: &Db,
    model: Option<&str>,
    alias: Option<&str>,
    after: i64,
    limit: Option<usize>,
) -> Result<Vec<AliasEvent>> {
    let limit = limit.map_or(i64::MAX, |l| i64::try_from(l).unwrap_or(i64::MAX));
    c.query_map("SELECT seq, time_ms, actor, model, alias, action, old_version, new_version, reason, prev_hash, hash
             FROM alias_events
             WHERE (CAST(?1 AS TEXT) IS NULL OR model = ?1) AND (CAST(?2 AS TEXT) IS NULL OR alias = ?2) AND seq > ?3
             ORDER BY seq LIMIT ?4", params![model, alias, after, limit], |r| {
            let action: String = r.get(5)?;
            Ok(AliasEvent {
                seq: r.get(0)?,
                time_ms: r.get(1)?,
                actor: r.get(2)?,
                model: r.get(3)?,
                alias: r.get(4)?,
                // An unknown action (an edited row) reads as `set`; the
                // chain check reports the edit.
                action: AliasAction::parse(&action).unwrap_or(AliasAction::Set),
                old_version: r.get::<Option<i64>>(6)?.map(|v| v as u64),
                new_version: r.get::<Option<i64>>(7)?.map(|v| v as u64),
                reason: r.get(8)?,
                prev_hash: r.get(9)?,
                hash: r.get(10)?,
            })
        }).map_err(RegistryError::db("reading alias history"))
}

fn audit_events(c: &Db) -> Result<Vec<AuditEvent>> {
    audit_events_after(c, 0, None)
}

/// Audit events after sequence number `after`, at most `limit` (all
/// without one), oldest first.
fn audit_events_after(c: &Db, after: i64, limit: Option<usize>) -> Result<Vec<AuditEvent>> {
    let limit = limit.map_or(i64::MAX, |l| i64::try_from(l).unwrap_or(i64::MAX));
    c.query_map(
        "SELECT seq, time_ms, actor, action, target, detail, prev_hash, hash
             FROM audit_events WHERE seq > ?1 ORDER BY seq LIMIT ?2",
        params![after, limit],
        |r| {
            Ok(AuditEvent {
                seq: r.get(0)?,
                time_ms: r.get(1)?,
                actor: r.get(2)?,
                action: r.get(3)?,
                target: r.get(4)?,
                detail: r.get(5)?,
                prev_hash: r.get(6)?,
                hash: r.get(7)?,
            })
        },
    )
    .map_err(RegistryError::db("reading the audit log"))
}

fn load_model(c: &Db, id: i64) -> Result<Model> {
    let (name, description, created_ms, created_by, updated_ms): (String, String, i64, String, i64) = c
        .query_row(
            "SELECT name, description, created_ms, created_by, updated_ms FROM models WHERE id = ?1", params![id],
            |r| Ok((r.get(0)?, r.get(1)?, r.get(2)?, r.get(3)?, r.get(4)?)),
        )
        .map_err(RegistryError::db("reading a model"))?;
    let tags = read_tags(
        c,
        "SELECT key, value FROM model_tags WHERE model_id = ?1 ORDER BY key",
        id,
    )?;
    let aliases = {
        c.query_map(
            "SELECT alias, version FROM aliases WHERE model_id = ?1 ORDER BY alias",
            params![id],
            |r| {
                Ok(AliasTarget {
                    alias: r.get(0)?,
                    version: r.get::<i64>(1)? as u64,
                })
            },
        )
        .map_err(RegistryError::db("reading aliases"))?
    };
    let (latest, count): (Option<i64>, i64) = c
        .query_row(
            "SELECT MAX(number), COUNT(*) FROM versions WHERE model_id = ?1",
            params![id],
            |r| Ok((r.get(0)?, r.get(1)?)),
        )
        .map_err(RegistryError::db("counting versions"))?;
    Ok(Model {
        name,
        description,
        created_ms,
        created_by,
        updated_ms,
        tags,
        aliases,
        latest_version: latest.map(|v| v as u64),
        versions: count as u64,
    })
}

fn read_tags(c: &Db, sql: &str, id: i64) -> Result<Vec<Tag>> {
    c.query_map(sql, params![id], |r| {
        Ok(Tag {
            key: r.get(0)?,
            value: r.get(1)?,
        })
    })
    .map_err(RegistryError::db("reading tags"))
}

fn load_version(c: &Db, vid: i64) -> Result<Version> {
    load_versions(c, &[vid])?
        .pop()
        .ok_or_else(|| RegistryError::db("reading a version")(crate::storage::DbError::NoRow))
}

/// The versions with these ids, in this order, read with one query per
/// table (a few hundred ids at a time): what a page of search results
/// loads. An id that names no version is left out.
fn load_versions(c: &Db, ids: &[i64]) -> Result<Vec<Version>> {
    let mut out = Vec::with_capacity(ids.len());
    for chunk in ids.chunks(500) {
        out.extend(load_version_chunk(c, chunk)?);
    }
    Ok(out)
}

/// `(version id, item)` rows grouped by version, in their order.
fn by_version<T>(rows: Vec<(i64, T)>) -> BTreeMap<i64, Vec<T>> {
    let mut out: BTreeMap<i64, Vec<T>> = BTreeMap::new();
    for (vid, item) in rows {
        out.entry(vid).or_default().push(item);
    }
    out
}

fn load_version_chunk(c: &Db, ids: &[i64]) -> Result<Vec<Version>> {
    struct Row {
        id: i64,
        model: String,
        number: i64,
        status: String,
        status_message: String,
        source: String,
        artifact_url: Option<String>,
        manifest_digest: Option<String>,
        description: String,
        lineage: String,
        created_ms: i64,
        created_by: String,
        updated_ms: i64,
    }
    if ids.is_empty() {
        return Ok(Vec::new());
    }
    // Ids are the database's own integers, never user input.
    let list = ids.iter().map(i64::to_string).collect::<Vec<_>>().join(",");
    let rows = c
        .query_map(
            &format!(
                "SELECT v.id, m.name, v.number, v.status, v.status_message, v.source, v.artifact_url,
                        v.manifest_digest, v.description, v.lineage, v.created_ms, v.created_by, v.updated_ms
                 FROM versions v JOIN models m ON m.id = v.model_id WHERE v.id IN ({list})"
            ),
            params![],
            |r| {
                Ok(Row {
                    id: r.get(0)?,
                    model: r.get(1)?,
                    number: r.get(2)?,
                    status: r.get(3)?,
                    status_message: r.get(4)?,
                    source: r.get(5)?,
                    artifact_url: r.get(6)?,
                    manifest_digest: r.get(7)?,
                    description: r.get(8)?,
                    lineage: r.get(9)?,
                    created_ms: r.get(10)?,
                    created_by: r.get(11)?,
                    updated_ms: r.get(12)?,
                })
            },
        )
        .map_err(RegistryError::db("reading a version"))?;
    let mut files = by_version(
        c.query_map(
            &format!(
                "SELECT version_id, name, size, sha256 FROM version_files
                 WHERE version_id IN ({list}) ORDER BY version_id, name"
            ),
            params![],
            |r| {
                Ok((
                    r.get::<i64>(0)?,
                    VersionFile {
                        name: r.get(1)?,
                        size: r.get::<i64>(2)? as u64,
                        sha256: r.get(3)?,
                    },
                ))
            },
        )
        .map_err(RegistryError::db("reading version files"))?,
    );
    let mut tags = by_version(
        c.query_map(
            &format!(
                "SELECT version_id, key, value FROM version_tags
                 WHERE version_id IN ({list}) ORDER BY version_id, key"
            ),
            params![],
            |r| {
                Ok((
                    r.get::<i64>(0)?,
                    Tag {
                        key: r.get(1)?,
                        value: r.get(2)?,
                    },
                ))
            },
        )
        .map_err(RegistryError::db("reading tags"))?,
    );
    let mut aliases = by_version(
        c.query_map(
            &format!(
                "SELECT v.id, a.alias FROM aliases a
                 JOIN versions v ON v.model_id = a.model_id AND v.number = a.version
                 WHERE v.id IN ({list}) ORDER BY v.id, a.alias"
            ),
            params![],
            |r| Ok((r.get::<i64>(0)?, r.get::<String>(1)?)),
        )
        .map_err(RegistryError::db("reading aliases"))?,
    );
    let signed: BTreeMap<i64, i64> = c
        .query_map(
            &format!(
                "SELECT version_id, COUNT(*) FROM signatures
                 WHERE version_id IN ({list}) GROUP BY version_id"
            ),
            params![],
            |r| Ok((r.get::<i64>(0)?, r.get::<i64>(1)?)),
        )
        .map_err(RegistryError::db("reading signatures"))?
        .into_iter()
        .collect();
    let mut by_id: BTreeMap<i64, Row> = rows.into_iter().map(|r| (r.id, r)).collect();
    let mut out = Vec::with_capacity(ids.len());
    for vid in ids {
        let Some(row) = by_id.remove(vid) else {
            continue;
        };
        let lineage: Lineage =
            serde_json::from_str(&row.lineage).map_err(|e| RegistryError::Invalid {
                what: "stored lineage",
                value: format!("{}:{}", row.model, row.number),
                reason: e.to_string(),
            })?;
        out.push(Version {
            model: row.model,
            version: row.number as u64,
            status: Status::parse(&row.status),
            status_message: row.status_message,
            source: row.source,
            artifact_url: row.artifact_url,
            manifest_digest: row.manifest_digest,
            description: row.description,
            lineage,
            created_ms: row.created_ms,
            created_by: row.created_by,
            updated_ms: row.updated_ms,
            files: files.remove(vid).unwrap_or_default(),
            tags: tags.remove(vid).unwrap_or_default(),
            aliases: aliases.remove(vid).unwrap_or_default(),
            signed: signed.get(vid).is_some_and(|n| *n > 0),
        });
    }
    Ok(out)
}

/// Rebuilds a version's manifest (for signing and verifying): its files in
/// the keel-store statement layout, named after the model and version.
pub fn version_manifest(v: &Version) -> std::result::Result<Manifest, RegistryError> {
    let files = v
        .files
        .iter()
        .map(|f| {
            Ok(FileEntry {
                name: f.name.clone(),
                size: f.size,
                sha256: Digest::from_hex(&f.sha256).ok_or_else(|| RegistryError::Invalid {
                    what: "stored digest",
                    value: f.sha256.clone(),
                    reason: format!("file {} of {}:{}", f.name, v.model, v.version),
                })?,
            })
        })
        .collect::<std::result::Result<Vec<_>, RegistryError>>()?;
    Manifest::new(
        format!("{}:{}", v.model, v.version),
        files,
        Default::default(),
    )
    .map_err(|e| RegistryError::Invalid {
        what: "stored files",
        value: format!("{}:{}", v.model, v.version),
        reason: e.to_string(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::FixedClock;

    #[test]
    fn every_stored_string_has_a_length_limit() {
        let mut reg = Registry::open_in_memory(Arc::new(FixedClock(0))).expect("open");
        let base = NewVersion {
            model: "m".into(),
            source: "s3://b/m".into(),
            create_model: true,
            ..Default::default()
        };
        let long = |n: usize| "x".repeat(n + 1);
        let mut cases: Vec<(NewVersion, &str)> = Vec::new();
        let mut v = base.clone();
        v.source = long(limits::SOURCE);
        cases.push((v, "source"));
        let mut v = base.clone();
        v.description = long(limits::DESCRIPTION);
        cases.push((v, "description"));
        let mut v = base.clone();
        v.lineage.run_id = Some(long(limits::ID));
        cases.push((v, "run id"));
        let mut v = base.clone();
        v.lineage.code_commit = Some(long(limits::ID));
        cases.push((v, "code commit"));
        let mut v = base.clone();
        v.lineage.datasets = vec![crate::Dataset {
            uri: long(limits::URI),
            digest: None,
        }];
        cases.push((v, "data set URI"));
        let mut v = base.clone();
        v.tags = (0..=limits::TAGS)
            .map(|i| Tag {
                key: format!("k{i}"),
                value: String::new(),
            })
            .collect();
        cases.push((v, "tags"));
        for (v, what) in cases {
            let e = reg.register_version("a", &v, None).expect_err(what);
            assert!(e.to_string().starts_with(&format!("invalid {what}")), "{e}");
            // Quoted input is cut short.
            assert!(e.to_string().len() < 200, "{e}");
        }
        assert!(
            reg.models().expect("models").is_empty(),
            "nothing half-written"
        );
        let e = reg
            .create_model("a", "m", &long(limits::DESCRIPTION), &[])
            .expect_err("description");
        assert!(e.to_string().contains("at most 5000 bytes"), "{e}");
        reg.register_version("a", &base, None).expect("fits");
        let e = reg
            .set_alias("a", "m", "prod", 1, &long(limits::REASON))
            .expect_err("reason");
        assert!(e.to_string().starts_with("invalid reason"), "{e}");
    }

    #[test]
    fn after_ready_only_metadata_changes() {
        let mut reg = Registry::open_in_memory(Arc::new(FixedClock(5))).expect("open");
        let new = NewVersion {
            model: "m".into(),
            source: "s3://b/m".into(),
            create_model: true,
            ..Default::default()
        };
        reg.register_version("a", &new, None).expect("v1");
        let v = reg.update_version("a", "m", 1, "notes").expect("update");
        assert_eq!(v.description, "notes");
        let m = reg.update_model("a", "m", "about m").expect("update");
        assert_eq!(m.description, "about m");
        // Everything else of a READY version stays as it was.
        let e = reg
            .conn
            .execute(
                "UPDATE versions SET source = 'x' WHERE number = 1",
                params![],
            )
            .expect_err("source");
        assert!(
            e.to_string().contains("only its description may change"),
            "{e}"
        );
        match reg.delete_version("m", 1) {
            Err(e @ RegistryError::VersionsAreKept { .. }) => {
                assert!(e.to_string().contains("never deleted"), "{e}")
            }
            other => panic!("expected VersionsAreKept, got {other:?}"),
        }
        assert!(matches!(
            reg.delete_version("m", 9),
            Err(RegistryError::UnknownVersion { .. })
        ));
        // A model with versions keeps its name; an empty one may change it.
        match reg.rename_model("a", "m", "m2") {
            Err(e @ RegistryError::NoRename { .. }) => {
                assert!(e.to_string().contains("1 version(s)"), "{e}")
            }
            other => panic!("expected NoRename, got {other:?}"),
        }
        reg.create_model("a", "empty", "", &[]).expect("empty");
        assert!(matches!(
            reg.rename_model("a", "empty", "m"),
            Err(RegistryError::ModelExists { .. })
        ));
        assert!(reg.rename_model("a", "empty", "team/x").is_err());
        assert_eq!(
            reg.rename_model("a", "empty", "full").expect("rename").name,
            "full"
        );
        let actions: Vec<String> = reg
            .audit_log()
            .expect("log")
            .into_iter()
            .map(|e| e.action)
            .collect();
        for a in ["version.update", "model.update", "model.rename"] {
            assert!(actions.iter().any(|x| x == a), "{a}: {actions:?}");
        }
        assert!(reg.verify_chains().expect("verify").ok());
    }

    #[test]
    fn long_tag_values_are_refused_whatever_their_characters() {
        // 3-byte characters: byte 40 falls inside the 14th.
        let euro = Tag {
            key: "note".into(),
            value: "\u{20ac}".repeat(1700),
        };
        match check_tag(&euro) {
            Err(RegistryError::Invalid { value, reason, .. }) => {
                assert_eq!(value, format!("{}...", "\u{20ac}".repeat(13)));
                assert!(reason.contains("at most 5000 bytes"), "{reason}");
            }
            other => panic!("expected Invalid, got {other:?}"),
        }
        let mut reg = Registry::open_in_memory(Arc::new(FixedClock(0))).expect("open");
        let e = reg
            .create_model("alice", "m", "", std::slice::from_ref(&euro))
            .expect_err("too long");
        assert!(e.to_string().contains("at most 5000 bytes"), "{e}");
        let ascii = Tag {
            key: "note".into(),
            value: "x".repeat(5001),
        };
        match check_tag(&ascii) {
            Err(RegistryError::Invalid { value, .. }) => {
                assert_eq!(value, format!("{}...", "x".repeat(40)));
            }
            other => panic!("expected Invalid, got {other:?}"),
        }
        let fits = Tag {
            key: "note".into(),
            value: "\u{20ac}".repeat(1666),
        };
        assert!(check_tag(&fits).is_ok());
    }
}
