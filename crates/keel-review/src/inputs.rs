//! The inputs a review reads, told apart by name or content, each parsed
//! without failing: keel's TOML files loosely (a review reports what the
//! gateway's own validation says rather than stopping at it), sbatch
//! scripts by their `#SBATCH` lines and `export`s, environment files as
//! `KEY=VALUE` lines.

use std::path::Path;

use crate::slurm::{parse_gres_conf, parse_slurm_conf, GresConf, Loader, SlurmConf};
use crate::{cut, Diagnostic, DiagnosticKind, Location};

/// What kind of file an input is.
#[derive(
    Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, serde::Serialize, serde::Deserialize,
)]
#[serde(rename_all = "snake_case")]
pub enum Kind {
    Slurm,
    Gres,
    Gateway,
    Keel,
    Sbatch,
    Env,
    Node,
    Prometheus,
    /// NCCL's configuration file (`/etc/nccl.conf`, `~/.nccl.conf`):
    /// `NAME=value` lines NCCL sets in its process when the environment
    /// does not (NVIDIA/nccl `src/misc/param.cc`). Azure's HPC images
    /// write `NCCL_IB_PCI_RELAXED_ORDERING` and `NCCL_TOPO_FILE` there.
    Nccl,
}

impl Kind {
    pub const ALL: [Kind; 9] = [
        Kind::Slurm,
        Kind::Gres,
        Kind::Gateway,
        Kind::Keel,
        Kind::Sbatch,
        Kind::Env,
        Kind::Node,
        Kind::Prometheus,
        Kind::Nccl,
    ];

    pub fn name(self) -> &'static str {
        match self {
            Kind::Slurm => "slurm",
            Kind::Gres => "gres",
            Kind::Gateway => "gateway",
            Kind::Keel => "keel",
            Kind::Sbatch => "sbatch",
            Kind::Env => "env",
            Kind::Node => "node",
            Kind::Prometheus => "prometheus",
            Kind::Nccl => "nccl",
        }
    }

    pub fn from_name(s: &str) -> Option<Kind> {
        Kind::ALL.into_iter().find(|k| k.name() == s)
    }
}

/// A TOML document read loosely, with its text kept to find lines.
#[derive(Debug, Clone)]
pub struct TomlDoc {
    pub file: String,
    pub text: String,
    pub value: toml::Table,
}

impl TomlDoc {
    /// The value at a dotted path of table keys.
    pub fn get(&self, path: &str) -> Option<&toml::Value> {
        let mut parts = path.split('.');
        let first = parts.next()?;
        let mut v = self.value.get(first)?;
        for p in parts {
            v = v.get(p)?;
        }
        Some(v)
    }

    pub fn str(&self, path: &str) -> Option<&str> {
        self.get(path).and_then(|v| v.as_str())
    }

    /// The line of `key` in table `table` (`""` for the root), the
    /// `occurrence`-th time that table's header appears; else the header's
    /// line; else 1.
    pub fn line_of(&self, table: &str, occurrence: usize, key: &str) -> u32 {
        toml_line(&self.text, table, occurrence, key)
    }

    pub fn location(&self, table: &str, occurrence: usize, key: &str) -> Location {
        Location {
            file: self.file.clone(),
            line: self.line_of(table, occurrence, key),
        }
    }
}

fn header_name(line: &str) -> Option<String> {
    let l = line.trim();
    let inner = l
        .strip_prefix("[[")
        .and_then(|r| r.split_once("]]"))
        .or_else(|| l.strip_prefix('[').and_then(|r| r.split_once(']')))?;
    Some(
        inner
            .0
            .split('.')
            .map(str::trim)
            .collect::<Vec<_>>()
            .join("."),
    )
}

fn toml_line(text: &str, table: &str, occurrence: usize, key: &str) -> u32 {
    let mut current = String::new();
    let mut seen = 0usize;
    let mut header_line = None;
    let mut in_target = table.is_empty();
    for (i, line) in text.lines().enumerate() {
        let n = u32::try_from(i + 1).unwrap_or(u32::MAX);
        if let Some(h) = header_name(line) {
            current = h;
            in_target = false;
            if current == table {
                if seen == occurrence {
                    in_target = true;
                    header_line = Some(n);
                }
                seen += 1;
            }
            continue;
        }
        if !in_target {
            // A dotted key under a parent table: `[traffic]` then
            // `health.enabled = false`.
            if let Some(rest) = table.strip_prefix(&format!("{current}.")) {
                let dotted = format!("{rest}.{key}");
                if line_key(line).is_some_and(|k| k == dotted) {
                    return n;
                }
            }
            if current.is_empty() && !table.is_empty() {
                let dotted = format!("{table}.{key}");
                if line_key(line).is_some_and(|k| k == dotted) {
                    return n;
                }
            }
            continue;
        }
        if line_key(line).is_some_and(|k| k == key) {
            return n;
        }
    }
    header_line.unwrap_or(1)
}

fn line_key(line: &str) -> Option<String> {
    let (k, _) = line.split_once('=')?;
    let k = k.trim();
    if k.is_empty() || k.starts_with('#') {
        return None;
    }
    Some(
        k.split('.')
            .map(|p| p.trim().trim_matches('"'))
            .collect::<Vec<_>>()
            .join("."),
    )
}

/// A gateway file: the loose document and what the gateway's own
/// validation said of it.
#[derive(Debug, Clone)]
pub struct GatewayInput {
    pub doc: TomlDoc,
    /// `keel serve`'s error for this file, when it would refuse it.
    pub invalid: Option<String>,
}

/// One `#SBATCH` option.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Directive {
    /// The long name without dashes (`requeue`, `signal`, `time`); short
    /// options are mapped to their long names where a rule reads them.
    pub option: String,
    pub value: Option<String>,
    pub line: u32,
}

/// A variable set by an environment file or an sbatch script's `export`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct EnvVar {
    pub name: String,
    pub value: String,
    pub location: Location,
}

/// An sbatch script.
#[derive(Debug, Clone)]
pub struct Sbatch {
    pub file: String,
    pub directives: Vec<Directive>,
    /// Logical lines (continuations joined) after the directives, with
    /// their first line number.
    pub commands: Vec<(u32, String)>,
    pub exports: Vec<EnvVar>,
}

impl Sbatch {
    pub fn directive(&self, option: &str) -> Option<&Directive> {
        self.directives.iter().rev().find(|d| d.option == option)
    }
}

/// What `keel review --node` learnt about the node it ran on (a JSON
/// file of this shape can be reviewed too: `node:FILE`).
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(deny_unknown_fields)]
pub struct NodeFacts {
    /// 1.
    pub version: u32,
    pub host: String,
    /// keel check's passive tier: `pass`, `warn`, `unknown` or `fail`.
    pub check_status: String,
    /// Checks that failed, as `id: detail`.
    #[serde(default)]
    pub failed_checks: Vec<String>,
    /// Mount points of local NVMe drives or md RAID arrays.
    #[serde(default)]
    pub scratch: Vec<String>,
}

impl NodeFacts {
    /// The name findings on this node are reported under.
    pub fn file(&self) -> String {
        format!("node:{}", self.host)
    }
}

/// Local scratch mounts in /proc/mounts text: file systems on NVMe drives
/// or md arrays.
pub fn scratch_mounts(mounts: &str) -> Vec<String> {
    mounts
        .lines()
        .filter_map(|l| {
            let mut f = l.split_whitespace();
            let (src, dst) = (f.next()?, f.next()?);
            (src.starts_with("/dev/nvme") || src.starts_with("/dev/md")).then(|| dst.to_owned())
        })
        .collect()
}

/// One `scrape_configs` job of a Prometheus configuration.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ScrapeJob {
    pub name: String,
    pub line: u32,
    /// `static_configs` targets.
    pub targets: Vec<String>,
    /// Some `*_sd_configs` finds its targets.
    pub discovery: bool,
}

/// One `rule_files` entry.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RuleFile {
    pub path: String,
    pub line: u32,
    /// keel's alert rules: the file is named `keel-alerts.yml` (or
    /// `.yaml`), or, read beside the configuration, holds their `keel-gpu`
    /// group.
    pub keel_alerts: bool,
}

/// A Prometheus configuration file (`prometheus.yml`): its scrape jobs and
/// rule files.
#[derive(Debug, Clone)]
pub struct PromConfig {
    pub file: String,
    pub jobs: Vec<ScrapeJob>,
    /// The line of `scrape_configs:` (1 when absent).
    pub jobs_line: u32,
    pub rule_files: Vec<RuleFile>,
    /// The line of `rule_files:` (1 when absent).
    pub rule_files_line: u32,
}

/// A parsed input.
#[derive(Debug, Clone)]
pub enum Input {
    Slurm(SlurmConf),
    Gres(GresConf),
    Gateway(GatewayInput),
    Keel(TomlDoc),
    Sbatch(Sbatch),
    Env(Vec<EnvVar>, String),
    Node(NodeFacts),
    Prometheus(PromConfig),
    /// NCCL's configuration file: its `NCCL_*` lines, and the file.
    Nccl(Vec<EnvVar>, String),
}

impl Input {
    pub fn kind(&self) -> Kind {
        match self {
            Input::Slurm(_) => Kind::Slurm,
            Input::Gres(_) => Kind::Gres,
            Input::Gateway(_) => Kind::Gateway,
            Input::Keel(_) => Kind::Keel,
            Input::Sbatch(_) => Kind::Sbatch,
            Input::Env(..) => Kind::Env,
            Input::Node(_) => Kind::Node,
            Input::Prometheus(_) => Kind::Prometheus,
            Input::Nccl(..) => Kind::Nccl,
        }
    }

    /// The main file it was read from.
    pub fn file(&self) -> &str {
        match self {
            Input::Slurm(s) => s.files.first().map_or("", String::as_str),
            Input::Gres(g) => &g.file,
            Input::Gateway(g) => &g.doc.file,
            Input::Keel(d) => &d.file,
            Input::Sbatch(s) => &s.file,
            Input::Env(_, f) => f,
            Input::Node(n) => &n.host,
            Input::Prometheus(p) => &p.file,
            Input::Nccl(_, f) => f,
        }
    }
}

/// Tells an input's kind from its name, then its content.
pub fn detect(path: &Path, text: &str) -> Option<Kind> {
    let name = path
        .file_name()
        .map(|n| n.to_string_lossy().to_ascii_lowercase())
        .unwrap_or_default();
    if name == "gres.conf" {
        return Some(Kind::Gres);
    }
    if name == "slurm.conf" {
        return Some(Kind::Slurm);
    }
    if name == "node.json" {
        return Some(Kind::Node);
    }
    if name == "keel.toml" {
        return Some(Kind::Keel);
    }
    if name == "nccl.conf" || name == ".nccl.conf" {
        return Some(Kind::Nccl);
    }
    if name == "prometheus.yml" || name == "prometheus.yaml" {
        return Some(Kind::Prometheus);
    }
    if (name.ends_with(".yml") || name.ends_with(".yaml"))
        && text
            .lines()
            .any(|l| l.starts_with("scrape_configs:") || l.starts_with("rule_files:"))
    {
        return Some(Kind::Prometheus);
    }
    if name.ends_with(".toml") {
        // A file that is not TOML is read as a gateway file, whose parse
        // reports the line.
        let Ok(table) = toml::from_str::<toml::Table>(text) else {
            return Some(Kind::Gateway);
        };
        let keel_tables = ["check", "bench", "serve", "model", "exporter", "cost"];
        if !table.is_empty() && table.keys().all(|k| keel_tables.contains(&k.as_str())) {
            return Some(Kind::Keel);
        }
        return Some(Kind::Gateway);
    }
    if text.lines().any(|l| l.trim_start().starts_with("#SBATCH")) {
        return Some(Kind::Sbatch);
    }
    if name.ends_with(".env") || name == "environment" {
        return Some(Kind::Env);
    }
    let lower = text.to_ascii_lowercase();
    if name.ends_with(".conf")
        && [
            "clustername",
            "slurmctldhost",
            "nodename=",
            "partitionname=",
        ]
        .iter()
        .any(|k| lower.contains(k))
    {
        return Some(Kind::Slurm);
    }
    None
}

/// Everything needed to parse one input.
#[derive(Debug, Clone, Copy)]
pub struct Source<'a> {
    pub path: &'a Path,
    pub text: &'a str,
    pub kind: Kind,
}

/// Parses one input. Problems become diagnostics; only a TOML file that is
/// not TOML at all yields no input.
pub fn parse(src: Source<'_>, loader: &dyn Loader, diags: &mut Vec<Diagnostic>) -> Option<Input> {
    let file = src.path.display().to_string();
    match src.kind {
        Kind::Slurm => {
            let mut c = parse_slurm_conf(src.path, src.text, loader);
            diags.append(&mut c.diagnostics);
            Some(Input::Slurm(c))
        }
        Kind::Gres => {
            let mut g = parse_gres_conf(src.path, src.text);
            diags.append(&mut g.diagnostics);
            Some(Input::Gres(g))
        }
        Kind::Gateway | Kind::Keel => {
            let value: toml::Table = match toml::from_str(src.text) {
                Ok(v) => v,
                Err(e) => {
                    let line = e.span().map(|s| line_at(src.text, s.start)).unwrap_or(1);
                    diags.push(Diagnostic::new(
                        DiagnosticKind::Malformed,
                        Location { file, line },
                        format!("not TOML: {}", cut(e.message().trim_end())),
                    ));
                    return None;
                }
            };
            let doc = TomlDoc {
                file,
                text: src.text.to_owned(),
                value,
            };
            if src.kind == Kind::Keel {
                keel_unknown_keys(&doc, diags);
                return Some(Input::Keel(doc));
            }
            let base = src.path.parent().unwrap_or(Path::new("."));
            let invalid = match keel_gateway_config::GatewayConfig::from_toml(src.text, base) {
                Ok(_) => None,
                Err(e) => {
                    let msg = error_chain(&e);
                    if msg.contains("(os error") {
                        // A file the config names (a key, a certificate)
                        // is not on this host: the review cannot tell
                        // whether keel serve would accept it where it runs.
                        diags.push(Diagnostic::new(
                            DiagnosticKind::Include,
                            Location {
                                file: doc.file.clone(),
                                line: 1,
                            },
                            format!("not checked here: {msg}"),
                        ));
                        return Some(Input::Gateway(GatewayInput { doc, invalid: None }));
                    }
                    if msg.contains("unknown field") {
                        diags.push(Diagnostic::new(
                            DiagnosticKind::UnknownKey,
                            Location {
                                file: doc.file.clone(),
                                line: line_in_message(&msg).unwrap_or(1),
                            },
                            msg.clone(),
                        ));
                    }
                    Some(msg)
                }
            };
            Some(Input::Gateway(GatewayInput { doc, invalid }))
        }
        Kind::Sbatch => {
            let s = parse_sbatch(&file, src.text);
            Some(Input::Sbatch(s))
        }
        Kind::Env => Some(Input::Env(parse_env(&file, src.text, diags), file)),
        Kind::Nccl => Some(Input::Nccl(parse_nccl_conf(&file, src.text), file)),
        Kind::Prometheus => {
            parse_prometheus(src.path, src.text, loader, diags).map(Input::Prometheus)
        }
        Kind::Node => match serde_json::from_str::<NodeFacts>(src.text) {
            Ok(n) => Some(Input::Node(n)),
            Err(e) => {
                diags.push(Diagnostic::new(
                    DiagnosticKind::Malformed,
                    Location {
                        file,
                        line: u32::try_from(e.line()).unwrap_or(1).max(1),
                    },
                    format!("not node facts: {}", json_problem(&e)),
                ));
                None
            }
        },
    }
}

/// The top-level keys of Prometheus's configuration file
/// (prometheus.io/docs/prometheus/latest/configuration/configuration/).
const PROMETHEUS_KEYS: &[&str] = &[
    "global",
    "runtime",
    "rule_files",
    "scrape_config_files",
    "scrape_configs",
    "alerting",
    "remote_write",
    "remote_read",
    "storage",
    "tracing",
    "otlp",
];

/// The 1-based line of the first line at or after `from` (0-based) that
/// `pred` accepts; else `fallback`.
fn find_line(text: &str, from: usize, fallback: u32, pred: impl Fn(&str) -> bool) -> u32 {
    text.lines()
        .enumerate()
        .skip(from)
        .find(|(_, l)| pred(l))
        .map_or(fallback, |(i, _)| u32::try_from(i + 1).unwrap_or(u32::MAX))
}

fn parse_prometheus(
    path: &Path,
    text: &str,
    loader: &dyn Loader,
    diags: &mut Vec<Diagnostic>,
) -> Option<PromConfig> {
    use yaml_rust2::{Yaml, YamlLoader};
    let file = path.display().to_string();
    // yaml-rust2 bounds the nesting of flow collections only: a block
    // nested thousands deep overflows the stack when its tree is built or
    // dropped; and it copies an anchored node at every alias, so a
    // kilobyte of aliases of aliases builds gigabytes. Its events are
    // counted first, each alias as the nodes it expands to.
    if let Some((line, problem)) = yaml_too_big(text, MAX_YAML_DEPTH, MAX_YAML_NODES) {
        let what = match problem {
            YamlTooBig::Depth => format!("YAML nested deeper than {MAX_YAML_DEPTH} levels"),
            YamlTooBig::Nodes => format!(
                "YAML whose aliases expand to more than {MAX_YAML_NODES} nodes (an alias bomb?)"
            ),
        };
        diags.push(Diagnostic::new(
            DiagnosticKind::Malformed,
            Location { file, line },
            format!("not read: {what}"),
        ));
        return None;
    }
    let docs = match YamlLoader::load_from_str(text) {
        Ok(d) => d,
        Err(e) => {
            diags.push(Diagnostic::new(
                DiagnosticKind::Malformed,
                Location {
                    file,
                    // An error at the end of the text is on its last line.
                    line: u32::try_from(e.marker().line()).unwrap_or(1).clamp(
                        1,
                        u32::try_from(text.lines().count().max(1)).unwrap_or(u32::MAX),
                    ),
                },
                format!("not YAML: {}", cut(e.info())),
            ));
            return None;
        }
    };
    let empty = Yaml::Null;
    let doc = docs.first().unwrap_or(&empty);
    if let Some(h) = doc.as_hash() {
        for k in h.keys() {
            let k = k.as_str().unwrap_or("");
            if !PROMETHEUS_KEYS.contains(&k) {
                let line = find_line(text, 0, 1, |l| l.starts_with(&format!("{k}:")));
                diags.push(Diagnostic::new(
                    DiagnosticKind::UnknownKey,
                    Location {
                        file: file.clone(),
                        line,
                    },
                    format!("unknown key {}", cut(k)),
                ));
            }
        }
    } else if !doc.is_null() {
        diags.push(Diagnostic::new(
            DiagnosticKind::Malformed,
            Location { file, line: 1 },
            "not a Prometheus configuration: expected a mapping of keys".to_owned(),
        ));
        return None;
    }
    let jobs_line = find_line(text, 0, 1, |l| l.starts_with("scrape_configs:"));
    let mut jobs = Vec::new();
    for job in doc["scrape_configs"]
        .as_vec()
        .map_or(&[][..], Vec::as_slice)
    {
        let name = job["job_name"].as_str().unwrap_or("").to_owned();
        let line = find_line(text, 0, jobs_line, |l| {
            l.contains("job_name") && l.contains(name.as_str())
        });
        let targets = job["static_configs"]
            .as_vec()
            .map(|v| {
                v.iter()
                    .flat_map(|sc| sc["targets"].as_vec().cloned().unwrap_or_default())
                    .filter_map(|t| t.as_str().map(str::to_owned))
                    .collect()
            })
            .unwrap_or_default();
        let discovery = job.as_hash().is_some_and(|h| {
            h.iter().any(|(k, v)| {
                k.as_str().is_some_and(|k| k.ends_with("_sd_configs")) && !v.is_null()
            })
        });
        jobs.push(ScrapeJob {
            name,
            line,
            targets,
            discovery,
        });
    }
    let rule_files_line = find_line(text, 0, 1, |l| l.starts_with("rule_files:"));
    let base = path.parent().unwrap_or(Path::new("."));
    let mut rule_files = Vec::new();
    for entry in doc["rule_files"].as_vec().map_or(&[][..], Vec::as_slice) {
        let Some(p) = entry.as_str() else { continue };
        let from = usize::try_from(rule_files_line)
            .unwrap_or(0)
            .saturating_sub(1);
        let line = find_line(text, from, rule_files_line, |l| l.contains(p));
        let name = Path::new(p)
            .file_name()
            .map(|n| n.to_string_lossy().into_owned())
            .unwrap_or_default();
        let keel_alerts = name == "keel-alerts.yml"
            || name == "keel-alerts.yaml"
            || (!p.contains(['*', '?', '[']) && {
                let full = base.join(p);
                match loader.load(&full) {
                    Ok(t) => t.contains("- name: keel-gpu"),
                    // A rule file on the Prometheus host only.
                    Err(e) if e.kind() == std::io::ErrorKind::NotFound => false,
                    Err(e) => {
                        diags.push(Diagnostic::new(
                            DiagnosticKind::Include,
                            Location {
                                file: file.clone(),
                                line,
                            },
                            format!(
                                "cannot read rule file {}: {e}",
                                cut(&full.display().to_string())
                            ),
                        ));
                        false
                    }
                }
            });
        rule_files.push(RuleFile {
            path: p.to_owned(),
            line,
            keel_alerts,
        });
    }
    Some(PromConfig {
        file,
        jobs,
        jobs_line,
        rule_files,
        rule_files_line,
    })
}

/// The deepest nesting of sequences and mappings a Prometheus
/// configuration may have (a real one has fewer than ten).
pub const MAX_YAML_DEPTH: usize = 256;

/// The most nodes (scalars, sequences, mappings) a Prometheus
/// configuration may have once its aliases are expanded: a large real one
/// (ten thousand static targets) has some tens of thousands; this bound
/// keeps the loaded tree within some tens of megabytes.
pub const MAX_YAML_NODES: u64 = 250_000;

/// Why [`yaml_too_big`] refused a text.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum YamlTooBig {
    Depth,
    Nodes,
}

/// The line where `text`'s collections nest deeper than `max_depth`, or
/// where its nodes, each alias counted as the nodes of what it names,
/// pass `max_nodes`; `None` when neither happens, and for text that is
/// not YAML (the loader reports it). One pass over the parser's events,
/// in time and memory linear in the text whatever its aliases.
fn yaml_too_big(text: &str, max_depth: usize, max_nodes: u64) -> Option<(u32, YamlTooBig)> {
    use std::collections::HashMap;
    use yaml_rust2::parser::Parser;
    use yaml_rust2::Event;
    let mut parser = Parser::new_from_str(text);
    // Open collections: their anchor id and the node count before them.
    let mut open: Vec<(usize, u64)> = Vec::new();
    // Expanded nodes of each anchor.
    let mut anchored: HashMap<usize, u64> = HashMap::new();
    let mut nodes = 0u64;
    loop {
        let Ok((event, mark)) = parser.next_token() else {
            return None;
        };
        let line = || u32::try_from(mark.line()).unwrap_or(u32::MAX).max(1);
        match event {
            Event::SequenceStart(anchor, _) | Event::MappingStart(anchor, _) => {
                open.push((anchor, nodes));
                nodes += 1;
                if open.len() > max_depth {
                    return Some((line(), YamlTooBig::Depth));
                }
            }
            Event::SequenceEnd | Event::MappingEnd => {
                if let Some((anchor, before)) = open.pop() {
                    if anchor > 0 {
                        anchored.insert(anchor, nodes - before);
                    }
                }
            }
            Event::Scalar(_, _, anchor, _) => {
                nodes += 1;
                if anchor > 0 {
                    anchored.insert(anchor, 1);
                }
            }
            Event::Alias(anchor) => {
                nodes = nodes.saturating_add(anchored.get(&anchor).copied().unwrap_or(1));
            }
            Event::StreamEnd => return None,
            _ => {}
        }
        if nodes > max_nodes {
            return Some((line(), YamlTooBig::Nodes));
        }
    }
}

/// What is wrong with a JSON document, without its content: serde's
/// messages quote the values they reject (`invalid type: string "..."`),
/// and the file may not be what it claims to be.
fn json_problem(e: &serde_json::Error) -> String {
    use serde_json::error::Category;
    let msg = e.to_string();
    let at = format!("line {} column {}", e.line(), e.column());
    match e.classify() {
        Category::Syntax => format!("not JSON at {at}"),
        Category::Eof => "the JSON ends early".to_owned(),
        Category::Io => "cannot be read".to_owned(),
        // Field names are the schema's words: kept.
        Category::Data if msg.starts_with("unknown field") || msg.starts_with("missing field") => {
            cut(msg.split(", expected").next().unwrap_or(&msg))
        }
        Category::Data => format!("a value of the wrong type or range at {at}"),
    }
}

fn error_chain(e: &dyn std::error::Error) -> String {
    let mut s = e.to_string();
    let mut src = e.source();
    while let Some(inner) = src {
        s.push_str(": ");
        s.push_str(&inner.to_string());
        src = inner.source();
    }
    s
}

fn line_in_message(msg: &str) -> Option<u32> {
    let rest = &msg[msg.find("line ")? + 5..];
    let digits: String = rest.chars().take_while(char::is_ascii_digit).collect();
    digits.parse().ok()
}

fn line_at(text: &str, byte: usize) -> u32 {
    let end = byte.min(text.len());
    let mut b = end;
    while !text.is_char_boundary(b) {
        b -= 1;
    }
    u32::try_from(text[..b].matches('\n').count() + 1).unwrap_or(u32::MAX)
}

/// The keys keel's main config file accepts (docs/config.md).
const KEEL_KEYS: &[(&str, &[&str])] = &[
    (
        "check",
        &[
            "sku",
            "gpus",
            "profile_file",
            "gpu_snapshot",
            "nvml_library",
            "imds_endpoint",
            "imds_timeout_ms",
            "read_timeout_s",
            "state_dir",
            "prometheus_textfile",
            "slurm_timeout_s",
            "fail_closed",
        ],
    ),
    ("bench", &["cuda_lib_dir"]),
    ("serve", &["config", "listen", "keys_file"]),
    (
        "model",
        &[
            "db",
            "db_password_file",
            "db_ca_file",
            "db_pool_size",
            "db_timeout_ms",
            "artifact_store",
            "actor",
            "public_key",
            "listen",
            "serve_token_sha256",
            "tracking_uri",
        ],
    ),
    (
        "exporter",
        &[
            "listen",
            "token_sha256",
            "no_auth",
            "gpu_snapshots",
            "replay_step_s",
            "nvml_library",
            "deadline_s",
            "check_textfile",
            "job_mapping_dir",
            "jobs_from_processes",
            "device_file_pattern",
            "dcgm_names",
            "max_connections",
            "idle_threshold_percent",
            "idle_minutes",
        ],
    ),
    ("cost", &["prometheus", "exporter", "exporter_token_file"]),
];

fn keel_unknown_keys(doc: &TomlDoc, diags: &mut Vec<Diagnostic>) {
    for (table, value) in &doc.value {
        let Some((_, keys)) = KEEL_KEYS.iter().find(|(t, _)| t == table) else {
            diags.push(Diagnostic::new(
                DiagnosticKind::UnknownKey,
                doc.location(table, 0, ""),
                format!("unknown table {}", cut(table)),
            ));
            continue;
        };
        if let Some(t) = value.as_table() {
            for k in t.keys() {
                if !keys.contains(&k.as_str()) {
                    diags.push(Diagnostic::new(
                        DiagnosticKind::UnknownKey,
                        doc.location(table, 0, k),
                        format!("unknown key {table}.{}", cut(k)),
                    ));
                }
            }
        }
    }
}

/// Lines with trailing-`\` continuations joined, each with its first line.
fn shell_lines(text: &str) -> Vec<(u32, String)> {
    let mut out = Vec::new();
    let mut current = String::new();
    let mut start = None;
    for (i, raw) in text.lines().enumerate() {
        let n = u32::try_from(i + 1).unwrap_or(u32::MAX);
        start.get_or_insert(n);
        let t = raw.trim_end();
        if let Some(body) = t.strip_suffix('\\') {
            current.push_str(body);
            current.push(' ');
            continue;
        }
        current.push_str(t);
        out.push((start.take().unwrap_or(n), std::mem::take(&mut current)));
    }
    if let Some(s) = start {
        out.push((s, current));
    }
    out
}

/// Short sbatch options rules read, by their long names.
const SHORT: &[(&str, &str)] = &[
    ("t", "time"),
    ("N", "nodes"),
    ("n", "ntasks"),
    ("p", "partition"),
    ("J", "job-name"),
    ("o", "output"),
];

fn parse_sbatch(file: &str, text: &str) -> Sbatch {
    let mut s = Sbatch {
        file: file.to_owned(),
        directives: Vec::new(),
        commands: Vec::new(),
        exports: Vec::new(),
    };
    for (n, line) in shell_lines(text) {
        let t = line.trim();
        if let Some(rest) = t.strip_prefix("#SBATCH") {
            for (opt, value) in sbatch_options(rest) {
                s.directives.push(Directive {
                    option: opt,
                    value,
                    line: n,
                });
            }
            continue;
        }
        if t.is_empty() || t.starts_with('#') {
            continue;
        }
        if let Some(rest) = t.strip_prefix("export ") {
            for tok in rest.split_whitespace() {
                if let Some((k, v)) = tok.split_once('=') {
                    s.exports.push(EnvVar {
                        name: k.to_owned(),
                        value: v.trim_matches(['"', '\'']).to_owned(),
                        location: Location {
                            file: file.to_owned(),
                            line: n,
                        },
                    });
                }
            }
        }
        s.commands.push((n, t.to_owned()));
    }
    s
}

fn sbatch_options(rest: &str) -> Vec<(String, Option<String>)> {
    let mut out = Vec::new();
    let mut toks = rest.split_whitespace().peekable();
    while let Some(tok) = toks.next() {
        if let Some(long) = tok.strip_prefix("--") {
            match long.split_once('=') {
                Some((k, v)) => out.push((k.to_owned(), Some(v.to_owned()))),
                None => {
                    let value = toks
                        .peek()
                        .filter(|v| !v.starts_with('-'))
                        .map(|v| (*v).to_owned());
                    if value.is_some() {
                        toks.next();
                    }
                    out.push((long.to_owned(), value));
                }
            }
        } else if let Some(short) = tok.strip_prefix('-') {
            let (name, inline) = short.split_at(short.chars().next().map_or(0, char::len_utf8));
            let value = if inline.is_empty() {
                let v = toks
                    .peek()
                    .filter(|v| !v.starts_with('-'))
                    .map(|v| (*v).to_owned());
                if v.is_some() {
                    toks.next();
                }
                v
            } else {
                Some(inline.trim_start_matches('=').to_owned())
            };
            let long = SHORT
                .iter()
                .find(|(s, _)| *s == name)
                .map_or(name, |(_, l)| *l);
            out.push((long.to_owned(), value));
        } else {
            // `#SBATCH` comments end at the first word that is not an
            // option.
            break;
        }
    }
    out
}

/// NCCL's configuration file as NCCL reads it (NVIDIA/nccl
/// `src/misc/param.cc`, `initEnvFunc`): a line starting with `#` is
/// skipped, any other is `NAME=value` split at the first `=` (no `export`,
/// no quotes removed, nothing trimmed), and a line without `=` is ignored. Only `NCCL_*`
/// names are kept: NCCL sets the others in its process too, but too late
/// for anything else to read them.
fn parse_nccl_conf(file: &str, text: &str) -> Vec<EnvVar> {
    text.lines()
        .enumerate()
        .filter(|(_, l)| !l.starts_with('#'))
        .filter_map(|(i, l)| {
            // NCCL takes the name as written: `NCCL_X = 1` sets `NCCL_X `,
            // which nothing reads.
            let (k, v) = l.split_once('=')?;
            (k.starts_with("NCCL_") && !k.contains(char::is_whitespace)).then(|| EnvVar {
                name: k.to_owned(),
                value: v.to_owned(),
                location: Location {
                    file: file.to_owned(),
                    line: u32::try_from(i + 1).unwrap_or(u32::MAX),
                },
            })
        })
        .collect()
}

fn parse_env(file: &str, text: &str, diags: &mut Vec<Diagnostic>) -> Vec<EnvVar> {
    let mut vars = Vec::new();
    for (i, raw) in text.lines().enumerate() {
        let n = u32::try_from(i + 1).unwrap_or(u32::MAX);
        let t = raw.trim();
        if t.is_empty() || t.starts_with('#') {
            continue;
        }
        let t = t.strip_prefix("export ").unwrap_or(t).trim();
        let loc = Location {
            file: file.to_owned(),
            line: n,
        };
        match t.split_once('=') {
            Some((k, v))
                if !k.is_empty() && k.chars().all(|c| c.is_ascii_alphanumeric() || c == '_') =>
            {
                vars.push(EnvVar {
                    name: k.to_owned(),
                    value: v.trim_matches(['"', '\'']).to_owned(),
                    location: loc,
                });
            }
            _ => diags.push(Diagnostic::new(
                DiagnosticKind::Malformed,
                loc,
                // The line is not repeated: an environment file can hold
                // secrets.
                "expected NAME=VALUE".to_owned(),
            )),
        }
    }
    vars
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn toml_lines_follow_tables_and_arrays_of_tables() {
        let text = "[server]\nlisten = \"0.0.0.0:80\"\n[traffic]\nhealth.enabled = false\n[[models]]\nname = \"a\"\n[[models]]\nname = \"b\"\nfallback = []\n";
        assert_eq!(toml_line(text, "server", 0, "listen"), 2);
        assert_eq!(toml_line(text, "traffic.health", 0, "enabled"), 4);
        assert_eq!(toml_line(text, "models", 1, "fallback"), 9);
        assert_eq!(toml_line(text, "models", 0, "fallback"), 5);
        assert_eq!(toml_line(text, "audit", 0, "path"), 1);
    }

    #[test]
    fn a_toml_file_that_is_not_toml_is_reported_with_its_line() {
        let path = Path::new("gw.toml");
        let text = "[server]\nlisten = \"127.0.0.1:80\"\nworkers = = 2\n";
        let kind = detect(path, text).expect("kind");
        let mut diags = Vec::new();
        let input = parse(
            Source { path, text, kind },
            &crate::slurm::FsLoader,
            &mut diags,
        );
        assert!(input.is_none());
        assert_eq!(diags.len(), 1);
        assert_eq!(diags[0].kind, DiagnosticKind::Malformed);
        assert_eq!(diags[0].location.line, 3);
    }

    fn prometheus(text: &str) -> (Option<PromConfig>, Vec<Diagnostic>) {
        let mut diags = Vec::new();
        let c = parse_prometheus(
            Path::new("prometheus.yml"),
            text,
            &crate::slurm::FsLoader,
            &mut diags,
        );
        (c, diags)
    }

    #[test]
    fn deeply_nested_yaml_is_reported_not_loaded() {
        let text = format!("scrape_configs:\n{}x\n", "- ".repeat(10_000));
        let (c, d) = prometheus(&text);
        assert!(c.is_none());
        assert_eq!(d.len(), 1, "{d:?}");
        assert_eq!(d[0].kind, DiagnosticKind::Malformed);
        assert_eq!(d[0].location.line, 2);
        assert_eq!(d[0].message, "not read: YAML nested deeper than 256 levels");
        // Flow collections too; and a depth within the bound is read.
        let (c, d) = prometheus(&format!(
            "rule_files: {}{}\n",
            "[".repeat(300),
            "]".repeat(300)
        ));
        assert!(c.is_none() && d.len() == 1, "{d:?}");
        let (c, d) = prometheus(&format!("scrape_configs:\n{}x\n", "- ".repeat(200)));
        assert!(c.is_some() && d.is_empty(), "{d:?}");
    }

    /// serde's messages quote the values they reject; what keel reports
    /// of a JSON input does not.
    #[test]
    fn json_problems_name_no_value() {
        let e = serde_json::from_str::<u64>("\"SECRET\"").expect_err("a string");
        let p = json_problem(&e);
        assert!(!p.contains("SECRET") && p.contains("line 1"), "{p}");
        let e = serde_json::from_str::<u64>("SECRET").expect_err("not JSON");
        assert_eq!(json_problem(&e), "not JSON at line 1 column 1");
        let e = serde_json::from_str::<u64>("").expect_err("empty");
        assert_eq!(json_problem(&e), "the JSON ends early");
    }

    /// A billion laughs in about a kilobyte: nine levels of nine aliases
    /// of the level below, 9^9 nodes once expanded.
    #[test]
    fn a_yaml_alias_bomb_is_reported_not_expanded() {
        let mut text = String::from("a0: &a0 [\"lol\"]\n");
        for i in 1..=9 {
            let refs = vec![format!("*a{}", i - 1); 9].join(", ");
            text.push_str(&format!("a{i}: &a{i} [{refs}]\n"));
        }
        text.push_str("scrape_configs: *a9\n");
        assert!(text.len() < 1200, "{}", text.len());
        let (c, d) = prometheus(&text);
        assert!(c.is_none());
        assert_eq!(d.len(), 1, "{d:?}");
        assert_eq!(d[0].kind, DiagnosticKind::Malformed);
        assert_eq!(
            d[0].message,
            "not read: YAML whose aliases expand to more than 250000 nodes (an alias bomb?)"
        );
        assert!((6..=11).contains(&d[0].location.line), "{d:?}");
        // Aliases that stay small are read as Prometheus reads them.
        let (c, d) = prometheus(
            "scrape_configs:\n  - job_name: a\n    static_configs: &t\n      - targets: [\"h:9400\"]\n  - job_name: b\n    static_configs: *t\n",
        );
        let c = c.expect("read");
        assert!(d.is_empty(), "{d:?}");
        assert_eq!(c.jobs.len(), 2);
        assert_eq!(c.jobs[1].targets, vec!["h:9400".to_owned()]);
    }

    #[test]
    fn rule_files_that_are_not_small_regular_files_are_reported() {
        let dir = tempfile::tempdir().expect("tempdir");
        let fifo = dir.path().join("fifo.yml");
        let made = std::process::Command::new("mkfifo")
            .arg(&fifo)
            .status()
            .expect("mkfifo");
        assert!(made.success());
        let big = dir.path().join("big.yml");
        std::fs::write(&big, vec![b'#'; 5 * 1024 * 1024]).expect("write");
        std::fs::write(dir.path().join("keel.yml"), "groups:\n  - name: keel-gpu\n")
            .expect("write");
        let text = format!(
            "rule_files:\n  - /dev/zero\n  - {}\n  - {}\n  - keel.yml\n  - missing.yml\n",
            fifo.display(),
            big.display()
        );
        let mut diags = Vec::new();
        let c = parse_prometheus(
            &dir.path().join("prometheus.yml"),
            &text,
            &crate::slurm::FsLoader,
            &mut diags,
        )
        .expect("parses");
        let keel: Vec<bool> = c.rule_files.iter().map(|r| r.keel_alerts).collect();
        assert_eq!(keel, vec![false, false, false, true, false]);
        let got: Vec<(u32, &str)> = diags
            .iter()
            .map(|d| (d.location.line, d.message.as_str()))
            .collect();
        assert_eq!(got.len(), 3, "{got:?}");
        assert!(
            got[0].0 == 2 && got[0].1.ends_with("/dev/zero: not a regular file"),
            "{got:?}"
        );
        assert!(
            got[1].0 == 3 && got[1].1.ends_with("fifo.yml: not a regular file"),
            "{got:?}"
        );
        assert!(
            got[2].0 == 4 && got[2].1.ends_with("big.yml: larger than 4 MiB"),
            "{got:?}"
        );
        assert!(diags.iter().all(|d| d.kind == DiagnosticKind::Include));
    }

    #[test]
    fn prometheus_configs_malformed_and_unknown_keys_are_reported_with_lines() {
        let (c, d) = prometheus(
            "global:\n  scrape_interval: 15s\nscrape_configs:\n  - job_name: [unclosed\n",
        );
        assert!(c.is_none());
        assert_eq!(d.len(), 1, "{d:?}");
        assert_eq!(d[0].kind, DiagnosticKind::Malformed);
        assert!(d[0].location.line >= 4, "{d:?}");

        let (c, d) = prometheus(
            "scrape_config:\n  - job_name: keel\nrule_files:\n  - a.yml\n  - /etc/prometheus/keel-alerts.yml\nscrape_configs:\n  - job_name: \"keel-exporter\"\n    static_configs:\n      - targets: ['gpu1:9400']\n",
        );
        let c = c.expect("config");
        assert_eq!(d.len(), 1, "{d:?}");
        assert_eq!(d[0].kind, DiagnosticKind::UnknownKey);
        assert_eq!(d[0].location.line, 1);
        assert_eq!(
            c.jobs,
            vec![ScrapeJob {
                name: "keel-exporter".into(),
                line: 7,
                targets: vec!["gpu1:9400".into()],
                discovery: false,
            }]
        );
        assert_eq!(c.rule_files_line, 3);
        let rf: Vec<_> = c
            .rule_files
            .iter()
            .map(|r| (r.path.as_str(), r.line, r.keel_alerts))
            .collect();
        assert_eq!(
            rf,
            vec![
                ("a.yml", 4, false),
                ("/etc/prometheus/keel-alerts.yml", 5, true)
            ]
        );

        let (c, d) = prometheus("- a\n- b\n");
        assert!(c.is_none());
        assert_eq!(d[0].kind, DiagnosticKind::Malformed);
    }

    proptest::proptest! {
        #[test]
        fn prometheus_parser_never_panics(text in "[ -~\n]{0,200}") {
            let (c, d) = prometheus(&text);
            // A file that yields no input says why.
            proptest::prop_assert!(c.is_some() || !d.is_empty());
            let lines = u32::try_from(text.lines().count().max(1)).unwrap_or(u32::MAX);
            for diag in d {
                proptest::prop_assert!(diag.location.line >= 1 && diag.location.line <= lines);
            }
        }
    }

    #[test]
    fn sbatch_directives_short_and_long() {
        let s = parse_sbatch(
            "job.sh",
            "#!/bin/bash\n#SBATCH -t 01:00:00 --requeue\n#SBATCH --signal=B:USR1@120\n#SBATCH -N2 # two nodes\nexport A=1 \\\n  B=\"2\"\nsrun x\n",
        );
        let got: Vec<_> = s
            .directives
            .iter()
            .map(|d| (d.option.as_str(), d.value.as_deref(), d.line))
            .collect();
        assert_eq!(
            got,
            vec![
                ("time", Some("01:00:00"), 2),
                ("requeue", None, 2),
                ("signal", Some("B:USR1@120"), 3),
                ("nodes", Some("2"), 4),
            ]
        );
        let e: Vec<_> = s
            .exports
            .iter()
            .map(|v| (v.name.as_str(), v.value.as_str(), v.location.line))
            .collect();
        assert_eq!(e, vec![("A", "1", 5), ("B", "2", 5)]);
    }
}
