//! Output and input drift of the versions of registry-following models:
//! for each model and version (deployment `v<N>`) and each feature, a
//! reference window and a current window (the last
//! `registry.drift_window_requests` observations).
//!
//! The reference is the model's recorded baseline (`drift.baseline_file`,
//! [`crate::drift_baseline`]) when it has one, else each version's first
//! `registry.drift_reference_requests` observations of the feature.
//!
//! Features:
//!
//! - of every answer: completion tokens, answer characters, latency,
//!   finish reason and prompt tokens ([`FEATURES`]), over fixed bins;
//! - of OIP v2 inference requests: the values of the numeric input
//!   tensors ([`oip_inputs`]), one feature per 1-D tensor
//!   (`input.TENSOR`) and per column of a 2-D one (`input.TENSOR.COLUMN`),
//!   at most [`MAX_INPUT_ROWS`] rows of a request and
//!   [`MAX_INPUT_FEATURES`] features of a model, each watched once seen in
//!   [`INPUT_ADMIT_REQUESTS`] requests (names not yet watched are counted
//!   in a map of at most [`MAX_INPUT_CANDIDATES`]; the ones it drops are
//!   `keel_drift_input_names_dropped_total`); their bins are the deciles
//!   of the reference values ([`keel_canary::drift::quantile_edges`]).
//!
//! [`DriftBook::render`] exports the Population Stability Index and the
//! Jensen-Shannon divergence (`keel_canary::drift`) of every feature whose
//! windows are full as Prometheus gauges:
//!
//! ```text
//! keel_drift_psi{model="chat",version="v2",feature="completion_tokens"} 0.0123
//! keel_drift_js{model="chat",version="v2",feature="completion_tokens"} 0.0031
//! ```
//!
//! A version's windows start when the gateway first serves it (after a
//! promotion or a restart) and are kept while the process runs. Requests
//! that failed (5xx, no answer) are left out.

use std::collections::{BTreeMap, HashMap};
use std::fmt::Write as _;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, RwLock};

use keel_canary::analysis::{FinishReason, Sample};
use keel_canary::drift::{
    jensen_shannon, psi, quantile_edges, Evaluation, Histogram, SlidingHistogram,
};
use serde_json::{json, Value};

use crate::drift_baseline::{Baseline, BaselineFeature, BaselineFile, BASELINE_VERSION};
use crate::drift_features::{label_char, MAX_TENSOR_NAME};
pub use crate::drift_features::{FEATURES, MAX_INPUT_FEATURES};

/// The output features that clients and load control rather than the
/// model: the prompt's length (the client's choice) and the latency (the
/// load's). Their drift is reported with the OIP input features and never
/// moves an alias: a client sending longer prompts, or a busy hour, would
/// otherwise roll a healthy version back. Canary guidance prefers a
/// concurrent baseline to such before/after comparisons (Kayenta,
/// Spinnaker's best practices); the rollout's canary analysis compares
/// latency against the stable version over the same period instead.
pub const REPORTED_ONLY: [&str; 2] = ["latency_ms", "prompt_tokens"];

/// Distinct requests an input feature must be seen in before it is
/// watched (without a baseline): a few requests with other tensors cannot
/// take the [`MAX_INPUT_FEATURES`] slots.
pub const INPUT_ADMIT_REQUESTS: u32 = 20;
/// Input feature names counted towards admission at most, per version;
/// past it the name seen in the fewest requests (the oldest among equals)
/// makes room and is counted as dropped.
pub const MAX_INPUT_CANDIDATES: usize = 256;
/// Rows of one request's input tensors that are sampled.
pub const MAX_INPUT_ROWS: usize = 16;
/// Bins of an input feature learnt from its reference values.
pub const INPUT_BINS: usize = 10;
/// Reference values an input feature's bins are learnt from, at most
/// (the rest of its reference fills those bins).
pub const LEARN_VALUES: usize = 4096;

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

/// A tensor name as a label: characters other than letters, digits, `_`,
/// `.` and `-` become `_`, at most 48 kept.
fn tensor_label(name: &str) -> String {
    name.chars()
        .take(MAX_TENSOR_NAME)
        .map(|c| if label_char(c) { c } else { '_' })
        .collect()
}

/// Sampled values of one OIP inference request's numeric input tensors,
/// by feature name (`input.TENSOR[.COLUMN]`).
#[derive(Debug, Default, Clone, PartialEq)]
pub struct InputValues(pub Vec<(String, Vec<f64>)>);

/// The numeric inputs of an OIP v2 inference request body: a 1-D tensor
/// is one feature, a 2-D tensor `[rows, columns]` one feature per column;
/// other ranks and non-numeric datatypes (`BYTES`, `BOOL`) are skipped.
/// At most [`MAX_INPUT_ROWS`] rows and [`MAX_INPUT_FEATURES`] features.
pub fn oip_inputs(body: &Value) -> InputValues {
    let mut out: Vec<(String, Vec<f64>)> = Vec::new();
    let Some(inputs) = body.get("inputs").and_then(Value::as_array) else {
        return InputValues(out);
    };
    for t in inputs {
        let room = MAX_INPUT_FEATURES.saturating_sub(out.len());
        if room == 0 {
            break;
        }
        let (Some(name), Some(dt)) = (
            t.get("name").and_then(Value::as_str),
            t.get("datatype").and_then(Value::as_str),
        ) else {
            continue;
        };
        if !(dt.starts_with("FP") || dt.starts_with("INT") || dt.starts_with("UINT")) {
            continue;
        }
        let shape: Option<Vec<u64>> = t
            .get("shape")
            .and_then(Value::as_array)
            .and_then(|s| s.iter().map(Value::as_u64).collect());
        let Some(data) = t.get("data") else { continue };
        let label = tensor_label(name);
        match shape.as_deref() {
            Some([_]) => {
                let mut v = Vec::new();
                leaves(data, MAX_INPUT_ROWS, &mut |_, x| v.push(x));
                if !v.is_empty() {
                    out.push((format!("input.{label}"), v));
                }
            }
            Some(&[rows, cols]) if cols > 0 => {
                let used = (cols as usize).min(room);
                let mut cs: Vec<Vec<f64>> = vec![Vec::new(); used];
                let n = (rows as usize)
                    .min(MAX_INPUT_ROWS)
                    .saturating_mul(cols as usize);
                leaves(data, n, &mut |i, x| {
                    let c = i % cols as usize;
                    if c < used {
                        cs[c].push(x);
                    }
                });
                for (c, v) in cs.into_iter().enumerate() {
                    if !v.is_empty() {
                        out.push((format!("input.{label}.{c}"), v));
                    }
                }
            }
            _ => {}
        }
    }
    InputValues(out)
}

/// Calls `f(position, value)` for the first `limit` leaves of `data`
/// (nested arrays flattened in row-major order); leaves that are not
/// finite numbers take their position but give no value.
fn leaves(data: &Value, limit: usize, f: &mut impl FnMut(usize, f64)) {
    let mut stack: Vec<std::slice::Iter<'_, Value>> = Vec::new();
    let mut i = 0;
    match data {
        Value::Array(a) => stack.push(a.iter()),
        v => {
            if let Some(x) = v.as_f64().filter(|x| x.is_finite()) {
                f(0, x);
            }
            return;
        }
    }
    while i < limit {
        let Some(top) = stack.last_mut() else { break };
        match top.next() {
            None => {
                stack.pop();
            }
            Some(Value::Array(a)) => stack.push(a.iter()),
            Some(v) => {
                if let Some(x) = v.as_f64().filter(|x| x.is_finite()) {
                    f(i, x);
                }
                i += 1;
            }
        }
    }
}

/// One feature's windows.
#[derive(Debug)]
struct Feature {
    name: String,
    /// `None` while the bins are learnt from the first values.
    reference: Option<Histogram>,
    /// Values kept to learn the bins from.
    pending: Vec<f64>,
    reference_n: usize,
    reference_full: bool,
    current: Option<SlidingHistogram>,
    /// Observations added to the current window since the last
    /// evaluation.
    fresh: u64,
}

impl Feature {
    fn fixed(name: &str, edges: Vec<f64>, window: usize) -> Option<Self> {
        let h = Histogram::new(edges).ok()?;
        Some(Feature {
            name: name.to_owned(),
            current: Some(SlidingHistogram::new(h.clone(), window).ok()?),
            reference: Some(h),
            pending: Vec::new(),
            reference_n: 0,
            reference_full: false,
            fresh: 0,
        })
    }

    fn learnt(name: &str) -> Self {
        Feature {
            name: name.to_owned(),
            reference: None,
            pending: Vec::new(),
            reference_n: 0,
            reference_full: false,
            current: None,
            fresh: 0,
        }
    }

    fn recorded(name: &str, h: &Histogram, window: usize) -> Option<Self> {
        Some(Feature {
            name: name.to_owned(),
            current: Some(SlidingHistogram::new(h.clone(), window).ok()?),
            reference_n: h.total() as usize,
            reference: Some(h.clone()),
            pending: Vec::new(),
            reference_full: true,
            fresh: 0,
        })
    }

    fn add(&mut self, x: f64, cap: usize, window: usize) {
        if !x.is_finite() {
            return;
        }
        if self.reference_full {
            if let Some(c) = &mut self.current {
                c.add(x);
                self.fresh += 1;
            }
            return;
        }
        match &mut self.reference {
            Some(h) => {
                h.add(x);
                self.reference_n += 1;
                self.reference_full = self.reference_n >= cap;
            }
            None => {
                self.pending.push(x);
                if self.pending.len() >= cap.min(LEARN_VALUES) {
                    self.learn(cap, window);
                }
            }
        }
    }

    /// Bins from the values kept so far, which fill them.
    fn learn(&mut self, cap: usize, window: usize) {
        let pending = std::mem::take(&mut self.pending);
        let Ok(mut h) = quantile_edges(&pending, INPUT_BINS).and_then(Histogram::new) else {
            return;
        };
        let Ok(current) = SlidingHistogram::new(h.clone(), window) else {
            return;
        };
        pending.iter().for_each(|&x| h.add(x));
        self.reference_n = pending.len();
        self.reference_full = self.reference_n >= cap;
        self.reference = Some(h);
        self.current = Some(current);
    }

    /// PSI and JS once both windows are full.
    fn measure(&self) -> Option<(f64, f64)> {
        if !self.reference_full {
            return None;
        }
        let (r, c) = (self.reference.as_ref()?, self.current.as_ref()?);
        if !c.is_full() {
            return None;
        }
        Some((
            psi(r.counts(), c.counts()).ok()?,
            jensen_shannon(r.counts(), c.counts()).ok()?,
        ))
    }
}

/// One version's features.
#[derive(Debug)]
struct Windows {
    /// [`FEATURES`] in order; `None` for one a baseline does not have.
    outputs: Vec<Option<Feature>>,
    inputs: Vec<Feature>,
    /// New input features are learnt (no baseline).
    learn_inputs: bool,
    /// Input feature names not yet watched: (requests seen in, order of
    /// arrival).
    candidates: HashMap<String, (u32, u64)>,
    arrivals: u64,
    /// Input feature names dropped: evicted from the candidates, or seen
    /// once every slot was taken.
    dropped_inputs: u64,
}

impl Windows {
    fn new(baseline: Option<&Baseline>, window: usize) -> Self {
        match baseline {
            None => Windows {
                outputs: FEATURES
                    .iter()
                    .enumerate()
                    .map(|(i, n)| Feature::fixed(n, edges(i), window))
                    .collect(),
                inputs: Vec::new(),
                learn_inputs: true,
                candidates: HashMap::new(),
                arrivals: 0,
                dropped_inputs: 0,
            },
            Some(b) => Windows {
                outputs: FEATURES
                    .iter()
                    .map(|n| b.get(n).and_then(|h| Feature::recorded(n, h, window)))
                    .collect(),
                inputs: b
                    .histograms
                    .iter()
                    .filter(|(n, _)| n.starts_with("input."))
                    .filter_map(|(n, h)| Feature::recorded(n, h, window))
                    .collect(),
                learn_inputs: false,
                candidates: HashMap::new(),
                arrivals: 0,
                dropped_inputs: 0,
            },
        }
    }

    /// Whether input feature `name`, seen in one more request, is
    /// watched from now on.
    fn admit(&mut self, name: &str) -> bool {
        if !self.learn_inputs {
            return false;
        }
        if self.inputs.len() >= MAX_INPUT_FEATURES {
            self.dropped_inputs += 1;
            return false;
        }
        self.arrivals += 1;
        let seen = match self.candidates.get_mut(name) {
            Some((n, _)) => {
                *n += 1;
                *n
            }
            None => {
                if self.candidates.len() >= MAX_INPUT_CANDIDATES {
                    let evicted = self
                        .candidates
                        .iter()
                        .min_by_key(|(_, &(n, at))| (n, at))
                        .map(|(k, _)| k.clone());
                    if let Some(k) = evicted {
                        self.candidates.remove(&k);
                        self.dropped_inputs += 1;
                    }
                }
                self.candidates.insert(name.to_owned(), (1, self.arrivals));
                1
            }
        };
        if seen < INPUT_ADMIT_REQUESTS {
            return false;
        }
        self.candidates.remove(name);
        self.inputs.push(Feature::learnt(name));
        true
    }

    fn all(&self) -> impl Iterator<Item = &Feature> {
        self.outputs.iter().flatten().chain(&self.inputs)
    }

    fn all_mut(&mut self) -> impl Iterator<Item = &mut Feature> {
        self.outputs
            .iter_mut()
            .flatten()
            .chain(self.inputs.iter_mut())
    }
}

/// Which window a recorded baseline is taken from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum WindowKind {
    Reference,
    Current,
}

impl WindowKind {
    pub fn name(self) -> &'static str {
        match self {
            WindowKind::Reference => "reference",
            WindowKind::Current => "current",
        }
    }
}

/// Why a baseline cannot be taken.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum SnapshotError {
    #[error("model {model:?} is not watched for drift (only models that follow the registry are)")]
    NotWatched { model: String },
    #[error("model {model:?} has served no answer from {version:?} since the gateway started")]
    NoVersion { model: String, version: String },
    #[error("no feature of {model:?} {version:?} has a full {window} window yet ({have} of {need} observations): record it once it is full")]
    NotFull {
        model: String,
        version: String,
        window: &'static str,
        have: usize,
        need: usize,
    },
}

/// What the drift watch of a model's version says, for metrics and the
/// admin API.
#[derive(Debug, Clone, Default)]
struct Alarm {
    /// Consecutive evaluations above the threshold.
    streak: u32,
    /// The same for the input features.
    input_streak: u32,
    /// Actions taken, by kind (`notify`, `fallback`).
    actions: BTreeMap<&'static str, u64>,
}

/// A feature's drift: `(model, version, feature, psi, js)`.
pub type Measure = (String, String, String, f64, f64);

/// The windows of the watched models' versions.
#[derive(Debug)]
pub struct DriftBook {
    on: AtomicBool,
    /// The watched models, each with its baseline if it has one.
    models: RwLock<HashMap<String, Option<Arc<Baseline>>>>,
    reference: usize,
    window: usize,
    /// By model, then version.
    versions: Mutex<HashMap<String, HashMap<String, Windows>>>,
    alarms: Mutex<BTreeMap<(String, String), Alarm>>,
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

impl DriftBook {
    /// Keeps the first `reference` observations of each feature as its
    /// reference (without a baseline) and the last `window` as its current
    /// window.
    pub fn new(reference: usize, window: usize) -> Self {
        DriftBook {
            on: AtomicBool::new(false),
            models: RwLock::new(HashMap::new()),
            reference: reference.max(1),
            window: window.max(1),
            versions: Mutex::new(HashMap::new()),
            alarms: Mutex::new(BTreeMap::new()),
        }
    }

    /// Watches the drift of `model`'s versions, against `baseline` when
    /// given.
    pub fn watch(&self, model: &str, baseline: Option<Arc<Baseline>>) {
        self.models
            .write()
            .unwrap_or_else(|p| p.into_inner())
            .insert(model.to_owned(), baseline);
        self.on.store(true, Ordering::Release);
    }

    /// Whether `model` is watched.
    pub fn watches(&self, model: &str) -> bool {
        self.on.load(Ordering::Acquire)
            && self
                .models
                .read()
                .unwrap_or_else(|p| p.into_inner())
                .contains_key(model)
    }

    fn with(&self, model: &str, version: &str, f: impl FnOnce(&mut Windows)) {
        if !self.on.load(Ordering::Acquire) {
            return;
        }
        let baseline = {
            let m = self.models.read().unwrap_or_else(|p| p.into_inner());
            match m.get(model) {
                Some(b) => b.clone(),
                None => return,
            }
        };
        let mut v = lock(&self.versions);
        let versions = match v.get_mut(model) {
            Some(m) => m,
            None => v.entry(model.to_owned()).or_default(),
        };
        let w = match versions.get_mut(version) {
            Some(w) => w,
            None => versions
                .entry(version.to_owned())
                .or_insert_with(|| Windows::new(baseline.as_deref(), self.window)),
        };
        f(w)
    }

    /// Records an answered request of a watched model (`prompt_tokens`
    /// as the backend counted them).
    pub fn record(&self, model: &str, version: &str, sample: &Sample, prompt_tokens: Option<u64>) {
        if sample.error {
            return;
        }
        let (cap, window) = (self.reference, self.window);
        self.with(model, version, |w| {
            for (f, x) in w.outputs.iter_mut().zip(values(sample, prompt_tokens)) {
                if let (Some(f), Some(x)) = (f, x) {
                    f.add(x, cap, window);
                }
            }
        });
    }

    /// Records the sampled inputs of an answered OIP request.
    pub fn record_inputs(&self, model: &str, version: &str, inputs: &InputValues) {
        if inputs.0.is_empty() {
            return;
        }
        let (cap, window) = (self.reference, self.window);
        self.with(model, version, |w| {
            let mut counted = std::collections::HashSet::new();
            for (name, xs) in &inputs.0 {
                let i = match w.inputs.iter().position(|f| f.name == *name) {
                    Some(i) => i,
                    // A name counts once a request.
                    None if !counted.insert(name.as_str()) => continue,
                    None if w.admit(name) => w.inputs.len() - 1,
                    None => continue,
                };
                for &x in xs {
                    w.inputs[i].add(x, cap, window);
                }
            }
        });
    }

    /// Every feature whose reference and current window are full, sorted.
    pub fn measures(&self) -> Vec<Measure> {
        let v = lock(&self.versions);
        let mut out = Vec::new();
        for (model, vs) in v.iter() {
            for (version, w) in vs {
                for f in w.all() {
                    if let Some((p, j)) = f.measure() {
                        out.push((model.clone(), version.clone(), f.name.clone(), p, j));
                    }
                }
            }
        }
        out.sort_by(|a, b| (&a.0, &a.1, &a.2).cmp(&(&b.0, &b.1, &b.2)));
        out
    }

    /// One evaluation of the output features of `model`'s `version` that
    /// the model alone decides (the drift action's): the largest PSI of
    /// those with both windows full, and which feature it is.
    /// Inconclusive when no such feature is full, or when nothing was
    /// added to their current windows since the previous evaluation (the
    /// same window is not counted twice). The features that clients or
    /// load move ([`REPORTED_ONLY`] and the OIP inputs) are left out:
    /// [`DriftBook::evaluate_inputs`].
    pub fn evaluate(&self, model: &str, version: &str) -> (Evaluation, Option<(String, f64)>) {
        self.evaluate_part(model, version, false)
    }

    /// [`DriftBook::evaluate`] of the features that clients or load move:
    /// the OIP input features and [`REPORTED_ONLY`] (reported, never acted
    /// on).
    pub fn evaluate_inputs(
        &self,
        model: &str,
        version: &str,
    ) -> (Evaluation, Option<(String, f64)>) {
        self.evaluate_part(model, version, true)
    }

    fn evaluate_part(
        &self,
        model: &str,
        version: &str,
        inputs: bool,
    ) -> (Evaluation, Option<(String, f64)>) {
        let mut v = lock(&self.versions);
        let Some(w) = v.get_mut(model).and_then(|m| m.get_mut(version)) else {
            return (Evaluation::Inconclusive, None);
        };
        let reported = |f: &Feature| REPORTED_ONLY.contains(&f.name.as_str());
        let part: Vec<&mut Feature> = if inputs {
            w.outputs
                .iter_mut()
                .flatten()
                .filter(|f| reported(f))
                .chain(w.inputs.iter_mut())
                .collect()
        } else {
            w.outputs
                .iter_mut()
                .flatten()
                .filter(|f| !reported(f))
                .collect()
        };
        let fresh: u64 = part.iter().map(|f| f.fresh).sum();
        let worst = part
            .iter()
            .filter_map(|f| f.measure().map(|(p, _)| (f.name.clone(), p)))
            .max_by(|a, b| a.1.total_cmp(&b.1));
        part.into_iter().for_each(|f| f.fresh = 0);
        match worst {
            Some((name, p)) if fresh > 0 => (Evaluation::Measured(p), Some((name, p))),
            w => (Evaluation::Inconclusive, w),
        }
    }

    /// Forgets the current windows of `model`'s `version` (its reference
    /// stays): after a drift action, the version must drift again over a
    /// whole new window before it counts.
    pub fn clear_current(&self, model: &str, version: &str) {
        let mut v = lock(&self.versions);
        if let Some(w) = v.get_mut(model).and_then(|m| m.get_mut(version)) {
            for f in w.all_mut() {
                if let (Some(r), Some(_)) = (&f.reference, &f.current) {
                    f.current = SlidingHistogram::new(r.clone(), self.window).ok();
                }
                f.fresh = 0;
            }
        }
    }

    /// Sets the run of evaluations above the threshold shown for
    /// `model`'s `version`.
    pub fn set_streak(&self, model: &str, version: &str, streak: u32) {
        lock(&self.alarms)
            .entry((model.to_owned(), version.to_owned()))
            .or_default()
            .streak = streak;
    }

    /// Sets the run of input evaluations above the threshold shown for
    /// `model`'s `version`.
    pub fn set_input_streak(&self, model: &str, version: &str, streak: u32) {
        lock(&self.alarms)
            .entry((model.to_owned(), version.to_owned()))
            .or_default()
            .input_streak = streak;
    }

    /// Counts an action taken on `model`'s `version`.
    pub fn count_action(&self, model: &str, version: &str, action: &'static str) {
        *lock(&self.alarms)
            .entry((model.to_owned(), version.to_owned()))
            .or_default()
            .actions
            .entry(action)
            .or_default() += 1;
    }

    /// The `window` of `model`'s `version` as a baseline file: every
    /// feature whose window is full.
    pub fn snapshot(
        &self,
        model: &str,
        version: &str,
        window: WindowKind,
        recorded_at: String,
    ) -> Result<BaselineFile, SnapshotError> {
        if !self.watches(model) {
            return Err(SnapshotError::NotWatched {
                model: model.to_owned(),
            });
        }
        let v = lock(&self.versions);
        let Some(w) = v.get(model).and_then(|m| m.get(version)) else {
            return Err(SnapshotError::NoVersion {
                model: model.to_owned(),
                version: version.to_owned(),
            });
        };
        let mut features = Vec::new();
        let mut have = 0;
        for f in w.all() {
            let h = match window {
                WindowKind::Reference => {
                    have = have.max(f.reference_n.max(f.pending.len()));
                    f.reference.as_ref().filter(|_| f.reference_full).cloned()
                }
                WindowKind::Current => match &f.current {
                    Some(c) => {
                        have = have.max(c.len());
                        c.is_full()
                            .then(|| {
                                Histogram::with_counts(c.edges().to_vec(), c.counts().to_vec()).ok()
                            })
                            .flatten()
                    }
                    None => None,
                },
            };
            if let Some(h) = h {
                features.push(BaselineFeature {
                    name: f.name.clone(),
                    edges: h.edges().to_vec(),
                    counts: h.counts().to_vec(),
                });
            }
        }
        if features.is_empty() {
            return Err(SnapshotError::NotFull {
                model: model.to_owned(),
                version: version.to_owned(),
                window: window.name(),
                have,
                need: match window {
                    WindowKind::Reference => self.reference,
                    WindowKind::Current => self.window,
                },
            });
        }
        Ok(BaselineFile {
            version: BASELINE_VERSION,
            model: model.to_owned(),
            recorded_from: version.to_owned(),
            window: window.name().to_owned(),
            recorded_at,
            features,
        })
    }

    /// `model`'s drift as the admin API shows it: per version, each
    /// feature's windows and measures, and the alarm.
    pub fn status(&self, model: &str) -> Option<Value> {
        let baseline = {
            let m = self.models.read().unwrap_or_else(|p| p.into_inner());
            m.get(model)?.as_ref().map(|b| {
                json!({"recorded_from": b.file.recorded_from, "window": b.file.window, "recorded_at": b.file.recorded_at})
            })
        };
        let v = lock(&self.versions);
        let alarms = lock(&self.alarms);
        let mut versions = serde_json::Map::new();
        if let Some(vs) = v.get(model) {
            let mut names: Vec<&String> = vs.keys().collect();
            names.sort();
            for version in names {
                let w = &vs[version];
                let features: Vec<Value> = w
                    .all()
                    .map(|f| {
                        let m = f.measure();
                        json!({
                            "name": f.name,
                            "reference": f.reference_n.max(f.pending.len()),
                            "reference_full": f.reference_full,
                            "current": f.current.as_ref().map_or(0, |c| c.len()),
                            "psi": m.map(|m| m.0),
                            "js": m.map(|m| m.1),
                        })
                    })
                    .collect();
                let a = alarms
                    .get(&(model.to_owned(), version.clone()))
                    .cloned()
                    .unwrap_or_default();
                versions.insert(
                    version.clone(),
                    json!({"features": features, "streak": a.streak, "input_streak": a.input_streak,
                        "actions": a.actions, "input_candidates": w.candidates.len(),
                        "input_names_dropped": w.dropped_inputs}),
                );
            }
        }
        Some(json!({
            "version": 1,
            "model": model,
            "baseline": baseline,
            "reference_size": self.reference,
            "window_size": self.window,
            "versions": versions,
        }))
    }

    /// The gauges in the Prometheus text format (nothing while no version
    /// has both windows).
    pub fn render(&self, out: &mut String) {
        let esc = |s: &str| {
            s.replace('\\', "\\\\")
                .replace('"', "\\\"")
                .replace('\n', "\\n")
        };
        let m = self.measures();
        if !m.is_empty() {
            for (name, help, pick) in [
                (
                    "keel_drift_psi",
                    "Population Stability Index of a version's feature: current window against its reference.",
                    0,
                ),
                (
                    "keel_drift_js",
                    "Jensen-Shannon divergence (bits) of a version's feature: current window against its reference.",
                    1,
                ),
            ] {
                let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} gauge");
                for (model, version, feature, p, j) in &m {
                    let v = if pick == 0 { p } else { j };
                    let _ = writeln!(
                        out,
                        "{name}{{model=\"{}\",version=\"{}\",feature=\"{}\"}} {v}",
                        esc(model),
                        esc(version),
                        esc(feature)
                    );
                }
            }
        }
        {
            let v = lock(&self.versions);
            let mut dropped: Vec<(&String, &String, u64)> = v
                .iter()
                .flat_map(|(m, vs)| vs.iter().map(move |(ver, w)| (m, ver, w.dropped_inputs)))
                .filter(|d| d.2 > 0)
                .collect();
            if !dropped.is_empty() {
                dropped.sort();
                out.push_str("# HELP keel_drift_input_names_dropped_total Input feature names of a version not watched: evicted before they were seen in enough requests, or past the limit of input features.\n# TYPE keel_drift_input_names_dropped_total counter\n");
                for (model, version, n) in dropped {
                    let _ = writeln!(
                        out,
                        "keel_drift_input_names_dropped_total{{model=\"{}\",version=\"{}\"}} {n}",
                        esc(model),
                        esc(version)
                    );
                }
            }
        }
        let alarms = lock(&self.alarms);
        if alarms.is_empty() {
            return;
        }
        out.push_str("# HELP keel_drift_breaches Consecutive drift evaluations of a version above its PSI threshold.\n# TYPE keel_drift_breaches gauge\n");
        for ((model, version), a) in alarms.iter() {
            let _ = writeln!(
                out,
                "keel_drift_breaches{{model=\"{}\",version=\"{}\"}} {}",
                esc(model),
                esc(version),
                a.streak
            );
        }
        out.push_str("# HELP keel_drift_input_breaches Consecutive drift evaluations of a version's input features above its PSI threshold (reported, never acted on).\n# TYPE keel_drift_input_breaches gauge\n");
        for ((model, version), a) in alarms.iter() {
            let _ = writeln!(
                out,
                "keel_drift_input_breaches{{model=\"{}\",version=\"{}\"}} {}",
                esc(model),
                esc(version),
                a.input_streak
            );
        }
        out.push_str("# HELP keel_drift_actions_total Drift actions taken on a version (notify, fallback).\n# TYPE keel_drift_actions_total counter\n");
        for ((model, version), a) in alarms.iter() {
            for (action, n) in &a.actions {
                let _ = writeln!(
                    out,
                    "keel_drift_actions_total{{model=\"{}\",version=\"{}\",action=\"{action}\"}} {n}",
                    esc(model),
                    esc(version),
                );
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::drift_features::valid_input_label;

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
    fn prompt_length_and_latency_shifts_are_reported_and_never_acted_on() {
        let b = DriftBook::new(100, 50);
        b.watch("chat", None);
        let at = |latency: f64| Sample {
            latency_ms: Some(latency),
            ..s(20, 80, FinishReason::Stop)
        };
        for i in 0..100 {
            b.record("chat", "v1", &at(10.0 + (i % 20) as f64), Some(30 + i % 10));
        }
        // Clients send prompts thirty times longer, under a load that makes
        // every answer ten times slower; the answers themselves are the same.
        for i in 0..50 {
            b.record(
                "chat",
                "v1",
                &at(100.0 + (i % 20) as f64 * 10.0),
                Some(1000 + i % 10),
            );
        }
        let shifted: Vec<_> = b
            .measures()
            .into_iter()
            .filter(|m| m.3 > 1.0)
            .map(|m| m.2)
            .collect();
        assert_eq!(shifted, vec!["latency_ms", "prompt_tokens"]);
        // The acted-on evaluation sees no drift...
        let (e, worst) = b.evaluate("chat", "v1");
        assert!(matches!(e, Evaluation::Measured(p) if p < 0.1), "{e:?}");
        let worst = worst.expect("measured").0;
        assert!(!REPORTED_ONLY.contains(&worst.as_str()), "{worst}");
        // ...the reported one does.
        let (e, worst) = b.evaluate_inputs("chat", "v1");
        assert!(matches!(e, Evaluation::Measured(p) if p > 1.0), "{e:?}");
        assert!(REPORTED_ONLY.contains(&worst.expect("measured").0.as_str()));
    }

    #[test]
    fn same_outputs_do_not_drift_and_shifted_ones_do() {
        let b = DriftBook::new(100, 50);
        b.record("chat", "v1", &s(20, 80, FinishReason::Stop), Some(30));
        assert!(b.measures().is_empty(), "not watched");
        b.watch("chat", None);
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
        assert_eq!(b.evaluate("chat", "v2").0, Evaluation::Inconclusive);
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
            match (version.as_str(), feature.as_str()) {
                ("v1", _) | ("v2", "latency_ms" | "prompt_tokens") => {
                    assert!(*p < 0.1 && *j < 0.05, "{version} {feature}: psi {p} js {j}")
                }
                _ => assert!(*p > 1.0 && *j > 0.9, "{version} {feature}: psi {p} js {j}"),
            }
        }
        // The worst feature, once; the same window again is inconclusive.
        let (e, worst) = b.evaluate("chat", "v2");
        assert!(matches!(e, Evaluation::Measured(p) if p > 1.0), "{e:?}");
        assert!(worst.is_some());
        assert_eq!(b.evaluate("chat", "v2").0, Evaluation::Inconclusive);
        let mut text = String::new();
        b.render(&mut text);
        assert!(text.contains("# TYPE keel_drift_psi gauge\n"), "{text}");
        assert!(
            text.contains(
                "keel_drift_js{model=\"chat\",version=\"v2\",feature=\"finish_reason\"} 1\n"
            ),
            "{text}"
        );
        // After an action the version must drift over a new window.
        b.clear_current("chat", "v2");
        assert!(b.measures().iter().all(|m| m.1 != "v2"));
    }

    #[test]
    fn oip_inputs_are_sampled_per_column_and_bounded() {
        let body = json!({"inputs": [
            {"name": "x", "shape": [3, 2], "datatype": "FP32", "data": [1, 10, 2, 20, 3, 30]},
            {"name": "age group", "shape": [2], "datatype": "INT64", "data": [[7], [8]]},
            {"name": "text", "shape": [1], "datatype": "BYTES", "data": ["hi"]},
            {"name": "cube", "shape": [1, 1, 1], "datatype": "FP32", "data": [1]},
            {"name": "nested", "shape": [2, 2], "datatype": "FP64", "data": [[1.5, null], [2.5, 4]]}
        ]});
        assert_eq!(
            oip_inputs(&body).0,
            vec![
                ("input.x.0".into(), vec![1.0, 2.0, 3.0]),
                ("input.x.1".into(), vec![10.0, 20.0, 30.0]),
                ("input.age_group".into(), vec![7.0, 8.0]),
                ("input.nested.0".into(), vec![1.5, 2.5]),
                ("input.nested.1".into(), vec![4.0]),
            ]
        );
        // A wide, tall tensor: MAX_INPUT_FEATURES columns, MAX_INPUT_ROWS rows.
        let data: Vec<f64> = (0..1000 * 100).map(f64::from).collect();
        let wide = json!({"inputs": [{"name": "w", "shape": [1000, 100], "datatype": "FP32", "data": data}]});
        let v = oip_inputs(&wide).0;
        assert_eq!(v.len(), MAX_INPUT_FEATURES);
        assert!(v.iter().all(|(_, xs)| xs.len() == MAX_INPUT_ROWS));
        assert_eq!(v[3].1[..2], [3.0, 103.0]);
        assert!(oip_inputs(&json!({"inputs": "x"})).0.is_empty());
        // A shape that does not fit the data (or memory) is read as far as
        // the data goes.
        let huge = json!({"inputs": [{"name": "h", "shape": [u64::MAX, u64::MAX / 2], "datatype": "FP32", "data": [1, 2, 3]}]});
        assert_eq!(
            oip_inputs(&huge).0,
            vec![
                ("input.h.0".into(), vec![1.0]),
                ("input.h.1".into(), vec![2.0]),
                ("input.h.2".into(), vec![3.0]),
            ]
        );
    }

    proptest::proptest! {
        #[test]
        fn oip_inputs_stay_bounded(
            shape in proptest::collection::vec(proptest::prelude::any::<u64>(), 0..4),
            data in proptest::collection::vec(-1e9f64..1e9, 0..300),
            nested in proptest::prelude::any::<bool>(),
            tensors in 1usize..40,
            dt in proptest::sample::select(vec!["FP32", "INT8", "UINT64", "BYTES", "BOOL", ""]),
        ) {
            let data = if nested {
                json!(data.chunks(3).map(|c| c.to_vec()).collect::<Vec<_>>())
            } else {
                json!(data)
            };
            let inputs: Vec<Value> = (0..tensors)
                .map(|i| json!({"name": format!("t{i}"), "shape": shape, "datatype": dt, "data": data}))
                .collect();
            let v = oip_inputs(&json!({"inputs": inputs}));
            proptest::prop_assert!(v.0.len() <= MAX_INPUT_FEATURES);
            for (name, xs) in &v.0 {
                proptest::prop_assert!(xs.len() <= MAX_INPUT_ROWS, "{name}: {}", xs.len());
                proptest::prop_assert!(valid_input_label(&name["input.".len()..]), "{name}");
            }
        }
    }

    #[test]
    fn input_features_learn_their_bins_and_detect_a_shifted_column() {
        let b = DriftBook::new(200, 100);
        b.watch("tab", None);
        let req = |shift: f64, i: usize| {
            let rows: Vec<f64> = (0..4)
                .flat_map(|r| [((i * 4 + r) % 50) as f64, ((i * 4 + r) % 50) as f64 + shift])
                .collect();
            oip_inputs(
                &json!({"inputs": [{"name": "x", "shape": [4, 2], "datatype": "FP32", "data": rows}]}),
            )
        };
        // Seen in enough requests to be watched; the last of them counts.
        for i in 0..INPUT_ADMIT_REQUESTS as usize - 1 {
            b.record_inputs("tab", "v1", &req(0.0, i));
        }
        for i in 0..50 {
            b.record_inputs("tab", "v1", &req(0.0, i));
        }
        assert!(b.measures().is_empty(), "no current window yet");
        for i in 0..25 {
            b.record_inputs("tab", "v1", &req(100.0, i));
        }
        let m = b.measures();
        assert_eq!(m.len(), 2, "{m:?}");
        assert_eq!(
            (m[0].2.as_str(), m[1].2.as_str()),
            ("input.x.0", "input.x.1")
        );
        assert!(m[0].3 < 0.1, "unshifted column: {m:?}");
        assert!(m[1].3 > 1.0, "shifted column: {m:?}");
        // A recorded reference is a baseline for a restarted gateway.
        let file = b
            .snapshot("tab", "v1", WindowKind::Reference, "now".into())
            .expect("full");
        assert_eq!(file.features.len(), 2);
        let base = Baseline::check(file, "tab").expect("valid");
        let b2 = DriftBook::new(200, 100);
        b2.watch("tab", Some(Arc::new(base)));
        for i in 0..25 {
            b2.record_inputs("tab", "v7", &req(100.0, i));
        }
        let m2 = b2.measures();
        assert_eq!(m2.len(), 2, "measured against the baseline at once: {m2:?}");
        assert!(m2[1].3 > 1.0, "{m2:?}");
        assert_eq!(
            b.snapshot("tab", "v9", WindowKind::Reference, String::new()),
            Err(SnapshotError::NoVersion {
                model: "tab".into(),
                version: "v9".into()
            })
        );
        let e = DriftBook::new(200, 100);
        e.watch("tab", None);
        for i in 0..INPUT_ADMIT_REQUESTS as usize {
            e.record_inputs("tab", "v1", &req(0.0, i));
        }
        assert!(matches!(
            e.snapshot("tab", "v1", WindowKind::Reference, String::new()),
            Err(SnapshotError::NotFull {
                have: 4,
                need: 200,
                ..
            })
        ));
    }

    fn tensor(name: &str, rows: usize, cols: usize, shift: f64, i: usize) -> InputValues {
        let data: Vec<f64> = (0..rows * cols)
            .map(|k| ((i * rows * cols + k) % 50) as f64 + shift)
            .collect();
        oip_inputs(&json!({"inputs": [
            {"name": name, "shape": [rows, cols], "datatype": "FP32", "data": data}
        ]}))
    }

    fn input_names(b: &DriftBook, version: &str) -> Vec<String> {
        let st = b.status("tab").expect("watched");
        st["versions"][version]["features"]
            .as_array()
            .into_iter()
            .flatten()
            .filter_map(|f| f["name"].as_str())
            .filter(|n| n.starts_with("input."))
            .map(str::to_owned)
            .collect()
    }

    #[test]
    fn a_few_junk_requests_cannot_take_the_input_slots() {
        let b = DriftBook::new(50, 50);
        b.watch("tab", None);
        // One request of a [1, 40] tensor: 32 names, none watched.
        b.record_inputs("tab", "v1", &tensor("junk", 1, 40, 0.0, 0));
        assert_eq!(input_names(&b, "v1"), Vec::<String>::new());
        for i in 0..INPUT_ADMIT_REQUESTS as usize - 1 {
            b.record_inputs("tab", "v1", &tensor("features", 4, 2, 0.0, i));
        }
        assert_eq!(input_names(&b, "v1"), Vec::<String>::new());
        b.record_inputs("tab", "v1", &tensor("features", 4, 2, 0.0, 99));
        assert_eq!(
            input_names(&b, "v1"),
            vec!["input.features.0".to_owned(), "input.features.1".to_owned()]
        );
        // A name twice in one request counts once.
        let twice = oip_inputs(&json!({"inputs": [
            {"name": "y", "shape": [1], "datatype": "FP32", "data": [1.0]},
            {"name": "y", "shape": [1], "datatype": "FP32", "data": [2.0]}
        ]}));
        for _ in 0..INPUT_ADMIT_REQUESTS / 2 {
            b.record_inputs("tab", "v1", &twice);
        }
        assert!(!input_names(&b, "v1").contains(&"input.y".to_owned()));

        // A flood of new names: the candidates stay bounded, the dropped
        // ones are counted, and a name sent on every request still gets in.
        let b = DriftBook::new(50, 50);
        b.watch("tab", None);
        for i in 0..10 {
            b.record_inputs("tab", "v2", &tensor(&format!("junk{i}"), 1, 32, 0.0, 0));
        }
        let st = b.status("tab").expect("watched");
        assert_eq!(
            st["versions"]["v2"]["input_candidates"],
            MAX_INPUT_CANDIDATES
        );
        assert_eq!(
            st["versions"]["v2"]["input_names_dropped"],
            320 - MAX_INPUT_CANDIDATES as u64
        );
        let mut text = String::new();
        b.render(&mut text);
        assert!(
            text.contains("keel_drift_input_names_dropped_total{model=\"tab\",version=\"v2\"} 64"),
            "{text}"
        );
        for i in 0..INPUT_ADMIT_REQUESTS as usize {
            b.record_inputs("tab", "v2", &tensor("features", 4, 2, 0.0, i));
            // More junk between two requests than a request holds.
            b.record_inputs("tab", "v2", &tensor(&format!("more{i}"), 1, 32, 0.0, 0));
        }
        assert_eq!(
            input_names(&b, "v2"),
            vec!["input.features.0".to_owned(), "input.features.1".to_owned()]
        );
    }

    #[test]
    fn input_drift_is_reported_apart_and_never_drives_the_action() {
        let b = DriftBook::new(50, 50);
        b.watch("tab", None);
        let steady = s(20, 80, FinishReason::Stop);
        for i in 0..INPUT_ADMIT_REQUESTS as usize + 200 {
            // Inputs shift once their reference is full; outputs stay.
            let shift = if i < INPUT_ADMIT_REQUESTS as usize + 20 {
                0.0
            } else {
                1000.0
            };
            b.record("tab", "v1", &steady, Some(30));
            b.record_inputs("tab", "v1", &tensor("features", 4, 2, shift, i));
        }
        let m = b.measures();
        assert!(
            m.iter().any(|x| x.2 == "input.features.0" && x.3 > 1.0),
            "{m:?}"
        );
        let (e, worst) = b.evaluate("tab", "v1");
        let (name, psi) = worst.expect("outputs measured");
        assert!(FEATURES.contains(&name.as_str()), "{name}");
        assert!(psi < 0.1, "{name} {psi}");
        assert_eq!(e, Evaluation::Measured(psi));
        let (e, worst) = b.evaluate_inputs("tab", "v1");
        let (name, psi) = worst.expect("inputs measured");
        assert!(name.starts_with("input.features."), "{name}");
        assert!(psi > 1.0, "{psi}");
        assert_eq!(e, Evaluation::Measured(psi));
        // Each part's fresh observations are its own: an answer's latency
        // and prompt length belong to the reported part, inputs only to it.
        assert_eq!(b.evaluate("tab", "v1").0, Evaluation::Inconclusive);
        b.record_inputs("tab", "v1", &tensor("features", 4, 2, 1000.0, 0));
        assert_eq!(b.evaluate("tab", "v1").0, Evaluation::Inconclusive);
        assert!(matches!(
            b.evaluate_inputs("tab", "v1").0,
            Evaluation::Measured(_)
        ));
        b.record("tab", "v1", &steady, Some(30));
        assert!(matches!(b.evaluate("tab", "v1").0, Evaluation::Measured(_)));
        assert!(matches!(
            b.evaluate_inputs("tab", "v1").0,
            Evaluation::Measured(_)
        ));
        assert_eq!(b.evaluate_inputs("tab", "v1").0, Evaluation::Inconclusive);
    }
}
