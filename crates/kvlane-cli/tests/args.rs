//! Arguments a user gets wrong: one clear line on stderr and a non-zero
//! exit, never a panic.

use std::process::{Command, Output};

fn kvlane(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_kvlane"))
        .args(args)
        .env_remove("KVLANE_PSK")
        .output()
        .unwrap()
}

/// The run failed with one line naming `needle`, and did not panic.
fn refused_with_one_line(out: &Output, needle: &str) {
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "exit {:?}: {stderr}", out.status);
    assert_eq!(out.status.code(), Some(1), "{stderr}");
    assert!(!stderr.contains("panicked"), "{stderr}");
    let lines: Vec<_> = stderr.lines().filter(|l| !l.trim().is_empty()).collect();
    assert_eq!(lines.len(), 1, "{stderr}");
    assert!(lines[0].contains(needle), "{stderr}");
}

#[test]
fn bench_refuses_a_block_size_no_memory_can_hold() {
    let out = kvlane(&["bench", "--block-sizes", "18446744073709550000"]);
    refused_with_one_line(&out, "18446744073709550000");
}

#[test]
fn bench_refuses_a_pool_no_memory_can_hold() {
    let out = kvlane(&[
        "bench",
        "--role",
        "target",
        "--pool",
        "18446744073709550000",
    ]);
    refused_with_one_line(&out, "--pool 18446744073709550000");
}

#[test]
fn bench_reports_a_block_size_the_host_cannot_allocate_without_panicking() {
    // Below the region cap but past any address space: the allocation
    // fails with a typed error that names the size.
    let out = kvlane(&[
        "bench",
        "--backend",
        "loopback",
        "--block-sizes",
        "4611686018427387904",
        "--duration",
        "100ms",
    ]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{stderr}");
    assert!(!stderr.contains("panicked"), "{stderr}");
    assert!(
        stderr.contains("could not allocate 4611686018427387904 bytes"),
        "{stderr}"
    );
}

/// `kvlane serve` on `listen` with `extra` arguments: what it wrote to
/// stderr by the time it printed its `listening` line (it is then killed).
fn serve_stderr(listen: &str, extra: &[&str]) -> String {
    use std::io::{BufRead, BufReader};
    use std::process::Stdio;
    let mut child = Command::new(env!("CARGO_BIN_EXE_kvlane"))
        .args([
            "serve", "--listen", listen, "--layers", "1", "--blocks", "1",
        ])
        .args(["--block-size", "4K"])
        .args(extra)
        .env_remove("KVLANE_PSK")
        .env_remove("RUST_LOG")
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let mut first = String::new();
    BufReader::new(child.stdout.take().unwrap())
        .read_line(&mut first)
        .unwrap();
    let _ = child.kill();
    let out = child.wait_with_output().unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr).into_owned();
    assert!(
        first.starts_with("listening "),
        "{first:?}; stderr: {stderr}"
    );
    stderr
}

#[test]
fn serve_on_loopback_without_a_key_warns_that_every_local_user_has_the_memory() {
    let stderr = serve_stderr("127.0.0.1:0", &[]);
    assert!(stderr.contains("without --psk"), "{stderr}");
    assert!(stderr.contains("every local user"), "{stderr}");
    assert!(
        stderr.contains("read and write the served memory"),
        "{stderr}"
    );
    // With a key there is nothing to warn about.
    let stderr = serve_stderr("127.0.0.1:0", &["--psk", "k"]);
    assert!(!stderr.contains("without --psk"), "{stderr}");
}
