//! Copying a whole registry from one database to another (SQLite to
//! PostgreSQL, or back), and checking every stored signature.
//!
//! [`copy`] reads the source in one snapshot and writes the target in one
//! write transaction, rows with their own ids, sequence numbers and
//! hashes, so both hash chains come over unchanged. Before it commits, it
//! checks, on the target's own connection inside that transaction, that
//! both chains verify and end at the source's heads, that every table
//! holds as many rows as the source's, and that every signature opens
//! with its recorded key and names its version's files. Anything wrong,
//! or a failure on the way (a lost connection, a killed process), and
//! nothing is committed: the target stays empty and the copy can simply
//! be run again. It refuses a target that holds anything.

use crate::chain::ChainReport;
use crate::storage::{params, Db, Param, TxMode, Value};
use crate::{Registry, RegistryError};

type Result<T> = std::result::Result<T, RegistryError>;

/// The registry's tables in an order that satisfies their references,
/// each with its columns and the columns of its key (the copy's order).
const TABLES: &[(&str, &[&str], &str)] = &[
    ("meta", &["key", "value"], "key"),
    (
        "models",
        &[
            "id",
            "name",
            "description",
            "created_ms",
            "created_by",
            "updated_ms",
        ],
        "id",
    ),
    ("model_tags", &["model_id", "key", "value"], "model_id, key"),
    (
        "versions",
        &[
            "id",
            "model_id",
            "number",
            "status",
            "status_message",
            "source",
            "artifact_url",
            "manifest_digest",
            "description",
            "run_id",
            "lineage",
            "created_ms",
            "created_by",
            "updated_ms",
        ],
        "id",
    ),
    (
        "version_files",
        &["version_id", "name", "size", "sha256"],
        "version_id, name",
    ),
    (
        "version_tags",
        &["version_id", "key", "value"],
        "version_id, key",
    ),
    (
        "aliases",
        &["model_id", "alias", "version"],
        "model_id, alias",
    ),
    (
        "alias_events",
        &[
            "seq",
            "time_ms",
            "actor",
            "model",
            "alias",
            "action",
            "old_version",
            "new_version",
            "reason",
            "prev_hash",
            "hash",
        ],
        "seq",
    ),
    (
        "audit_events",
        &[
            "seq",
            "time_ms",
            "actor",
            "action",
            "target",
            "detail",
            "prev_hash",
            "hash",
        ],
        "seq",
    ),
    (
        "signatures",
        &[
            "id",
            "version_id",
            "bundle",
            "public_key_pem",
            "key_hint",
            "created_ms",
            "created_by",
        ],
        "id",
    ),
    (
        "api_keys",
        &[
            "id",
            "name",
            "sha256",
            "role",
            "created_ms",
            "created_by",
            "revoked_ms",
        ],
        "id",
    ),
];

/// Tables whose ids the database hands out (PostgreSQL's identity
/// sequences must follow the copied ids).
const ID_TABLES: &[&str] = &["models", "versions", "signatures", "api_keys"];

/// Rows read and written at a time.
const BATCH: i64 = 1000;

/// What a copy did and checked.
#[derive(Debug, Clone, serde::Serialize)]
pub struct CopyReport {
    /// `(table, rows)` in copy order.
    pub tables: Vec<(String, u64)>,
    /// The target's chains, checked before the commit (the same heads as
    /// the source's).
    pub chains: ChainReport,
    pub signatures: SignatureReport,
}

/// Every stored signature opened with its recorded key and compared with
/// its version's files.
#[derive(Debug, Clone, Default, serde::Serialize)]
pub struct SignatureReport {
    pub checked: u64,
    /// One line per signature that does not hold.
    pub problems: Vec<String>,
}

impl SignatureReport {
    pub fn ok(&self) -> bool {
        self.problems.is_empty()
    }
}

impl Registry {
    /// Opens every stored signature with the public key recorded with it
    /// and compares the signed files with the version's files.
    pub fn verify_signatures(&self) -> Result<SignatureReport> {
        verify_signatures(self.db())
    }
}

fn verify_signatures(db: &Db) -> Result<SignatureReport> {
    let rows = db
        .query_map(
            "SELECT s.id, m.name, v.number, s.version_id, s.bundle, s.public_key_pem
             FROM signatures s JOIN versions v ON v.id = s.version_id
             JOIN models m ON m.id = v.model_id ORDER BY s.id",
            params![],
            |r| {
                Ok((
                    r.get::<i64>(0)?,
                    r.get::<String>(1)?,
                    r.get::<i64>(2)?,
                    r.get::<i64>(3)?,
                    r.get::<String>(4)?,
                    r.get::<String>(5)?,
                ))
            },
        )
        .map_err(RegistryError::db("reading signatures"))?;
    let mut report = SignatureReport::default();
    for (id, model, number, vid, bundle, pem) in rows {
        report.checked += 1;
        let files: Vec<(String, String)> = db
            .query_map(
                "SELECT name, sha256 FROM version_files WHERE version_id = ?1 ORDER BY name",
                params![vid],
                |r| Ok((r.get(0)?, r.get(1)?)),
            )
            .map_err(RegistryError::db("reading version files"))?;
        let what = format!("signature #{id} of {model}:{number}");
        let key =
            match crate::sign::PublicKey::from_pem(&pem, std::path::Path::new("<recorded key>")) {
                Ok(k) => k,
                Err(e) => {
                    report.problems.push(format!("{what}: {e}"));
                    continue;
                }
            };
        match key
            .open_bundle(bundle.as_bytes())
            .and_then(|p| crate::sign::parse_statement(&p))
        {
            Err(e) => report.problems.push(format!("{what}: {e}")),
            Ok(st) => {
                for p in crate::sign::compare(&st.resources, &files) {
                    report.problems.push(format!("{what}: {p}"));
                }
            }
        }
    }
    Ok(report)
}

fn count(db: &Db, table: &str) -> Result<u64> {
    db.query_row(&format!("SELECT COUNT(*) FROM {table}"), params![], |r| {
        r.get::<i64>(0)
    })
    .map(|n| n as u64)
    .map_err(RegistryError::db("counting rows"))
}

fn failed(reason: impl Into<String>) -> RegistryError {
    RegistryError::Migrate {
        reason: reason.into(),
    }
}

/// Copies everything in `from` into `to`, which must hold nothing (see
/// the module's documentation for what is checked before the commit).
pub fn copy(from: &Registry, to: &Registry) -> Result<CopyReport> {
    copy_then(from, to, |_| Ok(()))
}

/// [`copy`], with `last` run in the copy's transaction after everything
/// is checked and before it commits (a restore's audit event goes in with
/// the data it records, or neither does).
pub(crate) fn copy_then(
    from: &Registry,
    to: &Registry,
    last: impl FnOnce(&Db) -> Result<()>,
) -> Result<CopyReport> {
    if from.path() == to.path() {
        return Err(failed("the source and the target are the same database"));
    }
    // The source: its chains and signatures as they are, in the snapshot
    // that is copied.
    from.snapshot(|from| {
        let source_chains = from.verify_chains()?;
        if !source_chains.ok() {
            return Err(failed(format!(
                "the source's chains do not verify ({}); run `keel model audit verify` on it",
                source_chains
                    .breaks
                    .first()
                    .map(|b| format!("event #{}: {}", b.seq, b.what))
                    .unwrap_or_default()
            )));
        }
        let src = from.db();
        let dst = to.db();
        let tx = dst
            .begin(TxMode::Write)
            .map_err(RegistryError::db("starting the copy"))?;
        // Refused unless empty: PostgreSQL's schema holds the audit head's
        // row from the start, which the copy replaces.
        for (table, _, _) in TABLES {
            let n = count(&tx, table)?;
            let n = if *table == "meta" {
                let zero = tx
                    .query_opt(
                        "SELECT value FROM meta WHERE key = 'audit_head'",
                        params![],
                        |r| r.get::<String>(0),
                    )
                    .map_err(RegistryError::db("reading registry metadata"))?
                    .is_some_and(|v| v.bytes().all(|b| b == b'0'));
                n - u64::from(zero)
            } else {
                n
            };
            if n > 0 {
                return Err(RegistryError::NotEmpty {
                    path: to.path().to_owned(),
                });
            }
        }
        let mut tables = Vec::new();
        let mut ready = Vec::new();
        for (table, cols, key) in TABLES {
            let list = cols.join(", ");
            let marks: Vec<String> = (1..=cols.len()).map(|i| format!("?{i}")).collect();
            let insert = if *table == "meta" {
                format!(
                    "INSERT INTO meta ({list}) VALUES ({}) ON CONFLICT (key) DO UPDATE SET value = excluded.value",
                    marks.join(", ")
                )
            } else {
                format!("INSERT INTO {table} ({list}) VALUES ({})", marks.join(", "))
            };
            let select = format!("SELECT {list} FROM {table} ORDER BY {key} LIMIT ?1 OFFSET ?2");
            let status = cols.iter().position(|c| *c == "status");
            let mut copied = 0u64;
            loop {
                let rows = src
                    .query_map(&select, params![BATCH, copied as i64], |r| Ok(r.clone()))
                    .map_err(RegistryError::db("reading the source"))?;
                for row in &rows {
                    let mut values: Vec<Value> = row.0.clone();
                    // A version is written while pending (its files can
                    // only be added then, as in a registration) and gets
                    // its status once its files are in.
                    if let Some(i) = status {
                        if let (Value::Int(id), Value::Text(s)) = (&values[0], &values[i]) {
                            if s != "PENDING_REGISTRATION" {
                                ready.push((*id, s.clone()));
                            }
                        }
                        values[i] = Value::Text("PENDING_REGISTRATION".into());
                    }
                    let ps: Vec<Param<'_>> = values
                        .iter()
                        .map(crate::storage::ToParam::param)
                        .collect();
                    tx.execute(&insert, &ps)
                        .map_err(RegistryError::db("writing the target"))?;
                }
                copied += rows.len() as u64;
                if (rows.len() as i64) < BATCH {
                    break;
                }
            }
            if *table == "version_tags" {
                for (id, s) in ready.drain(..) {
                    tx.execute(
                        "UPDATE versions SET status = ?2 WHERE id = ?1",
                        params![id, s],
                    )
                    .map_err(RegistryError::db("writing the target"))?;
                }
            }
            tables.push(((*table).to_owned(), copied));
        }
        tx.0.ids_follow_rows(ID_TABLES)
            .map_err(RegistryError::db("writing the target"))?;

        // Checked inside the transaction, on the target's connection.
        for (table, n) in &tables {
            let there = count(&tx, table)?;
            if there != *n || count(src, table)? != *n {
                return Err(failed(format!(
                    "{table}: {n} rows read, {there} in the target"
                )));
            }
        }
        let chains = to.verify_chains()?;
        if !chains.ok() {
            return Err(failed(format!(
                "the copied chains do not verify: {}",
                chains
                    .breaks
                    .first()
                    .map(|b| format!("event #{}: {}", b.seq, b.what))
                    .unwrap_or_default()
            )));
        }
        if chains.audit_head != source_chains.audit_head
            || chains.alias_head != source_chains.alias_head
        {
            return Err(failed(format!(
                "the copied chains end at other heads than the source's (audit {} vs {}, alias {} vs {})",
                chains.audit_head, source_chains.audit_head, chains.alias_head, source_chains.alias_head
            )));
        }
        let source_signatures = verify_signatures(src)?;
        let signatures = verify_signatures(&tx)?;
        if !signatures.ok() || signatures.checked != source_signatures.checked {
            return Err(failed(format!(
                "{} of {} copied signatures do not hold (the source has {}, {} not holding): {}",
                signatures.problems.len(),
                signatures.checked,
                source_signatures.checked,
                source_signatures.problems.len(),
                signatures.problems.first().cloned().unwrap_or_default()
            )));
        }
        last(&tx)?;
        tx.commit()
            .map_err(RegistryError::db("committing the copy"))?;
        Ok(CopyReport {
            tables,
            chains,
            signatures,
        })
    })
}
