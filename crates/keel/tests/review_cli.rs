//! `keel review` and `keel cost` as processes: exit codes, versioned JSON,
//! SARIF's required structure, suppressions, the generated rule reference,
//! and reviews of the project's own test cluster and test gateways.

mod serve_common;

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
/// own `write_conf`, run on DIR=/tmp/keel-slurm), and its gres.conf.
fn write_test_cluster_conf(dir: &Path) {
    let script = repo().join("scripts/slurm-cluster");
    let status = Command::new("bash")
        .arg("-c")
        .arg(
            r#"set -euo pipefail
eval "$(grep -E '^(NODES|FIRST_PORT|CTLD_PORT)=' "$1")"
eval "$(sed -n '/^write_conf() {/,/^}/p' "$1")"
unset KEEL_TEST_SLURM_HEALTHCHECK
write_conf /tmp/keel-slurm "$2/slurm.conf"
printf 'NodeName=%s Name=gpu File=%s/dev/gpu[0-7]\n' "${NODES[-1]}" /tmp/keel-slurm >"$2/gres.conf""#,
        )
        .arg("bash")
        .arg(&script)
        .arg(dir)
        .status()
        .expect("bash");
    assert!(status.success());
}

#[test]
fn review_of_the_test_cluster_and_the_test_gateways() {
    let dir = tempfile::tempdir().expect("tempdir");
    write_test_cluster_conf(dir.path());
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
    let (code, out, err) = run(keel().current_dir(dir.path()).args([
        "review",
        "--fail-on",
        "never",
        "slurm.conf",
        "gres.conf",
        "gateway.toml",
        "bench.toml",
    ]));
    assert_eq!(code, 0, "{err}");
    insta::assert_snapshot!("review-test-cluster-and-gateways", out);
}
