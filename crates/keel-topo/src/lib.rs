//! Machine topology for keel: CPUs, NUMA nodes, NVIDIA GPUs, InfiniBand
//! HCAs, network interfaces and NVMe drives, read from sysfs and procfs under
//! a root directory; process-pinning plans for srun, mpirun, torchrun and
//! numactl; and verification of running processes against the layout.
//!
//! This crate reads files only. It does not talk to NVML or CUDA (GPU facts
//! that sysfs cannot give are passed in, see [`verify::GpuProcessMap`]),
//! never prints, never reads the process environment or the clock, and
//! changes nothing on the machine.

pub mod error;
pub mod gpu_ids;
pub mod idset;
pub mod machine;
pub mod pci;
pub mod plan;
pub mod procs;
pub mod root;
pub mod snapshot;
pub mod verify;

pub use error::TopoError;
pub use gpu_ids::{GpuId, GpuIdError, GpuIds, IdKind};
pub use idset::{CpuSet, IdSet, NodeSet};
pub use machine::{read_machine, Machine};
pub use pci::{PciAddr, Relation};
pub use plan::{plan, Launcher, Plan, PlanError, PlanRequest};
pub use procs::{read_processes, Process, Selection};
pub use root::Root;
pub use snapshot::{read_host_files, write_snapshot, SnapshotError, SnapshotSummary};
pub use verify::{verify, Scope, Verification};

/// The kind of an error of this crate
/// (keel-error's contract: the binary maps a kind to an exit code).
pub fn error_kind(e: &(dyn std::error::Error + 'static)) -> Option<keel_error::ErrorKind> {
    keel_error::classify!(e; TopoError, SnapshotError, PlanError)
}
