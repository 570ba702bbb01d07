//! Local NVMe scratch: find the drives, refuse any in use, plan a RAID0
//! with XFS at a mount point (`mdadm`, `mkfs.xfs`, `mount`), run the plan,
//! and measure what the result delivers.
//!
//! A drive is refused when it is mounted (itself or a partition), has
//! partitions, is used as swap, has holders (an md or device-mapper
//! device on top), is listed in `/proc/mdstat`, or carries a known
//! signature in its first bytes (a filesystem, an md superblock, a
//! partition table, LUKS, swap); `--force` lets signatures (only) be
//! wiped. Everything is read under a root directory, so tests use fixture
//! trees; the commands run are exactly the ones printed.
//!
//! keel names its array (`mdadm --create --name=<label>`), so it knows it
//! again after a reboot: drives whose md superblock (v1.2, 4 KiB in) names
//! keel's array are not refused but reassembled (when the kernel has not
//! already) and mounted; an array that is already mounted there is left
//! as it is. Planning is therefore idempotent, and `keel scratch apply
//! --apply` at boot brings scratch back after a plain reboot and builds it
//! again on the blank drives of a deallocated VM. An array (or a new one)
//! with fewer drives than the SKU has is refused unless allowed.

use std::fs::File;
use std::io::{Read, Write};
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::{Arc, Barrier};
use std::time::Instant;

use keel_topo::{Machine, Root};
use serde::Serialize;

#[derive(Debug, thiserror::Error)]
pub enum ScratchError {
    #[error(transparent)]
    Topo(#[from] keel_topo::TopoError),
    #[error("no usable drive: {reason}")]
    NoDrives { reason: String },
    #[error(
        "{mount} is already a mount point ({source_dev}): unmount it or choose another --mount"
    )]
    MountBusy { mount: String, source_dev: String },
    #[error("{what} needs root")]
    NotRoot { what: String },
    #[error("cannot read the first bytes of {devices}: their signatures are unchecked, so nothing is written")]
    Unchecked { devices: String },
    #[error("{what} has {found} drives but this SKU has {expected}: a smaller array is slower and smaller than the node's scratch should be (a drive missing or in use?); --allow-fewer-drives builds or mounts it anyway")]
    TooFewDrives {
        what: String,
        found: usize,
        expected: usize,
    },
    #[error("keel's array {name} (uuid {uuid}) has {found} of its {expected} drives ({members}): a RAID0 cannot run without all of them; find the missing drive, or rebuild it empty with --force")]
    Incomplete {
        name: String,
        uuid: String,
        found: usize,
        expected: usize,
        members: String,
    },
    #[error(
        "keel's array {device} is mounted at {at}, not at {mount}: unmount it or pass --mount {at}"
    )]
    MountedElsewhere {
        device: String,
        at: String,
        mount: String,
    },
    #[error("step {step} failed: {command}: {message}")]
    Step {
        step: usize,
        command: String,
        message: String,
    },
    #[error("cannot measure {path}")]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("cannot map a {bytes}-byte I/O buffer: nothing was measured")]
    Buffer {
        bytes: usize,
        #[source]
        source: std::io::Error,
    },
    #[error("{path} does not support direct I/O (O_DIRECT): measure a path on the scratch filesystem itself")]
    NoDirectIo { path: PathBuf },
}

/// One block device considered for scratch.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Drive {
    /// Kernel name, e.g. `nvme0n1`.
    pub name: String,
    /// Device path, e.g. `/dev/nvme0n1`.
    pub dev: String,
    pub size_bytes: Option<u64>,
    pub model: Option<String>,
    /// A signature found in its first bytes (`xfs`, `ext4`, `md`, ...).
    pub signature: Option<String>,
    /// Why it cannot be used; `None`: usable.
    pub refused: Option<String>,
    /// Its first bytes could not be read (not root): signatures unchecked.
    pub unread: bool,
    /// The md superblock (metadata 1.2) in its first bytes, if any.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub md: Option<MdSuperblock>,
}

/// What an md v1.2 superblock (4 KiB into a member) says of its array
/// (the kernel's `struct mdp_superblock_1`, `include/uapi/linux/raid/md_p.h`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct MdSuperblock {
    /// The array's UUID, 32 hex digits.
    pub uuid: String,
    /// The array's name, `homehost:name` as mdadm stores it.
    pub name: String,
    pub level: u32,
    pub raid_disks: u32,
}

impl MdSuperblock {
    /// Whether this names the array `label` (`keel-scratch`, or
    /// `host:keel-scratch` as mdadm prefixes its home host).
    pub fn is_named(&self, label: &str) -> bool {
        self.name == label || self.name.split_once(':').is_some_and(|(_, n)| n == label)
    }
}

/// Offset of the v1.2 superblock in a member.
const MD_SB_OFFSET: usize = 0x1000;

/// The md v1.2 superblock in a device's first bytes.
pub fn md_superblock(head: &[u8]) -> Option<MdSuperblock> {
    let sb = head.get(MD_SB_OFFSET..MD_SB_OFFSET + 96)?;
    let le32 = |at: usize| u32::from_le_bytes([sb[at], sb[at + 1], sb[at + 2], sb[at + 3]]);
    if le32(0) != 0xa92b_4efc || le32(4) != 1 {
        return None;
    }
    let uuid: String = sb[16..32].iter().map(|b| format!("{b:02x}")).collect();
    let name_bytes = &sb[32..64];
    let end = name_bytes.iter().position(|b| *b == 0).unwrap_or(32);
    let name = String::from_utf8_lossy(&name_bytes[..end]).into_owned();
    Some(MdSuperblock {
        uuid,
        name,
        level: le32(72),
        raid_disks: le32(92),
    })
}

/// One command of a plan.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Step {
    pub program: String,
    pub args: Vec<String>,
    pub why: String,
}

impl Step {
    fn new(program: &str, args: &[&str], why: &str) -> Self {
        Self {
            program: program.into(),
            args: args.iter().map(|s| s.to_string()).collect(),
            why: why.into(),
        }
    }

    /// The command as a shell line.
    pub fn line(&self) -> String {
        std::iter::once(self.program.as_str())
            .chain(self.args.iter().map(String::as_str))
            .map(crate::env::sh_quote)
            .collect::<Vec<_>>()
            .join(" ")
    }
}

/// What to build.
#[derive(Debug, Clone)]
pub struct Request {
    pub mount: PathBuf,
    /// The md device for two or more drives.
    pub array: PathBuf,
    /// Wipe signatures on drives that are not otherwise in use.
    pub force: bool,
    /// Use these devices (paths under `/dev`) instead of the NVMe drives.
    pub devices: Vec<PathBuf>,
    /// The XFS label and the md array's name (`--name`), by which keel
    /// knows its array again.
    pub label: String,
    /// The fewest drives an array may have (the SKU's NVMe count); `None`
    /// or 0: any number.
    pub min_drives: Option<usize>,
}

/// A plan: the drives seen, those used, and the exact commands.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Plan {
    pub drives: Vec<Drive>,
    pub used: Vec<String>,
    pub mount: PathBuf,
    pub device: String,
    pub steps: Vec<Step>,
    /// What to add for the array and the mount to come back after a reboot
    /// (not done by `apply`).
    pub persist: Vec<String>,
    pub notes: Vec<String>,
}

/// Known signatures: (offset, magic, name).
const SIGNATURES: &[(usize, &[u8], &str)] = &[
    (0, b"XFSB", "xfs"),
    (0x438, &[0x53, 0xEF], "ext2/3/4"),
    (0x1000, &[0xFC, 0x4E, 0x2B, 0xA9], "md (linux_raid_member)"),
    (0, &[0xFC, 0x4E, 0x2B, 0xA9], "md (linux_raid_member)"),
    (0x10040, b"_BHRfS_M", "btrfs"),
    (0, b"LUKS\xba\xbe", "crypto_LUKS"),
    (0xFF6, b"SWAPSPACE2", "swap"),
    (0x200, b"EFI PART", "gpt"),
];

/// How many bytes [`signature`] looks at.
pub const SIGNATURE_BYTES: usize = 0x10048;

/// The first known signature in `head` (a device's first bytes).
pub fn signature(head: &[u8]) -> Option<&'static str> {
    for (off, magic, name) in SIGNATURES {
        if head.len() >= off + magic.len() && &head[*off..off + magic.len()] == *magic {
            return Some(name);
        }
    }
    // An MBR: the boot signature and at least one partition entry.
    if head.len() >= 512 && head[510..512] == [0x55, 0xAA] {
        let any = (0..4).any(|i| head[446 + 16 * i + 4] != 0);
        if any {
            return Some("dos (MBR partition table)");
        }
    }
    None
}

/// Devices in `proc/mounts` and their mount points (octal escapes kept).
fn mounts(root: &Root) -> Result<Vec<(String, String)>, keel_topo::TopoError> {
    Ok(root
        .read_opt("proc/mounts")?
        .unwrap_or_default()
        .lines()
        .filter_map(|l| {
            let mut f = l.split_whitespace();
            Some((f.next()?.to_owned(), f.next()?.to_owned()))
        })
        .collect())
}

/// Kernel names of md members in `proc/mdstat`, with their array.
fn md_members(mdstat: &str) -> Vec<(String, String)> {
    let mut out = Vec::new();
    for l in mdstat.lines() {
        let Some((md, rest)) = l.split_once(" : ") else {
            continue;
        };
        if !md.starts_with("md") {
            continue;
        }
        for w in rest.split_whitespace() {
            if let Some((name, _)) = w.split_once('[') {
                out.push((name.to_owned(), md.trim().to_owned()));
            }
        }
    }
    out
}

/// The device's first bytes, `None` when they cannot be read.
fn head(root: &Root, dev: &str) -> Option<Vec<u8>> {
    let mut f = File::open(root.path(dev.trim_start_matches('/'))).ok()?;
    let mut buf = vec![0u8; SIGNATURE_BYTES];
    let mut n = 0;
    while n < buf.len() {
        match f.read(&mut buf[n..]) {
            Ok(0) => break,
            Ok(k) => n += k,
            Err(_) => return None,
        }
    }
    buf.truncate(n);
    Some(buf)
}

/// Inspects one block device by kernel name.
fn inspect(
    root: &Root,
    name: &str,
    model: Option<String>,
    size: Option<u64>,
    mounts: &[(String, String)],
    md: &[(String, String)],
    swaps: &str,
) -> Result<Drive, keel_topo::TopoError> {
    let dev = format!("/dev/{name}");
    let block = PathBuf::from("sys/class/block").join(name);
    let size = size.or(root
        .read_opt(block.join("size"))?
        .and_then(|s| s.trim().parse::<u64>().ok())
        .map(|s| s.saturating_mul(512)));
    let mut refused = None;
    let on_it: Vec<&(String, String)> = mounts
        .iter()
        .filter(|(d, _)| {
            d == &dev
                || d.strip_prefix(&dev)
                    .is_some_and(|rest| rest.trim_start_matches('p').parse::<u32>().is_ok())
        })
        .collect();
    if let Some((d, at)) = on_it.first() {
        refused = Some(format!("mounted: {d} at {at}"));
    }
    if refused.is_none() {
        let parts: Vec<String> = root
            .list(&block)?
            .into_iter()
            .filter(|e| e.starts_with(name) && e.len() > name.len())
            .collect();
        if !parts.is_empty() {
            refused = Some(format!("has partitions ({})", parts.join(", ")));
        }
    }
    if refused.is_none() {
        if let Some((_, array)) = md.iter().find(|(m, _)| m == name) {
            refused = Some(format!("member of {array} (/proc/mdstat)"));
        }
    }
    if refused.is_none() {
        let holders = root.list(block.join("holders"))?;
        if !holders.is_empty() {
            refused = Some(format!("in use by {}", holders.join(", ")));
        }
    }
    if refused.is_none()
        && swaps
            .lines()
            .skip(1)
            .any(|l| l.split_whitespace().next() == Some(&dev))
    {
        refused = Some("used as swap".into());
    }
    let (signature, unread, md) = match head(root, &dev) {
        Some(h) => (signature(&h).map(str::to_owned), false, md_superblock(&h)),
        None => (None, true, None),
    };
    Ok(Drive {
        name: name.to_owned(),
        dev,
        size_bytes: size,
        model,
        signature,
        refused,
        unread,
        md,
    })
}

/// The drives the request considers: the devices given, else the NVMe
/// namespaces of `machine`.
pub fn drives(
    root: &Root,
    machine: Option<&Machine>,
    req: &Request,
) -> Result<Vec<Drive>, ScratchError> {
    let mounts = mounts(root)?;
    let md = md_members(&root.read_opt("proc/mdstat")?.unwrap_or_default());
    let swaps = root.read_opt("proc/swaps")?.unwrap_or_default();
    let mut out = Vec::new();
    if req.devices.is_empty() {
        for c in machine.map(|m| m.nvme.as_slice()).unwrap_or_default() {
            for ns in &c.namespaces {
                let size = root
                    .read_opt(
                        PathBuf::from("sys/class/nvme")
                            .join(&c.name)
                            .join(ns)
                            .join("size"),
                    )?
                    .and_then(|s| s.trim().parse::<u64>().ok())
                    .map(|s| s.saturating_mul(512));
                out.push(inspect(
                    root,
                    ns,
                    c.model.clone(),
                    size,
                    &mounts,
                    &md,
                    &swaps,
                )?);
            }
        }
    } else {
        for d in &req.devices {
            let name = d
                .file_name()
                .map(|n| n.to_string_lossy().into_owned())
                .unwrap_or_default();
            out.push(inspect(root, &name, None, None, &mounts, &md, &swaps)?);
        }
    }
    Ok(out)
}

/// The arrays `/proc/mdstat` lists (`md127`) and their members' kernel
/// names.
fn md_arrays(mdstat: &str) -> Vec<(String, Vec<String>)> {
    let mut out: Vec<(String, Vec<String>)> = Vec::new();
    for (name, array) in md_members(mdstat) {
        match out.iter_mut().find(|(a, _)| *a == array) {
            Some((_, m)) => m.push(name),
            None => out.push((array, vec![name])),
        }
    }
    out
}

/// keel's own array among `drives`, if any: the members whose superblock
/// names `req.label`, with the device the kernel assembled them as.
fn keel_array(root: &Root, drives: &[Drive], req: &Request) -> Result<Option<Plan>, ScratchError> {
    let ours: Vec<&Drive> = drives
        .iter()
        .filter(|d| d.md.as_ref().is_some_and(|m| m.is_named(&req.label)))
        .collect();
    let Some(first) = ours.first().and_then(|d| d.md.clone()) else {
        return Ok(None);
    };
    // One array by UUID; another named alike (an old one) is not ours.
    let members: Vec<&Drive> = ours
        .iter()
        .copied()
        .filter(|d| d.md.as_ref().is_some_and(|m| m.uuid == first.uuid))
        .collect();
    let expected = first.raid_disks as usize;
    let names: Vec<String> = members.iter().map(|d| d.dev.clone()).collect();
    if members.len() < expected {
        if req.force {
            // Rebuilt empty: the create path wipes the stale superblocks.
            return Ok(None);
        }
        return Err(ScratchError::Incomplete {
            name: first.name.clone(),
            uuid: first.uuid.clone(),
            found: members.len(),
            expected,
            members: names.join(", "),
        });
    }
    if let Some(min) = req.min_drives.filter(|m| *m > 0) {
        if expected < min {
            return Err(ScratchError::TooFewDrives {
                what: format!("keel's array {}", first.name),
                found: expected,
                expected: min,
            });
        }
    }
    let mdstat = root.read_opt("proc/mdstat")?.unwrap_or_default();
    let assembled = md_arrays(&mdstat)
        .into_iter()
        .find(|(_, m)| members.iter().all(|d| m.contains(&d.name)));
    let mount = req.mount.display().to_string();
    let mut steps = Vec::new();
    let mut notes = Vec::new();
    let device = match &assembled {
        Some((md, _)) => format!("/dev/{md}"),
        None => req.array.display().to_string(),
    };
    let all_mounts = mounts(root)?;
    let mounted_at = assembled
        .as_ref()
        .and_then(|_| all_mounts.iter().find(|(d, _)| *d == device))
        .map(|(_, at)| at.clone());
    match (&assembled, &mounted_at) {
        (Some(_), Some(at)) if *at == mount => {
            notes.push(format!(
                "keel's array {} is {device}, mounted at {mount}: nothing to do",
                first.name
            ));
        }
        (Some(_), Some(at)) => {
            return Err(ScratchError::MountedElsewhere {
                device,
                at: at.clone(),
                mount,
            })
        }
        (assembled, _) => {
            if let Some((d, _)) = all_mounts.iter().find(|(_, at)| *at == mount) {
                return Err(ScratchError::MountBusy {
                    mount,
                    source_dev: d.clone(),
                });
            }
            if assembled.is_some() {
                notes.push(format!(
                    "keel's array {} is assembled as {device} (after a reboot): mounted again, not rebuilt",
                    first.name
                ));
            } else {
                let mut args = vec!["--assemble", device.as_str(), "--run"];
                args.extend(names.iter().map(String::as_str));
                steps.push(Step::new(
                    "mdadm",
                    &args,
                    "assemble keel's array again from its drives (its data kept)",
                ));
            }
            steps.push(Step::new("mkdir", &["-p", &mount], "the mount point"));
            steps.push(Step::new(
                "mount",
                &["-o", "noatime", &device, &mount],
                "mount it",
            ));
        }
    }
    // Its members are in use by keel's own array: used, not refused.
    let mut drives = drives.to_vec();
    for d in &mut drives {
        if names.contains(&d.dev) {
            d.refused = None;
        }
    }
    Ok(Some(Plan {
        drives,
        used: names,
        mount: req.mount.clone(),
        device,
        steps,
        persist: persist(req, expected),
        notes,
    }))
}

/// What keeps scratch across reboots.
fn persist(req: &Request, drives: usize) -> Vec<String> {
    let mut persist = vec![
        "deploy/systemd/keel-scratch.service: runs `keel scratch apply --apply` at boot, before slurmd: it mounts keel's array again after a reboot and builds it anew on the blank drives of a deallocated VM".to_owned(),
    ];
    if drives >= 2 {
        persist.push("or: mdadm --detail --scan >> /etc/mdadm/mdadm.conf".into());
    }
    persist.push(format!(
        "and LABEL={} {} xfs noatime,nofail 0 0   # /etc/fstab: nofail, as the drives are blank after a deallocation",
        req.label,
        req.mount.display()
    ));
    persist
}

/// Plans scratch from `drives`: keel's own array mounted again when the
/// drives hold it, else a new one.
pub fn plan(root: &Root, drives: Vec<Drive>, req: &Request) -> Result<Plan, ScratchError> {
    if let Some(p) = keel_array(root, &drives, req)? {
        return Ok(p);
    }
    let mount = req.mount.display().to_string();
    if let Some((d, _)) = mounts(root)?.into_iter().find(|(_, at)| *at == mount) {
        return Err(ScratchError::MountBusy {
            mount,
            source_dev: d,
        });
    }
    let mut notes = Vec::new();
    let mut used = Vec::new();
    let mut wipe = Vec::new();
    let mut drives = drives;
    for d in &mut drives {
        if d.refused.is_some() {
            continue;
        }
        if let Some(sig) = &d.signature {
            if req.force {
                wipe.push(d.dev.clone());
                notes.push(format!(
                    "{}: {sig} signature will be wiped (--force)",
                    d.dev
                ));
            } else {
                d.refused = Some(format!("holds a {sig} signature (--force wipes it)"));
                continue;
            }
        }
        used.push(d.dev.clone());
    }
    let unread: Vec<&str> = drives
        .iter()
        .filter(|d| d.unread && d.refused.is_none())
        .map(|d| d.dev.as_str())
        .collect();
    if !unread.is_empty() {
        notes.push(format!(
            "signatures not checked on {}: first bytes unreadable (not root?); apply checks again as root",
            unread.join(", ")
        ));
    }
    if used.is_empty() {
        let reason = if drives.is_empty() {
            "no NVMe drive found".to_owned()
        } else {
            drives
                .iter()
                .map(|d| format!("{}: {}", d.dev, d.refused.as_deref().unwrap_or("?")))
                .collect::<Vec<_>>()
                .join("; ")
        };
        return Err(ScratchError::NoDrives { reason });
    }
    if let Some(min) = req.min_drives.filter(|m| *m > 0) {
        if used.len() < min {
            let why: Vec<String> = drives
                .iter()
                .filter_map(|d| d.refused.as_ref().map(|r| format!("{}: {r}", d.dev)))
                .collect();
            return Err(ScratchError::TooFewDrives {
                what: format!(
                    "a new array{}",
                    if why.is_empty() {
                        String::new()
                    } else {
                        format!(" ({})", why.join("; "))
                    }
                ),
                found: used.len(),
                expected: min,
            });
        }
    }
    let mut steps = Vec::new();
    for w in &wipe {
        steps.push(Step::new(
            "wipefs",
            &["--all", w],
            "remove the old signature (--force)",
        ));
    }
    let device;
    if used.len() >= 2 {
        device = req.array.display().to_string();
        let n = format!("--raid-devices={}", used.len());
        let name = format!("--name={}", req.label);
        let mut args = vec![
            "--create",
            device.as_str(),
            "--level=0",
            n.as_str(),
            "--chunk=512",
            "--metadata=1.2",
            name.as_str(),
            "--run",
        ];
        args.extend(used.iter().map(String::as_str));
        steps.push(Step::new(
            "mdadm",
            &args,
            "stripe the drives into one RAID0 (512 KiB chunks)",
        ));
    } else {
        device = used[0].clone();
        notes.push("one drive: no array, XFS directly on it".into());
    }
    let mut mkfs = vec!["-L", req.label.as_str()];
    if req.force {
        mkfs.push("-f");
    }
    mkfs.push(device.as_str());
    steps.push(Step::new(
        "mkfs.xfs",
        &mkfs,
        "XFS, which reads the stripe geometry from md",
    ));
    steps.push(Step::new("mkdir", &["-p", &mount], "the mount point"));
    steps.push(Step::new(
        "mount",
        &["-o", "noatime", &device, &mount],
        "mount it",
    ));
    steps.push(Step::new(
        "chmod",
        &["1777", &mount],
        "writable by every job, files deletable by their owners only (like /tmp)",
    ));
    let persist = persist(req, used.len());
    Ok(Plan {
        drives,
        used,
        mount: req.mount.clone(),
        device,
        steps,
        persist,
        notes,
    })
}

/// The result of one step run.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct StepRun {
    pub command: String,
    pub ok: bool,
    pub output: String,
}

/// Runs the plan's steps in order and stops at the first failure (its
/// output in the error). Needs root.
pub fn apply(plan: &Plan, progress: &mut dyn FnMut(&str)) -> Result<Vec<StepRun>, ScratchError> {
    if !rustix::process::geteuid().is_root() {
        return Err(ScratchError::NotRoot {
            what: "keel scratch apply".into(),
        });
    }
    let unread: Vec<&str> = plan
        .drives
        .iter()
        .filter(|d| d.unread && plan.used.contains(&d.dev))
        .map(|d| d.dev.as_str())
        .collect();
    if !unread.is_empty() {
        return Err(ScratchError::Unchecked {
            devices: unread.join(", "),
        });
    }
    let mut runs = Vec::new();
    for (i, s) in plan.steps.iter().enumerate() {
        let line = s.line();
        progress(&line);
        let out = Command::new(&s.program)
            .args(&s.args)
            .stdin(Stdio::null())
            .output()
            .map_err(|e| ScratchError::Step {
                step: i + 1,
                command: line.clone(),
                message: e.to_string(),
            })?;
        let text = format!(
            "{}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
        let text: String = text.chars().take(4000).collect();
        if !out.status.success() {
            return Err(ScratchError::Step {
                step: i + 1,
                command: line,
                message: format!("{} {}", out.status, text.trim()),
            });
        }
        runs.push(StepRun {
            command: line,
            ok: true,
            output: text,
        });
    }
    Ok(runs)
}

/// How to measure.
#[derive(Debug, Clone, Copy)]
pub struct VerifyOptions {
    /// Parallel streams, each with a file of its own.
    pub streams: usize,
    /// Bytes each stream writes and reads.
    pub bytes_per_stream: u64,
    /// Bytes per request.
    pub block: usize,
}

impl Default for VerifyOptions {
    fn default() -> Self {
        Self {
            streams: 8,
            bytes_per_stream: 1 << 30,
            block: 1 << 20,
        }
    }
}

/// Sequential throughput measured with direct I/O.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct Throughput {
    pub streams: usize,
    pub block_bytes: usize,
    pub bytes: u64,
    pub write_seconds: f64,
    pub read_seconds: f64,
    /// 10^9 bytes a second.
    pub write_gbps: f64,
    pub read_gbps: f64,
}

/// A buffer for direct I/O: a mapping of its own (page-aligned), in base
/// pages, never in transparent huge pages, whatever the global allocator
/// does.
///
/// The kernel hands a direct request's buffer to the device as a list of
/// physically contiguous segments. In base pages a 1 MiB request is up to
/// 256 segments; in a huge page, one. Devices that pay per segment then
/// give more with huge pages: a virtio disk without indirect descriptors
/// takes one slot of its ring (256 on Firecracker) per segment, so one
/// request in base pages fills the ring and the other streams' requests
/// wait their turn, while in huge pages every stream's request is in
/// flight at once (on this project's build VM: 2.1 times the read figure;
/// see `docs/results/2026-11-26-scratch-buffers.md`). fio's buffers
/// (`iomem=malloc`, the default) and most applications' are in base
/// pages, so `verify` measures with base pages too: its figures then
/// describe the storage, not how the buffer happened to be allocated
/// (a large allocation of keel's allocator may be in huge pages).
pub struct DirectBuf {
    map: memmap2::MmapMut,
}

impl DirectBuf {
    /// `len` bytes (a multiple of 4096 for direct I/O), zeroed, every page
    /// present.
    pub fn new(len: usize) -> std::io::Result<Self> {
        let mut map = memmap2::MmapMut::map_anon(len.max(1))?;
        // Before the first touch, so that no huge page is ever faulted in.
        without_thp_is_fine(map.advise(memmap2::Advice::NoHugePage))?;
        // Touch every page now, outside any timed phase.
        map.fill(0);
        Ok(Self { map })
    }

    pub fn as_mut_slice(&mut self) -> &mut [u8] {
        &mut self.map[..]
    }

    /// The address of its first byte (page-aligned).
    pub fn addr(&self) -> usize {
        self.map.as_ptr() as usize
    }
}

/// `madvise(MADV_NOHUGEPAGE)`'s result, where EINVAL is success: a
/// kernel built without transparent huge pages refuses the advice, and
/// there every page is a base page already.
fn without_thp_is_fine(r: std::io::Result<()>) -> std::io::Result<()> {
    match r {
        Err(e) if e.raw_os_error() == Some(rustix::io::Errno::INVAL.raw_os_error()) => Ok(()),
        r => r,
    }
}

impl std::fmt::Debug for DirectBuf {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DirectBuf")
            .field("addr", &format_args!("{:#x}", self.addr()))
            .field("len", &self.map.len())
            .finish()
    }
}

fn io_err(path: &Path) -> impl Fn(std::io::Error) -> ScratchError + '_ {
    move |source| {
        if source.raw_os_error() == Some(rustix::io::Errno::INVAL.raw_os_error()) {
            ScratchError::NoDirectIo {
                path: path.to_owned(),
            }
        } else {
            ScratchError::Io {
                path: path.to_owned(),
                source,
            }
        }
    }
}

/// Writes, then reads, `streams` files of `bytes_per_stream` under `dir`
/// with `O_DIRECT`, all streams at once, and removes them. `progress` is
/// called between phases.
pub fn measure(
    dir: &Path,
    opts: VerifyOptions,
    progress: &mut dyn FnMut(&str),
) -> Result<Throughput, ScratchError> {
    let block = opts.block.max(4096) / 4096 * 4096;
    let blocks = (opts.bytes_per_stream / block as u64).max(1);
    let streams = opts.streams.max(1);
    if !dir.is_dir() {
        return Err(ScratchError::Io {
            path: dir.to_owned(),
            source: std::io::Error::new(
                std::io::ErrorKind::NotFound,
                "no such directory: give a directory on the scratch filesystem",
            ),
        });
    }
    let work = dir.join(format!(".keel-scratch-verify.{}", std::process::id()));
    std::fs::create_dir(&work).map_err(io_err(&work))?;
    let result = (|| {
        progress(&format!(
            "writing {streams} x {} MiB with O_DIRECT in {} KiB requests",
            (blocks * block as u64) >> 20,
            block >> 10
        ));
        let write = phase(&work, streams, blocks, block, true)?;
        progress("reading it back with O_DIRECT");
        let read = phase(&work, streams, blocks, block, false)?;
        let bytes = streams as u64 * blocks * block as u64;
        Ok(Throughput {
            streams,
            block_bytes: block,
            bytes,
            write_seconds: write,
            read_seconds: read,
            write_gbps: bytes as f64 / write / 1e9,
            read_gbps: bytes as f64 / read / 1e9,
        })
    })();
    let _ = std::fs::remove_dir_all(&work);
    result
}

/// One phase: every stream at once; the seconds from the common start to
/// the last stream's end (data synced).
fn phase(
    work: &Path,
    streams: usize,
    blocks: u64,
    block: usize,
    write: bool,
) -> Result<f64, ScratchError> {
    let start = Arc::new(Barrier::new(streams + 1));
    let mut handles = Vec::new();
    for i in 0..streams {
        let path = work.join(format!("stream{i}"));
        let start = Arc::clone(&start);
        handles.push(std::thread::spawn(move || -> Result<(), ScratchError> {
            let mut o = std::fs::OpenOptions::new();
            o.custom_flags(rustix::fs::OFlags::DIRECT.bits() as i32);
            if write {
                o.write(true).create_new(true);
            } else {
                o.read(true);
            }
            let opened = o.open(&path);
            // The buffer is made (and filled) before the clock starts, as
            // fio makes its buffers before a job's run time starts.
            let made = DirectBuf::new(block).map_err(|source| ScratchError::Buffer {
                bytes: block,
                source,
            });
            let made = made.map(|mut b| {
                if write {
                    fill_random(b.as_mut_slice(), i as u64);
                }
                b
            });
            // Wait for every stream even when this one failed to open, so
            // that the barrier releases.
            start.wait();
            let mut f = opened.map_err(io_err(&path))?;
            let mut made = made?;
            let buf = made.as_mut_slice();
            if write {
                for n in 0..blocks {
                    stamp(buf, i as u64, n);
                    f.write_all(buf).map_err(io_err(&path))?;
                }
                f.sync_all().map_err(io_err(&path))?;
            } else {
                for _ in 0..blocks {
                    f.read_exact(buf).map_err(io_err(&path))?;
                }
            }
            Ok(())
        }));
    }
    start.wait();
    let t0 = Instant::now();
    let mut first_err = None;
    for h in handles {
        let r = h.join().unwrap_or_else(|_| {
            Err(ScratchError::Io {
                path: work.to_owned(),
                source: std::io::Error::other("a measuring thread panicked"),
            })
        });
        if let (Err(e), None) = (r, &first_err) {
            first_err = Some(e);
        }
    }
    if let Some(e) = first_err {
        return Err(e);
    }
    Ok(t0.elapsed().as_secs_f64().max(1e-9))
}

/// Fills `buf` with pseudo-random bytes (xorshift64*): storage that
/// compresses must not see an easy pattern.
fn fill_random(buf: &mut [u8], seed: u64) {
    let mut x = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    for chunk in buf.chunks_mut(8) {
        x ^= x >> 12;
        x ^= x << 25;
        x ^= x >> 27;
        let v = x.wrapping_mul(0x2545_F491_4F6C_DD1D).to_le_bytes();
        chunk.copy_from_slice(&v[..chunk.len()]);
    }
}

/// Writes the stream and block number at the start of every 4 KiB of
/// `buf`, so that no two blocks written are alike (as fio's
/// `scramble_buffers`): storage that deduplicates must not skip them.
fn stamp(buf: &mut [u8], stream: u64, block: u64) {
    for (k, chunk) in buf.chunks_mut(4096).enumerate() {
        if chunk.len() >= 24 {
            chunk[..8].copy_from_slice(&stream.to_le_bytes());
            chunk[8..16].copy_from_slice(&block.to_le_bytes());
            chunk[16..24].copy_from_slice(&(k as u64).to_le_bytes());
        }
    }
}

/// A measured figure against the profile's.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Verdict {
    Pass,
    Warn,
    Fail,
    /// No figure to compare with.
    Unjudged,
}

/// `measured` against `expected`: pass at or above `warn_factor` times it,
/// warn down to `fail_factor` times it, fail below.
pub fn judge(measured: f64, expected: Option<f64>, warn_factor: f64, fail_factor: f64) -> Verdict {
    match expected {
        None => Verdict::Unjudged,
        Some(e) if measured >= e * warn_factor => Verdict::Pass,
        Some(e) if measured >= e * fail_factor => Verdict::Warn,
        Some(_) => Verdict::Fail,
    }
}

impl keel_error::HasKind for ScratchError {
    fn kind(&self) -> keel_error::ErrorKind {
        use keel_error::ErrorKind as K;
        match self {
            Self::Topo(t) => keel_error::HasKind::kind(t),
            Self::Io { .. } => K::Io,
            Self::NoDrives { .. }
            | Self::NoDirectIo { .. }
            | Self::Buffer { .. }
            | Self::TooFewDrives { .. }
            | Self::Incomplete { .. }
            | Self::Unchecked { .. } => K::Unavailable,
            Self::MountBusy { .. } | Self::MountedElsewhere { .. } | Self::NotRoot { .. } => {
                K::Usage
            }
            Self::Step { .. } => K::Failed,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_kernel_without_thp_refusing_the_advice_is_not_an_error() {
        let einval = std::io::Error::from_raw_os_error(rustix::io::Errno::INVAL.raw_os_error());
        assert!(without_thp_is_fine(Err(einval)).is_ok());
        let enomem = std::io::Error::from_raw_os_error(rustix::io::Errno::NOMEM.raw_os_error());
        assert!(without_thp_is_fine(Err(enomem)).is_err());
        assert!(without_thp_is_fine(Ok(())).is_ok());
    }
}
