//! kvlane control plane: handshake, keep-alive, peer lifecycle and
//! notifications as a sans-IO state machine with pluggable channels.
//!
//! Skeleton; filled in by the control-plane issue.
#![forbid(unsafe_code)]
