//! The rule catalogue: `rules.toml`, compiled in, read into typed rules.

use serde::{Deserialize, Serialize};

use crate::inputs::Kind;

const RULES: &str = include_str!("../rules.toml");

/// The five Well-Architected pillars, in report order.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Pillar {
    Reliability,
    Security,
    Cost,
    Operations,
    Performance,
}

impl Pillar {
    pub const ALL: [Pillar; 5] = [
        Pillar::Reliability,
        Pillar::Security,
        Pillar::Cost,
        Pillar::Operations,
        Pillar::Performance,
    ];

    pub fn name(self) -> &'static str {
        match self {
            Pillar::Reliability => "reliability",
            Pillar::Security => "security",
            Pillar::Cost => "cost",
            Pillar::Operations => "operations",
            Pillar::Performance => "performance",
        }
    }

    pub fn title(self) -> &'static str {
        match self {
            Pillar::Reliability => "Reliability",
            Pillar::Security => "Security",
            Pillar::Cost => "Cost optimization",
            Pillar::Operations => "Operational excellence",
            Pillar::Performance => "Performance efficiency",
        }
    }
}

/// How much a failed rule matters; ordered low < medium < high.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Severity {
    Low,
    Medium,
    High,
}

impl Severity {
    pub fn name(self) -> &'static str {
        match self {
            Severity::Low => "low",
            Severity::Medium => "medium",
            Severity::High => "high",
        }
    }

    pub fn parse(s: &str) -> Option<Severity> {
        match s {
            "low" => Some(Severity::Low),
            "medium" => Some(Severity::Medium),
            "high" => Some(Severity::High),
            _ => None,
        }
    }

    /// Weight in a pillar's score.
    pub fn weight(self) -> u32 {
        match self {
            Severity::Low => 1,
            Severity::Medium => 2,
            Severity::High => 3,
        }
    }
}

/// What a check reads besides the input.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Params {
    /// A slurm.conf key, a dotted TOML path, an environment variable, or a
    /// gateway listener table.
    #[serde(default)]
    pub key: Option<String>,
    #[serde(default)]
    pub values: Vec<String>,
    /// The value Slurm or keel uses when the key is absent.
    #[serde(default)]
    pub default: Option<String>,
    #[serde(default)]
    pub min: Option<i64>,
    /// Keys whose presence makes the rule apply.
    #[serde(default)]
    pub when: Vec<String>,
    /// An sbatch option's long name.
    #[serde(default)]
    pub option: Option<String>,
}

/// One rule.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Rule {
    pub id: String,
    pub name: String,
    pub pillar: Pillar,
    pub severity: Severity,
    pub target: Kind,
    pub check: String,
    #[serde(default)]
    pub params: Params,
    pub title: String,
    pub checks: String,
    pub seed: String,
    pub recommendation: String,
    pub why: String,
    pub fix: String,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct File {
    rule: Vec<Rule>,
}

/// The built-in catalogue, in file order.
pub fn rules() -> Vec<Rule> {
    // The file is compiled in and checked by the tests below: a parse
    // error here is a build defect, never user input.
    match toml::from_str::<File>(RULES) {
        Ok(f) => f.rule,
        Err(e) => panic!("rules.toml: {e}"),
    }
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeSet;

    use super::*;

    #[test]
    fn catalogue_is_well_formed() {
        let rules = rules();
        assert!(rules.len() >= 30, "{} rules", rules.len());
        let ids: BTreeSet<_> = rules.iter().map(|r| r.id.as_str()).collect();
        assert_eq!(ids.len(), rules.len(), "duplicate ids");
        let names: BTreeSet<_> = rules.iter().map(|r| r.name.as_str()).collect();
        assert_eq!(names.len(), rules.len(), "duplicate names");
        for p in Pillar::ALL {
            assert!(rules.iter().any(|r| r.pillar == p), "no rule for {p:?}");
        }
        for r in &rules {
            let prefix = match r.pillar {
                Pillar::Reliability => "KEEL-REL-",
                Pillar::Security => "KEEL-SEC-",
                Pillar::Cost => "KEEL-COST-",
                Pillar::Operations => "KEEL-OPS-",
                Pillar::Performance => "KEEL-PERF-",
            };
            assert!(r.id.starts_with(prefix), "{} is not {prefix}", r.id);
            assert!(
                r.seed.len() > 4 && r.seed.ends_with(".txt"),
                "{}: seed {}",
                r.id,
                r.seed
            );
            for field in [&r.title, &r.checks, &r.recommendation, &r.why, &r.fix] {
                assert!(!field.trim().is_empty(), "{}: empty field", r.id);
            }
            assert!(
                crate::eval::known_check(&r.check),
                "{}: unknown check {}",
                r.id,
                r.check
            );
        }
    }

    #[test]
    fn slurm_rules_name_only_keys_slurm_knows() {
        let known: Vec<&str> = include_str!("../slurm-keys.txt").lines().collect();
        for r in rules().iter().filter(|r| r.target == Kind::Slurm) {
            for k in r.params.key.iter().chain(&r.params.when) {
                assert!(
                    known.contains(&k.as_str()),
                    "{}: {k} is not a slurm.conf key",
                    r.id
                );
            }
        }
    }
}
