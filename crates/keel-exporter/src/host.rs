//! The node's own readings, under a machine root: HCA ports from sysfs,
//! XIDs from the kernel log, keel check's textfile. Each read that fails
//! leaves its reading absent; none stops the others.

use std::collections::BTreeMap;
use std::fs::File;
use std::io::{self, Read};
use std::path::{Path, PathBuf};

use keel_topo::Root;

use crate::readings::{HcaPort, XidCount, XidWindow};

/// HCA port error counters read from `ports/<n>/counters/`.
pub const HCA_ERROR_COUNTERS: &[&str] = &[
    "excessive_buffer_overrun_errors",
    "link_downed",
    "link_error_recovery",
    "local_link_integrity_errors",
    "port_rcv_constraint_errors",
    "port_rcv_errors",
    "port_rcv_remote_physical_errors",
    "port_rcv_switch_relay_errors",
    "port_xmit_constraint_errors",
    "port_xmit_discards",
    "symbol_error",
    "VL15_dropped",
];

/// Every port of every HCA under `sys/class/infiniband`; `None` when the
/// directory exists but cannot be listed.
pub fn hca_ports(root: &Root) -> Option<Vec<HcaPort>> {
    let base = Path::new("sys/class/infiniband");
    let mut out = Vec::new();
    for hca in root.list(base).ok()? {
        let ports_dir = base.join(&hca).join("ports");
        let Ok(ports) = root.list(&ports_dir) else {
            continue;
        };
        for port in ports {
            let Ok(num) = port.parse::<u32>() else {
                continue;
            };
            let p = ports_dir.join(&port);
            let attr = |name: &str| {
                root.read_attr(p.join(name))
                    .ok()
                    .flatten()
                    .map(|s| s.trim().to_owned())
            };
            // `4: ACTIVE` -> `ACTIVE`.
            let state = |name: &str| {
                attr(name).map(|s| match s.split_once(':') {
                    Some((_, word)) => word.trim().to_owned(),
                    None => s,
                })
            };
            let rate_gbps =
                attr("rate").and_then(|r| r.split_whitespace().next()?.parse::<f64>().ok());
            let mut counters = Vec::new();
            for name in HCA_ERROR_COUNTERS {
                if let Some(v) =
                    attr(&format!("counters/{name}")).and_then(|s| s.parse::<u64>().ok())
                {
                    counters.push(((*name).to_owned(), v));
                }
            }
            out.push(HcaPort {
                hca: hca.clone(),
                port: num,
                state: state("state"),
                phys_state: state("phys_state"),
                link_layer: attr("link_layer"),
                rate_gbps,
                counters,
            });
        }
    }
    Some(out)
}

/// keel check's Prometheus textfile, at most 1 MiB.
pub fn check_textfile(path: &Path) -> Result<String, String> {
    let f = File::open(path).map_err(|e| format!("cannot read {}: {e}", path.display()))?;
    let mut s = String::new();
    f.take(1 << 20)
        .read_to_string(&mut s)
        .map_err(|e| format!("cannot read {}: {e}", path.display()))?;
    Ok(s)
}

/// Counts XIDs in the kernel log as it grows. `/dev/kmsg` is opened once,
/// non-blocking; each [`XidTail::poll`] reads the records logged since the
/// last one. (A regular file, as in fixtures, is read the same way.)
#[derive(Debug)]
pub struct XidTail {
    path: PathBuf,
    file: Option<File>,
    /// The log is a character device (`/dev/kmsg`), not a regular file.
    device: bool,
    partial: Vec<u8>,
    counts: BTreeMap<(String, u32), u64>,
    /// Recent XIDs (PCI device, code, kernel time in µs), oldest first, at
    /// most [`XidTail::RECENT`] of them.
    recent: std::collections::VecDeque<(String, u32, u64)>,
    /// The last XID of each PCI device: (kernel time, code).
    last: BTreeMap<String, (u64, u32)>,
}

impl XidTail {
    /// Tails `<root>/dev/kmsg`.
    pub fn new(root: &Path) -> Self {
        Self {
            path: root.join("dev/kmsg"),
            file: None,
            device: false,
            partial: Vec::new(),
            counts: BTreeMap::new(),
            recent: std::collections::VecDeque::new(),
            last: BTreeMap::new(),
        }
    }

    /// Recent XIDs kept for [`XidTail::window`]: a log flooded with more
    /// than this many XIDs within the window shows the newest ones.
    pub const RECENT: usize = 4096;

    /// The XIDs polled so far that were logged within `window_ms` before
    /// `now_usec` (the node's uptime, the kernel log's clock), and each
    /// device's last XID.
    pub fn window(&self, now_usec: u64, window_ms: u64) -> XidWindow {
        let from = now_usec.saturating_sub(window_ms.saturating_mul(1000));
        let mut counts: BTreeMap<(String, u32), u64> = BTreeMap::new();
        for (pci, code, usec) in &self.recent {
            if *usec >= from && *usec <= now_usec {
                *counts.entry((pci.clone(), *code)).or_insert(0) += 1;
            }
        }
        XidWindow {
            window_ms,
            counts: counts
                .into_iter()
                .map(|((pci, code), count)| XidCount { pci, code, count })
                .collect(),
            last: self
                .last
                .iter()
                .map(|(pci, (_, code))| (pci.clone(), *code))
                .collect(),
        }
    }

    /// Reads what is new and returns the counts so far, or `None` when the
    /// log cannot be opened or read.
    pub fn poll(&mut self) -> Option<Vec<XidCount>> {
        use std::os::unix::fs::OpenOptionsExt;
        const O_NONBLOCK: i32 = 0o4000;
        // At most this much per poll, so a flood of log lines costs a
        // bounded amount per scrape; the rest is read next time.
        const MAX_PER_POLL: usize = 4 << 20;
        if self.file.is_none() {
            let f = std::fs::OpenOptions::new()
                .read(true)
                .custom_flags(O_NONBLOCK)
                .open(&self.path)
                .ok()?;
            self.device = f.metadata().map(|m| !m.is_file()).unwrap_or(false);
            self.file = Some(f);
        }
        let mut f = self.file.take()?;
        let mut buf = vec![0u8; 16 * 1024];
        let mut read = 0;
        loop {
            match f.read(&mut buf) {
                Ok(0) => break,
                Ok(n) => {
                    read += n;
                    self.partial.extend_from_slice(&buf[..n]);
                    // /dev/kmsg gives one record per read, without a
                    // trailing newline when the record fills the buffer.
                    if self.partial.last() != Some(&b'\n') && n < buf.len() && self.device {
                        self.partial.push(b'\n');
                    }
                    self.count_lines();
                    if read > MAX_PER_POLL {
                        break;
                    }
                }
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => break,
                // EPIPE: older records were overwritten; go on.
                Err(e) if e.raw_os_error() == Some(32) => continue,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
                Err(_) => return None,
            }
        }
        self.file = Some(f);
        Some(
            self.counts
                .iter()
                .map(|((pci, code), count)| XidCount {
                    pci: pci.clone(),
                    code: *code,
                    count: *count,
                })
                .collect(),
        )
    }

    fn count_lines(&mut self) {
        let Some(end) = self.partial.iter().rposition(|b| *b == b'\n') else {
            return;
        };
        let text = String::from_utf8_lossy(&self.partial[..=end]).into_owned();
        self.partial.drain(..=end);
        for r in keel_check::kmsg::parse(&text) {
            if let Some(x) = keel_check::kmsg::parse_xid(&r.message) {
                *self.counts.entry((x.pci.clone(), x.code)).or_insert(0) += 1;
                let last = self.last.entry(x.pci.clone()).or_insert((r.usec, x.code));
                if r.usec >= last.0 {
                    *last = (r.usec, x.code);
                }
                if self.recent.len() == Self::RECENT {
                    self.recent.pop_front();
                }
                self.recent.push_back((x.pci, x.code, r.usec));
            }
        }
    }
}

/// The node's uptime in microseconds from `proc/uptime` (the kernel log's
/// clock); `None` when it cannot be read.
pub fn uptime_usec(root: &Root) -> Option<u64> {
    let text = root.read_opt("proc/uptime").ok().flatten()?;
    let secs: f64 = text.split_whitespace().next()?.parse().ok()?;
    (secs.is_finite() && secs >= 0.0).then_some((secs * 1e6) as u64)
}
