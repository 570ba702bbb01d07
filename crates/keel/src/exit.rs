//! Exit codes, documented in README.md ("Exit codes").

use std::process::ExitCode;

use keel_topo::{PlanError, SnapshotError, TopoError};

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Code {
    /// Success; no problem found.
    Ok = 0,
    /// Warnings found.
    Warning = 1,
    /// Problems (failures) found.
    Failed = 2,
    /// Could not tell: something needed is unavailable (no GPU, nothing to
    /// inspect, a tool or library missing).
    Unknown = 3,
    /// Bad command line or impossible request.
    Usage = 64,
    /// Input data (sysfs, procfs, a file given) is malformed.
    Data = 65,
    /// Reading or writing a file (or object storage) failed.
    Io = 74,
    /// Object storage, or the registry, refused the credentials.
    NoPerm = 77,
    /// `keel run`: the job should be requeued (preempted, or a failure
    /// that another attempt may get past). EX_TEMPFAIL.
    Requeue = 75,
    /// `keel run`: do not requeue (the start-up retry budget is spent).
    Stop = 93,
}

impl From<Code> for ExitCode {
    fn from(c: Code) -> Self {
        ExitCode::from(c as u8)
    }
}

/// Whether the error is stdout closing under us (`keel ... | head`), which
/// is not a failure.
pub fn is_broken_pipe(err: &anyhow::Error) -> bool {
    err.chain().any(|e| {
        e.downcast_ref::<std::io::Error>()
            .is_some_and(|io| io.kind() == std::io::ErrorKind::BrokenPipe)
    })
}

/// Maps an error to its exit code by what failed.
pub fn classify(err: &anyhow::Error) -> Code {
    for e in err.chain() {
        if let Some(t) = e.downcast_ref::<TopoError>() {
            return topo_code(t);
        }
        if let Some(s) = e.downcast_ref::<SnapshotError>() {
            return match s {
                SnapshotError::Read(t) => topo_code(t),
                SnapshotError::NotEmpty { .. } => Code::Usage,
                SnapshotError::Write { .. } => Code::Io,
            };
        }
        if let Some(p) = e.downcast_ref::<PlanError>() {
            return match p {
                PlanError::NoGpus | PlanError::GpuWithoutNode { .. } => Code::Unknown,
                _ => Code::Usage,
            };
        }
        if e.downcast_ref::<UsageError>().is_some() {
            return Code::Usage;
        }
        if let Some(s) = e.downcast_ref::<keel_run::supervisor::SuperviseError>() {
            use keel_run::supervisor::SuperviseError as S;
            match s {
                S::Usage(_) => return Code::Usage,
                S::State(h) => return history_code(h),
                S::Ckpt(c) | S::Checkpoints { source: c, .. } => return ckpt_code(c),
                S::Io { .. } | S::Signal(_) => return Code::Io,
            }
        }
        if e.downcast_ref::<DataError>().is_some() {
            return Code::Data;
        }
        if e.downcast_ref::<PermissionError>().is_some() {
            return Code::NoPerm;
        }
        if let Some(r) = e.downcast_ref::<keel_gateway::rollout::RolloutError>() {
            use keel_gateway::rollout::RolloutError as R;
            return match r {
                R::StateCorrupt { .. } => Code::Data,
                R::StateLocked { .. } => Code::Usage,
                R::StateRead(_) | R::NotRecorded { .. } => Code::Io,
                R::WriteRefused { .. } => Code::NoPerm,
                _ => Code::Usage,
            };
        }
        if let Some(p) = e.downcast_ref::<keel_check::profile::ProfileError>() {
            return match p {
                keel_check::profile::ProfileError::Read { .. } => Code::Io,
                _ => Code::Usage,
            };
        }
        if let Some(b) = e.downcast_ref::<keel_bench::BenchError>() {
            return bench_code(b);
        }
        if let Some(c) = e.downcast_ref::<keel_cuda::CudaError>() {
            return cuda_code(c);
        }
        if let Some(h) = e.downcast_ref::<keel_run::HistoryError>() {
            return history_code(h);
        }
        if let Some(c) = e.downcast_ref::<keel_ckpt::CkptError>() {
            return ckpt_code(c);
        }
        if let Some(s) = e.downcast_ref::<keel_store::StoreError>() {
            return store_code(s);
        }
        if let Some(c) = e.downcast_ref::<keel_exporter::cost::CostError>() {
            use keel_exporter::cost::CostError as C;
            return match c {
                C::Url { .. } => Code::Usage,
                C::Format { .. } => Code::Data,
                C::Connect { .. } | C::Timeout { .. } | C::Status { .. } => Code::Unknown,
            };
        }
        if let Some(g) = e.downcast_ref::<keel_gateway::GatewayError>() {
            use keel_gateway::GatewayError as G;
            return match g {
                G::Read { .. } | G::Write { .. } => Code::Io,
                G::Config(_) | G::NoSuchKey { .. } => Code::Usage,
                G::Malformed { .. } => Code::Data,
                G::Jwks { .. } | G::Redis { .. } => Code::Unknown,
            };
        }
        if let Some(f) = e.downcast_ref::<keel_gateway::registry_follow::FollowError>() {
            use keel_gateway::registry_follow::FollowError as F;
            use keel_gateway::registry_source::RegistrySourceError as R;
            return match f {
                F::KeyFile { .. } => Code::Io,
                F::Source {
                    source: R::Unauthorized { .. },
                    ..
                } => Code::NoPerm,
                F::Source {
                    source: R::Unreachable { .. } | R::Timeout { .. } | R::Status { .. },
                    ..
                } => Code::Unknown,
                _ => Code::Usage,
            };
        }
        if let Some(b) = e.downcast_ref::<keel_gateway::drift_baseline::BaselineError>() {
            use keel_gateway::drift_baseline::BaselineError as B;
            return match b {
                B::Read { .. } => Code::Io,
                B::Parse { .. } | B::Invalid { .. } => Code::Data,
            };
        }
        if let Some(r) = e.downcast_ref::<keel_registry::RegistryError>() {
            return registry_code(r);
        }
        if let Some(s) = e.downcast_ref::<keel_registry::sign::SignError>() {
            return sign_code(s);
        }
        if let Some(a) = e.downcast_ref::<keel_registry::artifacts::ArtifactError>() {
            use keel_registry::artifacts::ArtifactError as A;
            return match a {
                A::Store(s) => store_code(s),
                A::Corrupt { .. } => Code::Failed,
                A::Manifest { .. } => Code::Data,
                A::NoManifest { .. }
                | A::VersionExists { .. }
                | A::Claimed { .. }
                | A::Empty { .. }
                | A::Symlink { .. }
                | A::BadName { .. }
                | A::TargetNotEmpty { .. } => Code::Usage,
                A::ReadDir { source, .. } if source.kind() == std::io::ErrorKind::NotFound => {
                    Code::Usage
                }
                A::ReadDir { .. } | A::Write { .. } => Code::Io,
            };
        }
        if let Some(s) = e.downcast_ref::<keel_tune::scratch::ScratchError>() {
            if let keel_tune::scratch::ScratchError::Topo(t) = s {
                return topo_code(t);
            }
            return crate::scratch::code(s);
        }
        if let Some(t) = e.downcast_ref::<keel_tune::clocks::ClocksError>() {
            use keel_tune::clocks::ClocksError as T;
            return match t {
                T::List(c) if c.is_unknown() => Code::Unknown,
                T::List(_) => Code::Failed,
                T::Fs(_) => Code::Io,
                T::State { .. } => Code::Data,
                T::GpuIds(_) => Code::Usage,
            };
        }
        if let Some(g) = e.downcast_ref::<keel_gpu::GpuError>() {
            return match g {
                keel_gpu::GpuError::Unavailable { .. }
                | keel_gpu::GpuError::Timeout { .. }
                | keel_gpu::GpuError::Nvml { .. } => Code::Unknown,
                keel_gpu::GpuError::Read { .. } => Code::Io,
                keel_gpu::GpuError::Format { .. } => Code::Data,
            };
        }
    }
    Code::Io
}

fn bench_code(b: &keel_bench::BenchError) -> Code {
    use keel_bench::rendezvous::RendezvousError as R;
    use keel_bench::BenchError as B;
    match b {
        B::Cuda(c) => cuda_code(c),
        B::Invalid(_) => Code::Usage,
        // The other ranks never came (or rank 0 never answered): the
        // benchmark could not run.
        B::Rendezvous(R::Timeout { .. }) => Code::Unknown,
        B::Rendezvous(R::Protocol { .. } | R::Resolve { .. }) => Code::Usage,
        B::Rendezvous(R::Bind { .. } | R::Io { .. }) => Code::Io,
        B::Affinity { .. } => Code::Io,
        B::Panicked { .. } => Code::Failed,
    }
}

/// Missing libraries and drivers are "unavailable" (3); a GPU that cannot
/// do what was asked, or a GPU that does not exist, is a usage error; a
/// CUDA, cuBLAS or NCCL call failing during the run is a failure (2).
fn cuda_code(c: &keel_cuda::CudaError) -> Code {
    use keel_cuda::CudaError as C;
    match c {
        C::Unavailable { .. } | C::MissingSymbol { .. } => Code::Unknown,
        C::NoSuchDevice { .. } | C::Unsupported { .. } => Code::Usage,
        C::Driver { .. } | C::Blas { .. } | C::Nccl { .. } | C::OutOfBounds { .. } => Code::Failed,
    }
}

fn topo_code(t: &TopoError) -> Code {
    match t {
        TopoError::Read { .. } => Code::Io,
        TopoError::Missing { .. } | TopoError::Parse { .. } | TopoError::OutsideRoot { .. } => {
            Code::Data
        }
        TopoError::NoSuchProcess { .. } => Code::Usage,
    }
}

fn history_code(h: &keel_run::HistoryError) -> Code {
    use keel_run::HistoryError as H;
    match h {
        H::Fs(_) => Code::Io,
        H::Corrupt { .. } | H::Version { .. } | H::Encode(_) => Code::Data,
    }
}

fn ckpt_code(c: &keel_ckpt::CkptError) -> Code {
    use keel_ckpt::CkptError as E;
    match c {
        E::Store(s) => store_code(s),
        E::BadRun { .. }
        | E::BadWriter { .. }
        | E::NotADirectory { .. }
        | E::NotAFile { .. }
        | E::SymlinkedDir { .. }
        | E::BadFileName { .. }
        | E::EmptyCheckpoint { .. }
        | E::TargetNotEmpty { .. }
        | E::NotPinned { .. } => Code::Usage,
        E::LocalDir { source, .. } if source.kind() == std::io::ErrorKind::NotFound => Code::Usage,
        E::LocalDir { .. } | E::LocalWrite { .. } | E::Contended { .. } => Code::Io,
        E::Manifest { .. } | E::Record { .. } => Code::Data,
        E::Fenced { .. } | E::Conflict { .. } | E::Integrity { .. } | E::AllFailed { .. } => {
            Code::Failed
        }
        E::NoCheckpoint { .. } | E::NoSuchStep { .. } | E::DeletedWhilePinning { .. } => {
            Code::Unknown
        }
    }
}

fn registry_code(r: &keel_registry::RegistryError) -> Code {
    use keel_registry::RegistryError as E;
    match r {
        E::Open { .. } | E::Connect { .. } | E::Db { .. } | E::Io { .. } => Code::Io,
        E::SchemaTooNew { .. } | E::BadBackup { .. } | E::Unverified { .. } => Code::Data,
        E::Store(s) => store_code(s),
        E::Migrate { .. } => Code::Failed,
        E::Unsupported { .. } => Code::Usage,
        E::Invalid { .. }
        | E::UnknownModel { .. }
        | E::ModelExists { .. }
        | E::UnknownVersion { .. }
        | E::UnknownAlias { .. }
        | E::WrongStatus { .. }
        | E::NothingToRollBack { .. }
        | E::ModelHasVersions { .. }
        | E::VersionsAreKept { .. }
        | E::NoRename { .. }
        | E::KeyExists { .. }
        | E::UnknownKey { .. }
        | E::NotEmpty { .. } => Code::Usage,
    }
}

fn sign_code(s: &keel_registry::sign::SignError) -> Code {
    use keel_registry::sign::SignError as E;
    match s {
        E::Read { .. } => Code::Io,
        E::BadKey { .. }
        | E::WrongKeyType { .. }
        | E::BadBundle { .. }
        | E::BadStatement { .. } => Code::Data,
        E::Unsupported { .. } => Code::Unknown,
        E::WrongKey { .. } | E::BadSignature | E::Mismatch { .. } | E::Symlink { .. } => {
            Code::Failed
        }
    }
}

fn store_code(s: &keel_store::StoreError) -> Code {
    use keel_store::{BackendErrorKind as K, StoreError as E};
    match s {
        E::BadUrl { .. } | E::BadBandwidth { .. } | E::BadKey { .. } | E::Open { .. } => {
            Code::Usage
        }
        E::Backend { kind, .. } => match kind {
            K::Unauthenticated | K::PermissionDenied => Code::NoPerm,
            _ => Code::Io,
        },
        E::DigestMismatch { .. } | E::SizeMismatch { .. } => Code::Failed,
        E::LocalRead { .. } | E::LocalWrite { .. } | E::Changed { .. } | E::Task { .. } => Code::Io,
    }
}

/// A request that cannot be carried out as asked.
#[derive(Debug)]
pub struct UsageError(pub String);

impl std::fmt::Display for UsageError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for UsageError {}

/// A service refused the credentials keel acts with (the registry
/// refused a gateway's write key).
#[derive(Debug)]
pub struct PermissionError(pub String);

impl std::fmt::Display for PermissionError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for PermissionError {}

/// Input that is not what it should be (a report that is not JSON).
#[derive(Debug)]
pub struct DataError(pub String);

impl std::fmt::Display for DataError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for DataError {}
