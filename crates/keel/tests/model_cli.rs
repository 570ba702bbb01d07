//! `keel model` end to end through the binary: registration from a
//! directory and from storage, aliases, pull, verify, tampering with a
//! stored byte and with the history, concurrent registrations from several
//! processes, bad input and exit codes.

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

use serde_json::Value;

struct Env {
    dir: tempfile::TempDir,
    /// A PostgreSQL database instead of the SQLite file `reg.db`.
    pg: Option<keel_testkit::pg::PgDb>,
}

/// `name::sqlite` and `name::postgres`: the test `name(env)` on each
/// store (the PostgreSQL one needs scripts/services/postgres, which
/// scripts/test starts).
macro_rules! on_both_stores {
    ($($name:ident),* $(,)?) => {$(
        mod $name {
            #[test]
            fn sqlite() {
                super::$name(super::Env::new())
            }
            #[test]
            #[ignore = "needs PostgreSQL: scripts/services/postgres (scripts/test starts it)"]
            fn postgres() {
                super::$name(super::Env::postgres())
            }
        }
    )*};
}

on_both_stores!(
    register_alias_pull_verify_end_to_end,
    an_edited_history_row_is_named_by_audit_verify,
    concurrent_registrations_from_several_processes_get_gapless_numbers,
);

impl Env {
    /// The registry on a throwaway PostgreSQL database, over TLS.
    fn postgres() -> Env {
        let mut e = Env::new();
        e.pg = Some(keel_testkit::pg::PgDb::create());
        e
    }

    /// The registry's database: the file's path or the URL.
    fn db(&self) -> String {
        match &self.pg {
            Some(pg) => pg.url.clone(),
            None => self.path("reg.db").display().to_string(),
        }
    }

    /// `keel model --db DB`, with the database's password and CA.
    fn command(&self) -> Command {
        let mut c = Command::new(env!("CARGO_BIN_EXE_keel"));
        c.args(["model", "--db", &self.db()]);
        if let Some(pg) = &self.pg {
            c.env("KEEL_MODEL_DB_PASSWORD", &pg.password)
                .env("KEEL_MODEL_DB_CA_FILE", &pg.ca);
        }
        c
    }

    /// Statements beneath the registry, as someone with the database's
    /// password could run them.
    fn tamper(&self, sqlite: &str, postgres: &str) {
        match &self.pg {
            Some(pg) => pg.execute(postgres).expect("edit"),
            None => rusqlite::Connection::open(self.path("reg.db"))
                .expect("open")
                .execute_batch(sqlite)
                .expect("edit"),
        }
    }

    fn new() -> Env {
        let dir = tempfile::tempdir().expect("tmp");
        let m = dir.path().join("model");
        std::fs::create_dir_all(m.join("tok")).expect("mkdir");
        std::fs::write(m.join("weights.safetensors"), vec![7u8; 70_000]).expect("w");
        std::fs::write(m.join("config.json"), b"{\"layers\": 2}\n").expect("w");
        std::fs::write(m.join("tok/vocab.txt"), b"a\nb\n").expect("w");
        Env { dir, pg: None }
    }

    fn path(&self, rel: &str) -> PathBuf {
        self.dir.path().join(rel)
    }

    fn keel(&self, args: &[&str]) -> Output {
        self.command()
            .args(args)
            .env(
                "KEEL_ARTIFACT_STORE",
                format!("file://{}", self.path("store").display()),
            )
            .env("KEEL_ACTOR", "tester")
            .env_remove("KEEL_CONFIG")
            .env("HOME", self.dir.path())
            .output()
            .expect("run keel")
    }

    fn ok(&self, args: &[&str]) -> String {
        let o = self.keel(args);
        assert!(
            o.status.success(),
            "keel model {args:?}: {}\n{}",
            String::from_utf8_lossy(&o.stdout),
            String::from_utf8_lossy(&o.stderr)
        );
        String::from_utf8_lossy(&o.stdout).into_owned()
    }

    fn json(&self, args: &[&str]) -> Value {
        let mut a = vec!["--json"];
        a.extend_from_slice(args);
        serde_json::from_str(&self.ok(&a)).expect("json")
    }

    /// Exit code and stderr of a failing call.
    fn fails(&self, args: &[&str]) -> (i32, String) {
        let o = self.keel(args);
        assert!(!o.status.success(), "keel model {args:?} succeeded");
        (
            o.status.code().unwrap_or(-1),
            String::from_utf8_lossy(&o.stderr).into_owned(),
        )
    }
}

fn s(p: &Path) -> &str {
    p.to_str().expect("utf8")
}

/// A fresh machine: no config file, no KEEL_ARTIFACT_STORE. `register
/// --path` uploads to the directory beside the database and `pull` reads it
/// back.
#[test]
fn register_and_pull_work_with_no_configuration() {
    let e = Env::new();
    let run = |args: &[&str]| {
        Command::new(env!("CARGO_BIN_EXE_keel"))
            .arg("model")
            .args(args)
            .env_remove("KEEL_ARTIFACT_STORE")
            .env_remove("KEEL_MODEL_DB")
            .env_remove("KEEL_CONFIG")
            .env_remove("XDG_DATA_HOME")
            .env("HOME", e.path("home"))
            .env("KEEL_ACTOR", "tester")
            .output()
            .expect("run keel")
    };
    let ok = |args: &[&str]| {
        let o = run(args);
        assert!(
            o.status.success(),
            "keel model {args:?}: {}",
            String::from_utf8_lossy(&o.stderr)
        );
        String::from_utf8_lossy(&o.stdout).into_owned()
    };
    let out = ok(&["--json", "register", "m", "--path", s(&e.path("model"))]);
    let v: Value = serde_json::from_str(&out).expect("json");
    let data = e.path("home/.local/share/keel");
    assert_eq!(
        v["model_version"]["artifact_url"],
        format!("file://{}/registry-artifacts/m/v1", data.display())
    );
    assert!(data.join("registry-artifacts/m/v1/config.json").is_file());
    ok(&["pull", "m:1", "--to", s(&e.path("out"))]);
    assert_eq!(
        std::fs::read(e.path("out/weights.safetensors")).expect("pulled"),
        vec![7u8; 70_000]
    );
    // --db moves the default store beside that database.
    let db = e.path("elsewhere/reg.db");
    ok(&[
        "--db",
        s(&db),
        "register",
        "m",
        "--path",
        s(&e.path("model")),
    ]);
    assert!(e.path("elsewhere/reg-artifacts/m/v1/config.json").is_file());
    let cfg = ok(&["--db", s(&db), "--print-config"]);
    assert!(
        cfg.contains(&format!(
            "file://{}",
            e.path("elsewhere/reg-artifacts").display()
        )),
        "{cfg}"
    );
}

fn register_alias_pull_verify_end_to_end(e: Env) {
    let m = e.path("model");
    let v1 = e.json(&[
        "register",
        "llama",
        "--path",
        s(&m),
        "--run-id",
        "job-42",
        "--dataset",
        "s3://data/train#sha256:abcd",
        "--code-commit",
        "0123abc",
        "--tag",
        "stage=dev",
    ]);
    let v1 = &v1["model_version"];
    assert_eq!(v1["version"], 1);
    assert_eq!(v1["status"], "READY");
    assert_eq!(v1["files"].as_array().map(Vec::len), Some(3));
    assert_eq!(v1["lineage"]["run_id"], "job-42");
    assert_eq!(v1["lineage"]["datasets"][0]["digest"], "sha256:abcd");
    let url = v1["artifact_url"].as_str().expect("url").to_owned();
    assert!(url.ends_with("/llama/v1"), "{url}");

    // The same files registered again from storage: same digest, next number.
    let v2 = e.json(&["register", "llama", "--from", &url, "--parent", "1"]);
    assert_eq!(v2["model_version"]["version"], 2);
    assert_eq!(
        v2["model_version"]["manifest_digest"],
        v1["manifest_digest"]
    );

    e.ok(&[
        "alias",
        "set",
        "llama",
        "production",
        "1",
        "--reason",
        "first",
    ]);
    e.ok(&[
        "alias",
        "set",
        "llama",
        "production",
        "2",
        "--reason",
        "second",
    ]);
    let rb = e.json(&["rollback", "llama", "production", "--reason", "bad canary"]);
    assert_eq!(rb["event"]["new_version"], 1);
    let h = e.json(&["history", "llama", "production"]);
    assert_eq!(h["events"].as_array().map(Vec::len), Some(3));
    assert_eq!(h["events"][2]["reason"], "bad canary");
    assert_eq!(h["events"][2]["actor"], "tester");
    let shown = e.ok(&["show", "llama@production"]);
    assert!(
        shown.contains("llama:1 | READY | aliases production"),
        "{shown}"
    );
    assert!(
        shown.contains("job-42") && shown.contains("weights.safetensors"),
        "{shown}"
    );
    let ls = e.ok(&["ls"]);
    assert!(ls.contains("production=1"), "{ls}");

    e.ok(&[
        "keygen",
        "--private-key",
        s(&e.path("k.pem")),
        "--public-key",
        s(&e.path("k.pub")),
    ]);
    e.ok(&["sign", "llama:1", "--key", s(&e.path("k.pem"))]);
    let out = e.path("pulled");
    e.ok(&["pull", "llama@production", "--to", s(&out)]);
    assert_eq!(
        std::fs::read(out.join("weights.safetensors")).expect("read"),
        vec![7u8; 70_000]
    );
    assert!(out.join("model.sig").exists());
    let v = e.json(&[
        "verify",
        "llama@production",
        "--public-key",
        s(&e.path("k.pub")),
    ]);
    assert_eq!(v["ok"], true, "{v}");
    let d = e.ok(&[
        "verify",
        "--path",
        s(&out),
        "--signature",
        s(&out.join("model.sig")),
        "--public-key",
        s(&e.path("k.pub")),
    ]);
    assert!(d.contains("signature valid; 3 resources match"), "{d}");

    // Another key: the signature is not accepted.
    e.ok(&[
        "keygen",
        "--private-key",
        s(&e.path("o.pem")),
        "--public-key",
        s(&e.path("o.pub")),
    ]);
    let (code, err) = e.fails(&["verify", "llama:1", "--public-key", s(&e.path("o.pub"))]);
    assert_eq!(code, 2, "{err}");
    assert!(err.contains("not made with this public key"), "{err}");
    let (code, err) = e.fails(&[
        "verify",
        "--path",
        s(&out),
        "--signature",
        s(&out.join("model.sig")),
        "--public-key",
        s(&e.path("o.pub")),
    ]);
    assert_eq!(code, 2, "{err}");

    // A local file changed after the pull is named.
    std::fs::write(out.join("tok/vocab.txt"), b"a\nc\n").expect("w");
    let (code, err) = e.fails(&[
        "verify",
        "--path",
        s(&out),
        "--signature",
        s(&out.join("model.sig")),
        "--public-key",
        s(&e.path("k.pub")),
    ]);
    assert_eq!(code, 2, "{err}");
    assert!(err.contains("tok/vocab.txt was modified"), "{err}");

    // Backup and restore into another database of the same kind (from
    // PostgreSQL too, a backup is a SQLite registry file).
    let url = format!("file://{}/backups/reg.db", e.path("").display());
    let b = e.json(&["backup", &url]);
    assert_eq!(b["audit_events"].as_u64().map(|n| n > 0), Some(true), "{b}");
    let target = match &e.pg {
        Some(_) => Env {
            dir: tempfile::tempdir().expect("tmp"),
            pg: Some(keel_testkit::pg::PgDb::create()),
        },
        None => Env {
            dir: tempfile::tempdir().expect("tmp"),
            pg: None,
        },
    };
    let o = target.keel(&["restore", &url]);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let a = target.ok(&["audit", "verify"]);
    assert!(a.ends_with("ok\n"), "{a}");
    // The restore is audited, naming the backup it came from.
    let log = target.json(&["audit", "log"]);
    let last = log["events"]
        .as_array()
        .and_then(|e| e.last())
        .expect("an event")
        .clone();
    assert_eq!(last["action"], "registry.restore", "{last}");
    let detail: Value =
        serde_json::from_str(last["detail"].as_str().expect("detail")).expect("detail is JSON");
    assert_eq!(detail["from"], url.as_str(), "{detail}");
    // The backup's temporary copy is gone.
    let left: Vec<_> = std::fs::read_dir(e.path(""))
        .expect("ls")
        .flatten()
        .filter(|f| {
            f.file_name()
                .to_string_lossy()
                .starts_with(".keel-registry-")
        })
        .collect();
    assert!(left.is_empty(), "{left:?}");
    // Into a registry that holds data: refused without --force, and on
    // PostgreSQL refused with what to do instead.
    let (code, err) = target.fails(&["restore", &url]);
    assert_eq!(code, 64, "{err}");
    if e.pg.is_some() {
        assert!(err.contains("empty database"), "{err}");
        let (code, err) = target.fails(&["restore", &url, "--force"]);
        assert_eq!(code, 64, "{err}");
        assert!(err.contains("empty database"), "{err}");
    } else {
        assert!(err.contains("use force"), "{err}");
    }
    let a = e.ok(&["audit", "verify"]);
    assert!(a.ends_with("ok\n"), "{a}");
}

#[test]
fn a_changed_stored_byte_is_named_and_pull_leaves_nothing() {
    let e = Env::new();
    e.ok(&["register", "m", "--path", s(&e.path("model"))]);
    let stored = e.path("store/m/v1/weights.safetensors");
    let mut data = std::fs::read(&stored).expect("read");
    data[12_345] ^= 1;
    std::fs::write(&stored, data).expect("write");
    let (code, err) = e.fails(&["verify", "m:1"]);
    assert_eq!(code, 2, "{err}");
    assert!(
        err.contains("weights.safetensors: content changed"),
        "{err}"
    );
    let (code, err) = e.fails(&["pull", "m:1", "--to", s(&e.path("out"))]);
    assert_eq!(code, 2, "{err}");
    assert!(err.contains("weights.safetensors"), "{err}");
    assert!(!e.path("out").exists());
}

fn an_edited_history_row_is_named_by_audit_verify(e: Env) {
    e.ok(&["register", "m", "--path", s(&e.path("model"))]);
    e.ok(&["register", "m", "--path", s(&e.path("model"))]);
    for (v, r) in [("1", "a"), ("2", "b"), ("1", "c")] {
        e.ok(&["alias", "set", "m", "prod", v, "--reason", r]);
    }
    e.tamper(
        "DROP TRIGGER alias_events_no_update; UPDATE alias_events SET actor = 'mallory' WHERE seq = 2;",
        "DROP TRIGGER alias_events_no_update ON alias_events; UPDATE alias_events SET actor = 'mallory' WHERE seq = 2;",
    );
    let o = e.keel(&["audit", "verify"]);
    assert_eq!(o.status.code(), Some(2));
    let text = String::from_utf8_lossy(&o.stdout);
    assert!(
        text.contains(
            "BROKEN alias history at event #2: event #2 was changed after it was written"
        ),
        "{text}"
    );
    let o = e.keel(&["--json", "audit", "verify"]);
    assert_eq!(o.status.code(), Some(2));
    let j: Value = serde_json::from_slice(&o.stdout).expect("json");
    assert_eq!(j["ok"], false);
    assert_eq!(j["report"]["breaks"][0]["seq"], 2);
}

fn concurrent_registrations_from_several_processes_get_gapless_numbers(e: Env) {
    let v = e.json(&["register", "m", "--path", s(&e.path("model"))]);
    let url = v["model_version"]["artifact_url"]
        .as_str()
        .expect("url")
        .to_owned();
    let procs = 8;
    let children: Vec<_> = (0..procs)
        .map(|_| {
            e.command()
                .args(["--json", "register", "m", "--from", &url])
                .env("KEEL_ACTOR", "racer")
                .stdout(std::process::Stdio::piped())
                .stderr(std::process::Stdio::piped())
                .spawn()
                .expect("spawn")
        })
        .collect();
    let mut numbers: Vec<u64> = children
        .into_iter()
        .map(|c| {
            let o = c.wait_with_output().expect("wait");
            assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
            let v: Value = serde_json::from_slice(&o.stdout).expect("json");
            v["model_version"]["version"].as_u64().expect("n")
        })
        .collect();
    numbers.sort_unstable();
    assert_eq!(numbers, (2..=procs as u64 + 1).collect::<Vec<_>>());
    let all = e.json(&["show", "m"]);
    assert_eq!(all["versions"].as_array().map(Vec::len), Some(procs + 1));
    assert!(e.ok(&["audit", "verify"]).ends_with("ok\n"));
}

const ED25519: &str = "-----BEGIN PRIVATE KEY-----\nMC4CAQAwBQYDK2VwBCIEIOtkPHJsyinizeny486mQ4SiECU9EPFzI5JPaFPLhFZ0\n-----END PRIVATE KEY-----\n";
const P384: &str = "-----BEGIN EC PRIVATE KEY-----\nMIGkAgEBBDD4Kz4cxlpoM1ukV7PZ81QMzagBLsXnaWyTeP6A5Tjics/OY9Ilgs0y\nWldUy0ZiG3SgBwYFK4EEACKhZANiAAROwPsaKGPTXtAdEAYPzAWcmp8FWw3lysH/\nHMU91dmg4WAcxYWHFasrr7LRs4xkYkGh6NAd1FiDwiWWx2KuPlbuqrw4HIRl359p\nnU6wjEGE+/l3tikuEfNF7GDPkhSp5lg=\n-----END EC PRIVATE KEY-----\n";

#[test]
fn bad_input_gets_clear_errors_and_exit_codes() {
    let e = Env::new();
    e.ok(&["register", "m", "--path", s(&e.path("model"))]);
    let cases: &[(&[&str], i32, &str)] = &[
        (&["show", "nope"], 64, "no model named \"nope\""),
        (&["show", "m:7"], 64, "has no version 7"),
        (&["show", "m:abc"], 64, "invalid version \"abc\""),
        (&["show", "m@prod"], 64, "has no alias \"prod\""),
        (
            &["alias", "set", "m", "prod", "0", "--reason", "x"],
            64,
            "invalid version",
        ),
        (
            &["alias", "set", "nope", "prod", "1", "--reason", "x"],
            64,
            "no model named",
        ),
        (&["rollback", "m", "prod"], 64, "no alias"),
        (
            &["register", "bad name", "--path", "/tmp"],
            64,
            "invalid model name",
        ),
        (
            &["register", "team/m", "--path", "/tmp"],
            64,
            "may not contain `/` or `:`",
        ),
        (
            &["register", "m", "--path", "/nonexistent-keel-dir/x"],
            64,
            "not a directory",
        ),
        (&["pull", "m:1", "--to", "/"], 64, "not an empty directory"),
    ];
    for (args, code, text) in cases {
        let (c, err) = e.fails(args);
        assert_eq!(c, *code, "{args:?}: {err}");
        assert!(err.contains(text), "{args:?}: {err}");
    }
    let keys: &[(&str, &str, i32, &str)] = &[
        ("garbage.pem", "not a key\n", 65, "not a PEM file"),
        ("ed25519.pem", ED25519, 65, "wrong key type: Ed25519"),
        (
            "p384.pem",
            P384,
            65,
            "wrong key type: EC key on curve secp384r1",
        ),
        (
            "truncated.pem",
            "-----BEGIN EC PRIVATE KEY-----\nMHcCAQEEI\n-----END EC PRIVATE KEY-----\n",
            65,
            "malformed EC PRIVATE KEY",
        ),
        (
            "encrypted.pem",
            "-----BEGIN ENCRYPTED PRIVATE KEY-----\nMIIB\n-----END ENCRYPTED PRIVATE KEY-----\n",
            65,
            "encrypted",
        ),
    ];
    for (name, pem, code, text) in keys {
        std::fs::write(e.path(name), pem).expect("w");
        let (c, err) = e.fails(&["sign", "m:1", "--key", s(&e.path(name))]);
        assert_eq!(c, *code, "{name}: {err}");
        assert!(err.contains(text), "{name}: {err}");
    }
    let (c, err) = e.fails(&["sign", "m:1", "--key", s(&e.path("missing.pem"))]);
    assert_eq!(c, 74, "{err}");
    // A private key given where the public key belongs.
    e.ok(&[
        "keygen",
        "--private-key",
        s(&e.path("k.pem")),
        "--public-key",
        s(&e.path("k.pub")),
    ]);
    let (c, err) = e.fails(&["verify", "m:1", "--public-key", s(&e.path("k.pem"))]);
    assert_eq!(c, 65, "{err}");
    assert!(err.contains("this is a private key"), "{err}");
    // An unsigned version checked against a trusted key fails.
    let (c, err) = e.fails(&["verify", "m:1", "--public-key", s(&e.path("k.pub"))]);
    assert_eq!(c, 2, "{err}");
    assert!(err.contains("is not signed"), "{err}");
    // keygen never overwrites.
    let (c, _) = e.fails(&[
        "keygen",
        "--private-key",
        s(&e.path("k.pem")),
        "--public-key",
        s(&e.path("x.pub")),
    ]);
    assert_eq!(c, 64);
}

/// Every file under `dir` with its bytes, by path relative to `dir`.
fn tree(dir: &Path) -> Vec<(PathBuf, Vec<u8>)> {
    fn walk(root: &Path, dir: &Path, out: &mut Vec<(PathBuf, Vec<u8>)>) {
        for entry in std::fs::read_dir(dir).expect("read_dir") {
            let p = entry.expect("entry").path();
            if p.is_dir() {
                walk(root, &p, out);
            } else {
                let rel = p.strip_prefix(root).expect("under root").to_owned();
                out.push((rel, std::fs::read(&p).expect("read")));
            }
        }
    }
    let mut out = Vec::new();
    walk(dir, dir, &mut out);
    out.sort();
    out
}

#[test]
fn a_version_already_in_the_artifact_store_is_never_written_over() {
    let e = Env::new();
    e.ok(&["register", "m", "--path", s(&e.path("model"))]);
    let v1 = e.path("store/m/v1");
    let before = tree(&v1);
    assert!(before.iter().any(|(p, _)| p == Path::new("manifest.json")));
    // A fresh database numbers from 1 again, into the same store.
    for f in ["reg.db", "reg.db-wal", "reg.db-shm"] {
        let _ = std::fs::remove_file(e.path(f));
    }
    std::fs::write(e.path("model/weights.safetensors"), b"other weights").expect("w");
    std::fs::write(e.path("model/extra.bin"), b"extra").expect("w");
    let (c, err) = e.fails(&["register", "m", "--path", s(&e.path("model"))]);
    assert_eq!(c, 64, "{err}");
    let url = format!("file://{}", v1.display());
    assert!(
        err.contains(&format!("{url} already holds a version")),
        "{err}"
    );
    assert!(err.contains("FAILED_REGISTRATION"), "{err}");
    assert_eq!(tree(&v1), before, "the stored version is unchanged");
    let v = e.json(&["show", "m:1"]);
    assert_eq!(v["model_version"]["status"], "FAILED_REGISTRATION", "{v}");
}

#[test]
fn a_destination_another_upload_claimed_is_never_written_into() {
    let e = Env::new();
    // Another registry database is uploading its version 1 into the same
    // store: its claim is there, its manifest not yet.
    let v1 = e.path("store/m/v1");
    std::fs::create_dir_all(&v1).expect("mkdir");
    std::fs::write(v1.join(".keel-claim"), b"m:1 by alice on node-a, pid 7\n").expect("w");
    let before = tree(&v1);
    let (c, err) = e.fails(&["register", "m", "--path", s(&e.path("model"))]);
    assert_eq!(c, 64, "{err}");
    assert!(err.contains("another upload claimed"), "{err}");
    assert!(err.contains("m:1 by alice on node-a, pid 7"), "{err}");
    assert!(err.contains("FAILED_REGISTRATION"), "{err}");
    assert_eq!(tree(&v1), before, "nothing was written beside the claim");
    // The next number goes to a fresh destination, and claims it.
    let v = e.json(&["register", "m", "--path", s(&e.path("model"))]);
    assert_eq!(v["model_version"]["version"], 2, "{v}");
    let claim = std::fs::read_to_string(e.path("store/m/v2/.keel-claim")).expect("claim");
    assert!(claim.starts_with("m:2 by tester on "), "{claim}");
    e.ok(&["verify", "m:2"]);
    // A directory holding keel's own top-level names is refused before a
    // number is taken.
    for reserved in ["manifest.json", ".keel-claim"] {
        std::fs::write(e.path("model").join(reserved), b"{}").expect("w");
        let (c, err) = e.fails(&["register", "m", "--path", s(&e.path("model"))]);
        assert_eq!(c, 64, "{err}");
        assert!(
            err.contains(reserved) && err.contains("subdirectory"),
            "{err}"
        );
        std::fs::remove_file(e.path("model").join(reserved)).expect("rm");
    }
    let (_, err) = e.fails(&["show", "m:3"]);
    assert!(
        err.contains("has no version 3"),
        "no number was taken: {err}"
    );
}

#[test]
fn registering_a_checkpoint_reuses_its_manifest_and_pins_it() {
    let e = Env::new();
    let ckpts = format!("file://{}", e.path("ckpts").display());
    let push = Command::new(env!("CARGO_BIN_EXE_keel"))
        .args(["ckpt", "push"])
        .arg(e.path("model"))
        .args(["--to", &ckpts, "--run", "pretrain", "--step", "100"])
        .output()
        .expect("push");
    assert!(
        push.status.success(),
        "{}",
        String::from_utf8_lossy(&push.stderr)
    );
    let register = |step: &'static str| {
        [
            "register",
            "llama",
            "--from-ckpt",
            ckpts.as_str(),
            "--run",
            "pretrain",
            "--step",
            step,
        ]
    };
    let v = e.json(&register("100"));
    let v = &v["model_version"];
    assert_eq!(v["version"], 1);
    let link = &v["lineage"]["checkpoint"];
    assert_eq!(link["run"], "pretrain");
    assert_eq!(link["step"], 100);
    // The version's digest is the checkpoint's: same files, same digest.
    assert_eq!(v["manifest_digest"], link["manifest_digest"]);
    assert_eq!(v["lineage"]["run_id"], "pretrain");
    // The files are read where the checkpoint keeps them, verified.
    let out = e.path("pulled");
    e.ok(&["pull", "llama:1", "--to", s(&out)]);
    assert_eq!(
        std::fs::read(out.join("tok/vocab.txt")).expect("read"),
        b"a\nb\n"
    );
    // Pinned, so checkpoint GC keeps it.
    let ls = Command::new(env!("CARGO_BIN_EXE_keel"))
        .args(["ckpt", "ls", &ckpts, "--run", "pretrain"])
        .output()
        .expect("ls");
    let text = String::from_utf8_lossy(&ls.stdout);
    assert!(
        text.contains("pinned (registered as model version llama:1)"),
        "{text}"
    );
    // A newer step, then GC keeping one: the registered step stays.
    let run = |args: &[&str]| {
        let o = Command::new(env!("CARGO_BIN_EXE_keel"))
            .args(args)
            .output()
            .expect("run");
        assert!(
            o.status.success(),
            "{args:?}: {}",
            String::from_utf8_lossy(&o.stderr)
        );
    };
    run(&[
        "ckpt",
        "push",
        s(&e.path("model")),
        "--to",
        &ckpts,
        "--run",
        "pretrain",
        "--step",
        "200",
    ]);
    run(&[
        "ckpt",
        "gc",
        &ckpts,
        "--run",
        "pretrain",
        "--keep-last",
        "1",
        "--apply",
    ]);
    let again = e.path("pulled-after-gc");
    e.ok(&["pull", "llama:1", "--to", s(&again)]);
    e.ok(&["verify", "llama:1"]);
    let register_step = |step: &'static str| e.fails(&register(step));
    // A step that does not exist is refused, and no version is taken.
    let (code, err) = register_step("7");
    assert_ne!(code, 0);
    assert!(err.contains("step 7"), "{err}");
    assert_eq!(
        e.json(&["show", "llama"])["versions"]
            .as_array()
            .map(Vec::len),
        Some(1)
    );
    // A checkpoint that cannot be pinned (here the pins/ prefix is a
    // file, so the pin cannot be written) never becomes a READY version.
    let pins = e.path("ckpts/pretrain/pins");
    std::fs::rename(&pins, e.path("pins-aside")).expect("mv");
    std::fs::write(&pins, b"in the way").expect("w");
    let (code, err) = register_step("200");
    assert_ne!(code, 0);
    assert!(
        err.contains("could not pin the checkpoint for llama:2"),
        "{err}"
    );
    assert_eq!(
        e.json(&["show", "llama:2"])["model_version"]["status"],
        "FAILED_REGISTRATION"
    );
}

#[test]
fn registering_from_storage_reads_every_byte_unless_told_sizes_only() {
    let e = Env::new();
    let v = e.json(&["register", "m", "--path", s(&e.path("model"))]);
    let stored = e.path("store/m/v1");
    // A copy of the stored version with one byte changed, size kept.
    let copy = e.path("copy");
    let st = Command::new("cp")
        .arg("-a")
        .arg(&stored)
        .arg(&copy)
        .status()
        .expect("cp");
    assert!(st.success());
    let f = copy.join("weights.safetensors");
    let mut b = std::fs::read(&f).expect("read");
    b[0] ^= 0xff;
    std::fs::write(&f, b).expect("write");
    let url = format!("file://{}", copy.display());
    let (code, err) = e.fails(&["register", "m", "--from", &url]);
    assert_ne!(code, 0);
    assert!(
        err.contains("weights.safetensors") && err.contains("SHA-256 differs"),
        "{err}"
    );
    assert_eq!(
        e.json(&["show", "m"])["versions"].as_array().map(Vec::len),
        Some(1),
        "no version taken"
    );
    // Sizes only: registered (and `verify` reads every byte and finds it).
    let v2 = e.json(&["register", "m", "--from", &url, "--sizes-only"]);
    assert_eq!(v2["model_version"]["version"], 2, "{v2}");
    let (code, _) = e.fails(&["verify", "m:2"]);
    assert_ne!(code, 0);
    assert_eq!(
        v2["model_version"]["manifest_digest"],
        v["model_version"]["manifest_digest"]
    );
}

/// `keel model migrate` copies a SQLite registry into an empty PostgreSQL
/// database (versions, aliases, the signature, both chains), refuses to
/// copy into it again once it holds the registry, and refuses a source
/// that does not exist.
#[test]
#[ignore = "needs PostgreSQL: scripts/services/postgres (scripts/test starts it)"]
fn migrate_copies_a_sqlite_registry_into_postgres_once() {
    let e = Env::new();
    e.ok(&["register", "m", "--path", s(&e.path("model"))]);
    e.ok(&["register", "m", "--path", s(&e.path("model"))]);
    e.ok(&["alias", "set", "m", "prod", "1", "--reason", "first"]);
    e.ok(&[
        "keygen",
        "--private-key",
        s(&e.path("k.pem")),
        "--public-key",
        s(&e.path("k.pub")),
    ]);
    e.ok(&["sign", "m:1", "--key", s(&e.path("k.pem"))]);
    let pg = Env::postgres();
    let Some(db) = &pg.pg else { unreachable!() };
    let from = format!("sqlite:{}", e.path("reg.db").display());
    let report = pg.json(&["migrate", "--from", &from, "--to", &db.url]);
    assert_eq!(report["report"]["signatures"]["checked"], 1, "{report}");
    assert_eq!(report["report"]["chains"]["alias_events"], 1, "{report}");

    // The PostgreSQL registry (with the SQLite one's artifact store).
    let o = pg
        .command()
        .args([
            "--json",
            "verify",
            "m@prod",
            "--public-key",
            s(&e.path("k.pub")),
        ])
        .env(
            "KEEL_ARTIFACT_STORE",
            format!("file://{}", e.path("store").display()),
        )
        .output()
        .expect("keel");
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    assert!(pg.ok(&["audit", "verify"]).ends_with("ok\n"));
    let shown = pg.json(&["show", "m"]);
    assert_eq!(shown["versions"].as_array().map(Vec::len), Some(2));

    let (code, err) = pg.fails(&["migrate", "--from", &from, "--to", &db.url]);
    assert_eq!(code, 64, "{err}");
    assert!(err.contains("already holds data"), "{err}");
    let (code, err) = pg.fails(&[
        "migrate",
        "--from",
        &format!("sqlite:{}", e.path("nothing.db").display()),
        "--to",
        &db.url,
    ]);
    assert_eq!(code, 64, "{err}");
    assert!(err.contains("no registry database there"), "{err}");
    assert!(err.contains("postgres://"), "{err}");
    assert!(!e.path("nothing.db").exists());
}
