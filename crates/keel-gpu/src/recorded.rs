//! Snapshots recorded on real machines (`keel check record --out FILE`),
//! replayed by fixtures and tests.

use std::path::{Path, PathBuf};

use crate::{GpuError, GpuProbe, GpuSnapshot, SNAPSHOT_VERSION};

/// A probe that returns a snapshot read from a JSON file.
#[derive(Debug, Clone)]
pub struct RecordedProbe {
    path: PathBuf,
}

impl RecordedProbe {
    pub fn new(path: impl Into<PathBuf>) -> Self {
        Self { path: path.into() }
    }
}

impl GpuProbe for RecordedProbe {
    fn snapshot(&self) -> Result<GpuSnapshot, GpuError> {
        load(&self.path)
    }
}

/// Reads and validates a snapshot file.
pub fn load(path: &Path) -> Result<GpuSnapshot, GpuError> {
    let text = std::fs::read_to_string(path).map_err(|source| GpuError::Read {
        path: path.to_path_buf(),
        source,
    })?;
    parse(path, &text)
}

/// Parses snapshot JSON; `path` only names the source in errors.
pub fn parse(path: &Path, text: &str) -> Result<GpuSnapshot, GpuError> {
    let snap: GpuSnapshot = serde_json::from_str(text).map_err(|e| GpuError::Format {
        path: path.to_path_buf(),
        message: e.to_string(),
    })?;
    if snap.version != SNAPSHOT_VERSION {
        return Err(GpuError::Format {
            path: path.to_path_buf(),
            message: format!(
                "version {} is not supported (expected {SNAPSHOT_VERSION})",
                snap.version
            ),
        });
    }
    Ok(snap)
}

/// Writes a snapshot as pretty JSON.
pub fn to_json(snap: &GpuSnapshot) -> String {
    let mut s = serde_json::to_string_pretty(snap).unwrap_or_default();
    s.push('\n');
    s
}
