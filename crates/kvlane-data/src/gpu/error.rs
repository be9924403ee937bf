//! Errors of the GPU module.

use super::{GpuDevice, GpuRuntime};

/// Why a GPU cannot be used here at all.
#[derive(Debug, Clone, thiserror::Error)]
#[non_exhaustive]
pub enum GpuUnavailable {
    /// The runtime's library could not be loaded.
    #[error("no {runtime} driver: cannot load {library} ({reason}); install the driver or set {env} to its path")]
    NoLibrary {
        /// The runtime.
        runtime: GpuRuntime,
        /// The library (path or soname) that was tried.
        library: String,
        /// The loader's message.
        reason: String,
        /// The environment variable that overrides the path.
        env: &'static str,
    },
    /// The library lacks a function kvlane needs.
    #[error("the {runtime} driver lacks {symbol}")]
    MissingSymbol {
        /// The runtime.
        runtime: GpuRuntime,
        /// The function.
        symbol: &'static str,
    },
    /// The driver initialized but has no device with this ordinal.
    #[error("the driver reports {count} device(s)")]
    NoDevice {
        /// How many devices the driver reports.
        count: u32,
    },
    /// The driver failed to initialize (`cuInit` / `hipInit`).
    #[error("driver initialization failed: {name} ({code})")]
    Init {
        /// The driver's error code.
        code: i32,
        /// The driver's name for it.
        name: String,
    },
    /// The device works, but cannot do this.
    #[error("{0}")]
    Operation(&'static str),
}

/// Everything that can go wrong with GPU memory. Every variant names the
/// device.
#[derive(Debug, Clone, thiserror::Error)]
#[non_exhaustive]
pub enum GpuError {
    /// The device cannot be used here (no driver library, no device, or no
    /// support for the operation); nothing was registered.
    #[error("{device}: unsupported: {why}")]
    Unsupported {
        /// The device asked for.
        device: GpuDevice,
        /// Why.
        why: GpuUnavailable,
    },
    /// A driver call failed.
    #[error("{device}: {call} failed: {name} ({code})")]
    Driver {
        /// The device.
        device: GpuDevice,
        /// The driver function, e.g. `"cuMemcpyDtoHAsync_v2"`.
        call: &'static str,
        /// The driver's error code.
        code: i32,
        /// The driver's name for it.
        name: String,
    },
    /// A pointer registered as device memory is not memory of that device.
    #[error("{device}: address {addr:#x} (+{len} bytes) is not memory of {device}: the driver says {found}")]
    NotDeviceMemory {
        /// The device named at registration.
        device: GpuDevice,
        /// The address.
        addr: u64,
        /// The length registered.
        len: u64,
        /// What the driver says it is, e.g. `"host memory"`, `"memory of cuda:1"`.
        found: String,
    },
}

impl GpuError {
    /// The device the error is about.
    pub fn device(&self) -> GpuDevice {
        match self {
            Self::Unsupported { device, .. }
            | Self::Driver { device, .. }
            | Self::NotDeviceMemory { device, .. } => *device,
        }
    }

    /// Whether the device cannot be used here at all.
    pub fn is_unsupported(&self) -> bool {
        matches!(self, Self::Unsupported { .. })
    }
}
