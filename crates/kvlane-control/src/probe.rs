//! Preflight reachability check.

use std::time::Duration;

use tokio::net::TcpStream;

use crate::error::ProbeError;
use crate::hedge;

/// Opens (and closes) a TCP connection to `addr` (`host:port`) within
/// `timeout`. The error names the address and the OS reason. A connect
/// unanswered for 200 ms gets a fresh one beside it, up to three (the
/// `hedge` module): a listener under a flood drops SYNs now and then, and
/// the kernel resends one only after 1 s.
pub async fn probe(addr: &str, timeout: Duration) -> Result<(), ProbeError> {
    match tokio::time::timeout(timeout, hedge::first_of(|| TcpStream::connect(addr))).await {
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
