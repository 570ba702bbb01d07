//! Per-request samples of the models a rollout watches, per deployment,
//! for the canary analysis (`keel_canary::analysis`).
//!
//! The request path pays one atomic load when no model is watched, and
//! otherwise one short lock to push a sample of a few dozen bytes. Each
//! deployment's window holds at most [`MAX_SAMPLES`] samples between two
//! [`SampleBook::take`]s; samples beyond that are counted as dropped, not
//! kept (the analysis needs far fewer).

use std::collections::HashMap;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Mutex;

use keel_canary::analysis::Sample;

/// Samples one deployment keeps between two takes.
pub const MAX_SAMPLES: usize = 100_000;

/// Samples of one deployment since the last take.
#[derive(Debug, Default, Clone, PartialEq)]
pub struct Window {
    pub samples: Vec<Sample>,
    /// Samples that did not fit.
    pub dropped: u64,
}

/// A model's windows by deployment name.
type Deployments = HashMap<Box<str>, Window>;

/// The watched models' windows, by model and deployment name.
#[derive(Debug, Default)]
pub struct SampleBook {
    watched: AtomicUsize,
    models: Mutex<HashMap<Box<str>, Deployments>>,
}

impl SampleBook {
    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<Box<str>, Deployments>> {
        self.models.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Starts keeping `model`'s samples (no-op when already watched).
    pub fn watch(&self, model: &str) {
        let mut m = self.lock();
        if !m.contains_key(model) {
            m.insert(model.into(), HashMap::new());
            self.watched.store(m.len(), Ordering::Release);
        }
    }

    /// Stops keeping `model`'s samples and drops those kept.
    pub fn unwatch(&self, model: &str) {
        let mut m = self.lock();
        m.remove(model);
        self.watched.store(m.len(), Ordering::Release);
    }

    /// Whether `model`'s samples are kept (one atomic load when no model
    /// is).
    pub fn watching(&self, model: &str) -> bool {
        self.watched.load(Ordering::Acquire) != 0 && self.lock().contains_key(model)
    }

    /// Records one request to `deployment` of `model` if the model is
    /// watched.
    pub fn record(&self, model: &str, deployment: &str, sample: Sample) {
        if self.watched.load(Ordering::Acquire) == 0 {
            return;
        }
        let mut m = self.lock();
        let Some(deployments) = m.get_mut(model) else {
            return;
        };
        let w = match deployments.get_mut(deployment) {
            Some(w) => w,
            None => deployments.entry(deployment.into()).or_default(),
        };
        if w.samples.len() < MAX_SAMPLES {
            w.samples.push(sample);
        } else {
            w.dropped += 1;
        }
    }

    /// `model`'s windows since the last take, emptied; `None` when the
    /// model is not watched.
    pub fn take(&self, model: &str) -> Option<HashMap<String, Window>> {
        let mut m = self.lock();
        let deployments = m.get_mut(model)?;
        Some(
            deployments
                .drain()
                .map(|(d, w)| (d.into_string(), w))
                .collect(),
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn s(error: bool) -> Sample {
        Sample {
            error,
            latency_ms: Some(1.0),
            completion_tokens: Some(3),
            finish_reason: None,
            answer_chars: Some(5),
            streamed: false,
            stream_aborted: false,
            output_mean: None,
        }
    }

    #[test]
    fn only_watched_models_are_kept_per_deployment_until_taken() {
        let b = SampleBook::default();
        b.record("m", "v1", s(false));
        assert_eq!(b.take("m"), None);
        assert!(!b.watching("m"));
        b.watch("m");
        assert!(b.watching("m") && !b.watching("other"));
        b.record("m", "v1", s(false));
        b.record("m", "v2", s(true));
        b.record("other", "v1", s(false));
        let w = b.take("m").expect("watched");
        assert_eq!(w.len(), 2);
        assert_eq!(w["v1"].samples, vec![s(false)]);
        assert_eq!(w["v2"].samples, vec![s(true)]);
        assert_eq!(b.take("m").map(|w| w.len()), Some(0));
        assert_eq!(b.take("other"), None);
        b.unwatch("m");
        b.record("m", "v1", s(false));
        assert_eq!(b.take("m"), None);
    }

    #[test]
    fn a_full_window_counts_what_it_drops() {
        let b = SampleBook::default();
        b.watch("m");
        for _ in 0..MAX_SAMPLES + 3 {
            b.record("m", "v1", s(false));
        }
        let w = b.take("m").expect("watched");
        assert_eq!((w["v1"].samples.len(), w["v1"].dropped), (MAX_SAMPLES, 3));
    }
}
