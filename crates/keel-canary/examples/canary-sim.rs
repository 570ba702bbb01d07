//! Simulated rollouts for `scripts/bench-canary` (not a test): many
//! rollouts of a canary identical to the stable version, and of canaries
//! degraded in one way each, through the same steps, intervals and
//! analysis the gateway runs ([`keel_canary::analysis`]). Prints a Markdown
//! report: the false-abort rate of identical versions and, per
//! degradation, how often and how soon it was aborted.
//!
//!   cargo run -p keel-canary --example canary-sim -- [--rollouts N]
//!       [--degraded-rollouts N] [--rate REQ_PER_S] [--interval SECS]
//!       [--steps 1,5,25,50] [--seed N]

use keel_canary::analysis::{
    evaluate_step, step_counts, FinishReason, Sample, StepDecision, StepPolicy, Thresholds,
};

/// SplitMix64.
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
    fn chance(&mut self, p: f64) -> bool {
        self.uniform() < p
    }
}

/// A version's behaviour: the stable one is [`Version::BASE`].
#[derive(Debug, Clone, Copy)]
struct Version {
    error_rate: f64,
    empty_rate: f64,
    stream_share: f64,
    stream_abort_rate: f64,
    /// Median completion tokens (log-normal, sigma 0.6).
    median_tokens: f64,
    max_tokens: u32,
    latency_factor: f64,
    /// Scales the whole latency model: 1 for an LLM's (about 1.2 s at the
    /// median), 0.0002 for a backend that answers in a quarter of a
    /// millisecond.
    latency_scale: f64,
}

impl Version {
    const BASE: Version = Version {
        error_rate: 0.005,
        empty_rate: 0.005,
        stream_share: 0.3,
        stream_abort_rate: 0.005,
        median_tokens: 180.0,
        max_tokens: 512,
        latency_factor: 1.0,
        latency_scale: 1.0,
    };

    fn sample(&self, rng: &mut Rng) -> Sample {
        if rng.chance(self.error_rate) {
            return Sample::failed(30.0 * (0.3 * rng.normal()).exp());
        }
        let streamed = rng.chance(self.stream_share);
        let stream_aborted = streamed && rng.chance(self.stream_abort_rate);
        let (tokens, chars, finish) = if rng.chance(self.empty_rate) {
            (1, 0, FinishReason::Stop)
        } else {
            let t = (self.median_tokens * (0.6 * rng.normal()).exp())
                .round()
                .max(1.0);
            if t >= f64::from(self.max_tokens) {
                (self.max_tokens, self.max_tokens * 4, FinishReason::Length)
            } else {
                let t = t as u32;
                (t, t * 4, FinishReason::Stop)
            }
        };
        // Prefill plus decoding time, with noise.
        let latency = (80.0 + 6.0 * f64::from(tokens))
            * self.latency_factor
            * self.latency_scale
            * (0.2 * rng.normal()).exp();
        Sample {
            error: false,
            latency_ms: Some(latency),
            completion_tokens: Some(tokens),
            finish_reason: Some(finish),
            answer_chars: Some(chars),
            streamed,
            stream_aborted,
            output_mean: None,
        }
    }
}

#[derive(Debug, Clone, Copy)]
struct Setup {
    rate: f64,
    interval_s: f64,
    thresholds: Thresholds,
    policy: StepPolicy,
}

#[derive(Debug)]
enum End {
    Promoted,
    Aborted {
        step: usize,
        requests: u64,
        canary_requests: u64,
        seconds: f64,
        checks: Vec<&'static str>,
    },
    Paused,
}

fn rollout(steps: &[f64], stable: &Version, canary: &Version, setup: &Setup, rng: &mut Rng) -> End {
    let per_interval = (setup.rate * setup.interval_s).round() as u64;
    let (mut requests, mut canary_requests, mut intervals_total) = (0u64, 0u64, 0u64);
    let mut earlier = Vec::new();
    for (i, &weight) in steps.iter().enumerate() {
        let (mut stable_w, mut canary_w) = (Vec::new(), Vec::new());
        let mut intervals = 0;
        loop {
            intervals += 1;
            intervals_total += 1;
            for _ in 0..per_interval {
                requests += 1;
                if rng.chance(weight / 100.0) {
                    canary_requests += 1;
                    canary_w.push(canary.sample(rng));
                } else {
                    stable_w.push(stable.sample(rng));
                }
            }
            let (a, decision) = evaluate_step(
                &stable_w,
                &canary_w,
                &earlier,
                &setup.thresholds,
                &setup.policy,
                intervals,
            );
            match decision {
                StepDecision::Advance => {
                    earlier.push(step_counts(&stable_w, &canary_w, &setup.thresholds));
                    break;
                }
                StepDecision::Hold => continue,
                StepDecision::Pause => return End::Paused,
                StepDecision::Abort => {
                    return End::Aborted {
                        step: i,
                        requests,
                        canary_requests,
                        seconds: intervals_total as f64 * setup.interval_s,
                        checks: a.failures().map(|c| c.check.name()).collect(),
                    }
                }
            }
        }
    }
    End::Promoted
}

fn quantile(v: &mut [f64], q: f64) -> f64 {
    v.sort_by(f64::total_cmp);
    if v.is_empty() {
        return f64::NAN;
    }
    v[((v.len() - 1) as f64 * q).round() as usize]
}

/// One-sided 95% upper bound of a proportion (Clopper-Pearson, by bisection
/// on the binomial tail).
fn upper_bound(k: u64, n: u64) -> f64 {
    if k == n {
        return 1.0;
    }
    let cdf = |p: f64| -> f64 {
        // P(X <= k) for Binomial(n, p), summed in log space.
        let mut total = 0.0;
        let mut log_term = (n as f64) * (1.0 - p).ln();
        for x in 0..=k {
            if x > 0 {
                log_term += ((n - x + 1) as f64).ln() - (x as f64).ln() + p.ln() - (1.0 - p).ln();
            }
            total += log_term.exp();
        }
        total
    };
    let (mut lo, mut hi) = (k as f64 / n as f64, 1.0);
    for _ in 0..60 {
        let mid = (lo + hi) / 2.0;
        if cdf(mid) > 0.05 {
            lo = mid;
        } else {
            hi = mid;
        }
    }
    hi
}

fn main() {
    let mut rollouts = 2000u64;
    let mut degraded_rollouts = 200u64;
    let mut rate = 50.0;
    let mut interval_s = 30.0;
    let mut steps = vec![1.0, 5.0, 25.0, 50.0];
    let mut seed = 1u64;
    let mut thresholds = Thresholds::default();
    let mut args = std::env::args().skip(1);
    while let Some(a) = args.next() {
        let v = args.next().unwrap_or_default();
        let bad = |what: &str| -> ! {
            eprintln!("canary-sim: {what} needs a number, got {v:?}");
            std::process::exit(2)
        };
        match a.as_str() {
            "--rollouts" => rollouts = v.parse().unwrap_or_else(|_| bad("--rollouts")),
            "--degraded-rollouts" => {
                degraded_rollouts = v.parse().unwrap_or_else(|_| bad("--degraded-rollouts"))
            }
            "--rate" => rate = v.parse().unwrap_or_else(|_| bad("--rate")),
            "--interval" => interval_s = v.parse().unwrap_or_else(|_| bad("--interval")),
            "--seed" => seed = v.parse().unwrap_or_else(|_| bad("--seed")),
            "--latency-min-increase-ms" => {
                thresholds.latency_min_increase_ms = v
                    .parse()
                    .unwrap_or_else(|_| bad("--latency-min-increase-ms"))
            }
            "--steps" => {
                steps = v
                    .split(',')
                    .map(|s| s.trim().parse().unwrap_or_else(|_| bad("--steps")))
                    .collect()
            }
            _ => {
                eprintln!("canary-sim: unknown argument {a}");
                std::process::exit(2)
            }
        }
    }
    let setup = Setup {
        rate,
        interval_s,
        thresholds,
        policy: StepPolicy::default(),
    };
    let b = Version::BASE;
    // A backend answering in about 0.24 ms at the median (a cache, a
    // small model on a fast machine), as in the false abort of issue 45.
    let fast = Version {
        latency_scale: 0.24 / 1160.0,
        ..b
    };
    let cases: Vec<(&str, Version, Version)> = vec![
        ("fast backend, identical (0.24 ms)", fast, fast),
        (
            "fast backend, canary x1.22 (+0.05 ms)",
            fast,
            Version {
                latency_factor: 1.22,
                ..fast
            },
        ),
        ("identical", b, b),
        (
            "empty answers 20%",
            b,
            Version {
                empty_rate: 0.20,
                ..b
            },
        ),
        (
            "empty answers 5%",
            b,
            Version {
                empty_rate: 0.05,
                ..b
            },
        ),
        (
            "5xx 5% (stable 0.5%)",
            b,
            Version {
                error_rate: 0.05,
                ..b
            },
        ),
        (
            "slower x1.5",
            b,
            Version {
                latency_factor: 1.5,
                ..b
            },
        ),
        (
            "slower x1.1 (under the 1.2 threshold)",
            b,
            Version {
                latency_factor: 1.1,
                ..b
            },
        ),
        (
            "completions x1.5 longer",
            b,
            Version {
                median_tokens: 270.0,
                ..b
            },
        ),
        (
            "completions x0.6 shorter",
            b,
            Version {
                median_tokens: 108.0,
                ..b
            },
        ),
        (
            "more `length` finishes (max_tokens 300)",
            b,
            Version {
                max_tokens: 300,
                ..b
            },
        ),
        (
            "stream aborts 5%",
            b,
            Version {
                stream_abort_rate: 0.05,
                ..b
            },
        ),
    ];
    println!(
        "Setup: {rate} requests/s, interval {interval_s} s, steps {steps:?} % then promotion at 100 %, \
         seed {seed}; thresholds and step policy: the defaults of keel_canary::analysis \
         (alpha {}, interim alpha {} before a step has its samples, latency fails only {} ms or more above stable's median, a step advances with >= {} canary requests and no failed check, pauses after {} intervals).\n",
        setup.thresholds.alpha, setup.thresholds.interim_alpha, setup.thresholds.latency_min_increase_ms, setup.policy.min_canary_samples, setup.policy.max_intervals
    );
    println!("| canary | rollouts | aborted | 95% upper bound | paused | abort step (median) | delay, requests (median / p90) | delay, canary requests (median / p90) | delay, s (median / p90) | checks that fired |");
    println!("|---|---|---|---|---|---|---|---|---|---|");
    let mut rng = Rng(seed);
    for (name, stable, v) in cases {
        let n = if name == "identical" || name.starts_with("fast backend") {
            rollouts
        } else {
            degraded_rollouts
        };
        let (mut aborted, mut paused) = (0u64, 0u64);
        let (mut req, mut creq, mut secs, mut stepv) = (vec![], vec![], vec![], vec![]);
        let mut fired: std::collections::BTreeMap<&str, u64> = Default::default();
        for _ in 0..n {
            match rollout(&steps, &stable, &v, &setup, &mut rng) {
                End::Promoted => {}
                End::Paused => paused += 1,
                End::Aborted {
                    step,
                    requests,
                    canary_requests,
                    seconds,
                    checks,
                } => {
                    aborted += 1;
                    req.push(requests as f64);
                    creq.push(canary_requests as f64);
                    secs.push(seconds);
                    stepv.push(steps[step]);
                    for c in checks {
                        *fired.entry(c).or_default() += 1;
                    }
                }
            }
        }
        let pair = |v: &mut Vec<f64>| {
            if v.is_empty() {
                "-".to_owned()
            } else {
                format!("{:.0} / {:.0}", quantile(v, 0.5), quantile(v, 0.9))
            }
        };
        let step = if stepv.is_empty() {
            "-".to_owned()
        } else {
            format!("{}%", quantile(&mut stepv, 0.5))
        };
        let fired = fired
            .iter()
            .map(|(c, k)| format!("{c} ({k})"))
            .collect::<Vec<_>>()
            .join(", ");
        println!(
            "| {name} | {n} | {aborted} ({:.2}%) | {:.2}% | {paused} | {step} | {} | {} | {} | {} |",
            100.0 * aborted as f64 / n as f64,
            100.0 * upper_bound(aborted, n),
            pair(&mut req),
            pair(&mut creq),
            pair(&mut secs),
            if fired.is_empty() { "-".to_owned() } else { fired },
        );
    }
}
