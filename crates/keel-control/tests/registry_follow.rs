//! The gateway follows the registry's aliases: two test backends serve
//! versions 1 and 2 of a model registered in a real registry (its HTTP API
//! over a socket, SQLite in a file); moving the alias through MLflow's API
//! or rolling it back with a second registry handle (as `keel model
//! rollback` does) reaches the gateway within 2 s; with the registry down
//! the gateway keeps its last routing and counts the failed polls.

#[path = "../../keel-gateway/tests/common/mod.rs"]
mod common;

use std::sync::atomic::AtomicU32;
use std::sync::Arc;
use std::time::{Duration, Instant};

use common::{add_key, chat_body, head, model, Running, TestBackend};
use keel_control::registry_follow::{Follow, FollowError, Follower};
use keel_control::registry_source::{
    ModelSource, RegistryClient, RegistrySourceError, BACKEND_TAG,
};
use keel_gateway::GatewayConfig;
use keel_registry::http::{router, serve, ServeOptions};
use keel_registry::{FixedClock, NewVersion, Registry, Role};
use keel_testkit::http;

struct RegistryServer {
    rt: tokio::runtime::Runtime,
    addr: std::net::SocketAddr,
    stop: Option<tokio::sync::oneshot::Sender<()>>,
    task: Option<tokio::task::JoinHandle<std::io::Result<()>>>,
}

impl RegistryServer {
    fn start(reg: Registry) -> Self {
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .enable_all()
            .build()
            .expect("runtime");
        let (tx, rx) = tokio::sync::oneshot::channel::<()>();
        let (addr, task) = rt.block_on(async {
            let l = tokio::net::TcpListener::bind("127.0.0.1:0")
                .await
                .expect("bind");
            let addr = l.local_addr().expect("addr");
            let app = router(reg, ServeOptions::default());
            (
                addr,
                tokio::spawn(serve(l, app, async {
                    let _ = rx.await;
                })),
            )
        });
        RegistryServer {
            rt,
            addr,
            stop: Some(tx),
            task: Some(task),
        }
    }

    fn stop(&mut self) {
        if let Some(tx) = self.stop.take() {
            let _ = tx.send(());
        }
        if let Some(t) = self.task.take() {
            let _ = self.rt.block_on(t);
        }
    }
}

fn clock() -> Arc<FixedClock> {
    Arc::new(FixedClock(1_700_000_000_000))
}

/// Which backend answered: the test backend puts its name there.
fn served_by(gw: &Running, key: &str) -> String {
    let r = gw.chat(key, chat_body("chat"));
    assert_eq!(r.status, 200, "{}", r.text());
    r.json()["system_fingerprint"]
        .as_str()
        .unwrap_or_default()
        .to_owned()
}

/// Sends requests until every one of 5 in a row is served by `name`;
/// returns how long that took.
fn wait_for(gw: &Running, key: &str, name: &str, limit: Duration) -> Duration {
    let t0 = Instant::now();
    loop {
        if (0..5).all(|_| served_by(gw, key) == name) {
            return t0.elapsed();
        }
        assert!(
            t0.elapsed() < limit,
            "still not served by {name} after {limit:?}"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
}

#[test]
fn the_gateway_follows_alias_changes_and_survives_the_registry_going_down() {
    let dir = tempfile::tempdir().expect("tmp");
    let b1 = TestBackend::start(&["--name", "v1"]);
    let b2 = TestBackend::start(&["--name", "v2"]);

    let db = dir.path().join("registry.db");
    let mut reg = Registry::open(&db, clock()).expect("registry");
    let reader = keel_registry::auth::new_secret();
    let writer = keel_registry::auth::new_secret();
    reg.create_api_key("admin", "gateway", Role::Read, &reader)
        .expect("key");
    reg.create_api_key("admin", "ops", Role::Write, &writer)
        .expect("key");
    for b in [&b1, &b2] {
        let v = reg
            .register_version(
                "ci",
                &NewVersion {
                    model: "chat".into(),
                    source: "s3://b/chat".into(),
                    create_model: true,
                    ..Default::default()
                },
                None,
            )
            .expect("version");
        reg.set_version_tag("ci", "chat", v.version, BACKEND_TAG, Some(&b.url()))
            .expect("tag");
    }
    reg.set_alias("ci", "chat", "production", 1, "first release")
        .expect("alias");
    drop(reg);
    let mut registry = RegistryServer::start(Registry::open(&db, clock()).expect("registry"));

    // The file's deployment is the template: its URL is replaced.
    let config = format!(
        "{}{}",
        head(dir.path()),
        model("chat", "", &[("template", "http://127.0.0.1:9".into(), 1)])
    );
    let gw = Running::start(dir.path(), &config);
    let (_, key) = add_key(dir.path(), "alice", &["user"], None);
    let base = GatewayConfig::load(&dir.path().join("gateway.toml")).expect("config");
    let follow = Follow {
        model: "chat".into(),
        source: ModelSource {
            model: "chat".into(),
            stable_alias: "production".into(),
            canary_alias: Some("canary".into()),
            require_signature: false,
            allowed_backends: Vec::new(),
        },
        canary_percent: Arc::new(AtomicU32::new(0)),
        applied_stable: Default::default(),
    };
    let registry_url = format!("http://{}", registry.addr);
    let (stop_tx, stop_rx) = tokio::sync::oneshot::channel::<()>();
    gw.rt.block_on(async {
        let client = RegistryClient::new(&registry_url, &reader).expect("client");
        let (follower, cfg) = Follower::new(client, vec![follow], base)
            .await
            .expect("resolves");
        gw.gw.apply(cfg).await.expect("apply");
        tokio::spawn(follower.run(gw.gw.clone(), Duration::from_secs(1), async {
            let _ = stop_rx.await;
        }));
    });
    assert_eq!(served_by(&gw, &key), "v1");

    // Moved through MLflow's API.
    let moved = http::request(
        registry.addr,
        "POST",
        "/api/2.0/mlflow/registered-models/alias",
        &[
            ("Authorization", &format!("Bearer {writer}")),
            ("Content-Type", "application/json"),
        ],
        br#"{"name":"chat","alias":"production","version":"2"}"#,
    )
    .expect("set alias");
    assert_eq!(moved.status, 200, "{}", moved.text());
    let took = wait_for(&gw, &key, "v2", Duration::from_secs(5));
    assert!(took < Duration::from_secs(2), "followed after {took:?}");

    // Rolled back by another registry handle on the same database.
    let mut ops = Registry::open(&db, clock()).expect("registry");
    ops.rollback("ops", "chat", "production", "v2 answers badly")
        .expect("rollback");
    let took = wait_for(&gw, &key, "v1", Duration::from_secs(5));
    assert!(took < Duration::from_secs(2), "followed after {took:?}");

    // An alias moved to a version with no backend is refused, the last
    // routing kept.
    let v3 = ops
        .register_version(
            "ci",
            &NewVersion {
                model: "chat".into(),
                source: "s3://b/chat3".into(),
                ..Default::default()
            },
            None,
        )
        .expect("v3");
    ops.set_alias("ops", "chat", "production", v3.version, "no backend")
        .expect("alias");
    std::thread::sleep(Duration::from_millis(2500));
    assert_eq!(served_by(&gw, &key), "v1");
    assert!(
        gw.metrics_text()
            .contains("keel_errors_total{route=\"registry\",kind=\"registry_refused\"}"),
        "{}",
        gw.metrics_text()
    );
    ops.set_alias("ops", "chat", "production", 1, "back")
        .expect("alias");

    // The registry goes down: the last known routing stays.
    registry.stop();
    std::thread::sleep(Duration::from_millis(2500));
    for _ in 0..5 {
        assert_eq!(served_by(&gw, &key), "v1");
    }
    let m = gw.metrics_text();
    assert!(
        m.contains("keel_errors_total{route=\"registry\",kind=\"registry_unreachable\"}"),
        "{m}"
    );
    let _ = stop_tx.send(());
    gw.stop();
}

#[test]
fn bad_input_at_start_is_an_error_not_a_fallback() {
    let dir = tempfile::tempdir().expect("tmp");
    let mut reg = Registry::open_in_memory(clock()).expect("registry");
    let reader = keel_registry::auth::new_secret();
    reg.create_api_key("admin", "gateway", Role::Read, &reader)
        .expect("key");
    reg.register_version(
        "ci",
        &NewVersion {
            model: "chat".into(),
            source: "s3://b/chat".into(),
            create_model: true,
            ..Default::default()
        },
        None,
    )
    .expect("version");
    reg.set_alias("ci", "chat", "production", 1, "first")
        .expect("alias");
    let registry = RegistryServer::start(reg);
    let config = format!(
        "{}{}",
        head(dir.path()),
        model("chat", "", &[("template", "http://127.0.0.1:9".into(), 1)])
    );
    std::fs::write(dir.path().join("gateway.toml"), &config).expect("write");
    let base = GatewayConfig::load(&dir.path().join("gateway.toml")).expect("config");
    let url = format!("http://{}", registry.addr);
    let start = |registry_model: &str, gateway_model: &str, key: &str| {
        let client = RegistryClient::new(&url, key).expect("client");
        let follow = Follow {
            model: gateway_model.into(),
            source: ModelSource {
                model: registry_model.into(),
                stable_alias: "production".into(),
                canary_alias: None,
                require_signature: false,
                allowed_backends: Vec::new(),
            },
            canary_percent: Arc::new(AtomicU32::new(0)),
            applied_stable: Default::default(),
        };
        registry
            .rt
            .block_on(Follower::new(client, vec![follow], base.clone()))
            .map(|_| ())
            .expect_err("refused")
    };
    let e = start("missing", "chat", &reader);
    assert!(
        matches!(
            &e,
            FollowError::Source {
                source: RegistrySourceError::ModelNotFound { .. },
                ..
            }
        ),
        "{e}"
    );
    // Version 1 has no keel.backend tag.
    let e = start("chat", "chat", &reader);
    assert!(
        matches!(
            &e,
            FollowError::Source {
                source: RegistrySourceError::NoBackend { version: 1, .. },
                ..
            }
        ),
        "{e}"
    );
    let e = start("chat", "chat", "keel_unknown-key");
    assert!(
        matches!(
            &e,
            FollowError::Source {
                source: RegistrySourceError::Unauthorized { .. },
                ..
            }
        ),
        "{e}"
    );
    assert_eq!(
        e.to_string(),
        "gateway model \"chat\" follows registry model \"chat\""
    );
}
