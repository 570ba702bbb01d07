//! Scratch planning on the machine fixtures (with injected mounts, arrays
//! and signatures), and `apply` + `verify` for real on loop devices where
//! the machine allows it.

use std::path::{Path, PathBuf};
use std::process::Command;

use keel_topo::Root;
use keel_tune::scratch::{self, Request, ScratchError, VerifyOptions};

fn fixture(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../../tests/fixtures")
        .join(name)
}

fn request(force: bool) -> Request {
    Request {
        mount: "/mnt/resource_nvme".into(),
        array: "/dev/md128".into(),
        force,
        devices: vec![],
        label: "keel-scratch".into(),
        min_drives: Some(8),
    }
}

fn plan_at(root: &Path, req: &Request) -> Result<scratch::Plan, ScratchError> {
    let root = Root::new(root);
    let m = keel_topo::read_machine(&root).expect("machine");
    let drives = scratch::drives(&root, Some(&m), req)?;
    scratch::plan(&root, drives, req)
}

/// A copy of a fixture's root whose proc/mounts and proc/mdstat, and dev
/// files, the test writes.
fn altered(machine: &str, mounts_extra: &str, mdstat: &str) -> tempfile::TempDir {
    let dir = tempfile::tempdir().expect("tempdir");
    let src = fixture(machine);
    std::os::unix::fs::symlink(src.join("sys"), dir.path().join("sys")).expect("link sys");
    std::fs::create_dir_all(dir.path().join("proc")).expect("proc");
    std::fs::create_dir_all(dir.path().join("dev")).expect("dev");
    for e in std::fs::read_dir(src.join("proc")).expect("proc") {
        let e = e.expect("entry");
        let name = e.file_name();
        if name != "mounts" && name != "mdstat" {
            std::os::unix::fs::symlink(e.path(), dir.path().join("proc").join(&name))
                .expect("link");
        }
    }
    let mounts = std::fs::read_to_string(src.join("proc/mounts")).expect("mounts");
    std::fs::write(dir.path().join("proc/mounts"), mounts + mounts_extra).expect("mounts");
    std::fs::write(dir.path().join("proc/mdstat"), mdstat).expect("mdstat");
    dir
}

fn write_dev(root: &Path, name: &str, at: usize, magic: &[u8]) {
    let mut bytes = vec![0u8; scratch::SIGNATURE_BYTES];
    bytes[at..at + magic.len()].copy_from_slice(magic);
    std::fs::write(root.join("dev").join(name), bytes).expect("dev");
}

#[test]
fn ndv4_plans_a_raid0_of_its_eight_nvme_drives() {
    let plan = plan_at(&fixture("nd96asr_v4"), &request(false)).expect("plan");
    assert_eq!(plan.used.len(), 8);
    assert_eq!(plan.used[0], "/dev/nvme0n1");
    let lines: Vec<String> = plan.steps.iter().map(|s| s.line()).collect();
    assert_eq!(
        lines,
        [
            "mdadm --create /dev/md128 --level=0 --raid-devices=8 --chunk=512 --metadata=1.2 --name=keel-scratch --run \
             /dev/nvme0n1 /dev/nvme1n1 /dev/nvme2n1 /dev/nvme3n1 /dev/nvme4n1 /dev/nvme5n1 /dev/nvme6n1 /dev/nvme7n1",
            "mkfs.xfs -L keel-scratch /dev/md128",
            "mkdir -p /mnt/resource_nvme",
            "mount -o noatime /dev/md128 /mnt/resource_nvme",
            "chmod 1777 /mnt/resource_nvme",
        ]
    );
    assert!(plan.persist.iter().any(|p| p.contains("nofail")));
    // The fixture has no device nodes: signatures are unchecked, and said so.
    assert!(plan
        .notes
        .iter()
        .any(|n| n.contains("signatures not checked")));
    let h100 = plan_at(&fixture("nd96isr_h100_v5"), &request(false)).expect("plan");
    assert_eq!(h100.used.len(), 8);
}

#[test]
fn drives_in_use_are_refused_and_signatures_need_force() {
    let mdstat = "Personalities : [raid1]\nmd127 : active raid1 nvme7n1[0] nvme6n1[1]\n      1048576 blocks [2/2] [UU]\n\nunused devices: <none>\n";
    let dir = altered(
        "nd96asr_v4",
        "/dev/nvme3n1 /data xfs rw,relatime 0 0\n",
        mdstat,
    );
    write_dev(dir.path(), "nvme0n1", 0, b"XFSB");
    write_dev(dir.path(), "nvme1n1", 0x1000, &[0xFC, 0x4E, 0x2B, 0xA9]);
    write_dev(dir.path(), "nvme2n1", 0, b"");
    // Fewer drives than the SKU's eight are allowed here.
    let request = |force| Request {
        min_drives: None,
        ..request(force)
    };
    let plan = plan_at(dir.path(), &request(false)).expect("plan");
    let refused = |dev: &str| {
        plan.drives
            .iter()
            .find(|d| d.dev == dev)
            .and_then(|d| d.refused.clone())
            .unwrap_or_default()
    };
    assert!(refused("/dev/nvme3n1").contains("mounted: /dev/nvme3n1 at /data"));
    assert!(refused("/dev/nvme7n1").contains("member of md127"));
    assert!(refused("/dev/nvme6n1").contains("member of md127"));
    assert!(refused("/dev/nvme0n1").contains("xfs signature"));
    assert!(refused("/dev/nvme1n1").contains("md (linux_raid_member)"));
    assert_eq!(refused("/dev/nvme2n1"), "", "blank and read: usable");
    assert_eq!(
        plan.used,
        ["/dev/nvme2n1", "/dev/nvme4n1", "/dev/nvme5n1"],
        "{:?}",
        plan.drives
    );

    // --force wipes signatures, never a mounted drive or an array member.
    let plan = plan_at(dir.path(), &request(true)).expect("plan");
    assert_eq!(plan.used.len(), 5);
    let lines: Vec<String> = plan.steps.iter().map(|s| s.line()).collect();
    assert_eq!(lines[0], "wipefs --all /dev/nvme0n1");
    assert_eq!(lines[1], "wipefs --all /dev/nvme1n1");
    assert!(
        lines[3].starts_with("mkfs.xfs -L keel-scratch -f "),
        "{lines:?}"
    );
    assert!(!lines
        .iter()
        .any(|l| l.contains("nvme3n1") || l.contains("nvme7n1")));
}

#[test]
fn a_busy_mount_point_or_no_usable_drive_is_an_error() {
    let dir = altered(
        "nd96asr_v4",
        "/dev/sdb1 /mnt/resource_nvme ext4 rw 0 0\n",
        "Personalities :\n",
    );
    let err = plan_at(dir.path(), &request(false)).expect_err("busy");
    assert!(matches!(err, ScratchError::MountBusy { .. }), "{err}");

    let mounts: String = (0..8)
        .map(|i| format!("/dev/nvme{i}n1p1 /data{i} ext4 rw 0 0\n"))
        .collect();
    let dir = altered("nd96asr_v4", &mounts, "Personalities :\n");
    let err = plan_at(dir.path(), &request(true)).expect_err("all mounted");
    assert!(
        err.to_string()
            .contains("/dev/nvme5n1: mounted: /dev/nvme5n1p1 at /data5"),
        "{err}"
    );

    let err = plan_at(&fixture("cpu-only"), &request(false)).expect_err("no nvme");
    assert!(err.to_string().contains("no NVMe drive found"), "{err}");
}

/// An md v1.2 superblock 4 KiB into a member, as mdadm writes it.
fn md_member(uuid: u8, name: &str, raid_disks: u32) -> Vec<u8> {
    let mut sb = vec![0u8; 96];
    sb[0..4].copy_from_slice(&0xa92b_4efc_u32.to_le_bytes());
    sb[4..8].copy_from_slice(&1u32.to_le_bytes());
    sb[16..32].copy_from_slice(&[uuid; 16]);
    sb[32..32 + name.len()].copy_from_slice(name.as_bytes());
    sb[92..96].copy_from_slice(&raid_disks.to_le_bytes());
    sb
}

/// The NDv4 fixture after a plain reboot: the eight drives carry keel's
/// array (`mdadm --create --name=keel-scratch`), which the kernel has or
/// has not assembled again, mounted or not.
fn rebooted(assembled: bool, mounted: bool, members: usize, raid_disks: u32) -> tempfile::TempDir {
    let names: Vec<String> = (0..members).map(|i| format!("nvme{i}n1[{i}]")).collect();
    let mdstat = if assembled {
        format!(
            "Personalities : [raid0]\nmd127 : active raid0 {}\n      7500000000 blocks super 1.2 512k chunks\n\nunused devices: <none>\n",
            names.join(" ")
        )
    } else {
        "Personalities : [raid0]\nunused devices: <none>\n".to_owned()
    };
    let mounts = if mounted {
        "/dev/md127 /mnt/resource_nvme xfs rw,noatime 0 0\n"
    } else {
        ""
    };
    let dir = altered("nd96asr_v4", mounts, &mdstat);
    for i in 0..members {
        write_dev(
            dir.path(),
            &format!("nvme{i}n1"),
            0x1000,
            &md_member(7, "ndv4-0001:keel-scratch", raid_disks),
        );
    }
    for i in members..8 {
        write_dev(dir.path(), &format!("nvme{i}n1"), 0, b"");
    }
    dir
}

#[test]
fn after_a_reboot_keels_array_is_mounted_again_not_refused() {
    // Assembled by the kernel (md127), not mounted: mount it.
    let dir = rebooted(true, false, 8, 8);
    let plan = plan_at(dir.path(), &request(false)).expect("plan");
    let lines: Vec<String> = plan.steps.iter().map(|s| s.line()).collect();
    assert_eq!(
        lines,
        [
            "mkdir -p /mnt/resource_nvme",
            "mount -o noatime /dev/md127 /mnt/resource_nvme"
        ]
    );
    assert_eq!(plan.device, "/dev/md127");
    assert_eq!(plan.used.len(), 8);
    assert!(
        plan.drives.iter().all(|d| d.refused.is_none()),
        "{:?}",
        plan.drives
    );

    // Not assembled: assemble it from its drives, keep its data.
    let dir = rebooted(false, false, 8, 8);
    let lines: Vec<String> = plan_at(dir.path(), &request(false))
        .expect("plan")
        .steps
        .iter()
        .map(|s| s.line())
        .collect();
    assert_eq!(
        lines[0],
        "mdadm --assemble /dev/md128 --run /dev/nvme0n1 /dev/nvme1n1 /dev/nvme2n1 /dev/nvme3n1 \
         /dev/nvme4n1 /dev/nvme5n1 /dev/nvme6n1 /dev/nvme7n1"
    );
    assert!(!lines
        .iter()
        .any(|l| l.starts_with("mkfs") || l.contains("--create")));

    // Already mounted there: nothing to do (a boot unit may run twice).
    let dir = rebooted(true, true, 8, 8);
    let plan = plan_at(dir.path(), &request(false)).expect("plan");
    assert!(plan.steps.is_empty(), "{:?}", plan.steps);
    assert!(plan.notes.iter().any(|n| n.contains("nothing to do")));

    // Mounted somewhere else: said so, nothing planned.
    let mut elsewhere = request(false);
    elsewhere.mount = "/scratch".into();
    assert!(matches!(
        plan_at(dir.path(), &elsewhere),
        Err(ScratchError::MountedElsewhere { .. })
    ));
}

#[test]
fn an_array_short_of_the_skus_drives_is_refused_unless_allowed() {
    // keel's array built from 4 of the 8 drives.
    let dir = rebooted(true, false, 4, 4);
    match plan_at(dir.path(), &request(false)) {
        Err(ScratchError::TooFewDrives {
            found: 4,
            expected: 8,
            ..
        }) => {}
        other => panic!("{other:?}"),
    }
    let mut allowed = request(false);
    allowed.min_drives = None;
    assert_eq!(plan_at(dir.path(), &allowed).expect("plan").used.len(), 4);

    // A member missing (7 of 8 present): a RAID0 cannot run.
    let dir = rebooted(false, false, 7, 8);
    match plan_at(dir.path(), &request(false)) {
        Err(e @ ScratchError::Incomplete { .. }) => {
            assert!(e.to_string().contains("7 of its 8 drives"), "{e}")
        }
        other => panic!("{other:?}"),
    }

    // A new array on 7 usable drives of 8 (one mounted elsewhere).
    let dir = altered(
        "nd96asr_v4",
        "/dev/nvme3n1 /data xfs rw,relatime 0 0\n",
        "Personalities : \nunused devices: <none>\n",
    );
    match plan_at(dir.path(), &request(false)) {
        Err(e @ ScratchError::TooFewDrives { .. }) => {
            assert!(e.to_string().contains("/dev/nvme3n1: mounted"), "{e}")
        }
        other => panic!("{other:?}"),
    }
    assert_eq!(plan_at(dir.path(), &allowed).expect("plan").used.len(), 7);
}

#[test]
fn md_superblocks_name_their_array() {
    let mut head = vec![0u8; scratch::SIGNATURE_BYTES];
    head[0x1000..0x1000 + 96].copy_from_slice(&md_member(0xab, "host:keel-scratch", 8));
    let sb = scratch::md_superblock(&head).expect("superblock");
    assert_eq!(sb.uuid, "ab".repeat(16));
    assert_eq!(sb.name, "host:keel-scratch");
    assert_eq!(sb.raid_disks, 8);
    assert!(sb.is_named("keel-scratch"));
    assert!(!sb.is_named("scratch"));
    assert!(scratch::md_superblock(&head[..0x1010]).is_none());
    assert!(scratch::md_superblock(&vec![0u8; 0x2000]).is_none());
}

#[test]
fn signatures() {
    let mut head = vec![0u8; scratch::SIGNATURE_BYTES];
    assert_eq!(scratch::signature(&head), None);
    head[0x438..0x43a].copy_from_slice(&[0x53, 0xEF]);
    assert_eq!(scratch::signature(&head), Some("ext2/3/4"));
    let mut mbr = vec![0u8; 512];
    mbr[510] = 0x55;
    mbr[511] = 0xAA;
    assert_eq!(
        scratch::signature(&mbr),
        None,
        "boot signature but no partition"
    );
    mbr[446 + 4] = 0x83;
    assert_eq!(scratch::signature(&mbr), Some("dos (MBR partition table)"));
    assert_eq!(scratch::signature(b"XFSB"), Some("xfs"));
    assert_eq!(scratch::signature(b"XF"), None);
}

#[test]
fn judging_against_the_profile_figure() {
    use scratch::{judge, Verdict};
    assert_eq!(judge(7.5, Some(8.0), 0.9, 0.5), Verdict::Pass);
    assert_eq!(judge(7.1, Some(8.0), 0.9, 0.5), Verdict::Warn);
    assert_eq!(judge(3.9, Some(8.0), 0.9, 0.5), Verdict::Fail);
    assert_eq!(judge(3.9, None, 0.9, 0.5), Verdict::Unjudged);
}

#[test]
fn measure_writes_and_reads_with_direct_io_and_cleans_up() {
    let dir = tempfile::tempdir_in(env!("CARGO_TARGET_TMPDIR")).expect("tempdir");
    let mut said = Vec::new();
    let r = scratch::measure(
        dir.path(),
        VerifyOptions {
            streams: 3,
            bytes_per_stream: 8 << 20,
            block: 1 << 20,
        },
        &mut |s| said.push(s.to_owned()),
    );
    match r {
        Ok(t) => {
            assert_eq!(t.bytes, 3 * (8 << 20));
            assert!(t.write_gbps > 0.0 && t.read_gbps > 0.0);
            assert_eq!(said.len(), 2);
        }
        Err(ScratchError::NoDirectIo { path }) => {
            eprintln!("skipped: {} does not support O_DIRECT", path.display());
        }
        Err(e) => panic!("{e}"),
    }
    assert_eq!(std::fs::read_dir(dir.path()).expect("dir").count(), 0);
}

/// Loop devices, unmounted and detached however the test ends.
struct Loops {
    devs: Vec<String>,
    files: tempfile::TempDir,
    mount: PathBuf,
    array: Option<String>,
}

impl Drop for Loops {
    fn drop(&mut self) {
        let _ = Command::new("umount").arg(&self.mount).status();
        if let Some(a) = &self.array {
            let _ = Command::new("mdadm").args(["--stop", a]).status();
        }
        for d in &self.devs {
            let _ = Command::new("losetup").args(["-d", d]).status();
        }
        let _ = &self.files;
    }
}

fn why_not_real() -> Option<String> {
    if !rustix::process::geteuid().is_root() {
        return Some("not root".into());
    }
    for tool in ["losetup", "mkfs.xfs", "mount", "wipefs"] {
        let found = std::env::var_os("PATH")
            .map(|p| std::env::split_paths(&p).any(|d| d.join(tool).exists()))
            .unwrap_or(false);
        if !found {
            return Some(format!(
                "{tool} is not installed (scripts/test installs xfsprogs and mdadm)"
            ));
        }
    }
    None
}

fn losetup(files: &Path, n: usize) -> Result<Vec<String>, String> {
    let mut devs: Vec<String> = Vec::new();
    for i in 0..n {
        let f = files.join(format!("drive{i}.img"));
        let file = std::fs::File::create(&f).map_err(|e| e.to_string())?;
        file.set_len(512 << 20).map_err(|e| e.to_string())?;
        let out = Command::new("losetup")
            .args(["--find", "--show"])
            .arg(&f)
            .output()
            .map_err(|e| e.to_string())?;
        if !out.status.success() {
            for d in &devs {
                let _ = Command::new("losetup").args(["-d", d]).status();
            }
            return Err(String::from_utf8_lossy(&out.stderr).trim().to_owned());
        }
        devs.push(String::from_utf8_lossy(&out.stdout).trim().to_owned());
    }
    Ok(devs)
}

fn real(n: usize) {
    if let Some(why) = why_not_real() {
        eprintln!("skipped: {why}");
        return;
    }
    if n >= 2 && !Path::new("/proc/mdstat").exists() {
        eprintln!("skipped: the kernel has no md driver loaded (/proc/mdstat is missing)");
        return;
    }
    let files = tempfile::tempdir_in(env!("CARGO_TARGET_TMPDIR")).expect("tempdir");
    let devs = match losetup(files.path(), n) {
        Ok(d) => d,
        Err(e) => {
            eprintln!("skipped: no loop device: {e}");
            return;
        }
    };
    let mount = files.path().join("mnt");
    let array = (n >= 2).then(|| format!("/dev/md/keel-test-{}", std::process::id()));
    let loops = Loops {
        devs: devs.clone(),
        files,
        mount: mount.clone(),
        array: array.clone(),
    };
    let req = Request {
        mount: mount.clone(),
        array: array.clone().unwrap_or_default().into(),
        force: false,
        devices: devs.iter().map(PathBuf::from).collect(),
        label: "keel-test".into(),
        min_drives: None,
    };
    let root = Root::new("/");
    let drives = scratch::drives(&root, None, &req).expect("drives");
    let plan = scratch::plan(&root, drives, &req).expect("plan");
    assert_eq!(plan.used, devs);
    let mut log = Vec::new();
    match scratch::apply(&plan, &mut |l| log.push(l.to_owned())) {
        Ok(runs) => assert_eq!(runs.len(), plan.steps.len()),
        Err(e) if e.to_string().contains("mount") && e.to_string().contains("permission") => {
            eprintln!("skipped: this machine does not allow mounting: {e}");
            return;
        }
        Err(e) => panic!("{e}\n{log:?}"),
    }
    let mounts = std::fs::read_to_string("/proc/mounts").expect("mounts");
    assert!(
        mounts
            .lines()
            .any(|l| l.split_whitespace().nth(1) == Some(mount.to_str().unwrap_or("-"))),
        "{mounts}"
    );
    let again = scratch::plan(
        &root,
        scratch::drives(&root, None, &req).expect("drives"),
        &req,
    );
    if n == 1 {
        // A second plan refuses the drive now: it is mounted.
        assert!(again.is_err());
    } else {
        // keel's own array, mounted where it belongs: nothing to do.
        let again = again.expect("plan of keel's mounted array");
        assert!(again.steps.is_empty(), "{:?}", again.steps);
        // What a plain reboot does to it, as far as the drives go:
        // unmounted and stopped. The next plan assembles and mounts the
        // same array, its files kept.
        std::fs::write(mount.join("kept"), b"data").expect("write");
        for (cmd, args) in [
            ("umount", vec![mount.display().to_string()]),
            (
                "mdadm",
                vec!["--stop".into(), array.clone().unwrap_or_default()],
            ),
        ] {
            let st = Command::new(cmd).args(&args).status().expect(cmd);
            assert!(st.success(), "{cmd} {args:?}");
        }
        let after = scratch::plan(
            &root,
            scratch::drives(&root, None, &req).expect("drives"),
            &req,
        )
        .expect("plan after a reboot");
        let lines: Vec<String> = after.steps.iter().map(|s| s.line()).collect();
        assert!(lines[0].starts_with("mdadm --assemble "), "{lines:?}");
        assert!(!lines.iter().any(|l| l.starts_with("mkfs")), "{lines:?}");
        scratch::apply(&after, &mut |_| {}).expect("assemble and mount");
        assert_eq!(std::fs::read(mount.join("kept")).expect("kept"), b"data");
    }
    let t = scratch::measure(
        &mount,
        VerifyOptions {
            streams: 4,
            bytes_per_stream: 16 << 20,
            block: 1 << 20,
        },
        &mut |_| {},
    )
    .expect("measure");
    assert_eq!(t.bytes, 4 * (16 << 20));
    assert!(t.write_gbps > 0.0 && t.read_gbps > 0.0);
    drop(loops);
}

#[test]
fn apply_and_verify_on_one_loop_device() {
    real(1);
}

#[test]
fn apply_and_verify_a_raid0_of_loop_devices() {
    real(2);
}
