//! Drift between a reference window and a current window of one feature:
//! fixed-bin histograms ([`Histogram`], [`SlidingHistogram`]) compared with
//! the Population Stability Index ([`psi`]) and the Jensen-Shannon
//! divergence ([`jensen_shannon`]).
//!
//! Both measures take two count vectors over the same bins (a numeric
//! feature's histogram, or a categorical feature such as the finish reason
//! counted per value) and compare their proportions:
//!
//! - PSI = Σ (cur% − ref%) · ln(cur% / ref%), with empty bins counted as
//!   [`PSI_EPSILON`]; symmetric, 0 for equal proportions, unbounded. The
//!   usual reading: under 0.1 no shift, 0.1 to 0.25 moderate, over 0.25
//!   major.
//! - JS = ½ KL(ref ‖ m) + ½ KL(cur ‖ m) with m the average, in bits:
//!   symmetric, 0 for equal proportions, at most 1 (disjoint). 0.1 is the
//!   common alert threshold.
//!
//! A feature whose range is not known in advance (an input column of a
//! tabular model) gets its edges from its reference values:
//! [`quantile_edges`] cuts them into bins of equal shares. Whether a drift
//! lasts is [`Sustained`]'s call: a threshold crossed on a number of
//! consecutive conclusive evaluations.

use thiserror::Error;

/// The proportion an empty bin counts as in [`psi`].
pub const PSI_EPSILON: f64 = 1e-4;

#[derive(Debug, Error, PartialEq)]
pub enum DriftError {
    #[error("the reference has {reference} bins and the current window {current}")]
    BinMismatch { reference: usize, current: usize },
    #[error("the {window} window is empty")]
    Empty { window: &'static str },
    #[error("histogram edges must be finite and strictly increasing: {reason}")]
    Edges { reason: String },
    #[error("a sliding window needs a capacity of at least one observation")]
    ZeroCapacity,
}

/// A histogram over fixed edges `e0 < e1 < ... < ek`: bin 0 counts values
/// below `e0`, bin i values in `[e(i-1), e(i))`, the last bin values from
/// `ek` up; k + 2 bins in all, so no value is lost. Values that are not
/// finite are not counted.
#[derive(Debug, Clone, PartialEq)]
pub struct Histogram {
    edges: Vec<f64>,
    counts: Vec<u64>,
}

impl Histogram {
    pub fn new(edges: Vec<f64>) -> Result<Self, DriftError> {
        if edges.is_empty() {
            return Err(DriftError::Edges {
                reason: "no edges".into(),
            });
        }
        if let Some(e) = edges.iter().find(|e| !e.is_finite()) {
            return Err(DriftError::Edges {
                reason: format!("{e} is not finite"),
            });
        }
        if let Some(w) = edges.windows(2).find(|w| w[0] >= w[1]) {
            return Err(DriftError::Edges {
                reason: format!("{} is not below {}", w[0], w[1]),
            });
        }
        let counts = vec![0; edges.len() + 1];
        Ok(Histogram { edges, counts })
    }

    /// A histogram over `edges` holding `counts` (one more than the
    /// edges), as recorded earlier.
    pub fn with_counts(edges: Vec<f64>, counts: Vec<u64>) -> Result<Self, DriftError> {
        let mut h = Histogram::new(edges)?;
        if counts.len() != h.counts.len() {
            return Err(DriftError::BinMismatch {
                reference: h.counts.len(),
                current: counts.len(),
            });
        }
        h.counts = counts;
        Ok(h)
    }

    /// `bins` equal-width bins between `lo` and `hi` (plus the two open
    /// ones).
    pub fn linear(lo: f64, hi: f64, bins: usize) -> Result<Self, DriftError> {
        let bins = bins.max(1);
        let edges = (0..=bins)
            .map(|i| lo + (hi - lo) * i as f64 / bins as f64)
            .collect();
        Histogram::new(edges)
    }

    /// The bin `x` falls in; `None` for a value that is not finite.
    pub fn bin(&self, x: f64) -> Option<usize> {
        x.is_finite()
            .then(|| self.edges.partition_point(|&e| e <= x))
    }

    pub fn add(&mut self, x: f64) {
        if let Some(b) = self.bin(x) {
            self.counts[b] = self.counts[b].saturating_add(1);
        }
    }

    pub fn counts(&self) -> &[u64] {
        &self.counts
    }

    pub fn edges(&self) -> &[f64] {
        &self.edges
    }

    /// The number of observations; `None` when the counts (as read from
    /// a file) add up to more than a `u64` holds.
    pub fn checked_total(&self) -> Option<u64> {
        self.counts.iter().try_fold(0u64, |t, &c| t.checked_add(c))
    }

    /// The number of observations, at most `u64::MAX`.
    pub fn total(&self) -> u64 {
        self.checked_total().unwrap_or(u64::MAX)
    }
}

/// The last `capacity` observations of a feature as a histogram: the
/// current window of drift, sliding as requests arrive.
#[derive(Debug, Clone)]
pub struct SlidingHistogram {
    hist: Histogram,
    recent: std::collections::VecDeque<usize>,
    capacity: usize,
}

impl SlidingHistogram {
    pub fn new(hist: Histogram, capacity: usize) -> Result<Self, DriftError> {
        if capacity == 0 {
            return Err(DriftError::ZeroCapacity);
        }
        let mut hist = hist;
        hist.counts.iter_mut().for_each(|c| *c = 0);
        Ok(SlidingHistogram {
            hist,
            recent: std::collections::VecDeque::with_capacity(capacity),
            capacity,
        })
    }

    pub fn add(&mut self, x: f64) {
        let Some(b) = self.hist.bin(x) else { return };
        if self.recent.len() == self.capacity {
            if let Some(old) = self.recent.pop_front() {
                self.hist.counts[old] -= 1;
            }
        }
        self.recent.push_back(b);
        self.hist.counts[b] += 1;
    }

    pub fn counts(&self) -> &[u64] {
        self.hist.counts()
    }

    pub fn edges(&self) -> &[f64] {
        self.hist.edges()
    }

    pub fn len(&self) -> usize {
        self.recent.len()
    }

    pub fn is_empty(&self) -> bool {
        self.recent.is_empty()
    }

    pub fn is_full(&self) -> bool {
        self.recent.len() == self.capacity
    }
}

/// Edges that cut `values` into `bins` bins of (nearly) equal shares:
/// the values at ranks `i·n/bins` for `i` in `1..bins`, duplicates merged,
/// so that `Histogram::new` accepts them. Values that are not finite are
/// ignored; with no finite value the result is [`DriftError::Empty`].
/// With `n` distinct values each bin of the resulting histogram holds
/// `⌊n/bins⌋` to `⌈n/bins⌉` of them.
pub fn quantile_edges(values: &[f64], bins: usize) -> Result<Vec<f64>, DriftError> {
    let mut v: Vec<f64> = values.iter().copied().filter(|x| x.is_finite()).collect();
    if v.is_empty() {
        return Err(DriftError::Empty {
            window: "reference",
        });
    }
    v.sort_by(f64::total_cmp);
    let bins = bins.max(2);
    let n = v.len();
    let mut edges: Vec<f64> = (1..bins).map(|i| v[i * n / bins]).collect();
    edges.dedup();
    if edges.is_empty() {
        edges.push(v[0]);
    }
    Ok(edges)
}

/// One evaluation of a drift measure.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Evaluation {
    /// Too few observations to say (a window not yet full, or nothing new
    /// since the previous evaluation): neither drift nor its absence.
    Inconclusive,
    /// The measure's value.
    Measured(f64),
}

/// A drift that lasts: the measure above `threshold` on `needed`
/// consecutive conclusive evaluations. An inconclusive evaluation neither
/// counts nor breaks the run; one at or below the threshold breaks it.
#[derive(Debug, Clone, PartialEq)]
pub struct Sustained {
    threshold: f64,
    needed: u32,
    streak: u32,
}

impl Sustained {
    pub fn new(threshold: f64, needed: u32) -> Self {
        Sustained {
            threshold,
            needed: needed.max(1),
            streak: 0,
        }
    }

    /// Takes one evaluation; `true` exactly once per run, on the
    /// evaluation that makes it `needed` long.
    pub fn observe(&mut self, e: Evaluation) -> bool {
        match e {
            Evaluation::Inconclusive => false,
            Evaluation::Measured(x) if x > self.threshold => {
                self.streak = self.streak.saturating_add(1);
                self.streak == self.needed
            }
            Evaluation::Measured(_) => {
                self.streak = 0;
                false
            }
        }
    }

    /// Consecutive conclusive evaluations above the threshold so far.
    pub fn streak(&self) -> u32 {
        self.streak
    }

    /// Forgets the run (the watched version changed).
    pub fn reset(&mut self) {
        self.streak = 0;
    }
}

fn proportions(reference: &[u64], current: &[u64]) -> Result<(Vec<f64>, Vec<f64>), DriftError> {
    if reference.len() != current.len() {
        return Err(DriftError::BinMismatch {
            reference: reference.len(),
            current: current.len(),
        });
    }
    let total = |c: &[u64]| c.iter().map(|&v| v as f64).sum::<f64>();
    let (rt, ct) = (total(reference), total(current));
    if rt == 0.0 {
        return Err(DriftError::Empty {
            window: "reference",
        });
    }
    if ct == 0.0 {
        return Err(DriftError::Empty { window: "current" });
    }
    Ok((
        reference.iter().map(|&v| v as f64 / rt).collect(),
        current.iter().map(|&v| v as f64 / ct).collect(),
    ))
}

/// Population Stability Index of `current` against `reference` (counts
/// over the same bins).
pub fn psi(reference: &[u64], current: &[u64]) -> Result<f64, DriftError> {
    let (r, c) = proportions(reference, current)?;
    Ok(r.iter()
        .zip(&c)
        .map(|(&r, &c)| {
            let (r, c) = (r.max(PSI_EPSILON), c.max(PSI_EPSILON));
            (c - r) * (c / r).ln()
        })
        .sum::<f64>()
        .max(0.0))
}

/// Jensen-Shannon divergence in bits (0 to 1) between the proportions of
/// `reference` and `current` (counts over the same bins).
pub fn jensen_shannon(reference: &[u64], current: &[u64]) -> Result<f64, DriftError> {
    let (r, c) = proportions(reference, current)?;
    let kl_half = |p: f64, m: f64| if p > 0.0 { p * (p / m).log2() } else { 0.0 };
    let js: f64 = r
        .iter()
        .zip(&c)
        .map(|(&r, &c)| {
            let m = (r + c) / 2.0;
            0.5 * kl_half(r, m) + 0.5 * kl_half(c, m)
        })
        .sum();
    Ok(js.clamp(0.0, 1.0))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bins_cover_every_finite_value() {
        let mut h = Histogram::new(vec![0.0, 10.0, 100.0]).unwrap();
        for x in [-5.0, 0.0, 9.9, 10.0, 99.0, 100.0, 1e9, f64::NAN] {
            h.add(x);
        }
        assert_eq!(h.counts(), &[1, 2, 2, 2]);
        assert_eq!(h.total(), 7);
    }

    #[test]
    fn counts_that_overflow_a_u64_have_no_total() {
        let h = Histogram::with_counts(vec![0.0], vec![u64::MAX, 1]).unwrap();
        assert_eq!(h.checked_total(), None);
        assert_eq!(h.total(), u64::MAX);
        let h = Histogram::with_counts(vec![0.0], vec![u64::MAX - 1, 1]).unwrap();
        assert_eq!(h.checked_total(), Some(u64::MAX));
        let mut h = Histogram::with_counts(vec![0.0], vec![0, u64::MAX]).unwrap();
        h.add(5.0);
        assert_eq!(h.counts(), &[0, u64::MAX]);
    }

    #[test]
    fn bad_edges_are_refused() {
        assert!(matches!(
            Histogram::new(vec![]),
            Err(DriftError::Edges { .. })
        ));
        let e = Histogram::new(vec![1.0, 1.0]).unwrap_err();
        assert_eq!(
            e.to_string(),
            "histogram edges must be finite and strictly increasing: 1 is not below 1"
        );
        assert!(Histogram::new(vec![0.0, f64::INFINITY]).is_err());
    }

    #[test]
    fn known_values() {
        // Disjoint: JS is one bit.
        assert_eq!(jensen_shannon(&[5, 0], &[0, 7]).unwrap(), 1.0);
        assert_eq!(psi(&[10, 10], &[20, 20]).unwrap(), 0.0);
        // 50/50 against 90/10: PSI = 0.4 ln 1.8 + 0.4 ln 5.
        let p = psi(&[50, 50], &[90, 10]).unwrap();
        assert!(
            (p - (0.4 * 1.8f64.ln() + 0.4 * 5f64.ln())).abs() < 1e-12,
            "{p}"
        );
        assert_eq!(
            psi(&[1, 2], &[1, 2, 3]),
            Err(DriftError::BinMismatch {
                reference: 2,
                current: 3
            })
        );
        assert_eq!(
            psi(&[0, 0], &[1, 2]),
            Err(DriftError::Empty {
                window: "reference"
            })
        );
    }

    #[test]
    fn quantile_edges_split_the_reference_evenly() {
        let v: Vec<f64> = (0..100).map(f64::from).collect();
        let e = quantile_edges(&v, 4).unwrap();
        assert_eq!(e, vec![25.0, 50.0, 75.0]);
        let mut h = Histogram::new(e).unwrap();
        v.iter().for_each(|&x| h.add(x));
        assert_eq!(h.counts(), &[25, 25, 25, 25]);
        // One value repeated: one edge, everything in the upper bin.
        assert_eq!(quantile_edges(&[3.0; 10], 10).unwrap(), vec![3.0]);
        assert_eq!(
            quantile_edges(&[f64::NAN], 10),
            Err(DriftError::Empty {
                window: "reference"
            })
        );
    }

    #[test]
    fn a_drift_must_last_and_inconclusive_evaluations_never_count() {
        use Evaluation::{Inconclusive as I, Measured as M};
        let mut s = Sustained::new(0.25, 3);
        let fired: Vec<bool> = [M(0.3), I, M(0.4), M(0.1), M(0.3), M(0.3), I, M(0.3), M(0.9)]
            .into_iter()
            .map(|e| s.observe(e))
            .collect();
        assert_eq!(
            fired,
            [false, false, false, false, false, false, false, true, false]
        );
        assert_eq!(s.streak(), 4);
        s.reset();
        assert_eq!(s.streak(), 0);
        let mut s = Sustained::new(0.25, 1);
        assert!(!(0..100).any(|_| s.observe(I)));
        assert!(!s.observe(M(0.25)), "at the threshold is not above it");
        assert!(s.observe(M(0.26)));
    }

    #[test]
    fn the_sliding_window_forgets_old_values() {
        let h = Histogram::new(vec![10.0]).unwrap();
        let mut s = SlidingHistogram::new(h, 3).unwrap();
        for x in [1.0, 2.0, 3.0, 20.0, 30.0] {
            s.add(x);
        }
        assert_eq!(s.counts(), &[1, 2]);
        assert!(s.is_full());
        assert!(SlidingHistogram::new(Histogram::new(vec![1.0]).unwrap(), 0).is_err());
    }
}
