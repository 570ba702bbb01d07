//! slurm.conf and gres.conf, parsed the way Slurm reads them: `#` starts a
//! comment unless escaped, a trailing `\` continues a line, keys are
//! case-insensitive, `Include FILE` reads FILE (relative to the including
//! file's directory, `%c` the lower-cased ClusterName), and a line is
//! `Key=Value` pairs separated by white space, values in double quotes
//! when they hold spaces. `NodeName`, `PartitionName`, `NodeSet` and
//! `DownNodes` lines are records of their own.
//!
//! Nothing here fails: a line that is not `Key=Value`, a key Slurm does not
//! know, an include that cannot be read are [`Diagnostic`]s with the file
//! and line, and parsing goes on.

use std::path::{Path, PathBuf};

use crate::{Diagnostic, DiagnosticKind, Location};

/// The parameter names Slurm's `read_config.c` accepts in slurm.conf
/// (SchedMD/slurm 284c3b9, 26.11), one a line.
const SLURM_KEYS: &str = include_str!("../slurm-keys.txt");

/// Keys of gres.conf lines.
const GRES_KEYS: &[&str] = &[
    "AutoDetect",
    "Count",
    "Cores",
    "File",
    "Flags",
    "Links",
    "MultipleFiles",
    "Name",
    "NodeName",
    "Type",
];

/// How deep `Include` may nest before it is reported as a loop.
const MAX_INCLUDE_DEPTH: usize = 8;

/// One `Key=Value` as written, with where it was.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Entry {
    /// The key as spelled in the file.
    pub key: String,
    pub value: String,
    pub location: Location,
}

/// Which kind of record line.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RecordKind {
    Node,
    Partition,
    NodeSet,
    DownNodes,
}

/// A `NodeName=...`, `PartitionName=...`, `NodeSet=...` or
/// `DownNodes=...` line: its name and the other pairs on it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Record {
    pub kind: RecordKind,
    pub name: String,
    pub fields: Vec<Entry>,
    pub location: Location,
}

impl Record {
    /// A field by name, case-insensitively.
    pub fn get(&self, key: &str) -> Option<&Entry> {
        self.fields
            .iter()
            .rev()
            .find(|e| e.key.eq_ignore_ascii_case(key))
    }
}

/// A parsed slurm.conf with everything it included.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct SlurmConf {
    /// Every parameter in file order (a later one overrides an earlier one).
    pub params: Vec<Entry>,
    pub records: Vec<Record>,
    pub diagnostics: Vec<Diagnostic>,
    /// The files read, the main one first.
    pub files: Vec<String>,
}

impl SlurmConf {
    /// The value Slurm uses for `key`: the last one given, matched
    /// case-insensitively.
    pub fn get(&self, key: &str) -> Option<&Entry> {
        self.params
            .iter()
            .rev()
            .find(|e| e.key.eq_ignore_ascii_case(key))
    }

    /// Records of one kind.
    pub fn records(&self, kind: RecordKind) -> impl Iterator<Item = &Record> {
        self.records.iter().filter(move |r| r.kind == kind)
    }
}

/// Reads included files. [`FsLoader`] reads the file system; tests give a
/// map.
pub trait Loader {
    fn load(&self, path: &Path) -> std::io::Result<String>;
}

/// Reads included files from the file system.
#[derive(Debug, Default, Clone, Copy)]
pub struct FsLoader;

/// The largest file [`FsLoader`] reads: an included slurm.conf or a
/// Prometheus rule file is far smaller.
pub const MAX_LOADED_BYTES: u64 = 4 * 1024 * 1024;

impl Loader for FsLoader {
    /// Reads a regular file of at most [`MAX_LOADED_BYTES`]
    /// ([`keel_fs::read_regular`]): a device (`/dev/zero`) or a FIFO is
    /// refused without waiting or reading, a larger file after that many
    /// bytes.
    fn load(&self, path: &Path) -> std::io::Result<String> {
        keel_fs::read_regular_to_string(path, MAX_LOADED_BYTES)
    }
}

/// Parses slurm.conf `text`, read from `path`, following includes through
/// `loader`.
pub fn parse_slurm_conf(path: &Path, text: &str, loader: &dyn Loader) -> SlurmConf {
    let mut conf = SlurmConf::default();
    parse_into(&mut conf, path, text, loader, 0);
    conf
}

fn known_key(key: &str) -> bool {
    SLURM_KEYS
        .lines()
        .any(|k| !k.is_empty() && k.eq_ignore_ascii_case(key))
}

fn parse_into(conf: &mut SlurmConf, path: &Path, text: &str, loader: &dyn Loader, depth: usize) {
    let file = path.display().to_string();
    conf.files.push(file.clone());
    for (line_no, line) in logical_lines(text) {
        let loc = Location {
            file: file.clone(),
            line: line_no,
        };
        let trimmed = line.trim();
        if trimmed.is_empty() {
            continue;
        }
        if let Some(target) = include_target(trimmed) {
            include(conf, path, &loc, target, loader, depth);
            continue;
        }
        let pairs = match split_pairs(trimmed) {
            Ok(p) => p,
            Err(msg) => {
                conf.diagnostics
                    .push(Diagnostic::new(DiagnosticKind::Malformed, loc, msg));
                continue;
            }
        };
        let Some((first_key, first_value)) = pairs.first() else {
            continue;
        };
        let kind = match first_key.to_ascii_lowercase().as_str() {
            "nodename" => Some(RecordKind::Node),
            "partitionname" => Some(RecordKind::Partition),
            "nodeset" => Some(RecordKind::NodeSet),
            "downnodes" => Some(RecordKind::DownNodes),
            _ => None,
        };
        if let Some(kind) = kind {
            conf.records.push(Record {
                kind,
                name: first_value.clone(),
                fields: pairs
                    .iter()
                    .skip(1)
                    .map(|(k, v)| Entry {
                        key: k.clone(),
                        value: v.clone(),
                        location: loc.clone(),
                    })
                    .collect(),
                location: loc,
            });
            continue;
        }
        for (key, value) in pairs {
            if !known_key(&key) {
                conf.diagnostics.push(Diagnostic::new(
                    DiagnosticKind::UnknownKey,
                    loc.clone(),
                    format!("unknown key {}", crate::cut(&key)),
                ));
            }
            conf.params.push(Entry {
                key,
                value,
                location: loc.clone(),
            });
        }
    }
}

fn include_target(line: &str) -> Option<&str> {
    let head = line.get(..7)?;
    if !head.eq_ignore_ascii_case("include") {
        return None;
    }
    let rest = &line[7..];
    if !rest.starts_with(|c: char| c.is_ascii_whitespace()) {
        return None;
    }
    rest.split_ascii_whitespace().next()
}

fn include(
    conf: &mut SlurmConf,
    path: &Path,
    loc: &Location,
    target: &str,
    loader: &dyn Loader,
    depth: usize,
) {
    let mut name = target.to_owned();
    if name.contains("%c") {
        match conf.get("ClusterName") {
            Some(c) => name = name.replace("%c", &c.value.to_ascii_lowercase()),
            None => {
                conf.diagnostics.push(Diagnostic::new(
                    DiagnosticKind::Include,
                    loc.clone(),
                    format!(
                        "include {} uses %c before ClusterName is set",
                        crate::cut(target)
                    ),
                ));
                return;
            }
        }
    }
    if name.contains('*') {
        conf.diagnostics.push(Diagnostic::new(
            DiagnosticKind::Include,
            loc.clone(),
            format!(
                "include {}: Slurm does not expand globs and skips it",
                crate::cut(target)
            ),
        ));
        return;
    }
    if depth >= MAX_INCLUDE_DEPTH {
        conf.diagnostics.push(Diagnostic::new(
            DiagnosticKind::Include,
            loc.clone(),
            format!(
                "include {} nests deeper than {MAX_INCLUDE_DEPTH} files (a loop?)",
                crate::cut(target)
            ),
        ));
        return;
    }
    let p = PathBuf::from(&name);
    let full = if p.is_absolute() {
        p
    } else {
        path.parent().unwrap_or(Path::new(".")).join(p)
    };
    match loader.load(&full) {
        Ok(text) => parse_into(conf, &full, &text, loader, depth + 1),
        Err(e) => conf.diagnostics.push(Diagnostic::new(
            DiagnosticKind::Include,
            loc.clone(),
            format!("cannot read included {}: {e}", full.display()),
        )),
    }
}

/// Lines with comments removed and continuations joined, each with the
/// number of the line it started on.
fn logical_lines(text: &str) -> Vec<(u32, String)> {
    let mut out = Vec::new();
    let mut current = String::new();
    let mut start: Option<u32> = None;
    for (i, raw) in text.lines().enumerate() {
        let n = u32::try_from(i + 1).unwrap_or(u32::MAX);
        let line = strip_comment(raw);
        let trimmed_end = line.trim_end();
        start.get_or_insert(n);
        if let Some(body) = continued(trimmed_end) {
            current.push_str(body);
            current.push(' ');
            continue;
        }
        current.push_str(trimmed_end);
        out.push((start.take().unwrap_or(n), std::mem::take(&mut current)));
    }
    if let Some(s) = start {
        out.push((s, current));
    }
    out
}

/// `line` without a trailing, unescaped `\`, when it has one.
fn continued(line: &str) -> Option<&str> {
    let trailing = line.bytes().rev().take_while(|&b| b == b'\\').count();
    (trailing % 2 == 1).then(|| &line[..line.len() - 1])
}

/// Everything before the first `#` preceded by an even number of `\`.
fn strip_comment(line: &str) -> String {
    let mut out = String::with_capacity(line.len());
    let mut backslashes = 0usize;
    for c in line.chars() {
        if c == '#' && backslashes.is_multiple_of(2) {
            break;
        }
        if c == '\\' {
            backslashes += 1;
        } else {
            backslashes = 0;
        }
        out.push(c);
    }
    out
}

/// Splits a line into `Key=Value` pairs; a value may be double-quoted.
///
/// An error says what is wrong and never repeats the line: a line that
/// does not parse may come from any file an `Include` names
/// (`Include /etc/shadow`), and the report must not carry its content.
fn split_pairs(line: &str) -> Result<Vec<(String, String)>, String> {
    let mut pairs = Vec::new();
    let mut chars = line.chars().peekable();
    loop {
        while chars.peek().is_some_and(|c| c.is_whitespace()) {
            chars.next();
        }
        if chars.peek().is_none() {
            break;
        }
        let mut key = String::new();
        while let Some(&c) = chars.peek() {
            if c == '=' || c.is_whitespace() {
                break;
            }
            key.push(c);
            chars.next();
        }
        if chars.peek() != Some(&'=') {
            return Err(format!(
                "expected Key=Value: word {} of the line has no =",
                pairs.len() + 1
            ));
        }
        chars.next();
        if key.is_empty() || !key.chars().all(|c| c.is_ascii_alphanumeric() || c == '_') {
            return Err(format!(
                "bad key in word {} of the line: a key is letters, digits and _",
                pairs.len() + 1
            ));
        }
        let mut value = String::new();
        if chars.peek() == Some(&'"') {
            chars.next();
            let mut closed = false;
            for c in chars.by_ref() {
                if c == '"' {
                    closed = true;
                    break;
                }
                value.push(c);
            }
            if !closed {
                return Err(format!(
                    "unterminated quote in the value of word {} of the line",
                    pairs.len() + 1
                ));
            }
        } else {
            while let Some(&c) = chars.peek() {
                if c.is_whitespace() {
                    break;
                }
                value.push(c);
                chars.next();
            }
        }
        pairs.push((key, unescape(&value)));
    }
    Ok(pairs)
}

fn unescape(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    let mut chars = s.chars();
    while let Some(c) = chars.next() {
        if c == '\\' {
            if let Some(n) = chars.next() {
                out.push(n);
            }
        } else {
            out.push(c);
        }
    }
    out
}

/// One gres.conf line.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GresLine {
    pub fields: Vec<Entry>,
    pub location: Location,
}

impl GresLine {
    pub fn get(&self, key: &str) -> Option<&Entry> {
        self.fields
            .iter()
            .rev()
            .find(|e| e.key.eq_ignore_ascii_case(key))
    }
}

/// A parsed gres.conf.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct GresConf {
    pub lines: Vec<GresLine>,
    pub diagnostics: Vec<Diagnostic>,
    pub file: String,
}

/// Parses gres.conf `text` read from `path` (includes are not followed).
pub fn parse_gres_conf(path: &Path, text: &str) -> GresConf {
    let file = path.display().to_string();
    let mut conf = GresConf {
        file: file.clone(),
        ..GresConf::default()
    };
    for (line_no, line) in logical_lines(text) {
        let loc = Location {
            file: file.clone(),
            line: line_no,
        };
        if line.trim().is_empty() {
            continue;
        }
        match split_pairs(line.trim()) {
            Ok(pairs) => {
                let mut fields = Vec::new();
                for (key, value) in pairs {
                    if !GRES_KEYS.iter().any(|k| k.eq_ignore_ascii_case(&key)) {
                        conf.diagnostics.push(Diagnostic::new(
                            DiagnosticKind::UnknownKey,
                            loc.clone(),
                            format!("unknown gres.conf key {}", crate::cut(&key)),
                        ));
                    }
                    fields.push(Entry {
                        key,
                        value,
                        location: loc.clone(),
                    });
                }
                conf.lines.push(GresLine {
                    fields,
                    location: loc,
                });
            }
            Err(msg) => conf
                .diagnostics
                .push(Diagnostic::new(DiagnosticKind::Malformed, loc, msg)),
        }
    }
    conf
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeMap;

    use super::*;

    struct MapLoader(BTreeMap<PathBuf, String>);

    impl Loader for MapLoader {
        fn load(&self, path: &Path) -> std::io::Result<String> {
            self.0
                .get(path)
                .cloned()
                .ok_or_else(|| std::io::Error::from(std::io::ErrorKind::NotFound))
        }
    }

    fn parse(text: &str) -> SlurmConf {
        parse_slurm_conf(
            Path::new("/etc/slurm/slurm.conf"),
            text,
            &MapLoader(BTreeMap::new()),
        )
    }

    #[test]
    fn includes_that_are_not_small_regular_files_are_reported() {
        let dir = tempfile::tempdir().expect("tempdir");
        let fifo = dir.path().join("fifo.conf");
        let made = std::process::Command::new("mkfifo")
            .arg(&fifo)
            .status()
            .expect("mkfifo");
        assert!(made.success());
        let big = dir.path().join("big.conf");
        std::fs::write(&big, vec![b'#'; 5 * 1024 * 1024]).expect("write");
        let text = format!(
            "Include /dev/zero\nInclude {}\nInclude {}\n",
            fifo.display(),
            big.display()
        );
        let c = parse_slurm_conf(&dir.path().join("slurm.conf"), &text, &FsLoader);
        let got: Vec<(u32, &str)> = c
            .diagnostics
            .iter()
            .map(|d| (d.location.line, d.message.as_str()))
            .collect();
        assert_eq!(got.len(), 3, "{got:?}");
        assert!(
            got[0].0 == 1 && got[0].1.ends_with("/dev/zero: not a regular file"),
            "{got:?}"
        );
        assert!(
            got[1].0 == 2 && got[1].1.ends_with("fifo.conf: not a regular file"),
            "{got:?}"
        );
        assert!(
            got[2].0 == 3 && got[2].1.ends_with("big.conf: larger than 4 MiB"),
            "{got:?}"
        );
    }

    #[test]
    fn keys_are_case_insensitive_and_the_last_wins() {
        let c = parse("returntoservice=0\nReturnToService=1 # comment\n");
        let e = c.get("RETURNTOSERVICE").expect("set");
        assert_eq!(e.value, "1");
        assert_eq!(e.location.line, 2);
        assert!(c.diagnostics.is_empty(), "{:?}", c.diagnostics);
    }

    #[test]
    fn continuation_lines_join_and_keep_the_first_line_number() {
        let c = parse("\n\nNodeName=n[1-2] \\\n  CPUs=96 \\\n  Gres=gpu:8\nJobRequeue=1\n");
        let n = c.records(RecordKind::Node).next().expect("node line");
        assert_eq!(n.name, "n[1-2]");
        assert_eq!(n.get("gres").map(|e| e.value.as_str()), Some("gpu:8"));
        assert_eq!(n.location.line, 3);
        assert_eq!(c.get("JobRequeue").map(|e| e.location.line), Some(6));
    }

    #[test]
    fn escaped_hash_is_not_a_comment_and_quotes_keep_spaces() {
        let c =
            parse("HealthCheckProgram=/opt/a\\#b\nPartitionName=gpu Nodes=ALL Reason=\"a b\"\n");
        assert_eq!(
            c.get("HealthCheckProgram").map(|e| e.value.as_str()),
            Some("/opt/a#b")
        );
        let p = c.records(RecordKind::Partition).next().expect("partition");
        assert_eq!(p.get("Reason").map(|e| e.value.as_str()), Some("a b"));
    }

    #[test]
    fn malformed_lines_and_unknown_keys_are_reported_with_file_and_line() {
        let c = parse("ClusterName=x\nthis is not a pair\nHealthCheckProgramm=/x\nName=\"open\n");
        let got: Vec<_> = c
            .diagnostics
            .iter()
            .map(|d| (d.kind, d.location.line, d.location.file.as_str()))
            .collect();
        assert_eq!(
            got,
            vec![
                (DiagnosticKind::Malformed, 2, "/etc/slurm/slurm.conf"),
                (DiagnosticKind::UnknownKey, 3, "/etc/slurm/slurm.conf"),
                (DiagnosticKind::Malformed, 4, "/etc/slurm/slurm.conf"),
            ]
        );
        assert_eq!(c.get("ClusterName").map(|e| e.value.as_str()), Some("x"));
    }

    #[test]
    fn includes_are_read_relative_to_the_file_with_cluster_name() {
        let mut files = BTreeMap::new();
        files.insert(
            PathBuf::from("/etc/slurm/nodes-prod.conf"),
            "NodeName=g1 Gres=gpu:8\nBogus=1\n".to_owned(),
        );
        let c = parse_slurm_conf(
            Path::new("/etc/slurm/slurm.conf"),
            "ClusterName=PROD\ninclude nodes-%c.conf\nInclude /missing.conf\nInclude a*.conf\n",
            &MapLoader(files),
        );
        assert_eq!(c.records.len(), 1);
        assert_eq!(
            c.files,
            vec!["/etc/slurm/slurm.conf", "/etc/slurm/nodes-prod.conf"]
        );
        let got: Vec<_> = c
            .diagnostics
            .iter()
            .map(|d| (d.kind, d.location.file.as_str(), d.location.line))
            .collect();
        assert_eq!(
            got,
            vec![
                (DiagnosticKind::UnknownKey, "/etc/slurm/nodes-prod.conf", 2),
                (DiagnosticKind::Include, "/etc/slurm/slurm.conf", 3),
                (DiagnosticKind::Include, "/etc/slurm/slurm.conf", 4),
            ]
        );
    }

    #[test]
    fn an_include_loop_stops() {
        let mut files = BTreeMap::new();
        files.insert(
            PathBuf::from("/etc/slurm/a.conf"),
            "Include a.conf\n".to_owned(),
        );
        let c = parse_slurm_conf(
            Path::new("/etc/slurm/slurm.conf"),
            "Include a.conf\n",
            &MapLoader(files),
        );
        assert_eq!(c.diagnostics.len(), 1);
        assert_eq!(c.diagnostics[0].kind, DiagnosticKind::Include);
    }

    #[test]
    fn gres_conf_lines() {
        let g = parse_gres_conf(
            Path::new("gres.conf"),
            "AutoDetect=nvml\nNodeName=n3 Name=gpu File=/dev/nvidia[0-7]\nNodeName=n4 Nmae=gpu\n",
        );
        assert_eq!(g.lines.len(), 3);
        assert_eq!(
            g.lines[1].get("file").map(|e| e.value.as_str()),
            Some("/dev/nvidia[0-7]")
        );
        assert_eq!(g.diagnostics.len(), 1);
        assert_eq!(g.diagnostics[0].location.line, 3);
    }

    proptest::proptest! {
        #[test]
        fn never_panics_and_locations_are_real_lines(text in "[ -~\\n\\t\\\\#\"=é]{0,400}") {
            let c = parse(&text);
            let lines = u32::try_from(text.lines().count()).unwrap_or(u32::MAX);
            for d in &c.diagnostics {
                proptest::prop_assert!(d.location.line >= 1 && d.location.line <= lines.max(1));
            }
            for e in &c.params {
                proptest::prop_assert!(e.location.line >= 1 && e.location.line <= lines.max(1));
            }
            let _ = parse_gres_conf(Path::new("g"), &text);
        }

        #[test]
        fn written_pairs_read_back(
            pairs in proptest::collection::vec(("[A-Za-z][A-Za-z0-9_]{0,12}", "[A-Za-z0-9/:,._-]{0,20}"), 1..10)
        ) {
            let text: String = pairs.iter().map(|(k, v)| format!("{k}={v}\n")).collect();
            let c = parse(&text);
            let mut params = c.params.iter();
            for (i, (k, v)) in pairs.iter().enumerate() {
                let lower = k.to_ascii_lowercase();
                if ["nodename", "partitionname", "nodeset", "downnodes"].contains(&lower.as_str()) {
                    continue;
                }
                let e = params.next().expect("one entry per pair");
                proptest::prop_assert_eq!(&e.key, k);
                proptest::prop_assert_eq!(&e.value, v);
                proptest::prop_assert_eq!(e.location.line as usize, i + 1);
            }
        }
    }
}
