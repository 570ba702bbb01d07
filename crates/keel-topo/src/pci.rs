//! PCI addresses, device identification and PCIe distance between devices.

use std::fmt;
use std::path::Path;
use std::str::FromStr;

/// A PCI address `DDDD:BB:DD.F` (domain, bus, device, function). Ordered the
/// way NVML and `CUDA_DEVICE_ORDER=PCI_BUS_ID` number GPUs.
#[derive(Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct PciAddr {
    pub domain: u32,
    pub bus: u8,
    pub device: u8,
    pub function: u8,
}

impl FromStr for PciAddr {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let bad = || format!("{s:?} is not a PCI address (DDDD:BB:DD.F)");
        let (domain, rest) = s.split_once(':').ok_or_else(bad)?;
        let (bus, rest) = rest.split_once(':').ok_or_else(bad)?;
        let (device, function) = rest.split_once('.').ok_or_else(bad)?;
        let hex = |t: &str, max_len: usize| {
            if t.is_empty() || t.len() > max_len || !t.bytes().all(|b| b.is_ascii_hexdigit()) {
                Err(bad())
            } else {
                u32::from_str_radix(t, 16).map_err(|_| bad())
            }
        };
        let domain = hex(domain, 8)?;
        let bus = hex(bus, 2)? as u8;
        let device = hex(device, 2)?;
        let function = hex(function, 1)?;
        if device > 0x1f || function > 7 {
            return Err(bad());
        }
        Ok(Self {
            domain,
            bus,
            device: device as u8,
            function: function as u8,
        })
    }
}

impl fmt::Display for PciAddr {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{:04x}:{:02x}:{:02x}.{:x}",
            self.domain, self.bus, self.device, self.function
        )
    }
}

impl fmt::Debug for PciAddr {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "PciAddr({self})")
    }
}

impl serde::Serialize for PciAddr {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.collect_str(self)
    }
}

/// The PCI addresses on a resolved sysfs device path, from the root port
/// down to the device itself:
/// `sys/devices/pci0000:00/0000:00:01.1/0000:01:00.0/0000:02:00.0` gives
/// `[0000:00:01.1, 0000:01:00.0, 0000:02:00.0]`. Also returns the host
/// bridge component (`pci0000:00`) when there is one.
pub fn chain(resolved: &Path) -> (Option<String>, Vec<PciAddr>) {
    let mut host = None;
    let mut addrs = Vec::new();
    for comp in resolved.components() {
        let name = comp.as_os_str().to_string_lossy();
        if let Some(rest) = name.strip_prefix("pci") {
            if rest.contains(':') && !rest.contains('.') {
                host = Some(name.to_string());
                addrs.clear();
                continue;
            }
        }
        if let Ok(a) = name.parse::<PciAddr>() {
            addrs.push(a);
        }
    }
    (host, addrs)
}

/// How two PCI devices are connected, with the names `nvidia-smi topo -m`
/// uses.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, serde::Serialize)]
pub enum Relation {
    /// Behind the same PCIe switch, one bridge each.
    #[serde(rename = "PIX")]
    Pix,
    /// Behind a common PCIe switch, crossing several bridges.
    #[serde(rename = "PXB")]
    Pxb,
    /// Under the same PCIe host bridge, without a common switch.
    #[serde(rename = "PHB")]
    Phb,
    /// On the same NUMA node, through different host bridges.
    #[serde(rename = "NODE")]
    Node,
    /// On different NUMA nodes (crossing the socket interconnect), or with
    /// an unknown NUMA node.
    #[serde(rename = "SYS")]
    Sys,
}

impl Relation {
    pub fn as_str(self) -> &'static str {
        match self {
            Relation::Pix => "PIX",
            Relation::Pxb => "PXB",
            Relation::Phb => "PHB",
            Relation::Node => "NODE",
            Relation::Sys => "SYS",
        }
    }

    /// Whether the two devices share a PCIe switch.
    pub fn shares_switch(self) -> bool {
        matches!(self, Relation::Pix | Relation::Pxb)
    }
}

/// Where a device sits: its host bridge, bridge chain (ending with the
/// device itself) and NUMA node.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Placement {
    pub host_bridge: Option<String>,
    pub chain: Vec<PciAddr>,
    pub numa_node: Option<u32>,
}

/// The PCIe relation between two placed devices.
pub fn relation(a: &Placement, b: &Placement) -> Relation {
    let same_host = a.host_bridge.is_some() && a.host_bridge == b.host_bridge;
    if same_host {
        // Bridges above each device (its chain without itself).
        let above_a = &a.chain[..a.chain.len().saturating_sub(1)];
        let above_b = &b.chain[..b.chain.len().saturating_sub(1)];
        let common = above_a
            .iter()
            .zip(above_b)
            .take_while(|(x, y)| x == y)
            .count();
        if common >= 1 {
            // The first common bridge is the root port, so sharing it means
            // sharing the switch below it. One private bridge each (the
            // downstream ports of one switch) is PIX.
            if above_a.len() - common <= 1 && above_b.len() - common <= 1 {
                return Relation::Pix;
            }
            return Relation::Pxb;
        }
        return Relation::Phb;
    }
    match (a.numa_node, b.numa_node) {
        (Some(x), Some(y)) if x == y => Relation::Node,
        _ => Relation::Sys,
    }
}

/// Marketing names of NVIDIA data-centre GPUs by PCI device id. NVML, when
/// present, names every device; this table covers the common ones so that
/// sysfs alone can say what a machine has.
pub fn nvidia_model(device_id: u16) -> Option<&'static str> {
    Some(match device_id {
        0x1db1 => "NVIDIA Tesla V100-SXM2-16GB",
        0x1db4 => "NVIDIA Tesla V100-PCIE-16GB",
        0x1db5 => "NVIDIA Tesla V100-SXM2-32GB",
        0x1db6 => "NVIDIA Tesla V100-PCIE-32GB",
        0x1eb8 => "NVIDIA Tesla T4",
        0x20b0 => "NVIDIA A100-SXM4-40GB",
        0x20b2 => "NVIDIA A100-SXM4-80GB",
        0x20b5 => "NVIDIA A100 80GB PCIe",
        0x20f1 => "NVIDIA A100-PCIE-40GB",
        0x2236 => "NVIDIA A10",
        0x26b5 => "NVIDIA L40",
        0x26b9 => "NVIDIA L40S",
        0x27b8 => "NVIDIA L4",
        0x2321 => "NVIDIA H100 NVL",
        0x2330 => "NVIDIA H100 80GB HBM3",
        0x2331 => "NVIDIA H100 PCIe",
        0x2335 => "NVIDIA H200",
        0x233b => "NVIDIA H200 NVL",
        0x2901 => "NVIDIA B200",
        _ => return None,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn a(s: &str) -> PciAddr {
        s.parse().expect("valid address")
    }

    #[test]
    fn addresses_parse_and_print() {
        assert_eq!(a("0000:07:00.0").to_string(), "0000:07:00.0");
        assert_eq!(a("000B:00:00.0").to_string(), "000b:00:00.0");
        assert_eq!(a("10000:e1:00.3").to_string(), "10000:e1:00.3");
        for bad in [
            "",
            "0000:07:00",
            "0000:07.00.0",
            "zz:07:00.0",
            "0000:107:00.0",
            "0000:07:20.0",
            "0000:07:00.8",
        ] {
            assert!(bad.parse::<PciAddr>().is_err(), "{bad:?} accepted");
        }
    }

    #[test]
    fn pci_bus_order_is_numeric() {
        let mut v = [
            a("000b:00:00.0"),
            a("0002:00:00.0"),
            a("0001:00:00.0"),
            a("000e:00:00.0"),
        ];
        v.sort();
        let s: Vec<String> = v.iter().map(|x| x.to_string()).collect();
        assert_eq!(
            s,
            [
                "0001:00:00.0",
                "0002:00:00.0",
                "000b:00:00.0",
                "000e:00:00.0"
            ]
        );
    }

    fn placed(path: &str, numa: Option<u32>) -> Placement {
        let (host_bridge, chain) = chain(Path::new(path));
        Placement {
            host_bridge,
            chain,
            numa_node: numa,
        }
    }

    #[test]
    fn relations_follow_the_bridge_chain() {
        let gpu = placed("devices/pci0000:00/0000:00:01.1/0000:01:00.0/0000:02:00.0/0000:03:00.0/0000:04:00.0/0000:07:00.0", Some(3));
        let pix = placed("devices/pci0000:00/0000:00:01.1/0000:01:00.0/0000:02:00.0/0000:03:00.0/0000:04:08.0/0000:0c:00.0", Some(3));
        let pxb = placed(
            "devices/pci0000:00/0000:00:01.1/0000:01:00.0/0000:02:08.0/0000:12:00.0",
            Some(3),
        );
        let phb = placed("devices/pci0000:00/0000:00:01.2/0000:20:00.0", Some(3));
        let node = placed("devices/pci0000:40/0000:40:01.1/0000:41:00.0", Some(3));
        let sys = placed("devices/pci0000:80/0000:80:01.1/0000:81:00.0", Some(5));
        assert_eq!(relation(&gpu, &pix), Relation::Pix);
        assert_eq!(relation(&gpu, &pxb), Relation::Pxb);
        assert_eq!(relation(&gpu, &phb), Relation::Phb);
        assert_eq!(relation(&gpu, &node), Relation::Node);
        assert_eq!(relation(&gpu, &sys), Relation::Sys);
        assert_eq!(relation(&pix, &gpu), Relation::Pix);
    }

    #[test]
    fn hyperv_devices_each_have_their_own_host_bridge() {
        let g = placed("devices/LNXSYSTM:00/LNXSYBUS:00/ACPI0004:00/VMBUS:00/47505500-0001-0000-3130-444531303244/pci0001:00/0001:00:00.0", Some(1));
        let h = placed("devices/LNXSYSTM:00/LNXSYBUS:00/ACPI0004:00/VMBUS:00/c0ffee00-0101-0000-3130-444531303244/pci0101:00/0101:00:00.0", Some(1));
        assert_eq!(g.chain, vec![a("0001:00:00.0")]);
        assert_eq!(relation(&g, &h), Relation::Node);
        let far = Placement {
            numa_node: None,
            ..h
        };
        assert_eq!(relation(&g, &far), Relation::Sys);
    }

    proptest! {
        #[test]
        fn address_round_trips(d in 0u32..0x10000, b in 0u8..=255, dev in 0u8..32, f in 0u8..8) {
            let x = PciAddr { domain: d, bus: b, device: dev, function: f };
            prop_assert_eq!(x.to_string().parse::<PciAddr>(), Ok(x));
        }

        #[test]
        fn address_parser_never_panics(s in "[0-9a-fA-F:.]{0,16}") {
            let _ = s.parse::<PciAddr>();
        }
    }
}
