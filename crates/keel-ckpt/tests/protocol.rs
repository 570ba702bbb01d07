//! The checkpoint protocol against real backends: the local file system
//! always, Azurite and the S3 server when `scripts/test` started them (the
//! same tests, `#[ignore]`d for a plain `cargo nextest run`).

use std::collections::BTreeMap;
use std::path::Path;
use std::sync::Arc;

use keel_ckpt::{
    Ckpt, CkptError, CkptRef, Context, GcPolicy, Order, Published, PushRequest, Selector,
};
use keel_store::{Store, StoreOptions, StoreUrl, TransferOptions};
use keel_testkit::objects::{unique, ObjectService};

/// A store for one test, and what keeps it alive.
struct Env {
    store: Store,
    _tmp: Option<tempfile::TempDir>,
}

fn file_env() -> Env {
    let tmp = tempfile::tempdir().expect("tmp");
    let url = StoreUrl::parse(&format!("file://{}", tmp.path().display())).expect("url");
    Env {
        store: Store::open(
            &url,
            &StoreOptions {
                create_root: true,
                ..Default::default()
            },
        )
        .expect("open"),
        _tmp: Some(tmp),
    }
}

fn service_env(svc: ObjectService) -> Env {
    let url = StoreUrl::parse(&svc.url(&unique("proto"))).expect("url");
    let opts = StoreOptions {
        env: svc.env.clone(),
        ..Default::default()
    };
    Env {
        store: Store::open(&url, &opts).expect("open"),
        _tmp: None,
    }
}

fn ctx(nonce: u64) -> Context {
    Context {
        now_unix: 1_700_000_000 + nonce as i64,
        host: "testhost".into(),
        nonce,
    }
}

/// Seconds since the Unix epoch, now.
fn unix_now() -> i64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .expect("time")
        .as_secs() as i64
}

fn opts() -> TransferOptions {
    TransferOptions {
        part_size: 64 << 10,
        files_in_parallel: 4,
        parts_in_flight: 3,
        ..Default::default()
    }
}

fn content(step: u64, name: &str, size: usize) -> Vec<u8> {
    let seed = step.wrapping_mul(2_654_435_761) ^ name.len() as u64;
    (0..size)
        .map(|i| {
            ((i as u64)
                .wrapping_mul(6_364_136_223_846_793_005)
                .wrapping_add(seed)
                >> 24) as u8
        })
        .collect()
}

/// A DCP-like checkpoint directory for `step`.
fn make_ckpt(root: &Path, step: u64) -> std::path::PathBuf {
    let dir = root.join(format!("step-{step}"));
    for (name, size) in [
        ("__0_0.distcp", 200_000usize),
        ("__1_0.distcp", 70_000),
        ("sub/extra.bin", 10),
        (".metadata", 300),
    ] {
        let p = dir.join(name);
        std::fs::create_dir_all(p.parent().expect("parent")).expect("mkdir");
        std::fs::write(&p, content(step, name, size)).expect("write");
    }
    dir
}

fn req(step: u64, writer: &str, nonce: u64) -> PushRequest {
    let mut metrics = BTreeMap::new();
    metrics.insert("loss".to_owned(), 10.0 / (step as f64 + 1.0));
    PushRequest {
        step,
        writer: writer.into(),
        metrics,
        ctx: ctx(nonce),
    }
}

fn same_tree(a: &Path, b: &Path) {
    let fa = keel_ckpt::detect::list_files(a).expect("a");
    let fb = keel_ckpt::detect::list_files(b).expect("b");
    assert_eq!(
        fa.iter().map(|f| &f.name).collect::<Vec<_>>(),
        fb.iter().map(|f| &f.name).collect::<Vec<_>>()
    );
    for (x, y) in fa.iter().zip(&fb) {
        assert_eq!(
            std::fs::read(&x.path).expect("x"),
            std::fs::read(&y.path).expect("y"),
            "{}",
            x.name
        );
    }
}

async fn push_latest_verify_pull(env: Env) {
    let ck = Ckpt::new(&env.store, "run-a").expect("ckpt");
    let local = tempfile::tempdir().expect("tmp");
    assert_eq!(ck.latest().await.expect("latest"), None);
    assert!(matches!(
        ck.resolve(Selector::Latest).await,
        Err(CkptError::NoCheckpoint { .. })
    ));
    let d10 = make_ckpt(local.path(), 10);
    let d20 = make_ckpt(local.path(), 20);
    let r = ck
        .push(&d10, &req(10, "job-1", 1), &opts())
        .await
        .expect("push 10");
    assert_eq!(r.framework, keel_ckpt::Framework::PytorchDcp);
    assert_eq!(r.files, 4);
    assert!(matches!(r.published, Published::Latest { .. }));
    let r = ck
        .push(&d20, &req(20, "job-1", 2), &opts())
        .await
        .expect("push 20");
    assert_eq!(ck.latest().await.expect("latest"), Some(r.checkpoint));
    // A push of the same step again uploads nothing.
    let again = ck
        .push(&d20, &req(20, "job-1", 3), &opts())
        .await
        .expect("again");
    assert!(again.already_committed);
    assert_eq!(again.bytes_uploaded, 0);

    let list = ck.list().await.expect("ls");
    assert_eq!(list.iter().map(|c| c.step).collect::<Vec<_>>(), [10, 20]);
    assert!(list[1].latest && !list[0].latest);
    assert!((list[0].metrics["loss"] - 10.0 / 11.0).abs() < 1e-12);

    let v = ck.verify(Selector::Latest, &opts()).await.expect("verify");
    assert!(v.ok, "{v:?}");
    let out = local.path().join("restore");
    let p = ck
        .pull(Selector::Latest, &out, false, &ctx(9), &opts())
        .await
        .expect("pull");
    assert_eq!(p.checkpoint.step, 20);
    assert!(p.fell_back_from.is_empty());
    same_tree(&d20, &out);
    // A non-empty target is refused before anything is fetched.
    let e = ck
        .pull(Selector::Step(10), &out, false, &ctx(10), &opts())
        .await
        .expect_err("not empty");
    assert!(matches!(e, CkptError::TargetNotEmpty { .. }), "{e}");
    let out10 = local.path().join("r10");
    ck.pull(Selector::Step(10), &out10, false, &ctx(11), &opts())
        .await
        .expect("pull 10");
    same_tree(&d10, &out10);
    assert!(matches!(
        ck.resolve(Selector::Step(15)).await,
        Err(CkptError::NoSuchStep { step: 15, .. })
    ));
}

async fn corruption_is_detected_and_pull_falls_back(env: Env) {
    let ck = Ckpt::new(&env.store, "run-c").expect("ckpt");
    let local = tempfile::tempdir().expect("tmp");
    let d1 = make_ckpt(local.path(), 1);
    let d2 = make_ckpt(local.path(), 2);
    ck.push(&d1, &req(1, "w", 1), &opts()).await.expect("push");
    let r2 = ck.push(&d2, &req(2, "w", 2), &opts()).await.expect("push");
    // Flip one byte of one stored object of step 2.
    let (_, meta) = ck
        .manifest(r2.checkpoint)
        .await
        .expect("m")
        .expect("committed");
    let key = format!("{}/__0_0.distcp", meta.data);
    let mut bytes = ck.store().get(&key).await.expect("get").to_vec();
    bytes[123_456] ^= 0x40;
    ck.store().put(&key, bytes.into()).await.expect("put");

    let v = ck.verify(Selector::Latest, &opts()).await.expect("verify");
    assert!(!v.ok);
    let bad: Vec<&str> = v
        .files
        .iter()
        .filter(|f| !f.ok)
        .map(|f| f.name.as_str())
        .collect();
    assert_eq!(bad, ["__0_0.distcp"]);

    let out = local.path().join("out");
    let e = ck
        .pull(Selector::Latest, &out, true, &ctx(3), &opts())
        .await
        .expect_err("no fallback");
    assert!(matches!(e, CkptError::Integrity { .. }), "{e}");
    assert!(!out.exists(), "nothing left behind");
    let leftovers: Vec<_> = std::fs::read_dir(local.path())
        .expect("ls")
        .flatten()
        .map(|e| e.file_name())
        .collect();
    assert_eq!(leftovers.len(), 2, "{leftovers:?}");

    let p = ck
        .pull(Selector::Latest, &out, false, &ctx(4), &opts())
        .await
        .expect("fallback");
    assert_eq!(p.checkpoint.step, 1);
    assert_eq!(p.fell_back_from.len(), 1);
    assert_eq!(p.fell_back_from[0].checkpoint.step, 2);
    assert!(
        p.fell_back_from[0].error.contains("SHA-256"),
        "{}",
        p.fell_back_from[0].error
    );
    same_tree(&d1, &out);
    // An explicit step never falls back.
    let e = ck
        .pull(
            Selector::Step(2),
            &local.path().join("o2"),
            false,
            &ctx(5),
            &opts(),
        )
        .await
        .expect_err("step 2");
    assert!(matches!(e, CkptError::Integrity { .. }), "{e}");
}

async fn concurrent_pushes_never_move_latest_backwards(env: Env) {
    let ck = Arc::new(Ckpt::new(&env.store, "run-r").expect("ckpt"));
    let local = tempfile::tempdir().expect("tmp");
    let steps: Vec<u64> = vec![5, 3, 8, 1, 7, 2, 6, 4];
    let dirs: Vec<_> = steps.iter().map(|s| make_ckpt(local.path(), *s)).collect();
    // Two writer processes of one job (the same writer name) racing.
    ck.acquire("job-7", &ctx(0)).await.expect("acquire");
    let mut tasks = Vec::new();
    for (i, (s, d)) in steps.iter().zip(dirs).enumerate() {
        let ck = ck.clone();
        let s = *s;
        tasks.push(tokio::spawn(async move {
            ck.push(&d, &req(s, "job-7", 100 + i as u64), &opts()).await
        }));
    }
    for t in tasks {
        t.await.expect("join").expect("push");
    }
    assert_eq!(ck.latest().await.expect("latest").map(|c| c.step), Some(8));
    // Along the chain, publishes of one epoch only ever go up.
    let mut last = 0;
    for g in ck.generations().await.expect("gens") {
        let r = ck.generation(g).await.expect("gen").expect("some");
        if r.kind == keel_ckpt::GenKind::Publish {
            let s = r.checkpoint.expect("ckpt").step;
            assert!(s > last, "generation {g} moved latest from {last} to {s}");
            last = s;
        }
    }
}

async fn fenced_writer_cannot_commit_or_publish(env: Env) {
    let ck = Ckpt::new(&env.store, "run-f").expect("ckpt");
    let local = tempfile::tempdir().expect("tmp");
    let old = ck
        .push(
            &make_ckpt(local.path(), 100),
            &req(100, "job-1", 1),
            &opts(),
        )
        .await
        .expect("push");
    assert_eq!(
        old.checkpoint,
        CkptRef {
            step: 100,
            epoch: 1
        }
    );
    // The job is requeued: the new incarnation takes the run over.
    let new = ck
        .acquire("job-1.requeue-1", &ctx(2))
        .await
        .expect("acquire");
    assert_eq!(new.epoch, 2);
    // Latest still names the old checkpoint, to resume from.
    assert_eq!(ck.latest().await.expect("latest"), Some(old.checkpoint));
    // The zombie keeps going: neither commit nor publish.
    let e = ck
        .push(
            &make_ckpt(local.path(), 200),
            &req(200, "job-1", 3),
            &opts(),
        )
        .await
        .expect_err("fenced");
    assert!(
        matches!(
            e,
            CkptError::Fenced {
                epoch: 1,
                by_epoch: 2,
                ..
            }
        ),
        "{e}"
    );
    assert!(ck.resolve(Selector::Step(200)).await.is_err());
    assert_eq!(ck.latest().await.expect("latest"), Some(old.checkpoint));
    // The successor resumes at an older step and publishes over the zombie.
    let r = ck
        .push(
            &make_ckpt(local.path(), 150),
            &req(150, "job-1.requeue-1", 4),
            &opts(),
        )
        .await
        .expect("push");
    assert!(matches!(r.published, Published::Latest { .. }));
    assert_eq!(
        ck.latest().await.expect("latest"),
        Some(CkptRef {
            step: 150,
            epoch: 2
        })
    );
    assert!(matches!(
        ck.acquire("job-1", &ctx(5)).await,
        Err(CkptError::Fenced { .. })
    ));
}

async fn gc_keeps_what_it_must_and_deletes_commit_first(env: Env) {
    let ck = Ckpt::new(&env.store, "run-g").expect("ckpt");
    let local = tempfile::tempdir().expect("tmp");
    for s in 1..=6u64 {
        ck.push(&make_ckpt(local.path(), s), &req(s, "w", s), &opts())
            .await
            .expect("push");
    }
    ck.pin(Selector::Step(2), "paper baseline", &ctx(50))
        .await
        .expect("pin");
    // Data of a push that died before its manifest: an orphan.
    ck.store()
        .put(
            "ckpt/00000000000000000007/e0000000001/data/dead/x.bin",
            vec![1u8; 10].into(),
        )
        .await
        .expect("put");
    let policy = GcPolicy {
        keep_last: Some(2),
        keep_best: Some((1, "loss".into(), Order::Max)),
        keep_every: None,
        grace_secs: 0,
    };
    let far_future = Context {
        now_unix: i64::MAX / 2,
        ..ctx(60)
    };
    let dry = ck.gc(&policy, false, &far_future).await.expect("dry");
    let deleted: Vec<u64> = dry.deleted.iter().map(|d| d.checkpoint.step).collect();
    // Kept: 5, 6 (last 2), 6 latest, 2 pinned, 1 (highest loss).
    assert_eq!(deleted, [3, 4]);
    assert_eq!(dry.orphans.len(), 1);
    assert_eq!(
        ck.list().await.expect("ls").len(),
        6,
        "dry run deletes nothing"
    );
    let done = ck.gc(&policy, true, &far_future).await.expect("apply");
    assert_eq!(done.deleted.len(), 2);
    let left: Vec<u64> = ck
        .list()
        .await
        .expect("ls")
        .iter()
        .map(|c| c.step)
        .collect();
    assert_eq!(left, [1, 2, 5, 6]);
    assert!(ck
        .store()
        .list("ckpt/00000000000000000003")
        .await
        .expect("ls")
        .is_empty());
    assert!(ck
        .store()
        .list("ckpt/00000000000000000007")
        .await
        .expect("ls")
        .is_empty());
    // A young orphan is left alone (grace period).
    ck.store()
        .put(
            "ckpt/00000000000000000008/e0000000001/data/young/x.bin",
            vec![1u8; 10].into(),
        )
        .await
        .expect("put");
    let now = Context {
        now_unix: unix_now(),
        ..ctx(70)
    };
    let g = ck
        .gc(
            &GcPolicy {
                grace_secs: 3600,
                ..GcPolicy::default()
            },
            true,
            &now,
        )
        .await
        .expect("gc");
    assert!(g.orphans.iter().all(|o| o.in_grace), "{g:?}");
    assert_eq!(
        ck.store()
            .list("ckpt/00000000000000000008")
            .await
            .expect("ls")
            .len(),
        1
    );
    let u = ck
        .unpin(Selector::Step(2), "baseline superseded", &ctx(71))
        .await
        .expect("unpin");
    assert_eq!(u.reason, "baseline superseded");
    assert_eq!(u.pin.reason, "paper baseline");
    // The removal left a record behind.
    assert_eq!(ck.store().list("unpins").await.expect("ls").len(), 1);
    assert!(matches!(
        ck.unpin(Selector::Step(2), "again", &ctx(72)).await,
        Err(CkptError::NotPinned { .. })
    ));
}

async fn gc_keeps_a_checkpoint_committed_but_not_yet_published(env: Env) {
    let ck = Ckpt::new(&env.store, "run-u").expect("ckpt");
    let local = tempfile::tempdir().expect("tmp");
    for s in 1..=3u64 {
        ck.push(&make_ckpt(local.path(), s), &req(s, "w", s), &opts())
            .await
            .expect("push");
    }
    // The state of a push that committed step 3 and has not yet moved
    // latest to it (or died in between): latest is step 2.
    let top = *ck.generations().await.expect("gens").last().expect("a gen");
    ck.store()
        .delete(&format!("latest/{top:020}.json"))
        .await
        .expect("delete");
    assert_eq!(ck.latest().await.expect("latest").map(|c| c.step), Some(2));
    let policy = GcPolicy {
        keep_every: Some(1000),
        ..GcPolicy::default()
    };
    let r = ck.gc(&policy, true, &ctx(10)).await.expect("gc");
    let deleted: Vec<u64> = r.deleted.iter().map(|d| d.checkpoint.step).collect();
    assert_eq!(deleted, [1]);
    let three = r
        .kept
        .iter()
        .find(|k| k.checkpoint.step == 3)
        .expect("step 3 kept");
    assert_eq!(three.reasons, ["newer than latest"]);
    ck.verify(Selector::Step(3), &opts()).await.expect("intact");
}

async fn a_checkpoint_pinned_while_gc_runs_is_never_deleted(env: Env) {
    let ck = Ckpt::new(&env.store, "run-p").expect("ckpt");
    let local = tempfile::tempdir().expect("tmp");
    const N: u64 = 12;
    for s in 1..=N {
        ck.push(&make_ckpt(local.path(), s), &req(s, "w", s), &opts())
            .await
            .expect("push");
    }
    let policy = GcPolicy {
        keep_last: Some(1),
        ..GcPolicy::default()
    };
    // gc deletes steps 1..N-1 while another task pins them, newest first
    // (the order gc does not go in), so the two meet somewhere.
    let gc = {
        let ck = ck.clone();
        tokio::spawn(async move { ck.gc(&policy, true, &ctx(100)).await })
    };
    let mut pinned = Vec::new();
    for s in (1..N).rev() {
        match ck.pin(Selector::Step(s), "keep", &ctx(200 + s)).await {
            Ok(_) => pinned.push(s),
            Err(CkptError::DeletedWhilePinning { .. } | CkptError::NoSuchStep { .. }) => {}
            Err(e) => panic!("pin {s}: {e}"),
        }
    }
    let report = gc.await.expect("join").expect("gc");
    // Whatever the interleaving: every pin that succeeded protects a whole
    // checkpoint, and nothing was reported both kept and deleted.
    for s in &pinned {
        ck.verify(Selector::Step(*s), &opts())
            .await
            .unwrap_or_else(|e| panic!("pinned step {s} damaged: {e}"));
    }
    for d in &report.deleted {
        assert!(!pinned.contains(&d.checkpoint.step), "{d:?} was pinned");
    }
    // A failed pin leaves no pin behind.
    let pins: Vec<u64> = ck
        .pins()
        .await
        .expect("pins")
        .iter()
        .map(|p| p.checkpoint.step)
        .collect();
    let mut want = pinned.clone();
    want.sort();
    assert_eq!(pins, want);
}

async fn watch_pushes_completed_and_survives_restart(env: Env) {
    let ck = Ckpt::new(&env.store, "run-w").expect("ckpt");
    let local = tempfile::tempdir().expect("tmp");
    make_ckpt(local.path(), 10);
    let partial = make_ckpt(local.path(), 20);
    std::fs::remove_file(partial.join(".metadata")).expect("rm");
    let mut w = keel_ckpt::watch::Watcher::new(ck.clone(), local.path(), None, "job-w".into());
    let ev = w.pass(&ctx(1), &opts()).await.expect("pass");
    assert_eq!(ev.len(), 1, "{ev:?}");
    assert_eq!(ck.latest().await.expect("latest").map(|c| c.step), Some(10));
    // DCP finishes step 20 by writing .metadata last.
    std::fs::write(partial.join(".metadata"), b"meta").expect("w");
    let ev = w.pass(&ctx(2), &opts()).await.expect("pass");
    assert_eq!(ev.len(), 1, "{ev:?}");
    // A restarted watcher uploads nothing again.
    let mut w2 = keel_ckpt::watch::Watcher::new(ck.clone(), local.path(), None, "job-w".into());
    let ev = w2.pass(&ctx(3), &opts()).await.expect("pass");
    assert!(ev.is_empty(), "{ev:?}");
    assert_eq!(ck.latest().await.expect("latest").map(|c| c.step), Some(20));
}

async fn watch_run_paces_its_passes_and_stops_when_told(env: Env) {
    use keel_ckpt::watch::{Pace, WatchEvent, WatchSummary, Watcher};
    let ck = Ckpt::new(&env.store, "run-p").expect("ckpt");
    let local = tempfile::tempdir().expect("tmp");
    make_ckpt(local.path(), 1);
    let mut w = Watcher::new(ck.clone(), local.path(), None, "job-p".into());
    let mut seen = Vec::new();
    let sum = w
        .run(
            Pace::Once,
            || ctx(1),
            &opts(),
            |ev| {
                seen.push(ev);
                true
            },
        )
        .await
        .expect("run");
    assert!(
        matches!(seen.as_slice(), [WatchEvent::Pushed { .. }]),
        "{seen:?}"
    );
    assert_eq!(
        sum,
        WatchSummary {
            passes: 1,
            pushed: 1,
            skipped: 0,
            failed: 0
        }
    );
    // Every 10 ms until the caller says stop: here after the pass that
    // pushes step 2, written when the third pass starts.
    let passes = std::sync::atomic::AtomicU64::new(0);
    let sum = w
        .run(
            Pace::Every(std::time::Duration::from_millis(10)),
            || {
                if passes.fetch_add(1, std::sync::atomic::Ordering::SeqCst) == 2 {
                    make_ckpt(local.path(), 2);
                }
                ctx(2)
            },
            &opts(),
            |ev| !matches!(ev, WatchEvent::Pushed { .. }),
        )
        .await
        .expect("run");
    assert_eq!(
        sum,
        WatchSummary {
            passes: 3,
            pushed: 1,
            skipped: 0,
            failed: 0
        }
    );
    assert_eq!(ck.latest().await.expect("latest").map(|c| c.step), Some(2));
    // A pass that fails as a whole ends the watch with its error.
    drop(local);
    let e = w
        .run(
            Pace::Every(std::time::Duration::from_millis(10)),
            || ctx(3),
            &opts(),
            |_| true,
        )
        .await
        .expect_err("the directory is gone");
    assert!(
        matches!(e, keel_ckpt::CkptError::NotADirectory { .. }),
        "{e}"
    );
}

async fn a_requeued_writer_skips_leftovers_and_pushes_a_retrained_step(env: Env) {
    let ck = Ckpt::new(&env.store, "run-r").expect("ckpt");
    let local = tempfile::tempdir().expect("tmp");
    let now = unix_now();
    let at = |t: i64, nonce: u64| Context {
        now_unix: t,
        ..ctx(nonce)
    };
    // Step 10 written a minute ago and pushed by the first incarnation.
    let dir = make_ckpt(local.path(), 10);
    let old = std::time::UNIX_EPOCH + std::time::Duration::from_secs((now - 60) as u64);
    for f in keel_ckpt::detect::list_files(&dir).expect("ls") {
        std::fs::File::options()
            .write(true)
            .open(&f.path)
            .and_then(|h| h.set_modified(old))
            .expect("mtime");
    }
    let mut w = keel_ckpt::watch::Watcher::new(ck.clone(), local.path(), None, "job-r".into());
    let ev = w.pass(&at(now - 30, 1), &opts()).await.expect("pass");
    assert!(
        matches!(ev[..], [keel_ckpt::watch::WatchEvent::Pushed { .. }]),
        "{ev:?}"
    );
    // The job is requeued: its new writer finds the same files on the
    // node and uploads nothing.
    let mut w2 =
        keel_ckpt::watch::Watcher::new(ck.clone(), local.path(), None, "job-r.requeue-1".into());
    let ev = w2.pass(&at(now - 20, 2), &opts()).await.expect("pass");
    assert!(
        matches!(
            ev[..],
            [keel_ckpt::watch::WatchEvent::Skipped { step: 10, .. }]
        ),
        "{ev:?}"
    );
    // It fell back and trained step 10 again: new files, pushed as its own.
    let mut w3 =
        keel_ckpt::watch::Watcher::new(ck.clone(), local.path(), None, "job-r.requeue-1".into());
    std::fs::write(dir.join("__0_0.distcp"), content(11, "retrained", 200_000)).expect("w");
    let ev = w3.pass(&at(now, 3), &opts()).await.expect("pass");
    let [keel_ckpt::watch::WatchEvent::Pushed { report, .. }] = &ev[..] else {
        panic!("{ev:?}");
    };
    assert_eq!(report.checkpoint, CkptRef { step: 10, epoch: 2 });
    assert_eq!(ck.latest().await.expect("latest"), Some(report.checkpoint));
}

async fn bad_input_changes_nothing(env: Env) {
    let ck = Ckpt::new(&env.store, "run-b").expect("ckpt");
    let local = tempfile::tempdir().expect("tmp");
    let e = ck
        .push(&local.path().join("missing"), &req(1, "w", 1), &opts())
        .await
        .expect_err("missing");
    assert!(matches!(e, CkptError::LocalDir { .. }), "{e}");
    let empty = local.path().join("empty");
    std::fs::create_dir(&empty).expect("mkdir");
    let e = ck
        .push(&empty, &req(1, "w", 1), &opts())
        .await
        .expect_err("empty");
    assert!(matches!(e, CkptError::EmptyCheckpoint { .. }), "{e}");
    assert!(
        ck.store().list("").await.expect("ls").is_empty(),
        "nothing written"
    );
    assert!(Ckpt::new(&env.store, "../x").is_err());
}

async fn gc_grace_periods_at_the_limits_of_time(env: Env) {
    let ck = Ckpt::new(&env.store, "run-g").expect("ckpt");
    ck.store()
        .put(
            "ckpt/00000000000000000003/e0000000001/data/dead/x.bin",
            vec![1u8; 10].into(),
        )
        .await
        .expect("put");
    let now = Context {
        now_unix: unix_now(),
        ..ctx(80)
    };
    for (grace_secs, now_unix, in_grace) in [
        (i64::MAX, now.now_unix, true),
        (i64::MAX, -1, true),
        (i64::MIN, now.now_unix, false),
        (-1, i64::MAX, false),
    ] {
        let policy = GcPolicy {
            grace_secs,
            ..GcPolicy::default()
        };
        let at = Context {
            now_unix,
            ..now.clone()
        };
        let g = ck.gc(&policy, false, &at).await.expect("gc");
        assert_eq!(g.orphans.len(), 1, "{g:?}");
        assert_eq!(
            g.orphans[0].in_grace, in_grace,
            "grace {grace_secs} at {now_unix}"
        );
    }
    assert_eq!(ck.store().list("").await.expect("ls").len(), 1, "dry runs");
}

macro_rules! suite {
    ($($name:ident),* $(,)?) => {
        mod file {
            $( #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
               async fn $name() { super::$name(super::file_env()).await } )*
        }
        mod azurite {
            $( #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
               #[ignore = "needs Azurite: scripts/test starts one"]
               async fn $name() {
                   super::$name(super::service_env(keel_testkit::objects::ObjectService::azurite())).await
               } )*
        }
        mod s3 {
            $( #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
               #[ignore = "needs an S3 server: scripts/test starts one"]
               async fn $name() {
                   super::$name(super::service_env(keel_testkit::objects::ObjectService::s3())).await
               } )*
        }
    };
}

suite!(
    push_latest_verify_pull,
    corruption_is_detected_and_pull_falls_back,
    concurrent_pushes_never_move_latest_backwards,
    fenced_writer_cannot_commit_or_publish,
    gc_keeps_what_it_must_and_deletes_commit_first,
    watch_pushes_completed_and_survives_restart,
    watch_run_paces_its_passes_and_stops_when_told,
    bad_input_changes_nothing,
    gc_grace_periods_at_the_limits_of_time,
    gc_keeps_a_checkpoint_committed_but_not_yet_published,
    a_checkpoint_pinned_while_gc_runs_is_never_deleted,
    a_requeued_writer_skips_leftovers_and_pushes_a_retrained_step,
);
