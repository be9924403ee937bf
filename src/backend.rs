//! Backend selection for the agent.

use crate::agent::BackendChoice;
use crate::error::{Error, ErrorKind};
use kvlane_data::tcp::{TcpBackend, TcpConfig};
use kvlane_data::{Backend, LoopbackBackend, MemoryKind, Region};
use std::net::{IpAddr, ToSocketAddrs};

/// Named rail backends, in rail order.
type NamedRails = Vec<(String, Box<dyn Backend>)>;

/// Which devices (verbs) or addresses (tcp) become rails.
#[derive(Clone, Debug, Default)]
pub(crate) struct RailChoice {
    /// Verbs devices by name; `None`: `KVLANE_IB_DEVICES`, else every
    /// device with an ACTIVE port.
    pub(crate) devices: Option<Vec<String>>,
    /// Use at most this many rails.
    pub(crate) max: Option<usize>,
}

/// The environment variable naming the verbs devices to use as rails
/// (`mlx5_0,mlx5_1`).
pub const ENV_IB_DEVICES: &str = "KVLANE_IB_DEVICES";

/// The environment variable that turns off shm to peers on this host under
/// `Auto` (`0`, `off`, `false`, `no`); [`AgentBuilder::same_host_shm`](crate::AgentBuilder::same_host_shm)
/// wins over it.
pub const ENV_SAME_HOST_SHM: &str = "KVLANE_SAME_HOST_SHM";

/// Shared memory to peers on this host under `Auto`.
#[derive(Clone, Copy, Debug)]
pub(crate) struct ShmChoice {
    /// Run shm beside Auto's backend at all.
    pub(crate) same_host: bool,
    /// Serve memory that is not shareable by cross-memory attach (opt-in).
    pub(crate) attach: bool,
}

/// [`AgentBuilder::same_host_shm`](crate::AgentBuilder::same_host_shm) when set, else
/// `KVLANE_SAME_HOST_SHM`, else on.
pub(crate) fn same_host_shm(set: Option<bool>) -> Result<bool, Error> {
    if let Some(on) = set {
        return Ok(on);
    }
    let Ok(v) = std::env::var(ENV_SAME_HOST_SHM) else {
        return Ok(true);
    };
    match v.trim().to_ascii_lowercase().as_str() {
        "" | "1" | "on" | "true" | "yes" => Ok(true),
        "0" | "off" | "false" | "no" => Ok(false),
        _ => Err(Error::msg(
            ErrorKind::InvalidInput,
            format!("{ENV_SAME_HOST_SHM}={v:?}: expected 1/on/true/yes or 0/off/false/no"),
        )),
    }
}

/// Creates the backend `choice` names. `Auto` (and its alias `SameHost`)
/// tries verbs and falls back to tcp, logging why, and runs shm beside it
/// for peers on this host ([`kvlane_data::SameHost`]) unless `shm` turns
/// that off or a region shm cannot serve is registered (logged).
/// `data_listen` is a comma-separated list of tcp listen addresses, one
/// rail each; several rails are joined by [`Rails`](kvlane_data::Rails).
pub(crate) fn create(
    choice: BackendChoice,
    data_listen: &str,
    advertise: Option<&str>,
    rails: &RailChoice,
    shm: ShmChoice,
    regions: &[&Region],
) -> Result<Box<dyn Backend>, Error> {
    let one = |named: NamedRails| -> Result<Box<dyn Backend>, Error> {
        let mut named = named;
        if let Some(max) = rails.max {
            named.truncate(max.max(1));
        }
        if named.len() == 1 {
            return Ok(named.pop().expect("one").1);
        }
        tracing::info!(
            rails = ?named.iter().map(|(n, _)| n.as_str()).collect::<Vec<_>>(),
            "data plane over several rails"
        );
        let names: Vec<String> = named.iter().map(|(n, _)| n.clone()).collect();
        let mut r = kvlane_data::Rails::new(named, kvlane_data::RailsConfig::default())?;
        prefer_nearest(&mut r, &names, regions);
        Ok(Box::new(r))
    };
    let tcp_rails = || -> Result<NamedRails, Error> {
        let made: Vec<(String, TcpBackend)> = data_listen
            .split(',')
            .map(str::trim)
            .filter(|a| !a.is_empty())
            .map(|a| Ok((format!("tcp:{a}"), tcp(a, advertise)?)))
            .collect::<Result<_, Error>>()?;
        // A rail whose network is down fences its failed connections
        // through another rail's address before their WRITEs move.
        TcpBackend::fence_through_each_other(&made.iter().map(|(_, b)| b).collect::<Vec<_>>());
        Ok(made
            .into_iter()
            .map(|(n, b)| (n, Box::new(b) as Box<dyn Backend>))
            .collect())
    };
    match choice {
        BackendChoice::Loopback => Ok(Box::new(LoopbackBackend::default())),
        BackendChoice::Tcp => one(tcp_rails()?),
        BackendChoice::Verbs => one(verbs(rails)?),
        BackendChoice::Shm => shm_alone(shm.attach),
        BackendChoice::Auto | BackendChoice::SameHost => {
            let other = match verbs(rails) {
                Ok(v) => one(v)?,
                Err(e) => {
                    tracing::info!(reason = %e, "backend auto: verbs unavailable, using tcp");
                    one(tcp_rails()?)?
                }
            };
            Ok(same_host(other, shm, regions))
        }
    }
}

/// The shm backend's settings; `attach`: cross-memory attach for memory
/// that is not shareable (opt-in, see `AgentBuilder::shm_cross_memory_attach`).
#[cfg(target_os = "linux")]
fn shm_config(attach: bool) -> kvlane_data::ShmConfig {
    kvlane_data::ShmConfig {
        cross_memory_attach: attach,
        ..kvlane_data::ShmConfig::default()
    }
}

#[cfg(target_os = "linux")]
fn shm_alone(attach: bool) -> Result<Box<dyn Backend>, Error> {
    Ok(Box::new(kvlane_data::ShmBackend::new(shm_config(attach))?))
}

#[cfg(not(target_os = "linux"))]
fn shm_alone(_attach: bool) -> Result<Box<dyn Backend>, Error> {
    Err(Error::msg(
        ErrorKind::Unsupported,
        "shm backend: Linux only (memfd, SCM_RIGHTS)",
    ))
}

/// `Auto`: shm to peers on this host beside `other`, when it is on, every
/// region registered at build is memory shm serves, and an shm backend
/// starts here; else `other` alone (the reason is logged at `info`).
#[cfg(target_os = "linux")]
fn same_host(other: Box<dyn Backend>, shm: ShmChoice, regions: &[&Region]) -> Box<dyn Backend> {
    use kvlane_data::{samehost, SameHost, ShmBackend};
    let kind = other.kind();
    if !shm.same_host {
        tracing::info!(other = %kind,
            "backend auto: shm to peers on this host is off (AgentBuilder::same_host_shm(false) \
             or {ENV_SAME_HOST_SHM}); every peer uses {kind}");
        return other;
    }
    if let Some(why) = regions
        .iter()
        .find_map(|r| samehost::unserved(r, shm.attach))
    {
        tracing::info!(reason = %why, other = %kind,
            "backend auto: no shm to peers on this host; every peer uses {kind}");
        return other;
    }
    match ShmBackend::new(shm_config(shm.attach)) {
        Ok(s) => Box::new(SameHost::new(s, other)),
        Err(e) => {
            tracing::info!(reason = %e, other = %kind,
                "backend auto: shm unavailable; every peer uses {kind}");
            other
        }
    }
}

#[cfg(not(target_os = "linux"))]
fn same_host(other: Box<dyn Backend>, _shm: ShmChoice, _regions: &[&Region]) -> Box<dyn Backend> {
    other
}

/// Gives each GPU region the rails nearest to its GPU, from this machine's
/// PCIe topology (`/sys`); regions whose GPU or rails the topology does not
/// place keep every rail. Nothing here fails the build: the preference is
/// an optimisation, said at `info` when it is made.
fn prefer_nearest(rails: &mut kvlane_data::Rails, names: &[String], regions: &[&Region]) {
    let gpus: Vec<(&Region, kvlane_data::GpuDevice)> = regions
        .iter()
        .filter_map(|r| match r.kind() {
            MemoryKind::Gpu { device } => Some((*r, device)),
            _ => None,
        })
        .collect();
    if gpus.is_empty() {
        return;
    }
    let topology = match kvlane_data::topology::Topology::scan() {
        Ok(t) => t,
        Err(e) => {
            tracing::info!(error = %e, "no PCIe topology: GPU regions use every rail");
            return;
        }
    };
    let names: Vec<&str> = names.iter().map(String::as_str).collect();
    for (region, device) in gpus {
        let bus = kvlane_data::gpu_devices(device.runtime)
            .ok()
            .and_then(|all| {
                all.into_iter()
                    .find(|g| g.device == device)
                    .map(|g| g.pci_bus_id)
            });
        let Some(bus) = bus else { continue };
        let near = topology.nearest_rails(&bus, &names);
        if !near.is_empty() {
            tracing::info!(region = %region.id(), %device, pci = %bus,
                rails = ?near.iter().map(|&i| names[i]).collect::<Vec<_>>(),
                "GPU region prefers its nearest rails");
            rails.prefer(region.id(), &near);
        }
    }
}

/// The device names of `KVLANE_IB_DEVICES` (`None` when unset or empty).
#[cfg(feature = "verbs")]
fn env_devices() -> Option<Vec<String>> {
    let v = std::env::var(ENV_IB_DEVICES).ok()?;
    let list: Vec<String> = v
        .split(',')
        .map(|s| s.trim().to_string())
        .filter(|s| !s.is_empty())
        .collect();
    (!list.is_empty()).then_some(list)
}

/// Resolves `host` (an IP address or a name) to the address advertised.
fn advertised_ip(host: &str) -> Result<IpAddr, Error> {
    if let Ok(ip) = host.trim_start_matches('[').trim_end_matches(']').parse() {
        return Ok(ip);
    }
    (host, 0)
        .to_socket_addrs()
        .map_err(|e| {
            Error::msg(
                ErrorKind::InvalidInput,
                format!("advertise address {host}: {e}"),
            )
        })?
        .next()
        .map(|a| a.ip())
        .ok_or_else(|| {
            Error::msg(
                ErrorKind::InvalidInput,
                format!("advertise address {host} resolves to no address"),
            )
        })
}

/// One verbs backend per rail device: the named ones, or every device
/// with an ACTIVE port (a device that fails to open is skipped, with the
/// reason logged, unless it was named).
#[cfg(feature = "verbs")]
fn verbs(rails: &RailChoice) -> Result<NamedRails, Error> {
    use kvlane_data::verbs::{list_devices, DeviceConfig, VerbsBackend, VerbsConfig};
    let named = rails.devices.clone().or_else(env_devices);
    let open = |dev: Option<&str>| -> Result<Box<dyn Backend>, Error> {
        let mut cfg = VerbsConfig::default();
        if let Some(d) = dev {
            cfg.device = DeviceConfig {
                device: Some(d.to_string()),
                ..cfg.device
            };
        }
        Ok(Box::new(
            VerbsBackend::new(cfg).map_err(kvlane_data::DataError::from)?,
        ))
    };
    match named {
        Some(list) => list
            .iter()
            .map(|d| {
                open(Some(d)).map(|b| (d.clone(), b)).map_err(|e| {
                    Error::msg(
                        e.kind(),
                        format!("verbs rail {d} (from the rail list): {e}"),
                    )
                })
            })
            .collect(),
        None => {
            let active: Vec<String> = list_devices()
                .map_err(kvlane_data::DataError::from)?
                .into_iter()
                .filter(|d| d.first_active_port().is_some())
                .map(|d| d.name)
                .collect();
            if active.len() <= 1 {
                // One device, or none ACTIVE: the backend's own choice and
                // its own error.
                let b = open(None)?;
                let name = active.into_iter().next().unwrap_or_else(|| "verbs".into());
                return Ok(vec![(name, b)]);
            }
            let mut out = Vec::new();
            for d in active {
                match open(Some(&d)) {
                    Ok(b) => out.push((d, b)),
                    Err(e) => tracing::warn!(device = %d, error = %e, "verbs rail skipped"),
                }
            }
            if out.is_empty() {
                return Err(Error::msg(
                    ErrorKind::Unsupported,
                    "verbs: no device with an ACTIVE port could be opened",
                ));
            }
            Ok(out)
        }
    }
}

#[cfg(not(feature = "verbs"))]
fn verbs(_: &RailChoice) -> Result<NamedRails, Error> {
    Err(Error::msg(
        ErrorKind::Unsupported,
        "verbs backend: this kvlane was built without the `verbs` cargo feature",
    ))
}

fn tcp(data_listen: &str, advertise: Option<&str>) -> Result<TcpBackend, Error> {
    let advertise = advertise.map(advertised_ip).transpose()?;
    let listen = data_listen
        .to_socket_addrs()
        .map_err(|e| {
            Error::msg(
                ErrorKind::InvalidInput,
                format!("data listen address {data_listen}: {e}"),
            )
        })?
        .next()
        .ok_or_else(|| {
            Error::msg(
                ErrorKind::InvalidInput,
                format!("{data_listen} resolves to no address"),
            )
        })?;
    Ok(TcpBackend::new(TcpConfig {
        listen,
        advertise,
        ..TcpConfig::default()
    })?)
}
