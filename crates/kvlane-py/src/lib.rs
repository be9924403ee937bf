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
mod shared;
mod transfer;

use pyo3::prelude::*;

/// Environment variable that turns on kvlane's own log lines in Python
/// processes: a `tracing` filter such as `info` or
/// `kvlane_control=debug,warn`, written to stderr with timestamps and
/// thread names. Unset (the default), kvlane logs nothing from Rust.
const ENV_LOG: &str = "KVLANE_LOG";

/// Installs a stderr subscriber when [`ENV_LOG`] is set. A process that
/// already has a global subscriber keeps it; a bad filter is reported on
/// stderr once and ignored, since logging must never stop an import.
fn init_logging() {
    let Ok(spec) = std::env::var(ENV_LOG) else {
        return;
    };
    match tracing_subscriber::EnvFilter::try_new(&spec) {
        Ok(filter) => {
            let _ = tracing_subscriber::fmt()
                .with_env_filter(filter)
                .with_writer(std::io::stderr)
                .with_thread_names(true)
                .with_ansi(false)
                .try_init();
        }
        Err(e) => {
            eprintln!("kvlane: {ENV_LOG}={spec:?} is not a log filter ({e}); logging stays off")
        }
    }
}

/// kvlane's native module (use the `kvlane` package).
#[pymodule]
fn _kvlane(m: &Bound<'_, PyModule>) -> PyResult<()> {
    init_logging();
    errors::register(m)?;
    m.add_class::<agent::Agent>()?;
    m.add_class::<agent::Peer>()?;
    m.add_class::<agent::PreparedTransfer>()?;
    m.add_class::<memory::Memory>()?;
    m.add_class::<memory::KvLayout>()?;
    m.add_class::<shared::SharedAlloc>()?;
    m.add_class::<transfer::Transfer>()?;
    m.add_class::<transfer::Telemetry>()?;
    m.add_class::<events::Notification>()?;
    m.add_class::<events::Notifications>()?;
    m.add_class::<events::PeerEvent>()?;
    m.add_class::<events::PeerEvents>()?;
    m.add("__version__", env!("CARGO_PKG_VERSION"))?;
    Ok(())
}
