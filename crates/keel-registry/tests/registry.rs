//! The registry end to end on both stores, a real SQLite file and a real
//! PostgreSQL database (each test runs on each: `NAME::sqlite`,
//! `NAME::postgres`): numbering, immutability, aliases and rollback, both
//! hash chains and what tampering they catch, API keys, schema versions;
//! backup and restore; and on PostgreSQL, several
//! registries (replicas) writing at once.

mod common;

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use common::Store;

use keel_registry::{
    Artifacts, Clock, Lineage, NewVersion, Registry, RegistryError, Role, Status, VersionRef,
};
use keel_store::{Digest, FileEntry, Manifest};

/// A clock that moves one second per reading.
#[derive(Debug, Default)]
struct Stepping(AtomicU64);

impl Clock for Stepping {
    fn now_ms(&self) -> u64 {
        1_700_000_000_000 + 1000 * self.0.fetch_add(1, Ordering::Relaxed)
    }
}

fn open(store: &Store) -> Registry {
    store.open(Arc::new(Stepping::default()))
}

fn artifacts(content: &[(&str, &[u8])]) -> Artifacts {
    let files = content
        .iter()
        .map(|(n, d)| FileEntry {
            name: (*n).to_owned(),
            size: d.len() as u64,
            sha256: Digest::of(d),
        })
        .collect();
    Artifacts {
        url: "file:///models/m".into(),
        manifest: Manifest::new("m", files, Default::default()).expect("manifest"),
    }
}

fn new(model: &str) -> NewVersion {
    NewVersion {
        model: model.into(),
        source: "file:///src".into(),
        create_model: true,
        lineage: Lineage {
            run_id: Some("run-7".into()),
            code_commit: Some("abc123".into()),
            ..Default::default()
        },
        ..Default::default()
    }
}

on_both_stores!(
    versions_are_numbered_per_model_and_immutable_once_ready,
    aliases_roll_back_like_a_stack_and_history_is_kept,
    audit_verify_names_the_first_broken_link,
    api_keys_are_stored_hashed_and_revocable,
    models_and_bad_input,
    backup_and_restore_keep_everything_and_refuse_broken_backups,
);

fn versions_are_numbered_per_model_and_immutable_once_ready(store: Store) {
    let mut r = open(&store);
    let a = artifacts(&[("w.bin", b"weights"), ("c.json", b"{}")]);
    let v1 = r
        .register_version("alice", &new("m"), Some(&a))
        .expect("v1");
    let v2 = r
        .register_version("alice", &new("m"), Some(&a))
        .expect("v2");
    let o1 = r
        .register_version("bob", &new("other"), Some(&a))
        .expect("o1");
    assert_eq!((v1.version, v2.version, o1.version), (1, 2, 1));
    assert_eq!(v1.status, Status::Ready);
    assert_eq!(v1.manifest_digest, Some(a.manifest.subject_digest().hex()));
    assert_eq!(v1.files.len(), 2);
    assert_eq!(v1.lineage.run_id.as_deref(), Some("run-7"));

    // A reserved version takes its number; completing it makes it READY;
    // a failed one keeps its number.
    let p = r.reserve_version("alice", &new("m")).expect("reserve");
    assert_eq!((p.version, p.status), (3, Status::PendingRegistration));
    let f = r.reserve_version("alice", &new("m")).expect("reserve");
    r.fail_version("alice", "m", f.version, "upload failed")
        .expect("fail");
    let done = r.complete_version("alice", "m", 3, &a).expect("complete");
    assert_eq!(done.status, Status::Ready);
    let e = r.complete_version("alice", "m", 3, &a).expect_err("again");
    assert!(matches!(e, RegistryError::WrongStatus { .. }), "{e}");
    assert_eq!(
        r.register_version("alice", &new("m"), Some(&a))
            .expect("v5")
            .version,
        5
    );

    // READY rows refuse every change, even straight SQL.
    drop(r);
    for stmt in [
        "UPDATE versions SET source = 'x' WHERE number = 1",
        "UPDATE version_files SET sha256 = 'x'",
        "DELETE FROM version_files",
        "DELETE FROM versions WHERE number = 1",
        "INSERT INTO version_files (version_id, name, size, sha256) VALUES (1, 'new', 1, 'x')",
        "UPDATE audit_events SET actor = 'x'",
        "DELETE FROM audit_events",
    ] {
        let e = store.sql(stmt).expect_err(stmt);
        assert!(
            e.contains("immutable") || e.contains("append-only") || e.contains("never deleted"),
            "{stmt}: {e}"
        );
    }
    if store.is_postgres() {
        // TRUNCATE skips row triggers; statement triggers refuse it.
        for table in ["audit_events", "alias_events", "versions", "version_files"] {
            let e = store
                .sql(&format!("TRUNCATE {table} CASCADE"))
                .expect_err(table);
            assert!(
                e.contains("immutable") || e.contains("append-only") || e.contains("never deleted"),
                "{table}: {e}"
            );
        }
    }
    let r = open(&store);
    assert!(r.verify_chains().expect("verify").ok());
}

fn aliases_roll_back_like_a_stack_and_history_is_kept(store: Store) {
    let mut r = open(&store);
    let a = artifacts(&[("w", b"1")]);
    for _ in 0..3 {
        r.register_version("ci", &new("m"), Some(&a)).expect("v");
    }
    r.set_alias("alice", "m", "production", 1, "first")
        .expect("set");
    r.set_alias("alice", "m", "production", 2, "better")
        .expect("set");
    r.set_alias("bob", "m", "production", 3, "best")
        .expect("set");
    r.set_alias("bob", "m", "staging", 3, "try").expect("set");
    let ev = r
        .rollback("carol", "m", "production", "regression")
        .expect("rb");
    assert_eq!((ev.old_version, ev.new_version), (Some(3), Some(2)));
    let ev = r.rollback("carol", "m", "production", "again").expect("rb");
    assert_eq!(ev.new_version, Some(1));
    let e = r
        .rollback("carol", "m", "production", "once more")
        .expect_err("none");
    assert!(matches!(e, RegistryError::NothingToRollBack { .. }), "{e}");
    assert_eq!(
        r.resolve(&VersionRef::Alias("m".into(), "production".into()))
            .expect("resolve")
            .version,
        1
    );
    let h = r.history("m", Some("production")).expect("history");
    let moves: Vec<(Option<u64>, Option<u64>, &str)> = h
        .iter()
        .map(|e| (e.old_version, e.new_version, e.actor.as_str()))
        .collect();
    assert_eq!(
        moves,
        [
            (None, Some(1), "alice"),
            (Some(1), Some(2), "alice"),
            (Some(2), Some(3), "bob"),
            (Some(3), Some(2), "carol"),
            (Some(2), Some(1), "carol"),
        ]
    );
    assert_eq!(r.history("m", None).expect("all").len(), 6);
    // Deleting and rolling back the delete restores the alias.
    r.delete_alias("dave", "m", "staging", "retire")
        .expect("rm");
    assert!(r.resolve(&"m@staging".parse().expect("ref")).is_err());
    r.rollback("dave", "m", "staging", "undo").expect("undo");
    assert_eq!(
        r.resolve(&"m@staging".parse().expect("ref"))
            .expect("back")
            .version,
        3
    );
    // Bad input.
    assert!(matches!(
        r.set_alias("a", "nope", "x", 1, "r"),
        Err(RegistryError::UnknownModel { .. })
    ));
    assert!(matches!(
        r.set_alias("a", "m", "x", 9, "r"),
        Err(RegistryError::UnknownVersion { .. })
    ));
    assert!(matches!(
        r.set_alias("a", "m", "latest", 1, "r"),
        Err(RegistryError::Invalid { .. })
    ));
    let pending = r.reserve_version("a", &new("m")).expect("reserve");
    assert!(matches!(
        r.set_alias("a", "m", "x", pending.version, "r"),
        Err(RegistryError::WrongStatus { .. })
    ));
    assert!(r.verify_chains().expect("verify").ok());
}

/// The registry the tampering cases start from: two versions, an alias
/// moved three times.
fn tamper_base(store: &Store) {
    let mut r = open(store);
    let a = artifacts(&[("w", b"1")]);
    r.register_version("ci", &new("m"), Some(&a)).expect("v1");
    r.register_version("ci", &new("m"), Some(&a)).expect("v2");
    for (v, why) in [(1, "a"), (2, "b"), (1, "c")] {
        r.set_alias("alice", "m", "production", v, why)
            .expect("set");
    }
    let clean = r.verify_chains().expect("verify");
    assert!(clean.ok(), "{:?}", clean.breaks);
    assert_eq!(clean.alias_events, 3);
}

/// A fresh registry like `store`'s kind, built by [`tamper_base`], then
/// changed beneath the registry; its chain report.
fn tampered(
    store: &Store,
    trigger: Option<(&str, &str)>,
    stmt: &str,
) -> keel_registry::ChainReport {
    let fresh = if store.is_postgres() {
        Store::postgres()
    } else {
        Store::sqlite()
    };
    tamper_base(&fresh);
    fresh.tamper(trigger, stmt).expect("tamper");
    open(&fresh).verify_chains().expect("verify")
}

fn audit_verify_names_the_first_broken_link(store: Store) {
    // Someone drops the triggers and edits the second alias event.
    let rep = tampered(
        &store,
        Some(("alias_events_no_update", "alias_events")),
        "UPDATE alias_events SET new_version = 2, reason = 'quietly' WHERE seq = 2;",
    );
    assert!(!rep.ok());
    let first = &rep.breaks[0];
    assert_eq!(
        (first.chain.as_str(), first.seq),
        ("alias history", 2),
        "{rep:?}"
    );
    assert!(
        first.what.contains("changed after it was written"),
        "{}",
        first.what
    );

    // An audit event deleted from the middle.
    let rep = tampered(
        &store,
        Some(("audit_events_no_delete", "audit_events")),
        "DELETE FROM audit_events WHERE seq = 3;",
    );
    let b = rep
        .breaks
        .iter()
        .find(|b| b.chain.as_str() == "audit log")
        .expect("audit break");
    assert_eq!(b.seq, 4, "{rep:?}");

    // The newest audit event removed: the recorded head catches it.
    let rep = tampered(
        &store,
        Some(("audit_events_no_delete", "audit_events")),
        "DELETE FROM audit_events WHERE seq = (SELECT MAX(seq) FROM audit_events);",
    );
    assert!(
        rep.breaks
            .iter()
            .any(|b| b.what.contains("removed from the end")),
        "{rep:?}"
    );

    // The current alias moved behind the history's back.
    let rep = tampered(&store, None, "UPDATE aliases SET version = 2");
    assert!(
        rep.breaks.iter().any(|b| b
            .what
            .contains("m@production points at version 2, but its history says version 1")),
        "{rep:?}"
    );

    // A file digest rewritten under a READY version.
    let rep = tampered(
        &store,
        Some(("version_files_no_update", "version_files")),
        &format!(
            "UPDATE version_files SET sha256 = '{}' WHERE version_id = 1;",
            Digest::of(b"evil").hex()
        ),
    );
    assert!(
        rep.breaks.iter().any(|b| b.what.contains("version m:1")),
        "{rep:?}"
    );
    drop(store);
}

fn api_keys_are_stored_hashed_and_revocable(store: Store) {
    let mut r = open(&store);
    let secret = keel_registry::auth::new_secret();
    let k = r
        .create_api_key("admin", "ci", Role::Write, &secret)
        .expect("key");
    assert_eq!(k.role, Role::Write);
    assert_eq!(
        r.authenticate(&secret).expect("auth").map(|k| k.name),
        Some("ci".into())
    );
    assert!(r.authenticate("keel_wrong").expect("auth").is_none());
    assert!(matches!(
        r.create_api_key(
            "admin",
            "ci",
            Role::Read,
            &keel_registry::auth::new_secret()
        ),
        Err(RegistryError::KeyExists { .. })
    ));
    r.revoke_api_key("admin", "ci").expect("revoke");
    assert!(r.authenticate(&secret).expect("auth").is_none());
    drop(r);
    let stored = store
        .text("SELECT sha256 FROM api_keys")
        .expect("a stored key");
    assert!(!stored.contains(&secret));
    assert_eq!(stored, keel_registry::auth::secret_hash(&secret));
}

/// A backup is a SQLite registry file from either store (SQLite's online
/// backup, or a checked copy of one PostgreSQL snapshot); restoring it
/// checks it first. On PostgreSQL a restore goes into an empty database
/// only: its tables refuse every delete.
fn backup_and_restore_keep_everything_and_refuse_broken_backups(store: Store) {
    let dir = tempfile::tempdir().expect("tmp");
    let same_kind = || {
        if store.is_postgres() {
            Store::postgres()
        } else {
            Store::sqlite()
        }
    };
    let sql = |p: &std::path::Path, s: &str| {
        rusqlite::Connection::open(p).and_then(|c| c.execute_batch(s))
    };
    let mut r = open(&store);
    let a = artifacts(&[("w", b"1")]);
    r.register_version("ci", &new("m"), Some(&a)).expect("v1");
    r.register_version("ci", &new("m"), Some(&a)).expect("v2");
    r.set_alias("ci", "m", "prod", 1, "go").expect("alias");
    r.set_alias("ci", "m", "prod", 2, "next").expect("alias");
    let backup = dir.path().join("backup.db");
    r.backup_to(&backup).expect("backup");
    // The backup is a registry of its own whose chains verify.
    let copy = Registry::open(&backup, Arc::new(Stepping::default())).expect("open backup");
    let chains = copy.verify_chains().expect("verify");
    assert!(chains.ok(), "{:?}", chains.breaks);
    assert_eq!(chains.alias_events, 2);
    drop(copy);
    // Never over a file that is there.
    assert!(r.backup_to(&backup).is_err());

    let fresh_store = same_kind();
    let mut fresh = open(&fresh_store);
    let restored = fresh.restore_from("ops", &backup, false).expect("restore");
    assert_eq!(restored.alias_events, 2);
    let prod = fresh.resolve(&"m@prod".parse().expect("ref")).expect("v");
    assert_eq!(prod.version, 2);
    assert_eq!(
        prod.manifest_digest,
        Some(a.manifest.subject_digest().hex())
    );
    let log = fresh.audit_log().expect("log");
    assert_eq!(
        log.last().map(|e| e.action.as_str()),
        Some("registry.restore")
    );
    // The backup's events, then the restore's (written with the data, in
    // one step), and the backup itself untouched.
    assert_eq!(log.len() as u64, chains.audit_events + 1);
    let backup_log = Registry::open(&backup, Arc::new(Stepping::default()))
        .expect("open backup")
        .audit_log()
        .expect("log");
    assert_eq!(backup_log.len() as u64, chains.audit_events);
    assert!(fresh.verify_chains().expect("verify").ok());
    // No staging copy left behind, beside the registry or the backup.
    let leftovers = |d: &std::path::Path| {
        std::fs::read_dir(d)
            .map(|it| {
                it.filter_map(|e| e.ok())
                    .filter(|e| {
                        e.file_name()
                            .to_string_lossy()
                            .starts_with(".keel-registry-")
                    })
                    .count()
            })
            .unwrap_or(0)
    };
    assert_eq!(leftovers(dir.path()), 0);
    if let Some(parent) = fresh.path().parent() {
        assert_eq!(leftovers(parent), 0);
    }
    // A registry with data is not replaced without force, and on
    // PostgreSQL not at all.
    if store.is_postgres() {
        for force in [false, true] {
            let e = fresh
                .restore_from("ops", &backup, force)
                .expect_err("over data on PostgreSQL");
            assert!(e.to_string().contains("empty database"), "{e}");
        }
    } else {
        assert!(matches!(
            fresh.restore_from("ops", &backup, false),
            Err(RegistryError::NotEmpty { .. })
        ));
        fresh.restore_from("ops", &backup, true).expect("forced");
    }
    assert_eq!(
        fresh
            .resolve(&"m@prod".parse().expect("ref"))
            .expect("v")
            .version,
        2
    );

    // A backup whose chain was edited is refused, and changes nothing.
    sql(
        &backup,
        "DROP TRIGGER alias_events_no_update; UPDATE alias_events SET reason = 'x';",
    )
    .expect("edit");
    let other_store = same_kind();
    let mut other = open(&other_store);
    let e = other
        .restore_from("ops", &backup, false)
        .expect_err("broken");
    assert!(e.to_string().contains("does not verify"), "{e}");
    std::fs::write(
        dir.path().join("junk.db"),
        b"not sqlite at all, just some bytes here",
    )
    .expect("w");
    assert!(other
        .restore_from("ops", &dir.path().join("junk.db"), false)
        .is_err());
    assert!(other.audit_log().expect("log").is_empty());
}

fn models_and_bad_input(store: Store) {
    let mut r = open(&store);
    r.create_model("alice", "empty", "no versions", &[])
        .expect("create");
    assert!(matches!(
        r.create_model("alice", "empty", "", &[]),
        Err(RegistryError::ModelExists { .. })
    ));
    assert!(matches!(
        r.create_model("alice", "bad name!", "", &[]),
        Err(RegistryError::Invalid { .. })
    ));
    let mut n = new("missing");
    n.create_model = false;
    assert!(matches!(
        r.register_version("a", &n, None),
        Err(RegistryError::UnknownModel { .. })
    ));
    let mut n = new("empty");
    n.lineage.parent_version = Some(4);
    assert!(matches!(
        r.register_version("a", &n, None),
        Err(RegistryError::UnknownVersion { .. })
    ));
    assert!(matches!(
        r.version("empty", 1),
        Err(RegistryError::UnknownVersion { .. })
    ));
    assert!(matches!(
        r.model("nope"),
        Err(RegistryError::UnknownModel { .. })
    ));
    assert!("m:zero".parse::<VersionRef>().is_err());
    r.register_version("a", &new("kept"), None).expect("v1");
    assert!(matches!(
        r.delete_model("a", "kept"),
        Err(RegistryError::ModelHasVersions { .. })
    ));
    r.delete_model("a", "empty").expect("delete empty");
    assert_eq!(
        r.models()
            .expect("ls")
            .iter()
            .map(|m| m.name.as_str())
            .collect::<Vec<_>>(),
        ["kept"]
    );
    // A newer schema than this build knows is refused.
    drop(r);
    store.set_schema_version(99);
    let e = store
        .try_open(Arc::new(Stepping::default()))
        .expect_err("newer");
    assert!(
        matches!(e, RegistryError::SchemaTooNew { found: 99, .. }),
        "{e}"
    );
}

/// Sixteen writers on two replicas' worth of connections (each thread a
/// registry of its own, as each `keel model serve` process is), all at
/// once on one PostgreSQL database: every version number is taken exactly
/// once with no gap, and the alias history and audit log stay one chain
/// each while both replicas move the same alias.
#[test]
#[ignore = "needs PostgreSQL: scripts/services/postgres (scripts/test starts it)"]
fn sixteen_writers_number_gaplessly_and_keep_one_chain() {
    const WRITERS: usize = 16;
    const EACH: usize = 12;
    let store = Arc::new(Store::postgres());
    let clock: Arc<dyn Clock> = Arc::new(Stepping::default());
    // The model exists before the race (its creation is part of the race
    // in the replica test).
    let mut r = store.open(clock.clone());
    r.create_model("ci", "m", "", &[]).expect("model");
    let a = artifacts(&[("w", b"1")]);
    let start = Arc::new(std::sync::Barrier::new(WRITERS));
    let threads: Vec<_> = (0..WRITERS)
        .map(|w| {
            let (store, clock, start, a) = (store.clone(), clock.clone(), start.clone(), a.clone());
            std::thread::spawn(move || {
                let mut reg = store.open(clock);
                start.wait();
                let mut mine = Vec::new();
                for i in 0..EACH {
                    let mut n = new("m");
                    n.create_model = false;
                    let v = reg
                        .register_version(&format!("writer-{w}"), &n, Some(&a))
                        .expect("register");
                    mine.push(v.version);
                    // Every other writer also moves the shared alias.
                    if w % 2 == 0 {
                        reg.set_alias(
                            &format!("writer-{w}"),
                            "m",
                            "prod",
                            v.version,
                            &format!("{i}"),
                        )
                        .expect("alias");
                    }
                }
                mine
            })
        })
        .collect();
    let mut all: Vec<u64> = threads
        .into_iter()
        .flat_map(|t| t.join().expect("writer"))
        .collect();
    all.sort_unstable();
    let want: Vec<u64> = (1..=(WRITERS * EACH) as u64).collect();
    assert_eq!(all, want, "gapless and unique");
    let report = r.verify_chains().expect("verify");
    assert!(report.ok(), "{:?}", report.breaks);
    assert_eq!(report.alias_events, (WRITERS / 2 * EACH) as u64);
    // One chain: every event links to the one before it (verify checks
    // it), and there is exactly one event per sequence number.
    assert_eq!(
        store.text("SELECT COUNT(DISTINCT prev_hash)::text FROM alias_events"),
        Some((WRITERS / 2 * EACH).to_string())
    );
    let history = r.history("m", Some("prod")).expect("history");
    for pair in history.windows(2) {
        assert_eq!(pair[1].old_version, pair[0].new_version, "{pair:?}");
    }
}

/// A database that goes away gives errors a server answers 503 for, and
/// the same registry works again once it is back, with no restart.
#[test]
#[ignore = "needs PostgreSQL: scripts/services/postgres (scripts/test starts it)"]
fn a_lost_connection_is_unavailable_then_recovers_by_itself() {
    let store = Store::postgres();
    let Store::Postgres(db) = &store else {
        unreachable!()
    };
    let mut r = open(&store);
    r.create_model("ci", "m", "", &[]).expect("model");
    // The server ends every session of this database (as a restart or a
    // failover does).
    db.admin()
        .batch_execute(&format!(
            "SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE datname = '{}' AND pid <> pg_backend_pid()",
            db.name
        ))
        .expect("terminate");
    // The registry finds out at its next statement: its idle connection
    // is replaced before a transaction starts, so the call succeeds.
    r.register_version("ci", &new("m"), None)
        .expect("reconnected before the write");
    // Terminated inside a read: that call fails as unavailable...
    let e = r
        .snapshot(|r| {
            db.admin()
                .batch_execute(&format!(
                    "SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE datname = '{}' AND pid <> pg_backend_pid()",
                    db.name
                ))
                .expect("terminate");
            r.models()
        })
        .expect_err("lost mid-read");
    assert!(e.is_unavailable(), "{e:#?}");
    // ...and the next one works.
    assert_eq!(r.models().expect("models").len(), 1);
    assert!(r.verify_chains().expect("verify").ok());
}
