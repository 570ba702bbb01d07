//! Schema versions and moving a registry between stores: a registry the
//! previous release wrote (tests/fixtures/registry-schema-2.db) is
//! migrated at open with everything intact; `migrate::copy` moves a
//! registry from SQLite to PostgreSQL and back with both hash chains and
//! every signature checked, refuses a target that holds anything, and,
//! stopped half-way (a lock the test holds past the copy's timeout) or
//! refused before its commit (a source whose chain is broken), leaves the
//! target empty, so it can simply run again.

mod common;

use std::path::PathBuf;
use std::sync::Arc;

use common::Store;
use keel_registry::{
    migrate, FixedClock, Registry, RegistryError, Role, VersionRef, SCHEMA_VERSION,
};

fn clock() -> Arc<FixedClock> {
    Arc::new(FixedClock(1_800_000_000_000))
}

/// The previous release's registry, copied to a directory of its own.
fn previous_release() -> (tempfile::TempDir, PathBuf) {
    let dir = tempfile::tempdir().expect("tmp");
    let path = dir.path().join("registry.db");
    std::fs::copy(
        concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/tests/fixtures/registry-schema-2.db"
        ),
        &path,
    )
    .expect("copy the fixture");
    (dir, path)
}

fn user_version(path: &std::path::Path) -> i64 {
    rusqlite::Connection::open(path)
        .expect("open")
        .query_row("PRAGMA user_version", [], |r| r.get(0))
        .expect("user_version")
}

/// What the fixture holds, as any registry with its content shows it.
fn assert_fixture_content(r: &Registry) {
    let report = r.verify_chains().expect("verify");
    assert!(report.ok(), "{:?}", report.breaks);
    assert_eq!((report.audit_events, report.alias_events), (10, 3));
    let v = r
        .resolve(&VersionRef::Alias("llama".into(), "production".into()))
        .expect("resolve");
    assert_eq!(v.version, 1);
    assert_eq!(r.versions("llama").expect("versions").len(), 2);
    let sigs = r.verify_signatures().expect("signatures");
    assert_eq!(sigs.checked, 1);
    assert!(sigs.ok(), "{:?}", sigs.problems);
    let sig = r.signature("llama", 1).expect("signature").expect("signed");
    let key = std::fs::read_to_string(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/tests/fixtures/registry-schema-2.pub"
    ))
    .expect("public key");
    assert_eq!(sig.public_key_pem.trim(), key.trim());
    assert_eq!(r.api_keys().expect("keys").len(), 1);
}

#[test]
fn the_previous_release_s_registry_is_migrated_at_open_with_everything_intact() {
    let (_dir, path) = previous_release();
    assert_eq!(user_version(&path), 2);
    let r = Registry::open(&path, clock()).expect("open and migrate");
    assert_eq!(user_version(&path), SCHEMA_VERSION);
    assert_fixture_content(&r);
    drop(r);
    // Schema 3: a signature can no longer be deleted beneath the registry.
    let e = rusqlite::Connection::open(&path)
        .expect("open")
        .execute_batch("DELETE FROM signatures")
        .expect_err("delete refused");
    assert!(e.to_string().contains("append-only"), "{e}");
}

fn pg_registry(store: &Store) -> Registry {
    store.open(clock())
}

#[test]
#[ignore = "needs PostgreSQL: scripts/services/postgres (scripts/test starts it)"]
fn copy_moves_a_registry_to_postgres_and_back_with_chains_and_signatures() {
    let (dir, path) = previous_release();
    let mut source = Registry::open(&path, clock()).expect("open");
    let secret = keel_registry::auth::new_secret();
    source
        .create_api_key("admin", "reader", Role::Read, &secret)
        .expect("key");
    let pg = Store::postgres();
    let target = pg_registry(&pg);
    let report = migrate::copy(&source, &target).expect("copy to PostgreSQL");
    assert!(report.chains.ok() && report.signatures.ok());
    assert_eq!(report.signatures.checked, 1);
    let versions = report
        .tables
        .iter()
        .find(|(t, _)| t == "versions")
        .map(|(_, n)| *n);
    assert_eq!(versions, Some(2));
    drop(target);

    // A new connection sees it all; the copied key authenticates; new rows
    // take ids and numbers after the copied ones.
    let mut on_pg = pg_registry(&pg);
    let before = on_pg.verify_chains().expect("verify");
    assert_eq!(
        before.audit_head,
        source.verify_chains().expect("v").audit_head
    );
    assert_eq!(
        on_pg.authenticate(&secret).expect("auth").map(|k| k.name),
        Some("reader".to_owned())
    );
    let v3 = on_pg
        .register_version(
            "ci",
            &keel_registry::NewVersion {
                model: "llama".into(),
                source: "s3://b/llama".into(),
                ..Default::default()
            },
            None,
        )
        .expect("register after the copy");
    assert_eq!(v3.version, 3);
    let after = on_pg.verify_chains().expect("verify");
    assert!(after.ok(), "{:?}", after.breaks);

    // And back into a new SQLite file.
    let back = Registry::open(&dir.path().join("back.db"), clock()).expect("open");
    let report = migrate::copy(&on_pg, &back).expect("copy back to SQLite");
    assert_eq!(report.chains.audit_head, after.audit_head);
    assert_eq!(
        back.resolve(&VersionRef::Latest("llama".into()))
            .expect("latest")
            .version,
        3
    );
}

#[test]
#[ignore = "needs PostgreSQL: scripts/services/postgres (scripts/test starts it)"]
fn copy_refuses_a_target_that_holds_anything_and_changes_nothing() {
    let (_dir, path) = previous_release();
    let source = Registry::open(&path, clock()).expect("open");
    let pg = Store::postgres();
    let mut target = pg_registry(&pg);
    target
        .create_model("someone", "theirs", "", &[])
        .expect("a model of the target's own");
    let before = target.verify_chains().expect("verify");
    let e = migrate::copy(&source, &target).expect_err("refused");
    assert!(matches!(e, RegistryError::NotEmpty { .. }), "{e}");
    let after = target.verify_chains().expect("verify");
    assert_eq!(before, after);
    assert_eq!(target.models().expect("models").len(), 1);
}

#[test]
#[ignore = "needs PostgreSQL: scripts/services/postgres (scripts/test starts it)"]
fn a_copy_stopped_half_way_leaves_the_target_empty_and_runs_again() {
    let (_dir, path) = previous_release();
    let source = Registry::open(&path, clock()).expect("open");
    let pg = Store::postgres();
    let mut opts = pg.pg_options().expect("options");
    opts.timeout = std::time::Duration::from_millis(500);
    let target = Registry::open_postgres(&opts, clock()).expect("open");
    let Store::Postgres(db) = &pg else {
        unreachable!()
    };

    // The test holds the signatures table: the copy writes models,
    // versions, files, aliases and both chains, then times out there.
    let mut blocker = db.client();
    let mut hold = blocker.transaction().expect("begin");
    hold.batch_execute("LOCK TABLE signatures IN ACCESS EXCLUSIVE MODE")
        .expect("lock");
    let e = migrate::copy(&source, &target).expect_err("stopped");
    assert!(e.is_unavailable(), "{e}");
    hold.rollback().expect("release");
    for table in ["models", "versions", "alias_events", "audit_events"] {
        assert_eq!(
            db.query_text(&format!("SELECT COUNT(*)::text FROM {table}"))
                .expect("count")
                .as_deref(),
            Some("0"),
            "{table} kept rows of the stopped copy"
        );
    }
    let report = migrate::copy(&source, &target).expect("the second run");
    assert!(report.chains.ok());
    assert_fixture_content(&target);
}

#[test]
#[ignore = "needs PostgreSQL: scripts/services/postgres (scripts/test starts it)"]
fn a_source_whose_chain_is_broken_is_not_copied() {
    let (_dir, path) = previous_release();
    drop(Registry::open(&path, clock()).expect("migrate"));
    rusqlite::Connection::open(&path)
        .expect("open")
        .execute_batch(
            "DROP TRIGGER audit_events_no_update; UPDATE audit_events SET actor = 'mallory' WHERE seq = 4;",
        )
        .expect("tamper");
    let source = Registry::open(&path, clock()).expect("open");
    let pg = Store::postgres();
    let target = pg_registry(&pg);
    let e = migrate::copy(&source, &target).expect_err("refused");
    assert!(e.to_string().contains("do not verify"), "{e}");
    assert!(target.models().expect("models").is_empty());
}
