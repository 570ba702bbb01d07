//! The statistical tests the analysis is built on: Fisher's exact test for
//! a higher event rate in one of two groups, the Mann-Whitney U test
//! (normal approximation with tie and continuity corrections), and the
//! normal tail they need.
//!
//! Rates in a canary are small (an error in a few hundred requests) and the
//! canary group is small at the first steps (1% of traffic), where the
//! normal approximation of the two-proportion z-test overstates the
//! evidence: two errors in 50 canary requests against 0.5% in the stable
//! group has z = 3.5 but an exact p-value of 0.04. The decision therefore
//! uses the exact conditional test; the z statistic is not computed.

/// Events out of trials in one group.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, serde::Serialize, serde::Deserialize)]
pub struct Count {
    pub events: u64,
    pub trials: u64,
}

impl Count {
    pub fn new(events: u64, trials: u64) -> Self {
        Self { events, trials }
    }

    /// `events / trials`, `None` for no trials.
    pub fn rate(&self) -> Option<f64> {
        (self.trials > 0).then(|| self.events as f64 / self.trials as f64)
    }
}

/// One-sided Fisher exact test: the p-value of seeing at least
/// `a.events` events in group `a` given the events of both groups, when
/// both groups have the same rate (hypergeometric upper tail). Small when
/// `a`'s rate is higher than `b`'s. `None` when a group has no trials or
/// has more events than trials.
pub fn fisher_greater(a: Count, b: Count) -> Option<f64> {
    if a.trials == 0 || b.trials == 0 || a.events > a.trials || b.events > b.trials {
        return None;
    }
    let n = a.trials + b.trials;
    let k = a.events + b.events;
    let draws = a.trials;
    let hi = k.min(draws);
    let lo = a.events;
    if lo > hi {
        return Some(0.0);
    }
    let denom = ln_choose(n, draws);
    // Terms decrease away from the mode; summing in log space keeps far
    // tails (p of 1e-30) representable.
    let mut log_terms = Vec::with_capacity((hi - lo + 1) as usize);
    for x in lo..=hi {
        if draws - x > n - k {
            continue;
        }
        log_terms.push(ln_choose(k, x) + ln_choose(n - k, draws - x) - denom);
    }
    let max = log_terms.iter().copied().fold(f64::NEG_INFINITY, f64::max);
    if !max.is_finite() {
        return Some(0.0);
    }
    let sum: f64 = log_terms.iter().map(|t| (t - max).exp()).sum();
    Some((max + sum.ln()).exp().clamp(0.0, 1.0))
}

/// The exact stratified version of [`fisher_greater`] (the exact
/// conditional test of no association in several 2x2 tables, as for a
/// common odds ratio of 1): each stratum `(a, b)` is one period in which
/// both groups were observed; within each, given its margins, the events
/// of `a` are hypergeometric when both groups have the same rate, and the
/// p-value is the upper tail of their sum over the strata (the
/// convolution of the strata's distributions) at the observed sum. With
/// one stratum it is [`fisher_greater`]. Strata in which a group has no
/// trials carry no information and are left out; `None` when none is
/// left or a count is impossible.
pub fn stratified_exact_greater(strata: &[(Count, Count)]) -> Option<f64> {
    if strata
        .iter()
        .any(|(a, b)| a.events > a.trials || b.events > b.trials)
    {
        return None;
    }
    let used: Vec<&(Count, Count)> = strata
        .iter()
        .filter(|(a, b)| a.trials > 0 && b.trials > 0)
        .collect();
    if used.is_empty() {
        return None;
    }
    // The distribution of the sum so far, from `offset`.
    let mut dist = vec![1.0f64];
    let mut offset = 0u64;
    let mut observed = 0u64;
    for (a, b) in used {
        let n = a.trials + b.trials;
        let k = a.events + b.events;
        let draws = a.trials;
        let lo = draws.saturating_sub(n - k);
        let hi = k.min(draws);
        let denom = ln_choose(n, draws);
        let logs: Vec<f64> = (lo..=hi)
            .map(|x| ln_choose(k, x) + ln_choose(n - k, draws - x) - denom)
            .collect();
        let max = logs.iter().copied().fold(f64::NEG_INFINITY, f64::max);
        let mut pmf: Vec<f64> = logs.iter().map(|l| (l - max).exp()).collect();
        let total: f64 = pmf.iter().sum();
        pmf.iter_mut().for_each(|p| *p /= total);
        let mut next = vec![0.0; dist.len() + pmf.len() - 1];
        for (i, d) in dist.iter().enumerate() {
            if *d == 0.0 {
                continue;
            }
            for (j, p) in pmf.iter().enumerate() {
                next[i + j] += d * p;
            }
        }
        dist = next;
        offset += lo;
        observed += a.events;
    }
    let from = observed.saturating_sub(offset) as usize;
    let p: f64 = dist.iter().skip(from).sum();
    Some(p.clamp(0.0, 1.0))
}

/// The Mann-Whitney U test of two samples.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct MannWhitney {
    /// U of the first sample: the number of pairs (x from `a`, y from `b`)
    /// with x > y, ties counting one half.
    pub u: f64,
    /// Standardised U (tie-corrected, without continuity correction).
    pub z: f64,
    /// One-sided p-value for `a` tending to larger values than `b`.
    pub p_greater: f64,
    /// One-sided p-value for `a` tending to smaller values than `b`.
    pub p_less: f64,
    pub n_a: usize,
    pub n_b: usize,
}

/// Mann-Whitney U test of `a` against `b` with average ranks for ties,
/// the tie-corrected variance and a continuity correction of one half.
/// Values that are not finite are left out. `None` when either sample has
/// no finite value. When every value is equal both p-values are 1.
pub fn mann_whitney(a: &[f64], b: &[f64]) -> Option<MannWhitney> {
    let mut all: Vec<(f64, bool)> = a
        .iter()
        .filter(|v| v.is_finite())
        .map(|&v| (v, true))
        .chain(b.iter().filter(|v| v.is_finite()).map(|&v| (v, false)))
        .collect();
    let n_a = all.iter().filter(|(_, in_a)| *in_a).count();
    let n_b = all.len() - n_a;
    if n_a == 0 || n_b == 0 {
        return None;
    }
    all.sort_by(|x, y| x.0.total_cmp(&y.0));
    let n = all.len();
    let mut rank_sum_a = 0.0;
    let mut tie_term = 0.0;
    let mut i = 0;
    while i < n {
        let mut j = i + 1;
        while j < n && all[j].0 == all[i].0 {
            j += 1;
        }
        // Ranks i+1 ..= j share their average.
        let avg = (i + 1 + j) as f64 / 2.0;
        let t = (j - i) as f64;
        tie_term += t * t * t - t;
        rank_sum_a += avg * all[i..j].iter().filter(|(_, in_a)| *in_a).count() as f64;
        i = j;
    }
    let (na, nb, nf) = (n_a as f64, n_b as f64, n as f64);
    let u = rank_sum_a - na * (na + 1.0) / 2.0;
    let mean = na * nb / 2.0;
    let var = na * nb / 12.0 * ((nf + 1.0) - tie_term / (nf * (nf - 1.0)).max(1.0));
    if var <= 0.0 {
        return Some(MannWhitney {
            u,
            z: 0.0,
            p_greater: 1.0,
            p_less: 1.0,
            n_a,
            n_b,
        });
    }
    let sd = var.sqrt();
    let z = (u - mean) / sd;
    let p_greater = normal_sf((u - mean - 0.5) / sd);
    let p_less = normal_sf((mean - u - 0.5) / sd);
    Some(MannWhitney {
        u,
        z,
        p_greater: p_greater.min(1.0),
        p_less: p_less.min(1.0),
        n_a,
        n_b,
    })
}

/// Upper tail of the standard normal distribution, P(Z > z).
pub fn normal_sf(z: f64) -> f64 {
    0.5 * erfc(z / std::f64::consts::SQRT_2)
}

/// Complementary error function with a relative error under 1.2e-7
/// everywhere (Chebyshev fit, Numerical Recipes' `erfcc`), so that far
/// tails keep their relative accuracy.
pub fn erfc(x: f64) -> f64 {
    let z = x.abs();
    let t = 1.0 / (1.0 + 0.5 * z);
    let ans = t
        * (-z * z - 1.265_512_23
            + t * (1.000_023_68
                + t * (0.374_091_96
                    + t * (0.096_784_18
                        + t * (-0.186_288_06
                            + t * (0.278_868_07
                                + t * (-1.135_203_98
                                    + t * (1.488_515_87
                                        + t * (-0.822_152_23 + t * 0.170_872_77)))))))))
            .exp();
    if x >= 0.0 {
        ans
    } else {
        2.0 - ans
    }
}

/// ln(n choose k) for k <= n.
fn ln_choose(n: u64, k: u64) -> f64 {
    ln_factorial(n) - ln_factorial(k) - ln_factorial(n - k)
}

fn ln_factorial(n: u64) -> f64 {
    ln_gamma(n as f64 + 1.0)
}

/// ln Γ(x) for x > 0 (Lanczos, g = 7, nine coefficients; relative error
/// about 1e-15).
fn ln_gamma(x: f64) -> f64 {
    const G: f64 = 7.0;
    const C: [f64; 9] = [
        0.999_999_999_999_809_9,
        676.520_368_121_885_1,
        -1_259.139_216_722_402_8,
        771.323_428_777_653_1,
        -176.615_029_162_140_6,
        12.507_343_278_686_905,
        -0.138_571_095_265_720_12,
        9.984_369_578_019_572e-6,
        1.505_632_735_149_311_6e-7,
    ];
    if x < 0.5 {
        // Reflection; only reached for x in (0, 0.5), which ln_factorial
        // never asks for.
        let pi = std::f64::consts::PI;
        return (pi / (pi * x).sin()).ln() - ln_gamma(1.0 - x);
    }
    let x = x - 1.0;
    let mut a = C[0];
    let t = x + G + 0.5;
    for (i, c) in C.iter().enumerate().skip(1) {
        a += c / (x + i as f64);
    }
    0.5 * (2.0 * std::f64::consts::PI).ln() + (x + 0.5) * t.ln() - t + a.ln()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn close(a: f64, b: f64, rel: f64) -> bool {
        (a - b).abs() <= rel * b.abs().max(1e-300)
    }

    #[test]
    fn normal_tail_matches_tables() {
        assert!(close(normal_sf(0.0), 0.5, 1e-6));
        assert!(close(normal_sf(1.959_964), 0.025, 1e-5));
        assert!(close(normal_sf(3.090_232), 0.001, 1e-5));
        assert!(close(normal_sf(6.0), 9.865_876e-10, 1e-5));
        assert!(close(normal_sf(-1.644_854), 0.95, 1e-6));
    }

    #[test]
    fn ln_gamma_matches_factorials() {
        assert!(ln_factorial(0).abs() < 1e-12);
        assert!(close(ln_factorial(10), 3_628_800f64.ln(), 1e-12));
        assert!(close(ln_factorial(170), 706.573_062_245_787_4, 1e-12));
    }

    #[test]
    fn fisher_matches_the_worked_example() {
        // The lady tasting tea: 3 of 4 right in each group of 4, one-sided
        // p = 17/70.
        let p = fisher_greater(Count::new(3, 4), Count::new(1, 4)).unwrap();
        assert!(close(p, 17.0 / 70.0, 1e-9), "{p}");
        // Two errors in 50 canary requests against 0.5% of 1500 stable
        // ones is not evidence at 0.001.
        let p = fisher_greater(Count::new(2, 50), Count::new(8, 1500)).unwrap();
        assert!(p > 0.01 && p < 0.2, "{p}");
        // Twenty empty answers in 100 against 0.5% is.
        let p = fisher_greater(Count::new(20, 100), Count::new(8, 1500)).unwrap();
        assert!(p < 1e-10, "{p}");
    }

    #[test]
    fn fisher_rejects_impossible_counts() {
        assert_eq!(fisher_greater(Count::new(1, 0), Count::new(0, 5)), None);
        assert_eq!(fisher_greater(Count::new(6, 5), Count::new(0, 5)), None);
        assert_eq!(fisher_greater(Count::new(0, 5), Count::new(0, 0)), None);
    }

    #[test]
    fn the_stratified_test_matches_a_hand_count_and_fisher_on_one_stratum() {
        // Stratum 1: 2 of 3 against 0 of 3, P(x) = 0.2, 0.6, 0.2 for x =
        // 0, 1, 2; stratum 2: 1 of 2 against 1 of 2, P(x) = 1/6, 4/6, 1/6.
        // P(sum >= 3) = (0.2 * 4 + 0.2 * 1 + 0.6 * 1) / 6.
        let s1 = (Count::new(2, 3), Count::new(0, 3));
        let s2 = (Count::new(1, 2), Count::new(1, 2));
        let p = stratified_exact_greater(&[s1, s2]).unwrap();
        assert!((p - 1.6 / 6.0).abs() < 1e-12, "{p}");
        for (a, b) in [
            (Count::new(2, 50), Count::new(5, 1000)),
            (Count::new(0, 10), Count::new(3, 30)),
            (Count::new(20, 100), Count::new(0, 1000)),
            (Count::new(7, 7), Count::new(7, 7)),
        ] {
            let f = fisher_greater(a, b).unwrap();
            let s = stratified_exact_greater(&[(a, b)]).unwrap();
            assert!(
                (f - s).abs() < 1e-12 * f.max(1e-300).max(1.0),
                "{a:?} {b:?}: {f} {s}"
            );
        }
        // A stratum with an empty group carries nothing; impossible
        // counts and no information at all are None.
        let empty = (Count::new(0, 0), Count::new(3, 10));
        assert_eq!(stratified_exact_greater(&[s1, s2, empty]), Some(p));
        assert_eq!(stratified_exact_greater(&[empty]), None);
        assert_eq!(stratified_exact_greater(&[]), None);
        assert_eq!(
            stratified_exact_greater(&[s1, (Count::new(3, 2), Count::new(0, 2))]),
            None
        );
        // Evidence adds up over strata: one extra event in each of three
        // small strata is weak alone, strong together.
        let st = (Count::new(3, 40), Count::new(4, 400));
        let one = stratified_exact_greater(&[st]).unwrap();
        let three = stratified_exact_greater(&[st, st, st]).unwrap();
        assert!(three < one / 10.0, "{one} {three}");
    }

    #[test]
    fn mann_whitney_matches_a_hand_count() {
        // a = [1, 2, 3], b = [4, 5]: a is below b in all 6 pairs.
        let r = mann_whitney(&[1.0, 2.0, 3.0], &[4.0, 5.0]).unwrap();
        assert_eq!(r.u, 0.0);
        assert!(r.p_less < r.p_greater);
        let r = mann_whitney(&[4.0, 5.0], &[1.0, 2.0, 3.0]).unwrap();
        assert_eq!(r.u, 6.0);
        // With ties: a = [1, 2], b = [2, 3]: pairs (1,2) 0, (1,3) 0,
        // (2,2) 0.5, (2,3) 0.
        let r = mann_whitney(&[1.0, 2.0], &[2.0, 3.0]).unwrap();
        assert_eq!(r.u, 0.5);
    }

    #[test]
    fn mann_whitney_of_constant_samples_is_no_evidence() {
        let r = mann_whitney(&[7.0; 40], &[7.0; 60]).unwrap();
        assert_eq!((r.p_greater, r.p_less), (1.0, 1.0));
        assert_eq!(mann_whitney(&[], &[1.0]), None);
        assert_eq!(mann_whitney(&[f64::NAN], &[1.0]), None);
    }
}
