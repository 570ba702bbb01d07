//! Output drift of the versions of registry-following models: for each
//! model and version (deployment `v<N>`), the first
//! `registry.drift_reference_requests` answers are the reference and the
//! last `registry.drift_window_requests` the current window, per feature:
//! completion tokens, answer characters, latency, finish reason and
//! prompt tokens.
//! [`DriftBook::render`] exports the Population Stability Index and the
//! Jensen-Shannon divergence (`keel_canary::drift`) of every feature as
//! Prometheus gauges once both windows are full:
//!
//! ```text
//! keel_drift_psi{model="chat",version="v2",feature="completion_tokens"} 0.0123
//! keel_drift_js{model="chat",version="v2",feature="completion_tokens"} 0.0031
//! ```
//!
//! A version's reference starts when the gateway first serves it (after a
//! promotion or a restart) and is kept while the process runs. Requests
//! that failed (5xx, no answer) carry no output and are left out.

use std::collections::{HashMap, HashSet};
use std::fmt::Write as _;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Mutex, RwLock};

use keel_canary::analysis::{FinishReason, Sample};
use keel_canary::drift::{jensen_shannon, psi, Histogram, SlidingHistogram};

/// The features, in the order of [`Features`]' arrays.
pub const FEATURES: [&str; 5] = [
    "completion_tokens",
    "answer_chars",
    "latency_ms",
    "finish_reason",
    "prompt_tokens",
];

fn edges(feature: usize) -> Vec<f64> {
    match feature {
        0 => vec![
            1.0, 2.0, 4.0, 8.0, 16.0, 32.0, 64.0, 128.0, 256.0, 512.0, 1024.0, 2048.0, 4096.0,
        ],
        1 => vec![1.0, 3.0, 10.0, 30.0, 100.0, 300.0, 1000.0, 3000.0, 10000.0],
        2 => vec![
            10.0, 25.0, 50.0, 100.0, 250.0, 500.0, 1000.0, 2500.0, 5000.0, 10000.0, 30000.0,
        ],
        // stop, length, other
        3 => vec![0.5, 1.5],
        _ => vec![
            8.0, 16.0, 32.0, 64.0, 128.0, 256.0, 512.0, 1024.0, 2048.0, 4096.0, 8192.0, 16384.0,
            32768.0,
        ],
    }
}

fn values(s: &Sample, prompt_tokens: Option<u64>) -> [Option<f64>; 5] {
    [
        s.completion_tokens.map(f64::from),
        s.answer_chars.map(f64::from),
        s.latency_ms,
        s.finish_reason.map(|f| match f {
            FinishReason::Stop => 0.0,
            FinishReason::Length => 1.0,
            FinishReason::Other => 2.0,
        }),
        prompt_tokens.map(|p| p as f64),
    ]
}

/// One version's windows.
#[derive(Debug)]
struct Windows {
    reference: Vec<Histogram>,
    reference_n: usize,
    current: Vec<SlidingHistogram>,
}

/// The windows of the watched models' versions.
#[derive(Debug)]
pub struct DriftBook {
    on: AtomicBool,
    models: RwLock<HashSet<String>>,
    reference: usize,
    window: usize,
    /// By model, then version.
    versions: Mutex<HashMap<String, HashMap<String, Windows>>>,
}

impl DriftBook {
    /// Keeps the first `reference` answers of each version as its
    /// reference and the last `window` as its current window.
    pub fn new(reference: usize, window: usize) -> Self {
        DriftBook {
            on: AtomicBool::new(false),
            models: RwLock::new(HashSet::new()),
            reference: reference.max(1),
            window: window.max(1),
            versions: Mutex::new(HashMap::new()),
        }
    }

    /// Watches the output drift of `model`'s versions.
    pub fn watch(&self, model: &str) {
        self.models
            .write()
            .unwrap_or_else(|p| p.into_inner())
            .insert(model.to_owned());
        self.on.store(true, Ordering::Release);
    }

    /// Records an answered request of a watched model (`prompt_tokens`
    /// as the backend counted them).
    pub fn record(&self, model: &str, version: &str, sample: &Sample, prompt_tokens: Option<u64>) {
        if !self.on.load(Ordering::Acquire) || sample.error {
            return;
        }
        if !self
            .models
            .read()
            .unwrap_or_else(|p| p.into_inner())
            .contains(model)
        {
            return;
        }
        let mut v = self.versions.lock().unwrap_or_else(|p| p.into_inner());
        let versions = match v.get_mut(model) {
            Some(m) => m,
            None => v.entry(model.to_owned()).or_default(),
        };
        let w = match versions.get_mut(version) {
            Some(w) => w,
            None => {
                let hist = |i| Histogram::new(edges(i));
                let reference: Result<Vec<_>, _> = (0..FEATURES.len()).map(hist).collect();
                let current: Result<Vec<_>, _> = (0..FEATURES.len())
                    .map(|i| hist(i).and_then(|h| SlidingHistogram::new(h, self.window)))
                    .collect();
                let (Ok(reference), Ok(current)) = (reference, current) else {
                    return;
                };
                versions.entry(version.to_owned()).or_insert(Windows {
                    reference,
                    reference_n: 0,
                    current,
                })
            }
        };
        let x = values(sample, prompt_tokens);
        if w.reference_n < self.reference {
            w.reference_n += 1;
            for (h, x) in w.reference.iter_mut().zip(x) {
                if let Some(x) = x {
                    h.add(x);
                }
            }
        } else {
            for (h, x) in w.current.iter_mut().zip(x) {
                if let Some(x) = x {
                    h.add(x);
                }
            }
        }
    }

    /// `(model, version, feature, psi, js)` of every feature of every
    /// version whose reference and current window are full.
    pub fn measures(&self) -> Vec<(String, String, &'static str, f64, f64)> {
        let v = self.versions.lock().unwrap_or_else(|p| p.into_inner());
        let mut out = Vec::new();
        for (model, version, w) in v
            .iter()
            .flat_map(|(m, vs)| vs.iter().map(move |(v, w)| (m, v, w)))
        {
            if w.reference_n < self.reference {
                continue;
            }
            for (i, (r, c)) in w.reference.iter().zip(&w.current).enumerate() {
                if !c.is_full() {
                    continue;
                }
                if let (Ok(p), Ok(j)) = (
                    psi(r.counts(), c.counts()),
                    jensen_shannon(r.counts(), c.counts()),
                ) {
                    out.push((model.clone(), version.clone(), FEATURES[i], p, j));
                }
            }
        }
        out.sort_by(|a, b| (&a.0, &a.1, a.2).cmp(&(&b.0, &b.1, b.2)));
        out
    }

    /// The gauges in the Prometheus text format (nothing while no version
    /// has both windows).
    pub fn render(&self, out: &mut String) {
        let m = self.measures();
        if m.is_empty() {
            return;
        }
        let esc = |s: &str| {
            s.replace('\\', "\\\\")
                .replace('"', "\\\"")
                .replace('\n', "\\n")
        };
        for (name, help, pick) in [
            (
                "keel_drift_psi",
                "Population Stability Index of a version's answers: current window against its first answers.",
                0,
            ),
            (
                "keel_drift_js",
                "Jensen-Shannon divergence (bits) of a version's answers: current window against its first answers.",
                1,
            ),
        ] {
            let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} gauge");
            for (model, version, feature, p, j) in &m {
                let v = if pick == 0 { p } else { j };
                let _ = writeln!(
                    out,
                    "{name}{{model=\"{}\",version=\"{}\",feature=\"{feature}\"}} {v}",
                    esc(model),
                    esc(version)
                );
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn s(tokens: u32, chars: u32, finish: FinishReason) -> Sample {
        Sample {
            error: false,
            latency_ms: Some(100.0),
            completion_tokens: Some(tokens),
            finish_reason: Some(finish),
            answer_chars: Some(chars),
            streamed: false,
            stream_aborted: false,
            output_mean: None,
        }
    }

    #[test]
    fn same_outputs_do_not_drift_and_shifted_ones_do() {
        let b = DriftBook::new(100, 50);
        b.record("chat", "v1", &s(20, 80, FinishReason::Stop), Some(30));
        assert!(b.measures().is_empty(), "not watched");
        b.watch("chat");
        for i in 0..100 {
            b.record(
                "chat",
                "v1",
                &s(10 + i % 20, 60 + i % 40, FinishReason::Stop),
                Some(30),
            );
            b.record(
                "chat",
                "v2",
                &s(10 + i % 20, 60 + i % 40, FinishReason::Stop),
                Some(30),
            );
        }
        assert!(b.measures().is_empty(), "no current window yet");
        // Failed requests are left out.
        for _ in 0..100 {
            b.record("chat", "v1", &Sample::failed(5.0), Some(30));
        }
        assert!(b.measures().is_empty());
        for i in 0..50 {
            b.record(
                "chat",
                "v1",
                &s(10 + (2 * i) % 20, 60 + (2 * i) % 40, FinishReason::Stop),
                Some(30),
            );
            // v2 now answers long and cut at the limit.
            b.record("chat", "v2", &s(1000, 4000, FinishReason::Length), Some(30));
        }
        let m = b.measures();
        assert_eq!(m.len(), 10, "{m:?}");
        for (_, version, feature, p, j) in &m {
            match (version.as_str(), *feature) {
                ("v1", _) | ("v2", "latency_ms" | "prompt_tokens") => {
                    assert!(*p < 0.1 && *j < 0.05, "{version} {feature}: psi {p} js {j}")
                }
                _ => assert!(*p > 1.0 && *j > 0.9, "{version} {feature}: psi {p} js {j}"),
            }
        }
        let mut text = String::new();
        b.render(&mut text);
        assert!(text.contains("# TYPE keel_drift_psi gauge\n"), "{text}");
        assert!(
            text.contains(
                "keel_drift_js{model=\"chat\",version=\"v2\",feature=\"finish_reason\"} 1\n"
            ),
            "{text}"
        );
    }
}
