//! Reading what the checks need from a node, each read with a timeout.

use std::collections::BTreeMap;
use std::io::{self, Read};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};

use keel_gpu::{GpuError, GpuProbe, GpuReading, GpuSnapshot};
use keel_topo::{Machine, Root};

use crate::kmsg::{self, Record};
use crate::with_timeout;

/// What the checks look at.
#[derive(Debug, Clone)]
pub struct Inputs {
    /// The machine layout, or why it could not be read.
    pub machine: Result<Machine, String>,
    /// The GPUs as NVML sees them, or why NVML could not be read.
    pub gpu: Result<GpuSnapshot, GpuUnavailable>,
    pub host: HostFacts,
    /// Counters from the previous run on this node, for growth checks.
    pub previous: Option<State>,
    /// How long the GPUs' clocks were watched because one held its clock
    /// at or above the default application clock with no process (a GPU
    /// just left by a job keeps its boost clock for a while); `None` when
    /// no GPU needed watching or the snapshot was recorded.
    pub clock_watch: Option<Duration>,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GpuUnavailable {
    /// `NVML_UNAVAILABLE`, `NVML_TIMEOUT`, `NVML_ERROR`.
    pub code: &'static str,
    pub message: String,
}

impl From<GpuError> for GpuUnavailable {
    fn from(e: GpuError) -> Self {
        let code = match e {
            GpuError::Unavailable { .. } => "NVML_UNAVAILABLE",
            GpuError::Timeout { .. } => "NVML_TIMEOUT",
            _ => "NVML_ERROR",
        };
        Self {
            code,
            message: e.to_string(),
        }
    }
}

/// Host facts from procfs, the kernel log and the file systems.
#[derive(Debug, Clone)]
pub struct HostFacts {
    pub hostname: Option<String>,
    pub boot_id: Option<String>,
    /// Seconds since boot: "now" for kernel-log windows.
    pub uptime_s: Option<f64>,
    pub mem_total_bytes: Option<u64>,
    pub swap_total_bytes: Option<u64>,
    /// Loaded kernel modules, or why they could not be read.
    pub modules: Result<Vec<String>, String>,
    /// Kernel log records, or why the log could not be read.
    pub kernel_log: Result<Vec<Record>, String>,
    /// Free bytes per mount point, or why it could not be read.
    pub disk_free: BTreeMap<String, Result<u64, String>>,
}

/// Counters remembered between runs (the state file).
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct State {
    pub version: u32,
    pub boot_id: Option<String>,
    /// PCIe replay counter per GPU PCI address.
    pub pcie_replay: BTreeMap<String, u64>,
}

impl State {
    pub fn from_inputs(inputs: &Inputs) -> State {
        let mut pcie_replay = BTreeMap::new();
        if let Ok(snap) = &inputs.gpu {
            for g in &snap.gpus {
                if let Some(c) = g.pcie.replay_counter {
                    pcie_replay.insert(g.pci_bus_id.clone(), c);
                }
            }
        }
        State {
            version: 1,
            boot_id: inputs.host.boot_id.clone(),
            pcie_replay,
        }
    }
}

#[derive(Debug, Clone)]
pub struct GatherOptions {
    /// Time allowed for each read (the machine layout, the kernel log, each
    /// file system).
    pub timeout: Duration,
    /// Mount points whose free space is checked.
    pub mounts: Vec<String>,
    /// The state file from the previous run, if any.
    pub state_file: Option<PathBuf>,
    /// How long to watch a GPU that holds its clock with no process before
    /// it counts as locked (the snapshot is read again every
    /// `clock_poll`); zero: judge the first snapshot.
    pub clock_settle: Duration,
    pub clock_poll: Duration,
}

/// Whether a GPU with no process holds its graphics clock at or above the
/// default application clock: locked clocks, or the boost of a workload
/// that has just ended (which falls within seconds).
pub fn clock_held_without_process(g: &GpuReading) -> bool {
    let no_process = g.processes.as_ref().is_some_and(|p| p.is_empty());
    let held = g.clocks.is_some_and(|c| {
        c.graphics_mhz
            .zip(c.default_app_graphics_mhz)
            .is_some_and(|(cur, default)| cur >= default)
    });
    no_process && held
}

/// The GPUs' snapshot, read again while a GPU holds its clock with no
/// process, until it drops or `settle` has passed. A later read that
/// fails keeps the last good one.
fn settled_snapshot(
    probe: &dyn GpuProbe,
    opts: &GatherOptions,
) -> (Result<GpuSnapshot, GpuUnavailable>, Option<Duration>) {
    let mut snap = probe.snapshot().map_err(GpuUnavailable::from);
    let started = Instant::now();
    let mut watching = false;
    while let Ok(s) = &snap {
        if !s.gpus.iter().any(clock_held_without_process) {
            break;
        }
        let elapsed = started.elapsed();
        watching = true;
        if elapsed >= opts.clock_settle {
            break;
        }
        std::thread::sleep(opts.clock_poll.min(opts.clock_settle - elapsed));
        match probe.snapshot() {
            Ok(next) => snap = Ok(next),
            Err(_) => break,
        }
    }
    (snap, watching.then(|| started.elapsed()))
}

/// Reads everything the passive checks need from the node under `root`.
pub fn gather(root: &Path, probe: &dyn GpuProbe, opts: &GatherOptions) -> Inputs {
    let base = root.to_path_buf();
    let machine = match with_timeout(opts.timeout, move || {
        keel_topo::read_machine(&Root::new(base)).map_err(|e| keel_error::one_line(&e))
    }) {
        Some(r) => r,
        None => Err(format!(
            "reading sysfs did not finish within {:?}",
            opts.timeout
        )),
    };
    let (gpu, clock_watch) = settled_snapshot(probe, opts);
    let host = gather_host(root, opts);
    let previous = opts.state_file.clone().and_then(|f| {
        with_timeout(opts.timeout, move || {
            let text = std::fs::read_to_string(f).ok()?;
            serde_json::from_str::<State>(&text).ok()
        })
        .flatten()
    });
    Inputs {
        machine,
        gpu,
        host,
        previous,
        clock_watch,
    }
}

fn read_small(root: &Path, rel: &str) -> Option<String> {
    std::fs::read_to_string(root.join(rel)).ok()
}

/// The small procfs files, read together on one thread under the timeout.
struct Small {
    meminfo: String,
    modules: Result<Vec<String>, String>,
    hostname: Option<String>,
    boot_id: Option<String>,
    uptime: Option<String>,
}

fn gather_host(root: &Path, opts: &GatherOptions) -> HostFacts {
    let base = root.to_path_buf();
    let small = with_timeout(opts.timeout, move || {
        let modules_path = base.join("proc/modules");
        Small {
            meminfo: read_small(&base, "proc/meminfo").unwrap_or_default(),
            modules: match std::fs::read_to_string(&modules_path) {
                Ok(s) => Ok(s
                    .lines()
                    .filter_map(|l| l.split_whitespace().next().map(str::to_owned))
                    .collect()),
                Err(e) => Err(format!("cannot read {}: {e}", modules_path.display())),
            },
            hostname: read_small(&base, "proc/sys/kernel/hostname"),
            boot_id: read_small(&base, "proc/sys/kernel/random/boot_id"),
            uptime: read_small(&base, "proc/uptime"),
        }
    })
    .unwrap_or_else(|| Small {
        meminfo: String::new(),
        modules: Err(format!(
            "reading /proc did not finish within {:?}",
            opts.timeout
        )),
        hostname: None,
        boot_id: None,
        uptime: None,
    });
    let meminfo = small.meminfo;
    let kb = |key: &str| -> Option<u64> {
        meminfo.lines().find_map(|l| {
            let rest = l.strip_prefix(key)?.strip_prefix(':')?;
            let mut w = rest.split_whitespace();
            let v: u64 = w.next()?.parse().ok()?;
            (w.next() == Some("kB")).then_some(v.checked_mul(1024)?)
        })
    };
    let modules = small.modules;
    let kmsg_path = root.join("dev/kmsg");
    let kernel_log = match with_timeout(opts.timeout, move || read_kmsg(&kmsg_path)) {
        Some(Ok(text)) => Ok(kmsg::parse(&text)),
        Some(Err(e)) => Err(e),
        None => Err(format!(
            "reading the kernel log did not finish within {:?}",
            opts.timeout
        )),
    };
    HostFacts {
        hostname: small
            .hostname
            .map(|s| s.trim().to_owned())
            .filter(|s| !s.is_empty()),
        boot_id: small.boot_id.map(|s| s.trim().to_owned()),
        uptime_s: small
            .uptime
            .and_then(|s| s.split_whitespace().next()?.parse().ok()),
        mem_total_bytes: kb("MemTotal"),
        swap_total_bytes: kb("SwapTotal"),
        modules,
        kernel_log,
        disk_free: disk_free(root, opts),
    }
}

/// The file in a recorded machine root (`keel topo snapshot`) that holds
/// the free space of its mounts when it was recorded: free space is not a
/// file the kernel shows, so a recording keeps what statvfs(2) said.
pub const DISK_RECORD: &str = "statvfs.json";

/// [`DISK_RECORD`]'s content: free bytes (available to an unprivileged
/// user) per mount point. A mount whose statvfs did not answer is absent.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct DiskRecord {
    pub schema: u32,
    pub free_bytes: BTreeMap<String, u64>,
}

/// Free space on each of `opts.mounts` (under the root), each statvfs with
/// the timeout: a hung network mount makes that mount unknown, no more.
///
/// A recorded root (any root but `/` that holds [`DISK_RECORD`]) is judged
/// by what was recorded, never by the free space of the disk the recording
/// now lies on; a mount it did not record is unknown.
pub fn disk_free(root: &Path, opts: &GatherOptions) -> BTreeMap<String, Result<u64, String>> {
    if root != Path::new("/") {
        let record = root.join(DISK_RECORD);
        if record.exists() {
            let read = read_disk_record(&record, opts.timeout);
            return opts
                .mounts
                .iter()
                .map(|m| {
                    let r =
                        match &read {
                            Err(e) => Err(e.clone()),
                            Ok(d) => d.free_bytes.get(m).copied().ok_or_else(|| {
                                format!("{m} is not recorded in {}", record.display())
                            }),
                        };
                    (m.clone(), r)
                })
                .collect();
        }
    }
    let mut disk_free = BTreeMap::new();
    for mount in &opts.mounts {
        let path = root.join(mount.trim_start_matches('/'));
        let shown = mount.clone();
        let r = match with_timeout(opts.timeout, move || free_bytes(&path)) {
            Some(r) => r,
            None => Err(format!(
                "statvfs({shown}) did not finish within {:?}",
                opts.timeout
            )),
        };
        disk_free.insert(mount.clone(), r);
    }
    disk_free
}

/// Reads a disk record: a regular file (opened without blocking, so a FIFO
/// planted at its name cannot hold the check) of at most 1 MiB, within
/// `timeout`.
fn read_disk_record(path: &Path, timeout: Duration) -> Result<DiskRecord, String> {
    const MAX: u64 = 1 << 20;
    let p = path.to_owned();
    let text = with_timeout(timeout, move || -> Result<String, String> {
        use std::os::unix::fs::OpenOptionsExt;
        const O_NONBLOCK: i32 = 0o4000;
        let cannot = |e: io::Error| format!("cannot read {}: {e}", p.display());
        let f = std::fs::OpenOptions::new()
            .read(true)
            .custom_flags(O_NONBLOCK)
            .open(&p)
            .map_err(cannot)?;
        if !f.metadata().map_err(cannot)?.is_file() {
            return Err(format!("{} is not a regular file", p.display()));
        }
        let mut text = String::new();
        f.take(MAX + 1).read_to_string(&mut text).map_err(cannot)?;
        if text.len() as u64 > MAX {
            return Err(format!("{} is larger than {MAX} bytes", p.display()));
        }
        Ok(text)
    })
    .unwrap_or_else(|| {
        Err(format!(
            "{} was not read within {:?}",
            path.display(),
            timeout
        ))
    })?;
    let d: DiskRecord = serde_json::from_str(&text)
        .map_err(|e| format!("{} is not a disk record: {e}", path.display()))?;
    if d.schema != 1 {
        return Err(format!(
            "{} has schema {}; this keel reads schema 1",
            path.display(),
            d.schema
        ));
    }
    Ok(d)
}

/// A mount point as `proc/mounts` writes it, its octal escapes (`\040`
/// space, `\011` tab, `\012` newline, `\134` backslash) decoded; `None`
/// for one that is not an absolute path of plain names.
fn mount_point(field: &str) -> Option<String> {
    let b = field.as_bytes();
    let mut out = Vec::with_capacity(b.len());
    let mut i = 0;
    while i < b.len() {
        let escape = b
            .get(i + 1..i + 4)
            .filter(|d| d.iter().all(|c| (b'0'..=b'7').contains(c)));
        match escape {
            Some(d) if b[i] == b'\\' => {
                let v = d.iter().fold(0u32, |v, c| v * 8 + u32::from(c - b'0'));
                out.push(u8::try_from(v).ok()?);
                i += 4;
            }
            _ => {
                out.push(b[i]);
                i += 1;
            }
        }
    }
    let s = String::from_utf8(out).ok()?;
    let plain = Path::new(&s)
        .components()
        .enumerate()
        .all(|(n, c)| match c {
            std::path::Component::RootDir => n == 0,
            std::path::Component::Normal(_) => n > 0,
            _ => false,
        });
    (s.starts_with('/') && plain).then_some(s)
}

/// File systems with no disk behind them, left out of a recording.
const PSEUDO_FS: &[&str] = &[
    "proc",
    "sysfs",
    "devtmpfs",
    "devpts",
    "cgroup",
    "cgroup2",
    "securityfs",
    "debugfs",
    "tracefs",
    "configfs",
    "fusectl",
    "pstore",
    "bpf",
    "mqueue",
    "hugetlbfs",
    "autofs",
    "binfmt_misc",
    "efivarfs",
    "rpc_pipefs",
    "nsfs",
    "ramfs",
    "squashfs",
    "overlay",
    "tmpfs",
];

/// For a snapshot of the node: the free space of `/` and of every mount in
/// `root/proc/mounts` with a disk behind it, each statvfs bounded by
/// `timeout`. Returns the record and a line for each mount left out.
pub fn disk_record_for_snapshot(root: &Path, timeout: Duration) -> (DiskRecord, Vec<String>) {
    let mut mounts = vec!["/".to_owned()];
    if let Ok(text) = std::fs::read_to_string(root.join("proc/mounts")) {
        for line in text.lines() {
            let f: Vec<&str> = line.split_whitespace().collect();
            if f.len() < 3 || PSEUDO_FS.contains(&f[2]) {
                continue;
            }
            if let Some(m) = mount_point(f[1]).filter(|m| !mounts.contains(m)) {
                mounts.push(m);
            }
        }
    }
    let mut record = DiskRecord {
        schema: 1,
        free_bytes: BTreeMap::new(),
    };
    let mut left_out = Vec::new();
    for (mount, r) in disk_free(
        root,
        &GatherOptions {
            timeout,
            mounts,
            state_file: None,
            clock_settle: Duration::ZERO,
            clock_poll: Duration::ZERO,
        },
    ) {
        match r {
            Ok(free) => {
                record.free_bytes.insert(mount, free);
            }
            Err(e) => left_out.push(e),
        }
    }
    (record, left_out)
}

/// The kernel log records checks read (XIDs, carrier losses) from
/// `root/dev/kmsg`, for a snapshot of the node: `Err` when the log cannot
/// be read (not root, no such file) or did not answer within `timeout`.
pub fn kernel_log_for_snapshot(root: &Path, timeout: Duration) -> Result<String, String> {
    let path = root.join("dev/kmsg");
    match crate::with_timeout(timeout, move || read_kmsg(&path)) {
        Some(Ok(text)) => Ok(kmsg::relevant(&text)),
        Some(Err(e)) => Err(e),
        None => Err(format!(
            "the kernel log did not answer within {} s",
            timeout.as_secs_f64()
        )),
    }
}

/// Reads the kernel log. `/dev/kmsg` hands out one record per read and
/// would block at the end, so it is opened non-blocking; a regular file (a
/// fixture or snapshot) is read to its end.
fn read_kmsg(path: &Path) -> Result<String, String> {
    use std::os::unix::fs::OpenOptionsExt;
    const O_NONBLOCK: i32 = 0o4000;
    const MAX: usize = 32 << 20;
    let mut f = std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(O_NONBLOCK)
        .open(path)
        .map_err(|e| format!("cannot read the kernel log {}: {e}", path.display()))?;
    let mut out = Vec::new();
    let mut buf = vec![0u8; 16 * 1024];
    loop {
        match f.read(&mut buf) {
            Ok(0) => break,
            Ok(n) => {
                out.extend_from_slice(&buf[..n]);
                if buf[n - 1] != b'\n' && n < buf.len() {
                    out.push(b'\n');
                }
                if out.len() > MAX {
                    break;
                }
            }
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => break,
            // EPIPE: older records were overwritten while reading; go on.
            Err(e) if e.raw_os_error() == Some(32) => continue,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
            Err(e) => {
                return Err(format!(
                    "cannot read the kernel log {}: {e}",
                    path.display()
                ))
            }
        }
    }
    Ok(String::from_utf8_lossy(&out).into_owned())
}

fn free_bytes(path: &Path) -> Result<u64, String> {
    let st = rustix::fs::statvfs(path).map_err(|e| format!("statvfs({}): {e}", path.display()))?;
    Ok(st.f_bavail.saturating_mul(st.f_frsize))
}

#[cfg(test)]
mod tests {
    use std::cell::RefCell;

    use keel_gpu::{ClockReading, GpuError, GpuReading, GpuSnapshot};

    use super::*;

    /// Answers with `clocks` in turn (the last one over and over).
    struct Clocks(RefCell<Vec<u32>>);

    impl GpuProbe for Clocks {
        fn snapshot(&self) -> Result<GpuSnapshot, GpuError> {
            let mut v = self.0.borrow_mut();
            let mhz = if v.len() > 1 { v.remove(0) } else { v[0] };
            Ok(GpuSnapshot {
                version: 1,
                gpus: vec![GpuReading {
                    processes: Some(Vec::new()),
                    clocks: Some(ClockReading {
                        graphics_mhz: Some(mhz),
                        default_app_graphics_mhz: Some(1980),
                        ..ClockReading::default()
                    }),
                    ..GpuReading::default()
                }],
                ..GpuSnapshot::default()
            })
        }
    }

    fn opts(settle_ms: u64) -> GatherOptions {
        GatherOptions {
            timeout: Duration::from_secs(5),
            mounts: Vec::new(),
            state_file: None,
            clock_settle: Duration::from_millis(settle_ms),
            clock_poll: Duration::from_millis(10),
        }
    }

    fn clock(snap: &Result<GpuSnapshot, GpuUnavailable>) -> Option<u32> {
        snap.as_ref().ok()?.gpus[0].clocks?.graphics_mhz
    }

    #[test]
    fn a_boost_clock_that_falls_is_read_again_until_it_has() {
        // The first read below the default application clock ends it.
        let probe = Clocks(RefCell::new(vec![1980, 1980, 1755, 345]));
        let (snap, watched) = settled_snapshot(&probe, &opts(5_000));
        assert_eq!(clock(&snap), Some(1755));
        assert!(
            watched.is_some_and(|d| d < Duration::from_secs(5)),
            "{watched:?}"
        );
    }

    #[test]
    fn a_held_clock_is_watched_for_the_settle_time_then_judged() {
        let probe = Clocks(RefCell::new(vec![1980]));
        let (snap, watched) = settled_snapshot(&probe, &opts(100));
        assert_eq!(clock(&snap), Some(1980));
        assert!(
            watched.is_some_and(|d| d >= Duration::from_millis(100)),
            "{watched:?}"
        );
    }

    #[test]
    fn an_idle_clock_or_a_busy_gpu_is_not_watched() {
        let probe = Clocks(RefCell::new(vec![345, 1980]));
        let (snap, watched) = settled_snapshot(&probe, &opts(5_000));
        assert_eq!((clock(&snap), watched), (Some(345), None));
        let mut busy = probe.snapshot().expect("snapshot").gpus.remove(0);
        busy.processes = Some(vec![keel_gpu::GpuProcess::default()]);
        assert!(!clock_held_without_process(&busy));
        busy.processes = None;
        assert!(!clock_held_without_process(&busy), "unknown processes");
    }

    #[test]
    fn zero_settle_judges_the_first_snapshot() {
        let probe = Clocks(RefCell::new(vec![1980, 345]));
        let (snap, watched) = settled_snapshot(&probe, &opts(0));
        assert_eq!(clock(&snap), Some(1980));
        assert!(watched.is_some());
    }

    fn disk_opts(mounts: &[&str]) -> GatherOptions {
        GatherOptions {
            timeout: Duration::from_secs(5),
            mounts: mounts.iter().map(|m| m.to_string()).collect(),
            state_file: None,
            clock_settle: Duration::ZERO,
            clock_poll: Duration::ZERO,
        }
    }

    #[test]
    fn a_recorded_root_is_judged_by_its_record_not_by_the_disk_it_lies_on() {
        let dir = tempfile::tempdir().expect("tempdir");
        std::fs::write(
            dir.path().join(DISK_RECORD),
            r#"{"schema": 1, "free_bytes": {"/": 5, "/mnt": 7}}"#,
        )
        .expect("write");
        let free = disk_free(dir.path(), &disk_opts(&["/", "/mnt", "/scratch"]));
        assert_eq!(free["/"], Ok(5));
        assert_eq!(free["/mnt"], Ok(7));
        let e = free["/scratch"].clone().expect_err("not recorded");
        assert!(e.contains("/scratch is not recorded"), "{e}");

        // A record keel cannot read makes every mount unknown, saying why.
        for (text, says) in [
            (r#"{"schema": 2, "free_bytes": {}}"#, "schema 2"),
            ("{", "is not a disk record"),
            (
                r#"{"schema": 1, "free_bytes": {"/": -1}}"#,
                "is not a disk record",
            ),
        ] {
            std::fs::write(dir.path().join(DISK_RECORD), text).expect("write");
            let e = disk_free(dir.path(), &disk_opts(&["/"]))["/"]
                .clone()
                .expect_err("unreadable record");
            assert!(e.contains(says), "{text}: {e}");
        }
    }

    #[test]
    fn a_root_without_a_record_is_read_with_statvfs_and_a_snapshot_records_it() {
        let dir = tempfile::tempdir().expect("tempdir");
        std::fs::create_dir_all(dir.path().join("proc")).expect("proc");
        std::fs::create_dir_all(dir.path().join("data")).expect("data");
        std::fs::write(
            dir.path().join("proc/mounts"),
            "proc /proc proc rw 0 0\n/dev/sda1 / ext4 rw 0 0\n/dev/sdb1 /data ext4 rw 0 0\n\
             tmpfs /run tmpfs rw 0 0\n/dev/sdc1 /gone ext4 rw 0 0\n",
        )
        .expect("mounts");
        let free = disk_free(dir.path(), &disk_opts(&["/"]));
        assert!(free["/"].is_ok(), "{free:?}");

        let (record, left_out) = disk_record_for_snapshot(dir.path(), Duration::from_secs(5));
        assert_eq!(record.schema, 1);
        let mounts: Vec<&str> = record.free_bytes.keys().map(String::as_str).collect();
        assert_eq!(mounts, ["/", "/data"]);
        assert_eq!(left_out.len(), 1, "{left_out:?}");
        assert!(left_out[0].contains("gone"), "{left_out:?}");
    }

    #[test]
    fn a_fifo_at_the_records_name_is_unknown_not_a_hang() {
        let dir = tempfile::tempdir().expect("tempdir");
        let fifo = dir.path().join(DISK_RECORD);
        rustix::fs::mkfifoat(
            rustix::fs::CWD,
            &fifo,
            rustix::fs::Mode::from_raw_mode(0o600),
        )
        .expect("mkfifo");
        let e = disk_free(dir.path(), &disk_opts(&["/"]))["/"]
            .clone()
            .expect_err("a fifo");
        assert!(e.contains("not a regular file"), "{e}");
    }

    #[test]
    fn mount_points_are_decoded_and_only_plain_paths_kept() {
        assert_eq!(mount_point("/").as_deref(), Some("/"));
        assert_eq!(
            mount_point("/mnt/my\\040disk").as_deref(),
            Some("/mnt/my disk")
        );
        assert_eq!(mount_point("/a\\011b\\134c").as_deref(), Some("/a\tb\\c"));
        assert_eq!(
            mount_point("/trailing\\04").as_deref(),
            Some("/trailing\\04")
        );
        for bad in ["relative", "/a/../../etc", "/bad\\777"] {
            assert_eq!(mount_point(bad), None, "{bad}");
        }
    }
}
