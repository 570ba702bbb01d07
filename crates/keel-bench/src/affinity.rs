//! Pinning the measuring thread to a GPU's CPUs, and finding those CPUs in
//! the machine keel-topo read.

use keel_topo::{CpuSet, Machine, PciAddr};
use rustix::thread::{sched_setaffinity, CpuSet as RawCpuSet};

use crate::BenchError;

/// Where a GPU sits: its NUMA node and the CPUs on it, when sysfs says.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Placement {
    pub numa_node: Option<u32>,
    pub cpus: Option<CpuSet>,
}

/// The GPU with PCI address `pci` (as the CUDA driver writes it) in
/// `machine`: its NUMA node, and the node's CPUs (or the device's
/// `local_cpulist` when the node is unknown).
pub fn placement(machine: Option<&Machine>, pci: &str) -> Placement {
    let Some(m) = machine else {
        return Placement::default();
    };
    let Ok(addr) = pci.parse::<PciAddr>() else {
        return Placement::default();
    };
    let Some(gpu) = m.gpus.iter().find(|g| g.pci == addr) else {
        return Placement::default();
    };
    let node_cpus = gpu
        .numa_node
        .and_then(|n| m.numa_nodes.iter().find(|nn| nn.id == n))
        .map(|nn| nn.cpus.clone())
        .filter(|c| !c.is_empty());
    Placement {
        numa_node: gpu.numa_node,
        cpus: node_cpus.or_else(|| gpu.local_cpus.clone().filter(|c| !c.is_empty())),
    }
}

/// Restricts the calling thread to `cpus`. Memory the thread touches
/// first afterwards is then allocated on their NUMA node (Linux's default
/// local policy).
pub fn pin_current_thread(cpus: &CpuSet) -> Result<(), BenchError> {
    let mut set = RawCpuSet::new();
    let mut any = false;
    for c in cpus.iter() {
        if (c as usize) < RawCpuSet::MAX_CPU {
            set.set(c as usize);
            any = true;
        }
    }
    if !any {
        return Err(BenchError::Affinity {
            cpus: cpus.to_list(),
            source: std::io::Error::new(std::io::ErrorKind::InvalidInput, "no usable CPU"),
        });
    }
    sched_setaffinity(None, &set).map_err(|e| BenchError::Affinity {
        cpus: cpus.to_list(),
        source: e.into(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pins_this_thread() {
        // Pin a scratch thread to the CPUs it may already use (the first
        // one), then check the kernel agrees.
        std::thread::spawn(|| {
            let current = rustix::thread::sched_getaffinity(None).expect("affinity");
            let first = (0..RawCpuSet::MAX_CPU)
                .find(|c| current.is_set(*c))
                .expect("some CPU");
            let want: CpuSet = [first as u32].into_iter().collect();
            pin_current_thread(&want).expect("pin");
            let now = rustix::thread::sched_getaffinity(None).expect("affinity");
            assert_eq!(now.count(), 1);
            assert!(now.is_set(first));
        })
        .join()
        .expect("thread");
        let e = pin_current_thread(&CpuSet::new()).expect_err("empty");
        assert!(e.to_string().contains("cannot pin"), "{e}");
    }

    #[test]
    fn gpu_placement_from_a_fixture() {
        let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("../../tests/fixtures/nd96asr_v4");
        let m = keel_topo::read_machine(&keel_topo::Root::new(&root)).expect("fixture");
        // GPU 0 of an ND96asr_v4 is on NUMA node 1, CPUs 24-47.
        let p = placement(Some(&m), "0001:00:00.0");
        assert_eq!(p.numa_node, Some(1));
        assert_eq!(p.cpus.expect("cpus").to_list(), "24-47");
        assert_eq!(placement(Some(&m), "00ff:00:00.0"), Placement::default());
        assert_eq!(placement(None, "0001:00:00.0"), Placement::default());
    }
}
