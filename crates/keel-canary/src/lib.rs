//! Canary analysis and output drift as pure functions over windows of
//! request samples.
//!
//! - [`stats`]: the tests themselves: Fisher's exact two-proportion test
//!   ([`stats::fisher_greater`]), the Mann-Whitney U test with tie
//!   correction ([`stats::mann_whitney`]), the normal tail.
//! - [`analysis`]: one [`analysis::Sample`] per request (status, latency,
//!   completion tokens, finish reason, answer length, stream abort); a
//!   canary window compared with a stable window over the same period,
//!   check by check ([`analysis::analyse`]), each check with a documented
//!   threshold and minimum sample size, the OIP v2 output mean among them;
//!   and the rollout step decision
//!   ([`analysis::decide_step`]): advance, hold, abort or pause.
//! - [`rollout`]: a progressive rollout as a state machine over those
//!   decisions: weight steps, abort, pause, promotion, each action with
//!   its reason and numbers.
//! - [`drift`]: fixed-bin histograms and the Population Stability Index and
//!   Jensen-Shannon divergence between a reference and a current window.
//!
//! This crate does no I/O, keeps no clock and draws no random numbers: the
//! gateway collects the samples, decides when a window ends, and acts on
//! the verdicts (weights, registry aliases, audit log, metrics).

#![forbid(unsafe_code)]

pub mod analysis;
pub mod drift;
pub mod rollout;
pub mod stats;
