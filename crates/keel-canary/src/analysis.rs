//! Canary against stable over the same window, check by check, and the
//! decision a rollout step takes from it.
//!
//! Every check compares the canary's window with the stable version's
//! window over the same period and fails only when both hold:
//!
//! - the difference is significant: one-sided p-value below
//!   [`Thresholds::alpha`] (default 0.001; the checks of a rollout make some
//!   thirty such comparisons, so 0.001 keeps the chance of a false abort of
//!   a healthy canary near 1% before the effect sizes below make it
//!   smaller still);
//! - the difference matters: larger than the check's effect threshold.
//!
//! A check with fewer samples than its minimum in either window is
//! inconclusive, which is not a failure: the step holds and the windows
//! keep growing. No step advances (and no rollout promotes) unless at
//! least one check passed: an analysis with every check inconclusive is
//! no evidence ([`decide_step`]).
//!
//! The rate checks (`error_rate`, `length_finish`, `empty_answer`,
//! `stream_abort`) of a step after the first also count the canary's
//! requests of the steps before it, each step a stratum compared with the
//! stable requests of that step ([`analyse_after`]: the exact stratified
//! test, the Mantel-Haenszel difference as the effect, the minimum sample
//! sizes on all the steps' requests). A rate only a little higher (stream
//! aborts from 0.5% to 5%, where only streamed requests count) is then
//! seen over several steps instead of being inconclusive in each; the
//! stratification keeps a rate that changes over time in both versions
//! from passing for a difference between them.
//!
//! A step is analysed at the end of every interval, so a held step is
//! looked at several times. Looks before the step has its
//! [`StepPolicy::min_canary_samples`] use the stricter
//! [`Thresholds::interim_alpha`] (default 0.0001; a Haybittle-Peto
//! boundary): a grossly broken canary is still stopped at once, while the
//! repeated looks at small windows add little to the chance of a false
//! abort ([`evaluate_step`]).
//!
//! | check | samples | test | fails when (defaults) |
//! |---|---|---|---|
//! | `error_rate` | every request; event: 5xx or no answer | Fisher exact (stratified by step after the first), canary higher | increase >= 0.02, n >= 50 |
//! | `latency` | answered requests, ms | Mann-Whitney, canary slower | median ratio >= 1.2 and median increase >= 5 ms, n >= 30 |
//! | `completion_tokens` | answers with a usage count | Mann-Whitney, either way | mean ratio >= 1.25 or <= 1/1.25, n >= 30 |
//! | `length_finish` | answers with a finish reason; event: `length` | Fisher exact, canary higher | increase >= 0.05, n >= 50 |
//! | `empty_answer` | answers with text; event: fewer than 3 non-space characters | Fisher exact, canary higher | increase >= 0.02, n >= 50 |
//! | `stream_abort` | streamed requests; event: the stream ended without its end marker | Fisher exact, canary higher | increase >= 0.02, n >= 50 |
//! | `output_mean` | OIP v2 answers: the mean of the first output tensor's numeric values | Mann-Whitney, either way | A >= 0.64 or <= 0.36, n >= 30 |
//!
//! `latency` pairs its relative threshold with an absolute one, as
//! Kayenta's judge pairs `allowedIncrease` with a tolerance: with a fast
//! backend a large window makes a difference of a few microseconds
//! significant and its ratio large (0.29 ms against 0.24 ms is 1.23
//! times), yet nobody is served worse. The canary's median must also
//! exceed the stable one by [`Thresholds::latency_min_increase_ms`]
//! (5 ms by default) to fail.
//!
//! `output_mean` is for models whose outputs are numbers, where a ratio
//! means nothing (values near 0, of either sign): its effect size is the
//! probability of superiority A = U / (n_canary n_stable), the chance that
//! a canary answer's value exceeds a stable one's (ties count half); 0.5
//! is no shift, and 0.64 or 0.36 is what Vargha and Delaney call a medium
//! effect (about 0.5 standard deviations between two normal
//! distributions). The compared statistics shown are the windows' medians.

use serde::{Deserialize, Serialize};

use crate::stats::{self, Count};

/// How a request ended, as the gateway saw it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FinishReason {
    /// `stop`, `end_turn`, `tool_calls` and the like: the model ended the
    /// answer.
    Stop,
    /// `length`, `max_tokens`: the answer was cut at the token limit.
    Length,
    /// Anything else (`content_filter`, unknown values).
    Other,
}

impl FinishReason {
    /// Maps an OpenAI or Anthropic finish reason.
    pub fn parse(s: &str) -> Self {
        match s {
            "length" | "max_tokens" => FinishReason::Length,
            "stop" | "end_turn" | "tool_calls" | "tool_use" | "function_call" | "stop_sequence" => {
                FinishReason::Stop
            }
            _ => FinishReason::Other,
        }
    }
}

/// One request to a version. Fields the gateway could not read are
/// `None` and leave the request out of the checks that need them.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Sample {
    /// A 5xx answer or no answer at all (connect error, timeout).
    pub error: bool,
    /// Time to the last byte of the answer, in milliseconds.
    pub latency_ms: Option<f64>,
    /// `usage.completion_tokens` of the answer.
    pub completion_tokens: Option<u32>,
    /// The first choice's finish reason.
    pub finish_reason: Option<FinishReason>,
    /// Non-whitespace characters of the first choice's text.
    pub answer_chars: Option<u32>,
    /// Whether the request asked for a stream.
    pub streamed: bool,
    /// A streamed answer that ended without its end marker.
    pub stream_aborted: bool,
    /// OIP v2: the mean of the first output tensor's numeric values (the
    /// gateway reads a bounded number of them).
    pub output_mean: Option<f64>,
}

impl Sample {
    /// A request that failed (5xx or no answer) after `latency_ms`.
    pub fn failed(latency_ms: f64) -> Self {
        Sample {
            error: true,
            latency_ms: Some(latency_ms),
            completion_tokens: None,
            finish_reason: None,
            answer_chars: None,
            streamed: false,
            stream_aborted: false,
            output_mean: None,
        }
    }
}

/// A check's minimum sample size and effect threshold for a rate.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct RateThreshold {
    /// Fewer samples than this in either window: inconclusive.
    pub min_samples: u64,
    /// The canary's rate must exceed the stable rate by at least this much
    /// (absolute, 0.02 = two percentage points) to fail.
    pub min_increase: f64,
}

/// A check's minimum sample size and effect threshold for a ratio.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct RatioThreshold {
    /// Fewer samples than this in either window: inconclusive.
    pub min_samples: u64,
    /// The canary's statistic over the stable one must reach this ratio
    /// (and for two-sided checks, or its inverse) to fail.
    pub max_ratio: f64,
}

/// A check's minimum sample size and effect threshold for a shift of a
/// distribution either way, as the probability of superiority.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct SuperiorityThreshold {
    /// Fewer samples than this in either window: inconclusive.
    pub min_samples: u64,
    /// A = P(canary > stable) + P(equal) / 2 must reach this, or fall to
    /// `1 - max_superiority`, to fail (0.5 < max_superiority < 1).
    pub max_superiority: f64,
}

/// Thresholds of every check; [`Thresholds::default`] holds the documented
/// defaults.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct Thresholds {
    /// One-sided significance level of every test.
    pub alpha: f64,
    /// The level of looks at a step that does not have its samples yet.
    pub interim_alpha: f64,
    pub error_rate: RateThreshold,
    /// Median latency ratio.
    pub latency: RatioThreshold,
    /// The least increase of the median latency, in milliseconds, that
    /// fails the latency check whatever its ratio: an absolute floor under
    /// the relative threshold.
    pub latency_min_increase_ms: f64,
    /// Mean completion tokens ratio, either way.
    pub completion_tokens: RatioThreshold,
    pub length_finish: RateThreshold,
    pub empty_answer: RateThreshold,
    /// Answers with fewer non-whitespace characters than this count as
    /// empty or very short.
    pub short_answer_chars: u32,
    pub stream_abort: RateThreshold,
    /// OIP v2 output values, either way.
    pub output_mean: SuperiorityThreshold,
}

impl Default for Thresholds {
    fn default() -> Self {
        Thresholds {
            alpha: 0.001,
            interim_alpha: 0.0001,
            error_rate: RateThreshold {
                min_samples: 50,
                min_increase: 0.02,
            },
            latency: RatioThreshold {
                min_samples: 30,
                max_ratio: 1.2,
            },
            latency_min_increase_ms: 5.0,
            completion_tokens: RatioThreshold {
                min_samples: 30,
                max_ratio: 1.25,
            },
            length_finish: RateThreshold {
                min_samples: 50,
                min_increase: 0.05,
            },
            empty_answer: RateThreshold {
                min_samples: 50,
                min_increase: 0.02,
            },
            short_answer_chars: 3,
            stream_abort: RateThreshold {
                min_samples: 50,
                min_increase: 0.02,
            },
            output_mean: SuperiorityThreshold {
                min_samples: 30,
                max_superiority: 0.64,
            },
        }
    }
}

impl Thresholds {
    /// The largest of the checks' minimum sample sizes: a step with fewer
    /// canary requests cannot have every check that sees its requests
    /// decide, so a [`StepPolicy::min_canary_samples`] below it would let
    /// a step advance on checks that could not judge (50 by default).
    pub fn largest_min_samples(&self) -> u64 {
        [
            self.error_rate.min_samples,
            self.latency.min_samples,
            self.completion_tokens.min_samples,
            self.length_finish.min_samples,
            self.empty_answer.min_samples,
            self.stream_abort.min_samples,
            self.output_mean.min_samples,
        ]
        .into_iter()
        .max()
        .unwrap_or(1)
    }
}

/// The checks, in the order [`analyse`] reports them.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Check {
    ErrorRate,
    Latency,
    CompletionTokens,
    LengthFinish,
    EmptyAnswer,
    StreamAbort,
    OutputMean,
}

impl Check {
    pub const ALL: [Check; 7] = [
        Check::ErrorRate,
        Check::Latency,
        Check::CompletionTokens,
        Check::LengthFinish,
        Check::EmptyAnswer,
        Check::StreamAbort,
        Check::OutputMean,
    ];

    pub fn name(self) -> &'static str {
        match self {
            Check::ErrorRate => "error_rate",
            Check::Latency => "latency",
            Check::CompletionTokens => "completion_tokens",
            Check::LengthFinish => "length_finish",
            Check::EmptyAnswer => "empty_answer",
            Check::StreamAbort => "stream_abort",
            Check::OutputMean => "output_mean",
        }
    }
}

impl std::fmt::Display for Check {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Outcome {
    Pass,
    Fail,
    /// Too few samples in a window to judge.
    Inconclusive,
}

/// One check's result with its numbers.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct CheckResult {
    pub check: Check,
    pub outcome: Outcome,
    pub stable_n: u64,
    pub canary_n: u64,
    /// The compared statistic: a rate, the median latency in ms or the
    /// mean completion tokens. `None` without samples.
    pub stable_value: Option<f64>,
    pub canary_value: Option<f64>,
    /// The test's p-value (for two-sided checks the smaller one-sided
    /// one); `None` when inconclusive.
    pub p_value: Option<f64>,
    /// The effect threshold the difference was held against: the minimum
    /// increase of a rate or the ratio.
    pub threshold: f64,
    /// An absolute floor held against the difference of the statistics as
    /// well (`latency`: the least increase in milliseconds); `None` for
    /// the checks that have none.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub min_increase: Option<f64>,
    pub alpha: f64,
}

impl std::fmt::Display for CheckResult {
    /// `empty_answer fail: canary 0.2000 (n=100) vs stable 0.0053 (n=1500), p=1.2e-30 < 0.001, threshold 0.02`
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let outcome = match self.outcome {
            Outcome::Pass => "pass",
            Outcome::Fail => "fail",
            Outcome::Inconclusive => "inconclusive",
        };
        let v = |v: Option<f64>| v.map_or_else(|| "unknown".to_owned(), |v| format!("{v:.4}"));
        write!(
            f,
            "{} {outcome}: canary {} (n={}) vs stable {} (n={})",
            self.check,
            v(self.canary_value),
            self.canary_n,
            v(self.stable_value),
            self.stable_n
        )?;
        if let Some(p) = self.p_value {
            write!(f, ", p={p:.2e} (alpha {})", self.alpha)?;
        }
        write!(f, ", threshold {}", self.threshold)?;
        if let Some(m) = self.min_increase {
            write!(f, " and +{m}")?;
        }
        Ok(())
    }
}

/// The checks of one window.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Analysis {
    pub checks: Vec<CheckResult>,
}

impl Analysis {
    /// The failed checks.
    pub fn failures(&self) -> impl Iterator<Item = &CheckResult> {
        self.checks.iter().filter(|c| c.outcome == Outcome::Fail)
    }

    pub fn failed(&self) -> bool {
        self.failures().next().is_some()
    }

    /// Whether at least one check passed: an analysis whose every check
    /// was inconclusive is no evidence, and no step advances on it.
    pub fn decided(&self) -> bool {
        self.checks.iter().any(|c| c.outcome == Outcome::Pass)
    }
}

/// The rate checks' counts of one window pair, `[stable, canary]` each:
/// what a finished step leaves for the steps after it
/// ([`analyse_after`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
pub struct StepCounts {
    pub error_rate: [Count; 2],
    pub length_finish: [Count; 2],
    pub empty_answer: [Count; 2],
    pub stream_abort: [Count; 2],
}

fn is_error(s: &Sample) -> Option<bool> {
    Some(s.error)
}

fn is_length(s: &Sample) -> Option<bool> {
    s.finish_reason.map(|r| r == FinishReason::Length)
}

fn is_aborted(s: &Sample) -> Option<bool> {
    s.streamed.then_some(s.stream_aborted)
}

/// The counts of a step's windows.
pub fn step_counts(stable: &[Sample], canary: &[Sample], t: &Thresholds) -> StepCounts {
    let short = t.short_answer_chars;
    let empty = |s: &Sample| s.answer_chars.map(|c| c < short);
    StepCounts {
        error_rate: [count(stable, is_error), count(canary, is_error)],
        length_finish: [count(stable, is_length), count(canary, is_length)],
        empty_answer: [count(stable, empty), count(canary, empty)],
        stream_abort: [count(stable, is_aborted), count(canary, is_aborted)],
    }
}

/// Compares the canary's window with the stable window of the same
/// period, every check of [`Check::ALL`].
pub fn analyse(stable: &[Sample], canary: &[Sample], t: &Thresholds) -> Analysis {
    analyse_after(stable, canary, &[], t)
}

/// [`analyse`] of a step that follows the finished steps `earlier`: the
/// rate checks (`error_rate`, `length_finish`, `empty_answer`,
/// `stream_abort`) test the canary on all its requests since the rollout
/// started, stratified by step (each step one stratum, compared with the
/// stable requests of the same step: [`stats::stratified_exact_greater`]),
/// their effect being the Mantel-Haenszel risk difference, and the rates
/// and counts they show being those of all the steps together. A rate
/// that stays a little higher needs the requests of several steps to be
/// seen (stream aborts: only the streamed requests count); with no
/// earlier step this is [`analyse`]. The other checks compare the
/// current step's windows only (latency and answer lengths shift with
/// the load, which each step changes).
pub fn analyse_after(
    stable: &[Sample],
    canary: &[Sample],
    earlier: &[StepCounts],
    t: &Thresholds,
) -> Analysis {
    let short = t.short_answer_chars;
    let strata = |pick: fn(&StepCounts) -> [Count; 2]| -> Vec<[Count; 2]> {
        earlier.iter().map(pick).collect()
    };
    let checks = vec![
        rate_check(
            Check::ErrorRate,
            stable,
            canary,
            &strata(|c| c.error_rate),
            is_error,
            t.error_rate,
            t.alpha,
        ),
        shift_check(
            Check::Latency,
            stable,
            canary,
            |s| (!s.error).then_some(s.latency_ms).flatten(),
            Shift::Greater(Stat::Median),
            t.latency,
            Some(t.latency_min_increase_ms),
            t.alpha,
        ),
        shift_check(
            Check::CompletionTokens,
            stable,
            canary,
            |s| s.completion_tokens.map(f64::from),
            Shift::Either(Stat::Mean),
            t.completion_tokens,
            None,
            t.alpha,
        ),
        rate_check(
            Check::LengthFinish,
            stable,
            canary,
            &strata(|c| c.length_finish),
            is_length,
            t.length_finish,
            t.alpha,
        ),
        rate_check(
            Check::EmptyAnswer,
            stable,
            canary,
            &strata(|c| c.empty_answer),
            |s| s.answer_chars.map(|c| c < short),
            t.empty_answer,
            t.alpha,
        ),
        rate_check(
            Check::StreamAbort,
            stable,
            canary,
            &strata(|c| c.stream_abort),
            is_aborted,
            t.stream_abort,
            t.alpha,
        ),
        superiority_check(
            Check::OutputMean,
            stable,
            canary,
            |s| s.output_mean,
            t.output_mean,
            t.alpha,
        ),
    ];
    Analysis { checks }
}

fn count(samples: &[Sample], event: impl Fn(&Sample) -> Option<bool>) -> Count {
    samples
        .iter()
        .filter_map(&event)
        .fold(Count::default(), |c, e| Count {
            events: c.events + u64::from(e),
            trials: c.trials + 1,
        })
}

#[allow(clippy::too_many_arguments)]
fn rate_check(
    check: Check,
    stable: &[Sample],
    canary: &[Sample],
    earlier: &[[Count; 2]],
    event: impl Fn(&Sample) -> Option<bool>,
    th: RateThreshold,
    alpha: f64,
) -> CheckResult {
    let now = [count(stable, &event), count(canary, &event)];
    let all: Vec<[Count; 2]> = earlier.iter().copied().chain([now]).collect();
    let sum = |i: usize| {
        all.iter().fold(Count::default(), |acc, x| Count {
            events: acc.events + x[i].events,
            trials: acc.trials + x[i].trials,
        })
    };
    let (s, c) = (sum(0), sum(1));
    let mut r = CheckResult {
        check,
        outcome: Outcome::Inconclusive,
        stable_n: s.trials,
        canary_n: c.trials,
        stable_value: s.rate(),
        canary_value: c.rate(),
        p_value: None,
        threshold: th.min_increase,
        min_increase: None,
        alpha,
    };
    if s.trials < th.min_samples.max(1) || c.trials < th.min_samples.max(1) {
        return r;
    }
    let (p, increase) = if earlier.is_empty() {
        (
            stats::fisher_greater(c, s),
            c.rate().unwrap_or(0.0) - s.rate().unwrap_or(0.0),
        )
    } else {
        let strata: Vec<(Count, Count)> = all.iter().map(|x| (x[1], x[0])).collect();
        (
            stats::stratified_exact_greater(&strata),
            mh_difference(&all),
        )
    };
    r.p_value = p;
    r.outcome = match p {
        Some(p) if p < alpha && increase >= th.min_increase => Outcome::Fail,
        Some(_) => Outcome::Pass,
        None => Outcome::Inconclusive,
    };
    r
}

/// The Mantel-Haenszel estimate of the canary's rate minus the stable
/// rate over strata `[stable, canary]`: each stratum's difference weighted
/// by n_stable n_canary / (n_stable + n_canary). 0 without information.
fn mh_difference(strata: &[[Count; 2]]) -> f64 {
    let (mut num, mut den) = (0.0, 0.0);
    for [s, c] in strata {
        let (n0, n1) = (s.trials as f64, c.trials as f64);
        if n0 == 0.0 || n1 == 0.0 {
            continue;
        }
        let n = n0 + n1;
        num += (c.events as f64 * n0 - s.events as f64 * n1) / n;
        den += n0 * n1 / n;
    }
    if den > 0.0 {
        num / den
    } else {
        0.0
    }
}

#[derive(Debug, Clone, Copy)]
enum Stat {
    Median,
    Mean,
}

#[derive(Debug, Clone, Copy)]
enum Shift {
    /// Only a canary with larger values fails.
    Greater(Stat),
    /// A canary with larger or smaller values fails.
    Either(Stat),
}

#[allow(clippy::too_many_arguments)]
fn shift_check(
    check: Check,
    stable: &[Sample],
    canary: &[Sample],
    value: impl Fn(&Sample) -> Option<f64>,
    shift: Shift,
    th: RatioThreshold,
    min_increase: Option<f64>,
    alpha: f64,
) -> CheckResult {
    let s: Vec<f64> = stable
        .iter()
        .filter_map(&value)
        .filter(|v| v.is_finite())
        .collect();
    let c: Vec<f64> = canary
        .iter()
        .filter_map(&value)
        .filter(|v| v.is_finite())
        .collect();
    let stat = match shift {
        Shift::Greater(st) | Shift::Either(st) => st,
    };
    let mut r = CheckResult {
        check,
        outcome: Outcome::Inconclusive,
        stable_n: s.len() as u64,
        canary_n: c.len() as u64,
        stable_value: statistic(&s, stat),
        canary_value: statistic(&c, stat),
        p_value: None,
        threshold: th.max_ratio,
        min_increase,
        alpha,
    };
    let min = th.min_samples.max(1) as usize;
    if s.len() < min || c.len() < min {
        return r;
    }
    let Some(mw) = stats::mann_whitney(&c, &s) else {
        return r;
    };
    let (sv, cv) = (r.stable_value.unwrap_or(0.0), r.canary_value.unwrap_or(0.0));
    // A ratio against a zero statistic: any positive canary value is an
    // unbounded increase, zero against zero none.
    let ratio = if sv > 0.0 {
        cv / sv
    } else if cv > 0.0 {
        f64::INFINITY
    } else {
        1.0
    };
    // The absolute floor: a canary slower by less than this passes
    // whatever the ratio and the p-value say.
    let above_floor = min_increase.is_none_or(|m| cv - sv >= m);
    let (p, fails) = match shift {
        Shift::Greater(_) => (mw.p_greater, ratio >= th.max_ratio && above_floor),
        Shift::Either(_) => {
            // Two one-sided tests at alpha / 2 each.
            let up = mw.p_greater < alpha / 2.0 && ratio >= th.max_ratio;
            let down = mw.p_less < alpha / 2.0 && ratio <= 1.0 / th.max_ratio;
            let p = (mw.p_greater.min(mw.p_less) * 2.0).min(1.0);
            (p, up || down)
        }
    };
    r.p_value = Some(p);
    r.outcome = if p < alpha && fails {
        Outcome::Fail
    } else {
        Outcome::Pass
    };
    r
}

/// A shift of the canary's values either way, judged by the probability
/// of superiority (two one-sided Mann-Whitney tests at `alpha / 2` each).
fn superiority_check(
    check: Check,
    stable: &[Sample],
    canary: &[Sample],
    value: impl Fn(&Sample) -> Option<f64>,
    th: SuperiorityThreshold,
    alpha: f64,
) -> CheckResult {
    let finite = |w: &[Sample]| -> Vec<f64> {
        w.iter()
            .filter_map(&value)
            .filter(|v| v.is_finite())
            .collect()
    };
    let (s, c) = (finite(stable), finite(canary));
    let mut r = CheckResult {
        check,
        outcome: Outcome::Inconclusive,
        stable_n: s.len() as u64,
        canary_n: c.len() as u64,
        stable_value: statistic(&s, Stat::Median),
        canary_value: statistic(&c, Stat::Median),
        p_value: None,
        threshold: th.max_superiority,
        min_increase: None,
        alpha,
    };
    let min = th.min_samples.max(1) as usize;
    if s.len() < min || c.len() < min {
        return r;
    }
    let Some(mw) = stats::mann_whitney(&c, &s) else {
        return r;
    };
    let a = mw.u / (mw.n_a as f64 * mw.n_b as f64);
    let up = mw.p_greater < alpha / 2.0 && a >= th.max_superiority;
    let down = mw.p_less < alpha / 2.0 && a <= 1.0 - th.max_superiority;
    let p = (mw.p_greater.min(mw.p_less) * 2.0).min(1.0);
    r.p_value = Some(p);
    r.outcome = if up || down {
        Outcome::Fail
    } else {
        Outcome::Pass
    };
    r
}

fn statistic(v: &[f64], stat: Stat) -> Option<f64> {
    if v.is_empty() {
        return None;
    }
    Some(match stat {
        Stat::Mean => v.iter().sum::<f64>() / v.len() as f64,
        Stat::Median => {
            let mut s = v.to_vec();
            s.sort_by(f64::total_cmp);
            let m = s.len() / 2;
            if s.len() % 2 == 1 {
                s[m]
            } else {
                (s[m - 1] + s[m]) / 2.0
            }
        }
    })
}

/// When a step may move on.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct StepPolicy {
    /// Canary requests a step needs (in addition to no failed check) to
    /// advance. Default 100.
    pub min_canary_samples: u64,
    /// Intervals a step may be held for lack of samples before the rollout
    /// pauses for a person to decide. Default 20.
    pub max_intervals: u32,
}

impl Default for StepPolicy {
    fn default() -> Self {
        StepPolicy {
            min_canary_samples: 100,
            max_intervals: 20,
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum StepDecision {
    /// No check failed, at least one passed, and the step has its
    /// samples: next weight.
    Advance,
    /// No check failed but the canary has too few requests, or no check
    /// could decide (every one inconclusive): keep the weight for another
    /// interval, the windows growing.
    Hold,
    /// A check failed: canary weight 0, canary alias rolled back.
    Abort,
    /// Still too few requests, or no check that could decide, after
    /// `max_intervals`: neither promote nor roll back (no traffic, and no
    /// check that could judge it, is no evidence either way).
    Pause,
}

/// Analyses a step at the end of one of its intervals and decides:
/// [`analyse_after`] the finished steps `earlier` at
/// [`Thresholds::interim_alpha`] while the step's canary window has fewer
/// than `policy.min_canary_samples` requests, at [`Thresholds::alpha`]
/// from then on, then [`decide_step`].
pub fn evaluate_step(
    stable: &[Sample],
    canary: &[Sample],
    earlier: &[StepCounts],
    t: &Thresholds,
    policy: &StepPolicy,
    intervals: u32,
) -> (Analysis, StepDecision) {
    let mut t = *t;
    if (canary.len() as u64) < policy.min_canary_samples {
        t.alpha = t.interim_alpha.min(t.alpha);
    }
    let a = analyse_after(stable, canary, earlier, &t);
    let d = decide_step(&a, canary.len() as u64, intervals, policy);
    (a, d)
}

/// The decision at the end of an interval of a step: `canary_requests` is
/// the step's canary window, `intervals` how many intervals the step has
/// run, counting this one.
pub fn decide_step(
    analysis: &Analysis,
    canary_requests: u64,
    intervals: u32,
    policy: &StepPolicy,
) -> StepDecision {
    if analysis.failed() {
        return StepDecision::Abort;
    }
    if canary_requests >= policy.min_canary_samples && analysis.decided() {
        StepDecision::Advance
    } else if intervals >= policy.max_intervals {
        StepDecision::Pause
    } else {
        StepDecision::Hold
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ok(latency_ms: f64, tokens: u32, chars: u32) -> Sample {
        Sample {
            error: false,
            latency_ms: Some(latency_ms),
            completion_tokens: Some(tokens),
            finish_reason: Some(FinishReason::Stop),
            answer_chars: Some(chars),
            streamed: false,
            stream_aborted: false,
            output_mean: None,
        }
    }

    fn outcome(a: &Analysis, check: Check) -> CheckResult {
        *a.checks.iter().find(|c| c.check == check).unwrap()
    }

    /// Latencies spread around `median` ms (about +-10%), `n` of them.
    fn fast(n: usize, median: f64) -> Vec<Sample> {
        (0..n)
            .map(|i| ok(median * (0.9 + 0.2 * (i as f64 + 0.5) / n as f64), 5, 20))
            .collect()
    }

    #[test]
    fn a_sub_millisecond_latency_difference_never_fails() {
        // The windows of the aborted healthy canary of issue 45: canary
        // 0.2896 ms (n=864) against stable 0.2362 ms (n=3506), a ratio of
        // 1.23 that large windows make significant.
        let t = Thresholds::default();
        let (stable, canary) = (fast(3506, 0.2362), fast(864, 0.2896));
        let c = outcome(&analyse(&stable, &canary, &t), Check::Latency);
        assert!(c.p_value.expect("p") < 1e-6, "{c}");
        assert!(
            c.canary_value.expect("canary") / c.stable_value.expect("stable") > 1.2,
            "{c}"
        );
        assert_eq!(c.outcome, Outcome::Pass, "{c}");
        assert!(c.to_string().ends_with("threshold 1.2 and +5"), "{c}");
        // A floor of 0 is the relative threshold alone: the same windows fail.
        let rel = Thresholds {
            latency_min_increase_ms: 0.0,
            ..t
        };
        let c = outcome(&analyse(&stable, &canary, &rel), Check::Latency);
        assert_eq!(c.outcome, Outcome::Fail, "{c}");
        // A slowdown above the floor still fails: 100 ms to 150 ms.
        let c = outcome(
            &analyse(&fast(500, 100.0), &fast(200, 150.0), &t),
            Check::Latency,
        );
        assert_eq!(c.outcome, Outcome::Fail, "{c}");
        // And one above the ratio but under the floor does not: 4 ms to 8 ms.
        let c = outcome(
            &analyse(&fast(500, 4.0), &fast(200, 8.0), &t),
            Check::Latency,
        );
        assert_eq!(c.outcome, Outcome::Pass, "{c}");
    }

    proptest::proptest! {
        /// Whatever the windows, a canary whose median latency is less than
        /// a millisecond above the stable one's never fails the check.
        #[test]
        fn sub_millisecond_differences_never_fail(
            base in 0.01f64..2000.0,
            diff in 0.0f64..0.999,
            spread in 0.0f64..0.5,
            ns in 30usize..3000,
            nc in 30usize..3000,
        ) {
            let win = |n: usize, m: f64| -> Vec<Sample> {
                (0..n)
                    .map(|i| ok(m * (1.0 - spread + 2.0 * spread * (i as f64 + 0.5) / n as f64), 5, 20))
                    .collect()
            };
            let c = outcome(
                &analyse(&win(ns, base), &win(nc, base + diff), &Thresholds::default()),
                Check::Latency,
            );
            proptest::prop_assert_ne!(c.outcome, Outcome::Fail, "{}", c);
        }
    }

    #[test]
    fn too_few_samples_is_inconclusive_not_failure() {
        let stable: Vec<_> = (0..1000)
            .map(|i| ok(100.0 + (i % 7) as f64, 50, 200))
            .collect();
        let canary = vec![ok(100.0, 50, 0); 20];
        let a = analyse(&stable, &canary, &Thresholds::default());
        let e = outcome(&a, Check::EmptyAnswer);
        assert_eq!(e.outcome, Outcome::Inconclusive);
        assert_eq!(e.canary_value, Some(1.0));
        assert!(!a.failed());
        assert_eq!(
            decide_step(&a, 20, 1, &StepPolicy::default()),
            StepDecision::Hold
        );
        assert_eq!(
            decide_step(&a, 20, 20, &StepPolicy::default()),
            StepDecision::Pause
        );
    }

    #[test]
    fn empty_answers_fail_with_their_numbers() {
        let stable: Vec<_> = (0..1000)
            .map(|i| ok(100.0 + (i % 7) as f64, 50, 200))
            .collect();
        let canary: Vec<_> = (0..100)
            .map(|i| ok(100.0 + (i % 7) as f64, 50, if i % 5 == 0 { 0 } else { 200 }))
            .collect();
        let a = analyse(&stable, &canary, &Thresholds::default());
        let failed: Vec<_> = a.failures().map(|c| c.check).collect();
        assert_eq!(failed, vec![Check::EmptyAnswer]);
        let e = outcome(&a, Check::EmptyAnswer);
        assert_eq!(e.canary_value, Some(0.2));
        assert_eq!(e.stable_value, Some(0.0));
        let text = e.to_string();
        assert!(
            text.starts_with(
                "empty_answer fail: canary 0.2000 (n=100) vs stable 0.0000 (n=1000), p="
            ),
            "{text}"
        );
        assert_eq!(
            decide_step(&a, 100, 1, &StepPolicy::default()),
            StepDecision::Abort
        );
    }

    #[test]
    fn interim_looks_are_stricter() {
        // 4 errors in 60 canary requests against 0.5% of 3000: p about
        // 4e-4, enough at 0.001 but not at the interim 0.0001.
        let mut stable = vec![ok(100.0, 50, 200); 3000];
        for s in stable.iter_mut().take(15) {
            *s = Sample::failed(5.0);
        }
        let mut canary = vec![ok(100.0, 50, 200); 60];
        for s in canary.iter_mut().take(4) {
            *s = Sample::failed(5.0);
        }
        let t = Thresholds::default();
        let p = outcome(&analyse(&stable, &canary, &t), Check::ErrorRate)
            .p_value
            .unwrap();
        assert!(p > t.interim_alpha && p < t.alpha, "{p}");
        let policy = StepPolicy::default();
        let (a, d) = evaluate_step(&stable, &canary, &[], &t, &policy, 1);
        assert_eq!(d, StepDecision::Hold);
        assert_eq!(outcome(&a, Check::ErrorRate).alpha, t.interim_alpha);
        // With the step's samples, the same rate fails.
        let mut canary = vec![ok(100.0, 50, 200); 120];
        for s in canary.iter_mut().take(8) {
            *s = Sample::failed(5.0);
        }
        assert_eq!(
            evaluate_step(&stable, &canary, &[], &t, &policy, 2).1,
            StepDecision::Abort
        );
    }

    #[test]
    fn a_significant_but_small_difference_passes() {
        // 1% more errors on 20 000 requests is significant but under the
        // 2-point threshold.
        let mut stable = vec![ok(100.0, 50, 200); 20_000];
        let mut canary = vec![ok(100.0, 50, 200); 20_000];
        for s in stable.iter_mut().take(100) {
            *s = Sample::failed(5.0);
        }
        for s in canary.iter_mut().take(300) {
            *s = Sample::failed(5.0);
        }
        let a = analyse(&stable, &canary, &Thresholds::default());
        let e = outcome(&a, Check::ErrorRate);
        assert!(e.p_value.unwrap() < 1e-6);
        assert_eq!(e.outcome, Outcome::Pass);
    }

    #[test]
    fn shorter_completions_fail_the_two_sided_check() {
        let stable: Vec<_> = (0..500).map(|i| ok(100.0, 100 + (i % 50), 200)).collect();
        let canary: Vec<_> = (0..200).map(|i| ok(100.0, 40 + (i % 50), 200)).collect();
        let a = analyse(&stable, &canary, &Thresholds::default());
        assert_eq!(outcome(&a, Check::CompletionTokens).outcome, Outcome::Fail);
        assert_eq!(outcome(&a, Check::Latency).outcome, Outcome::Pass);
    }

    fn streamed(aborted: bool) -> Sample {
        Sample {
            streamed: true,
            stream_aborted: aborted,
            ..ok(100.0, 50, 200)
        }
    }

    /// `n` streamed requests, every `every`-th one aborted.
    fn streams(n: usize, every: usize) -> Vec<Sample> {
        (0..n).map(|i| streamed(i % every == every - 1)).collect()
    }

    #[test]
    fn rate_checks_add_up_the_evidence_of_earlier_steps() {
        let t = Thresholds::default();
        // One step: 5 aborted streams in 100 against 2 in 400 is not
        // enough at alpha 0.001.
        let (stable, canary) = (streams(400, 200), streams(100, 20));
        let one = outcome(&analyse(&stable, &canary, &t), Check::StreamAbort);
        assert_eq!(one.outcome, Outcome::Pass, "{one}");
        // The same rate over three steps: the canary's 300 streams
        // together are.
        let step = step_counts(&stable, &canary, &t);
        assert_eq!(step.stream_abort, [Count::new(2, 400), Count::new(5, 100)]);
        let three = analyse_after(&stable, &canary, &[step, step], &t);
        let c = outcome(&three, Check::StreamAbort);
        assert_eq!(c.outcome, Outcome::Fail, "{c}");
        assert_eq!((c.canary_n, c.stable_n), (300, 1200));
        assert!(c.p_value.unwrap() < one.p_value.unwrap() / 100.0, "{c}");
        // Earlier steps as healthy as the stable version dilute a rate
        // that is high only now: the increase (Mantel-Haenszel) is under
        // the threshold.
        let healthy = step_counts(&stable, &streams(100, 200), &t);
        let diluted = analyse_after(&stable, &canary, &[healthy; 6], &t);
        assert_eq!(outcome(&diluted, Check::StreamAbort).outcome, Outcome::Pass);
        // With no earlier step, analyse_after is analyse.
        assert_eq!(
            analyse_after(&stable, &canary, &[], &t),
            analyse(&stable, &canary, &t)
        );
        // The stable group is compared step by step: a stable rate that
        // rose in the last step does not make the canary's steady rate
        // look low, nor an earlier low stable rate make it look high.
        let early = step_counts(&streams(400, 400), &streams(100, 20), &t);
        let late = analyse_after(&streams(400, 20), &streams(100, 20), &[early], &t);
        assert!(
            outcome(&late, Check::StreamAbort).p_value.unwrap() > 0.001,
            "{late:?}"
        );
    }

    /// An OIP answer: no text, no tokens; its output's mean.
    fn oip(mean: f64) -> Sample {
        Sample {
            error: false,
            latency_ms: Some(10.0),
            completion_tokens: None,
            finish_reason: None,
            answer_chars: None,
            streamed: false,
            stream_aborted: false,
            output_mean: Some(mean),
        }
    }

    #[test]
    fn shifted_oip_outputs_fail_either_way_and_identical_ones_pass() {
        // Values around 0 of either sign, where a ratio would mean
        // nothing: stable uniform on -0.5..0.5.
        let spread = |i: usize, n: usize| (i as f64 + 0.5) / n as f64 - 0.5;
        let stable: Vec<_> = (0..400).map(|i| oip(spread(i, 400))).collect();
        let t = Thresholds::default();
        for shift in [0.4, -0.4] {
            let canary: Vec<_> = (0..100).map(|i| oip(spread(i, 100) + shift)).collect();
            let a = analyse(&stable, &canary, &t);
            let c = outcome(&a, Check::OutputMean);
            assert_eq!(c.outcome, Outcome::Fail, "{shift}: {c}");
            assert_eq!(a.failures().count(), 1, "{a:?}");
            assert!(c.p_value.unwrap() < 1e-6, "{c}");
            assert_eq!(c.threshold, 0.64);
            assert!(
                c.to_string().starts_with("output_mean fail: canary "),
                "{c}"
            );
        }
        // The same values: pass; a small shift (A about 0.57),
        // significant on large windows, is under the threshold: pass.
        let same: Vec<_> = (0..100).map(|i| oip(spread(i, 100))).collect();
        assert_eq!(
            outcome(&analyse(&stable, &same, &t), Check::OutputMean).outcome,
            Outcome::Pass
        );
        let big: Vec<_> = (0..20_000).map(|i| oip(spread(i, 20_000))).collect();
        let small: Vec<_> = (0..20_000).map(|i| oip(spread(i, 20_000) + 0.07)).collect();
        let c = outcome(&analyse(&big, &small, &t), Check::OutputMean);
        assert!(c.p_value.unwrap() < 1e-6, "{c}");
        assert_eq!(c.outcome, Outcome::Pass, "{c}");
        // Constant outputs, equal: no evidence either way; moved: a fail.
        let ones = vec![oip(1.0); 100];
        let c = outcome(&analyse(&ones, &ones, &t), Check::OutputMean);
        assert_eq!((c.outcome, c.p_value), (Outcome::Pass, Some(1.0)));
        let twos = vec![oip(2.0); 40];
        let c = outcome(&analyse(&ones, &twos, &t), Check::OutputMean);
        assert_eq!(c.outcome, Outcome::Fail, "{c}");
        // Too few answers, or answers without outputs (OpenAI): inconclusive.
        let c = outcome(
            &analyse(&stable, &vec![oip(9.0); 29], &t),
            Check::OutputMean,
        );
        assert_eq!(c.outcome, Outcome::Inconclusive);
        let chat = vec![ok(100.0, 50, 200); 200];
        let c = outcome(&analyse(&chat, &chat, &t), Check::OutputMean);
        assert_eq!((c.outcome, c.stable_n), (Outcome::Inconclusive, 0));
    }

    #[test]
    fn finish_reasons_parse() {
        assert_eq!(FinishReason::parse("length"), FinishReason::Length);
        assert_eq!(FinishReason::parse("max_tokens"), FinishReason::Length);
        assert_eq!(FinishReason::parse("stop"), FinishReason::Stop);
        assert_eq!(FinishReason::parse("content_filter"), FinishReason::Other);
    }
}
