//! Device discovery: list devices, ports, GIDs and limits; pick a device, port
//! and GID by name, environment or "first ACTIVE port".

use std::fmt;
use std::net::Ipv6Addr;
use std::path::Path;
use std::sync::Arc;

use serde::{Deserialize, Serialize};
use sideway::ibverbs::address::GidType;
use sideway::ibverbs::device::{DeviceInfo as _, DeviceList};
use sideway::ibverbs::device_context::DeviceContext;

use super::error::{io_cause, libc_errno, Unsupported, VerbsError};

/// Environment variable naming the RDMA device to use (`mlx5_0`, `rxe0`, or
/// `name:port`). Overrides nothing set explicitly in [`DeviceConfig`].
pub const ENV_DEVICE: &str = "KVLANE_IB_DEVICE";
/// Environment variable forcing a GID index (decimal).
pub const ENV_GID_INDEX: &str = "KVLANE_IB_GID_INDEX";

/// Wire format of a GID.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[non_exhaustive]
pub enum GidKind {
    /// Native InfiniBand.
    Ib,
    /// RoCE v1 (Ethernet, not routable).
    RoceV1,
    /// RoCE v2 (UDP/IP, routable).
    RoceV2,
}

impl fmt::Display for GidKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Self::Ib => "IB",
            Self::RoceV1 => "RoCE v1",
            Self::RoceV2 => "RoCE v2",
        })
    }
}

/// One entry of a port's GID table.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GidInfo {
    /// Index in the port's GID table (what `sgid_index` means).
    pub index: u32,
    /// The GID itself; IPv4 addresses appear as `::ffff:a.b.c.d`.
    pub gid: Ipv6Addr,
    /// Wire format.
    pub kind: GidKind,
}

impl GidInfo {
    /// `true` for an IPv4-mapped GID (`::ffff:a.b.c.d`).
    pub fn is_ipv4(&self) -> bool {
        self.gid.to_ipv4_mapped().is_some()
    }
}

/// Logical state of a port.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum PortStatus {
    /// Link down.
    Down,
    /// Link up, waiting for the subnet manager.
    Init,
    /// Link up, not yet active.
    Armed,
    /// Usable.
    Active,
    /// Was active, link lost, may recover.
    ActiveDefer,
    /// Anything else.
    Unknown,
}

impl fmt::Display for PortStatus {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Self::Down => "DOWN",
            Self::Init => "INIT",
            Self::Armed => "ARMED",
            Self::Active => "ACTIVE",
            Self::ActiveDefer => "ACTIVE_DEFER",
            Self::Unknown => "UNKNOWN",
        })
    }
}

/// One physical port of a device.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PortInfo {
    /// Port number (1-based).
    pub port: u8,
    /// Logical state.
    pub state: PortStatus,
    /// `true` for Ethernet (RoCE), `false` for InfiniBand.
    pub ethernet: bool,
    /// Active path MTU in bytes.
    pub active_mtu: u32,
    /// Largest message a single work request may carry.
    pub max_msg_size: u32,
    /// Port LID (0 on RoCE).
    pub lid: u16,
    /// Non-zero GID table entries.
    pub gids: Vec<GidInfo>,
}

/// Device limits that shape how work is posted.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DeviceLimits {
    /// Maximum number of queue pairs.
    pub max_qp: u32,
    /// Maximum outstanding work requests per queue.
    pub max_qp_wr: u32,
    /// Maximum scatter/gather entries per work request.
    pub max_sge: u32,
    /// Maximum completion queue entries.
    pub max_cqe: u32,
    /// Largest registrable memory region in bytes.
    pub max_mr_size: u64,
    /// RDMA READs a queue pair can serve as responder at once.
    pub max_qp_rd_atom: u8,
    /// RDMA READs a queue pair can have outstanding as initiator.
    pub max_qp_init_rd_atom: u8,
}

/// Everything `kvlane devices` prints about one RDMA device.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DeviceInfo {
    /// Device name, e.g. `mlx5_0` or `rxe0`.
    pub name: String,
    /// Node GUID, hex.
    pub node_guid: String,
    /// Ports, in port-number order.
    pub ports: Vec<PortInfo>,
    /// Limits.
    pub limits: DeviceLimits,
}

impl DeviceInfo {
    /// The first port in the ACTIVE state.
    pub fn first_active_port(&self) -> Option<&PortInfo> {
        self.ports.iter().find(|p| p.state == PortStatus::Active)
    }
}

impl fmt::Display for DeviceInfo {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let l = &self.limits;
        writeln!(f, "{} (guid {})", self.name, self.node_guid)?;
        writeln!(
            f,
            "  limits: max_qp={} max_qp_wr={} max_sge={} max_cqe={} max_mr_size={} \
             max_qp_rd_atom={} max_qp_init_rd_atom={}",
            l.max_qp,
            l.max_qp_wr,
            l.max_sge,
            l.max_cqe,
            l.max_mr_size,
            l.max_qp_rd_atom,
            l.max_qp_init_rd_atom
        )?;
        for p in &self.ports {
            writeln!(
                f,
                "  port {}: {} {} mtu={} max_msg_sz={} lid={}",
                p.port,
                p.state,
                if p.ethernet { "Ethernet" } else { "InfiniBand" },
                p.active_mtu,
                p.max_msg_size,
                p.lid
            )?;
            for g in &p.gids {
                writeln!(f, "    gid[{}] {} ({})", g.index, g.gid, g.kind)?;
            }
        }
        Ok(())
    }
}

/// Which GID of the port to use.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
#[non_exhaustive]
pub enum GidSelector {
    /// RoCE v2 with an IPv4-mapped address; else any RoCE v2; else IB; else
    /// the first GID. The default: it is what routed RoCE fabrics need.
    #[default]
    RoceV2Ipv4,
    /// This exact table index.
    Index(u32),
    /// The first GID of this kind.
    Kind(GidKind),
}

/// How to pick the device, port and GID. Empty fields fall back to the
/// environment ([`ENV_DEVICE`], [`ENV_GID_INDEX`]) and then to the first ACTIVE
/// port of any device.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct DeviceConfig {
    /// Device name.
    pub device: Option<String>,
    /// Port number (1-based).
    pub port: Option<u8>,
    /// GID choice; `None` means environment or [`GidSelector::RoceV2Ipv4`].
    pub gid: Option<GidSelector>,
}

impl DeviceConfig {
    /// A config naming a device (first ACTIVE port, default GID).
    pub fn device(name: impl Into<String>) -> Self {
        Self {
            device: Some(name.into()),
            ..Self::default()
        }
    }

    /// Fills unset fields from [`ENV_DEVICE`] (`name` or `name:port`) and
    /// [`ENV_GID_INDEX`].
    pub fn with_env(mut self) -> Self {
        if self.device.is_none() {
            if let Ok(v) = std::env::var(ENV_DEVICE) {
                let v = v.trim();
                match v.split_once(':') {
                    Some((name, port)) => {
                        self.device = Some(name.to_owned());
                        if self.port.is_none() {
                            self.port = port.parse().ok();
                        }
                    }
                    None if !v.is_empty() => self.device = Some(v.to_owned()),
                    None => {}
                }
            }
        }
        if self.gid.is_none() {
            if let Some(i) = std::env::var(ENV_GID_INDEX)
                .ok()
                .and_then(|v| v.trim().parse().ok())
            {
                self.gid = Some(GidSelector::Index(i));
            }
        }
        self
    }
}

/// The outcome of [`select`]: one port of one device and a GID on it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Selection {
    /// The device.
    pub device: DeviceInfo,
    /// The chosen port.
    pub port: PortInfo,
    /// The chosen GID.
    pub gid: GidInfo,
}

/// Opens the device list, mapping "no library" / "no kernel support" to
/// [`Unsupported`].
pub(crate) fn device_list() -> Result<DeviceList, VerbsError> {
    DeviceList::new().map_err(|e| {
        let io = io_cause(&e);
        match io.raw_os_error() {
            // rdma-core-mummy sets EOPNOTSUPP when libibverbs.so.1 could not be dlopen()ed.
            Some(libc_errno::EOPNOTSUPP) => Unsupported::LibraryMissing.into(),
            // libibverbs returns ENOSYS when /sys/class/infiniband_verbs is missing.
            Some(libc_errno::ENOSYS) => Unsupported::NoKernelSupport.into(),
            _ if !Path::new("/sys/class/infiniband_verbs").exists() => {
                Unsupported::NoKernelSupport.into()
            }
            _ => VerbsError::ListDevices(io),
        }
    })
}

/// Lists every RDMA device with its ports, GIDs and limits.
///
/// Returns `Ok(vec![])` when verbs work but there is no device; use [`probe`]
/// to get that as an error with a reason.
pub fn list_devices() -> Result<Vec<DeviceInfo>, VerbsError> {
    let list = device_list()?;
    let mut out = Vec::with_capacity(list.len());
    for dev in list.iter() {
        let name = dev.name();
        let ctx = dev.open().map_err(|e| VerbsError::OpenDevice {
            device: name.clone(),
            source: io_cause(&e),
        })?;
        out.push(describe(&name, &ctx)?);
    }
    Ok(out)
}

/// Like [`list_devices`], but "no device" and "no ACTIVE port" are errors
/// ([`Unsupported::NoDevices`], [`Unsupported::NoActivePort`]). On a host
/// without RDMA this returns the plain reason; the CLI prints it.
pub fn probe() -> Result<Vec<DeviceInfo>, VerbsError> {
    let devices = list_devices()?;
    if devices.is_empty() {
        return Err(Unsupported::NoDevices.into());
    }
    if devices.iter().all(|d| d.first_active_port().is_none()) {
        return Err(Unsupported::NoActivePort {
            devices: names(&devices),
        }
        .into());
    }
    Ok(devices)
}

/// Picks device, port and GID according to `config` (see [`DeviceConfig`]).
pub fn select(config: &DeviceConfig) -> Result<Selection, VerbsError> {
    let config = config.clone().with_env();
    let devices = list_devices()?;
    if devices.is_empty() {
        return Err(Unsupported::NoDevices.into());
    }
    let (device, port) = match &config.device {
        Some(name) => {
            let dev = devices.iter().find(|d| &d.name == name).ok_or_else(|| {
                VerbsError::DeviceNotFound {
                    name: name.clone(),
                    available: names(&devices),
                }
            })?;
            let port = match config.port {
                Some(n) => dev.ports.iter().find(|p| p.port == n),
                None => dev.first_active_port(),
            };
            match port {
                Some(p) if p.state == PortStatus::Active => (dev, p),
                Some(p) => {
                    return Err(VerbsError::PortNotUsable {
                        device: dev.name.clone(),
                        port: p.port,
                        state: p.state.to_string(),
                    })
                }
                None => {
                    return Err(VerbsError::PortNotUsable {
                        device: dev.name.clone(),
                        port: config.port.unwrap_or(1),
                        state: "no such port or no ACTIVE port".to_owned(),
                    })
                }
            }
        }
        None => devices
            .iter()
            .find_map(|d| d.first_active_port().map(|p| (d, p)))
            .ok_or_else(|| Unsupported::NoActivePort {
                devices: names(&devices),
            })?,
    };
    let gid = pick_gid(&device.name, port, config.gid.unwrap_or_default())?;
    Ok(Selection {
        device: device.clone(),
        port: port.clone(),
        gid,
    })
}

/// Picks a GID of `port` according to `sel`.
pub fn pick_gid(device: &str, port: &PortInfo, sel: GidSelector) -> Result<GidInfo, VerbsError> {
    let found = match sel {
        GidSelector::Index(i) => port.gids.iter().find(|g| g.index == i),
        GidSelector::Kind(k) => port.gids.iter().find(|g| g.kind == k),
        GidSelector::RoceV2Ipv4 => port
            .gids
            .iter()
            .find(|g| g.kind == GidKind::RoceV2 && g.is_ipv4())
            .or_else(|| port.gids.iter().find(|g| g.kind == GidKind::RoceV2))
            .or_else(|| port.gids.iter().find(|g| g.kind == GidKind::Ib))
            .or_else(|| port.gids.first()),
    };
    found.cloned().ok_or_else(|| VerbsError::NoGid {
        device: device.to_owned(),
        port: port.port,
        wanted: match sel {
            GidSelector::Index(i) => format!("index {i}"),
            GidSelector::Kind(k) => k.to_string(),
            GidSelector::RoceV2Ipv4 => "usable".to_owned(),
        },
        available: port
            .gids
            .iter()
            .map(|g| format!("[{}] {} ({})", g.index, g.gid, g.kind))
            .collect::<Vec<_>>()
            .join(", "),
    })
}

fn names(devices: &[DeviceInfo]) -> String {
    if devices.is_empty() {
        return "none".to_owned();
    }
    devices
        .iter()
        .map(|d| d.name.as_str())
        .collect::<Vec<_>>()
        .join(", ")
}

/// Queries device attributes, ports and GID table of an open device.
pub(crate) fn describe(name: &str, ctx: &Arc<DeviceContext>) -> Result<DeviceInfo, VerbsError> {
    let query = |what: &str, e: &(dyn std::error::Error + 'static)| VerbsError::Query {
        device: name.to_owned(),
        what: what.to_owned(),
        source: io_cause(e),
    };
    let attr = ctx
        .query_device()
        .map_err(|e| query("device attributes", &e))?;
    let clamp_u8 = |v: i32| u8::try_from(v.max(0)).unwrap_or(u8::MAX);
    let clamp_u32 = |v: i32| u32::try_from(v.max(0)).unwrap_or(0);
    let limits = DeviceLimits {
        max_qp: clamp_u32(attr.max_qp()),
        max_qp_wr: clamp_u32(attr.max_qp_wr()),
        max_sge: clamp_u32(attr.max_sge()),
        max_cqe: clamp_u32(attr.max_cqe()),
        max_mr_size: attr.max_mr_size(),
        max_qp_rd_atom: clamp_u8(attr.max_qp_rd_atom()),
        max_qp_init_rd_atom: clamp_u8(attr.max_qp_init_rd_atom()),
    };
    let mut ports = Vec::new();
    for port in 1..=attr.phys_port_cnt() {
        let pa = ctx
            .query_port(port)
            .map_err(|e| query(&format!("port {port}"), &e))?;
        let raw = &pa.attr;
        ports.push(PortInfo {
            port,
            state: port_status(raw.state),
            // Checked on the raw value: sideway's `From<u8>` panics on unknown values.
            ethernet: raw.link_layer == 2,
            active_mtu: mtu_bytes(raw.active_mtu),
            max_msg_size: raw.max_msg_sz,
            lid: raw.lid,
            gids: Vec::new(),
        });
    }
    if !ports.is_empty() {
        let table = ctx.query_gid_table().map_err(|e| query("gid table", &e))?;
        for entry in table {
            let gid = Ipv6Addr::from(entry.gid().raw);
            if gid.is_unspecified() {
                continue;
            }
            let Some(port) = ports
                .iter_mut()
                .find(|p| u32::from(p.port) == entry.port_num())
            else {
                continue;
            };
            let kind = match entry.gid_type() {
                GidType::InfiniBand => GidKind::Ib,
                GidType::RoceV1 => GidKind::RoceV1,
                GidType::RoceV2 => GidKind::RoceV2,
            };
            port.gids.push(GidInfo {
                index: entry.gid_index(),
                gid,
                kind,
            });
        }
        for p in &mut ports {
            p.gids.sort_by_key(|g| g.index);
        }
    }
    Ok(DeviceInfo {
        name: name.to_owned(),
        node_guid: format!("{}", attr.node_guid()),
        ports,
        limits,
    })
}

pub(crate) fn port_status(raw: u32) -> PortStatus {
    match raw {
        1 => PortStatus::Down,
        2 => PortStatus::Init,
        3 => PortStatus::Armed,
        4 => PortStatus::Active,
        5 => PortStatus::ActiveDefer,
        _ => PortStatus::Unknown,
    }
}

/// `enum ibv_mtu` (1 = 256 … 5 = 4096) to bytes.
pub(crate) fn mtu_bytes(raw: u32) -> u32 {
    match raw {
        1..=5 => 128 << raw,
        _ => 0,
    }
}
