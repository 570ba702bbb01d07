//! `keel cost`: GPU-hours and their price from Slurm accounting.
//!
//! Input is the text of
//! `sacct -a -X -P -n --noconvert --format=JobID,JobName,User,Account,Partition,AllocTRES,ElapsedRaw,State,Start,End`
//! ([`SACCT_FORMAT`]): one allocation a line, `|`-separated. sacct escapes
//! nothing, so a job name may hold `|`: a row is read from both ends, the
//! JobID first and the last eight fields validated strictly, the name being
//! what lies between. GPU-hours are the allocation's `gres/gpu` count times
//! its elapsed time, clipped to the period; prices come from a user's TOML
//! table, per partition, per node hour, on demand and spot. A job whose
//! partition has no price is counted in GPU-hours and shown unpriced, never
//! as costing 0.
//!
//! A job is requeue-safe (what moving it to spot would have saved is
//! reported) when its Comment holds `keel run --slurm`'s marker
//! ([`keel_slurm::RUN_MARKER`]), or its name starts with a prefix the user
//! gives. The Comment is free text that sacct prints raw, newlines
//! included, so it is never read from the text: it comes from `sacct
//! --json` ([`parse_sacct_json`], joined by [`join_sacct_json`]), which also
//! confirms each row's job id and name (a newline in a name splits its
//! text row, and a split row is not counted).

use std::collections::{BTreeMap, HashMap};
use std::fmt::Write as _;

use serde::{Deserialize, Serialize};

use crate::{cut, Diagnostic, DiagnosticKind, Location};

/// The `--format` fields `keel cost` asks `sacct` for, in order.
pub const SACCT_FORMAT: &str =
    "JobID,JobName,User,Account,Partition,AllocTRES,ElapsedRaw,State,Start,End";
/// The number of fields of [`SACCT_FORMAT`].
const FIELDS: usize = 10;

/// Slurm's job state words (sacct's `State`, Slurm 22.05 to 25.11).
const STATES: &[&str] = &[
    "BOOT_FAIL",
    "CANCELLED",
    "COMPLETED",
    "COMPLETING",
    "CONFIGURING",
    "DEADLINE",
    "FAILED",
    "NODE_FAIL",
    "OUT_OF_MEMORY",
    "PENDING",
    "PREEMPTED",
    "REQUEUED",
    "REQUEUE_FED",
    "REQUEUE_HOLD",
    "RESIZING",
    "RESV_DEL_HOLD",
    "REVOKED",
    "RUNNING",
    "SIGNALING",
    "SPECIAL_EXIT",
    "STAGE_OUT",
    "STOPPED",
    "SUSPENDED",
    "TIMEOUT",
];

/// One allocation row.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SacctJob {
    pub job_id: String,
    pub name: String,
    pub user: String,
    pub account: String,
    pub partition: String,
    pub gpus: u64,
    pub elapsed_s: u64,
    pub state: String,
    /// Seconds since the Unix epoch, when sacct knew it.
    pub start: Option<i64>,
    pub end: Option<i64>,
    /// The job's Comment from `sacct --json`; `None` when it was not read.
    /// Empty where slurm.conf lacks `AccountingStoreFlags=job_comment`, and
    /// for a job that has not ended (slurmdbd receives it with the job's
    /// end).
    pub comment: Option<String>,
}

/// Whether `s` is a JobID as sacct prints it: `123`, `123_4`, `123_[5-9]`,
/// `123+0`.
fn is_job_id(s: &str) -> bool {
    s.starts_with(|c: char| c.is_ascii_digit())
        && s.chars()
            .all(|c| c.is_ascii_digit() || "_+[]-,%".contains(c))
}

/// Whether `s` is a State as sacct prints it: a state word, and for
/// `CANCELLED` perhaps `by UID`.
fn is_state(s: &str) -> bool {
    let mut words = s.split(' ');
    let first = words.next().unwrap_or("");
    let rest: Vec<&str> = words.collect();
    let plus = first.strip_suffix('+').unwrap_or(first);
    STATES.contains(&plus)
        && (rest.is_empty()
            || (first == "CANCELLED"
                && rest.len() == 2
                && rest[0] == "by"
                && !rest[1].is_empty()
                && rest[1].chars().all(|c| c.is_ascii_digit())))
}

/// Whether `s` is an AllocTRES list: empty, or `KEY=VALUE` items separated
/// by `,`.
fn is_tres(s: &str) -> bool {
    s.is_empty()
        || s.split(',').all(|item| {
            item.split_once('=').is_some_and(|(k, v)| {
                !k.is_empty()
                    && !v.is_empty()
                    && k.chars()
                        .all(|c| c.is_ascii_alphanumeric() || "/:_-.".contains(c))
                    && v.chars().all(|c| c.is_ascii_alphanumeric() || c == '.')
            })
        })
}

/// A Start or End field: a time, or one of the words sacct prints without
/// one.
fn is_time_field(s: &str) -> bool {
    matches!(s, "Unknown" | "None") || parse_time(s).is_some()
}

/// Whether `s` can be a user, account or partition name (no `|`, no
/// spaces, nothing sacct would not print for one).
fn is_plain_name(s: &str) -> bool {
    !s.is_empty()
        && s.chars()
            .all(|c| c.is_ascii_alphanumeric() || "._-@+".contains(c))
}

/// Parses sacct's text; lines that do not fit are diagnostics. A row is
/// read from both ends: the JobID is the first field, the last eight are
/// checked strictly, and the name is what lies between (`|`s included).
/// A JobID on more than one row is for [`drop_repeated`].
pub fn parse_sacct(file: &str, text: &str) -> (Vec<SacctJob>, Vec<Diagnostic>) {
    let mut jobs: Vec<(u32, SacctJob)> = Vec::new();
    let mut diags = Vec::new();
    for (i, line) in text.lines().enumerate() {
        let n = u32::try_from(i + 1).unwrap_or(u32::MAX);
        if line.trim().is_empty() {
            continue;
        }
        let loc = Location {
            file: file.to_owned(),
            line: n,
        };
        let bad = |what: String| Diagnostic::new(DiagnosticKind::Malformed, loc.clone(), what);
        let mut f: Vec<&str> = line.split('|').collect();
        // `-p` ends each line with a `|`: an End is never empty.
        if f.len() > FIELDS && f.last().is_some_and(|l| l.is_empty()) {
            f.pop();
        }
        if f.len() < FIELDS {
            diags.push(bad(format!(
                "expected {FIELDS} |-separated fields ({SACCT_FORMAT}), found {}",
                f.len()
            )));
            continue;
        }
        let k = f.len() - 8;
        let (user, account, partition, tres, elapsed, state, start, end) = (
            f[k],
            f[k + 1],
            f[k + 2],
            f[k + 3],
            f[k + 4],
            f[k + 5],
            f[k + 6],
            f[k + 7],
        );
        let problem = if !is_job_id(f[0]) {
            Some(format!("JobID {} is not a job id", cut(f[0])))
        } else if !is_plain_name(user)
            || ![account, partition]
                .iter()
                .all(|x| x.is_empty() || is_plain_name(x))
        {
            Some(format!(
                "User, Account or Partition {} is not a name",
                cut(&format!("{user}|{account}|{partition}"))
            ))
        } else if !is_tres(tres) {
            Some(format!("AllocTRES {} is not a TRES list", cut(tres)))
        } else if gpus_in_tres(tres).is_none() {
            Some(format!(
                "AllocTRES {}: a GPU count is not a whole number that fits in 64 bits",
                cut(tres)
            ))
        } else if elapsed.parse::<u64>().is_err() {
            Some(format!(
                "ElapsedRaw {} is not a number of seconds",
                cut(elapsed)
            ))
        } else if !is_state(state) {
            Some(format!("State {} is not a job state", cut(state)))
        } else if !is_time_field(start) || !is_time_field(end) {
            Some(format!(
                "Start or End {} is not a time",
                cut(&format!("{start}|{end}"))
            ))
        } else {
            None
        };
        if let Some(p) = problem {
            diags.push(bad(p));
            continue;
        }
        jobs.push((
            n,
            SacctJob {
                job_id: f[0].to_owned(),
                name: f[1..k].join("|"),
                user: user.to_owned(),
                account: account.to_owned(),
                partition: partition.to_owned(),
                gpus: gpus_in_tres(tres).unwrap_or_default(),
                elapsed_s: elapsed.parse().unwrap_or(0),
                state: state.to_owned(),
                start: parse_time(start),
                end: parse_time(end),
                comment: None,
            },
        ));
    }
    (jobs.into_iter().map(|(_, j)| j).collect(), diags)
}

/// Leaves out every row of a JobID that has more than one (sacct's `-X`
/// lists a job once: only a name holding a newline, whose pieces pass for
/// rows, can repeat one), with a diagnostic. After [`join_sacct_json`],
/// which already left out the pieces it could tell from their names.
pub fn drop_repeated(file: &str, jobs: Vec<SacctJob>) -> (Vec<SacctJob>, Vec<Diagnostic>) {
    let mut seen: HashMap<String, usize> = HashMap::new();
    for j in &jobs {
        *seen.entry(j.job_id.clone()).or_default() += 1;
    }
    let mut out = Vec::new();
    let mut diags = Vec::new();
    for j in jobs {
        match seen.get(&j.job_id).copied() {
            Some(0) => {}
            Some(1) => out.push(j),
            _ => {
                seen.insert(j.job_id.clone(), 0);
                diags.push(Diagnostic::new(
                    DiagnosticKind::Malformed,
                    Location {
                        file: file.to_owned(),
                        line: 0,
                    },
                    format!(
                        "job {} has more than one row (a job name holding a newline can forge one): none of them is counted",
                        cut(&j.job_id)
                    ),
                ));
            }
        }
    }
    (out, diags)
}

/// One job of `sacct --json`, as far as keel cost reads it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SacctJsonJob {
    pub name: String,
    /// `comment.job`; empty when it has none.
    pub comment: String,
}

/// A number, or data_parser's `{"set": true, "number": N}` (Slurm 23.02
/// and later).
#[derive(Deserialize)]
#[serde(untagged)]
enum JsonNumber {
    Plain(Option<u64>),
    Set {
        #[serde(default)]
        set: bool,
        #[serde(default)]
        number: u64,
    },
}

impl JsonNumber {
    fn get(&self) -> Option<u64> {
        match self {
            Self::Plain(n) => *n,
            Self::Set { set, number } => set.then_some(*number),
        }
    }
}

#[derive(Deserialize)]
struct JsonOut {
    jobs: Vec<JsonJob>,
}

#[derive(Deserialize)]
struct JsonJob {
    job_id: u64,
    #[serde(default)]
    name: String,
    #[serde(default)]
    comment: Option<JsonComment>,
    #[serde(default)]
    array: Option<JsonArray>,
    #[serde(default)]
    het: Option<JsonHet>,
}

#[derive(Deserialize)]
struct JsonComment {
    #[serde(default)]
    job: Option<String>,
}

#[derive(Deserialize)]
struct JsonArray {
    #[serde(default)]
    job_id: Option<u64>,
    #[serde(default)]
    task_id: Option<JsonNumber>,
    #[serde(default)]
    task: Option<String>,
}

#[derive(Deserialize)]
struct JsonHet {
    #[serde(default)]
    job_id: Option<u64>,
    #[serde(default)]
    job_offset: Option<JsonNumber>,
}

/// Reads `sacct --json`'s jobs (Slurm 22.05's openapi `dbv0.0.38` and the
/// later data_parser versions alike) by the JobID sacct's text shows them
/// under: `ID`, `ARRAY_TASK` for an array's task, `ARRAY_[RANGE]` for its
/// pending rest, `HET+OFFSET` for a heterogeneous job's component.
pub fn parse_sacct_json(text: &str) -> Result<BTreeMap<String, SacctJsonJob>, String> {
    let out: JsonOut = serde_json::from_str(text).map_err(|e| cut(&e.to_string()))?;
    let mut map = BTreeMap::new();
    for j in out.jobs {
        let array = j.array.as_ref().and_then(|a| a.job_id).filter(|&a| a != 0);
        let het = j.het.as_ref().and_then(|h| h.job_id).filter(|&h| h != 0);
        let id = match (array, het) {
            (Some(a), _) => {
                let arr = j.array.as_ref();
                match arr
                    .and_then(|a| a.task_id.as_ref())
                    .and_then(JsonNumber::get)
                {
                    Some(t) => format!("{a}_{t}"),
                    None => match arr
                        .and_then(|a| a.task.as_deref())
                        .filter(|t| !t.is_empty())
                    {
                        Some(t) if t.starts_with('[') => format!("{a}_{t}"),
                        Some(t) => format!("{a}_[{t}]"),
                        None => j.job_id.to_string(),
                    },
                }
            }
            (None, Some(h)) => match j
                .het
                .as_ref()
                .and_then(|x| x.job_offset.as_ref())
                .and_then(JsonNumber::get)
            {
                Some(o) => format!("{h}+{o}"),
                None => j.job_id.to_string(),
            },
            (None, None) => j.job_id.to_string(),
        };
        map.insert(
            id,
            SacctJsonJob {
                name: j.name,
                comment: j.comment.and_then(|c| c.job).unwrap_or_default(),
            },
        );
    }
    Ok(map)
}

/// Joins `sacct --json`'s answer to the text rows: each row takes its
/// job's comment; a row whose job the JSON does not list, or lists under
/// another name (the text row of a name holding a newline is split, and
/// its pieces can pass for rows), is left out with a diagnostic.
pub fn join_sacct_json(
    file: &str,
    jobs: Vec<SacctJob>,
    json: &BTreeMap<String, SacctJsonJob>,
) -> (Vec<SacctJob>, Vec<Diagnostic>) {
    let mut out = Vec::new();
    let mut diags = Vec::new();
    for mut j in jobs {
        let problem = match json.get(&j.job_id) {
            None => Some("is not in sacct --json's answer"),
            Some(x) if x.name != j.name => {
                Some("has another name in sacct --json's answer (a name holding a newline splits its row)")
            }
            Some(x) => {
                j.comment = Some(x.comment.clone());
                None
            }
        };
        match problem {
            Some(p) => diags.push(Diagnostic::new(
                DiagnosticKind::Malformed,
                Location {
                    file: file.to_owned(),
                    line: 0,
                },
                format!("job {} {p}: its row is not counted", cut(&j.job_id)),
            )),
            None => out.push(j),
        }
    }
    (out, diags)
}

/// The GPU count of an AllocTRES string: `gres/gpu=N`, else the sum of
/// typed `gres/gpu:TYPE=N` entries; `None` when a count (or the typed
/// entries' sum) does not fit in 64 bits, which no real allocation does.
pub fn gpus_in_tres(tres: &str) -> Option<u64> {
    let mut untyped = None;
    let mut typed = Some(0u64);
    for item in tres.split(',') {
        let Some((k, v)) = item.split_once('=') else {
            continue;
        };
        let gpu = k == "gres/gpu" || k.starts_with("gres/gpu:");
        if !gpu {
            continue;
        }
        let n = v.trim().parse::<u64>().ok();
        if k == "gres/gpu" {
            untyped = Some(n);
        } else {
            typed = typed.zip(n).and_then(|(t, n)| t.checked_add(n));
        }
    }
    untyped.unwrap_or(typed)
}

/// `YYYY-MM-DDTHH:MM:SS` (sacct's time format, UTC or the cluster's local
/// time alike) as seconds since the epoch; `None` for `Unknown`, `None`,
/// or anything else.
pub fn parse_time(s: &str) -> Option<i64> {
    keel_time::parse_date_time(s)
}

/// A price table file.
#[derive(Debug, Clone, Deserialize, Serialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct PriceTable {
    #[serde(default = "usd")]
    pub currency: String,
    /// Where the prices come from and when they were read; shown beside
    /// every figure.
    pub source: String,
    #[serde(default)]
    pub price: Vec<Price>,
}

fn usd() -> String {
    "USD".to_owned()
}

/// The price of one partition's nodes.
#[derive(Debug, Clone, Deserialize, Serialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct Price {
    pub partition: String,
    /// The VM size or machine the partition runs on.
    pub sku: String,
    pub gpus_per_node: u32,
    /// Per node hour.
    pub on_demand: f64,
    /// Per node hour on spot (or low-priority) capacity, when offered.
    #[serde(default)]
    pub spot: Option<f64>,
}

#[derive(Debug, thiserror::Error)]
pub enum PriceError {
    #[error("price table: {0}")]
    Parse(String),
    #[error("price table: partition {partition}: {reason}")]
    Invalid { partition: String, reason: String },
}

impl PriceTable {
    pub fn parse(text: &str) -> Result<Self, PriceError> {
        let t: PriceTable =
            toml::from_str(text).map_err(|e| PriceError::Parse(cut(e.message().trim_end())))?;
        let mut seen = Vec::new();
        for p in &t.price {
            let bad = |reason: &str| PriceError::Invalid {
                partition: cut(&p.partition),
                reason: reason.to_owned(),
            };
            if p.gpus_per_node == 0 {
                return Err(bad("gpus_per_node must be at least 1"));
            }
            if !(p.on_demand.is_finite() && p.on_demand >= 0.0) {
                return Err(bad("on_demand must be a price of 0 or more"));
            }
            if p.spot.is_some_and(|s| !(s.is_finite() && s >= 0.0)) {
                return Err(bad("spot must be a price of 0 or more"));
            }
            if seen.contains(&&p.partition) {
                return Err(bad("listed twice"));
            }
            seen.push(&p.partition);
        }
        Ok(t)
    }

    fn for_partition(&self, partition: &str) -> Option<&Price> {
        self.price.iter().find(|p| p.partition == partition)
    }
}

/// What to count.
#[derive(Debug, Clone, Default)]
pub struct CostOptions {
    /// Seconds since the epoch; allocations are clipped to [since, until).
    pub since: Option<i64>,
    pub until: Option<i64>,
    /// Job-name prefixes of requeue-safe jobs (checkpointing, requeued on
    /// failure): what moving them to spot would have saved. Jobs whose
    /// Comment holds keel run's marker are requeue-safe too.
    pub requeue_safe_prefixes: Vec<String>,
}

/// Why a job counts as requeue-safe.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum RequeueSafeBy {
    /// Its Comment holds keel run's marker: it ran under `keel run
    /// --slurm`. Wins when the name matches too.
    Marker,
    /// Its name starts with a `--requeue-safe` prefix.
    Name,
}

impl RequeueSafeBy {
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Marker => "marker",
            Self::Name => "name",
        }
    }
}

#[derive(Debug, Clone, Serialize, PartialEq)]
pub struct JobCost {
    pub job_id: String,
    pub name: String,
    pub user: String,
    pub account: String,
    pub partition: String,
    pub state: String,
    pub gpus: u64,
    pub gpu_hours: f64,
    /// On demand; `None` when the partition has no price.
    pub cost: Option<f64>,
    pub requeue_safe: bool,
    /// Which rule made it requeue-safe; `None` when it is not.
    pub requeue_safe_by: Option<RequeueSafeBy>,
    /// Whether its Comment holds keel run's marker; `None` when the
    /// comment was not read (no sacct --json), or is empty for a job that
    /// has not ended.
    pub marker: Option<bool>,
    /// What running it on spot would have saved (requeue-safe jobs in
    /// partitions with a spot price).
    pub spot_saving: Option<f64>,
}

#[derive(Debug, Clone, Serialize, PartialEq)]
pub struct Group {
    pub key: String,
    pub jobs: usize,
    pub gpu_hours: f64,
    /// On-demand cost of the priced jobs.
    pub cost: f64,
    /// GPU-hours of jobs in partitions without a price.
    pub unpriced_gpu_hours: f64,
    pub spot_saving: f64,
}

impl Group {
    fn new(key: &str) -> Self {
        Self {
            key: key.to_owned(),
            jobs: 0,
            gpu_hours: 0.0,
            cost: 0.0,
            unpriced_gpu_hours: 0.0,
            spot_saving: 0.0,
        }
    }

    fn add(&mut self, j: &JobCost) {
        self.jobs += 1;
        self.gpu_hours += j.gpu_hours;
        match j.cost {
            Some(c) => self.cost += c,
            None => self.unpriced_gpu_hours += j.gpu_hours,
        }
        self.spot_saving += j.spot_saving.unwrap_or(0.0);
    }
}

#[derive(Debug, Clone, Serialize, PartialEq)]
pub struct CostReport {
    pub currency: String,
    pub price_source: String,
    pub jobs: Vec<JobCost>,
    pub by_user: Vec<Group>,
    pub by_partition: Vec<Group>,
    pub total: Group,
    /// Idle GPU-hours from the exporters' accounting, priced with the same
    /// table; `None` when no source was given or it could not be read.
    pub idle: Option<IdleReport>,
    /// Why `idle` is `None`.
    pub idle_unknown: Option<String>,
}

/// One job's idle GPU time as the exporters' accounting counts it
/// (`keel_job_gpu_idle_seconds_total`); user and partition may be empty
/// where the exporter could not tell them.
#[derive(Debug, Clone, PartialEq)]
pub struct IdleJob {
    pub job_id: String,
    pub user: String,
    pub partition: String,
    pub idle_gpu_hours: f64,
}

/// A job's idle GPU-hours and what they cost.
#[derive(Debug, Clone, Serialize, PartialEq)]
pub struct IdleJobCost {
    pub job_id: String,
    pub user: String,
    pub partition: String,
    pub idle_gpu_hours: f64,
    /// At the partition's on-demand price; `None` when it has none.
    pub cost: Option<f64>,
    /// The job is among the accounting rows of the period.
    pub in_accounting: bool,
}

/// Idle GPU-hours summed by user, by partition or in total.
#[derive(Debug, Clone, Serialize, PartialEq)]
pub struct IdleGroup {
    pub key: String,
    pub jobs: usize,
    pub idle_gpu_hours: f64,
    pub cost: f64,
    pub unpriced_idle_gpu_hours: f64,
}

impl IdleGroup {
    fn new(key: &str) -> Self {
        Self {
            key: key.to_owned(),
            jobs: 0,
            idle_gpu_hours: 0.0,
            cost: 0.0,
            unpriced_idle_gpu_hours: 0.0,
        }
    }

    fn add(&mut self, j: &IdleJobCost) {
        self.jobs += 1;
        self.idle_gpu_hours += j.idle_gpu_hours;
        match j.cost {
            Some(c) => self.cost += c,
            None => self.unpriced_idle_gpu_hours += j.idle_gpu_hours,
        }
    }
}

/// Idle GPU-hours of a period, by job, user and partition.
#[derive(Debug, Clone, Serialize, PartialEq)]
pub struct IdleReport {
    /// Where they were read (`exporter URL, since it started`,
    /// `prometheus URL over 2026-09-01T00:00:00..2026-10-01T00:00:00`).
    pub source: String,
    pub jobs: Vec<IdleJobCost>,
    pub by_user: Vec<IdleGroup>,
    pub by_partition: Vec<IdleGroup>,
    pub total: IdleGroup,
}

/// Joins the exporters' idle rows to the report: a row's empty user or
/// partition is taken from the accounting row of the same job id, and its
/// idle GPU-hours are priced at that partition's on-demand price.
pub fn add_idle(
    report: &mut CostReport,
    source: String,
    rows: &[IdleJob],
    jobs: &[SacctJob],
    prices: &PriceTable,
) {
    let mut out = Vec::new();
    for r in rows {
        let acct = jobs.iter().find(|j| j.job_id == r.job_id);
        let pick = |own: &str, from: Option<&str>| {
            if own.is_empty() {
                from.unwrap_or("").to_owned()
            } else {
                own.to_owned()
            }
        };
        let user = pick(&r.user, acct.map(|j| j.user.as_str()));
        let partition = pick(&r.partition, acct.map(|j| j.partition.as_str()));
        let cost = prices
            .for_partition(&partition)
            .map(|p| r.idle_gpu_hours * p.on_demand / f64::from(p.gpus_per_node));
        out.push(IdleJobCost {
            job_id: r.job_id.clone(),
            user,
            partition,
            idle_gpu_hours: r.idle_gpu_hours,
            cost,
            in_accounting: report.jobs.iter().any(|j| j.job_id == r.job_id),
        });
    }
    out.sort_by(|a, b| {
        b.idle_gpu_hours
            .total_cmp(&a.idle_gpu_hours)
            .then(a.job_id.cmp(&b.job_id))
    });
    let group = |key: fn(&IdleJobCost) -> &str| {
        let mut m: BTreeMap<String, IdleGroup> = BTreeMap::new();
        for j in &out {
            let k = if key(j).is_empty() { "-" } else { key(j) };
            m.entry(k.to_owned())
                .or_insert_with(|| IdleGroup::new(k))
                .add(j);
        }
        let mut v: Vec<IdleGroup> = m.into_values().collect();
        v.sort_by(|a, b| {
            b.idle_gpu_hours
                .total_cmp(&a.idle_gpu_hours)
                .then(a.key.cmp(&b.key))
        });
        v
    };
    let by_user = group(|j| &j.user);
    let by_partition = group(|j| &j.partition);
    let mut total = IdleGroup::new("total");
    for j in &out {
        total.add(j);
    }
    report.idle = Some(IdleReport {
        source,
        jobs: out,
        by_user,
        by_partition,
        total,
    });
    report.idle_unknown = None;
}

/// Prices `jobs` with `prices`; jobs without GPUs or outside the period
/// are left out.
pub fn cost(jobs: &[SacctJob], prices: &PriceTable, opts: &CostOptions) -> CostReport {
    let mut out = Vec::new();
    for j in jobs {
        if j.gpus == 0 {
            continue;
        }
        let secs = clipped_seconds(j, opts);
        if secs <= 0 {
            continue;
        }
        #[allow(clippy::cast_precision_loss)]
        let gpu_hours = j.gpus as f64 * secs as f64 / 3600.0;
        let price = prices.for_partition(&j.partition);
        let per_gpu = |node: f64, p: &Price| node / f64::from(p.gpus_per_node);
        let cost = price.map(|p| gpu_hours * per_gpu(p.on_demand, p));
        let marker = j.comment.as_deref().and_then(|c| {
            // slurmdbd receives the comment with the job's end: until then
            // sacct shows none.
            if c.trim().is_empty() && not_ended(&j.state) {
                None
            } else {
                Some(keel_slurm::has_marker(c, keel_slurm::RUN_MARKER))
            }
        });
        let by_name = opts
            .requeue_safe_prefixes
            .iter()
            .any(|pre| !pre.is_empty() && j.name.starts_with(pre.as_str()));
        let requeue_safe_by = if marker == Some(true) {
            Some(RequeueSafeBy::Marker)
        } else if by_name {
            Some(RequeueSafeBy::Name)
        } else {
            None
        };
        let requeue_safe = requeue_safe_by.is_some();
        let spot_saving = match price {
            Some(p) if requeue_safe => p
                .spot
                .map(|s| gpu_hours * (per_gpu(p.on_demand, p) - per_gpu(s, p))),
            _ => None,
        };
        out.push(JobCost {
            job_id: j.job_id.clone(),
            name: j.name.clone(),
            user: j.user.clone(),
            account: j.account.clone(),
            partition: j.partition.clone(),
            state: j.state.clone(),
            gpus: j.gpus,
            gpu_hours,
            cost,
            requeue_safe,
            requeue_safe_by,
            marker,
            spot_saving,
        });
    }
    let group = |key: fn(&JobCost) -> &str| {
        let mut m: BTreeMap<String, Group> = BTreeMap::new();
        for j in &out {
            m.entry(key(j).to_owned())
                .or_insert_with(|| Group::new(key(j)))
                .add(j);
        }
        let mut v: Vec<Group> = m.into_values().collect();
        v.sort_by(|a, b| b.gpu_hours.total_cmp(&a.gpu_hours).then(a.key.cmp(&b.key)));
        v
    };
    let by_user = group(|j| &j.user);
    let by_partition = group(|j| &j.partition);
    let mut total = Group::new("total");
    for j in &out {
        total.add(j);
    }
    CostReport {
        currency: prices.currency.clone(),
        price_source: prices.source.clone(),
        jobs: out,
        by_user,
        by_partition,
        total,
        idle: None,
        idle_unknown: Some("no exporter or Prometheus source given".to_owned()),
    }
}

/// A state sacct reports before the job's end (Slurm 22.05's words).
fn not_ended(state: &str) -> bool {
    let word = state.split_whitespace().next().unwrap_or("");
    ["RUNNING", "PENDING", "SUSPENDED", "RESIZING"]
        .iter()
        .any(|s| word.eq_ignore_ascii_case(s))
}

fn clipped_seconds(j: &SacctJob, opts: &CostOptions) -> i64 {
    let elapsed = i64::try_from(j.elapsed_s).unwrap_or(i64::MAX);
    let (start, end) = match (j.start, j.end) {
        (Some(s), Some(e)) if e >= s => (s, e),
        (Some(s), _) => (s, s.saturating_add(elapsed)),
        _ => {
            // No times: count all of it unless a period excludes nothing
            // can be told; sacct's -S/-E already selected the rows.
            return elapsed;
        }
    };
    let from = opts.since.map_or(start, |s| start.max(s));
    let to = opts.until.map_or(end, |u| end.min(u));
    (to - from).max(0)
}

impl CostReport {
    /// The human report: totals, by partition, by user, and the spot
    /// saving, with the price source.
    pub fn text(&self) -> String {
        let mut s = String::new();
        let c = &self.currency;
        let _ = writeln!(
            s,
            "keel cost: {} GPU jobs, prices: {}",
            self.jobs.len(),
            self.price_source
        );
        let _ = writeln!(
            s,
            "total: {:.1} GPU-hours, {:.2} {c} on demand{}",
            self.total.gpu_hours,
            self.total.cost,
            unpriced(&self.total)
        );
        for (title, groups) in [("partition", &self.by_partition), ("user", &self.by_user)] {
            let _ = writeln!(s, "\nby {title}:");
            let _ = writeln!(
                s,
                "  {:<16} {:>6} {:>12} {:>14} {:>14}",
                title,
                "jobs",
                "GPU-hours",
                format!("cost {c}"),
                "spot saving"
            );
            for g in groups.iter() {
                // A group with no priced job has an unknown cost, not 0.
                let cost = if g.unpriced_gpu_hours > 0.0 && g.unpriced_gpu_hours >= g.gpu_hours {
                    "unknown".to_owned()
                } else {
                    format!("{:.2}", g.cost)
                };
                let _ = writeln!(
                    s,
                    "  {:<16} {:>6} {:>12.1} {:>14} {:>14.2}{}",
                    cut(&g.key),
                    g.jobs,
                    g.gpu_hours,
                    cost,
                    g.spot_saving,
                    unpriced(g)
                );
            }
        }
        match (&self.idle, &self.idle_unknown) {
            (Some(idle), _) => {
                let _ = writeln!(
                    s,
                    "\nidle: {:.1} GPU-hours, {:.2} {c} on demand{} (from {})",
                    idle.total.idle_gpu_hours,
                    idle.total.cost,
                    idle_unpriced(&idle.total),
                    idle.source
                );
                for (title, groups) in [("partition", &idle.by_partition), ("user", &idle.by_user)]
                {
                    let _ = writeln!(s, "\nidle by {title}:");
                    let _ = writeln!(
                        s,
                        "  {:<16} {:>6} {:>12} {:>14}",
                        title,
                        "jobs",
                        "idle GPU-h",
                        format!("cost {c}")
                    );
                    for g in groups.iter() {
                        let cost = if g.unpriced_idle_gpu_hours > 0.0
                            && g.unpriced_idle_gpu_hours >= g.idle_gpu_hours
                        {
                            "unknown".to_owned()
                        } else {
                            format!("{:.2}", g.cost)
                        };
                        let _ = writeln!(
                            s,
                            "  {:<16} {:>6} {:>12.2} {:>14}{}",
                            cut(&g.key),
                            g.jobs,
                            g.idle_gpu_hours,
                            cost,
                            idle_unpriced(g)
                        );
                    }
                }
            }
            (None, reason) => {
                let _ = writeln!(
                    s,
                    "\nidle GPU-hours: unknown ({})",
                    reason.as_deref().unwrap_or("not read")
                );
            }
        }
        self.requeue_safe_text(&mut s);
        s
    }

    /// The requeue-safe jobs, each with the rule that made it so, and what
    /// spot would have saved.
    fn requeue_safe_text(&self, s: &mut String) {
        let c = &self.currency;
        let safe: Vec<&JobCost> = self.jobs.iter().filter(|j| j.requeue_safe).collect();
        let count = |by: RequeueSafeBy| {
            safe.iter()
                .filter(|j| j.requeue_safe_by == Some(by))
                .count()
        };
        let _ = writeln!(
            s,
            "\nrequeue-safe jobs: {} ({} run under keel run, {} by name); running them on spot would have saved {:.2} {c}",
            safe.len(),
            count(RequeueSafeBy::Marker),
            count(RequeueSafeBy::Name),
            self.total.spot_saving
        );
        let unknown = self.jobs.iter().filter(|j| j.marker.is_none()).count();
        if unknown > 0 {
            let _ = writeln!(
                s,
                "  ({unknown} jobs' markers unknown (no comment from sacct --json, or jobs not ended: slurmdbd stores the comment at the end): only their names were matched)"
            );
        }
        if safe.is_empty() {
            return;
        }
        let _ = writeln!(
            s,
            "  {:<12} {:<16} {:<12} {:<12} {:>10} {:>14}  by",
            "job", "name", "user", "partition", "GPU-hours", "spot saving"
        );
        for j in safe {
            let saving = j
                .spot_saving
                .map_or_else(|| "unknown".to_owned(), |v| format!("{v:.2}"));
            let _ = writeln!(
                s,
                "  {:<12} {:<16} {:<12} {:<12} {:>10.1} {:>14}  {}",
                cut(&j.job_id),
                cut(&j.name),
                cut(&j.user),
                cut(&j.partition),
                j.gpu_hours,
                saving,
                j.requeue_safe_by.map_or("", RequeueSafeBy::as_str)
            );
        }
    }

    /// One CSV row a job, with a header.
    pub fn csv(&self) -> String {
        let mut s = String::from(
            "job_id,name,user,account,partition,state,gpus,gpu_hours,cost,requeue_safe,requeue_safe_by,spot_saving,idle_gpu_hours,idle_cost,currency\n",
        );
        let idle_of = |id: &str| -> [String; 2] {
            // Empty when unknown: no idle source, or a job the exporters
            // did not see.
            let row = self
                .idle
                .as_ref()
                .and_then(|i| i.jobs.iter().find(|r| r.job_id == id));
            match row {
                Some(r) => [
                    format!("{:.4}", r.idle_gpu_hours),
                    r.cost.map_or(String::new(), |c| format!("{c:.4}")),
                ],
                None => [String::new(), String::new()],
            }
        };
        for j in &self.jobs {
            let [idle_hours, idle_cost] = idle_of(&j.job_id);
            let fields = [
                csv_field(&j.job_id),
                csv_field(&j.name),
                csv_field(&j.user),
                csv_field(&j.account),
                csv_field(&j.partition),
                csv_field(&j.state),
                j.gpus.to_string(),
                format!("{:.4}", j.gpu_hours),
                j.cost.map_or(String::new(), |c| format!("{c:.4}")),
                j.requeue_safe.to_string(),
                j.requeue_safe_by
                    .map_or(String::new(), |b| b.as_str().to_owned()),
                j.spot_saving.map_or(String::new(), |c| format!("{c:.4}")),
                idle_hours,
                idle_cost,
                csv_field(&self.currency),
            ];
            s.push_str(&fields.join(","));
            s.push('\n');
        }
        // Idle jobs outside the period's accounting rows: their own line,
        // with what the exporters know of them.
        for r in self
            .idle
            .iter()
            .flat_map(|i| i.jobs.iter())
            .filter(|r| !r.in_accounting)
        {
            let fields = [
                csv_field(&r.job_id),
                String::new(),
                csv_field(&r.user),
                String::new(),
                csv_field(&r.partition),
                String::new(),
                String::new(),
                String::new(),
                String::new(),
                String::new(),
                String::new(),
                String::new(),
                format!("{:.4}", r.idle_gpu_hours),
                r.cost.map_or(String::new(), |c| format!("{c:.4}")),
                csv_field(&self.currency),
            ];
            s.push_str(&fields.join(","));
            s.push('\n');
        }
        s
    }
}

fn idle_unpriced(g: &IdleGroup) -> String {
    if g.unpriced_idle_gpu_hours > 0.0 {
        format!(
            " ({:.2} idle GPU-hours unpriced)",
            g.unpriced_idle_gpu_hours
        )
    } else {
        String::new()
    }
}

fn unpriced(g: &Group) -> String {
    if g.unpriced_gpu_hours > 0.0 {
        format!(" ({:.1} GPU-hours unpriced)", g.unpriced_gpu_hours)
    } else {
        String::new()
    }
}

/// RFC 4180 quoting; a field a spreadsheet would run as a formula gets a
/// leading `'`.
fn csv_field(s: &str) -> String {
    let s = if s.starts_with(['=', '+', '-', '@']) {
        format!("'{s}")
    } else {
        s.to_owned()
    };
    if s.contains([',', '"', '\n', '\r']) {
        format!("\"{}\"", s.replace('"', "\"\""))
    } else {
        s
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::strategy::Strategy as _;

    #[test]
    fn tres_gpu_counts() {
        assert_eq!(
            gpus_in_tres("billing=16,cpu=16,gres/gpu=8,mem=64G,node=1").expect("fits"),
            8
        );
        assert_eq!(
            gpus_in_tres("cpu=4,gres/gpu:a100=2,gres/gpu:h100=1"),
            Some(3)
        );
        assert_eq!(gpus_in_tres("cpu=4,gres/gpu=4,gres/gpu:h100=4"), Some(4));
        assert_eq!(gpus_in_tres("cpu=4,mem=1G"), Some(0));
        assert_eq!(gpus_in_tres(""), Some(0));
        assert_eq!(
            gpus_in_tres("gres/gpu=18446744073709551615"),
            Some(u64::MAX)
        );
        assert_eq!(gpus_in_tres("gres/gpu=18446744073709551616"), None);
        assert_eq!(
            gpus_in_tres("gres/gpu:a=18446744073709551615,gres/gpu:b=1"),
            None
        );
    }

    /// A GPU count that overflows is reported like one of -1, never
    /// dropped silently.
    #[test]
    fn a_gpu_count_that_overflows_is_reported() {
        let text = "\
1|big|u|a|gpu|gres/gpu=99999999999999999999|3600|COMPLETED|Unknown|Unknown
2|neg|u|a|gpu|gres/gpu=-1|3600|COMPLETED|Unknown|Unknown
3|sum|u|a|gpu|gres/gpu:a=18446744073709551615,gres/gpu:b=1|3600|COMPLETED|Unknown|Unknown
4|ok|u|a|gpu|gres/gpu=8|3600|COMPLETED|Unknown|Unknown
";
        let (jobs, diags) = parse_sacct("f", text);
        assert_eq!(jobs.len(), 1);
        assert_eq!(jobs[0].job_id, "4");
        let lines: Vec<u32> = diags.iter().map(|d| d.location.line).collect();
        assert_eq!(lines, vec![1, 2, 3]);
        assert!(
            diags[0].message.contains("GPU count"),
            "{}",
            diags[0].message
        );
    }

    #[test]
    fn times() {
        assert_eq!(parse_time("1970-01-01T00:00:00"), Some(0));
        assert_eq!(parse_time("2026-03-01T00:00:00"), Some(1_772_323_200));
        assert_eq!(parse_time("Unknown"), None);
        assert_eq!(parse_time("2026-13-01T00:00:00"), None);
    }

    #[test]
    fn sacct_rows_are_read_from_both_ends() {
        let text = "\
1|plain|u|a|gpu|gres/gpu=8|3600|COMPLETED|2026-09-01T00:00:00|2026-09-01T01:00:00
2|a|b|u|a|gpu|gres/gpu=8|3600|CANCELLED by 1001|Unknown|None|
3|big|carol|research|debug|cpu=1|60|COMPLETED|Unknown|Unknown|mallory|ml|gpu|gres/gpu=64|36000|COMPLETED|Unknown|Unknown
4|short|u|a|gpu|gres/gpu=8|3600|COMPLETED|Unknown
5|x|u|a|gpu|gres/gpu=8|soon|COMPLETED|Unknown|Unknown
6|x|u|a|gpu|gres/gpu=8|3600|DONE|Unknown|Unknown
7|x|u|a|gpu|gres/gpu=8|3600|COMPLETED|Unknown|later
8|x|u|a|gpu|not tres|3600|COMPLETED|Unknown|Unknown
x9|x|u|a|gpu|gres/gpu=8|3600|COMPLETED|Unknown|Unknown
";
        let (jobs, diags) = parse_sacct("f", text);
        let got: Vec<(&str, &str, &str, u64, u64)> = jobs
            .iter()
            .map(|j| {
                (
                    j.job_id.as_str(),
                    j.name.as_str(),
                    j.user.as_str(),
                    j.gpus,
                    j.elapsed_s,
                )
            })
            .collect();
        assert_eq!(
            got,
            vec![
                ("1", "plain", "u", 8, 3600),
                ("2", "a|b", "u", 8, 3600),
                // A name cannot supply the fields: the last eight are
                // the job's own.
                (
                    "3",
                    "big|carol|research|debug|cpu=1|60|COMPLETED|Unknown|Unknown",
                    "mallory",
                    64,
                    36000
                ),
            ]
        );
        assert!(jobs.iter().all(|j| j.comment.is_none()));
        assert_eq!(jobs[0].start, Some(1_788_220_800));
        assert_eq!(jobs[0].end, Some(1_788_224_400));
        let lines: Vec<u32> = diags.iter().map(|d| d.location.line).collect();
        assert_eq!(lines, vec![4, 5, 6, 7, 8, 9]);
        assert!(
            diags[0].message.contains("expected 10 |-separated fields"),
            "{}",
            diags[0].message
        );
    }

    /// sacct prints a job's name raw: a row whose name holds `|` and
    /// newlines as sacct -P would print it.
    fn raw_row(id: u64, name: &str, user: &str, gpus: u64, secs: u64) -> String {
        format!(
            "{id}|{name}|{user}|acct|gpu|cpu=8,gres/gpu={gpus}|{secs}|COMPLETED|2026-09-01T00:00:00|Unknown\n"
        )
    }

    #[test]
    fn a_row_the_json_does_not_confirm_is_not_counted() {
        let mut text = raw_row(1, "ok|ok", "u", 8, 3600);
        // A name with a newline forges a row of its own job id.
        text += &raw_row(
            2,
            "x|carol|acct|gpu|gres/gpu=64|99999|COMPLETED|Unknown|Unknown\n2|y",
            "mallory",
            1,
            60,
        );
        // And one of a job that does not exist.
        text += &raw_row(
            3,
            "x\n77|n|carol|acct|gpu|gres/gpu=64|99999|COMPLETED|Unknown|Unknown\nz",
            "mallory",
            1,
            60,
        );
        let (jobs, diags) = parse_sacct("f", &text);
        let json: BTreeMap<String, SacctJsonJob> = [
            ("1", "ok|ok", "keel-run"),
            (
                "2",
                "x|carol|acct|gpu|gres/gpu=64|99999|COMPLETED|Unknown|Unknown\n2|y",
                "",
            ),
            (
                "3",
                "x\n77|n|carol|acct|gpu|gres/gpu=64|99999|COMPLETED|Unknown|Unknown\nz",
                "",
            ),
        ]
        .into_iter()
        .map(|(id, name, comment)| {
            (
                id.to_owned(),
                SacctJsonJob {
                    name: name.to_owned(),
                    comment: comment.to_owned(),
                },
            )
        })
        .collect();
        let (jobs, more) = join_sacct_json("sacct --json", jobs, &json);
        let (jobs, _) = drop_repeated("f", jobs);
        let got: Vec<(&str, u64, Option<&str>)> = jobs
            .iter()
            .map(|j| (j.job_id.as_str(), j.gpus, j.comment.as_deref()))
            .collect();
        assert_eq!(got, vec![("1", 8, Some("keel-run"))]);
        assert!(!diags.is_empty());
        assert!(
            more.iter()
                .any(|d| d.message.contains("job 77 is not in sacct --json's answer")),
            "{more:?}"
        );
    }

    #[test]
    fn sacct_json_of_slurm_22_05_and_later_is_read() {
        let v38 = r#"{"meta":{},"jobs":[
            {"job_id":232,"name":"nm\nx|y","comment":{"administrator":null,"job":"c1\nc2|z","system":null},
             "array":{"job_id":0,"task":null,"task_id":null},"het":{"job_id":0,"job_offset":null}},
            {"job_id":234,"name":"a","comment":{"job":null},"array":{"job_id":233,"task":null,"task_id":1},"het":{"job_id":0,"job_offset":null}},
            {"job_id":235,"name":"h","array":{"job_id":0},"het":{"job_id":235,"job_offset":1}}]}"#;
        let m = parse_sacct_json(v38).expect("parses");
        assert_eq!(m["232"].name, "nm\nx|y");
        assert_eq!(m["232"].comment, "c1\nc2|z");
        assert_eq!(m["233_1"].comment, "");
        assert!(m.contains_key("235+1"));
        let v41 = r#"{"jobs":[{"job_id":9,"name":"n","comment":{"job":"keel-run"},
            "array":{"job_id":8,"task_id":{"set":true,"infinite":false,"number":3},"task":""},
            "het":{"job_id":0,"job_offset":{"set":false,"infinite":false,"number":0}}}]}"#;
        let m = parse_sacct_json(v41).expect("parses");
        assert_eq!(m["8_3"].comment, "keel-run");
        assert!(parse_sacct_json("not json").is_err());
    }

    #[test]
    fn marked_jobs_and_named_jobs_are_requeue_safe() {
        let text = "\
1|train|u|a|gpu|gres/gpu=8|3600|COMPLETED|Unknown|Unknown
2|keel-ft|u|a|gpu|gres/gpu=8|3600|COMPLETED|Unknown|Unknown
3|keel-both|u|a|gpu|gres/gpu=8|3600|COMPLETED|Unknown|Unknown
4|plain|u|a|gpu|gres/gpu=8|3600|COMPLETED|Unknown|Unknown
5|old|u|a|gpu|gres/gpu=8|3600|COMPLETED|Unknown|Unknown
6|marked|u|a|nospot|gres/gpu=8|3600|COMPLETED|Unknown|Unknown
7|running|u|a|gpu|gres/gpu=8|3600|RUNNING|Unknown|Unknown
8|running|u|a|gpu|gres/gpu=8|3600|RUNNING|Unknown|Unknown
";
        let (mut jobs, diags) = parse_sacct("f", text);
        assert!(diags.is_empty());
        // The comments as sacct --json gives them; 5's unknown.
        let comments = [
            Some("keel-run"),
            Some(""),
            Some("team=ml\nkeel-run"),
            Some("keel-runner"),
            None,
            Some("keel-run"),
            Some(""),
            Some("keel-run"),
        ];
        for (j, c) in jobs.iter_mut().zip(comments) {
            j.comment = c.map(str::to_owned);
        }
        let prices = PriceTable {
            currency: "USD".into(),
            source: "t".into(),
            price: vec![
                Price {
                    partition: "gpu".into(),
                    sku: "s".into(),
                    gpus_per_node: 8,
                    on_demand: 16.0,
                    spot: Some(4.0),
                },
                Price {
                    partition: "nospot".into(),
                    sku: "s".into(),
                    gpus_per_node: 8,
                    on_demand: 16.0,
                    spot: None,
                },
            ],
        };
        let opts = CostOptions {
            requeue_safe_prefixes: vec!["keel-".into()],
            ..CostOptions::default()
        };
        let r = cost(&jobs, &prices, &opts);
        let got: Vec<_> = r
            .jobs
            .iter()
            .map(|j| {
                (
                    j.job_id.as_str(),
                    j.requeue_safe_by,
                    j.marker,
                    j.spot_saving,
                )
            })
            .collect();
        // 8 GPU-hours at 2 on demand and 0.5 on spot a GPU-hour.
        assert_eq!(
            got,
            vec![
                ("1", Some(RequeueSafeBy::Marker), Some(true), Some(12.0)),
                ("2", Some(RequeueSafeBy::Name), Some(false), Some(12.0)),
                ("3", Some(RequeueSafeBy::Marker), Some(true), Some(12.0)),
                ("4", None, Some(false), None),
                ("5", None, None, None),
                ("6", Some(RequeueSafeBy::Marker), Some(true), None),
                // Not ended: slurmdbd has no comment yet.
                ("7", None, None, None),
                ("8", Some(RequeueSafeBy::Marker), Some(true), Some(12.0)),
            ]
        );
        assert_eq!(r.total.spot_saving, 48.0);
        let csv = r.csv();
        assert!(csv.starts_with("job_id,name,user,account,partition,state,gpus,gpu_hours,cost,requeue_safe,requeue_safe_by,spot_saving,"), "{csv}");
        assert!(
            csv.contains(
                "\n1,train,u,a,gpu,COMPLETED,8,8.0000,16.0000,true,marker,12.0000,,,USD\n"
            ),
            "{csv}"
        );
        assert!(
            csv.contains(
                "\n2,keel-ft,u,a,gpu,COMPLETED,8,8.0000,16.0000,true,name,12.0000,,,USD\n"
            ),
            "{csv}"
        );
        assert!(
            csv.contains("\n4,plain,u,a,gpu,COMPLETED,8,8.0000,16.0000,false,,,,,USD\n"),
            "{csv}"
        );
        let text = r.text();
        assert!(
            text.contains("requeue-safe jobs: 5 (4 run under keel run, 1 by name); running them on spot would have saved 48.00 USD"),
            "{text}"
        );
        assert!(
            text.contains(
                "(2 jobs' markers unknown (no comment from sacct --json, or jobs not ended: slurmdbd stores the comment at the end): only their names were matched)"
            ),
            "{text}"
        );
        assert!(text.contains("  2            keel-ft          u            gpu                 8.0          12.00  name\n"), "{text}");
        assert!(text.contains("  6            marked           u            nospot              8.0        unknown  marker\n"), "{text}");
        let json = serde_json::to_value(&r.jobs[0]).expect("json");
        assert_eq!(json["requeue_safe_by"], "marker");
        assert_eq!(json["marker"], true);
        assert!(serde_json::to_value(&r.jobs[3]).expect("json")["requeue_safe_by"].is_null());
    }

    #[test]
    fn clipping_to_the_period() {
        let j = SacctJob {
            job_id: "1".into(),
            name: "x".into(),
            user: "u".into(),
            account: "a".into(),
            partition: "gpu".into(),
            gpus: 8,
            elapsed_s: 7200,
            state: "COMPLETED".into(),
            start: Some(1000),
            end: Some(8200),
            comment: None,
        };
        let opts = CostOptions {
            since: Some(4600),
            ..CostOptions::default()
        };
        assert_eq!(clipped_seconds(&j, &opts), 3600);
        let opts = CostOptions {
            until: Some(500),
            ..CostOptions::default()
        };
        assert_eq!(clipped_seconds(&j, &opts), 0);
    }

    #[test]
    fn idle_rows_join_the_accounting_and_are_priced() {
        let job = |id: &str, partition: &str| SacctJob {
            job_id: id.into(),
            name: "n".into(),
            user: "alice".into(),
            account: "a".into(),
            partition: partition.into(),
            gpus: 8,
            elapsed_s: 3600,
            state: "COMPLETED".into(),
            start: None,
            end: None,
            comment: None,
        };
        let jobs = vec![job("1", "gpu"), job("2", "cpu")];
        let prices = PriceTable {
            currency: "USD".into(),
            source: "t".into(),
            price: vec![Price {
                partition: "gpu".into(),
                sku: "s".into(),
                gpus_per_node: 8,
                on_demand: 16.0,
                spot: None,
            }],
        };
        let mut r = cost(&jobs, &prices, &CostOptions::default());
        assert!(r.idle.is_none() && r.idle_unknown.is_some());
        let rows = [
            IdleJob {
                job_id: "1".into(),
                user: String::new(),
                partition: String::new(),
                idle_gpu_hours: 3.0,
            },
            IdleJob {
                job_id: "2".into(),
                user: "bob".into(),
                partition: String::new(),
                idle_gpu_hours: 1.0,
            },
            IdleJob {
                job_id: "9".into(),
                user: "carol".into(),
                partition: "gpu".into(),
                idle_gpu_hours: 0.5,
            },
        ];
        add_idle(&mut r, "exporter x".into(), &rows, &jobs, &prices);
        let idle = r.idle.as_ref().expect("idle");
        assert!(r.idle_unknown.is_none());
        let got: Vec<_> = idle
            .jobs
            .iter()
            .map(|j| {
                (
                    j.job_id.as_str(),
                    j.user.as_str(),
                    j.partition.as_str(),
                    j.cost,
                    j.in_accounting,
                )
            })
            .collect();
        assert_eq!(
            got,
            vec![
                ("1", "alice", "gpu", Some(6.0), true),
                ("2", "bob", "cpu", None, true),
                ("9", "carol", "gpu", Some(1.0), false),
            ]
        );
        assert_eq!(idle.total.idle_gpu_hours, 4.5);
        assert_eq!(idle.total.cost, 7.0);
        assert_eq!(idle.total.unpriced_idle_gpu_hours, 1.0);
        let csv = r.csv();
        assert!(
            csv.contains("\n9,,carol,,gpu,,,,,,,,0.5000,1.0000,USD\n"),
            "{csv}"
        );
        assert!(csv.contains(",3.0000,6.0000,USD\n"), "{csv}");
        assert!(r.text().contains("idle: 4.5 GPU-hours, 7.00 USD on demand (1.00 idle GPU-hours unpriced) (from exporter x)"), "{}", r.text());
    }

    proptest::proptest! {
        /// Names made of `|`, newlines and pieces of rows: a row counted is
        /// always a job's own, with its own numbers; a name without a
        /// newline never costs its job's row.
        #[test]
        fn no_name_changes_a_rows_numbers(
            names in proptest::collection::vec(
                proptest::collection::vec(
                    proptest::prop_oneof![
                        proptest::strategy::Just("|".to_owned()),
                        proptest::strategy::Just("\n".to_owned()),
                        proptest::strategy::Just("x".to_owned()),
                        (1u64..6).prop_map(|i| format!("{i}|")),
                        (1u64..6).prop_map(|i| format!("\n{i}|n")),
                        proptest::strategy::Just("|eve|acct|gpu|gres/gpu=64|99999|COMPLETED|Unknown|Unknown".to_owned()),
                    ],
                    0..6,
                ).prop_map(|v| v.concat()),
                1..5,
            )
        ) {
            use proptest::{prop_assert, prop_assert_eq};
            let mut text = String::new();
            let mut json = BTreeMap::new();
            for (i, name) in names.iter().enumerate() {
                let id = i as u64 + 1;
                text += &raw_row(id, name, "u", id, 100 * id);
                json.insert(id.to_string(), SacctJsonJob { name: name.clone(), comment: String::new() });
            }
            let (jobs, _) = parse_sacct("f", &text);
            let (jobs, _) = join_sacct_json("j", jobs, &json);
            let (jobs, _) = drop_repeated("f", jobs);
            for j in &jobs {
                let id: u64 = j.job_id.parse().expect("an input's id");
                prop_assert!(id >= 1 && (id as usize) <= names.len());
                prop_assert_eq!(&j.name, &names[id as usize - 1]);
                prop_assert_eq!((j.user.as_str(), j.gpus, j.elapsed_s), ("u", id, 100 * id));
            }
            // Only a newline (here, or in another name that copies this
            // job's row whole) costs a job its row.
            for (i, name) in names.iter().enumerate() {
                if !names.iter().any(|n| n.contains('\n')) {
                    prop_assert!(jobs.iter().any(|j| j.job_id == (i + 1).to_string()), "{:?}", name);
                }
            }
        }

        #[test]
        fn sacct_parser_never_panics(text in "[ -~\\n|]{0,300}") {
            let (jobs, diags) = parse_sacct("f", &text);
            proptest::prop_assert!(jobs.len() + diags.len() <= text.lines().count());
        }

        #[test]
        fn gpu_hours_add_up(rows in proptest::collection::vec((0u64..16, 0u64..100_000), 0..20)) {
            let jobs: Vec<SacctJob> = rows.iter().enumerate().map(|(i, (g, e))| SacctJob {
                job_id: i.to_string(), name: "n".into(), user: format!("u{}", i % 3),
                account: "a".into(), partition: "gpu".into(), gpus: *g, elapsed_s: *e,
                state: "COMPLETED".into(), start: None, end: None, comment: None,
            }).collect();
            let prices = PriceTable { currency: "USD".into(), source: "t".into(), price: vec![Price {
                partition: "gpu".into(), sku: "s".into(), gpus_per_node: 8, on_demand: 8.0, spot: Some(2.0),
            }]};
            let r = cost(&jobs, &prices, &CostOptions::default());
            #[allow(clippy::cast_precision_loss)]
            let want: f64 = rows.iter().map(|(g, e)| *g as f64 * *e as f64 / 3600.0).sum();
            proptest::prop_assert!((r.total.gpu_hours - want).abs() < 1e-6 * want.max(1.0));
            // 1 per GPU-hour on demand at 8 per 8-GPU node hour.
            proptest::prop_assert!((r.total.cost - want).abs() < 1e-6 * want.max(1.0));
            let users: f64 = r.by_user.iter().map(|g| g.gpu_hours).sum();
            proptest::prop_assert!((users - want).abs() < 1e-6 * want.max(1.0));
        }
    }
}
