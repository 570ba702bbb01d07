//! Node tuning as plans that can be shown before they are made and undone
//! after: GPU clocks raised for a job and restored exactly after it
//! ([`clocks`]), the NCCL/UCX/MPI environment for a machine ([`env`]), and
//! local NVMe scratch as a RAID0 with XFS ([`scratch`]).
//!
//! This crate computes and records; it talks to the GPUs only through
//! `keel_gpu::clocks::ClockControl` (NVML in production, [`fake`] in
//! tests), and reads the machine through `keel-topo`. It never touches
//! power limits, persistence or compute mode, and it prints nothing: the
//! `keel` binary renders its results.

#![forbid(unsafe_code)]

pub mod clocks;
pub mod env;
pub mod fake;
pub mod scratch;

/// The kind of an error of this crate or of the crates under it whose errors it passes on
/// (keel-error's contract: the binary maps a kind to an exit code).
pub fn error_kind(e: &(dyn std::error::Error + 'static)) -> Option<keel_error::ErrorKind> {
    keel_error::classify!(e; scratch::ScratchError, clocks::ClocksError; keel_gpu::error_kind, keel_topo::error_kind)
}
