//! CUDA for keel: the driver, cuBLAS/cuBLASLt and NCCL, all loaded at run
//! time so that keel builds, tests and runs on machines without CUDA.
//!
//! - [`locate`] finds the libraries: an explicit directory
//!   (`KEEL_CUDA_LIB_DIR`), `LD_LIBRARY_PATH`, the `nvidia/*/lib` folders of
//!   Python installs (virtualenv, conda, `~/.local`, `/usr/local/lib`,
//!   `/usr/lib`), `/usr/local/cuda*/lib64`, then the dynamic loader's own
//!   search path. It is pure: the environment comes in as a [`SearchEnv`].
//! - [`driver`] is the CUDA driver through `cudarc` (devices, primary
//!   contexts, streams, events, device and pinned host memory, copies).
//! - [`blas`] is matrix multiplication through cuBLAS (`cublasGemmEx`) and
//!   cuBLASLt (FP8).
//! - [`nccl`] is NCCL communicators and collectives.
//!
//! A library that is missing, does not load or lacks a function is
//! [`CudaError::Unavailable`] or [`CudaError::MissingSymbol`], never a panic:
//! cudarc's driver loader is only reached after its presence check and a
//! driver version check, and cuBLAS and NCCL are opened by this crate from
//! the exact files found (cudarc's own loader knows neither `libnccl.so.2`
//! nor the Python wheels' folders), with cudarc's type definitions.
//!
//! This is the only keel crate with `unsafe` code; every block says why it
//! is sound. It decides nothing about what a measurement means (that is
//! keel-bench), never prints, and reads no environment variable itself.

pub mod blas;
pub mod driver;
mod load;
pub mod locate;
pub mod nccl;

pub use blas::{BlasLibrary, GemmHandle, GemmType};
pub use driver::{Cuda, Device, DeviceBuffer, DeviceInfo, Event, HostBuffer, Stream};
pub use locate::SearchEnv;
pub use nccl::{Comm, NcclLibrary, NcclOp, NcclType, Span};

/// The lowest driver API version keel's bindings are for (cudarc's
/// `cuda-11080`): 11.8.
pub const MIN_DRIVER_VERSION: i32 = 11080;

/// What went wrong talking to CUDA.
#[derive(Debug, thiserror::Error)]
pub enum CudaError {
    /// A library is not installed, cannot be loaded, or the driver has no
    /// usable GPU: the benchmark cannot run here (exit code 3).
    #[error("{library} is unavailable: {reason}")]
    Unavailable {
        library: &'static str,
        reason: String,
    },
    /// The library loaded but lacks a function keel calls (too old).
    #[error("{library} at {path} lacks the function {symbol}: it is too old or not {library}")]
    MissingSymbol {
        library: &'static str,
        path: String,
        symbol: &'static str,
    },
    /// A CUDA driver call failed.
    #[error("CUDA driver call {call} failed: {name} ({message})")]
    Driver {
        call: &'static str,
        name: String,
        message: String,
    },
    /// A cuBLAS or cuBLASLt call failed.
    #[error("{call} failed with status {status} ({name})")]
    Blas {
        call: &'static str,
        status: i32,
        name: &'static str,
    },
    /// An NCCL call failed.
    #[error("{call} failed: NCCL error {code} ({message})")]
    Nccl {
        call: &'static str,
        code: i32,
        message: String,
    },
    /// A device ordinal the driver does not have.
    #[error("GPU {ordinal} does not exist: the CUDA driver sees {count} GPU(s)")]
    NoSuchDevice { ordinal: usize, count: usize },
    /// The GPU cannot do what was asked (FP8 before compute capability 8.9).
    #[error(
        "{what} is not supported on GPU {ordinal} ({name}, compute capability {major}.{minor})"
    )]
    Unsupported {
        what: String,
        ordinal: usize,
        name: String,
        major: i32,
        minor: i32,
    },
    /// A copy or call would go past the end of a buffer (a bug in the
    /// caller, caught before the GPU sees it).
    #[error("{what}: {needed} bytes needed but the buffer has {len}")]
    OutOfBounds {
        what: &'static str,
        needed: usize,
        len: usize,
    },
}

impl CudaError {
    /// Whether this means "cannot run here" rather than "ran and failed".
    pub fn is_unavailable(&self) -> bool {
        matches!(
            self,
            CudaError::Unavailable { .. } | CudaError::MissingSymbol { .. }
        )
    }
}

pub type Result<T, E = CudaError> = std::result::Result<T, E>;

/// Missing libraries and drivers are unavailable; a GPU that cannot do
/// what was asked, or one that does not exist, is a usage error; a CUDA,
/// cuBLAS or NCCL call failing during the run is a failure.
impl keel_error::HasKind for CudaError {
    fn kind(&self) -> keel_error::ErrorKind {
        use keel_error::ErrorKind as K;
        match self {
            Self::Unavailable { .. } | Self::MissingSymbol { .. } => K::Unavailable,
            Self::NoSuchDevice { .. } | Self::Unsupported { .. } => K::Usage,
            Self::Driver { .. }
            | Self::Blas { .. }
            | Self::Nccl { .. }
            | Self::OutOfBounds { .. } => K::Failed,
        }
    }
}

/// The kind of an error of this crate.
pub fn error_kind(e: &(dyn std::error::Error + 'static)) -> Option<keel_error::ErrorKind> {
    keel_error::classify!(e; CudaError)
}
