//! How a bench initiator learns where the target's raw-tcp ceiling is: the
//! target names the port in its engine id, which the handshake carries
//! (and, with `--psk`, authenticates), and the initiator dials it at the
//! host it dialed for control.

use std::net::{SocketAddr, ToSocketAddrs};

type BoxError = Box<dyn std::error::Error>;

/// The target's engine id, without a raw-tcp port.
const TARGET_ID: &str = "kvlane-bench-target";
/// What precedes the raw-tcp port in the target's engine id.
const RAW_TAG: &str = " raw-tcp=";

/// The engine id a target announces itself (and its raw-tcp port) with.
pub(crate) fn target_engine_id(raw_port: Option<u16>) -> String {
    match raw_port {
        Some(p) => format!("{TARGET_ID}{RAW_TAG}{p}"),
        None => TARGET_ID.to_owned(),
    }
}

/// The raw-tcp port a bench target's engine id announces, if any; an
/// announcement that is not a port is an error, not a missing ceiling.
pub(crate) fn announced_raw_port(engine_id: &str) -> Result<Option<u16>, String> {
    let Some(port) = engine_id
        .strip_prefix(TARGET_ID)
        .and_then(|rest| rest.strip_prefix(RAW_TAG))
    else {
        return Ok(None);
    };
    port.parse().map(Some).map_err(|e| {
        format!("the target announced {engine_id:?}, whose raw-tcp port is not a port: {e}")
    })
}

/// The host part of `host:port` (`[v6]:port` without the brackets).
pub(crate) fn host_of(addr: &str) -> &str {
    let host = addr.rsplit_once(':').map_or(addr, |(h, _)| h);
    host.strip_prefix('[')
        .and_then(|h| h.strip_suffix(']'))
        .unwrap_or(host)
}

/// `port` at the host of `connect`, the control address dialed.
pub(crate) fn raw_addr(connect: &str, port: u16) -> Result<SocketAddr, BoxError> {
    let host = host_of(connect);
    (host, port)
        .to_socket_addrs()
        .map_err(|e| format!("raw-tcp baseline: cannot resolve {host}: {e}"))?
        .next()
        .ok_or_else(|| format!("raw-tcp baseline: {host} has no address").into())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_target_engine_id_announces_its_raw_tcp_port() {
        assert_eq!(
            announced_raw_port(&target_engine_id(Some(41234))),
            Ok(Some(41234))
        );
        assert_eq!(announced_raw_port(&target_engine_id(None)), Ok(None));
        assert_eq!(announced_raw_port("decode raw-tcp=1"), Ok(None));
        let bad = announced_raw_port("kvlane-bench-target raw-tcp=70000").unwrap_err();
        assert!(bad.contains("raw-tcp=70000"), "{bad}");
    }

    #[test]
    fn the_raw_tcp_port_is_dialed_at_the_control_host() {
        assert_eq!(
            raw_addr("127.0.0.1:5555", 41).unwrap(),
            "127.0.0.1:41".parse::<SocketAddr>().unwrap()
        );
        assert_eq!(
            raw_addr("[::1]:5555", 41).unwrap(),
            "[::1]:41".parse::<SocketAddr>().unwrap()
        );
        assert_eq!(raw_addr("localhost:5555", 41).unwrap().port(), 41);
        assert_eq!(host_of("0.0.0.0:5555"), "0.0.0.0");
    }
}
