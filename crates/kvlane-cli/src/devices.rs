//! `kvlane devices`: GPUs and RDMA devices, or the plain reason there are
//! none.

use kvlane_data::topology::Topology;
use kvlane_data::{gpu_devices, GpuRuntime};
use std::path::{Path, PathBuf};

/// Options of `kvlane devices`.
#[derive(clap::Args, Debug)]
pub(crate) struct DevicesArgs {
    /// Read the PCIe tree for the GPU x NIC matrix from this sysfs root
    /// (a saved or fixture tree) instead of /sys.
    #[arg(long, default_value = "/sys")]
    sysfs: PathBuf,
}

/// Prints what this machine offers; returns false when there is no RDMA.
pub(crate) fn run(args: &DevicesArgs) -> bool {
    gpus();
    topology(&args.sysfs);
    rdma()
}

/// The GPU x NIC matrix (`nvidia-smi topo -m` link classes: PIX one PCIe
/// switch, PXB several bridges, PHB the host bridge, NODE across host
/// bridges of one NUMA node, SYS across NUMA nodes).
fn topology(sysfs: &Path) {
    match Topology::from_sysfs(sysfs) {
        Ok(t) if !t.gpus.is_empty() && !t.nics.is_empty() => {
            crate::out::outln!("topology (GPU x RDMA NIC, from {}):", sysfs.display());
            crate::out::out!("{}", t.matrix());
            for g in &t.gpus {
                let near: Vec<&str> = t
                    .nearest_nics(&g.pci)
                    .iter()
                    .map(|n| n.name.as_str())
                    .collect();
                crate::out::outln!("nearest to GPU{}: {}", g.index, near.join(", "));
            }
        }
        Ok(t) => crate::out::outln!(
            "topology: {} GPU(s) and {} RDMA NIC(s) on the PCIe tree of {} (no matrix)",
            t.gpus.len(),
            t.nics.len(),
            sysfs.display()
        ),
        Err(e) => crate::out::outln!("topology: {e}"),
    }
}

/// One line per GPU (`cuda:0 NVIDIA H200 pci 0000:1b:00.0 ...`), or one
/// line per runtime saying why it has none.
fn gpus() {
    for rt in [GpuRuntime::Cuda, GpuRuntime::Rocm] {
        match gpu_devices(rt) {
            Ok(devs) => devs.iter().for_each(|d| crate::out::outln!("gpu {d}")),
            Err(e) => crate::out::outln!("no {rt} GPU: {e}"),
        }
    }
}

fn rdma() -> bool {
    let sysfs = Path::new("/sys/class/infiniband");
    let names: Vec<String> = std::fs::read_dir(sysfs)
        .map(|d| {
            d.filter_map(|e| e.ok())
                .map(|e| e.file_name().to_string_lossy().into_owned())
                .collect()
        })
        .unwrap_or_default();
    if !cfg!(feature = "verbs") {
        crate::out::outln!("no RDMA: this kvlane was built without the `verbs` feature (cargo build --features verbs)");
        if names.is_empty() {
            crate::out::outln!(
                "(and the kernel exposes no RDMA devices: {} is missing or empty)",
                sysfs.display()
            );
        } else {
            crate::out::outln!("the kernel has RDMA devices: {}", names.join(", "));
        }
        crate::out::outln!("available backends: tcp, loopback");
        return false;
    }
    verbs_devices()
}

#[cfg(feature = "verbs")]
fn verbs_devices() -> bool {
    match kvlane_data::verbs::list_devices() {
        Ok(devs) if !devs.is_empty() => {
            for d in devs {
                crate::out::outln!("{d}");
            }
            true
        }
        Ok(_) => {
            crate::out::outln!(
                "no RDMA: libibverbs found no devices; available backends: tcp, loopback"
            );
            false
        }
        Err(e) => {
            crate::out::outln!("no RDMA: {e}; available backends: tcp, loopback");
            false
        }
    }
}

#[cfg(not(feature = "verbs"))]
fn verbs_devices() -> bool {
    false
}
