//! What the machine allows a server, read once at start: how many files
//! the process may open and how much memory it may use. A server that
//! holds thousands of long connections (the gateway's streams) sizes its
//! connection cap from these instead of a fixed number.
//!
//! The open-file limit is raised from its soft value to the hard one
//! first ([`raise_open_files`]), as systemd's documentation asks of
//! programs that need many descriptors (the soft limit of 1024 exists for
//! programs that still use `select()`; the hard limit is what the system
//! grants: <https://0pointer.net/blog/file-descriptor-limits.html>), and
//! as Go's runtime does for every program since Go 1.19.
//!
//! Memory is the smaller of the machine's (`MemTotal` in
//! `/proc/meminfo`) and the process's cgroup limit (v2 `memory.max`, v1
//! `memory.limit_in_bytes`); a value that cannot be read is unknown, not
//! zero, and the cap then rests on what is known.

use std::path::Path;

/// The limits a server's connection cap is chosen from.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Machine {
    /// The process's open-file limit (soft), if known.
    pub open_files: Option<u64>,
    /// Memory the process may use, if known.
    pub memory_bytes: Option<u64>,
}

/// Raises the soft open-file limit to the hard limit; returns the soft
/// limit before and after (unchanged when it could not be raised).
pub fn raise_open_files() -> (Option<u64>, Option<u64>) {
    use rustix::process::{getrlimit, setrlimit, Resource, Rlimit};
    let l = getrlimit(Resource::Nofile);
    let before = l.current;
    if l.current == l.maximum {
        return (before, before);
    }
    let raised = setrlimit(
        Resource::Nofile,
        Rlimit {
            current: l.maximum,
            maximum: l.maximum,
        },
    );
    match raised {
        Ok(()) => (before, getrlimit(Resource::Nofile).current),
        Err(_) => (before, before),
    }
}

impl Machine {
    /// This process's limits, memory read under `root` (`/` normally; a
    /// fixture's root in tests).
    pub fn read(root: &Path) -> Self {
        use rustix::process::{getrlimit, Resource};
        let read = |p: &str| std::fs::read_to_string(root.join(p)).ok();
        let total = read("proc/meminfo").and_then(|s| mem_total(&s));
        let cgroup = read("proc/self/cgroup")
            .map(|s| cgroup_limit_files(&s))
            .unwrap_or_default()
            .into_iter()
            .filter_map(|p| read(&p).and_then(|s| cgroup_limit(&s)))
            .min();
        Self {
            open_files: getrlimit(Resource::Nofile).current,
            memory_bytes: match (total, cgroup) {
                (Some(t), Some(c)) => Some(t.min(c)),
                (t, c) => t.or(c),
            },
        }
    }
}

/// `MemTotal` of `/proc/meminfo`, in bytes.
pub fn mem_total(meminfo: &str) -> Option<u64> {
    let line = meminfo.lines().find(|l| l.starts_with("MemTotal:"))?;
    let mut f = line.split_whitespace().skip(1);
    let n: u64 = f.next()?.parse().ok()?;
    match f.next() {
        Some("kB") | None => n.checked_mul(1024),
        Some(_) => None,
    }
}

/// A cgroup memory limit file's value: `max` (v2) and the v1 "no limit"
/// (a page-rounded `i64::MAX`) are no limit.
pub fn cgroup_limit(text: &str) -> Option<u64> {
    let t = text.trim();
    if t == "max" {
        return None;
    }
    let n: u64 = t.parse().ok()?;
    (n < 1 << 62).then_some(n)
}

/// The memory limit files that may bound this process, relative to the
/// root, for the cgroups in `/proc/self/cgroup` (v2's `0::/path` and v1's
/// memory controller `N:memory:/path`, where cgroupfs is mounted as
/// usual): its own cgroup's, every ancestor's (a slice's or a pod's limit
/// bounds the cgroups under it), and the mount root's (a container without
/// a cgroup namespace sees its host path in `/proc/self/cgroup` but its
/// own cgroup at the mount root). Files that do not exist are skipped by
/// the caller; the smallest limit found applies.
pub fn cgroup_limit_files(self_cgroup: &str) -> Vec<String> {
    let mut out = Vec::new();
    for line in self_cgroup.lines() {
        let mut f = line.splitn(3, ':');
        let (Some(_), Some(ctrl), Some(path)) = (f.next(), f.next(), f.next()) else {
            continue;
        };
        let (base, file) = if ctrl.is_empty() {
            ("sys/fs/cgroup", "memory.max")
        } else if ctrl.split(',').any(|c| c == "memory") {
            ("sys/fs/cgroup/memory", "memory.limit_in_bytes")
        } else {
            continue;
        };
        let parts: Vec<&str> = path.trim().split('/').filter(|p| !p.is_empty()).collect();
        for n in (0..=parts.len()).rev() {
            let dir = parts[..n].join("/");
            out.push(if dir.is_empty() {
                format!("{base}/{file}")
            } else {
                format!("{base}/{dir}/{file}")
            });
        }
    }
    out
}

/// What each connection may cost, for [`connection_cap`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ConnectionCost {
    /// The most memory one connection may hold (its buffers and what its
    /// response may hold).
    pub bytes: u64,
    /// Memory held besides connections (budgets shared by all of them,
    /// the process's own).
    pub fixed_bytes: u64,
    /// Descriptors one connection needs (2 for a proxy: the client's and
    /// the backend's).
    pub files: u64,
    /// Descriptors kept for everything else (other listeners, idle
    /// backend connections, log files); a quarter of the limit where that
    /// is fewer.
    pub reserved_files: u64,
}

/// How connections are sized when the machine says nothing.
pub const FALLBACK_CONNECTIONS: usize = 1024;
/// The fewest connections a cap chosen from the machine allows.
pub const MIN_CONNECTIONS: usize = 64;
/// The share of memory connections may hold at most, in their worst case
/// all at once: a half, leaving the rest to the page cache, the other
/// processes and the allocator's own.
pub const MEMORY_SHARE: (u64, u64) = (1, 2);

/// The connections a listener can serve at once on `m`: as many as the
/// open files allow (after the reserved ones, or a quarter of the limit
/// where that is fewer, each connection taking `cost.files`) and as many
/// whose worst case fits in half of the memory
/// (after the fixed part), whichever is fewer, and at least
/// [`MIN_CONNECTIONS`]; [`FALLBACK_CONNECTIONS`] when neither is known.
pub fn connection_cap(m: &Machine, cost: &ConnectionCost) -> usize {
    let by_files = m
        .open_files
        .map(|f| f.saturating_sub(cost.reserved_files.min(f / 4)) / cost.files.max(1));
    let by_memory = m.memory_bytes.map(|b| {
        (b / MEMORY_SHARE.1 * MEMORY_SHARE.0).saturating_sub(cost.fixed_bytes) / cost.bytes.max(1)
    });
    let n = match (by_files, by_memory) {
        (Some(f), Some(b)) => f.min(b),
        (Some(x), None) | (None, Some(x)) => x,
        (None, None) => return FALLBACK_CONNECTIONS,
    };
    usize::try_from(n)
        .unwrap_or(usize::MAX)
        .max(MIN_CONNECTIONS)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn memory_is_read_from_meminfo_and_the_cgroup_limit() {
        assert_eq!(
            mem_total("MemTotal:       24571008 kB\nMemFree: 1 kB\n"),
            Some(24_571_008 * 1024)
        );
        assert_eq!(mem_total("MemFree: 1 kB\n"), None);
        assert_eq!(mem_total("MemTotal: lots kB\n"), None);
        assert_eq!(cgroup_limit("max\n"), None);
        assert_eq!(cgroup_limit("9223372036854771712\n"), None, "v1's no limit");
        assert_eq!(cgroup_limit("4294967296\n"), Some(4 << 30));
        assert_eq!(cgroup_limit(""), None);
        assert_eq!(
            cgroup_limit_files("0::/system.slice/keel.service\n"),
            [
                "sys/fs/cgroup/system.slice/keel.service/memory.max",
                "sys/fs/cgroup/system.slice/memory.max",
                "sys/fs/cgroup/memory.max"
            ]
        );
        assert_eq!(cgroup_limit_files("0::/\n"), ["sys/fs/cgroup/memory.max"]);
        assert_eq!(
            cgroup_limit_files("9:pids:/\n4:memory:/process_api/abc\n0::/\n"),
            [
                "sys/fs/cgroup/memory/process_api/abc/memory.limit_in_bytes",
                "sys/fs/cgroup/memory/process_api/memory.limit_in_bytes",
                "sys/fs/cgroup/memory/memory.limit_in_bytes",
                "sys/fs/cgroup/memory.max"
            ]
        );
    }

    #[test]
    fn a_fixture_machine_is_read_under_its_root() {
        let dir = std::env::temp_dir().join(format!("keel-http-machine-{}", std::process::id()));
        let cg = dir.join("sys/fs/cgroup/memory/job");
        std::fs::create_dir_all(&cg).expect("dirs");
        std::fs::create_dir_all(dir.join("proc/self")).expect("dirs");
        std::fs::write(dir.join("proc/meminfo"), "MemTotal: 8388608 kB\n").expect("meminfo");
        std::fs::write(dir.join("proc/self/cgroup"), "4:memory:/job\n").expect("cgroup");
        std::fs::write(cg.join("memory.limit_in_bytes"), "2147483648\n").expect("limit");
        let m = Machine::read(&dir);
        assert_eq!(
            m.memory_bytes,
            Some(2 << 30),
            "the cgroup's limit is smaller"
        );
        std::fs::write(cg.join("memory.limit_in_bytes"), "9223372036854771712\n").expect("limit");
        assert_eq!(Machine::read(&dir).memory_bytes, Some(8 << 30));
        // A parent's limit bounds the job's cgroup.
        std::fs::write(
            dir.join("sys/fs/cgroup/memory/memory.limit_in_bytes"),
            "1073741824\n",
        )
        .expect("limit");
        assert_eq!(Machine::read(&dir).memory_bytes, Some(1 << 30));
        // Without a cgroup namespace the path in /proc/self/cgroup is the
        // host's; the container's own limit is at the mount root.
        std::fs::write(dir.join("proc/self/cgroup"), "4:memory:/docker/0123abcd\n")
            .expect("cgroup");
        assert_eq!(Machine::read(&dir).memory_bytes, Some(1 << 30));
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn the_cap_is_what_files_and_memory_both_allow() {
        let cost = ConnectionCost {
            bytes: 448 << 10,
            fixed_bytes: 96 << 20,
            files: 2,
            reserved_files: 1024,
        };
        let m = |files, mem| Machine {
            open_files: files,
            memory_bytes: mem,
        };
        // 1,048,576 files, 23.4 GiB: memory decides.
        let big = connection_cap(&m(Some(1 << 20), Some(24_571_008 * 1024)), &cost);
        assert_eq!(
            big,
            ((24_571_008u64 * 1024 / 2 - (96 << 20)) / (448 << 10)) as usize
        );
        // 20,000 files: files decide.
        assert_eq!(
            connection_cap(&m(Some(20_000), Some(24_571_008 * 1024)), &cost),
            (20_000 - 1024) / 2
        );
        // A small container.
        assert_eq!(
            connection_cap(&m(Some(1 << 20), Some(1 << 30)), &cost),
            ((512u64 << 20) - (96 << 20)) as usize / (448 << 10)
        );
        // A small limit keeps a quarter for the rest, not the whole reserve.
        assert_eq!(
            connection_cap(&m(Some(1024), None), &cost),
            (1024 - 256) / 2
        );
        // Too few files for anything: the floor, not zero.
        assert_eq!(connection_cap(&m(Some(64), None), &cost), MIN_CONNECTIONS);
        assert_eq!(connection_cap(&m(None, None), &cost), FALLBACK_CONNECTIONS);
        assert_eq!(connection_cap(&m(None, Some(4 << 30)), &cost), 4461);
    }

    proptest::proptest! {
        /// The parsers take any text without panicking.
        #[test]
        fn parsers_take_any_text(t in ".{0,200}") {
            let _ = mem_total(&t);
            let _ = cgroup_limit(&t);
            let _ = cgroup_limit_files(&t);
        }

        /// The cap is never under the floor, and more files or more memory
        /// never lower it.
        #[test]
        fn more_files_or_memory_never_lower_the_cap(
            files in proptest::option::of(0u64..(1 << 21)),
            mem in proptest::option::of(0u64..(1 << 36)),
            more_files in 0u64..(1 << 20),
            more_mem in 0u64..(1 << 34),
            bytes in 1u64..(1 << 20),
            fixed in 0u64..(1 << 28),
        ) {
            let cost = ConnectionCost { bytes, fixed_bytes: fixed, files: 2, reserved_files: 1024 };
            let m = Machine { open_files: files, memory_bytes: mem };
            let n = connection_cap(&m, &cost);
            proptest::prop_assert!(n >= MIN_CONNECTIONS);
            if files.is_some() && mem.is_some() {
                let bigger = Machine {
                    open_files: files.map(|f| f + more_files),
                    memory_bytes: mem.map(|b| b + more_mem),
                };
                proptest::prop_assert!(connection_cap(&bigger, &cost) >= n);
            }
        }
    }
}
