//! Preflight reachability check.

use std::time::Duration;

use tokio::net::TcpStream;

use crate::error::ProbeError;

/// Opens (and closes) a TCP connection to `addr` (`host:port`) within
/// `timeout`. The error names the address and the OS reason.
pub async fn probe(addr: &str, timeout: Duration) -> Result<(), ProbeError> {
    match tokio::time::timeout(timeout, TcpStream::connect(addr)).await {
        Ok(Ok(stream)) => {
            drop(stream);
            Ok(())
        }
        Ok(Err(source)) => Err(ProbeError::Unreachable {
            addr: addr.to_owned(),
            source,
        }),
        Err(_) => Err(ProbeError::Timeout {
            addr: addr.to_owned(),
            timeout,
        }),
    }
}
