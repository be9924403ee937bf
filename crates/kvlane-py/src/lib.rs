//! The `kvlane` Python package's native module, `kvlane._kvlane`.
//!
//! It converts and forwards to the facade (`kvlane::Agent`, `Peer`,
//! `TransferHandle`): no transport logic lives here. Every call that
//! blocks, waits or copies releases the GIL and checks for signals while
//! it waits, so Ctrl-C interrupts it. Buffers are registered zero-copy
//! through the buffer protocol; foreign pointers only through
//! `Memory.unsafe_from_ptr`, whose contract is documented there.

mod agent;
mod buffer;
mod errors;
mod events;
mod memory;
mod runtime;
mod transfer;

use pyo3::prelude::*;

/// kvlane's native module (use the `kvlane` package).
#[pymodule]
fn _kvlane(m: &Bound<'_, PyModule>) -> PyResult<()> {
    errors::register(m)?;
    m.add_class::<agent::Agent>()?;
    m.add_class::<agent::Peer>()?;
    m.add_class::<agent::PreparedTransfer>()?;
    m.add_class::<memory::Memory>()?;
    m.add_class::<memory::KvLayout>()?;
    m.add_class::<transfer::Transfer>()?;
    m.add_class::<transfer::Telemetry>()?;
    m.add_class::<events::Notification>()?;
    m.add_class::<events::Notifications>()?;
    m.add_class::<events::PeerEvent>()?;
    m.add_class::<events::PeerEvents>()?;
    m.add("__version__", env!("CARGO_PKG_VERSION"))?;
    Ok(())
}
