//! dcgm-exporter's metric names and labels (`DCGM_FI_DEV_*`; labels `gpu`,
//! `UUID`, `device`, `modelName`, `Hostname`, `pci_bus_id`, `DCGM_FI_DRIVER_VERSION`,
//! and `hpc_job` where a job holds the GPU), in dcgm-exporter's units (MiB,
//! MHz, percent, millijoules).

use crate::readings::Readings;

/// The readings under dcgm-exporter's names.
pub fn render(r: &Readings) -> String {
    crate::expose::render(r)
}
