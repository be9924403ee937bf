//! Backend selection for the agent.

use crate::agent::BackendChoice;
use crate::error::{Error, ErrorKind};
use kvlane_data::tcp::{TcpBackend, TcpConfig};
use kvlane_data::{Backend, LoopbackBackend};
use std::net::{IpAddr, ToSocketAddrs};

/// Creates the backend `choice` names; `Auto` tries verbs and falls back
/// to tcp, logging why.
pub(crate) fn create(
    choice: BackendChoice,
    data_listen: &str,
    advertise: Option<&str>,
) -> Result<Box<dyn Backend>, Error> {
    match choice {
        BackendChoice::Loopback => Ok(Box::new(LoopbackBackend::default())),
        BackendChoice::Tcp => tcp(data_listen, advertise),
        BackendChoice::Verbs => verbs(),
        BackendChoice::Auto => verbs().or_else(|e| {
            tracing::info!(reason = %e, "backend auto: verbs unavailable, using tcp");
            tcp(data_listen, advertise)
        }),
    }
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

#[cfg(feature = "verbs")]
fn verbs() -> Result<Box<dyn Backend>, Error> {
    use kvlane_data::verbs::{VerbsBackend, VerbsConfig};
    let backend =
        VerbsBackend::new(VerbsConfig::default()).map_err(kvlane_data::DataError::from)?;
    Ok(Box::new(backend))
}

#[cfg(not(feature = "verbs"))]
fn verbs() -> Result<Box<dyn Backend>, Error> {
    Err(Error::msg(
        ErrorKind::Unsupported,
        "verbs backend: this kvlane was built without the `verbs` cargo feature",
    ))
}

fn tcp(data_listen: &str, advertise: Option<&str>) -> Result<Box<dyn Backend>, Error> {
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
    Ok(Box::new(TcpBackend::new(TcpConfig {
        listen,
        advertise,
        ..TcpConfig::default()
    })?))
}
