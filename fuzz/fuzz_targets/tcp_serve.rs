//! Bytes from a peer through the tcp server's real request loop (the
//! state machine every served connection runs, over an in-memory stream
//! with partial reads and writes): it must end, never panic, and never
//! write to a region without the remote-write right.
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    kvlane_data::tcp::fuzz_serve(data);
});
