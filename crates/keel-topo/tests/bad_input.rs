//! Malformed or missing sysfs/procfs files give errors naming the file, and
//! values that cannot be read are absent, never 0.

use std::fs;
use std::path::Path;

use keel_topo::plan::{plan, Launcher, PlanError, PlanRequest};
use keel_topo::{read_machine, Root, TopoError};

fn write(root: &Path, rel: &str, content: &str) {
    let p = root.join(rel);
    fs::create_dir_all(p.parent().expect("parent")).expect("mkdir");
    fs::write(p, content).expect("write");
}

/// A two-node machine with 4 CPUs and one GPU on node 1.
fn small_machine(root: &Path) {
    write(root, "sys/devices/system/cpu/online", "0-3\n");
    write(root, "sys/devices/system/node/online", "0-1\n");
    write(root, "sys/devices/system/node/node0/cpulist", "0-1\n");
    write(root, "sys/devices/system/node/node1/cpulist", "2-3\n");
    let dev = "sys/devices/pci0000:00/0000:00:01.0/0000:01:00.0";
    write(root, &format!("{dev}/vendor"), "0x10de\n");
    write(root, &format!("{dev}/device"), "0x2330\n");
    write(root, &format!("{dev}/class"), "0x030200\n");
    write(root, &format!("{dev}/numa_node"), "1\n");
    fs::create_dir_all(root.join("sys/bus/pci/devices")).expect("mkdir");
    std::os::unix::fs::symlink(
        "../../../devices/pci0000:00/0000:00:01.0/0000:01:00.0",
        root.join("sys/bus/pci/devices/0000:01:00.0"),
    )
    .expect("symlink");
}

const GPU: &str = "sys/devices/pci0000:00/0000:00:01.0/0000:01:00.0";

/// The last two components: PCI device files are named through
/// `sys/bus/pci/devices/<addr>/`, the path a user would look at.
fn tail(file: &str) -> String {
    let parts: Vec<&str> = file.rsplitn(3, '/').collect();
    format!("{}/{}", parts[1], parts[0])
}

fn parse_error_path(e: &TopoError) -> String {
    match e {
        TopoError::Parse { path, .. } | TopoError::Missing { path } => {
            path.to_string_lossy().into_owned()
        }
        other => panic!("unexpected error {other:?}"),
    }
}

#[test]
fn small_machine_reads_and_absent_values_stay_absent() {
    let tmp = tempfile::tempdir().expect("tempdir");
    small_machine(tmp.path());
    let m = read_machine(&Root::new(tmp.path())).expect("machine");
    assert_eq!(m.gpus.len(), 1);
    let g = &m.gpus[0];
    assert_eq!(g.numa_node, Some(1));
    assert_eq!(g.model.as_deref(), Some("NVIDIA H100 80GB HBM3"));
    // No link files, no topology files, no meminfo: unknown, not 0.
    assert_eq!(g.link.current_width, None);
    assert_eq!(g.link.degraded(), None);
    assert_eq!(m.threads_per_core, None);
    assert_eq!(m.numa_nodes[0].memory_bytes, None);
    assert!(m.sockets.is_empty());
}

#[test]
fn malformed_files_are_named_in_the_error() {
    let cases = [
        ("sys/devices/system/cpu/online", "0-x\n"),
        ("sys/devices/system/node/node1/cpulist", "3-2\n"),
        (
            "sys/devices/system/node/node0/meminfo",
            "Node 0 MemTotal: lots\n",
        ),
        ("sys/devices/system/node/node0/distance", "10 eleven\n"),
        (&format!("{GPU}/numa_node"), "abc\n"),
        (&format!("{GPU}/vendor"), "nvidia\n"),
        (&format!("{GPU}/current_link_speed"), "fast\n"),
        (&format!("{GPU}/current_link_width"), "-4\n"),
        (&format!("{GPU}/local_cpulist"), "0-99999999\n"),
        ("sys/devices/system/cpu/cpu2/topology/core_id", "two\n"),
    ];
    for (file, content) in cases {
        let tmp = tempfile::tempdir().expect("tempdir");
        small_machine(tmp.path());
        write(tmp.path(), file, content);
        let err = read_machine(&Root::new(tmp.path())).expect_err(file);
        let path = parse_error_path(&err);
        assert!(path.ends_with(&tail(file)), "{file}: error names {path}");
        assert!(err.to_string().contains(&tail(file)), "{err}");
    }
}

#[test]
fn missing_required_files_are_named() {
    let tmp = tempfile::tempdir().expect("tempdir");
    small_machine(tmp.path());
    fs::remove_file(tmp.path().join("sys/devices/system/node/node1/cpulist")).expect("rm");
    let err = read_machine(&Root::new(tmp.path())).expect_err("missing cpulist");
    assert!(parse_error_path(&err).ends_with("sys/devices/system/node/node1/cpulist"));

    let tmp = tempfile::tempdir().expect("tempdir");
    small_machine(tmp.path());
    fs::remove_file(tmp.path().join(format!("{GPU}/class"))).expect("rm");
    let err = read_machine(&Root::new(tmp.path())).expect_err("missing class");
    assert!(
        parse_error_path(&err).ends_with("0000:01:00.0/class"),
        "{err}"
    );
}

#[test]
fn unknown_link_speed_is_absent() {
    let tmp = tempfile::tempdir().expect("tempdir");
    small_machine(tmp.path());
    write(
        tmp.path(),
        &format!("{GPU}/current_link_speed"),
        "Unknown\n",
    );
    write(
        tmp.path(),
        &format!("{GPU}/max_link_speed"),
        "32.0 GT/s PCIe\n",
    );
    write(tmp.path(), &format!("{GPU}/current_link_width"), "8\n");
    write(tmp.path(), &format!("{GPU}/max_link_width"), "16\n");
    let m = read_machine(&Root::new(tmp.path())).expect("machine");
    assert_eq!(m.gpus[0].link.current_speed_gts, None);
    assert_eq!(m.gpus[0].link.max_speed_gts, Some(32.0));
    // x8 of x16 is degraded whatever the unknown speed.
    assert_eq!(m.gpus[0].link.degraded(), Some(true));
}

#[test]
fn gpu_without_numa_node_is_refused_on_a_multi_node_machine() {
    let tmp = tempfile::tempdir().expect("tempdir");
    small_machine(tmp.path());
    write(tmp.path(), &format!("{GPU}/numa_node"), "-1\n");
    let m = read_machine(&Root::new(tmp.path())).expect("machine");
    assert_eq!(m.gpus[0].numa_node, None);
    let req = PlanRequest {
        launcher: Launcher::Srun,
        ranks_per_node: None,
        cpus_per_rank: None,
    };
    assert_eq!(
        plan(&m, &req).map(|_| ()),
        Err(PlanError::GpuWithoutNode {
            gpu: 0,
            pci: "0000:01:00.0".into()
        })
    );
}

#[test]
fn gpu_without_numa_node_on_a_single_node_machine_is_on_node_0() {
    let tmp = tempfile::tempdir().expect("tempdir");
    small_machine(tmp.path());
    write(tmp.path(), "sys/devices/system/node/online", "0\n");
    write(tmp.path(), "sys/devices/system/node/node0/cpulist", "0-3\n");
    write(tmp.path(), &format!("{GPU}/numa_node"), "-1\n");
    let m = read_machine(&Root::new(tmp.path())).expect("machine");
    assert_eq!(m.gpus[0].numa_node, Some(0));
}

#[test]
fn machine_without_numa_in_sysfs_is_one_node() {
    let tmp = tempfile::tempdir().expect("tempdir");
    small_machine(tmp.path());
    fs::remove_dir_all(tmp.path().join("sys/devices/system/node")).expect("rm");
    write(
        tmp.path(),
        "proc/meminfo",
        "MemTotal:       16384 kB\nMemFree: 1 kB\n",
    );
    let m = read_machine(&Root::new(tmp.path())).expect("machine");
    assert!(!m.numa_from_sysfs);
    assert_eq!(m.numa_nodes.len(), 1);
    assert_eq!(m.numa_nodes[0].memory_bytes, Some(16384 * 1024));
    assert_eq!(m.numa_nodes[0].cpus.to_list(), "0-3");
}

#[test]
fn plan_limits() {
    let tmp = tempfile::tempdir().expect("tempdir");
    small_machine(tmp.path());
    let m = read_machine(&Root::new(tmp.path())).expect("machine");
    let req = |n, c| PlanRequest {
        launcher: Launcher::Srun,
        ranks_per_node: n,
        cpus_per_rank: c,
    };
    assert_eq!(
        plan(&m, &req(Some(5), None)).map(|_| ()),
        Err(PlanError::MoreRanksThanCpus { ranks: 5, cpus: 4 })
    );
    assert_eq!(
        plan(&m, &req(Some(0), None)).map(|_| ()),
        Err(PlanError::ZeroRanks)
    );
    assert_eq!(
        plan(&m, &req(None, Some(0))).map(|_| ()),
        Err(PlanError::ZeroCpus)
    );
    let p = plan(&m, &req(Some(2), Some(1))).expect("two ranks on one GPU");
    assert_eq!(p.ranks[0].cpus.to_list(), "2");
    assert_eq!(p.ranks[1].cpus.to_list(), "3");
    assert_eq!(
        p.command,
        "srun --ntasks-per-node=2 --cpu-bind=mask_cpu:4,8"
    );
    assert!(matches!(
        plan(&m, &req(Some(4), Some(1))),
        Err(PlanError::DoesNotFit { node: 1, .. })
    ));
}

#[test]
fn a_refused_link_attribute_is_absent_not_an_error() {
    let tmp = tempfile::tempdir().expect("tempdir");
    small_machine(tmp.path());
    // A directory where the attribute should be: reading it fails with
    // EISDIR, as the kernel fails a read of a link whose device does not
    // answer (EINVAL). Root reads through 000 permissions, a directory not.
    fs::create_dir_all(tmp.path().join(format!("{GPU}/current_link_width"))).expect("mkdir");
    write(tmp.path(), &format!("{GPU}/max_link_width"), "16\n");
    let m = read_machine(&Root::new(tmp.path())).expect("one unreadable attribute is no error");
    assert_eq!(m.gpus[0].link.current_width, None);
    assert_eq!(m.gpus[0].link.max_width, Some(16));
}

#[test]
fn mpirun_plan_on_a_machine_whose_nodes_list_no_cpu_is_an_error() {
    let tmp = tempfile::tempdir().expect("tempdir");
    small_machine(tmp.path());
    write(tmp.path(), "sys/devices/system/node/node0/cpulist", "\n");
    write(tmp.path(), "sys/devices/system/node/node1/cpulist", "\n");
    let Ok(m) = read_machine(&Root::new(tmp.path())) else {
        return; // refused while reading: also no panic
    };
    let req = PlanRequest {
        launcher: Launcher::Mpirun,
        ranks_per_node: None,
        cpus_per_rank: None,
    };
    assert!(plan(&m, &req).is_err());
}
