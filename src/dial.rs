//! Which data addresses the agent dials: by default only on the host its
//! control connection to that peer came from (the address it dialed, or the
//! one an inbound connection came from), so a peer cannot make the agent
//! connect to a third host by advertising it. `AgentBuilder::dial_any_data_host`
//! turns this off (a target that advertises a different host on purpose).

use crate::error::{Error, ErrorKind};
use kvlane_data::{BackendKind, Endpoint, TcpEndpoint};
use std::net::IpAddr;

/// `ip` with an IPv4-mapped IPv6 address as IPv4.
fn canonical(ip: IpAddr) -> IpAddr {
    match ip {
        IpAddr::V6(v6) => v6.to_ipv4_mapped().map_or(ip, IpAddr::V4),
        v4 => v4,
    }
}

/// Whether `endpoint` (already [`Endpoint::reached_at`] the control host)
/// may be dialed for the peer at `peer` whose control connection is on
/// `control_host`, by a backend of `rails` rails: each rail it would pair
/// is held to that host (a multi-rail peer whose other rails sit on other
/// addresses of its host needs `dial_any_data_host`: nothing here can tell
/// another address of the peer's host from a third host). Loopback
/// addresses count as one host. Only tcp endpoints carry an address.
pub(crate) fn check(
    peer: &str,
    endpoint: &Endpoint,
    control_host: Option<IpAddr>,
    rails: usize,
) -> Result<(), Error> {
    if endpoint.backend != BackendKind::Tcp {
        return Ok(());
    }
    let theirs = endpoint.rails();
    let many = theirs.len() > 1 && rails > 1;
    for (i, rail) in theirs.iter().take(rails.max(1)).enumerate() {
        let what = if many {
            format!("the data endpoint of its rail {i}")
        } else {
            "its data endpoint".to_owned()
        };
        check_one(peer, &what, rail, control_host)?;
    }
    Ok(())
}

fn check_one(
    peer: &str,
    what: &str,
    endpoint: &Endpoint,
    control_host: Option<IpAddr>,
) -> Result<(), Error> {
    let ep = TcpEndpoint::from_endpoint(endpoint)?;
    let data = canonical(ep.addr.ip());
    let allow = "(AgentBuilder::dial_any_data_host, `--dial-any-data-host`, allows it)";
    let Some(host) = control_host.map(canonical) else {
        return Err(Error::msg(
            ErrorKind::Refused,
            format!(
                "{peer}: not dialing {what} {} (the target listens on {}): the host of its \
                 control connection is not known here {allow}",
                ep.addr, ep.listen
            ),
        ));
    };
    if data == host || (data.is_loopback() && host.is_loopback()) {
        return Ok(());
    }
    Err(Error::msg(
        ErrorKind::Refused,
        format!(
            "{peer}: not dialing {what} {} (the target listens on {}): it is not on {host}, the \
             host of its control connection {allow}",
            ep.addr, ep.listen
        ),
    ))
}
