//! `keel serve` as a process: keys made, listed and revoked with the CLI
//! while it runs, the audit log checked by `keel serve audit verify`,
//! SIGHUP reload, graceful shutdown with a stream in flight, and TLS on
//! the listener and to a backend.

mod serve_common;

use std::time::{Duration, Instant};

use keel_testkit::serve::BackendTls;
use keel_testkit::tls::TestPki;
use serde_json::{json, Value};
use serve_common::*;

#[test]
fn keys_cli_revocation_is_immediate_and_audit_verify_catches_tampering() {
    revocation_and_audit(None);
}

#[test]
fn on_one_worker_revocation_is_immediate_and_the_audit_log_whole() {
    revocation_and_audit(Some(1));
}

fn revocation_and_audit(workers: Option<usize>) {
    let dir = tempfile::tempdir().expect("tempdir");
    let b = TestBackend::start(&[]);
    let cfg = config(dir.path(), &b.url(), "");
    if let Some(n) = workers {
        set_workers(&cfg, n);
    }
    let (id, secret) = create_key(&cfg, "alice", "user", Some("ml"));
    assert!(secret.starts_with("sk-keel-"));
    let keys = std::fs::read_to_string(dir.path().join("keys.json")).expect("keys");
    assert!(!keys.contains(&secret), "only the hash is stored");
    let (code, ls) = run(&[
        "serve",
        "keys",
        "ls",
        "--config",
        cfg.to_str().expect("utf8"),
    ]);
    assert_eq!(code, 0);
    assert!(
        ls.contains(&id) && ls.contains("alice") && !ls.contains(&secret),
        "{ls}"
    );

    let mut g = GatewayProcess::start(&keel(), &cfg);
    let r =
        http::post_json(g.public, "/v1/chat/completions", &secret, &chat_body()).expect("request");
    assert_eq!(r.status, 200, "{}", r.text());
    let (code, _) = run(&[
        "serve",
        "keys",
        "revoke",
        &id,
        "--config",
        cfg.to_str().expect("utf8"),
    ]);
    assert_eq!(code, 0);
    let r =
        http::post_json(g.public, "/v1/chat/completions", &secret, &chat_body()).expect("request");
    assert_eq!(r.status, 401, "revoked: refused on the next request");
    let (_, ls) = run(&[
        "--json",
        "serve",
        "keys",
        "ls",
        "--config",
        cfg.to_str().expect("utf8"),
    ]);
    let v: Value = serde_json::from_str(&ls).expect("json");
    assert!(v["keys"][0]["revoked"].is_string());

    g.signal("TERM");
    assert_eq!(g.wait(), Some(0));
    let audit = dir.path().join("audit.jsonl");
    let (code, out) = run(&["serve", "audit", "verify", audit.to_str().expect("utf8")]);
    assert_eq!(code, 0, "{out}");
    assert!(out.contains("intact"), "{out}");
    let text = std::fs::read_to_string(&audit).expect("audit");
    assert!(text.lines().any(|l| l.contains("\"event\":\"denied\"")));
    assert!(!text.contains(&secret));
    std::fs::write(&audit, text.replacen("\"status\":200", "\"status\":201", 1)).expect("tamper");
    let (code, out) = run(&[
        "--json",
        "serve",
        "audit",
        "verify",
        audit.to_str().expect("utf8"),
    ]);
    assert_eq!(code, 2, "{out}");
    let v: Value = serde_json::from_str(&out).expect("json");
    assert_eq!(v["ok"], false);
    assert_eq!(v["command"], "serve audit verify");
}

/// A crash mid-write leaves half a line: `audit verify` says so (exit 1,
/// the lines before it intact), and the gateway still starts, setting the
/// half line aside and continuing the chain with a `recovered` event.
#[test]
fn a_torn_audit_line_is_a_crash_not_tampering_and_does_not_stop_the_gateway() {
    let dir = tempfile::tempdir().expect("tempdir");
    let b = TestBackend::start(&[]);
    let cfg = config(dir.path(), &b.url(), "");
    let (_, secret) = create_key(&cfg, "alice", "user", None);
    let audit = dir.path().join("audit.jsonl");
    let a = audit.to_str().expect("utf8");
    let mut g = GatewayProcess::start(&keel(), &cfg);
    let r = http::post_json(g.public, "/v1/chat/completions", &secret, &chat_body()).expect("req");
    assert_eq!(r.status, 200);
    g.signal("TERM");
    assert_eq!(g.wait(), Some(0));
    let text = std::fs::read_to_string(&audit).expect("audit");
    let lines = text.lines().count();
    std::fs::write(
        &audit,
        format!("{text}{{\"seq\":{},\"prev\":\"ab", lines + 1),
    )
    .expect("tear");

    let (code, out) = run(&["--json", "serve", "audit", "verify", a]);
    assert_eq!(code, 1, "{out}");
    let v: Value = serde_json::from_str(&out).expect("json");
    assert_eq!(v["incomplete_tail"], true);
    assert_eq!(v["entries"], lines as u64);
    let (_, out) = run(&["serve", "audit", "verify", a]);
    assert!(out.contains("incomplete final line (crash)"), "{out}");

    let mut g = GatewayProcess::start(&keel(), &cfg);
    let r = http::post_json(g.public, "/v1/chat/completions", &secret, &chat_body()).expect("req");
    assert_eq!(r.status, 200);
    g.signal("TERM");
    assert_eq!(g.wait(), Some(0));
    let (code, out) = run(&["--json", "serve", "audit", "verify", a]);
    assert_eq!(code, 0, "{out}");
    let v: Value = serde_json::from_str(&out).expect("json");
    assert_eq!(v["recoveries"], 1);
    let mode = std::os::unix::fs::PermissionsExt::mode(
        &std::fs::metadata(&audit).expect("stat").permissions(),
    );
    assert_eq!(mode & 0o777, 0o600, "the audit log is its owner's only");
}

/// With `audit.hmac_key_file`, the log carries signed checkpoints: `verify
/// --key` vouches for it, and refuses a re-chained or emptied log (which
/// the bare chain cannot tell from a real one) and a key file others may
/// read.
#[test]
fn signed_checkpoints_catch_a_rechained_or_emptied_audit_log() {
    use std::os::unix::fs::PermissionsExt;
    let dir = tempfile::tempdir().expect("tempdir");
    let b = TestBackend::start(&[]);
    let key = dir.path().join("audit.key");
    std::fs::write(
        &key,
        "8f1d3c0a9b7e6d5c4b3a29180706f5e4d3c2b1a0ffeeddccbbaa998877665544\n",
    )
    .expect("key");
    std::fs::set_permissions(&key, std::fs::Permissions::from_mode(0o644)).expect("chmod");
    let cfg = config(dir.path(), &b.url(), "");
    let text = std::fs::read_to_string(&cfg).expect("config");
    std::fs::write(
        &cfg,
        text.replacen(
            "path = \"audit.jsonl\"\n",
            "path = \"audit.jsonl\"\nhmac_key_file = \"audit.key\"\ncheckpoint_every = 2\n",
            1,
        ),
    )
    .expect("config");
    let c = cfg.to_str().expect("utf8");
    let (code, _) = run(&["serve", "--config", c, "--print-config"]);
    assert_eq!(code, 64, "a key others can read is refused");
    std::fs::set_permissions(&key, std::fs::Permissions::from_mode(0o600)).expect("chmod");

    let (_, secret) = create_key(&cfg, "alice", "user", None);
    // Two runs: each shutdown writes a checkpoint, so the log has at
    // least two, whatever the batching.
    for _ in 0..2 {
        let mut g = GatewayProcess::start(&keel(), &cfg);
        for _ in 0..3 {
            let r = http::post_json(g.public, "/v1/chat/completions", &secret, &chat_body())
                .expect("req");
            assert_eq!(r.status, 200);
        }
        g.signal("TERM");
        assert_eq!(g.wait(), Some(0));
    }
    let audit = dir.path().join("audit.jsonl");
    let (a, k) = (audit.to_str().expect("utf8"), key.to_str().expect("utf8"));
    let (code, out) = run(&["--json", "serve", "audit", "verify", a, "--key", k]);
    assert_eq!(code, 0, "{out}");
    let v: Value = serde_json::from_str(&out).expect("json");
    assert!(v["checkpoints"].as_u64().expect("checkpoints") >= 2, "{v}");
    assert_eq!(v["signed_through"], v["entries"], "{v}");
    assert_eq!(v["anchored_checkpoint"], v["entries"], "{v}");
    let anchor = dir.path().join("audit.jsonl.anchor");
    assert_eq!(v["anchor"], anchor.display().to_string(), "{v}");

    // Cut right after the first checkpoint: the checkpoints left verify,
    // the anchor kept beside the log does not (issue 44, E9).
    let text = std::fs::read_to_string(&audit).expect("audit");
    let first = text
        .lines()
        .position(|l| l.contains("\"event\":\"checkpoint\""))
        .expect("a checkpoint");
    let cut: String = text
        .lines()
        .take(first + 1)
        .map(|l| format!("{l}\n"))
        .collect();
    std::fs::write(&audit, &cut).expect("cut");
    let (code, out) = run(&["serve", "audit", "verify", a, "--key", k]);
    assert_eq!(code, 2, "{out}");
    assert!(out.contains("lines were cut off"), "{out}");
    let (code, out) = run(&[
        "serve",
        "audit",
        "verify",
        a,
        "--key",
        k,
        "--anchor",
        "/nonexistent",
    ]);
    assert_ne!(code, 0, "{out}");
    let moved = dir.path().join("elsewhere.anchor");
    std::fs::rename(&anchor, &moved).expect("move the anchor");
    let (code, out) = run(&["serve", "audit", "verify", a, "--key", k]);
    assert_eq!(code, 0, "without its anchor the cut log verifies: {out}");
    assert!(out.contains("no anchor file"), "{out}");
    let m = moved.to_str().expect("utf8");
    let (code, out) = run(&["serve", "audit", "verify", a, "--key", k, "--anchor", m]);
    assert_eq!(code, 2, "{out}");

    std::fs::write(&audit, "").expect("empty");
    let (code, out) = run(&["serve", "audit", "verify", a]);
    assert_eq!(code, 0, "the bare chain accepts an empty log: {out}");
    let (code, out) = run(&["serve", "audit", "verify", a, "--key", k]);
    assert_eq!(code, 2, "{out}");
    assert!(out.contains("NO signed checkpoint"), "{out}");
}

/// `audit.sync = true`: a response is released only once its audit line
/// is on disk, so the line is in the file when the answer arrives.
#[test]
fn with_audit_sync_the_line_is_on_disk_before_the_response() {
    let dir = tempfile::tempdir().expect("tempdir");
    let b = TestBackend::start(&[]);
    let cfg = config(dir.path(), &b.url(), "");
    let text = std::fs::read_to_string(&cfg).expect("config");
    std::fs::write(
        &cfg,
        text.replacen(
            "path = \"audit.jsonl\"\n",
            "path = \"audit.jsonl\"\nsync = true\n",
            1,
        ),
    )
    .expect("config");
    let (_, secret) = create_key(&cfg, "alice", "user", None);
    let mut g = GatewayProcess::start(&keel(), &cfg);
    let audit = dir.path().join("audit.jsonl");
    for _ in 0..10 {
        let r =
            http::post_json(g.public, "/v1/chat/completions", &secret, &chat_body()).expect("req");
        assert_eq!(r.status, 200);
        let id = r.header("x-request-id").expect("request id").to_owned();
        let text = std::fs::read_to_string(&audit).expect("audit");
        assert!(
            text.contains(&format!("\"request_id\":\"{id}\"")),
            "request {id} is in the audit log when its response arrives"
        );
    }
    g.signal("TERM");
    assert_eq!(g.wait(), Some(0));
}

/// One `keys revoke` and three `keys create` at once, ten rounds: every
/// revocation that printed success holds, every printed key is in the
/// file, and the file always parses.
#[test]
fn concurrent_key_writers_lose_nothing() {
    let dir = tempfile::tempdir().expect("tempdir");
    let cfg = config(dir.path(), "http://127.0.0.1:9", "");
    let keys = dir.path().join("keys.json");
    let mut revoked = Vec::new();
    let mut created = Vec::new();
    for round in 0..10 {
        let (victim, _) = create_key(&cfg, &format!("victim{round}"), "user", None);
        let c = cfg.to_str().expect("utf8").to_owned();
        let revoke = {
            let (c, victim) = (c.clone(), victim.clone());
            std::thread::spawn(move || run(&["serve", "keys", "revoke", &victim, "--config", &c]))
        };
        let creates: Vec<_> = (0..3)
            .map(|i| {
                let c = c.clone();
                std::thread::spawn(move || {
                    run(&[
                        "--json",
                        "serve",
                        "keys",
                        "create",
                        "--config",
                        &c,
                        "--name",
                        &format!("k{i}"),
                        "--role",
                        "user",
                    ])
                })
            })
            .collect();
        let (code, out) = revoke.join().expect("join");
        assert_eq!(code, 0, "{out}");
        revoked.push(victim);
        for t in creates {
            let (code, out) = t.join().expect("join");
            assert_eq!(code, 0, "{out}");
            let v: Value = serde_json::from_str(&out).expect("json");
            created.push(v["id"].as_str().expect("id").to_owned());
        }
        let text = std::fs::read_to_string(&keys).expect("keys");
        serde_json::from_str::<Value>(&text).expect("the key file parses");
    }
    let v: Value = serde_json::from_str(&std::fs::read_to_string(&keys).expect("keys"))
        .expect("the key file parses");
    let records = v["keys"].as_array().expect("keys");
    let find = |id: &str| records.iter().find(|k| k["id"] == id);
    for id in &revoked {
        let k = find(id).unwrap_or_else(|| panic!("{id} lost"));
        assert!(k["revoked_ms"].is_u64(), "revocation of {id} undone: {k}");
    }
    for id in &created {
        assert!(
            find(id).is_some(),
            "{id} was printed but is not in the file"
        );
    }
    assert_eq!(records.len(), 40);
    let strays: Vec<_> = std::fs::read_dir(dir.path())
        .expect("ls")
        .map(|e| e.expect("entry").file_name().to_string_lossy().into_owned())
        .filter(|n| n.contains(".tmp"))
        .collect();
    assert!(strays.is_empty(), "temporary files left: {strays:?}");
}

#[test]
fn graceful_shutdown_finishes_a_stream_and_stops_accepting() {
    graceful_shutdown(None);
}

#[test]
fn on_one_worker_graceful_shutdown_finishes_a_stream() {
    graceful_shutdown(Some(1));
}

fn graceful_shutdown(workers: Option<usize>) {
    let dir = tempfile::tempdir().expect("tempdir");
    let b = TestBackend::start(&["--chunk-delay-ms", "100", "--tokens", "10"]);
    let cfg = config(dir.path(), &b.url(), "");
    if let Some(n) = workers {
        set_workers(&cfg, n);
    }
    let (_, secret) = create_key(&cfg, "s", "user", None);
    let mut g = GatewayProcess::start(&keel(), &cfg);
    let mut body = chat_body();
    body["stream"] = json!(true);
    body["max_tokens"] = json!(10);
    std::thread::scope(|s| {
        let stream = s.spawn(|| {
            http::post_json(g.public, "/v1/chat/completions", &secret, &body).expect("stream")
        });
        std::thread::sleep(Duration::from_millis(300));
        g.signal("TERM");
        std::thread::sleep(Duration::from_millis(200));
        assert!(
            std::net::TcpStream::connect(g.public).is_err(),
            "no new connections after SIGTERM"
        );
        let r = stream.join().expect("thread");
        assert_eq!(r.status, 200);
        let text = r.text();
        assert_eq!(
            text.matches("tok ").count(),
            10,
            "the stream in flight finished: {text}"
        );
        assert!(text.ends_with("data: [DONE]\n\n"));
    });
    let t = Instant::now();
    assert_eq!(g.wait(), Some(0));
    assert!(t.elapsed() < Duration::from_secs(5));
    let (code, out) = run(&[
        "serve",
        "audit",
        "verify",
        dir.path().join("audit.jsonl").to_str().expect("utf8"),
    ]);
    assert_eq!(code, 0, "{out}");
    let text = std::fs::read_to_string(dir.path().join("audit.jsonl")).expect("audit");
    assert!(
        text.lines()
            .last()
            .is_some_and(|l| l.contains("\"event\":\"stop\"")),
        "the stream's entry is written before stop"
    );
    assert!(text.contains("\"stream\":true"));
}

#[test]
fn sighup_reloads_the_config_file() {
    let dir = tempfile::tempdir().expect("tempdir");
    let blue = TestBackend::start(&["--name", "blue"]);
    let green = TestBackend::start(&["--name", "green"]);
    let cfg = config(dir.path(), &blue.url(), "");
    // On the single-threaded runtime: the signal, the reload and the
    // requests share one thread.
    set_workers(&cfg, 1);
    let (_, secret) = create_key(&cfg, "h", "user", None);
    let g = GatewayProcess::start(&keel(), &cfg);
    let r = http::post_json(g.public, "/v1/chat/completions", &secret, &chat_body()).expect("r");
    assert_eq!(r.json()["system_fingerprint"], "blue");
    let text = std::fs::read_to_string(&cfg).expect("read");
    std::fs::write(&cfg, text.replace(&blue.url(), &green.url())).expect("write");
    g.signal("HUP");
    let t = Instant::now();
    loop {
        let r =
            http::post_json(g.public, "/v1/chat/completions", &secret, &chat_body()).expect("r");
        if r.json()["system_fingerprint"] == "green" {
            break;
        }
        assert!(
            t.elapsed() < Duration::from_secs(5),
            "SIGHUP did not reload"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    let m = http::get(g.metrics.expect("metrics"), "/metrics", METRICS_TOKEN).expect("metrics");
    assert!(m
        .text()
        .contains("keel_requests_total{route=\"/v1/chat/completions\""));
    assert_eq!(
        http::get(g.metrics.expect("metrics"), "/metrics", "wrong")
            .expect("metrics")
            .status,
        401
    );
}

#[test]
fn print_config_and_bad_config_exit_codes() {
    let dir = tempfile::tempdir().expect("tempdir");
    let cfg = config(
        dir.path(),
        "http://127.0.0.1:9",
        "[limits]\nredis_url = \"redis://:s3cret-pw@127.0.0.1:6379/0\"\n",
    );
    let (code, out) = run(&[
        "--json",
        "serve",
        "--config",
        cfg.to_str().expect("utf8"),
        "--print-config",
    ]);
    assert_eq!(code, 0);
    assert!(
        !out.contains("s3cret-pw"),
        "the Redis password is printed: {out}"
    );
    let v: Value = serde_json::from_str(&out).expect("json");
    assert_eq!(
        v["config"]["limits"]["redis_url"],
        "redis://***@127.0.0.1:6379/0"
    );
    assert_eq!(v["config"]["traffic"]["retries"], 2);
    assert_eq!(v["config"]["server"]["pin_header"], "x-keel-deployment");
    std::fs::write(&cfg, "[server]\nnope = 1\n").expect("write");
    assert_eq!(
        run(&["serve", "--config", cfg.to_str().expect("utf8")]).0,
        64
    );
    assert_eq!(run(&["serve", "--config", "/nonexistent/gw.toml"]).0, 74);
    // `keys create` reports why the configuration did not load, not that
    // no key file was given.
    let (code, err) = run_stderr(&[
        "serve",
        "keys",
        "create",
        "--config",
        cfg.to_str().expect("utf8"),
        "--name",
        "alice",
        "--role",
        "user",
    ]);
    assert_eq!(code, 64, "{err}");
    assert!(err.contains("nope"), "{err}");
    assert!(!err.contains("no key file"), "{err}");
}

/// Runs `keel ARGS` and returns (exit code, stderr).
fn run_stderr(args: &[&str]) -> (i32, String) {
    let out = std::process::Command::new(keel())
        .args(args)
        .env_remove("KEEL_CONFIG")
        .output()
        .expect("run keel");
    (
        out.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

#[test]
fn https_listener_to_an_mtls_backend_with_sighup_certificate_renewal_and_tls_errors() {
    let dir = tempfile::tempdir().expect("tempdir");
    let pki = TestPki::generate(dir.path());
    let b = TestBackend::start_tls(&[], &pki, BackendTls::Mutual);
    let (cert, key) = (dir.path().join("gw.pem"), dir.path().join("gw.key"));
    std::fs::copy(pki.server_cert(), &cert).expect("copy");
    std::fs::copy(pki.server_key(), &key).expect("copy");
    // Relative paths: from the config file's directory.
    let upstream = "[upstream_tls]\nsystem_roots = false\nca_file = \"ca.pem\"\nclient_cert = \"client.pem\"\nclient_key = \"client.key\"\n";
    let cfg = config(dir.path(), &b.url(), upstream);
    let text = std::fs::read_to_string(&cfg).expect("read");
    let tls_text = text.replacen(
        "[server]\n",
        "[server]\ntls_cert = \"gw.pem\"\ntls_key = \"gw.key\"\n",
        1,
    );
    std::fs::write(&cfg, &tls_text).expect("write");
    let (_, secret) = create_key(&cfg, "t", "user", None);
    let g = GatewayProcess::start(&keel(), &cfg);
    let client = pki.client();
    let r = client
        .post_json(g.public, "/v1/chat/completions", &secret, &chat_body())
        .expect("chat over TLS");
    assert_eq!(r.status, 200, "{}", r.text());
    assert_eq!(b.count("/v1/chat/completions"), 1);
    assert!(
        http::post_json(g.public, "/v1/chat/completions", &secret, &chat_body()).is_err(),
        "plain HTTP gets no answer"
    );

    // A renewed certificate, then SIGHUP: new connections get it.
    let renewed_dir = dir.path().join("renewed");
    std::fs::create_dir(&renewed_dir).expect("mkdir");
    let renewed = TestPki::generate(&renewed_dir);
    std::fs::copy(renewed.server_cert(), &cert).expect("copy");
    std::fs::copy(renewed.server_key(), &key).expect("copy");
    g.signal("HUP");
    let t = Instant::now();
    while renewed.client().connect(g.public).is_err() {
        assert!(
            t.elapsed() < Duration::from_secs(5),
            "SIGHUP did not load the renewed certificate"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    let r = renewed
        .client()
        .post_json(g.public, "/v1/chat/completions", &secret, &chat_body())
        .expect("chat over TLS");
    assert_eq!(r.status, 200, "{}", r.text());
    drop(g);

    // Files that do not load stop `keel serve` with the file's name.
    let c = cfg.to_str().expect("utf8");
    std::fs::write(&cfg, tls_text.replace("gw.key", "missing.key")).expect("write");
    let (code, err) = run_stderr(&["serve", "--config", c]);
    assert_eq!(code, 74, "{err}");
    assert!(err.contains("missing.key"), "{err}");
    std::fs::write(
        dir.path().join("garbage.pem"),
        "-----BEGIN CERTIFICATE-----\nnope\n",
    )
    .expect("write");
    std::fs::write(&cfg, tls_text.replace("ca.pem", "garbage.pem")).expect("write");
    let (code, err) = run_stderr(&["serve", "--config", c]);
    assert_eq!(code, 65, "{err}");
    assert!(err.contains("garbage.pem"), "{err}");
    std::fs::write(&cfg, tls_text.replace("tls_key = \"gw.key\"\n", "")).expect("write");
    let (code, err) = run_stderr(&["serve", "--config", c]);
    assert_eq!(code, 64, "{err}");
    assert!(
        err.contains("server.tls_cert and server.tls_key go together"),
        "{err}"
    );
}

#[test]
fn rollout_commands_refuse_bad_arguments_before_calling() {
    let t = tempfile::tempdir().expect("tmp");
    let token = t.path().join("admin.token");
    std::fs::write(&token, "").expect("token");
    let token = token.to_str().expect("utf8");
    let keel_err = |args: &[&str]| {
        let o = std::process::Command::new(keel())
            .args(args)
            .env_remove("KEEL_CONFIG")
            .output()
            .expect("keel");
        (
            o.status.code().unwrap_or(-1),
            String::from_utf8_lossy(&o.stderr).into_owned(),
        )
    };
    for (args, expect) in [
        (
            vec!["serve", "rollout", "status", "chat"],
            "--admin http://host:port",
        ),
        (
            vec![
                "serve",
                "rollout",
                "status",
                "chat",
                "--admin",
                "http://127.0.0.1:1",
            ],
            "--token-file FILE",
        ),
        (
            vec![
                "serve",
                "rollout",
                "start",
                "chat",
                "--admin",
                "http://127.0.0.1:1",
                "--token-file",
                token,
            ],
            "is empty",
        ),
    ] {
        let (code, err) = keel_err(&args);
        assert_eq!(code, 64, "{args:?}: {err}");
        assert!(err.contains(expect), "{args:?}: {err}");
    }
    std::fs::write(t.path().join("admin.token"), "secret").expect("token");
    for (admin, model, expect) in [
        ("https://127.0.0.1:1", "chat", "must be http://host:port"),
        ("http://127.0.0.1:1/x", "chat", "must be http://host:port"),
        ("http://127.0.0.1:1", "a/b", "\"a/b\" is not a model name"),
    ] {
        let (code, err) = keel_err(&[
            "serve",
            "rollout",
            "abort",
            model,
            "--admin",
            admin,
            "--token-file",
            token,
        ]);
        assert_eq!(code, 64, "{admin} {model}: {err}");
        assert!(err.contains(expect), "{admin} {model}: {err}");
        assert!(!err.contains("secret"));
    }
}
