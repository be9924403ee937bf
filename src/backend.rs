//! Backend selection for the agent.

use crate::agent::BackendChoice;
use crate::error::{Error, ErrorKind};
use kvlane_data::{Backend, LoopbackBackend};

/// Creates the backend `choice` names; `Auto` falls back and logs why.
pub(crate) fn create(choice: BackendChoice, data_listen: &str) -> Result<Box<dyn Backend>, Error> {
    match choice {
        BackendChoice::Loopback => Ok(Box::new(LoopbackBackend::default())),
        BackendChoice::Tcp | BackendChoice::Auto => tcp(data_listen),
        BackendChoice::Verbs => Err(Error::msg(
            ErrorKind::Unsupported,
            "the verbs backend is not wired into the agent yet",
        )),
    }
}

fn tcp(_data_listen: &str) -> Result<Box<dyn Backend>, Error> {
    Err(Error::msg(ErrorKind::Unsupported, "tcp backend pending"))
}
