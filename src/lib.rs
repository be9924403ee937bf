//! kvlane: a KV-cache transport for LLM inference engines.
//!
//! The facade (`Agent`) is built in its own issue; for now this crate
//! re-exports the data and control planes.
#![forbid(unsafe_code)]

pub use kvlane_control as control;
pub use kvlane_data as data;
