//! Median and spread of repeated measurements.

use serde::Serialize;

/// A set of measurements of one quantity.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct Summary {
    /// How many measurements.
    pub n: usize,
    pub median: f64,
    pub min: f64,
    pub max: f64,
    /// `(max - min) / median` in percent: how far apart the runs were.
    pub spread_pct: f64,
}

impl Summary {
    /// `None` for no samples or a sample that is not a finite number.
    pub fn of(samples: &[f64]) -> Option<Summary> {
        if samples.is_empty() || samples.iter().any(|s| !s.is_finite()) {
            return None;
        }
        let mut s = samples.to_vec();
        s.sort_by(f64::total_cmp);
        let n = s.len();
        let median = if n % 2 == 1 {
            s[n / 2]
        } else {
            (s[n / 2 - 1] + s[n / 2]) / 2.0
        };
        let (min, max) = (s[0], s[n - 1]);
        let spread_pct = if median > 0.0 {
            (max - min) / median * 100.0
        } else {
            0.0
        };
        Some(Summary {
            n,
            median,
            min,
            max,
            spread_pct,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn median_and_spread() {
        let s = Summary::of(&[3.0, 1.0, 2.0]).expect("summary");
        assert_eq!((s.n, s.median, s.min, s.max), (3, 2.0, 1.0, 3.0));
        assert_eq!(s.spread_pct, 100.0);
        let s = Summary::of(&[10.0, 12.0, 11.0, 13.0]).expect("summary");
        assert_eq!(s.median, 11.5);
        assert!((s.spread_pct - 3.0 / 11.5 * 100.0).abs() < 1e-12);
        assert_eq!(Summary::of(&[]), None);
        assert_eq!(Summary::of(&[1.0, f64::NAN]), None);
        assert_eq!(Summary::of(&[0.0, 0.0]).expect("zeros").spread_pct, 0.0);
    }
}
