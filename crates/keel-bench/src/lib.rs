//! GPU benchmarks for keel: what each measurement means and how it is
//! taken.
//!
//! - [`copy`]: host-to-device and device-to-host with pinned host memory on
//!   the GPU's own NUMA node (the measuring thread pinned there first),
//!   device-to-device (HBM), and GPU-to-GPU peer copies; CUDA events,
//!   warm-up, median and spread.
//! - [`gemm`]: cuBLAS products on random inputs, TFLOPS and the fraction of
//!   the datasheet peak ([`peaks`]), a correctness check against a
//!   float64 CPU reference on a small problem, and every repetition of the
//!   large problem compared with the first (silent data corruption);
//!   optionally for a duration (burn test).
//! - [`nccl`]: collectives with nccl-tests semantics: the size sweep
//!   ([`sweep`]), per-collective counts and bandwidth formulas
//!   ([`collective`]), data checks, and the nccl-tests table
//!   ([`table`]); one process driving all local GPUs, or one rank per
//!   process with the NCCL id passed over TCP ([`rendezvous`], rank and
//!   size from Slurm: [`launch`]).
//!
//! The GPU work goes through keel-cuda; everything else here is pure and
//! tested without a GPU. This crate never prints, exits or reads the
//! process environment (Slurm's variables are passed in), times with an
//! injected [`Monotonic`] clock, and does not judge node health or drain
//! anything: it returns typed results.

#![forbid(unsafe_code)]

pub mod affinity;
pub mod collective;
pub mod copy;
pub mod data;
pub mod gemm;
pub mod launch;
pub mod nccl;
pub mod peaks;
pub mod rendezvous;
pub mod size;
pub mod stats;
pub mod sweep;
pub mod table;

pub use keel_cuda::CudaError;

/// Why a benchmark could not run.
#[derive(Debug, thiserror::Error)]
pub enum BenchError {
    /// CUDA, cuBLAS or NCCL is missing or failed.
    #[error(transparent)]
    Cuda(#[from] CudaError),
    /// The request cannot be carried out as asked (bad sizes, a GPU that
    /// does not exist, an operation the data type cannot do).
    #[error("{0}")]
    Invalid(String),
    /// The ranks could not find each other.
    #[error(transparent)]
    Rendezvous(#[from] rendezvous::RendezvousError),
    /// The measuring thread could not be pinned to the GPU's CPUs.
    #[error("cannot pin the benchmark thread to CPUs {cpus}")]
    Affinity {
        cpus: String,
        #[source]
        source: std::io::Error,
    },
    /// A benchmark thread died (a bug).
    #[error("the benchmark thread for GPU {gpu} panicked")]
    Panicked { gpu: usize },
}

/// Where time comes from (monotonic), so tests and callers choose.
pub use keel_time::{Monotonic, SystemClock};

impl keel_error::HasKind for BenchError {
    fn kind(&self) -> keel_error::ErrorKind {
        use keel_error::ErrorKind as K;
        use rendezvous::RendezvousError as R;
        match self {
            Self::Cuda(c) => keel_error::HasKind::kind(c),
            Self::Invalid(_) => K::Usage,
            // The other ranks never came (or rank 0 never answered): the
            // benchmark could not run.
            Self::Rendezvous(R::Timeout { .. }) => K::Unavailable,
            Self::Rendezvous(R::Protocol { .. } | R::Resolve { .. }) => K::Usage,
            Self::Rendezvous(R::Bind { .. } | R::Io { .. }) => K::Io,
            Self::Affinity { .. } => K::Io,
            Self::Panicked { .. } => K::Failed,
        }
    }
}

/// The kind of an error of this crate, or of the CUDA calls under it.
pub fn error_kind(e: &(dyn std::error::Error + 'static)) -> Option<keel_error::ErrorKind> {
    keel_error::classify!(e; BenchError; keel_cuda::error_kind)
}
