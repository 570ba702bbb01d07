//! `keel review` and `keel cost` as processes: exit codes, versioned JSON,
//! SARIF's required structure, suppressions, the generated rule reference,
//! and reviews of the project's own test cluster and test gateways.

#[allow(unused_imports)]
mod serve_common;

/// keel-gateway's integration tests' config builders.
#[allow(unused_imports)]
#[path = "../../keel-gateway/tests/common/mod.rs"]
mod gateway_common;

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

use serde_json::Value;

fn keel() -> Command {
    Command::new(env!("CARGO_BIN_EXE_keel"))
}

fn repo() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..")
}

fn rule_fixture(id: &str, kind: &str, file: &str) -> PathBuf {
    repo()
        .join("crates/keel-review/tests/fixtures/rules")
        .join(id)
        .join(kind)
        .join(file)
}

fn run(cmd: &mut Command) -> (i32, String, String) {
    let Output {
        status,
        stdout,
        stderr,
    } = cmd.output().expect("run keel");
    (
        status.code().unwrap_or(-1),
        String::from_utf8_lossy(&stdout).into_owned(),
        String::from_utf8_lossy(&stderr).into_owned(),
    )
}

#[test]
fn exit_2_on_a_high_finding_unless_fail_on_says_otherwise() {
    let failing = rule_fixture("KEEL-REL-001", "fail", "slurm.conf");
    let (code, out, _) = run(keel().arg("review").arg(&failing));
    assert_eq!(code, 2, "{out}");
    assert!(out.contains("FAIL high KEEL-REL-001"), "{out}");
    let (code, _, _) = run(keel().args(["review", "--fail-on", "never"]).arg(&failing));
    assert_eq!(code, 0);
    // A medium finding fails only from --fail-on medium down.
    let medium = rule_fixture("KEEL-REL-004", "fail", "slurm.conf");
    let (code, _, _) = run(keel().arg("review").arg(&medium));
    assert_eq!(code, 0);
    let (code, _, _) = run(keel().args(["review", "--fail-on", "medium"]).arg(&medium));
    assert_eq!(code, 2);
    let passing = rule_fixture("KEEL-REL-001", "pass", "slurm.conf");
    let (code, out, _) = run(keel().args(["review", "--fail-on", "low"]).arg(&passing));
    assert_eq!(code, 0, "{out}");
}

#[test]
fn json_is_versioned_and_lists_findings_with_locations() {
    let failing = rule_fixture("KEEL-SEC-002", "fail", "gateway.toml");
    let (code, out, err) = run(keel().args(["--json", "review"]).arg(&failing));
    assert_eq!(code, 2, "{err}");
    let v: Value = serde_json::from_str(&out).expect("json");
    assert_eq!(v["version"], 1);
    assert_eq!(v["command"], "review");
    let f = v["findings"]
        .as_array()
        .expect("findings")
        .iter()
        .find(|f| f["rule"] == "KEEL-SEC-002")
        .expect("KEEL-SEC-002 finding");
    assert_eq!(f["severity"], "high");
    assert_eq!(f["pillar"], "security");
    assert_eq!(f["location"]["line"], 3);
    let sec = v["pillars"]
        .as_array()
        .expect("pillars")
        .iter()
        .find(|p| p["pillar"] == "security")
        .expect("security");
    assert!(sec["score"].as_u64().expect("score") < 100);
}

#[test]
fn malformed_and_unknown_lines_are_reported_not_fatal() {
    let dir = tempfile::tempdir().expect("tempdir");
    let conf = dir.path().join("slurm.conf");
    std::fs::write(
        &conf,
        "ClusterName=x\nNot a pair\nHealthCheckProgramm=/x\nReturnToService=1\n",
    )
    .expect("write");
    let (code, out, err) = run(keel().args(["--json", "review"]).arg(&conf));
    assert_eq!(code, 2, "{err}");
    let v: Value = serde_json::from_str(&out).expect("json");
    let diags: Vec<(String, u64)> = v["diagnostics"]
        .as_array()
        .expect("diagnostics")
        .iter()
        .map(|d| {
            (
                d["kind"].as_str().unwrap_or("").to_owned(),
                d["location"]["line"].as_u64().unwrap_or(0),
            )
        })
        .collect();
    assert_eq!(
        diags,
        vec![("malformed".to_owned(), 2), ("unknown_key".to_owned(), 3)]
    );
}

/// An included file whose lines do not parse (`Include /etc/shadow`)
/// shows up as its file, line numbers and problems: no word of it reaches
/// the text, JSON or SARIF report.
#[test]
fn lines_that_do_not_parse_are_never_repeated() {
    let dir = tempfile::tempdir().expect("tempdir");
    let conf = dir.path().join("slurm.conf");
    let shadow = dir.path().join("shadow");
    std::fs::write(
        &shadow,
        "root:$6$SECRETsalt$SECREThash:19000:0:99999:7:::\n\
         SECRETword SECRETother\n\
         Key=\"SECRETunterminated\n\
         SECRET-key=SECRETvalue\n",
    )
    .expect("write");
    std::fs::write(
        &conf,
        format!("ClusterName=x\nInclude {}\n", shadow.display()),
    )
    .expect("write");
    let (_, json, err) = run(keel().args(["--json", "review"]).arg(&conf));
    assert!(!json.contains("SECRET"), "{json}");
    let v: Value = serde_json::from_str(&json).expect("json");
    let diags: Vec<(String, u64)> = v["diagnostics"]
        .as_array()
        .expect("diagnostics")
        .iter()
        .filter(|d| d["location"]["file"].as_str() == Some(&shadow.display().to_string()))
        .map(|d| {
            (
                d["kind"].as_str().unwrap_or("").to_owned(),
                d["location"]["line"].as_u64().unwrap_or(0),
            )
        })
        .collect();
    assert_eq!(
        diags,
        (1..=4)
            .map(|l| ("malformed".to_owned(), l))
            .collect::<Vec<_>>(),
        "{json}{err}"
    );
    let (_, text, err) = run(keel().arg("review").arg(&conf));
    assert!(text.contains("shadow"), "{text}{err}");
    assert!(
        !text.contains("SECRET") && !err.contains("SECRET"),
        "{text}{err}"
    );
    let (_, sarif, err) = run(keel().args(["review", "--format", "sarif"]).arg(&conf));
    assert!(sarif.starts_with('{'), "{sarif}{err}");
    assert!(
        !sarif.contains("SECRET") && !err.contains("SECRET"),
        "{sarif}{err}"
    );
}

/// Runs `cmd` and gives up after 30 s (killing it): what a test of a
/// command that used to hang needs.
fn run_within(cmd: &mut Command) -> Option<(i32, String, String)> {
    use std::io::Read;
    use std::process::Stdio;
    let mut child = cmd
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("run keel");
    let t0 = std::time::Instant::now();
    let status = loop {
        if let Some(st) = child.try_wait().expect("wait") {
            break st;
        }
        if t0.elapsed() > std::time::Duration::from_secs(30) {
            let _ = child.kill();
            let _ = child.wait();
            return None;
        }
        std::thread::sleep(std::time::Duration::from_millis(20));
    };
    let (mut out, mut err) = (String::new(), String::new());
    let _ = child.stdout.take().expect("out").read_to_string(&mut out);
    let _ = child.stderr.take().expect("err").read_to_string(&mut err);
    Some((status.code().unwrap_or(-1), out, err))
}

/// A FIFO no one writes and a link to /dev/zero, given where `keel
/// review`, `keel cost` and `keel serve drift baseline show` expect a
/// file, are refused at once with the file's name, not read forever.
#[test]
fn fifos_and_devices_given_as_files_are_refused_at_once() {
    let dir = tempfile::tempdir().expect("tempdir");
    let fifo = dir.path().join("fifo");
    let made = Command::new("mkfifo").arg(&fifo).status().expect("mkfifo");
    assert!(made.success());
    let zero = dir.path().join("zero");
    std::os::unix::fs::symlink("/dev/zero", &zero).expect("symlink");
    for bad in [&fifo, &zero] {
        let name = bad.display().to_string();
        let cases: Vec<Command> = vec![
            {
                let mut c = keel();
                c.arg("review").arg(format!("slurm:{name}"));
                c
            },
            {
                let mut c = keel();
                c.arg("cost")
                    .arg("--prices")
                    .arg(cost_fixture("prices.toml"))
                    .arg("--sacct-file")
                    .arg(bad);
                c
            },
            {
                let mut c = keel();
                c.arg("cost")
                    .arg("--prices")
                    .arg(bad)
                    .arg("--sacct-file")
                    .arg(cost_fixture("prices.toml"));
                c
            },
            {
                let mut c = keel();
                c.args(["serve", "drift", "baseline", "show"]).arg(bad);
                c
            },
        ];
        for mut c in cases {
            let shown = format!("{c:?}");
            let (code, _, err) = run_within(&mut c).unwrap_or_else(|| panic!("hung: {shown}"));
            assert_ne!(code, 0, "{shown}: {err}");
            assert!(
                err.contains(&name) && err.contains("not a regular file"),
                "{shown}: {err}"
            );
        }
    }
}

/// Checks the SARIF 2.1.0 schema's requirements on what keel writes: the
/// root's version and runs; tool.driver.name; each rule's id; each
/// result's message text, a ruleId that names a rule, a ruleIndex that
/// points at it, a level from the schema's enum, physical locations with
/// an artifact location and a region whose startLine is at least 1, and
/// suppressions with a kind from the enum.
fn check_sarif(v: &Value) {
    assert_eq!(v["version"], "2.1.0");
    let runs = v["runs"].as_array().expect("runs");
    assert_eq!(runs.len(), 1);
    let run = &runs[0];
    let driver = &run["tool"]["driver"];
    assert!(driver["name"].as_str().is_some_and(|n| !n.is_empty()));
    let rules = driver["rules"].as_array().expect("rules");
    for r in rules {
        assert!(r["id"].as_str().is_some_and(|s| !s.is_empty()));
        for f in ["shortDescription", "fullDescription", "help"] {
            let text = r[f]["text"].as_str().expect("descriptor text");
            assert!(!text.is_empty() && text.len() <= 1024 || f == "help");
        }
        assert!(["none", "note", "warning", "error"]
            .contains(&r["defaultConfiguration"]["level"].as_str().expect("level")));
    }
    for res in run["results"].as_array().expect("results") {
        assert!(res["message"]["text"]
            .as_str()
            .is_some_and(|t| !t.is_empty()));
        let id = res["ruleId"].as_str().expect("ruleId");
        let idx = usize::try_from(res["ruleIndex"].as_u64().expect("ruleIndex")).expect("index");
        assert_eq!(rules[idx]["id"], id);
        assert!(
            ["none", "note", "warning", "error"].contains(&res["level"].as_str().expect("level"))
        );
        for loc in res["locations"].as_array().expect("locations") {
            let pl = &loc["physicalLocation"];
            assert!(pl["artifactLocation"]["uri"]
                .as_str()
                .is_some_and(|u| !u.is_empty()));
            assert!(pl["region"]["startLine"].as_u64().expect("startLine") >= 1);
        }
        assert!(res["partialFingerprints"]
            .as_object()
            .is_some_and(|m| m.values().all(Value::is_string)));
        if let Some(sups) = res.get("suppressions") {
            for s in sups.as_array().expect("suppressions") {
                assert!(["inSource", "external"].contains(&s["kind"].as_str().expect("kind")));
                assert!(["accepted", "underReview", "rejected"]
                    .contains(&s["status"].as_str().expect("status")));
            }
        }
    }
}

#[test]
fn sarif_has_every_rule_and_the_findings_with_suppressions() {
    let dir = tempfile::tempdir().expect("tempdir");
    let sup = dir.path().join("suppressions.toml");
    std::fs::write(
        &sup,
        "[[suppress]]\nrule = \"KEEL-REL-001\"\nfile = \"slurm.conf\"\nreason = \"health checks run from cron on this cluster\"\n",
    )
    .expect("write");
    let failing = rule_fixture("KEEL-REL-001", "fail", "slurm.conf");
    let gateway = rule_fixture("KEEL-SEC-005", "fail", "gateway.toml");
    let (code, out, err) = run(keel()
        .args(["review", "--format", "sarif", "--suppressions"])
        .arg(&sup)
        .arg(&failing)
        .arg(&gateway));
    assert_eq!(code, 0, "the only high finding is suppressed: {err}");
    let v: Value = serde_json::from_str(&out).expect("sarif json");
    check_sarif(&v);
    let results = v["runs"][0]["results"].as_array().expect("results");
    let rel = results
        .iter()
        .find(|r| r["ruleId"] == "KEEL-REL-001")
        .expect("suppressed result kept");
    assert_eq!(rel["suppressions"][0]["kind"], "external");
    assert_eq!(
        rel["suppressions"][0]["justification"],
        "health checks run from cron on this cluster"
    );
    assert!(results.iter().any(|r| r["ruleId"] == "KEEL-SEC-005"));
    let n_rules = v["runs"][0]["tool"]["driver"]["rules"]
        .as_array()
        .expect("rules")
        .len();
    assert_eq!(n_rules, keel_review::rules().len());

    // With KEEL_SARIF_SCHEMA naming the official schema
    // (oasis-tcs/sarif-spec sarif-2.1/schema/sarif-schema-2.1.0.json),
    // Python's jsonschema validates the whole document against it too.
    if let Some(schema) = std::env::var_os("KEEL_SARIF_SCHEMA") {
        let doc = dir.path().join("out.sarif");
        std::fs::write(&doc, &out).expect("write sarif");
        let (code, out, err) = run(Command::new("python3")
            .arg("-c")
            .arg(
                "import json,sys,jsonschema\n\
             s=json.load(open(sys.argv[1])); d=json.load(open(sys.argv[2]))\n\
             v=jsonschema.Draft4Validator(s, format_checker=jsonschema.FormatChecker())\n\
             e=[x.message for x in v.iter_errors(d)]\n\
             print(e); sys.exit(1 if e else 0)",
            )
            .arg(schema)
            .arg(&doc));
        assert_eq!(code, 0, "SARIF schema errors: {out} {err}");
    }
}

#[test]
fn a_suppression_needs_a_reason_and_a_known_rule() {
    let dir = tempfile::tempdir().expect("tempdir");
    let conf = rule_fixture("KEEL-REL-001", "fail", "slurm.conf");
    for (text, want) in [
        (
            "[[suppress]]\nrule = \"KEEL-REL-001\"\nreason = \"  \"\n",
            "needs a reason",
        ),
        (
            "[[suppress]]\nrule = \"KEEL-NOPE-1\"\nreason = \"x\"\n",
            "unknown rule",
        ),
        ("[[suppress]]\nrule = \"KEEL-REL-001\"\n", "reason"),
        (
            "[[suppress]]\nrule = \"KEEL-REL-001\"\nreason = \"x\"\nexpires = \"soon\"\n",
            "YYYY-MM-DD",
        ),
    ] {
        let sup = dir.path().join("s.toml");
        std::fs::write(&sup, text).expect("write");
        let (code, out, err) = run(keel()
            .args(["review", "--suppressions"])
            .arg(&sup)
            .arg(&conf));
        assert_eq!(code, 65, "{text}: {out}");
        assert!(err.contains(want), "{text}: {err}");
        assert!(
            out.is_empty(),
            "nothing printed on a bad suppression file: {out}"
        );
    }
    // An expired suppression no longer applies.
    let sup = dir.path().join("s.toml");
    std::fs::write(
        &sup,
        "[[suppress]]\nrule = \"KEEL-REL-001\"\nreason = \"until the rollout\"\nexpires = \"2000-01-01\"\n",
    )
    .expect("write");
    let (code, _, _) = run(keel()
        .args(["review", "--suppressions"])
        .arg(&sup)
        .arg(&conf));
    assert_eq!(code, 2);
}

#[test]
fn docs_review_md_is_the_generated_catalogue() {
    let (code, out, err) = run(keel().args(["review", "--list-rules", "--format", "markdown"]));
    assert_eq!(code, 0, "{err}");
    let doc = std::fs::read_to_string(repo().join("docs/review.md")).expect("docs/review.md");
    assert!(
        doc == out,
        "docs/review.md is not current: run `keel review --list-rules --format markdown > docs/review.md`"
    );
}

/// The test cluster's slurm.conf as scripts/slurm-cluster writes it (its
/// own `write_conf`, run on DIR=/tmp/keel-slurm), with slurmdbd accounting
/// or without (where slurmdbd or MariaDB cannot run), and its gres.conf.
fn write_test_cluster_conf(dir: &Path, accounting: bool) {
    let script = repo().join("scripts/slurm-cluster");
    let status = Command::new("bash")
        .arg("-c")
        .arg(
            r#"set -euo pipefail
eval "$(grep -E '^(NODES|FIRST_PORT|CTLD_PORT|DBD_PORT|DB_PORT)=' "$1")"
eval "$(sed -n '/^write_conf() {/,/^}/p' "$1")"
unset KEEL_TEST_SLURM_HEALTHCHECK
write_conf /tmp/keel-slurm "$2/slurm.conf" "$3"
printf 'NodeName=%s Name=gpu File=%s/dev/gpu[0-7]\n' "${NODES[-1]}" /tmp/keel-slurm >"$2/gres.conf""#,
        )
        .arg("bash")
        .arg(&script)
        .arg(dir)
        .arg(if accounting { "1" } else { "0" })
        .status()
        .expect("bash");
    assert!(status.success());
}

/// The review of the test cluster's own slurm.conf and gres.conf, with
/// and without accounting: `(rule, status)` of every rule that applies.
fn review_test_cluster(accounting: bool) -> Vec<(String, String)> {
    let dir = tempfile::tempdir().expect("tempdir");
    write_test_cluster_conf(dir.path(), accounting);
    let (code, out, err) = run(keel().current_dir(dir.path()).args([
        "--json",
        "review",
        "--fail-on",
        "never",
        "slurm.conf",
        "gres.conf",
    ]));
    assert_eq!(code, 0, "{err}");
    let v: Value = serde_json::from_str(&out).expect("json");
    assert_eq!(v["diagnostics"], serde_json::json!([]), "{out}");
    v["rules"]
        .as_array()
        .expect("rules")
        .iter()
        .filter(|r| r["status"] != "not_applicable")
        .map(|r| {
            (
                r["rule"].as_str().unwrap_or("").to_owned(),
                r["status"].as_str().unwrap_or("").to_owned(),
            )
        })
        .collect()
}

/// The accounting scripts/slurm-cluster sets up with slurmdbd is what the
/// accounting rules ask for; without it they fail, and nothing else
/// changes.
#[test]
fn review_of_the_test_cluster_with_and_without_accounting() {
    let with = review_test_cluster(true);
    let without = review_test_cluster(false);
    let differ: Vec<(&str, &str, &str)> = with
        .iter()
        .zip(&without)
        .filter(|(a, b)| a != b)
        .map(|((id, a), (id_b, b))| {
            assert_eq!(id, id_b);
            (id.as_str(), a.as_str(), b.as_str())
        })
        .collect();
    assert_eq!(with.len(), without.len());
    assert_eq!(
        differ,
        vec![
            ("KEEL-COST-003", "pass", "fail"),
            ("KEEL-COST-004", "pass", "fail"),
            ("KEEL-COST-005", "pass", "fail"),
        ]
    );
}

#[test]
fn review_of_the_test_cluster_and_the_test_gateways() {
    let dir = tempfile::tempdir().expect("tempdir");
    write_test_cluster_conf(dir.path(), true);
    // The gateway the `keel serve` CLI tests run, and the one
    // scripts/bench-serve measures (keel, FULL=1).
    serve_common::config(dir.path(), "http://127.0.0.1:18000", "");
    let status = Command::new("bash")
        .arg("-c")
        .arg(r#"source "$1/scripts/lib/serve-targets.sh" && keel_config 18080 18081 18082 18000 2 1 0000000000000000000000000000000000000000000000000000000000000000 >"$2/bench.toml""#)
        .arg("bash")
        .arg(repo())
        .arg(dir.path())
        .status()
        .expect("bash");
    assert!(status.success());
    // keel-gateway's tests: the common head, and the two models most of
    // them serve (`chat` falling back to `small`).
    let gw = format!(
        "{}{}{}",
        gateway_common::head(Path::new("/run/keel-test")),
        gateway_common::model(
            "chat",
            "fallback = [\"small\"]",
            &[
                ("blue", "http://127.0.0.1:18001".to_owned(), 1),
                ("green", "http://127.0.0.1:18002".to_owned(), 1)
            ]
        ),
        gateway_common::model(
            "small",
            "",
            &[("tiny", "http://127.0.0.1:18003".to_owned(), 1)]
        ),
    );
    std::fs::write(dir.path().join("gateway-lib.toml"), gw).expect("write");
    let (code, out, err) = run(keel().current_dir(dir.path()).args([
        "review",
        "--fail-on",
        "never",
        "slurm.conf",
        "gres.conf",
        "gateway.toml",
        "bench.toml",
        "gateway-lib.toml",
    ]));
    assert_eq!(code, 0, "{err}");
    insta::assert_snapshot!("review-test-cluster-and-gateways", out);
}

/// The gateways the registry-following tests run (serve_registry.rs):
/// routing to whatever version the production alias names fails the
/// signature rule, a high finding; with `require_signature` and the
/// trusted key it passes.
#[test]
fn review_of_the_registry_following_test_gateways() {
    let dir = tempfile::tempdir().expect("tempdir");
    let (unsigned, signed) = (dir.path().join("unsigned"), dir.path().join("signed"));
    std::fs::create_dir(&unsigned).expect("mkdir");
    std::fs::create_dir(&signed).expect("mkdir");
    let url = "http://127.0.0.1:18470";
    serve_common::registry_config(&unsigned, url, "chat", "", "");
    serve_common::registry_config(
        &signed,
        url,
        "chat",
        "public_key_file = \"a.pub\"",
        ", require_signature = true, allowed_backends = [\"http://127.0.0.1:18000\"]",
    );
    let review = |cfg: &Path| {
        let (code, out, err) = run(keel().args(["--json", "review"]).arg(cfg));
        let v: Value = serde_json::from_str(&out).unwrap_or_else(|e| panic!("{e}: {err}"));
        let status = v["rules"]
            .as_array()
            .expect("rules")
            .iter()
            .find(|r| r["rule"] == "KEEL-SEC-013")
            .map(|r| r["status"].as_str().unwrap_or("").to_owned())
            .expect("rule");
        let findings: Vec<String> = v["findings"]
            .as_array()
            .expect("findings")
            .iter()
            .filter(|f| f["rule"] == "KEEL-SEC-013")
            .map(|f| {
                format!(
                    "{}: {}",
                    f["location"]["line"],
                    f["message"].as_str().unwrap_or("")
                )
            })
            .collect();
        (code, status, findings)
    };
    let (code, status, findings) = review(&unsigned.join("gateway.toml"));
    assert_eq!((code, status.as_str()), (2, "fail"));
    assert_eq!(
        findings,
        vec!["22: model chat serves registry model chat@production without registry.require_signature = true"]
    );
    let (_, status, findings) = review(&signed.join("gateway.toml"));
    assert_eq!((status.as_str(), findings.len()), ("pass", 0));
    // A gateway with fixed deployments only: the rule does not apply.
    serve_common::config(dir.path(), "http://127.0.0.1:18000", "");
    let (_, status, _) = review(&dir.path().join("gateway.toml"));
    assert_eq!(status, "not_applicable");
}

fn cost_fixture(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures/cost")
        .join(name)
}

fn cost_cmd() -> Command {
    let mut c = keel();
    c.arg("cost")
        .arg("--prices")
        .arg(cost_fixture("prices.toml"))
        .arg("--sacct-file")
        .arg(cost_fixture("sacct.txt"))
        .args([
            "--since",
            "2026-09-01",
            "--until",
            "2026-10-01",
            "--requeue-safe",
            "keel-",
        ]);
    c
}

fn close(a: f64, b: f64) -> bool {
    (a - b).abs() < 1e-6
}

#[test]
fn cost_prices_gpu_hours_by_user_and_partition_and_spot_savings() {
    let (code, out, err) = run(cost_cmd().arg("--json"));
    assert_eq!(code, 0, "{err}");
    let v: Value = serde_json::from_str(&out).expect("json");
    assert_eq!(v["version"], 1);
    assert_eq!(v["command"], "cost");
    let r = &v["report"];
    // 1001: 8 GPUs x 10 h; 1002: 16 x 2 h; 1004: 4 x 1.5 h (typed gres);
    // 1005: 8 x 0.5 h (running, End Unknown); 1006: 8 x 1 h (unpriced
    // partition); 1007: 4 x 2 h of its 4 h (started before --since);
    // 1003 has no GPU.
    let total = &r["total"];
    assert!(
        close(total["gpu_hours"].as_f64().expect("f64"), 138.0),
        "{total}"
    );
    assert!(close(
        total["unpriced_gpu_hours"].as_f64().expect("f64"),
        8.0
    ));
    // H100 at 98.32 / 8 = 12.29 a GPU-hour: (80 + 32 + 4 + 8) x 12.29;
    // A100 at 32.77 / 8: 6 x 4.09625.
    assert!(
        close(
            total["cost"].as_f64().expect("f64"),
            124.0 * 12.29 + 6.0 * 4.09625
        ),
        "{total}"
    );
    // Requeue-safe (keel-*): 1002 and 1005, 36 GPU-hours at 12.29 -
    // 18.169536 / 8 = 10.018808 saved each.
    assert!(
        close(
            total["spot_saving"].as_f64().expect("f64"),
            36.0 * 10.018808
        ),
        "{total}"
    );
    let jobs = r["jobs"].as_array().expect("jobs");
    assert_eq!(jobs.len(), 6);
    let j1006 = jobs.iter().find(|j| j["job_id"] == "1006").expect("1006");
    assert!(
        j1006["cost"].is_null(),
        "an unpriced job is not free: {j1006}"
    );
    let users: Vec<(&str, f64)> = r["by_user"]
        .as_array()
        .expect("by_user")
        .iter()
        .map(|g| {
            (
                g["key"].as_str().unwrap_or(""),
                g["gpu_hours"].as_f64().unwrap_or(-1.0),
            )
        })
        .collect();
    assert_eq!(
        users,
        vec![
            ("alice", 84.0),
            ("bob", 40.0),
            ("dave", 8.0),
            ("carol", 6.0)
        ]
    );
    let parts: Vec<&str> = r["by_partition"]
        .as_array()
        .expect("by_partition")
        .iter()
        .map(|g| g["key"].as_str().unwrap_or(""))
        .collect();
    assert_eq!(parts, vec!["gpu", "h200", "a100"]);
}

#[test]
fn cost_text_and_csv() {
    let (code, out, err) = run(&mut cost_cmd());
    assert_eq!(code, 0, "{err}");
    insta::assert_snapshot!("cost-text", out);
    let (code, out, err) = run(cost_cmd().args(["--format", "csv"]));
    assert_eq!(code, 0, "{err}");
    let lines: Vec<&str> = out.lines().collect();
    assert_eq!(
        lines[0],
        "job_id,name,user,account,partition,state,gpus,gpu_hours,cost,requeue_safe,requeue_safe_by,spot_saving,idle_gpu_hours,idle_cost,currency"
    );
    assert_eq!(lines.len(), 7);
    assert!(
        lines.contains(
            &"1002,keel-ft,bob,ml,gpu,PREEMPTED,16,32.0000,393.2800,true,name,320.6019,,,USD"
        ),
        "{out}"
    );
    assert!(
        lines.contains(&"1006,sweep,dave,ml,h200,COMPLETED,8,8.0000,,false,,,,,USD"),
        "{out}"
    );
}

/// Rows with their comments from sacct --json: jobs `keel run --slurm`
/// marked are requeue-safe without a name prefix, and each output says
/// which rule made a job requeue-safe.
#[test]
fn cost_counts_jobs_marked_by_keel_run_as_requeue_safe() {
    let cmd = |extra: &[&str]| {
        let mut c = keel();
        c.arg("cost")
            .arg("--prices")
            .arg(cost_fixture("prices.toml"))
            .arg("--sacct-file")
            .arg(cost_fixture("sacct-marked.txt"))
            .arg("--sacct-json")
            .arg(cost_fixture("sacct-marked.json"))
            .args(["--since", "2026-09-01", "--until", "2026-10-01"])
            .args(extra);
        c
    };
    let by = |out: &str| -> Vec<(String, Value, Value, Value)> {
        let v: Value = serde_json::from_str(out).expect("json");
        v["report"]["jobs"]
            .as_array()
            .expect("jobs")
            .iter()
            .map(|j| {
                (
                    j["job_id"].as_str().unwrap_or("").to_owned(),
                    j["requeue_safe"].clone(),
                    j["requeue_safe_by"].clone(),
                    j["marker"].clone(),
                )
            })
            .collect()
    };
    let row = |id: &str, safe: bool, rule: Value, marker: bool| {
        (id.to_owned(), Value::Bool(safe), rule, Value::Bool(marker))
    };
    // The marker alone: 1001 and 1005 (after a user's own comment); not
    // 1007, whose comment only starts like it.
    let (code, out, err) = run(&mut cmd(&["--json"]));
    assert_eq!(code, 0, "{err}");
    assert_eq!(
        by(&out),
        vec![
            row("1001", true, "marker".into(), true),
            row("1002", false, Value::Null, false),
            row("1004", false, Value::Null, false),
            row("1005", true, "marker".into(), true),
            row("1006", false, Value::Null, false),
            row("1007", false, Value::Null, false),
        ]
    );
    let v: Value = serde_json::from_str(&out).expect("json");
    // 84 GPU-hours at 12.29 - 18.169536 / 8 = 10.018808 saved each.
    assert!(
        close(
            v["report"]["total"]["spot_saving"].as_f64().expect("f64"),
            84.0 * 10.018808
        ),
        "{out}"
    );
    // A name prefix adds 1002; 1005 matches both and counts as marked.
    let (code, out, err) = run(&mut cmd(&["--json", "--requeue-safe", "keel-"]));
    assert_eq!(code, 0, "{err}");
    let rows = by(&out);
    assert_eq!(rows[1], row("1002", true, "name".into(), false));
    assert_eq!(rows[3], row("1005", true, "marker".into(), true));
    let (code, out, err) = run(&mut cmd(&["--format", "csv", "--requeue-safe", "keel-"]));
    assert_eq!(code, 0, "{err}");
    for line in [
        "1001,train-llm,alice,ml,gpu,COMPLETED,8,80.0000,983.2000,true,marker,801.5046,,,USD",
        "1002,keel-ft,bob,ml,gpu,PREEMPTED,16,32.0000,393.2800,true,name,320.6019,,,USD",
        "1007,train-old,bob,ml,gpu,CANCELLED by 1001,4,8.0000,98.3200,false,,,,,USD",
    ] {
        assert!(out.lines().any(|l| l == line), "{line}\n{out}");
    }
    let (code, out, err) = run(&mut cmd(&["--requeue-safe", "keel-"]));
    assert_eq!(code, 0, "{err}");
    assert!(
        out.contains(
            "requeue-safe jobs: 3 (2 run under keel run, 1 by name); running them on spot would have saved 1162.18 USD"
        ),
        "{out}"
    );
    assert!(!out.contains("markers unknown"), "{out}");
    for line in [
        "  1001         train-llm        alice        gpu                80.0         801.50  marker",
        "  1002         keel-ft          bob          gpu                32.0         320.60  name",
    ] {
        assert!(out.lines().any(|l| l == line), "{line}\n{out}");
    }
}

/// A job name holding `|` cannot supply a row's fields, and a name holding
/// a newline cannot add a row sacct --json does not confirm.
#[test]
fn cost_job_names_cannot_forge_rows() {
    let dir = tempfile::tempdir().expect("tempdir");
    let sacct = dir.path().join("sacct.txt");
    let forged =
        "big|carol|research|debug|cpu=1|60|COMPLETED|2026-09-01T00:00:00|2026-09-01T00:01:00";
    let split = "x\n77|n|carol|ml|gpu|gres/gpu=64|360000|COMPLETED|Unknown|Unknown\ny";
    std::fs::write(
        &sacct,
        format!(
            "1|{forged}|mallory|ml|gpu|gres/gpu=64|3600|COMPLETED|2026-09-01T00:00:00|2026-09-01T01:00:00\n\
             2|{split}|mallory|ml|gpu|gres/gpu=8|3600|COMPLETED|2026-09-01T00:00:00|2026-09-01T01:00:00\n"
        ),
    )
    .expect("write");
    let json = dir.path().join("sacct.json");
    std::fs::write(
        &json,
        serde_json::json!({"jobs": [
            {"job_id": 1, "name": forged, "comment": {"job": "keel-run"}},
            {"job_id": 2, "name": split, "comment": {"job": "team=ml\nx|y keel-run"}},
        ]})
        .to_string(),
    )
    .expect("write");
    let (code, out, err) = run(keel()
        .args(["--json", "cost", "--prices"])
        .arg(cost_fixture("prices.toml"))
        .arg("--sacct-file")
        .arg(&sacct)
        .arg("--sacct-json")
        .arg(&json));
    assert_eq!(code, 0, "{err}");
    let v: Value = serde_json::from_str(&out).expect("json");
    let jobs = v["report"]["jobs"].as_array().expect("jobs");
    assert_eq!(jobs.len(), 1, "{out}");
    assert_eq!(jobs[0]["user"], "mallory");
    assert_eq!(jobs[0]["gpus"], 64);
    assert_eq!(jobs[0]["marker"], true);
    assert!(
        err.contains("job 77 is not in sacct --json's answer"),
        "{err}"
    );
    assert!(err.contains("sacct.txt:4: expected 10"), "{err}");
    assert!(err.contains("sacct.txt:2: expected 10"), "{err}");
}

#[test]
fn cost_bad_input_is_reported() {
    let dir = tempfile::tempdir().expect("tempdir");
    let sacct = dir.path().join("sacct.txt");
    std::fs::write(
        &sacct,
        "1|a|u|acc|gpu|gres/gpu=8|3600|COMPLETED|Unknown|Unknown\nnot a row\n2|b|u|acc|gpu|gres/gpu=8|soon|COMPLETED|Unknown|Unknown\n",
    )
    .expect("write");
    let (code, out, err) = run(keel()
        .args(["--json", "cost", "--prices"])
        .arg(cost_fixture("prices.toml"))
        .arg("--sacct-file")
        .arg(&sacct));
    assert_eq!(code, 0, "{err}");
    assert!(err.contains("sacct.txt:2: expected 10"), "{err}");
    assert!(err.contains("sacct.txt:3: ElapsedRaw soon"), "{err}");
    let v: Value = serde_json::from_str(&out).expect("json");
    assert!(close(
        v["report"]["total"]["gpu_hours"].as_f64().expect("f64"),
        8.0
    ));

    let prices = dir.path().join("prices.toml");
    for (text, want) in [
        ("source = \"x\"\n[[price]]\npartition = \"gpu\"\nsku = \"s\"\ngpus_per_node = 0\non_demand = 1.0\n", "gpus_per_node"),
        ("source = \"x\"\n[[price]]\npartition = \"gpu\"\nsku = \"s\"\ngpus_per_node = 8\non_demand = -1.0\n", "on_demand"),
        ("source = \"x\"\nprise = 1\n", "unknown field"),
    ] {
        std::fs::write(&prices, text).expect("write");
        let (code, out, err) = run(
            keel()
                .args(["cost", "--prices"])
                .arg(&prices)
                .arg("--sacct-file")
                .arg(cost_fixture("sacct.txt")),
        );
        assert_eq!(code, 65, "{text}");
        assert!(err.contains(want), "{text}: {err}");
        assert!(out.is_empty());
    }
    let (code, _, err) = run(keel()
        .args(["cost", "--since", "yesterday", "--prices"])
        .arg(cost_fixture("prices.toml"))
        .arg("--sacct-file")
        .arg(cost_fixture("sacct.txt")));
    assert_eq!(code, 64, "{err}");
    assert!(err.contains("--since: expected YYYY-MM-DD"), "{err}");
}

fn copy_dir(from: &Path, to: &Path) {
    std::fs::create_dir_all(to).expect("mkdir");
    for e in std::fs::read_dir(from).expect("read_dir") {
        let e = e.expect("entry");
        let ty = e.file_type().expect("type");
        let dest = to.join(e.file_name());
        if ty.is_dir() {
            copy_dir(&e.path(), &dest);
        } else if ty.is_symlink() {
            let target = std::fs::read_link(e.path()).expect("link");
            std::os::unix::fs::symlink(target, dest).expect("symlink");
        } else {
            std::fs::copy(e.path(), dest).expect("copy");
        }
    }
}

#[test]
fn node_review_runs_the_passive_check_and_reads_scratch_mounts() {
    let dir = tempfile::tempdir().expect("tempdir");
    let root = dir.path().join("root");
    copy_dir(&repo().join("tests/fixtures/nd96isr_h100_v5"), &root);
    std::fs::write(
        root.join("proc/mounts"),
        "/dev/sda1 / ext4 rw 0 0\n/dev/md128 /mnt/resource_nvme xfs rw 0 0\n",
    )
    .expect("mounts");
    let snapshot = root.join("gpu.json");
    let review = |snapshot: &Path| {
        let (code, out, err) = run(keel()
            .env("KEEL_IMDS_ENDPOINT", "127.0.0.1:1")
            .env_remove("KEEL_CONFIG")
            // Without paths, review also reads $SLURM_CONF: this test is
            // about the node alone.
            .env_remove("SLURM_CONF")
            .env("HOME", dir.path())
            .arg("--root")
            .arg(&root)
            .args(["--json", "review", "--node", "--gpu-snapshot"])
            .arg(snapshot));
        let v: Value = serde_json::from_str(&out).unwrap_or_else(|e| panic!("{e}: {out} {err}"));
        let status = |id: &str| {
            v["rules"]
                .as_array()
                .expect("rules")
                .iter()
                .find(|r| r["rule"] == id)
                .map(|r| r["status"].as_str().unwrap_or("").to_owned())
                .expect("rule")
        };
        (code, status("KEEL-REL-016"), status("KEEL-PERF-008"), v)
    };
    let (code, check, scratch, _) = review(&snapshot);
    assert_eq!(
        (code, check.as_str(), scratch.as_str()),
        (0, "pass", "pass")
    );

    // A GPU with ECC off fails keel check, a high finding: exit 2.
    let mut gpus: Value =
        serde_json::from_str(&std::fs::read_to_string(&snapshot).expect("gpu.json")).expect("json");
    gpus["gpus"][0]["ecc_enabled"] = Value::Bool(false);
    let bad = dir.path().join("bad-gpu.json");
    std::fs::write(&bad, gpus.to_string()).expect("write");
    std::fs::write(root.join("proc/mounts"), "/dev/sda1 / ext4 rw 0 0\n").expect("mounts");
    let (code, check, scratch, v) = review(&bad);
    assert_eq!(
        (code, check.as_str(), scratch.as_str()),
        (2, "fail", "fail")
    );
    let finding = v["findings"]
        .as_array()
        .expect("findings")
        .iter()
        .find(|f| f["rule"] == "KEEL-REL-016")
        .expect("finding");
    assert!(
        finding["message"]
            .as_str()
            .expect("message")
            .contains("gpu.ecc_mode"),
        "{finding}"
    );
}

/// Without paths, the system's slurm.conf is read under --root: a review of
/// a fixture or snapshot never reads the host's /etc/slurm, whether or not
/// the host has one.
#[test]
fn review_without_paths_reads_slurm_conf_under_root() {
    let dir = tempfile::tempdir().expect("tempdir");
    let root = dir.path().join("root");
    std::fs::create_dir_all(root.join("etc/slurm")).expect("mkdir");
    let review = || {
        run(keel()
            .env_remove("SLURM_CONF")
            .env_remove("KEEL_CONFIG")
            .env_remove("KEEL_SERVE_CONFIG")
            .env("HOME", dir.path())
            .arg("--root")
            .arg(&root)
            .args(["--json", "review"]))
    };
    // Nothing under the root: nothing to review (exit 3), whatever the
    // host's /etc/slurm holds.
    let (code, out, err) = review();
    assert_eq!(code, 3, "{out} {err}");
    assert!(out.contains("nothing to review"), "{out}");
    // A slurm.conf under the root is the one reviewed.
    std::fs::copy(
        rule_fixture("KEEL-REL-001", "fail", "slurm.conf"),
        root.join("etc/slurm/slurm.conf"),
    )
    .expect("copy");
    let (code, out, err) = review();
    assert_eq!(code, 2, "{out} {err}");
    let v: Value = serde_json::from_str(&out).unwrap_or_else(|e| panic!("{e}: {out}"));
    let f = v["findings"]
        .as_array()
        .expect("findings")
        .iter()
        .find(|f| f["rule"] == "KEEL-REL-001")
        .expect("KEEL-REL-001 finding");
    let file = f["location"]["file"]
        .as_str()
        .unwrap_or_default()
        .to_owned();
    assert!(
        Path::new(&file).starts_with(&root),
        "read outside the root: {f}"
    );
}

/// `keel cost` without --sacct-file runs `sacct` from PATH: here a script
/// standing in for Slurm's client, which records its arguments,
/// SLURM_TIME_FORMAT and TZ (UTC, whatever the caller's, so that the period
/// is the idle GPU-hours' one) and prints the recorded rows.
#[test]
fn cost_runs_sacct_with_the_period_and_a_timeout() {
    use std::os::unix::fs::PermissionsExt;
    let dir = tempfile::tempdir().expect("tempdir");
    let bin = dir.path().join("bin");
    std::fs::create_dir(&bin).expect("mkdir");
    let script = bin.join("sacct");
    let args_file = dir.path().join("args");
    std::fs::write(
        &script,
        format!(
            "#!/bin/sh\nprintf '%s\\n' \"$*\" \"$SLURM_TIME_FORMAT $TZ\" >>'{}'\n[ -n \"$SACCT_SLEEP\" ] && sleep \"$SACCT_SLEEP\"\nif [ \"$1\" = --json ]; then [ -n \"$SACCT_NO_JSON\" ] && {{ echo 'sacct: unrecognized option --json' >&2; exit 1; }}; cat '{}'; else cat '{}'; fi\n",
            args_file.display(),
            cost_fixture("sacct-marked.json").display(),
            cost_fixture("sacct.txt").display()
        ),
    )
    .expect("write");
    std::fs::set_permissions(&script, std::fs::Permissions::from_mode(0o755)).expect("chmod");
    let path = format!(
        "{}:{}",
        bin.display(),
        std::env::var("PATH").unwrap_or_default()
    );
    let (code, out, err) = run(keel()
        .env("PATH", &path)
        .env("SLURM_TIME_FORMAT", "relative")
        .env("TZ", "America/New_York")
        .args([
            "--json",
            "cost",
            "--since",
            "2026-09-01",
            "--until",
            "2026-10-01",
            "--prices",
        ])
        .arg(cost_fixture("prices.toml")));
    assert_eq!(code, 0, "{err}");
    let recorded = std::fs::read_to_string(&args_file).expect("args");
    assert_eq!(
        recorded,
        "-a -X -P -n --noconvert --format=JobID,JobName,User,Account,Partition,AllocTRES,ElapsedRaw,State,Start,End -S 2026-09-01 -E 2026-10-01\nstandard UTC\n\
         --json -a -X -S 2026-09-01 -E 2026-10-01\nstandard UTC\n"
    );
    let v: Value = serde_json::from_str(&out).expect("json");
    assert!(close(
        v["report"]["total"]["gpu_hours"].as_f64().expect("f64"),
        138.0
    ));
    // The comments came from sacct --json: 1001 and 1005 are marked.
    assert_eq!(v["report"]["jobs"][0]["job_id"], "1001");
    assert_eq!(v["report"]["jobs"][0]["marker"], true);

    // A sacct without --json: every marker unknown, with a warning; the
    // numbers are the same.
    let (code, out, err) = run(keel()
        .env("PATH", &path)
        .env("SACCT_NO_JSON", "1")
        .args(["--json", "cost", "--since", "2026-09-01", "--prices"])
        .arg(cost_fixture("prices.toml")));
    assert_eq!(code, 0, "{err}");
    assert!(
        err.contains("sacct --json: sacct failed")
            && err.contains("every job's keel-run marker is unknown"),
        "{err}"
    );
    let v: Value = serde_json::from_str(&out).expect("json");
    assert!(close(
        v["report"]["total"]["gpu_hours"].as_f64().expect("f64"),
        138.0
    ));
    assert!(v["report"]["jobs"]
        .as_array()
        .expect("jobs")
        .iter()
        .all(|j| j["marker"].is_null()));

    let (code, _, err) = run(keel()
        .env("PATH", &path)
        .env("SACCT_SLEEP", "5")
        .args(["cost", "--sacct-timeout", "1", "--prices"])
        .arg(cost_fixture("prices.toml")));
    assert_eq!(code, 74, "{err}");
    assert!(err.contains("sacct did not finish within 1 s"), "{err}");
}
