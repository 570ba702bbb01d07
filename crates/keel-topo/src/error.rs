use std::io;
use std::path::PathBuf;

/// Why the machine could not be read.
#[derive(Debug, thiserror::Error)]
pub enum TopoError {
    #[error("failed to read {path}")]
    Read {
        path: PathBuf,
        #[source]
        source: io::Error,
    },
    #[error("{path} is missing; is the root a Linux machine (sysfs and procfs)?")]
    Missing { path: PathBuf },
    #[error("unexpected content in {path}: {content:?} ({reason})")]
    Parse {
        path: PathBuf,
        content: String,
        reason: String,
    },
    #[error("{path} resolves to {target}, outside the machine root")]
    OutsideRoot { path: PathBuf, target: PathBuf },
    #[error("no process {pid} under {path}")]
    NoSuchProcess { pid: u32, path: PathBuf },
}

impl TopoError {
    pub(crate) fn parse(path: PathBuf, content: &str, reason: impl ToString) -> Self {
        Self::Parse {
            path,
            content: content.trim_end().to_owned(),
            reason: reason.to_string(),
        }
    }
}

impl keel_error::HasKind for TopoError {
    fn kind(&self) -> keel_error::ErrorKind {
        use keel_error::ErrorKind as K;
        match self {
            Self::Read { .. } => K::Io,
            Self::Missing { .. } | Self::Parse { .. } | Self::OutsideRoot { .. } => K::Input,
            Self::NoSuchProcess { .. } => K::Usage,
        }
    }
}
