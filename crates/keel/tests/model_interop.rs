//! Interop with the real Python tools (`scripts/services/python-tools`
//! installs them and sets KEEL_TEST_PYTHON_TOOLS): the OpenSSF reference signer
//! `model-signing` 1.1.1 in both directions, and the MLflow client against
//! `keel model serve`, loading models through `models:/` URIs from file://,
//! Azurite and S3 artifact stores, and MLflow 3's `log_model` with a real
//! `mlflow server` as the tracking server.

use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};

fn python() -> PathBuf {
    std::env::var_os("KEEL_TEST_PYTHON_TOOLS")
        .map(PathBuf::from)
        .expect("KEEL_TEST_PYTHON_TOOLS is not set: run `eval \"$(scripts/services/python-tools)\"` (scripts/test does)")
}

/// The registry database a test runs keel on: a SQLite file, or a
/// throwaway PostgreSQL database (over TLS) when `pg` is set.
struct Db {
    path: PathBuf,
    pg: Option<keel_testkit::pg::PgDb>,
    /// KEEL_ARTIFACT_STORE for every command, where set.
    artifacts: Option<String>,
}

impl Db {
    fn file(path: PathBuf) -> Db {
        Db {
            path,
            pg: None,
            artifacts: None,
        }
    }

    /// On PostgreSQL, which has no directory beside it, the store a
    /// SQLite registry at `DIR/reg.db` has by default, configured.
    fn with_default_store_of(mut self, dir: &Path) -> Db {
        if self.pg.is_some() {
            let dir = std::path::absolute(dir).expect("absolute");
            self.artifacts = Some(format!("file://{}/reg-artifacts", dir.display()));
        }
        self
    }

    /// `keel model --db DB` with the database's password and CA.
    fn command(&self) -> Command {
        let mut c = Command::new(env!("CARGO_BIN_EXE_keel"));
        if let Some(a) = &self.artifacts {
            c.env("KEEL_ARTIFACT_STORE", a);
        }
        c.arg("model").arg("--db");
        match &self.pg {
            Some(pg) => {
                c.arg(&pg.url)
                    .env("KEEL_MODEL_DB_PASSWORD", &pg.password)
                    .env("KEEL_MODEL_DB_CA_FILE", &pg.ca);
            }
            None => {
                c.arg(&self.path);
            }
        }
        c
    }
}

/// Which store a test's registry is on.
#[derive(Clone, Copy)]
enum Store {
    Sqlite,
    Postgres,
}

impl Store {
    /// The registry database: `DIR/reg.db`, or a new PostgreSQL database.
    fn db(self, dir: &Path) -> Db {
        Db {
            path: dir.join("reg.db"),
            pg: matches!(self, Store::Postgres).then(keel_testkit::pg::PgDb::create),
            artifacts: None,
        }
    }
}

/// `name::sqlite` and `name::postgres`: the test `name(store)` on each
/// store (both need the Python tools; the PostgreSQL one also
/// scripts/services/postgres: scripts/test sets up both).
macro_rules! on_both_stores {
    ($($name:ident),* $(,)?) => {
        on_both_stores!(@ "needs Python tools: scripts/test installs them";
            "needs Python tools and PostgreSQL: scripts/test sets them up"; $($name),*);
    };
    (@ $sqlite:literal; $postgres:literal; $($name:ident),*) => {$(
        mod $name {
            #[test]
            #[ignore = $sqlite]
            fn sqlite() {
                super::$name(super::Store::Sqlite)
            }
            #[test]
            #[ignore = $postgres]
            fn postgres() {
                super::$name(super::Store::Postgres)
            }
        }
    )*};
}

on_both_stores!(
    model_signing_verifies_keel_signatures,
    mlflow_client_works_against_keel_serve,
    log_model_versions_carry_their_run_from_the_tracking_server,
);
on_both_stores!(@ "needs Python tools, Azurite and the S3 server: scripts/test starts them";
    "needs Python tools, Azurite, the S3 server and PostgreSQL: scripts/test starts them";
    mlflow_client_loads_models_registered_in_keel);

fn keel(db: &Db, args: &[&str]) -> Output {
    db.command()
        .args(args)
        .env("KEEL_ACTOR", "interop")
        .env_remove("KEEL_CONFIG")
        .output()
        .expect("run keel")
}

fn ok(o: Output) -> String {
    assert!(
        o.status.success(),
        "{}\n{}",
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr)
    );
    String::from_utf8_lossy(&o.stdout).into_owned()
}

/// `python -m model_signing ARGS`.
fn model_signing(args: &[&str]) -> Output {
    Command::new(python())
        .args(["-m", "model_signing"])
        .args(args)
        .output()
        .expect("run model_signing")
}

fn s(p: &Path) -> &str {
    p.to_str().expect("utf8")
}

fn model_dir(root: &Path) -> PathBuf {
    let m = root.join("model");
    std::fs::create_dir_all(m.join("tokenizer")).expect("mkdir");
    std::fs::write(
        m.join("model.safetensors"),
        (0..300_000u32).map(|i| (i % 251) as u8).collect::<Vec<_>>(),
    )
    .expect("w");
    std::fs::write(m.join("config.json"), b"{\"hidden\": 64}\n").expect("w");
    std::fs::write(m.join("tokenizer/vocab.json"), b"{\"a\": 1}\n").expect("w");
    m
}

/// A P-256 key exactly as `openssl ecparam -name prime256v1 -genkey`
/// writes it (EC PARAMETERS block, then the SEC1 key), and its public key.
fn openssl_key(dir: &Path) -> (PathBuf, PathBuf) {
    let key = dir.join("key.pem");
    let public = dir.join("key.pub");
    let made = Command::new("openssl")
        .args(["ecparam", "-name", "prime256v1", "-genkey", "-out"])
        .arg(&key)
        .status()
        .is_ok_and(|s| s.success())
        && Command::new("openssl")
            .args(["ec", "-pubout", "-in"])
            .arg(&key)
            .arg("-out")
            .arg(&public)
            .stderr(Stdio::null())
            .status()
            .is_ok_and(|s| s.success());
    if !made {
        // No openssl binary: the venv's `cryptography` writes the same
        // formats (TraditionalOpenSSL is SEC1).
        let script = format!(
            "from cryptography.hazmat.primitives.asymmetric import ec\nfrom cryptography.hazmat.primitives import serialization as s\nk = ec.generate_private_key(ec.SECP256R1())\nopen({:?}, 'wb').write(k.private_bytes(s.Encoding.PEM, s.PrivateFormat.TraditionalOpenSSL, s.NoEncryption()))\nopen({:?}, 'wb').write(k.public_key().public_bytes(s.Encoding.PEM, s.PublicFormat.SubjectPublicKeyInfo))\n",
            s(&key),
            s(&public)
        );
        ok(Command::new(python())
            .args(["-c", &script])
            .output()
            .expect("python"));
    }
    (key, public)
}

fn model_signing_verifies_keel_signatures(on: Store) {
    let t = tempfile::tempdir().expect("tmp");
    let db = on.db(t.path());
    let m = model_dir(t.path());
    let store = format!("file://{}", t.path().join("store").display());
    ok(keel(
        &db,
        &[
            "register",
            "llama",
            "--path",
            s(&m),
            "--artifact-store",
            &store,
        ],
    ));
    // keel's own key, and an openssl-made one: both are accepted.
    ok(keel(
        &db,
        &[
            "keygen",
            "--private-key",
            s(&t.path().join("k.pem")),
            "--public-key",
            s(&t.path().join("k.pub")),
        ],
    ));
    ok(keel(
        &db,
        &["sign", "llama:1", "--key", s(&t.path().join("k.pem"))],
    ));
    let pulled = t.path().join("pulled");
    ok(keel(&db, &["pull", "llama:1", "--to", s(&pulled)]));
    let sig = pulled.join("model.sig");
    let o = model_signing(&[
        "verify",
        "key",
        "--signature",
        s(&sig),
        "--public_key",
        s(&t.path().join("k.pub")),
        "--ignore-paths",
        s(&sig),
        s(&pulled),
    ]);
    assert!(
        o.status.success(),
        "reference verifier rejected keel's signature: {}{}",
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr)
    );

    let (okey, opub) = openssl_key(t.path());
    ok(keel(
        &db,
        &[
            "register",
            "llama",
            "--path",
            s(&m),
            "--artifact-store",
            &store,
        ],
    ));
    ok(keel(&db, &["sign", "llama:2", "--key", s(&okey)]));
    let pulled2 = t.path().join("pulled2");
    ok(keel(&db, &["pull", "llama:2", "--to", s(&pulled2)]));
    let sig2 = pulled2.join("model.sig");
    let o = model_signing(&[
        "verify",
        "key",
        "--signature",
        s(&sig2),
        "--public_key",
        s(&opub),
        "--ignore-paths",
        s(&sig2),
        s(&pulled2),
    ]);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));

    // The reference tool also refuses a changed file and a wrong key.
    std::fs::write(pulled.join("config.json"), b"{\"hidden\": 65}\n").expect("w");
    let o = model_signing(&[
        "verify",
        "key",
        "--signature",
        s(&sig),
        "--public_key",
        s(&t.path().join("k.pub")),
        "--ignore-paths",
        s(&sig),
        s(&pulled),
    ]);
    assert!(!o.status.success());
    assert!(
        String::from_utf8_lossy(&o.stdout).contains("config.json")
            || String::from_utf8_lossy(&o.stderr).contains("config.json")
    );
    let o = model_signing(&[
        "verify",
        "key",
        "--signature",
        s(&sig2),
        "--public_key",
        s(&t.path().join("k.pub")),
        "--ignore-paths",
        s(&sig2),
        s(&pulled2),
    ]);
    assert!(!o.status.success());
}

#[test]
#[ignore = "needs Python tools: scripts/test installs them"]
fn keel_verifies_model_signing_signatures() {
    let t = tempfile::tempdir().expect("tmp");
    let db = Db::file(t.path().join("unused.db"));
    let m = model_dir(t.path());
    let (key, public) = openssl_key(t.path());
    let sig = m.join("model.sig");
    let o = model_signing(&[
        "sign",
        "key",
        "--private_key",
        s(&key),
        "--signature",
        s(&sig),
        s(&m),
    ]);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let out = ok(keel(
        &db,
        &[
            "verify",
            "--path",
            s(&m),
            "--signature",
            s(&sig),
            "--public-key",
            s(&public),
        ],
    ));
    assert!(
        out.contains("signature valid; 3 resources match (files serialization)"),
        "{out}"
    );

    // Shards serialization, through the reference library's API.
    let shard_sig = t.path().join("shards.sig");
    let script = format!(
        "from model_signing import signing, hashing\nsigning.Config().use_elliptic_key_signer(private_key={:?}).set_hashing_config(hashing.Config().use_shard_serialization(shard_size=65536)).sign({:?}, {:?})\n",
        s(&key), s(&m), s(&shard_sig)
    );
    ok(Command::new(python())
        .args(["-c", &script])
        .output()
        .expect("python"));
    let out = ok(keel(
        &db,
        &[
            "verify",
            "--path",
            s(&m),
            "--signature",
            s(&shard_sig),
            "--public-key",
            s(&public),
        ],
    ));
    assert!(out.contains("(shards serialization)"), "{out}");

    // One flipped byte is named (file and shard); another key is refused.
    let w = m.join("model.safetensors");
    let mut data = std::fs::read(&w).expect("r");
    data[200_000] ^= 0x40;
    std::fs::write(&w, data).expect("w");
    let o = keel(
        &db,
        &[
            "verify",
            "--path",
            s(&m),
            "--signature",
            s(&sig),
            "--public-key",
            s(&public),
        ],
    );
    assert_eq!(o.status.code(), Some(2));
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(err.contains("model.safetensors was modified"), "{err}");
    let o = keel(
        &db,
        &[
            "verify",
            "--path",
            s(&m),
            "--signature",
            s(&shard_sig),
            "--public-key",
            s(&public),
        ],
    );
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(
        err.contains("model.safetensors:196608:262144 was modified"),
        "{err}"
    );
    ok(keel(
        &db,
        &[
            "keygen",
            "--private-key",
            s(&t.path().join("o.pem")),
            "--public-key",
            s(&t.path().join("o.pub")),
        ],
    ));
    let o = keel(
        &db,
        &[
            "verify",
            "--path",
            s(&m),
            "--signature",
            s(&sig),
            "--public-key",
            s(&t.path().join("o.pub")),
        ],
    );
    assert_eq!(o.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&o.stderr).contains("not made with this public key"));
}

/// Kills the server when the test ends, passing or not.
struct Server(std::process::Child);

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// `keel model serve` on a free port: the server (killed when dropped)
/// and its URL.
fn serve(db: &Db) -> (Server, String) {
    serve_with(db, &[], None)
}

/// `keel model serve ARGS` on a free port, its stderr into `stderr` if
/// given.
fn serve_with(db: &Db, args: &[&str], stderr: Option<&Path>) -> (Server, String) {
    let err = match stderr {
        Some(p) => Stdio::from(std::fs::File::create(p).expect("stderr file")),
        None => Stdio::inherit(),
    };
    let mut child = db
        .command()
        .args(["serve", "--listen", "127.0.0.1:0"])
        .args(args)
        .env_remove("KEEL_CONFIG")
        .env_remove("KEEL_MLFLOW_TRACKING_URI")
        .stdout(Stdio::piped())
        .stderr(err)
        .spawn()
        .expect("serve");
    let stdout = child.stdout.take().expect("stdout");
    let server = Server(child);
    let mut line = String::new();
    BufReader::new(stdout).read_line(&mut line).expect("read");
    let url = line.trim().rsplit(' ').next().expect("url").to_owned();
    assert!(url.starts_with("http://127.0.0.1:"), "{line}");
    (server, url)
}

/// A write key for the MLflow client.
fn write_key(db: &Db) -> String {
    let created: serde_json::Value = serde_json::from_str(&ok(keel(
        db,
        &["--json", "keys", "create", "mlflow", "--role", "write"],
    )))
    .expect("json");
    created["secret"].as_str().expect("secret").to_owned()
}

/// The MLflow client loads models from keel by alias, number and
/// `latest`, downloads them with `mlflow.artifacts`, from the default
/// file:// store and from Azurite and S3 (reading them with its own
/// credentials), whether keel's CLI or the client registered them.
fn mlflow_client_loads_models_registered_in_keel(store: Store) {
    let azurite = keel_testkit::objects::ObjectService::azurite();
    let s3 = keel_testkit::objects::ObjectService::s3();
    let t = tempfile::tempdir().expect("tmp");
    let db = store.db(t.path()).with_default_store_of(t.path());
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/python/mlflow_load.py");
    let model = t.path().join("pyfunc-model");
    ok(Command::new(python())
        .arg(&script)
        .args(["save", s(&model)])
        .output()
        .expect("python"));
    // No artifact store configured: the default store beside the database.
    ok(keel(
        &db,
        &[
            "register",
            "adder",
            "--path",
            s(&model),
            "--run-id",
            "train-7",
            "--dataset",
            "s3://data/train#sha256:ab12",
            "--code-commit",
            "0123abc",
        ],
    ));
    ok(keel(
        &db,
        &[
            "alias",
            "set",
            "adder",
            "production",
            "1",
            "--reason",
            "first",
        ],
    ));
    let mut stored = Vec::new();
    for (svc, name) in [(&azurite, "adder-az"), (&s3, "adder-s3")] {
        let store = svc.url(&keel_testkit::objects::unique("mlflow-load"));
        ok(keel(
            &db,
            &[
                "register",
                name,
                "--path",
                s(&model),
                "--artifact-store",
                &store,
            ],
        ));
        stored.push(format!("{name}:1"));
    }
    let secret = write_key(&db);
    let (server, url) = serve(&db);
    let o = Command::new(python())
        .arg(&script)
        .args(["load", s(&model), "adder"])
        .args(&stored)
        .env("MLFLOW_TRACKING_URI", &url)
        .env("MLFLOW_REGISTRY_URI", &url)
        .env("MLFLOW_TRACKING_TOKEN", &secret)
        .env("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
        // The client reads S3 where the test server is.
        .env(
            "MLFLOW_S3_ENDPOINT_URL",
            std::env::var("AWS_ENDPOINT_URL").unwrap_or_default(),
        )
        .current_dir(t.path())
        .output()
        .expect("python");
    let out = ok(o);
    drop(server);
    let seen: serde_json::Value =
        serde_json::from_str(out.lines().last().unwrap_or("")).expect("json");
    for k in ["alias", "number", "latest", "client_alias"] {
        assert_eq!(seen[k], serde_json::json!([2, 42]), "{k}: {seen}");
    }
    let store = format!(
        "file://{}/reg-artifacts/adder/v1",
        std::path::absolute(t.path()).expect("abs").display()
    );
    assert_eq!(seen["v1_source"], store.as_str(), "{seen}");
    assert_eq!(seen["download_uri"], store.as_str(), "{seen}");
    assert_eq!(seen["latest_versions"], serde_json::json!(["1"]));
    // keel's lineage, as MLflow shows it.
    assert_eq!(seen["v1_run_id"], "train-7");
    let tags = &seen["v1_tags"];
    assert_eq!(tags["keel.dataset.0"], "s3://data/train");
    assert_eq!(tags["keel.dataset.0.digest"], "sha256:ab12");
    assert_eq!(tags["keel.code_commit"], "0123abc");
    assert!(
        tags["keel.manifest_digest"]
            .as_str()
            .is_some_and(|d| d.len() == 64),
        "{tags}"
    );
    assert_eq!(seen["download_same"], true);
    assert_eq!(seen["client_version"], "2");
    assert_eq!(seen["fluent_version"], "3");
    assert_eq!(seen["fluent"], serde_json::json!([2, 42]));
    assert_eq!(seen["client_run_id"], "run-from-client");
    let az = &seen["stored"]["adder-az:1"];
    assert!(
        az["source"].as_str().is_some_and(|s| s
            .starts_with("wasbs://keel-test@devstoreaccount1.blob.core.windows.net/mlflow-load-")),
        "{az}"
    );
    let s3v = &seen["stored"]["adder-s3:1"];
    assert!(
        s3v["source"]
            .as_str()
            .is_some_and(|s| s.starts_with("s3://keel-test/mlflow-load-")),
        "{s3v}"
    );
    for v in [az, s3v] {
        assert_eq!(v["download_same"], true, "{v}");
        assert_eq!(v["predict"], serde_json::json!([2, 42]), "{v}");
    }
    // The uploader's directory is recorded nowhere.
    let shown = ok(keel(&db, &["--json", "show", "adder:1"]));
    assert!(!shown.contains(s(&model)), "{shown}");
    let log: serde_json::Value =
        serde_json::from_str(&ok(keel(&db, &["--json", "audit", "log"]))).expect("json");
    for e in log["events"].as_array().expect("events") {
        if e["target"] == "adder:1" {
            assert!(
                !e["detail"].as_str().unwrap_or("").contains(s(&model)),
                "{e}"
            );
        }
    }
}

fn mlflow_client_works_against_keel_serve(on: Store) {
    let t = tempfile::tempdir().expect("tmp");
    let db = on.db(t.path());
    let created: serde_json::Value = serde_json::from_str(&ok(keel(
        &db,
        &["--json", "keys", "create", "mlflow", "--role", "write"],
    )))
    .expect("json");
    let secret = created["secret"].as_str().expect("secret").to_owned();
    let (server, url) = serve(&db);
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/python/mlflow_client.py");
    let o = Command::new(python())
        .arg(&script)
        .arg(&url)
        .env("MLFLOW_TRACKING_TOKEN", &secret)
        .env("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
        .output()
        .expect("python");
    let out = ok(o);
    let seen: serde_json::Value =
        serde_json::from_str(out.lines().last().unwrap_or("")).expect("json");
    assert_eq!(seen["versions"], serde_json::json!(["1", "2"]));
    assert_eq!(seen["by_run"], serde_json::json!(["1"]));
    assert_eq!(seen["models"], serde_json::json!(["mlf-model"]));
    assert_eq!(seen["aliases"]["champion"], "2");
    assert_eq!(seen["v1_tags"]["k"], "v");
    assert_eq!(seen["alias_deleted"], true);
    assert_eq!(seen["duplicate"], "RESOURCE_ALREADY_EXISTS");
    assert_eq!(seen["newest"], serde_json::json!(["2"]));
    assert_eq!(seen["ascending"], serde_json::json!(["1", "2"]));
    assert_eq!(seen["default_order"], serde_json::json!(["2", "1"]));
    assert_eq!(
        seen["models_desc"],
        serde_json::json!(["mlf-other", "mlf-model"])
    );
    assert_eq!(
        seen["models_by_time"],
        serde_json::json!(["mlf-other", "mlf-model"])
    );
    assert_eq!(
        seen["client_errors"],
        serde_json::json!({
            "slash_name": "INVALID_PARAMETER_VALUE",
            "colon_name": "INVALID_PARAMETER_VALUE",
            "too_large": "INVALID_PARAMETER_VALUE",
            "missing_version": "RESOURCE_DOES_NOT_EXIST",
            "missing_model": "RESOURCE_DOES_NOT_EXIST",
        })
    );
    let ch = &seen["changes"];
    assert_eq!(ch["model_description"], "updated");
    assert_eq!(ch["v1_description"], "v1 notes");
    assert_eq!(ch["v1_updated_description"], "v1 notes");
    assert_eq!(ch["renamed"], "mlf-other2");
    for (k, code, text) in [
        ("rename_with_versions", "INVALID_STATE", "alias history"),
        ("delete_version", "INVALID_STATE", "never deleted"),
        (
            "transition",
            "NOT_IMPLEMENTED",
            "set_registered_model_alias",
        ),
        ("lineage_tag", "INVALID_PARAMETER_VALUE", "lineage"),
    ] {
        assert_eq!(ch[k][0], code, "{k}: {ch}");
        assert!(
            ch[k][1].as_str().is_some_and(|m| m.contains(text)),
            "{k}: {ch}"
        );
    }
    for (k, code) in seen["order_errors"].as_object().expect("errors") {
        assert_eq!(code, "INVALID_PARAMETER_VALUE", "{k}");
    }
    // Without the token the client is refused.
    let o = Command::new(python())
        .arg(&script)
        .arg(&url)
        .env_remove("MLFLOW_TRACKING_TOKEN")
        .env("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
        .output()
        .expect("python");
    assert!(!o.status.success());
    drop(server);
    // What the client did is in keel's history and audit log.
    let h = ok(keel(&db, &["history", "mlf-model"]));
    assert!(h.contains("key:mlflow"), "{h}");
    assert!(ok(keel(&db, &["audit", "verify"])).ends_with("ok\n"));
}

/// A real `mlflow server` from the Python tools (SQLite backend store,
/// artifacts in a local directory) on a free loopback port, in a process
/// group of its own: dropping it kills the server and its workers.
struct MlflowServer {
    child: std::process::Child,
    url: String,
}

impl MlflowServer {
    fn start(dir: &Path) -> Self {
        use std::os::unix::process::CommandExt;
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .and_then(|l| l.local_addr())
            .expect("free port")
            .port();
        let log_path = dir.join("mlflow-server.log");
        let log = std::fs::File::create(&log_path).expect("log");
        let child = Command::new(python())
            .args(["-m", "mlflow", "server", "--backend-store-uri"])
            .arg(format!("sqlite:///{}", s(&dir.join("mlflow.db"))))
            .arg("--default-artifact-root")
            .arg(format!("file://{}", s(&dir.join("mlflow-artifacts"))))
            .args(["--host", "127.0.0.1", "--port", &port.to_string()])
            .args(["--workers", "1"])
            .env("MLFLOW_DISABLE_TELEMETRY", "true")
            .env("DO_NOT_TRACK", "true")
            .current_dir(dir)
            .stdin(Stdio::null())
            .stdout(log.try_clone().expect("log"))
            .stderr(log)
            .process_group(0)
            .spawn()
            .expect("start mlflow server");
        let mut server = Self {
            child,
            url: format!("http://127.0.0.1:{port}"),
        };
        // Starting imports much of MLflow: allow for a busy machine (over
        // 180 s at a load average of 15 on 2 cores).
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(300);
        while !healthy(port) {
            let exited = server.child.try_wait().expect("wait").is_some();
            if exited || std::time::Instant::now() > deadline {
                panic!(
                    "mlflow server did not start ({}):\n{}",
                    if exited {
                        "it exited"
                    } else {
                        "no answer in 300 s"
                    },
                    std::fs::read_to_string(&log_path).unwrap_or_default()
                );
            }
            std::thread::sleep(std::time::Duration::from_millis(500));
        }
        server
    }
}

impl Drop for MlflowServer {
    fn drop(&mut self) {
        let _ = Command::new("kill")
            .args(["-KILL", "--", &format!("-{}", self.child.id())])
            .status();
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Whether `GET /health` on the loopback port answers 200.
fn healthy(port: u16) -> bool {
    use std::io::{Read, Write};
    let Ok(mut c) = std::net::TcpStream::connect(("127.0.0.1", port)) else {
        return false;
    };
    let _ = c.set_read_timeout(Some(std::time::Duration::from_secs(5)));
    let mut answer = String::new();
    c.write_all(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n")
        .is_ok()
        && c.read_to_string(&mut answer).is_ok()
        && answer.starts_with("HTTP/1.1 200")
}

/// MLflow 3's `log_model(..., registered_model_name=...)`, with a real
/// MLflow tracking server and keel as the registry: the client sends keel
/// no run id, and keel asks the tracking server for the logged model's
/// run. When the tracking server is not configured, does not know the
/// model or is down, the version is still created, without a run, and
/// keel warns.
fn log_model_versions_carry_their_run_from_the_tracking_server(store: Store) {
    let t = tempfile::tempdir().expect("tmp");
    let db = store.db(t.path());
    let secret = write_key(&db);
    let mlflow = MlflowServer::start(t.path());
    let warnings = t.path().join("keel-serve.err");
    let (server, url) = serve_with(&db, &["--tracking-uri", &mlflow.url], Some(&warnings));
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/python/mlflow_log_model.py");
    let tracking = mlflow.url.clone();
    let client = |registry: &str, args: &[&str]| -> serde_json::Value {
        let o = Command::new(python())
            .arg(&script)
            .args(args)
            .env("MLFLOW_TRACKING_URI", &tracking)
            .env("MLFLOW_REGISTRY_URI", registry)
            .env("MLFLOW_TRACKING_TOKEN", &secret)
            .env("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
            .env("MLFLOW_DISABLE_TELEMETRY", "true")
            .env("DO_NOT_TRACK", "true")
            .current_dir(t.path())
            .output()
            .expect("python");
        let out = ok(o);
        serde_json::from_str(out.lines().last().unwrap_or("")).expect("json")
    };

    let logged = client(&url, &["log", "logged"]);
    let run_id = logged["run_id"].as_str().expect("run id").to_owned();
    let model_id = logged["model_id"].as_str().expect("model id").to_owned();
    assert!(!run_id.is_empty() && model_id.starts_with("m-"), "{logged}");
    assert_eq!(logged["logged_model_run_id"], run_id.as_str(), "{logged}");
    assert_eq!(logged["version"], "1", "{logged}");
    assert_eq!(logged["version_run_id"], run_id.as_str(), "{logged}");
    assert_eq!(
        logged["version_source"],
        format!("models:/{model_id}").as_str()
    );
    let shown: serde_json::Value =
        serde_json::from_str(&ok(keel(&db, &["--json", "show", "logged:1"]))).expect("json");
    assert!(shown.to_string().contains(&run_id), "{shown}");

    // A logged model the tracking server does not know.
    let unknown = client(
        &url,
        &["register", "logged", "m-00000000000000000000000000000000"],
    );
    assert_eq!(unknown["version"], "2", "{unknown}");
    assert_eq!(unknown["version_run_id"], "", "{unknown}");

    // A keel with no tracking server configured.
    let bare_warnings = t.path().join("keel-bare.err");
    let (bare, bare_url) = serve_with(&db, &[], Some(&bare_warnings));
    let bare_version = client(&bare_url, &["register", "logged", &model_id]);
    assert_eq!(bare_version["version"], "3", "{bare_version}");
    assert_eq!(bare_version["version_run_id"], "", "{bare_version}");
    drop(bare);

    // The tracking server down.
    drop(mlflow);
    let down = client(&url, &["register", "logged", &model_id]);
    assert_eq!(down["version"], "4", "{down}");
    assert_eq!(down["version_run_id"], "", "{down}");
    drop(server);

    let warned = std::fs::read_to_string(&warnings).expect("stderr");
    assert!(
        warned.contains("does not know this logged model"),
        "{warned}"
    );
    assert!(
        warned.contains("cannot reach the tracking server"),
        "{warned}"
    );
    assert_eq!(warned.matches("WARN").count(), 2, "{warned}");
    let warned = std::fs::read_to_string(&bare_warnings).expect("stderr");
    assert!(
        warned.contains("no MLflow tracking server is configured"),
        "{warned}"
    );
    assert!(ok(keel(&db, &["audit", "verify"])).ends_with("ok\n"));
}
