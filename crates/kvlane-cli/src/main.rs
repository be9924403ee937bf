//! The `kvlane` command-line tool.
fn main() {}
