//! kvlane data plane (being written).

#[cfg(feature = "verbs")]
pub mod verbs;
