//! The HTTP API over a real socket: every route rejects a missing, wrong
//! or revoked credential; read keys cannot write; the bearer token from
//! the configuration works; keel's read API returns versioned JSON. The
//! tests of what the API answers run on both stores (`NAME::sqlite`,
//! `NAME::postgres`).

mod common;

use std::sync::Arc;

use common::Store;

use keel_registry::http::{router, serve, serve_with, ConnectionLimits, ServeOptions};
use keel_registry::{FixedClock, NewVersion, Registry, Role};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

on_both_stores_async!(
    every_route_is_authenticated_and_roles_hold,
    searches_order_and_page_as_mlflow,
    every_error_has_mlflows_shape_and_code,
    every_list_is_paged_and_every_answer_is_capped,
);

/// Every route with a method and a body that would succeed when allowed.
const ROUTES: &[(&str, &str, &str)] = &[
    ("GET", "/api/v1/models", ""),
    ("GET", "/api/v1/models/get?name=m", ""),
    ("GET", "/api/v1/versions?name=m", ""),
    ("GET", "/api/v1/versions/get?name=m&version=1", ""),
    ("GET", "/api/v1/aliases?name=m", ""),
    ("GET", "/api/v1/history?name=m", ""),
    ("GET", "/api/v1/audit/verify", ""),
    (
        "POST",
        "/api/2.0/mlflow/registered-models/create",
        r#"{"name":"new"}"#,
    ),
    ("GET", "/api/2.0/mlflow/registered-models/get?name=m", ""),
    ("GET", "/api/2.0/mlflow/registered-models/search", ""),
    (
        "DELETE",
        "/api/2.0/mlflow/registered-models/delete",
        r#"{"name":"new"}"#,
    ),
    (
        "POST",
        "/api/2.0/mlflow/registered-models/set-tag",
        r#"{"name":"m","key":"k","value":"v"}"#,
    ),
    (
        "DELETE",
        "/api/2.0/mlflow/registered-models/delete-tag",
        r#"{"name":"m","key":"k"}"#,
    ),
    (
        "POST",
        "/api/2.0/mlflow/registered-models/alias",
        r#"{"name":"m","alias":"a","version":"1"}"#,
    ),
    (
        "GET",
        "/api/2.0/mlflow/registered-models/alias?name=m&alias=a",
        "",
    ),
    (
        "DELETE",
        "/api/2.0/mlflow/registered-models/alias",
        r#"{"name":"m","alias":"a"}"#,
    ),
    (
        "POST",
        "/api/2.0/mlflow/model-versions/create",
        r#"{"name":"m","source":"s3://b/x"}"#,
    ),
    (
        "GET",
        "/api/2.0/mlflow/model-versions/get?name=m&version=1",
        "",
    ),
    (
        "GET",
        "/api/2.0/mlflow/model-versions/search?filter=name%3D%27m%27",
        "",
    ),
    (
        "GET",
        "/api/2.0/mlflow/model-versions/get-download-uri?name=m&version=1",
        "",
    ),
    (
        "PATCH",
        "/api/2.0/mlflow/registered-models/update",
        r#"{"name":"m","description":"d"}"#,
    ),
    (
        "PATCH",
        "/api/2.0/mlflow/model-versions/update",
        r#"{"name":"m","version":"1","description":"d"}"#,
    ),
    (
        "POST",
        "/api/2.0/mlflow/registered-models/get-latest-versions",
        r#"{"name":"m"}"#,
    ),
    (
        "GET",
        "/api/2.0/mlflow/registered-models/get-latest-versions?name=m&stages=None",
        "",
    ),
    (
        "POST",
        "/api/2.0/mlflow/model-versions/set-tag",
        r#"{"name":"m","version":"1","key":"k","value":"v"}"#,
    ),
    (
        "DELETE",
        "/api/2.0/mlflow/model-versions/delete-tag",
        r#"{"name":"m","version":"1","key":"k"}"#,
    ),
];

async fn call(
    addr: std::net::SocketAddr,
    method: &str,
    path: &str,
    body: &str,
    auth: Option<&str>,
) -> (u16, String) {
    let mut s = tokio::net::TcpStream::connect(addr).await.expect("connect");
    let mut req = format!("{method} {path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n");
    if let Some(a) = auth {
        req.push_str(&format!("{a}\r\n"));
    }
    if !body.is_empty() {
        req.push_str(&format!(
            "Content-Type: application/json\r\nContent-Length: {}\r\n",
            body.len()
        ));
    }
    req.push_str("\r\n");
    req.push_str(body);
    s.write_all(req.as_bytes()).await.expect("write");
    let mut resp = String::new();
    s.read_to_string(&mut resp).await.expect("read");
    let status = resp.get(9..12).and_then(|c| c.parse().ok()).unwrap_or(0);
    let body = resp
        .split_once("\r\n\r\n")
        .map(|(_, b)| b.to_owned())
        .unwrap_or_default();
    (status, body)
}

async fn every_route_is_authenticated_and_roles_hold(store: Store) {
    let mut reg = store.open(Arc::new(FixedClock(1_700_000_000_000)));
    let writer = keel_registry::auth::new_secret();
    let reader = keel_registry::auth::new_secret();
    let revoked = keel_registry::auth::new_secret();
    reg.create_api_key("admin", "writer", Role::Write, &writer)
        .expect("k");
    reg.create_api_key("admin", "reader", Role::Read, &reader)
        .expect("k");
    reg.create_api_key("admin", "old", Role::Write, &revoked)
        .expect("k");
    reg.revoke_api_key("admin", "old").expect("revoke");
    let new = NewVersion {
        model: "m".into(),
        source: "s3://b/m".into(),
        create_model: true,
        ..Default::default()
    };
    reg.register_version("ci", &new, None).expect("v1");
    let token = "a-bearer-token-from-the-config-file-0123456789";
    let app = router(
        reg,
        ServeOptions {
            token_sha256: Some(keel_registry::auth::secret_hash(token)),
            max_body_bytes: 4096,
            ..Default::default()
        },
    );
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind");
    let addr = listener.local_addr().expect("addr");
    let (tx, rx) = tokio::sync::oneshot::channel::<()>();
    let server = tokio::spawn(serve(listener, app, async {
        let _ = rx.await;
    }));

    assert_eq!(call(addr, "GET", "/health", "", None).await.0, 200);
    let bad = [
        None,
        Some("Authorization: Bearer keel_not-a-key".to_owned()),
        Some(format!("Authorization: Bearer {revoked}")),
        Some(format!("Authorization: Basic {writer}")),
        Some("api-key: ".to_owned()),
    ];
    for (method, path, body) in ROUTES {
        for auth in &bad {
            let (status, text) = call(addr, method, path, body, auth.as_deref()).await;
            assert_eq!(status, 401, "{method} {path} with {auth:?}: {text}");
            assert!(!text.contains("keel_"), "{text}");
        }
        let (status, text) = call(
            addr,
            method,
            path,
            body,
            Some(&format!("api-key: {reader}")),
        )
        .await;
        // get-latest-versions reads, whatever its method.
        if *method == "GET" || path.ends_with("get-latest-versions") {
            // Allowed: found, or not there yet (a missing alias is 400).
            assert!(
                status == 200 || status == 404 || (status == 400 && text.contains("alias")),
                "{method} {path} read: {status} {text}"
            );
        } else {
            assert_eq!(status, 403, "{method} {path} read: {text}");
        }
    }
    // Writers go through in order (create, tag, alias, ...).
    for (method, path, body) in ROUTES {
        let auth = if path.contains("set-tag") {
            format!("Authorization: Bearer {token}")
        } else {
            format!("Authorization: Bearer {writer}")
        };
        let (status, text) = call(addr, method, path, body, Some(&auth)).await;
        assert_eq!(status, 200, "{method} {path}: {text}");
    }
    // Errors carry MLflow's codes and no internals.
    let auth = format!("api-key: {writer}");
    let (s, t) = call(
        addr,
        "GET",
        "/api/2.0/mlflow/registered-models/get?name=nope",
        "",
        Some(&auth),
    )
    .await;
    assert_eq!(s, 404);
    assert!(t.contains("RESOURCE_DOES_NOT_EXIST"), "{t}");
    let (s, t) = call(
        addr,
        "POST",
        "/api/2.0/mlflow/registered-models/create",
        r#"{"name":"m"}"#,
        Some(&auth),
    )
    .await;
    assert_eq!(s, 400);
    assert!(t.contains("RESOURCE_ALREADY_EXISTS"), "{t}");
    let (s, _) = call(
        addr,
        "POST",
        "/api/2.0/mlflow/registered-models/create",
        "{not json",
        Some(&auth),
    )
    .await;
    assert!((400..500).contains(&s), "{s}");
    let big = format!(r#"{{"name":"{}"}}"#, "x".repeat(10_000));
    let (s, _) = call(
        addr,
        "POST",
        "/api/2.0/mlflow/registered-models/create",
        &big,
        Some(&auth),
    )
    .await;
    assert_eq!(s, 413);
    let (s, t) = call(
        addr,
        "GET",
        "/api/2.0/mlflow/model-versions/get?name=m&version=abc",
        "",
        Some(&auth),
    )
    .await;
    assert_eq!(s, 400, "{t}");
    // keel's read API: versioned JSON, the alias history with its hashes.
    let (s, t) = call(addr, "GET", "/api/v1/history?name=m", "", Some(&auth)).await;
    assert_eq!(s, 200);
    let v: serde_json::Value = serde_json::from_str(&t).expect("json");
    assert_eq!(v["version"], 1);
    assert_eq!(v["events"].as_array().map(Vec::len), Some(2), "{v}");
    assert_eq!(v["events"][0]["actor"], "key:writer");
    let (_, t) = call(addr, "GET", "/api/v1/audit/verify", "", Some(&auth)).await;
    assert!(t.contains("\"ok\":true"), "{t}");
    let _ = tx.send(());
    server.await.expect("join").expect("serve");
}

/// Serves `reg` on a free port: its address and a sender that stops it.
async fn start(reg: Registry) -> (std::net::SocketAddr, tokio::sync::oneshot::Sender<()>) {
    let app = router(reg, ServeOptions::default());
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind");
    let addr = listener.local_addr().expect("addr");
    let (tx, rx) = tokio::sync::oneshot::channel::<()>();
    tokio::spawn(serve(listener, app, async {
        let _ = rx.await;
    }));
    (addr, tx)
}

fn json(text: &str) -> serde_json::Value {
    serde_json::from_str(text).unwrap_or_else(|e| panic!("{e}: {text}"))
}

fn versions_of(v: &serde_json::Value) -> Vec<String> {
    v["model_versions"]
        .as_array()
        .map(|a| {
            a.iter()
                .map(|v| {
                    format!(
                        "{}:{}",
                        v["name"].as_str().unwrap_or(""),
                        v["version"].as_str().unwrap_or("")
                    )
                })
                .collect()
        })
        .unwrap_or_default()
}

async fn searches_order_and_page_as_mlflow(store: Store) {
    let mut reg = store.open(Arc::new(FixedClock(1_700_000_000_000)));
    let key = keel_registry::auth::new_secret();
    reg.create_api_key("admin", "k", Role::Read, &key)
        .expect("k");
    for (model, n) in [("b", 12), ("a", 3)] {
        for i in 0..n {
            let new = NewVersion {
                model: model.into(),
                source: "s3://b/m".into(),
                create_model: true,
                lineage: keel_registry::Lineage {
                    run_id: Some(format!("run-{}", i % 3)),
                    ..Default::default()
                },
                tags: vec![keel_registry::Tag {
                    key: "i".into(),
                    value: i.to_string(),
                }],
                ..Default::default()
            };
            reg.register_version("ci", &new, None).expect("v");
        }
    }
    reg.set_alias("ci", "b", "champion", 5, "test")
        .expect("alias");
    reg.set_alias("ci", "b", "shadow", 5, "test")
        .expect("alias");
    let (addr, stop) = start(reg).await;
    let auth = format!("api-key: {key}");
    let get = |path: String| {
        let auth = auth.clone();
        async move { call(addr, "GET", &path, "", Some(&auth)).await }
    };
    let m = "/api/2.0/mlflow";
    // The common idiom: the newest version of a model.
    let (s, t) = get(format!(
        "{m}/model-versions/search?filter=name%3D%27b%27&order_by=version_number+DESC&max_results=1"
    ))
    .await;
    assert_eq!(s, 200, "{t}");
    assert_eq!(versions_of(&json(&t)), ["b:12"]);
    // Name and run together (narrowed in the database), and the run alone;
    // each version of a page carries its own tags and aliases.
    let (s, t) = get(format!(
        "{m}/model-versions/search?filter=name%3D%27b%27+AND+run_id%3D%27run-1%27&order_by=version_number+ASC"
    ))
    .await;
    assert_eq!(s, 200, "{t}");
    let v = json(&t);
    assert_eq!(versions_of(&v), ["b:2", "b:5", "b:8", "b:11"]);
    let page = v["model_versions"].as_array().expect("versions");
    assert_eq!(page[1]["run_id"], "run-1", "{t}");
    assert_eq!(
        page[1]["aliases"],
        serde_json::json!(["champion", "shadow"]),
        "{t}"
    );
    assert_eq!(page[1]["tags"][0]["value"], "4", "{t}");
    assert_eq!(page[2]["aliases"], serde_json::json!([]), "{t}");
    assert_eq!(page[2]["tags"][0]["value"], "7", "{t}");
    let (_, t) = get(format!(
        "{m}/model-versions/search?filter=run_id%3D%27run-2%27&order_by=name+ASC&order_by=version_number+ASC"
    ))
    .await;
    assert_eq!(versions_of(&json(&t)), ["a:3", "b:3", "b:6", "b:9", "b:12"]);
    // MLflow's default (one clock tick here): name ascending, newest first.
    let (_, t) = get(format!("{m}/model-versions/search?max_results=4")).await;
    assert_eq!(versions_of(&json(&t)), ["a:3", "a:2", "a:1", "b:12"]);
    // Two keys, backquoted; pages follow the order.
    let mut seen = Vec::new();
    let mut token = String::new();
    loop {
        let (_, t) = get(format!(
            "{m}/model-versions/search?order_by=%60name%60+DESC&order_by=version_number+ASC&max_results=5&page_token={token}"
        ))
        .await;
        let v = json(&t);
        seen.extend(versions_of(&v));
        match v["next_page_token"].as_str() {
            Some(n) => token = n.to_owned(),
            None => break,
        }
    }
    let want: Vec<String> = (1..=12)
        .map(|n| format!("b:{n}"))
        .chain((1..=3).map(|n| format!("a:{n}")))
        .collect();
    assert_eq!(seen, want);
    let (_, t) = get(format!("{m}/registered-models/search?order_by=name+DESC")).await;
    let v = json(&t);
    let names: Vec<&str> = v["registered_models"]
        .as_array()
        .expect("models")
        .iter()
        .filter_map(|m| m["name"].as_str())
        .collect();
    assert_eq!(names, ["b", "a"]);
    // Unknown keys, directions, duplicates and out-of-bounds pages are
    // refused in MLflow's shape.
    for q in [
        "model-versions/search?order_by=size",
        "model-versions/search?order_by=name+UP",
        "model-versions/search?order_by=name&order_by=name+DESC",
        "model-versions/search?max_results=0",
        "model-versions/search?max_results=-3",
        "model-versions/search?max_results=200001",
        "model-versions/search?max_results=many",
        "registered-models/search?max_results=1001",
        "registered-models/search?order_by=version_number",
    ] {
        let (s, t) = get(format!("{m}/{q}")).await;
        assert_eq!(s, 400, "{q}: {t}");
        assert_eq!(json(&t)["error_code"], "INVALID_PARAMETER_VALUE", "{q}");
    }
    let (s, _) = get(format!("{m}/model-versions/search?max_results=200000")).await;
    assert_eq!(s, 200);
    let _ = stop.send(());
}

/// Every error the MLflow client can see is `{"error_code", "message"}`
/// with MLflow's code and status, the extractors' own rejections included.
async fn every_error_has_mlflows_shape_and_code(store: Store) {
    let mut reg = store.open(Arc::new(FixedClock(1_700_000_000_000)));
    let key = keel_registry::auth::new_secret();
    reg.create_api_key("admin", "k", Role::Write, &key)
        .expect("k");
    let new = NewVersion {
        model: "m".into(),
        source: "s3://b/m".into(),
        create_model: true,
        ..Default::default()
    };
    reg.register_version("ci", &new, None).expect("v1");
    let app = router(
        reg,
        ServeOptions {
            max_body_bytes: 4096,
            ..Default::default()
        },
    );
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind");
    let addr = listener.local_addr().expect("addr");
    let (tx, rx) = tokio::sync::oneshot::channel::<()>();
    tokio::spawn(serve(listener, app, async {
        let _ = rx.await;
    }));
    let auth = format!("api-key: {key}");
    let m = "/api/2.0/mlflow";
    let big = format!(r#"{{"name":"{}"}}"#, "x".repeat(10_000));
    // A body over the limit is not read to its end: the answer says the
    // connection closes, so a pooling client does not reuse it.
    {
        let mut s = tokio::net::TcpStream::connect(addr).await.expect("connect");
        let req = format!(
            "POST {m}/registered-models/create HTTP/1.1\r\nHost: x\r\n{auth}\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n{big}",
            big.len()
        );
        s.write_all(req.as_bytes()).await.expect("write");
        let mut resp = Vec::new();
        let _ = s.read_to_end(&mut resp).await;
        let head = String::from_utf8_lossy(&resp).to_ascii_lowercase();
        assert!(head.starts_with("http/1.1 413"), "{head}");
        assert!(head.contains("\r\nconnection: close\r\n"), "{head}");
    }
    let cases: Vec<(&str, String, String, u16, &str)> = vec![
        // 413: a body over the limit.
        (
            "POST",
            format!("{m}/registered-models/create"),
            big,
            413,
            "INVALID_PARAMETER_VALUE",
        ),
        // 400: not JSON.
        (
            "POST",
            format!("{m}/registered-models/create"),
            "{not json".into(),
            400,
            "INVALID_PARAMETER_VALUE",
        ),
        // 422 -> 400: JSON of the wrong shape.
        (
            "POST",
            format!("{m}/registered-models/create"),
            r#"{"name": 7}"#.into(),
            400,
            "INVALID_PARAMETER_VALUE",
        ),
        (
            "POST",
            format!("{m}/registered-models/create"),
            "{}".into(),
            400,
            "INVALID_PARAMETER_VALUE",
        ),
        // Query strings: a missing or malformed parameter.
        (
            "GET",
            format!("{m}/registered-models/get"),
            String::new(),
            400,
            "INVALID_PARAMETER_VALUE",
        ),
        (
            "GET",
            format!("{m}/model-versions/get?name=m"),
            String::new(),
            400,
            "INVALID_PARAMETER_VALUE",
        ),
        (
            "GET",
            format!("{m}/model-versions/get?name=m&version=%FF%FE"),
            String::new(),
            400,
            "INVALID_PARAMETER_VALUE",
        ),
        (
            "GET",
            format!("{m}/registered-models/alias?name=m"),
            String::new(),
            400,
            "INVALID_PARAMETER_VALUE",
        ),
        // MLflow's codes: a missing alias is a bad parameter, a missing
        // version or model does not exist, a duplicate model exists.
        (
            "GET",
            format!("{m}/registered-models/alias?name=m&alias=prod"),
            String::new(),
            400,
            "INVALID_PARAMETER_VALUE",
        ),
        (
            "GET",
            format!("{m}/model-versions/get?name=m&version=9"),
            String::new(),
            404,
            "RESOURCE_DOES_NOT_EXIST",
        ),
        (
            "GET",
            format!("{m}/registered-models/get?name=nope"),
            String::new(),
            404,
            "RESOURCE_DOES_NOT_EXIST",
        ),
        (
            "POST",
            format!("{m}/registered-models/create"),
            r#"{"name":"m"}"#.into(),
            400,
            "RESOURCE_ALREADY_EXISTS",
        ),
        // Names MLflow's client cannot address.
        (
            "POST",
            format!("{m}/registered-models/create"),
            r#"{"name":"team/m"}"#.into(),
            400,
            "INVALID_PARAMETER_VALUE",
        ),
        (
            "POST",
            format!("{m}/registered-models/create"),
            r#"{"name":"a:b"}"#.into(),
            400,
            "INVALID_PARAMETER_VALUE",
        ),
        // Long bad input is quoted only in part.
        (
            "GET",
            format!("{m}/model-versions/search?filter={}", "x".repeat(5000)),
            String::new(),
            400,
            "INVALID_PARAMETER_VALUE",
        ),
        (
            "GET",
            format!(
                "{m}/model-versions/search?filter=name+IN+%28%27{}%27%29",
                "y".repeat(5000)
            ),
            String::new(),
            400,
            "INVALID_PARAMETER_VALUE",
        ),
        (
            "GET",
            format!("{m}/model-versions/get?name=m&version={}", "9".repeat(3000)),
            String::new(),
            400,
            "INVALID_PARAMETER_VALUE",
        ),
        (
            "POST",
            format!("{m}/registered-models/set-tag"),
            format!(r#"{{"name":"m","key":"{}","value":"v"}}"#, "k".repeat(3000)),
            400,
            "INVALID_PARAMETER_VALUE",
        ),
        (
            "POST",
            format!("{m}/registered-models/alias"),
            format!(
                r#"{{"name":"m","alias":"{}","version":"1"}}"#,
                "a".repeat(3000)
            ),
            400,
            "INVALID_PARAMETER_VALUE",
        ),
        // Unknown routes and methods.
        (
            "GET",
            format!("{m}/experiments/list"),
            String::new(),
            404,
            "ENDPOINT_NOT_FOUND",
        ),
        (
            "PUT",
            format!("{m}/registered-models/get"),
            String::new(),
            405,
            "ENDPOINT_NOT_FOUND",
        ),
    ];
    for (method, path, body, status, code) in &cases {
        let (s, t) = call(addr, method, path, body, Some(&auth)).await;
        assert_eq!(s, *status, "{method} {path}: {t}");
        let v = json(&t);
        assert_eq!(v["error_code"], *code, "{method} {path}: {t}");
        assert!(
            v["message"]
                .as_str()
                .is_some_and(|m| !m.is_empty() && m.len() < 400),
            "{t}"
        );
    }
    // A body without a JSON content type: 415 from the extractor, 400 here.
    let mut s = tokio::net::TcpStream::connect(addr).await.expect("connect");
    let body = r#"{"name":"plain"}"#;
    let req = format!(
        "POST {m}/registered-models/create HTTP/1.1\r\nHost: x\r\nConnection: close\r\n{auth}\r\nContent-Type: text/plain\r\nContent-Length: {}\r\n\r\n{body}",
        body.len()
    );
    s.write_all(req.as_bytes()).await.expect("write");
    let mut resp = String::new();
    s.read_to_string(&mut resp).await.expect("read");
    assert!(resp.starts_with("HTTP/1.1 400"), "{resp}");
    assert!(
        resp.contains("\"error_code\":\"INVALID_PARAMETER_VALUE\""),
        "{resp}"
    );
    // Deleting an alias that is not set succeeds, as in MLflow.
    let (s, t) = call(
        addr,
        "DELETE",
        &format!("{m}/registered-models/alias"),
        r#"{"name":"m","alias":"never"}"#,
        Some(&auth),
    )
    .await;
    assert_eq!(s, 200, "{t}");
    let (s, _) = call(
        addr,
        "DELETE",
        &format!("{m}/registered-models/alias"),
        r#"{"name":"nope","alias":"never"}"#,
        Some(&auth),
    )
    .await;
    assert_eq!(s, 404);
    let _ = tx.send(());
}

/// A search with the longest LIKE pattern over the longest sources runs on
/// its own read connection: a `get` meanwhile answers within 100 ms.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_long_search_does_not_hold_up_other_requests() {
    let t = tempfile::tempdir().expect("tmp");
    let mut reg = Registry::open(
        &t.path().join("reg.db"),
        Arc::new(FixedClock(1_700_000_000_000)),
    )
    .expect("reg");
    let key = keel_registry::auth::new_secret();
    reg.create_api_key("admin", "k", Role::Read, &key)
        .expect("k");
    let source = format!("s3://b/{}", "a".repeat(keel_registry::limits::SOURCE - 7));
    for _ in 0..150 {
        let new = NewVersion {
            model: "m".into(),
            source: source.clone(),
            create_model: true,
            ..Default::default()
        };
        reg.register_version("ci", &new, None).expect("v");
    }
    let (addr, stop) = start(reg).await;
    let auth = format!("api-key: {key}");
    // `%` then 255 characters that match everywhere but at the end: each
    // row costs about the pattern's length times the source's.
    let pattern = format!("%25{}b", "a".repeat(254));
    let path =
        format!("/api/2.0/mlflow/model-versions/search?filter=source_path+LIKE+%27{pattern}%27");
    // Up to three tries, so that a moment of a busy machine (CI runs
    // many tests at once) is not taken for a held lock: a registry that
    // holds its lock through a search delays every get of every try by
    // the search's whole length.
    let mut tries = Vec::new();
    for _ in 0..3 {
        let search = {
            let (auth, path) = (auth.clone(), path.clone());
            tokio::spawn(async move {
                let t0 = std::time::Instant::now();
                let (s, body) = call(addr, "GET", &path, "", Some(&auth)).await;
                (s, body, t0.elapsed())
            })
        };
        tokio::time::sleep(std::time::Duration::from_millis(50)).await;
        let mut slowest = std::time::Duration::ZERO;
        for _ in 0..5 {
            let t0 = std::time::Instant::now();
            let (s, body) = call(
                addr,
                "GET",
                "/api/2.0/mlflow/model-versions/get?name=m&version=7",
                "",
                Some(&auth),
            )
            .await;
            assert_eq!(s, 200, "{body}");
            slowest = slowest.max(t0.elapsed());
        }
        let during = !search.is_finished();
        let (s, body, took) = search.await.expect("search");
        assert_eq!(s, 200, "{body}");
        assert_eq!(json(&body)["model_versions"], serde_json::json!([]));
        // The gets ran while the search did (else this try shows nothing).
        assert!(during, "the search took only {took:?}");
        tries.push((slowest, took));
        if slowest < std::time::Duration::from_millis(100) {
            break;
        }
    }
    assert!(
        tries
            .iter()
            .any(|(slowest, _)| *slowest < std::time::Duration::from_millis(100)),
        "a get took over 100 ms during a search in every try (slowest get, search): {tries:?}"
    );
    // A longer pattern is refused before any row is read.
    let long = format!("%25{}b", "a".repeat(256));
    let (s, body) = call(
        addr,
        "GET",
        &format!("/api/2.0/mlflow/model-versions/search?filter=source_path+LIKE+%27{long}%27"),
        "",
        Some(&auth),
    )
    .await;
    assert_eq!(s, 400, "{body}");
    assert!(body.contains("at most 256 characters"), "{body}");
    let _ = stop.send(());
}

/// An answer given before the request's body has all arrived (stages
/// refused, a missing key, an unknown endpoint) leaves unread bytes on the
/// connection, which the server then closes: the answer says so
/// (`Connection: close`), or a pooling client (the MLflow client's
/// `requests`) sends its next request on the closed connection and fails
/// with "Remote end closed connection without response". An answer to a
/// body that was read whole keeps the connection.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_answer_before_the_body_is_read_closes_the_connection_and_says_so() {
    let mut reg = Registry::open_in_memory(Arc::new(FixedClock(1_700_000_000_000))).expect("reg");
    let key = keel_registry::auth::new_secret();
    reg.create_api_key("admin", "k", Role::Write, &key)
        .expect("k");
    let (addr, stop) = start(reg).await;
    let m = "/api/2.0/mlflow";
    let body =
        r#"{"name":"m","version":"1","stage":"Production","archive_existing_versions":false}"#;
    let (first, rest) = body.split_at(10);
    for (path, auth) in [
        (
            format!("{m}/model-versions/transition-stage"),
            format!("api-key: {key}\r\n"),
        ),
        (format!("{m}/registered-models/create"), String::new()),
        (
            format!("{m}/no-such-endpoint"),
            format!("api-key: {key}\r\n"),
        ),
        ("/health".to_owned(), String::new()),
    ] {
        let mut s = tokio::net::TcpStream::connect(addr).await.expect("connect");
        // The head and the first bytes of the body; the rest comes after
        // the answer, as from a client whose body is still in flight.
        let req = format!(
            "POST {path} HTTP/1.1\r\nHost: x\r\n{auth}Content-Type: application/json\r\nContent-Length: {}\r\n\r\n{first}",
            body.len()
        );
        s.write_all(req.as_bytes()).await.expect("write");
        let mut head = Vec::new();
        let mut buf = [0u8; 4096];
        while !head.windows(4).any(|w| w == b"\r\n\r\n") {
            let n = tokio::time::timeout(std::time::Duration::from_secs(10), s.read(&mut buf))
                .await
                .expect("an answer")
                .expect("read");
            assert!(n > 0, "{path}: closed without an answer");
            head.extend_from_slice(&buf[..n]);
        }
        let head = String::from_utf8_lossy(&head).to_ascii_lowercase();
        assert!(
            head.contains("\r\nconnection: close\r\n"),
            "{path}: answered before the body was read, without saying the connection closes:\n{head}"
        );
        let _ = s.write_all(rest.as_bytes()).await;
    }
    // A body read whole: the connection stays open for the next request.
    let mut s = tokio::net::TcpStream::connect(addr).await.expect("connect");
    let create = r#"{"name":"kept"}"#;
    let req = format!(
        "POST {m}/registered-models/create HTTP/1.1\r\nHost: x\r\napi-key: {key}\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n{create}GET {m}/registered-models/get?name=kept HTTP/1.1\r\nHost: x\r\napi-key: {key}\r\nConnection: close\r\n\r\n",
        create.len()
    );
    s.write_all(req.as_bytes()).await.expect("write");
    let mut all = String::new();
    s.read_to_string(&mut all).await.expect("read");
    assert_eq!(all.matches("HTTP/1.1 200").count(), 2, "{all}");
    let _ = stop.send(());
}

/// What one client may hold of the server is bounded: a head that does not
/// come, a kept-alive connection left idle, a client that reads none of its
/// answers, a body sent slowly; a connection over a limit (in all, or from
/// one address) is answered 503 at once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn connections_are_bounded_in_number_and_time() {
    use std::time::{Duration, Instant};
    let mut reg = Registry::open_in_memory(Arc::new(FixedClock(1_700_000_000_000))).expect("reg");
    let key = keel_registry::auth::new_secret();
    reg.create_api_key("admin", "k", Role::Write, &key)
        .expect("k");
    let app = router(reg, ServeOptions::default());
    let start = |limits: ConnectionLimits| {
        let app = app.clone();
        async move {
            let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
                .await
                .expect("bind");
            let addr = listener.local_addr().expect("addr");
            let (stop, rx) = tokio::sync::oneshot::channel::<()>();
            let server = tokio::spawn(serve_with(listener, app, limits, async {
                let _ = rx.await;
            }));
            (addr, stop, server)
        }
    };
    let limits = ConnectionLimits {
        max_connections: 2,
        max_per_client: 64,
        // Both places for any connection: the held ones below have not
        // been answered yet, so they do not count as authenticated.
        reserved: 0,
        header_timeout: Duration::from_millis(500),
        idle_timeout: Duration::from_millis(500),
        write_timeout: Duration::from_millis(500),
        lifetime: Duration::from_secs(2),
        drain: Duration::from_secs(2),
        ..ConnectionLimits::default()
    };
    let (addr, stop, server) = start(limits).await;
    // A request with a key: its connection is kept alive.
    let authed = format!("GET /api/v1/models HTTP/1.1\r\nHost: x\r\napi-key: {key}\r\n\r\n");
    // Closed (EOF or reset) within `within`, whatever it answered first.
    async fn closed_within(s: &mut tokio::net::TcpStream, within: Duration) -> (Duration, String) {
        let started = Instant::now();
        let mut got = Vec::new();
        let mut buf = [0u8; 65536];
        loop {
            match tokio::time::timeout(within, s.read(&mut buf)).await {
                Ok(Ok(0)) | Ok(Err(_)) => {
                    return (
                        started.elapsed(),
                        String::from_utf8_lossy(&got).into_owned(),
                    )
                }
                Ok(Ok(n)) => got.extend_from_slice(&buf[..n.min(4096)]),
                Err(_) => panic!("still open after {within:?}"),
            }
        }
    }

    // A head that never comes; a kept-alive connection answered once, then idle.
    let mut silent = tokio::net::TcpStream::connect(addr).await.expect("connect");
    let (t, _) = closed_within(&mut silent, Duration::from_secs(5)).await;
    assert!(t >= Duration::from_millis(400), "{t:?}");
    let mut idle = tokio::net::TcpStream::connect(addr).await.expect("connect");
    idle.write_all(authed.as_bytes()).await.expect("write");
    let (t, answer) = closed_within(&mut idle, Duration::from_secs(5)).await;
    assert!(answer.starts_with("HTTP/1.1 200"), "{answer}");
    assert!(
        !answer.to_ascii_lowercase().contains("connection: close"),
        "{answer}"
    );
    assert!(t >= Duration::from_millis(400), "{t:?}");
    // Answers to no one in particular keep no connection: /health, and a
    // request without a valid key.
    for req in [
        "GET /health HTTP/1.1\r\nHost: x\r\n\r\n".to_owned(),
        "GET /api/v1/models HTTP/1.1\r\nHost: x\r\napi-key: wrong\r\n\r\n".to_owned(),
    ] {
        let mut s = tokio::net::TcpStream::connect(addr).await.expect("connect");
        s.write_all(req.as_bytes()).await.expect("write");
        let (t, answer) = closed_within(&mut s, Duration::from_secs(5)).await;
        assert!(
            answer
                .to_ascii_lowercase()
                .contains("\r\nconnection: close\r\n"),
            "{answer}"
        );
        assert!(t < Duration::from_millis(300), "{t:?}");
    }

    // Two connections held (bodies still coming): a third is answered 503 at once.
    let m = "/api/2.0/mlflow";
    let create = r#"{"name":"slow"}"#;
    let (head_part, rest) = create.split_at(3);
    // `Expect: 100-continue`: the server says `100 Continue` when it starts
    // reading the body, so the test knows each request is in flight (its
    // head read, its place no longer one waiting for a head) instead of
    // guessing how long the server takes on a loaded machine.
    let slow = format!(
        "POST {m}/registered-models/create HTTP/1.1\r\nHost: x\r\napi-key: {key}\r\nContent-Type: application/json\r\nExpect: 100-continue\r\nContent-Length: {}\r\n\r\n{head_part}",
        create.len()
    );
    let mut held = Vec::new();
    while held.len() < 2 {
        let mut s = tokio::net::TcpStream::connect(addr).await.expect("connect");
        s.write_all(slow.as_bytes()).await.expect("write");
        let mut head = Vec::new();
        let mut byte = [0u8; 1];
        while !head.ends_with(b"\r\n\r\n") {
            match tokio::time::timeout(Duration::from_secs(30), s.read(&mut byte)).await {
                Ok(Ok(1)) => head.push(byte[0]),
                other => panic!(
                    "no interim answer: {other:?} after {:?}",
                    String::from_utf8_lossy(&head)
                ),
            }
        }
        let head = String::from_utf8_lossy(&head).into_owned();
        if head.starts_with("HTTP/1.1 100") {
            held.push(s);
        } else {
            // A place of an earlier test connection not yet given back.
            assert!(head.starts_with("HTTP/1.1 503"), "{head}");
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }
    let mut third = tokio::net::TcpStream::connect(addr).await.expect("connect");
    let (t, answer) = closed_within(&mut third, Duration::from_secs(2)).await;
    assert!(answer.starts_with("HTTP/1.1 503"), "{answer}");
    assert!(answer.contains("TEMPORARILY_UNAVAILABLE"), "{answer}");
    assert!(t < Duration::from_millis(500), "{t:?}");
    // At their lifetime the held connections finish the request in flight
    // (the rest of the body comes after it), answer it, and close.
    tokio::time::sleep(Duration::from_millis(2200)).await;
    let mut created = 0;
    for s in &mut held {
        s.write_all(rest.as_bytes()).await.expect("write the rest");
        let (_, answer) = closed_within(s, Duration::from_secs(5)).await;
        let lower = answer.to_ascii_lowercase();
        if lower.starts_with("http/1.1 200") {
            created += 1;
            assert!(lower.contains("\r\nconnection: close\r\n"), "{answer}");
        } else {
            // The second create of the same name.
            assert!(lower.starts_with("http/1.1 400"), "{answer}");
        }
    }
    assert_eq!(created, 1);
    let _ = stop.send(());
    tokio::time::timeout(Duration::from_secs(5), server)
        .await
        .expect("the server stops")
        .expect("join")
        .expect("serve");

    // A client that sends requests and reads none of the answers holds the
    // only place until its answers stop moving for the write timeout, long
    // before the connection's lifetime: then a request is served again.
    let (addr, stop, server) = start(ConnectionLimits {
        max_connections: 1,
        write_timeout: Duration::from_millis(500),
        lifetime: Duration::from_secs(600),
        ..ConnectionLimits::default()
    })
    .await;
    // The client's receive buffer is made small before it connects, and it
    // sends requests until the server stops reading them: the answers then
    // fill the server's send buffer within a few megabytes whatever the
    // kernel's buffer autotuning allows (tcp_rmem up to 32 MiB lets a
    // default socket absorb every answer of a fixed flood, and the write
    // timeout never starts).
    let deaf = tokio::net::TcpSocket::new_v4().expect("socket");
    deaf.set_recv_buffer_size(4096).expect("SO_RCVBUF");
    let mut deaf = deaf.connect(addr).await.expect("connect");
    let flood = authed.repeat(1_000);
    let writer = tokio::spawn(async move {
        while deaf.write_all(flood.as_bytes()).await.is_ok() {}
        deaf
    });
    tokio::time::sleep(Duration::from_millis(200)).await;
    let started = Instant::now();
    let mut refused = 0;
    let served = async {
        loop {
            let mut s = tokio::net::TcpStream::connect(addr).await.expect("connect");
            s.write_all(b"GET /health HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
                .await
                .expect("write");
            let mut a = String::new();
            let _ = s.read_to_string(&mut a).await;
            if a.starts_with("HTTP/1.1 200") {
                return;
            }
            assert!(a.starts_with("HTTP/1.1 503"), "{a}");
            refused += 1;
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    };
    // How long the server takes to fill its send buffer depends on the
    // machine's load; the bound that matters is the connection's lifetime
    // (600 s), which only the write timeout can beat.
    tokio::time::timeout(Duration::from_secs(120), served)
        .await
        .expect("served once the deaf client is cut");
    assert!(refused > 0, "the deaf client never held the place");
    assert!(started.elapsed() < Duration::from_secs(120));
    writer.abort();
    let _ = stop.send(());
    let _ = tokio::time::timeout(Duration::from_secs(35), server).await;

    // From one address, at most `max_per_client`.
    let (addr, stop, server) = start(ConnectionLimits {
        max_per_client: 1,
        ..ConnectionLimits::default()
    })
    .await;
    let _first = tokio::net::TcpStream::connect(addr).await.expect("connect");
    tokio::time::sleep(Duration::from_millis(100)).await;
    let mut second = tokio::net::TcpStream::connect(addr).await.expect("connect");
    let (_, answer) = closed_within(&mut second, Duration::from_secs(2)).await;
    assert!(
        answer.contains("too many connections from this address"),
        "{answer}"
    );
    let _ = stop.send(());
    drop(_first);
    tokio::time::timeout(Duration::from_secs(35), server)
        .await
        .expect("the server stops")
        .expect("join")
        .expect("serve");
}

/// A connection from `source` (a loopback address of its own: a client of
/// its own) to `addr`.
async fn connect_from(source: [u8; 4], addr: std::net::SocketAddr) -> tokio::net::TcpStream {
    let s = tokio::net::TcpSocket::new_v4().expect("socket");
    s.bind(std::net::SocketAddr::from((source, 0)))
        .expect("bind the source address");
    s.connect(addr).await.expect("connect")
}

/// Reads one answer's head and a body of its Content-Length.
async fn one_answer(s: &mut tokio::net::TcpStream) -> String {
    let mut got = Vec::new();
    let mut buf = [0u8; 4096];
    loop {
        let text = String::from_utf8_lossy(&got).into_owned();
        if let Some((head, body)) = text.split_once("\r\n\r\n") {
            let len = head
                .lines()
                .find_map(|l| {
                    l.to_ascii_lowercase()
                        .strip_prefix("content-length: ")
                        .and_then(|v| v.trim().parse::<usize>().ok())
                })
                .unwrap_or(0);
            if body.len() >= len {
                return text;
            }
        }
        match tokio::time::timeout(std::time::Duration::from_secs(10), s.read(&mut buf)).await {
            Ok(Ok(0)) | Ok(Err(_)) => return String::from_utf8_lossy(&got).into_owned(),
            Ok(Ok(n)) => got.extend_from_slice(&buf[..n]),
            Err(_) => panic!("no answer within 10 s: {}", String::from_utf8_lossy(&got)),
        }
    }
}

/// Unauthenticated connections that never send a head (from 8 addresses,
/// each within its per-client share) cannot keep a client with a key out:
/// the oldest of them is closed to make room, and a connection that has
/// authenticated is never closed for a newer one.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn slow_heads_without_a_key_give_way_to_a_client_with_one() {
    use std::time::Duration;
    let mut reg = Registry::open_in_memory(Arc::new(FixedClock(1_700_000_000_000))).expect("reg");
    let key = keel_registry::auth::new_secret();
    reg.create_api_key("admin", "k", Role::Read, &key)
        .expect("k");
    let app = router(reg, ServeOptions::default());
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind");
    let addr = listener.local_addr().expect("addr");
    let (stop, rx) = tokio::sync::oneshot::channel::<()>();
    let server = tokio::spawn(serve_with(
        listener,
        app,
        ConnectionLimits {
            max_connections: 16,
            max_per_client: 2,
            // Long enough that no slow head ends by itself in this test.
            header_timeout: Duration::from_secs(120),
            ..ConnectionLimits::default()
        },
        async {
            let _ = rx.await;
        },
    ));
    // 8 clients hold 2 connections each, sending nothing: every place.
    let mut slow = Vec::new();
    for i in 0..8u8 {
        for _ in 0..2 {
            slow.push(connect_from([127, 0, 1, 1 + i], addr).await);
        }
    }
    let authed = format!("GET /api/v1/models HTTP/1.1\r\nHost: x\r\napi-key: {key}\r\n\r\n");
    let mut keyed = connect_from([127, 0, 0, 1], addr).await;
    keyed.write_all(authed.as_bytes()).await.expect("write");
    let answer = one_answer(&mut keyed).await;
    assert!(answer.starts_with("HTTP/1.1 200"), "{answer}");
    // The oldest slow head was closed to make room.
    let mut buf = [0u8; 64];
    let n = tokio::time::timeout(Duration::from_secs(10), slow[0].read(&mut buf))
        .await
        .expect("the oldest slow head is closed")
        .unwrap_or(0);
    assert_eq!(n, 0, "{:?}", String::from_utf8_lossy(&buf[..n]));
    // More slow heads from new clients make room among themselves, never
    // by closing the authenticated connection, which is served again.
    for i in 0..12u8 {
        slow.push(connect_from([127, 0, 2, 1 + i], addr).await);
    }
    keyed.write_all(authed.as_bytes()).await.expect("write");
    let answer = one_answer(&mut keyed).await;
    assert!(answer.starts_with("HTTP/1.1 200"), "{answer}");
    let _ = stop.send(());
    drop(slow);
    drop(keyed);
    tokio::time::timeout(Duration::from_secs(35), server)
        .await
        .expect("the server stops")
        .expect("join")
        .expect("serve");
}

/// Issue 44 (E2): every list is a page. keel's own lists (versions,
/// models, history) give 100 items by default, at most 1,000, and a
/// `next_page_token` while more follow; MLflow's searches keep MLflow's
/// page sizes, and every answer is cut short at the response size cap
/// with a token for the rest, which MLflow's clients follow.
async fn every_list_is_paged_and_every_answer_is_capped(store: Store) {
    let mut reg = store.open(Arc::new(FixedClock(1_700_000_000_000)));
    let key = keel_registry::auth::new_secret();
    reg.create_api_key("admin", "k", Role::Read, &key)
        .expect("k");
    for _ in 0..25 {
        let new = NewVersion {
            model: "m".into(),
            source: "s3://b/m".into(),
            create_model: true,
            ..Default::default()
        };
        reg.register_version("ci", &new, None).expect("version");
    }
    for i in 0..12 {
        reg.set_alias("ci", "m", "production", i + 1, "release")
            .expect("alias");
    }
    for name in ["x", "y", "z"] {
        reg.create_model("ci", name, "", &[]).expect("model");
    }
    let app = router(
        reg,
        ServeOptions {
            max_response_bytes: 4096,
            ..Default::default()
        },
    );
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind");
    let addr = listener.local_addr().expect("addr");
    let (tx, rx) = tokio::sync::oneshot::channel::<()>();
    tokio::spawn(serve(listener, app, async {
        let _ = rx.await;
    }));
    let auth = format!("api-key: {key}");
    let get = |path: String| {
        let auth = auth.clone();
        async move {
            let (s, t) = call(addr, "GET", &path, "", Some(&auth)).await;
            assert_eq!(s, 200, "{path}: {t}");
            json(&t)
        }
    };
    // Pages of 10 versions, in order, each with the token of the next.
    let mut seen = Vec::new();
    let mut token = String::new();
    let mut pages = 0;
    loop {
        let v = get(format!(
            "/api/v1/versions?name=m&max_results=10&page_token={token}"
        ))
        .await;
        assert_eq!(v["version"], 1);
        let items = v["versions"].as_array().expect("versions");
        assert!(!items.is_empty() && items.len() <= 10, "{v}");
        seen.extend(items.iter().map(|i| i["version"].as_u64().expect("n")));
        pages += 1;
        match v["next_page_token"].as_str() {
            Some(t) => token = t.to_owned(),
            None => break,
        }
    }
    assert_eq!(seen, (1..=25).collect::<Vec<u64>>());
    assert!(pages >= 3, "{pages}");
    // The default page, the bound on max_results, a bad token.
    let v = get("/api/v1/models".into()).await;
    let names: Vec<&str> = v["models"]
        .as_array()
        .expect("models")
        .iter()
        .map(|m| m["name"].as_str().unwrap_or(""))
        .collect();
    assert_eq!(names, ["m", "x", "y", "z"]);
    assert!(v.get("next_page_token").is_none(), "{v}");
    let v = get("/api/v1/models?max_results=2".into()).await;
    assert_eq!(v["next_page_token"], "x", "{v}");
    let v = get("/api/v1/models?max_results=2&page_token=x".into()).await;
    assert_eq!(v["models"][0]["name"], "y", "{v}");
    for bad in [
        "/api/v1/versions?name=m&max_results=1001",
        "/api/v1/versions?name=m&max_results=0",
        "/api/v1/versions?name=m&page_token=-3",
    ] {
        let (s, t) = call(addr, "GET", bad, "", Some(&auth)).await;
        assert_eq!(s, 400, "{bad}: {t}");
        assert!(t.contains("INVALID_PARAMETER_VALUE"), "{t}");
    }
    let v = get("/api/v1/history?name=m&alias=production&max_results=5".into()).await;
    assert_eq!(v["events"].as_array().expect("events").len(), 5);
    assert_eq!(v["next_page_token"], v["events"][4]["seq"].to_string());
    // MLflow's search: a 4 KiB answer holds a few versions, then a token;
    // following the tokens gives every version once.
    let mut seen = Vec::new();
    let mut token = String::new();
    loop {
        let (s, t) = call(
            addr,
            "GET",
            &format!(
                "/api/2.0/mlflow/model-versions/search?filter=name%3D%27m%27&page_token={token}"
            ),
            "",
            Some(&auth),
        )
        .await;
        assert_eq!(s, 200, "{t}");
        assert!(t.len() < 4096 + 1024, "{}", t.len());
        let v = json(&t);
        let got = versions_of(&v);
        assert!(!got.is_empty(), "{v}");
        seen.extend(got);
        match v["next_page_token"].as_str() {
            Some(n) => token = n.to_owned(),
            None => break,
        }
    }
    let mut want: Vec<String> = (1..=25).rev().map(|n| format!("m:{n}")).collect();
    want.sort();
    seen.sort();
    assert_eq!(seen, want);
    let _ = tx.send(());
}
