//! Supervision of a training job, as far as it can be decided without
//! running anything: the hang detector (heartbeats against a configured or
//! learned timeout), the per-job failure history kept in a state file, the
//! decision after a failure (which nodes to drain, which to exclude,
//! whether to requeue), goodput accounting across requeues, the
//! supervisor's metrics text, and eviction notices: Azure Scheduled Events
//! (parsing, filtering for this VM, polling an IMDS address and
//! acknowledging), AWS Spot and GCP preemption.
//!
//! Time is always passed in: the detector and the accounting take
//! monotonic offsets ([`std::time::Duration`] since an origin the caller
//! chooses) or wall-clock milliseconds, never reading a clock themselves.
//!
//! Those modules launch nothing and read no clock. [`supervisor`] is the
//! I/O shell around them: it starts the trainer, signals it, runs the
//! pre-flight checks with srun, talks to Slurm, to the checkpoint store
//! and to the metadata services, and feeds what it sees into them; its
//! console and wall clock are given by the caller (the `keel` binary, which
//! turns flags into a [`supervisor::Plan`] and renders the
//! [`supervisor::Conclusion`]).

#![forbid(unsafe_code)]

pub mod budget;
pub mod decide;
pub mod events;
pub mod goodput;
pub mod hang;
pub mod history;
pub mod metrics;
pub mod supervisor;

pub use decide::{decide, placed_on_excluded, Decision, NodeReport, Outcome, RunPolicy, Verdict};
pub use goodput::{account, AttemptTimes, Goodput};
pub use hang::{HangConfig, HangDetector, HangStatus, Phase, Timeout};
pub use history::{Cause, FailureRecord, History, HistoryError, JobHistory};

/// The kind of an error of this crate or of the crates under it whose errors it passes on
/// (keel-error's contract: the binary maps a kind to an exit code).
pub fn error_kind(e: &(dyn std::error::Error + 'static)) -> Option<keel_error::ErrorKind> {
    keel_error::classify!(e; supervisor::SuperviseError, HistoryError; keel_ckpt::error_kind)
}
