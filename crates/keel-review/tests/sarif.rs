//! keel review's SARIF validated against the SARIF 2.1.0 JSON schema (the
//! OASIS Standard's, with Errata 01), vendored under `tests/fixtures/sarif/`:
//! a review of every rule's
//! failing input, with suppressed findings and input problems, so that
//! every kind of result and notification keel writes is in the document.

use std::path::{Path, PathBuf};

use keel_review::report::Suppressions;
use keel_review::slurm::FsLoader;
use keel_review::{detect, parse_all, review, rules, Options, ReviewOptions, Source};
use serde_json::Value;

fn fixtures() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures")
}

fn schema() -> Value {
    let text =
        std::fs::read_to_string(fixtures().join("sarif/sarif-schema-2.1.0.json")).expect("schema");
    serde_json::from_str(&text).expect("schema is JSON")
}

/// The SARIF of a review of every rule's failing input, plus a malformed
/// slurm.conf line and an unknown key (diagnostics), with suppressions.
fn sarif() -> Value {
    let root = fixtures().join("rules");
    let mut texts = Vec::new();
    let mut dirs: Vec<PathBuf> = std::fs::read_dir(&root)
        .expect("rules")
        .map(|e| e.expect("entry").path().join("fail"))
        .collect();
    dirs.sort();
    for dir in dirs {
        let mut files: Vec<PathBuf> = std::fs::read_dir(&dir)
            .expect("fail dir")
            .map(|e| e.expect("entry").path())
            .collect();
        files.sort();
        for p in files {
            let text = std::fs::read_to_string(&p).expect("fixture");
            texts.push((p.strip_prefix(&root).expect("under").to_path_buf(), text));
        }
    }
    texts.push((
        PathBuf::from("broken/slurm.conf"),
        "ClusterName=x\nthis line is not a setting\nNoSuchKey=1\n".to_owned(),
    ));
    let sources: Vec<Source<'_>> = texts
        .iter()
        .map(|(p, t)| Source {
            path: p,
            text: t,
            kind: detect(p, t).expect("kind"),
        })
        .collect();
    let catalogue = rules();
    let (inputs, diags) = parse_all(&sources, &FsLoader);
    assert!(!diags.is_empty(), "the broken slurm.conf gives diagnostics");
    let suppressions = Suppressions::parse(
        "[[suppress]]\nrule = \"KEEL-REL-001\"\nreason = \"health checks run from cron here\"\n\
         [[suppress]]\nrule = \"KEEL-SEC-013\"\nfile = \"gateway.toml\"\nreason = \"signing starts next quarter\"\nexpires = \"2099-12-31\"\n",
        &catalogue,
    )
    .expect("suppressions");
    let report = review(
        &catalogue,
        &inputs,
        diags,
        &ReviewOptions {
            eval: Options {
                storage_ingress: Some(keel_units::Bandwidth::parse("20Gbit/s").expect("bandwidth")),
            },
            suppressions,
            today: Some("2026-11-26".to_owned()),
        },
    );
    assert!(report.findings.iter().any(|f| f.suppressed.is_some()));
    for r in &catalogue {
        assert!(
            report.findings.iter().any(|f| f.rule == r.id),
            "{}: no finding",
            r.id
        );
    }
    report.sarif("0.0.0")
}

fn errors(schema: &Value, doc: &Value) -> Vec<String> {
    let validator = jsonschema::validator_for(schema).expect("the schema compiles");
    validator
        .iter_errors(doc)
        .map(|e| format!("{} at {}", e, e.instance_path()))
        .collect()
}

#[test]
fn sarif_is_valid_against_the_sarif_2_1_0_schema() {
    let doc = sarif();
    let errs = errors(&schema(), &doc);
    assert!(errs.is_empty(), "{errs:#?}");
}

/// The validation catches what a broken writer produces: a wrong
/// version, a level outside the enum, a region starting at line 0, a
/// suppression without its kind, a property the schema does not define.
#[test]
fn the_schema_rejects_broken_sarif() {
    let doc = sarif();
    type Break = (&'static str, fn(&mut Value));
    let breaks: [Break; 5] = [
        ("version", |d| d["version"] = "2.0.0".into()),
        ("level", |d| {
            d["runs"][0]["results"][0]["level"] = "fatal".into()
        }),
        ("startLine", |d| {
            d["runs"][0]["results"][0]["locations"][0]["physicalLocation"]["region"]["startLine"] =
                0.into()
        }),
        ("suppression kind", |d| {
            let results = d["runs"][0]["results"].as_array_mut().expect("results");
            let r = results
                .iter_mut()
                .find(|r| r.get("suppressions").is_some())
                .expect("a suppressed result");
            r["suppressions"][0]
                .as_object_mut()
                .expect("object")
                .remove("kind");
        }),
        ("unknown property", |d| d["runs"][0]["bogus"] = true.into()),
    ];
    let s = schema();
    for (what, f) in &breaks {
        let mut bad = doc.clone();
        f(&mut bad);
        assert!(!errors(&s, &bad).is_empty(), "{what} not caught");
    }
}
