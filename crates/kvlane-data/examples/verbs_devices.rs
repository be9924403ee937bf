//! Prints the RDMA devices the verbs backend sees, or why there are none.
//!
//! `cargo run -p kvlane-data --features verbs --example verbs_devices`

fn main() {
    match kvlane_data::verbs::probe() {
        Ok(devices) => {
            for d in devices {
                print!("{d}");
            }
        }
        Err(e) => {
            eprintln!("{e}");
            std::process::exit(2);
        }
    }
}
