//! Properties of the tests and distances: bounds, symmetry, invariance,
//! calibration under identical distributions and power against shifts.

use keel_canary::analysis::{
    analyse, analyse_after, step_counts, FinishReason, Sample, Thresholds,
};
use keel_canary::drift::{jensen_shannon, psi, quantile_edges, Evaluation, Histogram, Sustained};
use keel_canary::stats::{fisher_greater, mann_whitney, Count};
use proptest::prelude::*;

/// SplitMix64: seeded draws for the calibration properties.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }
    fn uniform(&mut self) -> f64 {
        (self.next() >> 11) as f64 / (1u64 << 53) as f64
    }
    fn normal(&mut self) -> f64 {
        let u = self.uniform().max(1e-300);
        let v = self.uniform();
        (-2.0 * u.ln()).sqrt() * (2.0 * std::f64::consts::PI * v).cos()
    }
    fn bernoulli(&mut self, p: f64) -> bool {
        self.uniform() < p
    }
}

fn counts() -> impl Strategy<Value = Vec<u64>> {
    prop::collection::vec(0u64..1000, 2..12)
}

proptest! {
    #[test]
    fn fisher_is_a_probability_and_monotone(
        n_a in 1u64..400, n_b in 1u64..4000, fa in 0.0f64..1.0, fb in 0.0f64..1.0,
    ) {
        let x_a = (fa * n_a as f64) as u64;
        let x_b = (fb * n_b as f64) as u64;
        let p = fisher_greater(Count::new(x_a, n_a), Count::new(x_b, n_b)).unwrap();
        prop_assert!((0.0..=1.0).contains(&p));
        if x_a < n_a {
            let more = fisher_greater(Count::new(x_a + 1, n_a), Count::new(x_b, n_b)).unwrap();
            prop_assert!(more <= p + 1e-9, "{more} > {p}");
        }
        let none = fisher_greater(Count::new(0, n_a), Count::new(x_b, n_b)).unwrap();
        prop_assert!((none - 1.0).abs() < 1e-9, "{none}");
    }

    #[test]
    fn mann_whitney_is_antisymmetric(
        a in prop::collection::vec(-1e3f64..1e3, 1..80),
        b in prop::collection::vec(-1e3f64..1e3, 1..80),
    ) {
        let ab = mann_whitney(&a, &b).unwrap();
        let ba = mann_whitney(&b, &a).unwrap();
        prop_assert!((ab.u + ba.u - (a.len() * b.len()) as f64).abs() < 1e-6);
        prop_assert!((ab.p_greater - ba.p_less).abs() < 1e-12);
        prop_assert!((0.0..=1.0).contains(&ab.p_greater));
        prop_assert!((0.0..=1.0).contains(&ab.p_less));
    }

    #[test]
    fn mann_whitney_depends_on_ranks_only(
        a in prop::collection::vec(-5f64..5.0, 1..60),
        b in prop::collection::vec(-5f64..5.0, 1..60),
    ) {
        let ea: Vec<f64> = a.iter().map(|x| x.exp() * 3.0 + 1.0).collect();
        let eb: Vec<f64> = b.iter().map(|x| x.exp() * 3.0 + 1.0).collect();
        let raw = mann_whitney(&a, &b).unwrap();
        let moved = mann_whitney(&ea, &eb).unwrap();
        prop_assert!((raw.u - moved.u).abs() < 1e-9);
        prop_assert!((raw.p_greater - moved.p_greater).abs() < 1e-9);
    }

    #[test]
    fn a_sample_above_the_other_is_detected(
        a in prop::collection::vec(0f64..100.0, 20..80),
        b in prop::collection::vec(0f64..100.0, 20..80),
    ) {
        let shifted: Vec<f64> = a.iter().map(|x| x + 1000.0).collect();
        let r = mann_whitney(&shifted, &b).unwrap();
        prop_assert_eq!(r.u, (a.len() * b.len()) as f64);
        prop_assert!(r.p_greater < 1e-4, "{}", r.p_greater);
        prop_assert!(r.p_less > 0.99);
    }

    #[test]
    fn distances_are_symmetric_bounded_and_zero_on_equal_proportions(
        r in counts(), c in counts(), k in 1u64..5,
    ) {
        let n = r.len().min(c.len());
        let (r, c) = (&r[..n], &c[..n]);
        prop_assume!(r.iter().sum::<u64>() > 0 && c.iter().sum::<u64>() > 0);
        let js = jensen_shannon(r, c).unwrap();
        prop_assert!((0.0..=1.0).contains(&js));
        prop_assert!((js - jensen_shannon(c, r).unwrap()).abs() < 1e-12);
        let p = psi(r, c).unwrap();
        prop_assert!(p >= 0.0);
        prop_assert!((p - psi(c, r).unwrap()).abs() < 1e-9);
        let scaled: Vec<u64> = r.iter().map(|v| v * k).collect();
        prop_assert!(jensen_shannon(r, &scaled).unwrap() < 1e-12);
        prop_assert!(psi(r, &scaled).unwrap() < 1e-12);
    }

    #[test]
    fn quantile_edges_give_bins_of_equal_shares(
        raw in prop::collection::btree_set(-1_000_000i64..1_000_000, 1..400),
        bins in 2usize..20,
    ) {
        let v: Vec<f64> = raw.iter().map(|&x| x as f64 / 7.0).collect();
        let edges = quantile_edges(&v, bins).unwrap();
        prop_assert!(edges.windows(2).all(|w| w[0] < w[1]));
        let mut h = Histogram::new(edges).unwrap();
        v.iter().for_each(|&x| h.add(x));
        prop_assert_eq!(h.total(), v.len() as u64);
        let n = v.len() as u64;
        let b = bins as u64;
        if n >= b {
            prop_assert_eq!(h.counts().len(), bins);
            for &c in h.counts() {
                prop_assert!(c >= n / b && c <= n.div_ceil(b), "{:?} of {}", h.counts(), n);
            }
        }
        // The reference against itself has no drift.
        prop_assert!(psi(h.counts(), h.counts()).unwrap() < 1e-12);
    }

    #[test]
    fn a_sustained_drift_fires_once_only_after_enough_conclusive_breaches(
        evals in prop::collection::vec(prop::option::of(0f64..1.0), 0..60),
        needed in 1u32..6,
    ) {
        let mut s = Sustained::new(0.5, needed);
        let mut run = 0u32;
        for e in &evals {
            let fired = s.observe(match e {
                Some(x) => Evaluation::Measured(*x),
                None => Evaluation::Inconclusive,
            });
            match e {
                Some(x) if *x > 0.5 => run += 1,
                Some(_) => run = 0,
                None => {}
            }
            let breach = matches!(e, Some(x) if *x > 0.5);
            prop_assert_eq!(fired, breach && run == needed);
            prop_assert_eq!(s.streak(), run);
        }
        // Inconclusive evaluations alone never fire.
        let mut s = Sustained::new(0.0, 1);
        prop_assert!(!(0..evals.len()).any(|_| s.observe(Evaluation::Inconclusive)));
    }

    #[test]
    fn an_identical_window_never_fails(
        raw in prop::collection::vec((any::<bool>(), 1f64..5000.0, 0u32..600, 0u8..3, 0u32..400, any::<bool>()), 0..300),
    ) {
        let samples: Vec<Sample> = raw.iter().map(|&(error, lat, tokens, fin, chars, streamed)| Sample {
            error,
            latency_ms: Some(lat),
            completion_tokens: Some(tokens),
            finish_reason: Some(match fin { 0 => FinishReason::Stop, 1 => FinishReason::Length, _ => FinishReason::Other }),
            answer_chars: Some(chars),
            streamed,
            stream_aborted: streamed && chars % 7 == 0,
            // OIP output means of either sign, on some requests.
            output_mean: (chars % 3 != 0).then_some(lat - 2500.0),
        }).collect();
        let a = analyse(&samples, &samples, &Thresholds::default());
        prop_assert!(!a.failed(), "{:?}", a.failures().collect::<Vec<_>>());
        // Nor with earlier steps that were identical too.
        let t = Thresholds::default();
        let step = step_counts(&samples, &samples, &t);
        let a = analyse_after(&samples, &samples, &[step, step, step], &t);
        prop_assert!(!a.failed(), "{:?}", a.failures().collect::<Vec<_>>());
    }

}

proptest! {
    // Each case draws thousands of samples: a few seeds are enough. The
    // seeds are fixed: these check a test's level and power, which a
    // calibrated test misses by chance at a known rate (13 or more
    // rejections of 400 at 0.01 has a chance of 2.5e-4; two tests in each
    // of twelve random cases would fail about one run in 170). Fixed, the
    // suite gives the same answer every time, and a change that breaks
    // calibration or power still fails it.
    #![proptest_config(ProptestConfig {
        cases: 12,
        rng_seed: proptest::test_runner::RngSeed::Fixed(0x6b65_656c_6361_6e61),
        ..ProptestConfig::default()
    })]

    /// Under identical distributions each test rejects at about its level:
    /// at 0.01 over 400 replicates, 13 or more rejections would have a
    /// chance under 1e-3 for a calibrated test.
    #[test]
    fn identical_distributions_rarely_fail(seed in any::<u64>()) {
        let mut rng = Rng(seed);
        let (mut fisher_rejects, mut mw_rejects) = (0, 0);
        for _ in 0..400 {
            let p = 0.01 + 0.1 * rng.uniform();
            let (n_a, n_b) = (50 + (rng.next() % 200), 500 + (rng.next() % 2000));
            let x_a = (0..n_a).filter(|_| rng.bernoulli(p)).count() as u64;
            let x_b = (0..n_b).filter(|_| rng.bernoulli(p)).count() as u64;
            if fisher_greater(Count::new(x_a, n_a), Count::new(x_b, n_b)).unwrap() < 0.01 {
                fisher_rejects += 1;
            }
            let a: Vec<f64> = (0..40).map(|_| (rng.normal() * 0.5).exp()).collect();
            let b: Vec<f64> = (0..200).map(|_| (rng.normal() * 0.5).exp()).collect();
            if mann_whitney(&a, &b).unwrap().p_greater < 0.01 {
                mw_rejects += 1;
            }
        }
        prop_assert!(fisher_rejects <= 12, "fisher rejected {fisher_rejects} of 400");
        prop_assert!(mw_rejects <= 12, "mann-whitney rejected {mw_rejects} of 400");
    }

    /// 20% empty answers against 1%, and latency 1.5 times slower, are found
    /// in nearly every window of 100 canary requests.
    #[test]
    fn shifted_distributions_are_detected(seed in any::<u64>()) {
        let mut rng = Rng(seed);
        let (mut rate_hits, mut mw_hits) = (0, 0);
        for _ in 0..50 {
            let x_a = (0..100).filter(|_| rng.bernoulli(0.20)).count() as u64;
            let x_b = (0..2000).filter(|_| rng.bernoulli(0.01)).count() as u64;
            if fisher_greater(Count::new(x_a, 100), Count::new(x_b, 2000)).unwrap() < 0.001 {
                rate_hits += 1;
            }
            let a: Vec<f64> = (0..100).map(|_| 1.5 * (rng.normal() * 0.3).exp()).collect();
            let b: Vec<f64> = (0..2000).map(|_| (rng.normal() * 0.3).exp()).collect();
            if mann_whitney(&a, &b).unwrap().p_greater < 0.001 {
                mw_hits += 1;
            }
        }
        prop_assert!(rate_hits >= 48, "{rate_hits} of 50");
        prop_assert!(mw_hits >= 48, "{mw_hits} of 50");
    }
}

mod rollouts {
    use keel_canary::analysis::{FinishReason, Sample, StepPolicy, Thresholds};
    use keel_canary::rollout::{Action, Phase, Plan, Rollout};
    use proptest::prelude::*;

    fn sample(error: bool, chars: u32) -> Sample {
        Sample {
            error,
            latency_ms: Some(100.0),
            completion_tokens: Some(40),
            finish_reason: Some(FinishReason::Stop),
            answer_chars: Some(chars),
            streamed: false,
            stream_aborted: false,
            output_mean: None,
        }
    }

    proptest! {
        /// Whatever the windows hold, the weight only rises step by step
        /// until the rollout ends; an abort leaves 0, a promotion 100, and
        /// an ended rollout does nothing more.
        #[test]
        fn weights_rise_through_the_plan_then_end(
            steps in prop::collection::btree_set(1u32..100, 1..5),
            windows in prop::collection::vec((0usize..300, 0u32..40, 0u32..40), 1..40),
        ) {
            let mut steps: Vec<u32> = steps.into_iter().collect();
            steps.push(100);
            let plan = Plan { steps: steps.clone(), thresholds: Thresholds::default(), policy: StepPolicy { min_canary_samples: 50, max_intervals: 5 } };
            let (mut r, first) = Rollout::start("p", plan).expect("valid plan");
            prop_assert_eq!(first, Action::SetWeight { weight: steps[0] });
            let stable: Vec<Sample> = (0..1000).map(|i| sample(i % 100 == 0, 200)).collect();
            let mut last = steps[0];
            for (n, error_pct, empty_pct) in windows {
                let canary: Vec<Sample> = (0..n)
                    .map(|i| sample((i as u32 * 7) % 100 < error_pct, if (i as u32 * 13) % 100 < empty_pct { 0 } else { 200 }))
                    .collect();
                let before = r.phase;
                let a = r.on_interval(&stable, &canary);
                if before != Phase::Progressing {
                    prop_assert_eq!(a, Action::Continue);
                    continue;
                }
                match a {
                    Action::SetWeight { weight } => {
                        prop_assert!(weight > last && steps.contains(&weight));
                        last = weight;
                    }
                    Action::Abort { reason } => {
                        prop_assert_eq!(r.weight(), 0);
                        prop_assert!(reason.starts_with("rollout p: aborted at"), "{}", reason);
                    }
                    Action::Promote { .. } => prop_assert_eq!(r.weight(), 100),
                    Action::Pause { .. } => prop_assert_eq!(r.phase, Phase::Paused),
                    Action::Continue => prop_assert_eq!(r.weight(), last),
                }
            }
        }
    }
}
