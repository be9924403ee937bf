//! kvlane data plane (being written).
