//! Exit codes, documented in README.md ("Exit codes").

use std::process::ExitCode;

use keel_error::ErrorKind;

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

/// The crates whose errors reach the binary, each recognising its own
/// error types and those of the crates it passes errors on from
/// (keel-error's contract): the binary knows their kinds, not their types.
const CLASSIFIERS: &[keel_error::Classifier] = &[
    keel_topo::error_kind,
    keel_check::error_kind,
    keel_bench::error_kind,
    keel_ckpt::error_kind,
    keel_run::error_kind,
    keel_registry::error_kind,
    keel_gateway::error_kind,
    keel_control::error_kind,
    keel_exporter::error_kind,
    keel_tune::error_kind,
];

/// The exit code of an error kind.
pub fn kind_code(k: ErrorKind) -> Code {
    match k {
        ErrorKind::Usage => Code::Usage,
        ErrorKind::Input => Code::Data,
        ErrorKind::Unavailable => Code::Unknown,
        ErrorKind::Io => Code::Io,
        ErrorKind::Permission => Code::NoPerm,
        ErrorKind::Failed => Code::Failed,
        // A kind added later: an I/O error until it has a code of its own.
        _ => Code::Io,
    }
}

/// Maps an error to its exit code by what failed: the first error in its
/// chain that is the binary's own or that a library classifies.
pub fn classify(err: &anyhow::Error) -> Code {
    for e in err.chain() {
        if e.downcast_ref::<UsageError>().is_some() {
            return Code::Usage;
        }
        if e.downcast_ref::<DataError>().is_some() {
            return Code::Data;
        }
        if e.downcast_ref::<PermissionError>().is_some() {
            return Code::NoPerm;
        }
        if let Some(k) = CLASSIFIERS.iter().find_map(|c| c(e)) {
            return kind_code(k);
        }
    }
    Code::Io
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

#[cfg(test)]
mod tests {
    use super::*;

    fn code_of<E: std::error::Error + Send + Sync + 'static>(e: E) -> Code {
        classify(&anyhow::Error::new(e).context("doing something"))
    }

    #[test]
    fn library_errors_map_to_codes_by_their_kind() {
        assert_eq!(code_of(keel_topo::PlanError::NoGpus), Code::Unknown);
        assert_eq!(
            code_of(keel_registry::RegistryError::UnknownModel { name: "m".into() }),
            Code::Usage
        );
        assert_eq!(
            code_of(keel_gpu::GpuError::Unavailable {
                reason: "no driver".into()
            }),
            Code::Unknown
        );
        // An error a crate passes on from the crate under it: the kind of
        // the one under it.
        assert_eq!(
            code_of(keel_ckpt::CkptError::Store(
                keel_store::StoreError::BadUrl {
                    url: "x://".into(),
                    reason: "no such scheme".into()
                }
            )),
            Code::Usage
        );
        // The binary's own, and one nobody classifies.
        assert_eq!(code_of(DataError("not JSON".into())), Code::Data);
        assert_eq!(code_of(std::io::Error::other("disk")), Code::Io);
    }

    #[test]
    fn every_kind_has_its_documented_code() {
        for (k, c) in [
            (ErrorKind::Usage, 64),
            (ErrorKind::Input, 65),
            (ErrorKind::Unavailable, 3),
            (ErrorKind::Io, 74),
            (ErrorKind::Permission, 77),
            (ErrorKind::Failed, 2),
        ] {
            assert_eq!(kind_code(k) as u8, c, "{k:?}");
        }
    }
}
