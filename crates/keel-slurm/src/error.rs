use std::path::PathBuf;
use std::process::ExitStatus;

/// Why a Slurm command gave no usable answer.
#[derive(Debug, thiserror::Error)]
pub enum SlurmError {
    /// The command did not finish in time; it was killed. A hung or
    /// overloaded slurmctld looks like this.
    #[error("`{command}` did not finish within {seconds} s and was killed")]
    Timeout { command: String, seconds: f64 },
    /// The program is not there (Slurm's client commands are not installed,
    /// or the configured binary directory is wrong).
    #[error("{} not found: are Slurm's client commands installed?", program.display())]
    NotInstalled { program: PathBuf },
    /// The program could not be started or waited for.
    #[error("failed to run {}", program.display())]
    Io {
        program: PathBuf,
        #[source]
        source: std::io::Error,
    },
    /// The command ran and failed (controller unreachable, request refused).
    /// `stderr` is the command's standard error, or its standard output when
    /// it wrote its complaint there (`scontrol ping`).
    #[error("`{command}` failed ({status}): {stderr}")]
    Failed {
        command: String,
        status: ExitStatus,
        stderr: String,
    },
    /// The command succeeded but its output is not what this crate reads.
    #[error("unexpected output from `{command}`: {output:?} ({reason})")]
    Parse {
        command: String,
        output: String,
        reason: String,
    },
    /// A job id that is not one (digits, `_` for an array task).
    #[error("invalid Slurm job id {job:?}")]
    BadJob { job: String },
    /// Slurm does not know the node.
    #[error("slurm has no node named {name:?}")]
    NoSuchNode { name: String },
    /// A job's `ExcNodeList` did not read back with every node it was set
    /// to exclude (a site's job_submit plugin may rewrite it).
    #[error("job {job} was requeued but its ExcNodeList does not exclude {}", missing.join(","))]
    NotExcluded { job: String, missing: Vec<String> },
    /// A node name or reason that cannot be passed to scontrol safely.
    #[error("invalid {what} {value:?}: {problem}")]
    Invalid {
        what: &'static str,
        value: String,
        problem: &'static str,
    },
}
