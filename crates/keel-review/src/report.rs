//! A review's report: findings per rule, suppressions with their reasons,
//! a score per pillar, and its renderings (text, SARIF 2.1.0, Markdown).

use std::collections::BTreeMap;
use std::fmt::Write as _;

use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};

use crate::catalogue::{Pillar, Rule, Severity};
use crate::eval::{evaluate, Options, Outcome};
use crate::inputs::{Input, Kind};
use crate::{Diagnostic, Location};

/// A suppression file: `[[suppress]]` tables.
#[derive(Debug, Clone, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Suppressions {
    #[serde(default)]
    pub suppress: Vec<Suppression>,
}

/// One suppression: a rule, optionally only in files whose path is `file`
/// or ends with `/` and `file`, with a reason, until `expires` (YYYY-MM-DD,
/// inclusive).
#[derive(Debug, Clone, Deserialize, Serialize, PartialEq, Eq)]
#[serde(deny_unknown_fields)]
pub struct Suppression {
    pub rule: String,
    #[serde(default)]
    pub file: Option<String>,
    pub reason: String,
    #[serde(default)]
    pub expires: Option<String>,
}

#[derive(Debug, thiserror::Error)]
pub enum SuppressionError {
    #[error("suppressions: {0}")]
    Parse(String),
    #[error("suppressions: entry {index} (rule {rule}) needs a reason")]
    NoReason { index: usize, rule: String },
    #[error("suppressions: entry {index} names unknown rule {rule}")]
    UnknownRule { index: usize, rule: String },
    #[error("suppressions: entry {index}: expires must be YYYY-MM-DD")]
    BadDate { index: usize },
}

impl Suppressions {
    /// Parses and checks a suppression file against the catalogue.
    pub fn parse(text: &str, rules: &[Rule]) -> Result<Self, SuppressionError> {
        let s: Suppressions = toml::from_str(text)
            .map_err(|e| SuppressionError::Parse(crate::cut(e.message().trim_end())))?;
        for (index, sup) in s.suppress.iter().enumerate() {
            let index = index + 1;
            if !rules.iter().any(|r| r.id == sup.rule) {
                return Err(SuppressionError::UnknownRule {
                    index,
                    rule: crate::cut(&sup.rule),
                });
            }
            if sup.reason.trim().is_empty() {
                return Err(SuppressionError::NoReason {
                    index,
                    rule: sup.rule.clone(),
                });
            }
            if let Some(d) = &sup.expires {
                let ok = d.len() == 10
                    && d.bytes().enumerate().all(|(i, b)| {
                        if i == 4 || i == 7 {
                            b == b'-'
                        } else {
                            b.is_ascii_digit()
                        }
                    });
                if !ok {
                    return Err(SuppressionError::BadDate { index });
                }
            }
        }
        Ok(s)
    }

    fn find(&self, rule: &str, file: &str, today: Option<&str>) -> Option<&Suppression> {
        self.suppress.iter().find(|s| {
            s.rule == rule
                && s.file.as_deref().is_none_or(|f| {
                    file == f || file.strip_suffix(f).is_some_and(|head| head.ends_with('/'))
                })
                && match (&s.expires, today) {
                    (Some(exp), Some(t)) => t <= exp.as_str(),
                    _ => true,
                }
        })
    }
}

/// One failure of one rule.
#[derive(Debug, Clone, Serialize, PartialEq, Eq)]
pub struct Finding {
    pub rule: String,
    pub pillar: Pillar,
    pub severity: Severity,
    pub location: Location,
    pub message: String,
    /// The suppression's reason, when one applies.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub suppressed: Option<String>,
}

/// A rule's status in this review.
#[derive(Debug, Clone, Copy, Serialize, PartialEq, Eq)]
#[serde(rename_all = "snake_case")]
pub enum Status {
    Pass,
    Fail,
    /// Failed, with every failure suppressed.
    Suppressed,
    /// No input of its kind was reviewed.
    NotApplicable,
}

#[derive(Debug, Clone, Serialize, PartialEq, Eq)]
pub struct RuleStatus {
    pub rule: String,
    pub status: Status,
}

/// A pillar's score: the severity-weighted share of applicable rules that
/// pass (a suppressed rule counts as passing), 0-100; `None` when no rule
/// of the pillar applied.
#[derive(Debug, Clone, Serialize, PartialEq, Eq)]
pub struct PillarScore {
    pub pillar: Pillar,
    pub score: Option<u32>,
    pub passed: usize,
    pub failed: usize,
    pub suppressed: usize,
    pub not_applicable: usize,
}

#[derive(Debug, Clone, Serialize, PartialEq, Eq)]
pub struct InputSummary {
    pub file: String,
    pub kind: Kind,
}

/// The whole review.
#[derive(Debug, Clone, Serialize)]
pub struct Report {
    pub inputs: Vec<InputSummary>,
    pub pillars: Vec<PillarScore>,
    pub findings: Vec<Finding>,
    pub rules: Vec<RuleStatus>,
    pub diagnostics: Vec<Diagnostic>,
    #[serde(skip)]
    catalogue: Vec<Rule>,
}

/// What a review needs besides its inputs.
#[derive(Debug, Clone, Default)]
pub struct ReviewOptions {
    pub eval: Options,
    pub suppressions: Suppressions,
    /// Today as YYYY-MM-DD, for suppressions' `expires`.
    pub today: Option<String>,
}

/// Runs every rule of `catalogue` over `inputs`.
pub fn review(
    catalogue: &[Rule],
    inputs: &[Input],
    diagnostics: Vec<Diagnostic>,
    opts: &ReviewOptions,
) -> Report {
    let mut findings = Vec::new();
    let mut rules = Vec::new();
    for rule in catalogue {
        let status = match evaluate(rule, inputs, &opts.eval) {
            Outcome::NotApplicable => Status::NotApplicable,
            Outcome::Pass => Status::Pass,
            Outcome::Fail(failures) => {
                let mut all_suppressed = true;
                for f in failures {
                    let suppressed = opts
                        .suppressions
                        .find(&rule.id, &f.location.file, opts.today.as_deref())
                        .map(|s| s.reason.clone());
                    all_suppressed &= suppressed.is_some();
                    findings.push(Finding {
                        rule: rule.id.clone(),
                        pillar: rule.pillar,
                        severity: rule.severity,
                        location: f.location,
                        message: f.message,
                        suppressed,
                    });
                }
                if all_suppressed {
                    Status::Suppressed
                } else {
                    Status::Fail
                }
            }
        };
        rules.push(RuleStatus {
            rule: rule.id.clone(),
            status,
        });
    }
    let pillars = Pillar::ALL
        .into_iter()
        .map(|p| {
            let mut s = PillarScore {
                pillar: p,
                score: None,
                passed: 0,
                failed: 0,
                suppressed: 0,
                not_applicable: 0,
            };
            let (mut got, mut total) = (0u32, 0u32);
            for (rule, st) in catalogue.iter().zip(&rules).filter(|(r, _)| r.pillar == p) {
                let w = rule.severity.weight();
                match st.status {
                    Status::Pass => {
                        s.passed += 1;
                        got += w;
                        total += w;
                    }
                    Status::Suppressed => {
                        s.suppressed += 1;
                        got += w;
                        total += w;
                    }
                    Status::Fail => {
                        s.failed += 1;
                        total += w;
                    }
                    Status::NotApplicable => s.not_applicable += 1,
                }
            }
            s.score = (got * 100 + total / 2).checked_div(total);
            s
        })
        .collect();
    Report {
        inputs: inputs
            .iter()
            .map(|i| InputSummary {
                file: i.file().to_owned(),
                kind: i.kind(),
            })
            .collect(),
        pillars,
        findings,
        rules,
        diagnostics,
        catalogue: catalogue.to_vec(),
    }
}

impl Report {
    /// The most severe finding not suppressed.
    pub fn worst(&self) -> Option<Severity> {
        self.findings
            .iter()
            .filter(|f| f.suppressed.is_none())
            .map(|f| f.severity)
            .max()
    }

    /// Whether a finding at or above `threshold` is left.
    pub fn fails(&self, threshold: Severity) -> bool {
        self.worst().is_some_and(|w| w >= threshold)
    }

    /// The human report: pillars in order, each with its score and the
    /// failed rules with their findings and fixes.
    pub fn text(&self) -> String {
        let mut s = String::new();
        let applicable = self
            .rules
            .iter()
            .filter(|r| r.status != Status::NotApplicable)
            .count();
        let _ = writeln!(
            s,
            "keel review: {} input{}, {} of {} rules applied",
            self.inputs.len(),
            if self.inputs.len() == 1 { "" } else { "s" },
            applicable,
            self.rules.len()
        );
        for i in &self.inputs {
            let _ = writeln!(s, "  {:<8} {}", i.kind.name(), i.file);
        }
        for p in &self.pillars {
            let score = p
                .score
                .map_or_else(|| "n/a".to_owned(), |v| format!("{v}/100"));
            let _ = writeln!(
                s,
                "\n{} {}: {} passed, {} failed, {} suppressed, {} not applicable",
                p.pillar.title(),
                score,
                p.passed,
                p.failed,
                p.suppressed,
                p.not_applicable
            );
            for (rule, st) in self.catalogue.iter().zip(&self.rules).filter(|(r, st)| {
                r.pillar == p.pillar && matches!(st.status, Status::Fail | Status::Suppressed)
            }) {
                let tag = if st.status == Status::Fail {
                    "FAIL"
                } else {
                    "SUPPRESSED"
                };
                let _ = writeln!(
                    s,
                    "  {tag} {} {} [{}]: {}",
                    rule.severity.name(),
                    rule.id,
                    rule.name,
                    rule.title
                );
                for f in self.findings.iter().filter(|f| f.rule == rule.id) {
                    let _ = writeln!(
                        s,
                        "    {}:{}: {}",
                        f.location.file, f.location.line, f.message
                    );
                    if let Some(r) = &f.suppressed {
                        let _ = writeln!(s, "      suppressed: {r}");
                    }
                }
                if st.status == Status::Fail {
                    let _ = writeln!(s, "    fix: {}", rule.fix);
                    let _ = writeln!(s, "    why: {} ({})", rule.why, rule.seed);
                }
            }
        }
        if !self.diagnostics.is_empty() {
            let _ = writeln!(s, "\nInput problems:");
            for d in &self.diagnostics {
                let kind = match d.kind {
                    crate::DiagnosticKind::Malformed => "malformed",
                    crate::DiagnosticKind::UnknownKey => "unknown key",
                    crate::DiagnosticKind::Include => "include",
                    crate::DiagnosticKind::UnknownInput => "unknown input",
                };
                let _ = writeln!(
                    s,
                    "  {}:{}: {kind}: {}",
                    d.location.file, d.location.line, d.message
                );
            }
        }
        s
    }

    /// The report as a SARIF 2.1.0 log: one run, every catalogue rule as a
    /// reporting descriptor, every finding as a result (suppressed ones
    /// with an external, accepted suppression and its reason), input
    /// problems as tool notifications.
    pub fn sarif(&self, tool_version: &str) -> serde_json::Value {
        use serde_json::json;
        let index: BTreeMap<&str, usize> = self
            .catalogue
            .iter()
            .enumerate()
            .map(|(i, r)| (r.id.as_str(), i))
            .collect();
        let rules: Vec<_> = self
            .catalogue
            .iter()
            .map(|r| {
                let mut props = json!({
                    "tags": [r.pillar.name(), r.target.name()],
                    "precision": "high",
                    "seed": r.seed,
                });
                if r.pillar == Pillar::Security {
                    props["security-severity"] = json!(match r.severity {
                        Severity::High => "8.0",
                        Severity::Medium => "5.0",
                        Severity::Low => "2.0",
                    });
                }
                json!({
                    "id": r.id,
                    "name": r.name,
                    "shortDescription": { "text": r.title },
                    "fullDescription": { "text": format!("{} {}", r.checks, r.why) },
                    "help": {
                        "text": format!("Fix: {}\nWhy: {} ({}: \"{}\")", r.fix, r.why, r.seed, r.recommendation),
                        "markdown": format!("**Fix:** {}\n\n**Why:** {}\n\n> {}\n\n— `{}`", r.fix, r.why, r.recommendation, r.seed),
                    },
                    "defaultConfiguration": { "level": level(r.severity) },
                    "properties": props,
                })
            })
            .collect();
        let results: Vec<_> = self
            .findings
            .iter()
            .map(|f| {
                let mut res = json!({
                    "ruleId": f.rule,
                    "ruleIndex": index.get(f.rule.as_str()).copied().unwrap_or(0),
                    "level": level(f.severity),
                    "message": { "text": f.message },
                    "locations": [{
                        "physicalLocation": {
                            "artifactLocation": { "uri": uri(&f.location.file) },
                            "region": { "startLine": f.location.line.max(1) },
                        }
                    }],
                    "partialFingerprints": {
                        "keel/v1": fingerprint(&f.rule, &f.location.file, &f.message),
                    },
                });
                if let Some(reason) = &f.suppressed {
                    res["suppressions"] = json!([{
                        "kind": "external",
                        "status": "accepted",
                        "justification": reason,
                    }]);
                }
                res
            })
            .collect();
        let notifications: Vec<_> = self
            .diagnostics
            .iter()
            .map(|d| {
                json!({
                    "level": "warning",
                    "message": { "text": d.message },
                    "locations": [{
                        "physicalLocation": {
                            "artifactLocation": { "uri": uri(&d.location.file) },
                            "region": { "startLine": d.location.line.max(1) },
                        }
                    }],
                })
            })
            .collect();
        json!({
            "$schema": "https://json.schemastore.org/sarif-2.1.0.json",
            "version": "2.1.0",
            "runs": [{
                "tool": { "driver": {
                    "name": "keel",
                    "version": tool_version,
                    "rules": rules,
                }},
                "invocations": [{
                    "executionSuccessful": true,
                    "toolConfigurationNotifications": notifications,
                }],
                "results": results,
            }],
        })
    }
}

fn level(s: Severity) -> &'static str {
    match s {
        Severity::High => "error",
        Severity::Medium => "warning",
        Severity::Low => "note",
    }
}

/// A file path as a URI reference: relative paths stay relative (to the
/// directory keel ran in), absolute ones become `file://` URIs; characters
/// outside RFC 3986's unreserved set and `/` are %-encoded.
fn uri(path: &str) -> String {
    let mut out = String::new();
    if path.starts_with('/') {
        out.push_str("file://");
    }
    for b in path.bytes() {
        if b.is_ascii_alphanumeric() || b"-._~/".contains(&b) {
            out.push(char::from(b));
        } else {
            let _ = write!(out, "%{b:02X}");
        }
    }
    out
}

fn fingerprint(rule: &str, file: &str, message: &str) -> String {
    let mut h = Sha256::new();
    for part in [rule, file, message] {
        h.update(part.as_bytes());
        h.update([0]);
    }
    h.finalize()[..16].iter().fold(String::new(), |mut s, b| {
        let _ = write!(s, "{b:02x}");
        s
    })
}

/// The catalogue as Markdown: a table per pillar, then every rule.
pub fn markdown(catalogue: &[Rule]) -> String {
    let mut s = String::from(include_str!("../guide.md"));
    s.push_str("\n# Rules\n\n");
    s.push_str("This file is generated by `keel review --list-rules --format markdown`\n");
    s.push_str("from `crates/keel-review/guide.md` and `crates/keel-review/rules.toml`;\n");
    s.push_str("a test fails when it is not current. Each rule cites the seed document\n");
    s.push_str("and the recommendation it comes from.\n");
    for p in Pillar::ALL {
        let _ = write!(s, "\n## {}\n\n", p.title());
        s.push_str("| id | severity | reads | rule |\n|---|---|---|---|\n");
        for r in catalogue.iter().filter(|r| r.pillar == p) {
            let _ = writeln!(
                s,
                "| [{}](#{}) | {} | {} | {} |",
                r.id,
                r.id.to_ascii_lowercase(),
                r.severity.name(),
                r.target.name(),
                r.title.replace('|', "\\|")
            );
        }
    }
    s.push_str("\n## Every rule\n");
    for r in catalogue {
        let _ = write!(
            s,
            "\n### {}\n\n`{}` · {} · {} · reads {}\n\n- **Checks:** {}\n- **Why:** {}\n- **Seed:** `{}`: \"{}\"\n- **Fix:** {}\n",
            r.id,
            r.name,
            r.pillar.name(),
            r.severity.name(),
            r.target.name(),
            r.checks,
            r.why,
            r.seed,
            r.recommendation,
            r.fix
        );
    }
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn suppressions_match_whole_path_components_and_expire() {
        let rules = crate::rules();
        let s = Suppressions::parse(
            "[[suppress]]\nrule = \"KEEL-REL-004\"\nfile = \"slurm.conf\"\nreason = \"r\"\nexpires = \"2026-12-31\"\n",
            &rules,
        )
        .expect("parse");
        let today = Some("2026-12-31");
        assert!(s.find("KEEL-REL-004", "slurm.conf", today).is_some());
        assert!(s
            .find("KEEL-REL-004", "/etc/slurm/slurm.conf", today)
            .is_some());
        assert!(s
            .find("KEEL-REL-004", "/etc/slurm/myslurm.conf", today)
            .is_none());
        assert!(s.find("KEEL-REL-005", "slurm.conf", today).is_none());
        assert!(s
            .find("KEEL-REL-004", "slurm.conf", Some("2027-01-01"))
            .is_none());
    }
}
