//! The tcp backend's request decoder and target-side checks on arbitrary
//! bytes: every 32-byte header is decoded, re-encoded, and checked against
//! a small region table; whatever is accepted must lie inside its region
//! and be allowed by its access flags.
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    kvlane_data::tcp::fuzz_request(data);
});
