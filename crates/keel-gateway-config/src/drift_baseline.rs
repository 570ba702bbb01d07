//! Recorded drift baselines: a version's reference window (or its current
//! window) written to a file, so that a model's drift is measured against
//! a known good behaviour rather than against whatever a version answered
//! first after the gateway started.
//!
//! The file is JSON, written by `keel serve drift baseline save` from the
//! admin API's `GET /admin/drift/MODEL/baseline` and read at start for
//! models with `drift.baseline_file`:
//!
//! ```json
//! {"version": 1, "model": "chat", "recorded_from": "v2", "window": "reference",
//!  "recorded_at": "2026-11-26T08:00:00Z",
//!  "features": [{"name": "completion_tokens", "edges": [1.0, 2.0], "counts": [0, 3, 97]}]}
//! ```
//!
//! Each feature is a histogram: `edges` strictly increasing and finite,
//! `counts` one more than the edges (below the first edge, between two,
//! from the last one up), not all zero. Feature names are the output
//! features of [`crate::drift_features::FEATURES`] and OIP input features
//! (`input.TENSOR` or `input.TENSOR.COLUMN`). A file that does not read
//! or does not pass these checks is an error at start, never ignored.

use std::path::{Path, PathBuf};

use keel_canary::drift::Histogram;
use serde::{Deserialize, Serialize};

/// The baseline format this gateway reads and writes.
pub const BASELINE_VERSION: u32 = 1;

/// The most observations one feature of a baseline may hold (10^12): a
/// window is `registry.drift_reference_requests` or
/// `registry.drift_window_requests` observations, so a larger total is not
/// one keel recorded.
pub const MAX_BASELINE_OBSERVATIONS: u64 = 1_000_000_000_000;

/// A baseline file as written.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct BaselineFile {
    pub version: u32,
    /// The gateway model it was recorded for.
    pub model: String,
    /// The deployment (`v<N>`) whose answers it holds.
    pub recorded_from: String,
    /// `reference` or `current`.
    pub window: String,
    pub recorded_at: String,
    pub features: Vec<BaselineFeature>,
}

/// One feature's histogram.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct BaselineFeature {
    pub name: String,
    pub edges: Vec<f64>,
    pub counts: Vec<u64>,
}

#[derive(Debug, thiserror::Error)]
pub enum BaselineError {
    #[error("cannot read the drift baseline {path}")]
    Read {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("the drift baseline {path} is not a baseline file: {message}")]
    Parse { path: PathBuf, message: String },
    #[error("the drift baseline {path}: {message}")]
    Invalid { path: PathBuf, message: String },
}

/// A validated baseline: the reference histogram of each feature it has.
#[derive(Debug, Clone)]
pub struct Baseline {
    pub file: BaselineFile,
    pub histograms: Vec<(String, Histogram)>,
}

/// Whether `name` is a feature a baseline may hold.
pub fn known_feature(name: &str) -> bool {
    crate::drift_features::FEATURES.contains(&name)
        || name
            .strip_prefix("input.")
            .is_some_and(crate::drift_features::valid_input_label)
}

/// The largest baseline file read: a regular file
/// ([`keel_fs::read_regular`]); real ones are some kilobytes.
pub const MAX_BASELINE_BYTES: u64 = keel_fs::MAX_CONFIG_BYTES;

impl Baseline {
    /// Reads and checks `path`, a baseline for gateway model `model`.
    pub fn read(path: &Path, model: &str) -> Result<Self, BaselineError> {
        let bytes = keel_fs::read_regular(path, MAX_BASELINE_BYTES).map_err(|source| {
            BaselineError::Read {
                path: path.to_owned(),
                source,
            }
        })?;
        let file: BaselineFile =
            serde_json::from_slice(&bytes).map_err(|e| BaselineError::Parse {
                path: path.to_owned(),
                message: e.to_string(),
            })?;
        Baseline::check(file, model).map_err(|message| BaselineError::Invalid {
            path: path.to_owned(),
            message,
        })
    }

    /// Checks a parsed baseline for gateway model `model`.
    pub fn check(file: BaselineFile, model: &str) -> Result<Self, String> {
        if file.version != BASELINE_VERSION {
            return Err(format!(
                "format version {} (this keel reads version {BASELINE_VERSION})",
                file.version
            ));
        }
        for (field, value) in [
            ("model", &file.model),
            ("recorded_from", &file.recorded_from),
            ("window", &file.window),
            ("recorded_at", &file.recorded_at),
        ] {
            if value.chars().any(char::is_control) {
                return Err(format!(
                    "{field} {:?} holds control characters",
                    value.chars().take(100).collect::<String>()
                ));
            }
        }
        if file.model != model {
            return Err(format!(
                "recorded for model {:?}, not {model:?}",
                file.model.chars().take(100).collect::<String>()
            ));
        }
        if file.features.is_empty() {
            return Err("it has no features".into());
        }
        let inputs = file
            .features
            .iter()
            .filter(|f| f.name.starts_with("input."))
            .count();
        if inputs > crate::drift_features::MAX_INPUT_FEATURES {
            return Err(format!(
                "{inputs} input features; at most {} are kept",
                crate::drift_features::MAX_INPUT_FEATURES
            ));
        }
        let mut histograms = Vec::with_capacity(file.features.len());
        for f in &file.features {
            let name: String = f.name.chars().take(100).collect();
            if !known_feature(&f.name) {
                return Err(format!(
                    "feature {name:?} is neither one of {:?} nor input.TENSOR[.COLUMN]",
                    crate::drift_features::FEATURES
                ));
            }
            if histograms.iter().any(|(n, _)| *n == f.name) {
                return Err(format!("feature {name:?} appears twice"));
            }
            Histogram::new(f.edges.clone()).map_err(|e| format!("feature {name:?}: {e}"))?;
            if f.counts.len() != f.edges.len() + 1 {
                return Err(format!(
                    "feature {name:?}: {} counts for {} edges (one more count than edges)",
                    f.counts.len(),
                    f.edges.len()
                ));
            }
            if f.counts.iter().all(|&c| c == 0) {
                return Err(format!("feature {name:?}: every count is 0"));
            }
            let h = Histogram::with_counts(f.edges.clone(), f.counts.clone())
                .map_err(|e| format!("feature {name:?}: {e}"))?;
            match h.checked_total() {
                Some(t) if t <= MAX_BASELINE_OBSERVATIONS => {}
                t => {
                    return Err(format!(
                        "feature {name:?}: the counts add up to {} observations; at most {MAX_BASELINE_OBSERVATIONS} are a baseline",
                        t.map_or_else(|| "more than 2^64".to_owned(), |t| t.to_string())
                    ))
                }
            }
            histograms.push((f.name.clone(), h));
        }
        Ok(Baseline { file, histograms })
    }

    /// The histogram of `feature`, if the baseline has it.
    pub fn get(&self, feature: &str) -> Option<&Histogram> {
        self.histograms
            .iter()
            .find(|(n, _)| n == feature)
            .map(|(_, h)| h)
    }
}

impl keel_error::HasKind for BaselineError {
    fn kind(&self) -> keel_error::ErrorKind {
        use keel_error::ErrorKind as K;
        match self {
            Self::Read { .. } => K::Io,
            Self::Parse { .. } | Self::Invalid { .. } => K::Input,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn file() -> BaselineFile {
        BaselineFile {
            version: 1,
            model: "chat".into(),
            recorded_from: "v1".into(),
            window: "reference".into(),
            recorded_at: "2026-11-26T08:00:00Z".into(),
            features: vec![
                BaselineFeature {
                    name: "completion_tokens".into(),
                    edges: vec![1.0, 8.0],
                    counts: vec![0, 3, 7],
                },
                BaselineFeature {
                    name: "input.x.0".into(),
                    edges: vec![0.5],
                    counts: vec![4, 4],
                },
            ],
        }
    }

    fn refused(f: impl FnOnce(&mut BaselineFile)) -> String {
        let mut b = file();
        f(&mut b);
        Baseline::check(b, "chat").expect_err("refused")
    }

    #[test]
    fn a_good_baseline_reads_and_bad_ones_are_refused_with_the_reason() {
        let b = Baseline::check(file(), "chat").expect("valid");
        assert_eq!(b.get("completion_tokens").map(|h| h.total()), Some(10));
        assert_eq!(
            b.get("input.x.0").map(|h| h.counts().to_vec()),
            Some(vec![4, 4])
        );
        assert!(b.get("latency_ms").is_none());
        assert_eq!(
            Baseline::check(file(), "other").expect_err("other model"),
            "recorded for model \"chat\", not \"other\""
        );
        assert!(refused(|b| b.version = 2).contains("format version 2"));
        assert!(refused(|b| b.features.clear()).contains("no features"));
        assert_eq!(
            refused(|b| b.recorded_from = "v1\u{1b}]0;owned\u{7}".into()),
            "recorded_from \"v1\\u{1b}]0;owned\\u{7}\" holds control characters"
        );
        let mut escaped = file();
        escaped.model = "chat\u{1b}[2J".into();
        assert!(Baseline::check(escaped, "chat\u{1b}[2J")
            .expect_err("control characters")
            .starts_with("model \"chat\\u{1b}[2J\" holds control characters"));
        assert!(refused(|b| b.features[0].name = "colour".into()).contains("\"colour\" is neither"));
        assert!(refused(|b| b.features[1].name = "input.a b".into()).contains("is neither"));
        assert!(
            refused(|b| b.features[1].name = "completion_tokens".into()).contains("appears twice")
        );
        assert!(refused(|b| {
            b.features[0].counts.pop();
        })
        .contains("2 counts for 2 edges"));
        assert!(refused(|b| b.features[0].edges = vec![8.0, 1.0]).contains("strictly increasing"));
        assert!(refused(|b| b.features[0].counts = vec![0, 0, 0]).contains("every count is 0"));
        assert!(refused(|b| b.features[1].counts = vec![u64::MAX, 1])
            .contains("add up to more than 2^64 observations"));
        assert!(
            refused(|b| b.features[1].counts = vec![MAX_BASELINE_OBSERVATIONS, 1])
                .contains("add up to 1000000000001 observations; at most 1000000000000")
        );
        let mut at_cap = file();
        at_cap.features[1].counts = vec![MAX_BASELINE_OBSERVATIONS - 1, 1];
        assert!(Baseline::check(at_cap, "chat").is_ok());
    }

    #[test]
    fn a_missing_or_corrupt_file_is_an_error_naming_it() {
        let t = tempfile::tempdir().expect("tmp");
        let p = t.path().join("base.json");
        let e = Baseline::read(&p, "chat").expect_err("missing");
        assert!(
            e.to_string().contains("cannot read the drift baseline"),
            "{e}"
        );
        std::fs::write(&p, "{\"version\": 1, \"model\": \"chat\"").expect("write");
        let e = Baseline::read(&p, "chat").expect_err("corrupt");
        assert!(e.to_string().contains("is not a baseline file"), "{e}");
        std::fs::write(&p, serde_json::to_vec(&file()).expect("json")).expect("write");
        assert!(Baseline::read(&p, "chat").is_ok());
    }
}
