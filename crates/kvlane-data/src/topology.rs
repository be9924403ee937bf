//! GPU and NIC placement on the PCIe tree, read from sysfs.
//!
//! A node with one NIC per GPU only reaches its bandwidth when each GPU's
//! memory goes out through the NIC nearest to it; the next nearest crosses
//! a host bridge or the socket interconnect. [`Topology::scan`] reads the
//! PCIe hierarchy from `/sys` (no driver, no GPU runtime needed) and
//! [`link`] classifies a GPU-NIC pair the way `nvidia-smi topo -m`
//! does, so the two tools' matrices can be compared line by line.
//!
//! GPUs are numbered in PCI bus order (`CUDA_DEVICE_ORDER=PCI_BUS_ID`);
//! match them with a runtime's devices by [`PciDevice::address`].

use std::cmp::Ordering;
use std::fmt;
use std::fs;
use std::path::{Path, PathBuf};

/// How far apart two PCIe devices are, nearest first (`nvidia-smi topo`
/// names).
#[derive(Copy, Clone, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Link {
    /// At most one PCIe switch between them.
    Pix,
    /// Several PCIe bridges, not through the host bridge.
    Pxb,
    /// Through one PCIe host bridge (the CPU's root complex).
    Phb,
    /// Across host bridges within one NUMA node.
    Node,
    /// Across NUMA nodes (the socket interconnect), or placement unknown.
    Sys,
}

impl fmt::Display for Link {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.pad(match self {
            Self::Pix => "PIX",
            Self::Pxb => "PXB",
            Self::Phb => "PHB",
            Self::Node => "NODE",
            Self::Sys => "SYS",
        })
    }
}

/// A PCI function and where it sits in the tree.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PciDevice {
    /// Normalized bus id, `dddd:bb:dd.f` in lower case.
    pub address: String,
    /// PCI vendor id.
    pub vendor: u16,
    /// PCI device id.
    pub device: u16,
    /// PCI class code (24 bits: class, subclass, programming interface).
    pub class: u32,
    /// NUMA node, when the platform reports one.
    pub numa_node: Option<u32>,
    /// The host bridge (`pciDDDD:BB`) this device hangs off.
    pub host_bridge: String,
    /// Bridges from the root port down to the device, not including it.
    pub bridges: Vec<String>,
}

/// Who made a GPU.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub enum GpuVendor {
    /// PCI vendor 0x10de.
    Nvidia,
    /// PCI vendor 0x1002.
    Amd,
}

/// A GPU found on the PCIe tree.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Gpu {
    /// Position in PCI bus order among the node's GPUs.
    pub index: usize,
    /// Vendor.
    pub vendor: GpuVendor,
    /// Its PCI function.
    pub pci: PciDevice,
}

/// An RDMA device (`/sys/class/infiniband/NAME`) and its PCI function.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Nic {
    /// The verbs device name (`mlx5_0`, `ionic_3`, `rxe0`, ...).
    pub name: String,
    /// Its PCI function; `None` for software devices (rxe, siw).
    pub pci: Option<PciDevice>,
}

/// A sysfs tree could not be read.
#[derive(Debug, thiserror::Error)]
pub enum TopologyError {
    /// A file or link under the sysfs root could not be read.
    #[error("topology: cannot read {path}: {source}")]
    Io {
        /// What was being read.
        path: PathBuf,
        /// The OS error.
        #[source]
        source: std::io::Error,
    },
    /// A sysfs file held something that is not what the kernel writes.
    #[error("topology: {path}: {what}")]
    Parse {
        /// The file.
        path: PathBuf,
        /// What was wrong.
        what: String,
    },
}

/// The GPUs and RDMA NICs of a node and their PCIe placement.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Topology {
    /// GPUs, in PCI bus order.
    pub gpus: Vec<Gpu>,
    /// RDMA devices, by name.
    pub nics: Vec<Nic>,
}

impl Topology {
    /// Reads this machine's `/sys`.
    pub fn scan() -> Result<Self, TopologyError> {
        Self::from_sysfs(Path::new("/sys"))
    }

    /// Reads a sysfs tree rooted at `root` (`/sys`, or a test fixture).
    /// A tree without `bus/pci` or `class/infiniband` has no GPUs or no NICs;
    /// that is not an error.
    pub fn from_sysfs(root: &Path) -> Result<Self, TopologyError> {
        let mut gpus = Vec::new();
        for entry in list(&root.join("bus/pci/devices"))? {
            let dev = pci_device(&entry)?;
            if let Some(vendor) = gpu_vendor(&dev) {
                gpus.push(Gpu {
                    index: 0,
                    vendor,
                    pci: dev,
                });
            }
        }
        gpus.sort_by(|a, b| a.pci.address.cmp(&b.pci.address));
        for (i, g) in gpus.iter_mut().enumerate() {
            g.index = i;
        }
        let mut nics = Vec::new();
        for entry in list(&root.join("class/infiniband"))? {
            let name = entry
                .file_name()
                .map(|n| n.to_string_lossy().into_owned())
                .unwrap_or_default();
            let link = entry.join("device");
            let pci = match fs::symlink_metadata(&link) {
                Ok(_) => Some(pci_device(&link)?),
                // rxe and siw have no PCI function of their own.
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => None,
                Err(source) => return Err(TopologyError::Io { path: link, source }),
            };
            nics.push(Nic { name, pci });
        }
        nics.sort_by(|a, b| natural_cmp(&a.name, &b.name));
        Ok(Self { gpus, nics })
    }

    /// The GPU with this PCI bus id (any case, 4- or 8-digit domain, as
    /// CUDA, HIP and `nvidia-smi` print it).
    pub fn gpu_by_address(&self, bus_id: &str) -> Option<&Gpu> {
        let want = normalize_bus_id(bus_id)?;
        self.gpus.iter().find(|g| g.pci.address == want)
    }

    /// The NICs nearest to `gpu`, best link first; ties keep name order.
    /// Software NICs (no PCI function) come last, as [`Link::Sys`].
    pub fn nics_by_distance(&self, gpu: &PciDevice) -> Vec<(&Nic, Link)> {
        let mut out: Vec<(&Nic, Link)> = self
            .nics
            .iter()
            .map(|n| (n, n.pci.as_ref().map_or(Link::Sys, |p| link(gpu, p))))
            .collect();
        out.sort_by_key(|&(_, l)| l);
        out
    }

    /// The NICs that share the best link to `gpu` (several when the node
    /// gives a GPU two NICs on its switch). Empty when there are no NICs.
    pub fn nearest_nics(&self, gpu: &PciDevice) -> Vec<&Nic> {
        let all = self.nics_by_distance(gpu);
        let best = all.first().map(|&(_, l)| l);
        all.into_iter()
            .take_while(|&(_, l)| Some(l) == best)
            .map(|(n, _)| n)
            .collect()
    }

    /// Which of `rails` (RDMA device names, in rail order) are nearest to
    /// the GPU at PCI address `gpu_bus_id`: the indices of those that
    /// share its best link. Empty when the GPU is not in this topology or
    /// no rail names one of its NICs (tcp rails, say).
    pub fn nearest_rails(&self, gpu_bus_id: &str, rails: &[&str]) -> Vec<usize> {
        let Some(gpu) = self.gpu_by_address(gpu_bus_id) else {
            return Vec::new();
        };
        let links: Vec<(usize, Link)> = rails
            .iter()
            .enumerate()
            .filter_map(|(i, name)| {
                let nic = self.nics.iter().find(|n| n.name == *name)?;
                Some((i, nic.pci.as_ref().map_or(Link::Sys, |p| link(&gpu.pci, p))))
            })
            .collect();
        let Some(best) = links.iter().map(|&(_, l)| l).min() else {
            return Vec::new();
        };
        links
            .into_iter()
            .filter(|&(_, l)| l == best)
            .map(|(i, _)| i)
            .collect()
    }

    /// The GPU x NIC matrix as `kvlane devices` prints it: one row per GPU
    /// (index, bus id, NUMA node, then the link to each NIC).
    pub fn matrix(&self) -> String {
        use std::fmt::Write;
        let mut s = String::new();
        let w = self
            .nics
            .iter()
            .map(|n| n.name.len())
            .max()
            .unwrap_or(0)
            .max(4);
        let _ = write!(s, "{:<6} {:<12} {:>4}", "", "bus id", "NUMA");
        for n in &self.nics {
            let _ = write!(s, "  {:>w$}", n.name);
        }
        s.push('\n');
        for g in &self.gpus {
            let numa = g.pci.numa_node.map_or("-".to_string(), |n| n.to_string());
            let _ = write!(
                s,
                "{:<6} {:<12} {:>4}",
                format!("GPU{}", g.index),
                g.pci.address,
                numa
            );
            for n in &self.nics {
                let l = n.pci.as_ref().map_or(Link::Sys, |p| link(&g.pci, p));
                let _ = write!(s, "  {:>w$}", l.to_string());
            }
            s.push('\n');
        }
        s
    }
}

/// Classifies the path between two PCI functions.
pub fn link(a: &PciDevice, b: &PciDevice) -> Link {
    if a.host_bridge != b.host_bridge {
        return match (a.numa_node, b.numa_node) {
            (Some(x), Some(y)) if x == y => Link::Node,
            _ => Link::Sys,
        };
    }
    let common = a
        .bridges
        .iter()
        .zip(&b.bridges)
        .take_while(|(x, y)| x == y)
        .count();
    if common == 0 {
        // Different root ports of one host bridge.
        return Link::Phb;
    }
    // Below the last shared bridge (a switch's upstream port) each side
    // passes at most one more bridge (its downstream port): one switch
    // between them, however deep that switch sits.
    let below = (a.bridges.len() - common).max(b.bridges.len() - common);
    if below <= 1 {
        Link::Pix
    } else {
        Link::Pxb
    }
}

/// `dddd:bb:dd.f` in lower case, from any of the spellings runtimes use
/// (`00000000:1B:00.0`, `0000:1b:00.0`, `1b:00.0`).
pub fn normalize_bus_id(id: &str) -> Option<String> {
    let id = id.trim();
    let (domain, rest) = match id.matches(':').count() {
        2 => id.split_once(':')?,
        1 => ("0", id),
        _ => return None,
    };
    let domain = u32::from_str_radix(domain, 16).ok()?;
    let (bus, rest) = rest.split_once(':')?;
    let (dev, func) = rest.split_once('.')?;
    let bus = u8::from_str_radix(bus, 16).ok()?;
    let dev = u8::from_str_radix(dev, 16).ok()?;
    let func = u8::from_str_radix(func, 16).ok()?;
    if domain > 0xffff || dev > 0x1f || func > 7 {
        return None;
    }
    Some(format!("{domain:04x}:{bus:02x}:{dev:02x}.{func:x}"))
}

fn list(dir: &Path) -> Result<Vec<PathBuf>, TopologyError> {
    match fs::read_dir(dir) {
        Ok(rd) => {
            let mut v = Vec::new();
            for e in rd {
                let e = e.map_err(|source| TopologyError::Io {
                    path: dir.to_path_buf(),
                    source,
                })?;
                v.push(e.path());
            }
            Ok(v)
        }
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(Vec::new()),
        Err(source) => Err(TopologyError::Io {
            path: dir.to_path_buf(),
            source,
        }),
    }
}

/// Reads the PCI function a sysfs link (or directory) points at.
fn pci_device(link: &Path) -> Result<PciDevice, TopologyError> {
    let real = fs::canonicalize(link).map_err(|source| TopologyError::Io {
        path: link.to_path_buf(),
        source,
    })?;
    let parse_err = |what: String| TopologyError::Parse {
        path: real.clone(),
        what,
    };
    // .../devices/pciDDDD:BB/<root port>/<bridge>.../<device>
    let parts: Vec<String> = real
        .components()
        .map(|c| c.as_os_str().to_string_lossy().into_owned())
        .collect();
    let root_at = parts
        .iter()
        .rposition(|p| p.starts_with("pci") && p.contains(':'))
        .ok_or_else(|| parse_err("not under a PCI host bridge (devices/pciDDDD:BB)".into()))?;
    let mut chain: Vec<String> = Vec::new();
    for p in &parts[root_at + 1..] {
        let bdf =
            normalize_bus_id(p).ok_or_else(|| parse_err(format!("`{p}` is not a PCI bus id")))?;
        chain.push(bdf);
    }
    let address = chain
        .pop()
        .ok_or_else(|| parse_err("a host bridge, not a PCI function".into()))?;
    let hex = |name: &str| -> Result<u32, TopologyError> {
        let f = real.join(name);
        let s = fs::read_to_string(&f).map_err(|source| TopologyError::Io {
            path: f.clone(),
            source,
        })?;
        let t = s.trim();
        u32::from_str_radix(t.trim_start_matches("0x"), 16).map_err(|_| TopologyError::Parse {
            path: f,
            what: format!("`{t}` is not a hex number"),
        })
    };
    let narrow = |name: &str| -> Result<u16, TopologyError> {
        let v = hex(name)?;
        u16::try_from(v).map_err(|_| TopologyError::Parse {
            path: real.join(name),
            what: format!("{v:#x} does not fit a 16-bit PCI id"),
        })
    };
    let numa_file = real.join("numa_node");
    let numa_node = match fs::read_to_string(&numa_file) {
        Ok(s) => match s.trim().parse::<i64>() {
            Ok(n) if n >= 0 => u32::try_from(n).ok(),
            Ok(_) => None,
            Err(_) => {
                return Err(TopologyError::Parse {
                    path: numa_file,
                    what: format!("`{}` is not a NUMA node", s.trim()),
                })
            }
        },
        Err(_) => None,
    };
    Ok(PciDevice {
        address,
        vendor: narrow("vendor")?,
        device: narrow("device")?,
        class: hex("class")?,
        numa_node,
        host_bridge: parts[root_at].clone(),
        bridges: chain,
    })
}

fn gpu_vendor(d: &PciDevice) -> Option<GpuVendor> {
    let class = d.class >> 8; // class + subclass
    match d.vendor {
        // VGA (0x0300) or 3D controller (0x0302).
        0x10de if matches!(class, 0x0300 | 0x0302) => Some(GpuVendor::Nvidia),
        // Instinct parts enumerate as display (0x0380) or processing
        // accelerators (0x1200); Radeon as VGA.
        0x1002 if matches!(class, 0x0300 | 0x0302 | 0x0380 | 0x1200) => Some(GpuVendor::Amd),
        _ => None,
    }
}

/// `mlx5_2` before `mlx5_10`.
fn natural_cmp(a: &str, b: &str) -> Ordering {
    let split = |s: &str| {
        let at = s.trim_end_matches(|c: char| c.is_ascii_digit()).len();
        let (head, num) = s.split_at(at);
        (head.to_string(), num.parse::<u64>().ok())
    };
    split(a).cmp(&split(b)).then_with(|| a.cmp(b))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bus_ids_normalize_from_every_runtime_spelling() {
        assert_eq!(
            normalize_bus_id("00000000:1B:00.0").as_deref(),
            Some("0000:1b:00.0")
        );
        assert_eq!(normalize_bus_id("1b:00.0").as_deref(), Some("0000:1b:00.0"));
        assert_eq!(normalize_bus_id("pci0000:1b"), None);
        assert_eq!(normalize_bus_id("0000:1b:20.0"), None);
    }

    #[test]
    fn names_sort_by_their_number() {
        let mut v = vec!["mlx5_10", "mlx5_2", "ionic_0", "mlx5_1"];
        v.sort_by(|a, b| natural_cmp(a, b));
        assert_eq!(v, ["ionic_0", "mlx5_1", "mlx5_2", "mlx5_10"]);
    }
}
