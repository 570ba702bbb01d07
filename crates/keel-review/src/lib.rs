//! `keel review` and `keel cost`: reads what a GPU cluster and keel's
//! services actually run (slurm.conf with its includes and gres.conf,
//! keel's gateway and main config files, sbatch scripts, a job's
//! environment), checks it against a catalogue of rules kept as data
//! (`rules.toml`), each tied to a recommendation of the seed documents,
//! and renders the findings (text, JSON, SARIF 2.1.0, Markdown). `cost`
//! prices `sacct` allocation rows with a user's price table.
//!
//! Everything here is pure: parsers take text, evaluation takes parsed
//! inputs. It does not read the live node, run `sacct`, or print; the
//! binary does that.
#![forbid(unsafe_code)]

pub mod catalogue;
pub mod cost;
pub mod eval;
pub mod inputs;
pub mod report;
pub mod slurm;

pub use catalogue::{rules, Pillar, Rule, Severity};
pub use eval::Options;
pub use inputs::{detect, Input, Kind, Source};
pub use report::{markdown, review, Report, ReviewOptions, Suppressions};

use serde::Serialize;

/// Where a finding or a diagnostic is: a file and a 1-based line (1 when
/// the setting is missing from the file).
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize)]
pub struct Location {
    pub file: String,
    pub line: u32,
}

/// What kind of problem reading an input had.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum DiagnosticKind {
    /// The line could not be read as the format's syntax.
    Malformed,
    /// A key the format does not define.
    UnknownKey,
    /// An included file could not be read, or the include is not
    /// supported.
    Include,
    /// The file's kind could not be told from its name or content.
    UnknownInput,
}

/// A problem reading an input: reported beside the findings, never fatal.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Diagnostic {
    pub kind: DiagnosticKind,
    pub location: Location,
    pub message: String,
}

impl Diagnostic {
    pub fn new(kind: DiagnosticKind, location: Location, message: String) -> Self {
        Self {
            kind,
            location,
            message,
        }
    }
}

/// The longest piece of an input repeated in a message.
const CUT_BYTES: usize = 64;

/// `s` cut to [`CUT_BYTES`] on a character boundary, followed by `…` and
/// its length when cut.
pub(crate) fn cut(s: &str) -> String {
    if s.len() <= CUT_BYTES {
        return s.to_owned();
    }
    let mut end = CUT_BYTES;
    while !s.is_char_boundary(end) {
        end -= 1;
    }
    format!("{}… ({} bytes)", &s[..end], s.len())
}

/// Parses every source; problems reading them are diagnostics.
pub fn parse_all(
    sources: &[Source<'_>],
    loader: &dyn slurm::Loader,
) -> (Vec<Input>, Vec<Diagnostic>) {
    let mut diags = Vec::new();
    let inputs = sources
        .iter()
        .filter_map(|s| inputs::parse(*s, loader, &mut diags))
        .collect();
    (inputs, diags)
}
