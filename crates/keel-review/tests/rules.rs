//! Every rule as data: `tests/fixtures/rules/<ID>/pass/` holds an input the
//! rule passes, `fail/` one it fails; the failing findings are snapshots.

use std::path::{Path, PathBuf};

use keel_review::report::Status;
use keel_review::slurm::FsLoader;
use keel_review::{detect, parse_all, review, rules, Options, ReviewOptions, Source};

fn fixtures() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/rules")
}

fn options() -> ReviewOptions {
    ReviewOptions {
        eval: Options {
            storage_ingress: Some(keel_units::Bandwidth::parse("20Gbit/s").expect("bandwidth")),
        },
        ..ReviewOptions::default()
    }
}

/// Reviews every file in `dir` (named relative to the fixtures) and
/// returns the rule's status and its findings as `file:line: message`.
fn check(dir: &Path, rule: &str) -> (Status, String) {
    let root = fixtures();
    let mut texts = Vec::new();
    let mut entries: Vec<_> = std::fs::read_dir(dir)
        .expect("fixture dir")
        .map(|e| e.expect("entry").path())
        .collect();
    entries.sort();
    for p in entries {
        let text = std::fs::read_to_string(&p).expect("fixture");
        let shown = p.strip_prefix(&root).expect("under fixtures").to_path_buf();
        texts.push((shown, text));
    }
    let sources: Vec<Source<'_>> = texts
        .iter()
        .map(|(p, t)| Source {
            path: p,
            text: t,
            kind: detect(p, t).expect("fixture kind"),
        })
        .collect();
    let (inputs, diags) = parse_all(&sources, &FsLoader);
    let report = review(&rules(), &inputs, diags, &options());
    let status = report
        .rules
        .iter()
        .find(|r| r.rule == rule)
        .expect("rule in report")
        .status;
    let mut out = String::new();
    for f in report.findings.iter().filter(|f| f.rule == rule) {
        out.push_str(&format!(
            "{}:{}: {}\n",
            f.location.file, f.location.line, f.message
        ));
    }
    (status, out)
}

#[test]
fn every_rule_passes_its_passing_input_and_fails_its_failing_one() {
    let mut settings = insta::Settings::clone_current();
    settings.set_prepend_module_to_snapshot(false);
    settings.set_snapshot_path("snapshots/rules");
    let _guard = settings.bind_to_scope();
    for rule in rules() {
        let dir = fixtures().join(&rule.id);
        let (pass, findings) = check(&dir.join("pass"), &rule.id);
        assert_eq!(pass, Status::Pass, "{}: pass input: {findings}", rule.id);
        let (fail, findings) = check(&dir.join("fail"), &rule.id);
        assert_eq!(fail, Status::Fail, "{}: fail input", rule.id);
        insta::assert_snapshot!(rule.id.clone(), findings);
    }
}

/// A cluster set up as Azure CycleCloud sets it up (slurm.conf, gres.conf,
/// the HPC image's /etc/nccl.conf), with keel's recommended additions and
/// the seeds' NCCL job made a training job, gets no finding above low:
/// none of the deliberate choices (ReturnToService=2 on autoscaled CLOUD
/// nodes, JobRequeue's default, NCCL settings in /etc/nccl.conf, Slurm
/// 25.05's PrologTimeout) is reported as a problem.
#[test]
fn a_cluster_set_up_as_the_seeds_and_cyclecloud_advise_has_no_finding_above_low() {
    let dir = fixtures().join("../clusters/cyclecloud");
    let mut texts = Vec::new();
    let mut entries: Vec<_> = std::fs::read_dir(&dir)
        .expect("fixture dir")
        .map(|e| e.expect("entry").path())
        .collect();
    entries.sort();
    for p in entries {
        let text = std::fs::read_to_string(&p).expect("fixture");
        texts.push((p.clone(), text));
    }
    let sources: Vec<Source<'_>> = texts
        .iter()
        .map(|(p, t)| Source {
            path: p,
            text: t,
            kind: detect(p, t).expect("fixture kind"),
        })
        .collect();
    assert_eq!(sources.len(), 4);
    let (inputs, diags) = parse_all(&sources, &FsLoader);
    assert!(diags.is_empty(), "{diags:?}");
    let report = review(&rules(), &inputs, diags, &options());
    let above_low: Vec<String> = report
        .findings
        .iter()
        .filter(|f| f.severity > keel_review::Severity::Low)
        .map(|f| {
            format!(
                "{} {:?} {}:{}: {}",
                f.rule, f.severity, f.location.file, f.location.line, f.message
            )
        })
        .collect();
    assert!(above_low.is_empty(), "{above_low:#?}");
    // The rules this is about were evaluated, not skipped.
    for id in [
        "KEEL-REL-004",
        "KEEL-REL-007",
        "KEEL-REL-008",
        "KEEL-PERF-002",
        "KEEL-PERF-004",
        "KEEL-PERF-009",
    ] {
        let r = report.rules.iter().find(|r| r.rule == id).expect("rule");
        assert_eq!(r.status, Status::Pass, "{id}");
    }
}
