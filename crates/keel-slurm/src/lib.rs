//! Slurm for keel: node state and drain reason through `sinfo` and
//! `scontrol`, draining and resuming nodes, Slurm's hostlist syntax, and
//! [`decide`], the pure function that says whether a node should be
//! drained, resumed or left alone given what the health checks concluded.
//!
//! Every command runs as a subprocess with a deadline ([`SlurmConfig`]):
//! a hung slurmctld is a [`SlurmError::Timeout`], never a hung keel. The
//! parsers are pure functions, tolerant of newer Slurm versions' words.
//!
//! This crate does not know what a health check is (a [`Verdict`] comes in
//! as plain data), does not link libslurm, never prints, and reads neither
//! the environment nor the wall clock: the environment Slurm's commands
//! need (`SLURM_CONF`) is passed in, and the only time it reads is the
//! monotonic clock behind command deadlines.

mod client;
mod comment;
mod decide;
mod error;
mod hostlist;
mod node;
mod run;
mod times;

pub use client::{check_name as check_node_name, JobStatus, Slurm, SlurmConfig};
pub use comment::{has_marker, with_marker, RUN_MARKER};
pub use decide::{decide, Action, Policy, Verdict};
pub use error::SlurmError;
pub use hostlist::{expand_hostlist, HostlistError, MAX_HOSTS};
pub use node::{
    parse_scontrol_node, parse_sinfo, parse_state, NodeFlags, NodeInfo, NodeState, ParseError,
};
pub use times::{parse_grace_time, parse_kill_wait, parse_squeue_time};
