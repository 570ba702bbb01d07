//! The registry end to end on a real SQLite file: numbering, immutability,
//! aliases and rollback, both hash chains and what tampering they catch,
//! API keys, backup and restore, and the HTTP API's authentication.

use std::path::Path;
use std::sync::atomic::{AtomicI64, Ordering};
use std::sync::Arc;

use keel_registry::{
    Artifacts, Clock, Lineage, NewVersion, Registry, RegistryError, Role, Status, VersionRef,
};
use keel_store::{Digest, FileEntry, Manifest};

/// A clock that moves one second per reading.
#[derive(Debug, Default)]
struct Stepping(AtomicI64);

impl Clock for Stepping {
    fn now_ms(&self) -> i64 {
        1_700_000_000_000 + 1000 * self.0.fetch_add(1, Ordering::Relaxed)
    }
}

fn open(path: &Path) -> Registry {
    Registry::open(path, Arc::new(Stepping::default())).expect("open")
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

fn sql(path: &Path, statement: &str) -> rusqlite::Result<usize> {
    rusqlite::Connection::open(path)?.execute_batch(statement)?;
    Ok(0)
}

#[test]
fn versions_are_numbered_per_model_and_immutable_once_ready() {
    let dir = tempfile::tempdir().expect("tmp");
    let db = dir.path().join("reg.db");
    let mut r = open(&db);
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
        let e = sql(&db, stmt).expect_err(stmt).to_string();
        assert!(
            e.contains("immutable") || e.contains("append-only") || e.contains("never deleted"),
            "{stmt}: {e}"
        );
    }
    let r = open(&db);
    assert!(r.verify_chains().expect("verify").ok());
}

#[test]
fn aliases_roll_back_like_a_stack_and_history_is_kept() {
    let dir = tempfile::tempdir().expect("tmp");
    let mut r = open(&dir.path().join("reg.db"));
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

#[test]
fn audit_verify_names_the_first_broken_link() {
    let dir = tempfile::tempdir().expect("tmp");
    let db = dir.path().join("reg.db");
    let mut r = open(&db);
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
    drop(r);

    // Someone drops the triggers and edits the second alias event.
    let copy = dir.path().join("edited.db");
    std::fs::copy(&db, &copy).expect("copy");
    sql(
        &copy,
        "DROP TRIGGER alias_events_no_update; UPDATE alias_events SET new_version = 2, reason = 'quietly' WHERE seq = 2;",
    )
    .expect("edit");
    let rep = open(&copy).verify_chains().expect("verify");
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
    let copy = dir.path().join("deleted.db");
    std::fs::copy(&db, &copy).expect("copy");
    sql(
        &copy,
        "DROP TRIGGER audit_events_no_delete; DELETE FROM audit_events WHERE seq = 3;",
    )
    .expect("edit");
    let rep = open(&copy).verify_chains().expect("verify");
    let b = rep
        .breaks
        .iter()
        .find(|b| b.chain.as_str() == "audit log")
        .expect("audit break");
    assert_eq!(b.seq, 4, "{rep:?}");

    // The newest audit event removed: the recorded head catches it.
    let copy = dir.path().join("tail.db");
    std::fs::copy(&db, &copy).expect("copy");
    sql(
        &copy,
        "DROP TRIGGER audit_events_no_delete; DELETE FROM audit_events WHERE seq = (SELECT MAX(seq) FROM audit_events);",
    )
    .expect("edit");
    let rep = open(&copy).verify_chains().expect("verify");
    assert!(
        rep.breaks
            .iter()
            .any(|b| b.what.contains("removed from the end")),
        "{rep:?}"
    );

    // The current alias moved behind the history's back.
    let copy = dir.path().join("alias.db");
    std::fs::copy(&db, &copy).expect("copy");
    sql(&copy, "UPDATE aliases SET version = 2").expect("edit");
    let rep = open(&copy).verify_chains().expect("verify");
    assert!(
        rep.breaks.iter().any(|b| b
            .what
            .contains("m@production points at version 2, but its history says version 1")),
        "{rep:?}"
    );

    // A file digest rewritten under a READY version.
    let copy = dir.path().join("digest.db");
    std::fs::copy(&db, &copy).expect("copy");
    sql(
        &copy,
        &format!(
            "DROP TRIGGER version_files_no_update; UPDATE version_files SET sha256 = '{}' WHERE version_id = 1;",
            Digest::of(b"evil").hex()
        ),
    )
    .expect("edit");
    let rep = open(&copy).verify_chains().expect("verify");
    assert!(
        rep.breaks.iter().any(|b| b.what.contains("version m:1")),
        "{rep:?}"
    );
}

#[test]
fn api_keys_are_stored_hashed_and_revocable() {
    let dir = tempfile::tempdir().expect("tmp");
    let db = dir.path().join("reg.db");
    let mut r = open(&db);
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
    let stored: String = rusqlite::Connection::open(&db)
        .expect("open")
        .query_row("SELECT group_concat(sha256) FROM api_keys", [], |row| {
            row.get(0)
        })
        .expect("row");
    assert!(!stored.contains(&secret));
    assert_eq!(stored, keel_registry::auth::secret_hash(&secret));
}

#[test]
fn backup_and_restore_keep_everything_and_refuse_broken_backups() {
    let dir = tempfile::tempdir().expect("tmp");
    let mut r = open(&dir.path().join("reg.db"));
    let a = artifacts(&[("w", b"1")]);
    r.register_version("ci", &new("m"), Some(&a)).expect("v1");
    r.set_alias("ci", "m", "prod", 1, "go").expect("alias");
    let backup = dir.path().join("backup.db");
    r.backup_to(&backup).expect("backup");

    let mut fresh = open(&dir.path().join("fresh.db"));
    fresh.restore_from("ops", &backup, false).expect("restore");
    assert_eq!(
        fresh
            .resolve(&"m@prod".parse().expect("ref"))
            .expect("v")
            .version,
        1
    );
    let log = fresh.audit_log().expect("log");
    assert_eq!(
        log.last().map(|e| e.action.as_str()),
        Some("registry.restore")
    );
    assert!(fresh.verify_chains().expect("verify").ok());
    // A registry with data is not replaced without force.
    assert!(matches!(
        fresh.restore_from("ops", &backup, false),
        Err(RegistryError::NotEmpty { .. })
    ));
    fresh.restore_from("ops", &backup, true).expect("forced");

    // A backup whose chain was edited is refused.
    sql(
        &backup,
        "DROP TRIGGER alias_events_no_update; UPDATE alias_events SET reason = 'x';",
    )
    .expect("edit");
    let mut other = open(&dir.path().join("other.db"));
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
}

#[test]
fn models_and_bad_input() {
    let dir = tempfile::tempdir().expect("tmp");
    let mut r = open(&dir.path().join("reg.db"));
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
    let db = dir.path().join("reg.db");
    sql(&db, "PRAGMA user_version = 99").expect("bump");
    let e = Registry::open(&db, Arc::new(Stepping::default())).expect_err("newer");
    assert!(
        matches!(e, RegistryError::SchemaTooNew { found: 99, .. }),
        "{e}"
    );
}
