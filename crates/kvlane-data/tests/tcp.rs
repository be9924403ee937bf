//! The conformance suite and tcp-specific tests on the tcp backend.

use kvlane_data::conformance::Fixture;
use kvlane_data::{TcpBackend, TcpConfig};

struct Tcp;

impl Fixture for Tcp {
    type Backend = TcpBackend;
    fn backends(&self) -> (TcpBackend, TcpBackend) {
        let config = TcpConfig {
            queue_depth: 256,
            // Small chunks so the suite's transfers are split and striped.
            chunk_bytes: 64 << 10,
            ..TcpConfig::default()
        };
        (
            TcpBackend::new(config.clone()).expect("start tcp backend"),
            TcpBackend::new(config).expect("start tcp backend"),
        )
    }
}

kvlane_data::conformance_tests!(Tcp);
