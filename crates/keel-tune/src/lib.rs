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
