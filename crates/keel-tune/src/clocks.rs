//! GPU clocks for a job: raise every GPU to its maximum supported clocks
//! before the job (`prolog`) and put back exactly what was there after it
//! (`epilog`).
//!
//! - Method per GPU: application clocks where the GPU has them (the
//!   highest supported memory clock and the highest graphics clock NVML
//!   lists for it), locked GPU clocks (and locked memory clocks where they
//!   switch at run time) otherwise. Each reset undoes only its own setting
//!   (`ResetApplicationsClocks` undoes application clocks,
//!   `ResetGpuLockedClocks` a GPU lock), so the epilog undoes what the
//!   prolog's method set and nothing else.
//! - The prior state of every GPU the prolog will change is written to the
//!   state file (atomically, mode 0600) before the first change, so a
//!   crash between a change and its record cannot happen: the epilog finds
//!   the record of every GPU that may have changed. A second prolog keeps
//!   the first one's record of the original state.
//! - The epilog restores each recorded GPU (a setting equal to the
//!   recorded one is left alone, so it is idempotent) and removes the state
//!   file when every GPU is restored; without a state file it changes
//!   nothing.
//! - Power limits, persistence mode and compute mode are never touched.

use std::path::{Path, PathBuf};

use keel_gpu::clocks::{
    ClockCaps, ClockControl, ClockPair, ClockState, ControlError, ControlledGpu, Lock, Range,
};
use serde::{Deserialize, Serialize};

/// The state file's format version.
pub const STATE_VERSION: u32 = 1;

/// Where the prolog records the prior clocks by default.
pub const DEFAULT_STATE_FILE: &str = "/var/lib/keel/tune-clocks.json";

#[derive(Debug, thiserror::Error)]
pub enum ClocksError {
    #[error("cannot list the GPUs")]
    List(#[source] ControlError),
    #[error(transparent)]
    Fs(#[from] keel_fs::FsError),
    #[error("{path} is not a keel clock state file: {message}")]
    State { path: PathBuf, message: String },
    #[error("--slurm-gpus: {0}")]
    GpuIds(#[from] keel_topo::GpuIdError),
}

/// How a GPU's clocks are raised.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Method {
    /// `nvmlDeviceSetApplicationsClocks`, undone by
    /// `nvmlDeviceResetApplicationsClocks`.
    Applications,
    /// `nvmlDeviceSetGpuLockedClocks` (and `SetMemoryLockedClocks` where
    /// memory clocks switch at run time), undone by their resets.
    Locked,
}

/// The record of one GPU in the state file.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct GpuRecord {
    pub index: u32,
    pub pci_bus_id: String,
    pub method: Method,
    /// The state before keel's first prolog.
    pub prior: ClockState,
    /// Default application clocks (what a reset of them gives).
    pub default_applications: Option<ClockPair>,
    /// Whether the prolog locks memory clocks too.
    pub lock_memory: bool,
}

/// The state file: the prior clocks of every GPU the prolog changes.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct StateFile {
    pub version: u32,
    pub gpus: Vec<GpuRecord>,
}

impl StateFile {
    /// The state file at `path`, `None` when there is none.
    pub fn load(path: &Path) -> Result<Option<Self>, ClocksError> {
        let Some(bytes) = keel_fs::read_optional(path)? else {
            return Ok(None);
        };
        let bad = |message: String| ClocksError::State {
            path: path.to_owned(),
            message,
        };
        let s: StateFile = serde_json::from_slice(&bytes).map_err(|e| bad(e.to_string()))?;
        if s.version != STATE_VERSION {
            return Err(bad(format!(
                "version {} (this keel writes {STATE_VERSION})",
                s.version
            )));
        }
        Ok(Some(s))
    }

    /// Replaces the file at `path` (0600, atomic, synced).
    pub fn store(&self, path: &Path) -> Result<(), ClocksError> {
        if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
            std::fs::create_dir_all(dir).map_err(|source| keel_fs::FsError::Write {
                path: dir.to_owned(),
                source,
            })?;
        }
        let mut bytes = serde_json::to_vec_pretty(self).map_err(|e| ClocksError::State {
            path: path.to_owned(),
            message: e.to_string(),
        })?;
        bytes.push(b'\n');
        keel_fs::write_atomic(path, &bytes, 0o600)?;
        Ok(())
    }

    fn record(&self, pci: &str) -> Option<&GpuRecord> {
        self.gpus.iter().find(|r| r.pci_bus_id == pci)
    }
}

/// One setting to change.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum Action {
    SetApplications { pair: ClockPair },
    ResetApplications,
    LockGpu { range: Range },
    ResetGpuLock,
    LockMemory { range: Range },
    ResetMemoryLock,
}

impl Action {
    /// What is changed, for logs.
    pub fn what(&self) -> &'static str {
        match self {
            Self::SetApplications { .. } | Self::ResetApplications => "application clocks",
            Self::LockGpu { .. } | Self::ResetGpuLock => "locked GPU clocks",
            Self::LockMemory { .. } | Self::ResetMemoryLock => "locked memory clocks",
        }
    }

    /// The value after the change, for logs.
    pub fn after(&self, default_applications: Option<ClockPair>) -> String {
        match self {
            Self::SetApplications { pair } => pair.to_string(),
            Self::ResetApplications => {
                default_applications.map_or("the default".to_owned(), |p| format!("{p} (default)"))
            }
            Self::LockGpu { range } | Self::LockMemory { range } => format!("locked {range}"),
            Self::ResetGpuLock | Self::ResetMemoryLock => "unlocked".to_owned(),
        }
    }

    fn run(&self, ctl: &mut dyn ClockControl, gpu: u32) -> Result<(), ControlError> {
        match *self {
            Self::SetApplications { pair } => ctl.set_applications_clocks(gpu, pair),
            Self::ResetApplications => ctl.reset_applications_clocks(gpu),
            Self::LockGpu { range } => ctl.set_locked_gpu_clocks(gpu, range),
            Self::ResetGpuLock => ctl.reset_locked_gpu_clocks(gpu),
            Self::LockMemory { range } => ctl.set_locked_memory_clocks(gpu, range),
            Self::ResetMemoryLock => ctl.reset_locked_memory_clocks(gpu),
        }
    }
}

/// A planned or made change: what, before, after and how it went.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Change {
    pub gpu: u32,
    pub pci_bus_id: String,
    pub action: Action,
    pub what: &'static str,
    pub before: String,
    pub after: String,
    /// `None`: planned only (dry run, or not reached after a failure);
    /// `Some(true)`: made.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub done: Option<bool>,
    /// Why the change failed.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub error: Option<String>,
}

/// The outcome for one GPU.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum GpuStatus {
    /// Changed (or, in a dry run, would change).
    Changed,
    /// Already as wanted.
    Unchanged,
    /// Unsupported, no permission or unreadable: keel cannot tell or act.
    Unknown,
    /// A call failed for another reason.
    Failed,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct GpuOutcome {
    pub gpu: u32,
    pub pci_bus_id: String,
    pub name: Option<String>,
    pub method: Option<Method>,
    pub status: GpuStatus,
    pub detail: String,
    pub changes: Vec<Change>,
}

/// What a prolog or epilog did (or would do).
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Report {
    pub applied: bool,
    pub state_file: PathBuf,
    /// A sentence about the state file (recorded, kept, removed, absent).
    pub state: String,
    pub gpus: Vec<GpuOutcome>,
}

impl Report {
    pub fn any(&self, status: GpuStatus) -> bool {
        self.gpus.iter().any(|g| g.status == status)
    }
}

/// The pair application clocks are raised to: the highest supported
/// memory clock and the highest graphics clock listed for it (within the
/// maximum where NVML gives one).
pub fn best_applications(caps: &ClockCaps) -> Option<ClockPair> {
    let (mem, grs) = caps.supported.iter().max_by_key(|(m, _)| *m)?;
    let gr = grs
        .iter()
        .copied()
        .filter(|g| caps.max_graphics_mhz.is_none_or(|max| *g <= max))
        .max()?;
    Some(ClockPair {
        graphics_mhz: gr,
        memory_mhz: *mem,
    })
}

/// The method and the actions that raise one GPU's clocks from `state`.
fn raise(caps: &ClockCaps, state: &ClockState) -> Result<(Method, bool, Vec<Action>), String> {
    if caps.applications {
        let Some(pair) = best_applications(caps) else {
            return Err("NVML lists no supported application clocks".into());
        };
        let actions = if state.applications == Some(pair) {
            vec![]
        } else {
            vec![Action::SetApplications { pair }]
        };
        return Ok((Method::Applications, false, actions));
    }
    if caps.lock_gpu {
        let Some(max) = caps.max_graphics_mhz else {
            return Err("the maximum graphics clock could not be read".into());
        };
        let range = Range {
            min_mhz: max,
            max_mhz: max,
        };
        let mut actions = Vec::new();
        if state.locked_gpu != Lock::Locked(range) {
            actions.push(Action::LockGpu { range });
        }
        let lock_memory = caps.lock_memory && caps.max_memory_mhz.is_some();
        if let (true, Some(mem)) = (lock_memory, caps.max_memory_mhz) {
            let range = Range {
                min_mhz: mem,
                max_mhz: mem,
            };
            if state.locked_memory != Lock::Locked(range) {
                actions.push(Action::LockMemory { range });
            }
        }
        return Ok((Method::Locked, lock_memory, actions));
    }
    Err("the GPU supports neither application clocks nor locked clocks".into())
}

/// The actions that bring a GPU from `now` back to its record.
fn restore(rec: &GpuRecord, now: Option<&ClockState>) -> Vec<Action> {
    let mut actions = Vec::new();
    match rec.method {
        Method::Applications => {
            let Some(prior) = rec.prior.applications else {
                return actions;
            };
            if now.and_then(|n| n.applications) == Some(prior) {
                return actions;
            }
            if Some(prior) == rec.default_applications {
                actions.push(Action::ResetApplications);
            } else {
                actions.push(Action::SetApplications { pair: prior });
            }
        }
        Method::Locked => {
            let lock = |prior: Lock, now: Option<Lock>, set: fn(Range) -> Action, reset: Action| {
                match prior {
                    Lock::Locked(r) if now != Some(Lock::Locked(r)) => Some(set(r)),
                    Lock::Locked(_) => None,
                    // An unknown prior lock is reset: NVML cannot read a lock
                    // set before keel's prolog (docs/tune.md).
                    Lock::Unlocked | Lock::Unknown if now == Some(Lock::Unlocked) => None,
                    Lock::Unlocked | Lock::Unknown => Some(reset),
                }
            };
            if let Some(a) = lock(
                rec.prior.locked_gpu,
                now.map(|n| n.locked_gpu),
                |range| Action::LockGpu { range },
                Action::ResetGpuLock,
            ) {
                actions.push(a);
            }
            if rec.lock_memory {
                if let Some(a) = lock(
                    rec.prior.locked_memory,
                    now.map(|n| n.locked_memory),
                    |range| Action::LockMemory { range },
                    Action::ResetMemoryLock,
                ) {
                    actions.push(a);
                }
            }
        }
    }
    actions
}

fn before_text(a: &Action, state: Option<&ClockState>) -> String {
    let Some(s) = state else {
        return "unknown".into();
    };
    match a {
        Action::SetApplications { .. } | Action::ResetApplications => s
            .applications
            .map_or("unknown".to_owned(), |p| p.to_string()),
        Action::LockGpu { .. } | Action::ResetGpuLock => s.locked_gpu.to_string(),
        Action::LockMemory { .. } | Action::ResetMemoryLock => s.locked_memory.to_string(),
    }
}

/// The state file's lock (its directory created first).
fn lock(path: &Path) -> Result<keel_fs::Lock, ClocksError> {
    if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
        std::fs::create_dir_all(dir).map_err(|source| keel_fs::FsError::Write {
            path: dir.to_owned(),
            source,
        })?;
    }
    Ok(keel_fs::Lock::exclusive(path)?)
}

/// Options for [`prolog`] and [`epilog`].
#[derive(Debug, Clone)]
pub struct Options {
    pub state_file: PathBuf,
    /// Change the GPUs; otherwise only plan.
    pub apply: bool,
    /// Only these GPUs (NVML indices); empty: all.
    pub only: Vec<u32>,
}

/// The NVML indices of the GPUs Slurm names by `ids` (`SLURM_JOB_GPUS`):
/// device minors (gres.conf `File=/dev/nvidiaN`, as CycleCloud writes it)
/// or NVML indices (`AutoDetect=nvml`), per `kind`. NVML's GPUs are joined
/// with the driver's minors (`procfs`, by PCI address) through keel-topo's
/// `GpuIds`; an id that names no GPU is an error, never another GPU.
pub fn slurm_gpus(
    ctl: &dyn ClockControl,
    procfs: &std::collections::BTreeMap<keel_topo::PciAddr, u32>,
    ids: &[u32],
    kind: keel_topo::IdKind,
) -> Result<Vec<u32>, ClocksError> {
    let gpus = ctl.gpus().map_err(ClocksError::List)?;
    let map = keel_topo::GpuIds::new(
        gpus.iter().map(|g| (g.index, g.pci_bus_id.clone(), None)),
        procfs,
    );
    Ok(map.to_indices(ids, kind)?)
}

fn selected(ctl: &dyn ClockControl, only: &[u32]) -> Result<Vec<ControlledGpu>, ClocksError> {
    let gpus = ctl.gpus().map_err(ClocksError::List)?;
    Ok(gpus
        .into_iter()
        .filter(|g| only.is_empty() || only.contains(&g.index))
        .collect())
}

fn outcome(
    g: &ControlledGpu,
    method: Option<Method>,
    status: GpuStatus,
    detail: String,
) -> GpuOutcome {
    GpuOutcome {
        gpu: g.index,
        pci_bus_id: g.pci_bus_id.clone(),
        name: g.name.clone(),
        method,
        status,
        detail,
        changes: vec![],
    }
}

fn error_status(e: &ControlError) -> GpuStatus {
    if e.is_unknown() {
        GpuStatus::Unknown
    } else {
        GpuStatus::Failed
    }
}

/// Runs `changes` in order, stopping at the first failure; the outcome's
/// status says how it went.
fn run_changes(ctl: &mut dyn ClockControl, out: &mut GpuOutcome) {
    for c in &mut out.changes {
        match c.action.run(ctl, c.gpu) {
            Ok(()) => c.done = Some(true),
            Err(e) => {
                out.status = error_status(&e);
                out.detail = e.to_string();
                c.done = Some(false);
                c.error = Some(e.to_string());
                return;
            }
        }
    }
}

/// The prolog: raises every (selected) GPU's clocks to the maximum, after
/// recording each one's prior state. Dry run unless `opts.apply`.
pub fn prolog(ctl: &mut dyn ClockControl, opts: &Options) -> Result<Report, ClocksError> {
    // Prologs and epilogs of jobs sharing a node may run at once: each
    // read-modify-write of the state file holds its lock.
    let _lock = if opts.apply {
        Some(lock(&opts.state_file)?)
    } else {
        None
    };
    let existing = StateFile::load(&opts.state_file)?;
    let mut state = existing.clone().unwrap_or(StateFile {
        version: STATE_VERSION,
        gpus: vec![],
    });
    let mut outcomes = Vec::new();
    for g in selected(ctl, &opts.only)? {
        let read = ctl
            .caps(g.index)
            .and_then(|c| ctl.state(g.index).map(|s| (c, s)));
        let (caps, now) = match read {
            Ok(x) => x,
            Err(e) => {
                outcomes.push(outcome(&g, None, error_status(&e), e.to_string()));
                continue;
            }
        };
        let (method, lock_memory, actions) = match raise(&caps, &now) {
            Ok(x) => x,
            Err(why) => {
                outcomes.push(outcome(&g, None, GpuStatus::Unknown, why));
                continue;
            }
        };
        let mut o = outcome(&g, Some(method), GpuStatus::Unchanged, String::new());
        if actions.is_empty() {
            o.detail = "already at the maximum supported clocks".into();
            outcomes.push(o);
            continue;
        }
        o.status = GpuStatus::Changed;
        o.detail = match &state.record(&g.pci_bus_id) {
            Some(_) => "raised; the original state recorded earlier is kept".into(),
            None => "raised; the prior state is recorded first".into(),
        };
        if state.record(&g.pci_bus_id).is_none() {
            state.gpus.push(GpuRecord {
                index: g.index,
                pci_bus_id: g.pci_bus_id.clone(),
                method,
                prior: now,
                default_applications: caps.default_applications,
                lock_memory,
            });
        }
        o.changes = actions
            .iter()
            .map(|a| Change {
                gpu: g.index,
                pci_bus_id: g.pci_bus_id.clone(),
                action: a.clone(),
                what: a.what(),
                before: before_text(a, Some(&now)),
                after: a.after(caps.default_applications),
                done: None,
                error: None,
            })
            .collect();
        outcomes.push(o);
    }
    let changing = outcomes.iter().any(|o| o.status == GpuStatus::Changed);
    let state_note;
    if opts.apply && changing {
        // Record first: a crash after any change leaves a record of it.
        if existing.as_ref() != Some(&state) {
            state.store(&opts.state_file)?;
            state_note = "prior state recorded".to_owned();
        } else {
            state_note = "the original state recorded earlier is kept".to_owned();
        }
        for o in outcomes
            .iter_mut()
            .filter(|o| o.status == GpuStatus::Changed)
        {
            run_changes(ctl, o);
        }
    } else if changing {
        state_note = "dry run: the prior state would be recorded before any change".to_owned();
    } else {
        state_note = "nothing to change, nothing recorded".to_owned();
    }
    Ok(Report {
        applied: opts.apply,
        state_file: opts.state_file.clone(),
        state: state_note,
        gpus: outcomes,
    })
}

/// The epilog: restores every recorded GPU to its recorded state and
/// removes the state file once all are restored. Without a state file it
/// changes nothing. Dry run unless `opts.apply`.
pub fn epilog(ctl: &mut dyn ClockControl, opts: &Options) -> Result<Report, ClocksError> {
    let _lock = if opts.apply && opts.state_file.exists() {
        Some(lock(&opts.state_file)?)
    } else {
        None
    };
    let Some(state) = StateFile::load(&opts.state_file)? else {
        return Ok(Report {
            applied: opts.apply,
            state_file: opts.state_file.clone(),
            state: "no state file: nothing was recorded, nothing changed".into(),
            gpus: vec![],
        });
    };
    let gpus = selected(ctl, &opts.only)?;
    let mut outcomes = Vec::new();
    for rec in &state.gpus {
        let g = match gpus.iter().find(|g| g.pci_bus_id == rec.pci_bus_id) {
            Some(g) => g.clone(),
            None if !opts.only.is_empty() => continue,
            None => {
                let g = ControlledGpu {
                    index: rec.index,
                    pci_bus_id: rec.pci_bus_id.clone(),
                    name: None,
                };
                outcomes.push(outcome(
                    &g,
                    Some(rec.method),
                    GpuStatus::Unknown,
                    "recorded GPU not found by NVML".into(),
                ));
                continue;
            }
        };
        let now = ctl.state(g.index).ok();
        let actions = restore(rec, now.as_ref());
        let mut o = outcome(&g, Some(rec.method), GpuStatus::Unchanged, String::new());
        if actions.is_empty() {
            o.detail = "already in its recorded state".into();
        } else {
            o.status = GpuStatus::Changed;
            o.detail = "restored to its recorded state".into();
            o.changes = actions
                .iter()
                .map(|a| Change {
                    gpu: g.index,
                    pci_bus_id: g.pci_bus_id.clone(),
                    action: a.clone(),
                    what: a.what(),
                    before: before_text(a, now.as_ref()),
                    after: a.after(rec.default_applications),
                    done: None,
                    error: None,
                })
                .collect();
            if opts.apply {
                run_changes(ctl, &mut o);
            }
        }
        outcomes.push(o);
    }
    let restored = outcomes
        .iter()
        .all(|o| matches!(o.status, GpuStatus::Changed | GpuStatus::Unchanged));
    let covers_all = opts.only.is_empty();
    let note = if !opts.apply {
        "dry run: the state file is kept".to_owned()
    } else if restored && covers_all {
        std::fs::remove_file(&opts.state_file).map_err(|source| keel_fs::FsError::Write {
            path: opts.state_file.clone(),
            source,
        })?;
        if let Some(dir) = opts
            .state_file
            .parent()
            .filter(|d| !d.as_os_str().is_empty())
        {
            let _ = keel_fs::sync_dir(dir);
        }
        "every GPU restored; state file removed".to_owned()
    } else if restored {
        "the selected GPUs restored; the state file is kept for the others".to_owned()
    } else {
        "not every GPU was restored: the state file is kept for the next reset".to_owned()
    };
    Ok(Report {
        applied: opts.apply,
        state_file: opts.state_file.clone(),
        state: note,
        gpus: outcomes,
    })
}

impl keel_error::HasKind for ClocksError {
    fn kind(&self) -> keel_error::ErrorKind {
        use keel_error::ErrorKind as K;
        match self {
            Self::List(c) if c.is_unknown() => K::Unavailable,
            Self::List(_) => K::Failed,
            Self::Fs(_) => K::Io,
            Self::State { .. } => K::Input,
            Self::GpuIds(_) => K::Usage,
        }
    }
}
