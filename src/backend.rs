//! Backend selection for the agent.

use crate::agent::BackendChoice;
use crate::error::{Error, ErrorKind};
use kvlane_data::tcp::{TcpBackend, TcpConfig};
use kvlane_data::{Backend, LoopbackBackend};
use std::net::ToSocketAddrs;

/// Creates the backend `choice` names; `Auto` falls back to tcp and logs why.
pub(crate) fn create(choice: BackendChoice, data_listen: &str) -> Result<Box<dyn Backend>, Error> {
    match choice {
        BackendChoice::Loopback => Ok(Box::new(LoopbackBackend::default())),
        BackendChoice::Tcp => tcp(data_listen),
        BackendChoice::Auto => {
            tracing::info!(
                "backend auto: using tcp (the verbs backend is not wired into the agent yet)"
            );
            tcp(data_listen)
        }
        BackendChoice::Verbs => Err(Error::msg(
            ErrorKind::Unsupported,
            "the verbs backend is not wired into the agent yet; use tcp",
        )),
    }
}

fn tcp(data_listen: &str) -> Result<Box<dyn Backend>, Error> {
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
        ..TcpConfig::default()
    })?))
}
