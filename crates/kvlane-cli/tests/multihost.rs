//! Two hosts for real: the `kvlane` binary (and the prefill/decode
//! example) in separate network namespaces joined by a bridge, with link
//! faults (see `netns/mod.rs`). Needs root: the tests panic without it,
//! they never skip. Each prints what it measured (detection time against
//! the liveness budget, p50/p99, GB/s).
//!
//! `cargo test --workspace --all-targets` builds the example these tests
//! run; alone, build it first: `cargo build --example prefill_decode`.

mod netns;

use netns::{Net, Proc};
use serde_json::Value;
use std::path::PathBuf;
use std::process::ExitStatus;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

const KVLANE: &str = env!("CARGO_BIN_EXE_kvlane");
const PORT: u16 = 5555;
/// Pinned data-plane port where a test needs to know it.
const DATA_PORT: u16 = 6000;
const BLOCK: &str = "64K";
/// Short liveness for the fault tests: a keep-alive every 250 ms, dead
/// after 4 unanswered, so a silent peer is dead 1.25 s after it was last
/// heard.
const LIVENESS: [&str; 8] = [
    "--keepalive-interval",
    "250ms",
    "--liveness-budget",
    "4",
    "--handshake-timeout",
    "2s",
    "--reconnect-max",
    "500ms",
];
const BUDGET: Duration = Duration::from_millis(1250);
/// Scheduling slack on top of the budget (shared 2-core CI machines).
const SLACK: Duration = Duration::from_secs(1);

fn unix_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .expect("clock after 1970")
        .as_millis() as u64
}

fn strings(args: &[&str]) -> Vec<String> {
    args.iter().map(|s| s.to_string()).collect()
}

/// `kvlane serve` on host `h`, ready (it printed its listening line).
fn serve(net: &Net, h: usize, listen: &str, extra: &[&str]) -> Proc {
    let mut args = strings(&["serve", "--listen", listen, "--layers", "1"]);
    args.extend(strings(&["--blocks", "16", "--block-size", BLOCK]));
    args.extend(strings(&LIVENESS));
    args.extend(strings(extra));
    // Namespace addresses are not loopback: without a key, serve must be
    // told it may run unauthenticated.
    if !extra.contains(&"--psk") {
        args.push("--insecure".into());
    }
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    let mut p = net.spawn(h, "serve", KVLANE, &args);
    p.wait_line("listening line", Duration::from_secs(60), |l| {
        l.starts_with("listening ")
    });
    p
}

/// A `kvlane soak --json` run and the JSON lines it printed.
struct Soak {
    proc: Proc,
}

fn json(line: &str) -> Value {
    serde_json::from_str(line)
        .unwrap_or_else(|e| panic!("soak printed a non-JSON line ({e}): {line}"))
}

fn event(v: &Value) -> &str {
    v["event"].as_str().unwrap_or("")
}

fn ms_of(v: &Value) -> u64 {
    v["unix_ms"].as_u64().expect("every soak line has unix_ms")
}

impl Soak {
    fn start(net: &Net, h: usize, targets: &[String], duration: &str, extra: &[&str]) -> Self {
        let mut args = strings(&["soak", "--json", "--connect", &targets.join(",")]);
        args.extend(strings(&["--duration", duration, "--block-size", BLOCK]));
        if !extra.contains(&"--stats-interval") {
            args.extend(strings(&["--stats-interval", "500ms"]));
        }
        args.extend(strings(&LIVENESS));
        args.extend(strings(extra));
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        Self {
            proc: net.spawn(h, "soak", KVLANE, &args),
        }
    }

    /// The first line stamped at or after `after_ms` that satisfies
    /// `pred`: one already read, or the next to come within `timeout`.
    fn wait(
        &mut self,
        what: &str,
        after_ms: u64,
        timeout: Duration,
        pred: impl Fn(&Value) -> bool,
    ) -> Value {
        let pred = |v: &Value| ms_of(v) >= after_ms && pred(v);
        if let Some(v) = self.lines().into_iter().find(|v| pred(v)) {
            return v;
        }
        json(&self.proc.wait_line(what, timeout, |l| pred(&json(l))))
    }

    /// A stats line stamped after `after_ms` with transfers to `peer` done
    /// in its interval.
    fn wait_ok(&mut self, peer: &str, after_ms: u64, timeout: Duration) -> Value {
        self.wait(
            &format!("transfers to {peer}"),
            after_ms + 1,
            timeout,
            |v| event(v) == "stats" && v["peer"] == peer && v["interval_ok"].as_u64() > Some(0),
        )
    }

    fn lines(&self) -> Vec<Value> {
        self.proc.seen().iter().map(|l| json(l)).collect()
    }

    /// Waits for the end; returns the exit status and the summary.
    fn finish(&mut self, timeout: Duration) -> (ExitStatus, Value) {
        let status = self.proc.wait(timeout);
        let summary = self
            .lines()
            .into_iter()
            .rfind(|v| event(v) == "summary")
            .unwrap_or_else(|| {
                panic!(
                    "soak printed no summary ({status})\nstdout:\n{}\nstderr:\n{}",
                    self.proc.seen().join("\n"),
                    self.proc.stderr()
                )
            });
        println!("soak summary: {summary}");
        (status, summary)
    }

    /// Keep-alive never declared a peer dead.
    fn assert_never_dead(&self, under: &str) {
        let dead: Vec<String> = self
            .lines()
            .iter()
            .filter(|v| event(v) == "peer" && v["state"] == "dead")
            .map(Value::to_string)
            .collect();
        assert!(
            dead.is_empty(),
            "keep-alive declared the peer dead {under}:\n{}",
            dead.join("\n")
        );
    }

    /// Everything it printed, for failure messages.
    fn dump(&self) -> String {
        format!(
            "soak stdout:\n{}\nsoak stderr:\n{}",
            self.proc.seen().join("\n"),
            self.proc.stderr()
        )
    }
}

fn peer_summary<'a>(summary: &'a Value, peer: &str) -> &'a Value {
    summary["peers"]
        .as_array()
        .and_then(|ps| ps.iter().find(|p| p["peer"] == peer))
        .unwrap_or_else(|| panic!("no summary for {peer}: {summary}"))
}

/// A soak that ran clean against `peer`: it came up, moved data, no byte
/// differed, and (with `no_failures`) no transfer failed.
fn assert_clean(summary: &Value, peer: &str, no_failures: bool) {
    let p = peer_summary(summary, peer);
    assert_eq!(p["came_up"], true, "{peer} never came up: {summary}");
    assert_eq!(p["mismatches"], 0, "bytes differed: {summary}");
    assert_eq!(p["stale_violations"], 0, "{summary}");
    assert!(
        p["ok"].as_u64() > Some(0),
        "no transfer completed: {summary}"
    );
    if no_failures {
        assert_eq!(p["failed"], 0, "transfers failed: {summary}");
    }
}

fn seconds(ms: u64) -> f64 {
    ms as f64 / 1e3
}

// ---------------------------------------------------------------- a. recipes

/// The `host-a$` and `host-b$` commands of the README's "Two hosts" recipe.
fn readme_two_host_commands() -> (String, String) {
    let readme = include_str!("../../../README.md");
    let line = |prompt: &str| {
        readme
            .lines()
            .find_map(|l| l.strip_prefix(prompt))
            .unwrap_or_else(|| panic!("README.md has no `{prompt}` line any more"))
            .trim()
            .to_owned()
    };
    (line("host-a$ "), line("host-b$ "))
}

/// `kvlane a b c` → `["a", "b", "c"]`.
fn kvlane_args(cmd: &str) -> Vec<String> {
    let mut words = cmd.split_whitespace();
    assert_eq!(words.next(), Some("kvlane"), "not a kvlane command: {cmd}");
    words.map(str::to_owned).collect()
}

#[test]
fn readme_two_host_bench_recipe_runs_across_hosts() {
    let (target_cmd, initiator_cmd) = readme_two_host_commands();
    let net = Net::new(2);
    let host_a = net.ip(0).to_string();
    let initiator_cmd = initiator_cmd.replace("host-a", &host_a);
    println!("host-a$ {target_cmd}\nhost-b$ {initiator_cmd}");
    let target_args = kvlane_args(&target_cmd);
    let target_args: Vec<&str> = target_args.iter().map(String::as_str).collect();
    let mut target = net.spawn(0, "bench-target", KVLANE, &target_args);
    target.wait_line("listening line", Duration::from_secs(60), |l| {
        l.starts_with("listening ")
    });
    let args = kvlane_args(&initiator_cmd);
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    let out = net.run(1, KVLANE, &args, Duration::from_secs(240));
    let stdout = String::from_utf8_lossy(&out.stdout);
    println!("{stdout}");
    assert!(
        out.status.success(),
        "the README's two-host bench failed across hosts ({}):\n{}\n{}\ntarget stderr:\n{}",
        out.status,
        stdout,
        String::from_utf8_lossy(&out.stderr),
        target.stderr()
    );
    // Per block size and op, the tcp backend's row and the raw-tcp ceiling
    // of the same link, same run; columns found by their header.
    let mut lines = stdout.lines();
    let header: Vec<&str> = lines
        .next()
        .unwrap_or_default()
        .split_whitespace()
        .collect();
    let col = |name: &str| {
        header
            .iter()
            .position(|h| *h == name)
            .unwrap_or_else(|| panic!("no {name} column in:\n{stdout}"))
    };
    let (c_backend, c_op, c_block, c_gbps) = (col("backend"), col("op"), col("block"), col("GB/s"));
    let rows: Vec<Vec<&str>> = lines
        .map(|l| l.split_whitespace().collect())
        .filter(|r: &Vec<&str>| r.len() > c_gbps)
        .collect();
    let gbps = |backend: &str, op: &str, block: &str| -> f64 {
        let row = rows
            .iter()
            .find(|r| (r[c_backend], r[c_op], r[c_block]) == (backend, op, block))
            .unwrap_or_else(|| panic!("no {backend} {op} {block} row in:\n{stdout}"));
        row[c_gbps].parse().expect("a GB/s column")
    };
    for block in ["64K", "1M"] {
        for op in ["read", "write"] {
            let (tcp, raw) = (gbps("tcp", op, block), gbps("raw-tcp", op, block));
            assert!(
                tcp > 0.0 && raw > 0.0,
                "{op} {block}: tcp {tcp}, raw-tcp {raw}"
            );
            println!(
                "bench across hosts: {op} {block}: tcp {tcp} GB/s, link ceiling (raw-tcp) {raw} GB/s, ratio {:.2}",
                tcp / raw
            );
        }
    }
}

/// `auto` (the bench's default; both pools shareable memory) between two
/// processes of one kernel: in one network namespace they are on one host
/// and go over shm; from another namespace (a host as CI simulates one)
/// the shm socket is out of reach, so the peer goes over tcp, and the
/// initiator says why at `info`.
#[test]
fn auto_is_shm_within_one_namespace_and_tcp_across_two_saying_why() {
    let net = Net::new(2);
    let listen = format!("{}:{PORT}", net.ip(0));
    let args = [
        "bench", "--role", "target", "--listen", &listen, "--pool", "4M",
    ];
    let mut target = net.spawn(0, "bench-target", KVLANE, &args);
    target.wait_line("listening line", Duration::from_secs(60), |l| {
        l.starts_with("listening ")
    });
    let initiator = |h: usize| -> (Vec<String>, String) {
        let mut cmd = net.command(h, KVLANE);
        cmd.env("RUST_LOG", "info")
            .args([
                "bench",
                "--role",
                "initiator",
                "--connect",
                &listen,
                "--json",
            ])
            .args(["--block-sizes", "64K", "--batch", "4", "--duration", "50ms"]);
        let out = netns::output_within(&mut cmd, Duration::from_secs(120));
        let (stdout, stderr) = (
            String::from_utf8_lossy(&out.stdout).into_owned(),
            String::from_utf8_lossy(&out.stderr).into_owned(),
        );
        assert!(
            out.status.success(),
            "initiator in h{}: {}\n{stdout}\n{stderr}\ntarget stderr:\n{}",
            h + 1,
            out.status,
            target.stderr()
        );
        let rows = stdout
            .lines()
            .map(|l| json(l)["backend"].as_str().unwrap_or_default().to_owned())
            .collect();
        (rows, stderr)
    };
    let (rows, _) = initiator(0);
    assert_eq!(rows, ["shm", "shm", "memcpy"], "one namespace: shm");
    let (rows, stderr) = initiator(1);
    assert_eq!(
        rows,
        ["raw-tcp", "raw-tcp", "tcp", "tcp"],
        "another namespace: tcp"
    );
    assert!(
        stderr.contains("shm: peer via tcp") && stderr.contains("another network namespace"),
        "the initiator did not say why it left shm:\n{stderr}"
    );
}

#[test]
fn serve_on_a_wildcard_answers_ping_from_another_host() {
    let net = Net::new(2);
    let listen = format!("0.0.0.0:{PORT}");
    let _serve = serve(&net, 0, &listen, &[]);
    let target = net.addr(0, PORT);
    let out = net.run(
        1,
        KVLANE,
        &["ping", &target, "-c", "3"],
        Duration::from_secs(60),
    );
    let stdout = String::from_utf8_lossy(&out.stdout);
    println!("{stdout}");
    assert!(
        out.status.success(),
        "kvlane ping {target} across hosts failed ({}):\n{stdout}{}",
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
    assert_eq!(stdout.matches("pong from").count(), 3, "{stdout}");
}

#[test]
fn unreachable_advertise_address_is_named_with_the_listening_address() {
    // TEST-NET-1: no route to it from any host.
    const NOWHERE: &str = "192.0.2.1";
    let net = Net::new(2);
    let listen = format!("0.0.0.0:{PORT}");
    let mut args = strings(&["serve", "--listen", &listen, "--advertise", NOWHERE]);
    args.extend(strings(&["--insecure", "--layers", "1", "--blocks", "16"]));
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    let mut serve = net.spawn(0, "serve", KVLANE, &args);
    // Either `serve` refuses the address at once, or the first peer that
    // tries it fails; whichever fails must name both addresses.
    let first = serve.next_line(Duration::from_secs(60));
    let (who, error) = match first {
        Some(l) if l.starts_with("listening ") => {
            let target = net.addr(0, PORT);
            let out = net.run(1, KVLANE, &["ping", &target], Duration::from_secs(60));
            assert!(
                !out.status.success(),
                "ping through an unreachable advertised address succeeded:\n{}",
                String::from_utf8_lossy(&out.stdout)
            );
            ("ping", String::from_utf8_lossy(&out.stderr).into_owned())
        }
        other => {
            let status = serve.wait(Duration::from_secs(30));
            assert!(!status.success(), "serve printed {other:?} and exited 0");
            ("serve", serve.stderr())
        }
    };
    println!("{who} failed with: {error}");
    assert!(
        error.contains(NOWHERE) && error.contains("0.0.0.0:"),
        "the {who} error must name the advertised address ({NOWHERE}) and the address the \
         target listens on (0.0.0.0:PORT):\n{error}"
    );
}

// ------------------------------------------------------ b. prefill / decode

/// `target/<profile>/examples/prefill_decode`, next to this test's `deps/`
/// (`cargo build --examples` makes it; `cargo test` alone builds only
/// hashed copies, some of them test harnesses, so ci/test.sh builds the
/// examples first).
fn example_binary() -> PathBuf {
    let exe = std::env::current_exe().expect("test executable path");
    let profile_dir = exe
        .parent()
        .and_then(|deps| deps.parent())
        .expect("target/<profile>/deps/<test>");
    let bin = profile_dir.join("examples").join("prefill_decode");
    let source = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../examples/prefill_decode.rs");
    let built = std::fs::metadata(&bin).and_then(|m| m.modified());
    let changed = std::fs::metadata(&source).and_then(|m| m.modified());
    match (built, changed) {
        (Ok(b), Ok(c)) if b >= c => bin,
        (Ok(_), _) => panic!(
            "{} is older than examples/prefill_decode.rs: run `cargo build --examples` first \
             (ci/test.sh does)",
            bin.display()
        ),
        (Err(e), _) => panic!(
            "{} is missing ({e}): run `cargo build --examples` first (ci/test.sh does)",
            bin.display()
        ),
    }
}

#[test]
fn prefill_decode_example_across_hosts_is_byte_exact() {
    let bin = example_binary();
    let bin = bin.to_str().expect("utf-8 path");
    let net = Net::new(2);
    let listen = format!("0.0.0.0:{PORT}");
    let mut decode = net.spawn(0, "decode", bin, &["--role", "decode", "--listen", &listen]);
    decode.wait_line("listening line", Duration::from_secs(60), |l| {
        l.starts_with("listening ")
    });
    let target = net.addr(0, PORT);
    let out = net.run(
        1,
        bin,
        &["--role", "prefill", "--connect", &target],
        Duration::from_secs(120),
    );
    let stdout = String::from_utf8_lossy(&out.stdout);
    println!("prefill:\n{stdout}");
    assert!(
        out.status.success() && stdout.contains("contents verified"),
        "prefill across hosts failed ({}):\n{stdout}{}\ndecode:\n{}\n{}",
        out.status,
        String::from_utf8_lossy(&out.stderr),
        decode.seen().join("\n"),
        decode.stderr()
    );
    let status = decode.wait(Duration::from_secs(60));
    println!("decode:\n{}", decode.seen().join("\n"));
    assert!(
        status.success()
            && decode
                .seen()
                .iter()
                .any(|l| l.contains("contents verified")),
        "decode did not verify the WRITE ({status}):\n{}\n{}",
        decode.seen().join("\n"),
        decode.stderr()
    );
}

// ------------------------------------------------------------- c. loss, delay

fn print_numbers(test: &str, summary: &Value, peer: &str) {
    let p = peer_summary(summary, peer);
    println!(
        "{test}: {} transfers ok, {} failed, p50 {} us, p99 {} us, {} GB/s",
        p["ok"], p["failed"], p["p50_us"], p["p99_us"], p["gbps"]
    );
}

#[test]
fn two_percent_loss_keeps_transfers_correct_and_the_peer_alive() {
    let net = Net::new(2);
    let _serve = serve(&net, 0, &net.addr(0, PORT), &[]);
    net.loss(0, 2);
    let target = net.addr(0, PORT);
    let mut soak = Soak::start(&net, 1, std::slice::from_ref(&target), "10s", &[]);
    let (status, summary) = soak.finish(Duration::from_secs(60));
    let dropped = net.dropped(0);
    print_numbers("2% loss", &summary, &target);
    println!("2% loss: {dropped} packets dropped by the loss rules");
    soak.assert_never_dead("under 2% loss");
    assert!(status.success(), "{status}\n{}", soak.dump());
    assert_clean(&summary, &target, true);
    assert!(
        dropped > 0,
        "the loss rules dropped nothing: the fault was not applied"
    );
}

#[test]
fn fifty_ms_each_way_keeps_transfers_correct_and_the_peer_alive() {
    let net = Net::new(3);
    let (server, client, router) = (0, 1, 2);
    let data = net.addr(server, DATA_PORT);
    let _serve = serve(
        &net,
        server,
        &net.addr(server, PORT),
        &["--data-listen", &data],
    );
    let proxy = net.delay(
        client,
        router,
        server,
        &[PORT, DATA_PORT],
        Duration::from_millis(50),
    );
    let target = net.addr(server, PORT);
    let mut soak = Soak::start(&net, client, std::slice::from_ref(&target), "10s", &[]);
    let (status, summary) = soak.finish(Duration::from_secs(60));
    print_numbers("50 ms each way", &summary, &target);
    println!(
        "50 ms each way: the proxy accepted {} connections and forwarded {} bytes",
        proxy.accepted(),
        proxy.forwarded()
    );
    soak.assert_never_dead("with 50 ms delay each way");
    assert!(status.success(), "{status}\n{}", soak.dump());
    assert_clean(&summary, &target, true);
    // Control and data plane went through the proxy: at least every
    // payload byte moved (WRITE out, READ back) passed it.
    let p = peer_summary(&summary, &target);
    let payload = p["ok"].as_u64().unwrap_or(0) * (64 << 10) * 2;
    assert!(
        proxy.accepted() >= 2 && proxy.forwarded() >= payload,
        "traffic bypassed the delay proxy: {} connections, {} bytes forwarded, {payload} payload",
        proxy.accepted(),
        proxy.forwarded()
    );
}

// ------------------------------------------------------------- d. link down

#[test]
fn link_down_fails_transfers_within_the_budget_and_recovers() {
    let net = Net::new(2);
    let _serve = serve(&net, 0, &net.addr(0, PORT), &[]);
    let target = net.addr(0, PORT);
    let mut soak = Soak::start(&net, 1, std::slice::from_ref(&target), "22s", &[]);
    soak.wait_ok(&target, 0, Duration::from_secs(30));

    let down = unix_ms();
    net.link(0, false);
    let bound = BUDGET + SLACK + Duration::from_secs(10);
    let failed = soak.wait("a transfer failure", down, bound, |v| {
        event(v) == "transfer_failed"
    });
    let detection = ms_of(&failed).saturating_sub(down);
    let dead = soak.wait("a dead event", down, bound, |v| {
        event(v) == "peer" && v["state"] == "dead"
    });
    println!(
        "link down: first transfer failed after {:.3} s ({}: {}), dead after {:.3} s; budget {:.3} s (+{:.1} s slack)",
        seconds(detection),
        failed["kind"],
        failed["error"],
        seconds(ms_of(&dead).saturating_sub(down)),
        BUDGET.as_secs_f64(),
        SLACK.as_secs_f64()
    );
    assert_eq!(failed["kind"], "PeerLost", "{failed}");
    assert!(
        Duration::from_millis(detection) <= BUDGET + SLACK,
        "in-flight transfers failed {detection} ms after the link went down; budget {BUDGET:?} + {SLACK:?}"
    );

    std::thread::sleep(Duration::from_millis(
        (down + 10_000).saturating_sub(unix_ms()),
    ));
    let up = unix_ms();
    net.link(0, true);
    let back = soak.wait("up again", up, Duration::from_secs(15), |v| {
        event(v) == "peer" && v["state"] == "up"
    });
    let flowing = soak.wait_ok(&target, ms_of(&back), Duration::from_secs(10));
    println!(
        "link up after {:.1} s down: peer up again after {:.3} s, transfers flowing after {:.3} s",
        seconds(up - down),
        seconds(ms_of(&back) - up),
        seconds(ms_of(&flowing) - up)
    );
    let (status, summary) = soak.finish(Duration::from_secs(40));
    print_numbers("link down 10 s", &summary, &target);
    assert!(status.success(), "{status}\n{}", soak.dump());
    assert_clean(&summary, &target, false);
    assert_eq!(
        peer_summary(&summary, &target)["restarts"],
        0,
        "a link flap is not a restart"
    );
}

// ------------------------------------------------------- e. killed, restarted

#[test]
fn killed_target_fails_within_the_budget_then_restarts_stale() {
    let net = Net::new(2);
    let listen = net.addr(0, PORT);
    let mut served = serve(&net, 0, &listen, &[]);
    let target = listen.clone();
    let mut soak = Soak::start(&net, 1, std::slice::from_ref(&target), "16s", &[]);
    soak.wait_ok(&target, 0, Duration::from_secs(30));

    let killed = unix_ms();
    served.kill();
    let bound = BUDGET + SLACK + Duration::from_secs(10);
    let failed = soak.wait("a transfer failure", killed, bound, |v| {
        event(v) == "transfer_failed"
    });
    let dead = soak.wait("a dead event", killed, bound, |v| {
        event(v) == "peer" && v["state"] == "dead"
    });
    let (detection, dead_after) = (
        ms_of(&failed).saturating_sub(killed),
        ms_of(&dead).saturating_sub(killed),
    );
    println!(
        "SIGKILL: first transfer failed after {:.3} s ({}: {}), dead after {:.3} s; budget {:.3} s (+{:.1} s slack)",
        seconds(detection),
        failed["kind"],
        failed["error"],
        seconds(dead_after),
        BUDGET.as_secs_f64(),
        SLACK.as_secs_f64()
    );
    assert_eq!(failed["kind"], "PeerLost", "{failed}");
    assert!(
        Duration::from_millis(detection) <= BUDGET + SLACK
            && Duration::from_millis(dead_after) <= BUDGET + SLACK,
        "killed target: transfers failed after {detection} ms, dead after {dead_after} ms; \
         budget {BUDGET:?} + {SLACK:?}"
    );

    let restarted_at = unix_ms();
    let _served = serve(&net, 0, &listen, &[]);
    let restarted = soak.wait("a restarted event", killed, Duration::from_secs(15), |v| {
        event(v) == "peer" && v["state"] == "restarted"
    });
    let check = soak.wait("the stale check", killed, Duration::from_secs(5), |v| {
        event(v) == "stale_check"
    });
    println!(
        "restart: detected {:.3} s after the new process started ({}); old prepared transfer: {check}",
        seconds(ms_of(&restarted).saturating_sub(restarted_at)),
        restarted["detail"]
    );
    assert_eq!(
        check["stale"], true,
        "a transfer prepared before the restart went out: {check}"
    );
    assert_eq!(check["kind"], "Stale", "{check}");
    soak.wait_ok(&target, ms_of(&restarted), Duration::from_secs(10));
    let (status, summary) = soak.finish(Duration::from_secs(40));
    print_numbers("SIGKILL + restart", &summary, &target);
    assert!(status.success(), "{status}\n{}", soak.dump());
    assert_clean(&summary, &target, false);
    assert_eq!(peer_summary(&summary, &target)["restarts"], 1, "{summary}");
}

// -------------------------------------------------- f. blackholed data plane

/// Median and max of the `p99_us` of `stats` lines.
fn p99s(lines: &[&Value]) -> (u64, u64) {
    let mut v: Vec<u64> = lines.iter().filter_map(|l| l["p99_us"].as_u64()).collect();
    v.sort_unstable();
    (
        v.get(v.len() / 2).copied().unwrap_or(0),
        v.last().copied().unwrap_or(0),
    )
}

#[test]
fn blackholed_data_plane_of_one_peer_leaves_the_other_flowing() {
    const CONNECT_TIMEOUT: Duration = Duration::from_secs(3);
    let net = Net::new(3);
    let (soak_host, t1, t2) = (0, 1, 2);
    let _healthy = serve(&net, t1, &net.addr(t1, PORT), &[]);
    let (t1_addr, t2_addr) = (net.addr(t1, PORT), net.addr(t2, PORT));
    // T2's control plane answers; every packet to its data port is dropped.
    net.blackhole(t2, DATA_PORT);
    let mut soak = Soak::start(
        &net,
        soak_host,
        &[t1_addr.clone(), t2_addr.clone()],
        "16s",
        &["--stats-interval", "250ms", "--connect-timeout", "3s"],
    );
    soak.wait_ok(&t1_addr, 0, Duration::from_secs(30));
    soak.wait_ok(&t1_addr, unix_ms() + 500, Duration::from_secs(10));
    let t2_started = unix_ms();
    let data = net.addr(t2, DATA_PORT);
    let _blackholed = serve(&net, t2, &t2_addr, &["--data-listen", &data]);
    let t2_up = unix_ms();
    // The first failure that names T2's data endpoint: its control plane
    // answered (at once, or once T2 was up for an attempt begun earlier),
    // then the dial of the blackholed port hung for the connect timeout.
    let data_ip = data.clone();
    let failed = soak.wait(
        "T2's data-plane dial to fail",
        t2_up,
        CONNECT_TIMEOUT * 4 + Duration::from_secs(10),
        |v| {
            event(v) == "connect_failed"
                && v["peer"] == t2_addr.as_str()
                && v["error"].as_str().is_some_and(|e| e.contains(&data_ip))
        },
    );
    let fail_at = ms_of(&failed);
    let attempt_from = fail_at.saturating_sub(failed["elapsed_ms"].as_f64().unwrap_or(0.0) as u64);
    // From the later of the attempt's start and T2's start to the failure.
    let took = fail_at.saturating_sub(attempt_from.max(t2_up));
    let error = failed["error"].as_str().unwrap_or("").to_owned();
    let dial_from = fail_at.saturating_sub(CONNECT_TIMEOUT.as_millis() as u64);
    let (from, to) = (dial_from + 300, fail_at.saturating_sub(300));
    let lines = soak.lines();
    let t1_stats: Vec<&Value> = lines
        .iter()
        .filter(|v| event(v) == "stats" && v["peer"] == t1_addr.as_str())
        .collect();
    let covers = |v: &Value, a: u64, b: u64| {
        let end = ms_of(v);
        let start = end.saturating_sub((v["interval_s"].as_f64().unwrap_or(0.0) * 1e3) as u64);
        start >= a && end <= b
    };
    let before: Vec<&Value> = t1_stats
        .iter()
        .copied()
        .filter(|v| ms_of(v) <= t2_started)
        .collect();
    let during: Vec<&Value> = t1_stats
        .iter()
        .copied()
        .filter(|v| covers(v, from, to))
        .collect();
    let stalled: Vec<&Value> = during
        .iter()
        .copied()
        .filter(|v| v["interval_ok"].as_u64() == Some(0))
        .collect();
    let (b50, bmax) = p99s(&before);
    let (d50, dmax) = p99s(&during);
    println!(
        "blackholed T2: its connect failed {:.3} s after T2 was reachable (connect timeout {:?}): {error}",
        seconds(took),
        CONNECT_TIMEOUT
    );
    println!(
        "T1 p99 before: median {b50} us, max {bmax} us over {} intervals; while T2's dial hung: \
         median {d50} us, max {dmax} us over {} intervals, {} of them without a completed transfer",
        before.len(),
        during.len(),
        stalled.len()
    );
    assert!(
        !during.is_empty(),
        "no 250 ms stats interval of T1 fell inside T2's hanging dial ({from}..{to})\n{}",
        soak.dump()
    );
    assert!(
        stalled.is_empty(),
        "T1 completed no transfer in {} of {} intervals while T2's data-plane dial hung: one \
         blackholed peer stalls the others\n{}",
        stalled.len(),
        during.len(),
        stalled
            .iter()
            .map(|v| v.to_string())
            .collect::<Vec<_>>()
            .join("\n")
    );
    assert!(
        error.contains(&net.ip(t2).to_string()),
        "T2's connect error does not name its address {}: {error}",
        net.ip(t2)
    );
    assert!(
        Duration::from_millis(took) <= CONNECT_TIMEOUT + Duration::from_millis(1500),
        "T2's connect failed only {took} ms after T2 was reachable; connect timeout {CONNECT_TIMEOUT:?}"
    );
    let (status, summary) = soak.finish(Duration::from_secs(40));
    let lines = soak.lines();
    let after: Vec<&Value> = lines
        .iter()
        .filter(|v| {
            event(v) == "stats" && v["peer"] == t1_addr.as_str() && ms_of(v) > fail_at + 300
        })
        .collect();
    let (a50, amax) = p99s(&after);
    println!(
        "T1 p99 after T2's dial failed: median {a50} us, max {amax} us over {} intervals",
        after.len()
    );
    assert!(
        !status.success(),
        "a soak whose peer never came up must fail: {summary}"
    );
    assert_clean(&summary, &t1_addr, true);
    assert_eq!(
        peer_summary(&summary, &t2_addr)["came_up"],
        false,
        "{summary}"
    );
    assert!(net.blackholed(t2) > 0, "the blackhole dropped nothing");
}

// ------------------------------------------------------------------ rails

/// The bytes each rail had carried at the first `rails` line of a soak
/// stamped at or after `after_ms`.
fn rail_bytes(soak: &mut Soak, after_ms: u64) -> Vec<u64> {
    let v = soak.wait("a rails line", after_ms, Duration::from_secs(10), |v| {
        event(v) == "rails"
    });
    v["rails"]
        .as_array()
        .expect("rails")
        .iter()
        .map(|r| r["bytes"].as_u64().expect("bytes"))
        .collect()
}

#[test]
fn a_rail_whose_link_goes_down_hands_its_work_to_the_other_and_comes_back() {
    // Two hosts on two networks; serve and soak each use both as rails.
    // Rail 1 is on another address than the control connection (one per
    // network): each side dials it only with `--dial-any-data-host`.
    let net = Net::with_rails(2, 2);
    let rails_of = |h: usize| format!("{}:0,{}:0", net.ip_on(h, 0), net.ip_on(h, 1));
    let target = net.addr(0, PORT);
    let any = "--dial-any-data-host";
    let _serve = serve(&net, 0, &target, &["--data-listen", &rails_of(0), any]);
    let mut soak = Soak::start(
        &net,
        1,
        std::slice::from_ref(&target),
        "20s",
        &[
            "--data-listen",
            &rails_of(1),
            "--stats-interval",
            "250ms",
            any,
        ],
    );
    soak.wait_ok(&target, unix_ms(), Duration::from_secs(30));
    std::thread::sleep(Duration::from_secs(2));
    let before = rail_bytes(&mut soak, unix_ms());
    assert_eq!(before.len(), 2, "{}", soak.dump());
    assert!(
        before.iter().all(|&b| b > 0),
        "both rails carry bytes: {before:?}"
    );

    // Rail 1 of the soaking host goes down for 6 s: transfers go on.
    net.link_rail(1, 1, false);
    let down = unix_ms();
    std::thread::sleep(Duration::from_secs(6));
    soak.wait_ok(&target, down + 4000, Duration::from_secs(10));
    let during = rail_bytes(&mut soak, unix_ms());
    net.link_rail(1, 1, true);
    let up = unix_ms();
    // After it is back (re-dialed within retry_after), it carries bytes again.
    std::thread::sleep(Duration::from_secs(5));
    let after = rail_bytes(&mut soak, unix_ms());
    let (status, summary) = soak.finish(Duration::from_secs(60));
    println!("rails: before {before:?}, down {during:?}, up {after:?}");
    assert!(status.success(), "{status}\n{}", soak.dump());
    // Not one transfer failed: the parts on the dead rail moved.
    assert_clean(&summary, &target, true);
    soak.assert_never_dead("with one rail down");
    let rails = summary["rails"].as_array().expect("rails in the summary");
    assert!(
        rails[1]["reposts"].as_u64() >= Some(1),
        "nothing moved off the downed rail: {summary}"
    );
    assert!(
        during[0] > before[0],
        "rail 0 carried nothing while rail 1 was down"
    );
    assert!(
        after[1] > during[1],
        "rail 1 carried nothing in the 5 s after its link came back (at {up}): {during:?} -> {after:?}\n{}",
        soak.dump()
    );
}
