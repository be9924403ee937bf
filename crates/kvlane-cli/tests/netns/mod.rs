//! Hosts as Linux network namespaces, for tests that must leave 127.0.0.1.
//!
//! A [`Net`] is N hosts (`h1..hN`, addresses `10.231.S.1..N/24`), each a
//! network namespace whose `eth0` is one end of a veth pair; the other ends
//! are ports of a bridge that lives in a namespace of its own, so nothing
//! touches the machine's network and the addresses exist only inside.
//! Faults: a link down or up (the bridge port: the host sees its carrier
//! go, the far side sees silence, not a reset), random loss (nftables
//! `numgen random`; this kernel has no `sch_netem`), a blackholed TCP port
//! (every packet to it dropped: a dial hangs) and a delay proxy.
//!
//! The delay proxy is a TCP forwarder on a third "router" host: the client
//! host routes the server's address via the router, whose nftables
//! `redirect` hands the chosen ports to the proxy, which holds every chunk
//! for D before passing it on (each way). It is transparent: the client
//! dials the server's own address and the server advertises its own
//! address, as without a proxy. The proxy runs on a thread of the test
//! process that moved itself into the router's namespace (`setns`) and
//! drives its sockets with a current-thread tokio runtime: no helper binary
//! to build and find, no process that could outlive the test, and it stops
//! when its guard drops.
//!
//! Needs root; without it (or without namespace support) a `Net` panics
//! with the reason: these tests fail loudly, they never skip. `ip` and `nft`
//! are installed with apt-get when missing. Names carry the test process id
//! and a counter, so tests run in parallel; namespaces left by a process
//! that died are removed by the next run, and a `Net` removes its own (and
//! kills what runs inside) when dropped.
#![allow(dead_code)] // each test binary uses a different part

use std::fs::File;
use std::io::{BufRead, BufReader, Read, Write};
use std::net::{Ipv4Addr, SocketAddr};
use std::os::fd::AsFd;
use std::process::{Child, Command, ExitStatus, Output, Stdio};
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::sync::{mpsc, Arc, Mutex, Once};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

/// Namespace names start with this, then `<pid>x<seq>`.
const PREFIX: &str = "kvl";
static SEQ: AtomicU32 = AtomicU32::new(1);

fn is_root() -> bool {
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with("Uid:"))
                .and_then(|l| l.split_whitespace().nth(2).map(|euid| euid == "0"))
        })
        .unwrap_or(false)
}

/// Runs `cmd` to completion within `limit`; kills it past the limit.
pub(crate) fn output_within(cmd: &mut Command, limit: Duration) -> Output {
    let what = format!("{cmd:?}");
    let mut child = cmd
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap_or_else(|e| panic!("cannot run {what}: {e}"));
    let out = child.stdout.take().map(drain);
    let err = child.stderr.take().map(drain);
    let deadline = Instant::now() + limit;
    let status = loop {
        if let Some(s) = child.try_wait().expect("wait for a child") {
            break s;
        }
        if Instant::now() >= deadline {
            let _ = child.kill();
            let _ = child.wait();
            panic!("{what} did not finish within {limit:?}");
        }
        std::thread::sleep(Duration::from_millis(10));
    };
    let take = |h: Option<JoinHandle<Vec<u8>>>| h.and_then(|h| h.join().ok()).unwrap_or_default();
    Output {
        status,
        stdout: take(out),
        stderr: take(err),
    }
}

fn drain(mut r: impl Read + Send + 'static) -> JoinHandle<Vec<u8>> {
    std::thread::spawn(move || {
        let mut v = Vec::new();
        let _ = r.read_to_end(&mut v);
        v
    })
}

/// Runs a setup command; panics with its output when it fails.
fn sh(args: &[&str]) -> String {
    let out = output_within(
        Command::new(args[0]).args(&args[1..]),
        Duration::from_secs(30),
    );
    if !out.status.success() {
        panic!(
            "`{}` failed ({}): {}",
            args.join(" "),
            out.status,
            String::from_utf8_lossy(&out.stderr).trim()
        );
    }
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// Feeds `script` to `nft -f -` inside namespace `ns`.
fn nft(ns: &str, script: &str) {
    let mut child = Command::new("ip")
        .args(["netns", "exec", ns, "nft", "-f", "-"])
        .stdin(Stdio::piped())
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .expect("run nft");
    child
        .stdin
        .take()
        .expect("nft stdin")
        .write_all(script.as_bytes())
        .expect("write the nft script");
    let out = child.wait_with_output().expect("wait for nft");
    assert!(
        out.status.success(),
        "nft in {ns} refused:\n{script}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
}

fn have(tool: &str) -> bool {
    Command::new("sh")
        .args(["-c", &format!("command -v {tool}")])
        .stdout(Stdio::null())
        .status()
        .is_ok_and(|s| s.success())
}

/// Root, `ip` and `nft` (installed when missing), and no namespaces left
/// by earlier runs whose process is gone. Once per test process.
fn prepare_machine() {
    static ONCE: Once = Once::new();
    ONCE.call_once(|| {
        assert!(
            is_root(),
            "the multi-host tests need root: they build network namespaces (CI runs them as \
             root; run `sudo -E cargo test -p kvlane-cli --test multihost`). They never skip."
        );
        for (tool, package) in [("ip", "iproute2"), ("nft", "nftables")] {
            if have(tool) {
                continue;
            }
            eprintln!("netns: installing {package} for `{tool}`");
            let apt = |args: &[&str]| {
                let out = output_within(
                    Command::new("apt-get")
                        .args(["-o", "DPkg::Lock::Timeout=120", "-q", "-y"])
                        .args(args)
                        .env("DEBIAN_FRONTEND", "noninteractive"),
                    Duration::from_secs(600),
                );
                assert!(
                    out.status.success(),
                    "apt-get {} failed: {}",
                    args.join(" "),
                    String::from_utf8_lossy(&out.stderr)
                );
            };
            apt(&["update"]);
            apt(&["install", package]);
            assert!(
                have(tool),
                "{package} is installed but `{tool}` is not on PATH"
            );
        }
        remove_stale();
    });
}

/// Removes namespaces of test processes that no longer run.
fn remove_stale() {
    for ns in sh(&["ip", "netns", "list"])
        .lines()
        .filter_map(|l| l.split_whitespace().next())
    {
        let Some(pid) = ns
            .strip_prefix(PREFIX)
            .and_then(|r| r.split('x').next())
            .and_then(|p| p.parse::<u32>().ok())
        else {
            continue;
        };
        if pid != std::process::id() && !std::path::Path::new(&format!("/proc/{pid}")).exists() {
            eprintln!("netns: removing {ns}, left by process {pid}");
            kill_inside(ns);
            let _ = Command::new("ip").args(["netns", "del", ns]).status();
        }
    }
}

/// SIGKILLs every process in namespace `ns` (never this one).
fn kill_inside(ns: &str) {
    let Ok(out) = Command::new("ip").args(["netns", "pids", ns]).output() else {
        return;
    };
    for pid in String::from_utf8_lossy(&out.stdout).split_whitespace() {
        if pid != std::process::id().to_string() {
            let _ = Command::new("kill").args(["-9", pid]).status();
        }
    }
}

/// N hosts on one bridge (or one bridge per rail). See the module docs.
pub(crate) struct Net {
    tag: String,
    subnet: u8,
    switch: String,
    hosts: Vec<String>,
    rails: usize,
}

impl Net {
    /// `n` hosts `h1..hn` with addresses `10.231.S.1..n`.
    pub(crate) fn new(n: usize) -> Self {
        Self::with_rails(n, 1)
    }

    /// `n` hosts, each on `rails` networks: rail `r` is its own bridge,
    /// `eth{r}` in every host, addresses `10.(231+r).S.1..n`.
    pub(crate) fn with_rails(n: usize, rails: usize) -> Self {
        assert!((1..=4).contains(&rails));
        assert!((1..=250).contains(&n));
        prepare_machine();
        let seq = SEQ.fetch_add(1, Ordering::Relaxed);
        let tag = format!("{PREFIX}{}x{seq}", std::process::id());
        let net = Self {
            switch: format!("{tag}sw"),
            hosts: (1..=n).map(|i| format!("{tag}h{i}")).collect(),
            subnet: (seq % 250) as u8 + 1,
            tag,
            rails,
        };
        // A leftover of a process that had our pid: start clean.
        for ns in net.namespaces() {
            if std::path::Path::new(&format!("/run/netns/{ns}")).exists() {
                kill_inside(&ns);
                let _ = Command::new("ip").args(["netns", "del", &ns]).status();
            }
        }
        let sw = net.switch.clone();
        sh(&["ip", "netns", "add", &sw]);
        for h in &net.hosts {
            sh(&["ip", "netns", "add", h]);
            sh(&["ip", "-n", h, "link", "set", "lo", "up"]);
        }
        for r in 0..rails {
            let br = format!("br{r}");
            sh(&["ip", "-n", &sw, "link", "add", &br, "type", "bridge"]);
            sh(&["ip", "-n", &sw, "link", "set", &br, "up"]);
            for (i, h) in net.hosts.iter().enumerate() {
                let port = net.port(i, r);
                let eth = format!("eth{r}");
                let ip = format!("{}/24", net.ip_on(i, r));
                sh(&[
                    "ip", "-n", &sw, "link", "add", &port, "type", "veth", "peer", "name", &eth,
                    "netns", h,
                ]);
                sh(&["ip", "-n", &sw, "link", "set", &port, "master", &br, "up"]);
                sh(&["ip", "-n", h, "addr", "add", &ip, "dev", &eth]);
                sh(&["ip", "-n", h, "link", "set", &eth, "up"]);
            }
        }
        net
    }

    /// The switch-side port of host `h` on rail `r`.
    fn port(&self, h: usize, r: usize) -> String {
        if r == 0 {
            format!("p{}", h + 1)
        } else {
            format!("r{r}p{}", h + 1)
        }
    }

    /// The address of host `h` (0-based) on rail `r` (0-based).
    pub(crate) fn ip_on(&self, h: usize, r: usize) -> Ipv4Addr {
        assert!(r < self.rails, "rail {r} of {}", self.rails);
        Ipv4Addr::new(10, 231 + r as u8, self.subnet, h as u8 + 1)
    }

    /// Takes host `h`'s link on rail `r` down or up.
    pub(crate) fn link_rail(&self, h: usize, r: usize, up: bool) {
        let state = if up { "up" } else { "down" };
        sh(&[
            "ip",
            "-n",
            &self.switch,
            "link",
            "set",
            &self.port(h, r),
            state,
        ]);
    }

    fn namespaces(&self) -> Vec<String> {
        let mut v = self.hosts.clone();
        v.push(self.switch.clone());
        v
    }

    /// The namespace name of host `h` (0-based).
    pub(crate) fn ns(&self, h: usize) -> &str {
        &self.hosts[h]
    }

    /// The address of host `h` (0-based).
    pub(crate) fn ip(&self, h: usize) -> Ipv4Addr {
        Ipv4Addr::new(10, 231, self.subnet, h as u8 + 1)
    }

    /// `ip:port` of host `h`.
    pub(crate) fn addr(&self, h: usize, port: u16) -> String {
        format!("{}:{port}", self.ip(h))
    }

    /// A command that runs `program` inside host `h`.
    pub(crate) fn command(&self, h: usize, program: &str) -> Command {
        let mut c = Command::new("ip");
        c.args(["netns", "exec", &self.hosts[h], program]);
        c
    }

    /// Runs `program args` in host `h` to completion (bounded by `limit`).
    pub(crate) fn run(&self, h: usize, program: &str, args: &[&str], limit: Duration) -> Output {
        output_within(self.command(h, program).args(args), limit)
    }

    /// Starts `program args` in host `h`; it is killed when the guard drops.
    pub(crate) fn spawn(&self, h: usize, label: &str, program: &str, args: &[&str]) -> Proc {
        Proc::spawn(
            format!("{label}@h{}", h + 1),
            self.command(h, program).args(args),
        )
    }

    /// Takes host `h`'s link (its bridge port) down or up.
    pub(crate) fn link(&self, h: usize, up: bool) {
        let port = format!("p{}", h + 1);
        let state = if up { "up" } else { "down" };
        sh(&["ip", "-n", &self.switch, "link", "set", &port, state]);
    }

    /// Drops `pct` percent of the packets host `h` sends and of those it
    /// receives; 0 clears.
    pub(crate) fn loss(&self, h: usize, pct: u32) {
        assert!(pct <= 100);
        let mut script = String::from("table inet kvloss\ndelete table inet kvloss\n");
        if pct > 0 {
            script.push_str(&format!(
                "table inet kvloss {{\n\
                 chain in {{ type filter hook input priority 0; iifname \"eth0\" numgen random mod 100 < {pct} counter drop; }}\n\
                 chain out {{ type filter hook output priority 0; oifname \"eth0\" numgen random mod 100 < {pct} counter drop; }}\n\
                 }}\n"
            ));
        }
        nft(&self.hosts[h], &script);
    }

    /// Packets the [`loss`](Self::loss) rules of host `h` dropped so far.
    pub(crate) fn dropped(&self, h: usize) -> u64 {
        counted(&self.hosts[h], "kvloss")
    }

    /// Drops every TCP packet to `port` on host `h`: a dial to it hangs
    /// (no reset, no answer), established connections go silent.
    pub(crate) fn blackhole(&self, h: usize, port: u16) {
        nft(
            &self.hosts[h],
            &format!(
                "table inet kvbh {{\n\
                 chain in {{ type filter hook input priority 0; tcp dport {port} counter drop; }}\n\
                 }}\n"
            ),
        );
    }

    /// Packets the [`blackhole`](Self::blackhole) rules of host `h` dropped.
    pub(crate) fn blackholed(&self, h: usize) -> u64 {
        counted(&self.hosts[h], "kvbh")
    }

    /// Sends `client`'s TCP connections to `server`'s `ports` through a
    /// proxy on host `router` that delays every byte by `delay` each way.
    pub(crate) fn delay(
        &self,
        client: usize,
        router: usize,
        server: usize,
        ports: &[u16],
        delay: Duration,
    ) -> DelayProxy {
        let (c, r, s) = (&self.hosts[client], self.ip(router), self.ip(server));
        sh(&[
            "ip",
            "-n",
            c,
            "route",
            "add",
            &format!("{s}/32"),
            "via",
            &r.to_string(),
        ]);
        let list = ports
            .iter()
            .map(u16::to_string)
            .collect::<Vec<_>>()
            .join(", ");
        nft(
            &self.hosts[router],
            &format!(
                "table ip kvdelay {{\n\
                 chain pre {{ type nat hook prerouting priority -100; ip daddr {s} tcp dport {{ {list} }} counter redirect; }}\n\
                 }}\n"
            ),
        );
        let routes = ports
            .iter()
            .map(|&p| (p, SocketAddr::from((s, p))))
            .collect();
        DelayProxy::start(&self.hosts[router], routes, delay)
    }
}

/// Sum of the `counter packets N` of table `table` in namespace `ns`.
fn counted(ns: &str, table: &str) -> u64 {
    let text = sh(&[
        "ip", "netns", "exec", ns, "nft", "list", "table", "inet", table,
    ]);
    let words: Vec<&str> = text.split_whitespace().collect();
    words
        .windows(2)
        .filter(|w| w[0] == "packets")
        .filter_map(|w| w[1].parse::<u64>().ok())
        .sum()
}

impl Drop for Net {
    fn drop(&mut self) {
        for ns in self.namespaces() {
            kill_inside(&ns);
            let _ = Command::new("ip").args(["netns", "del", &ns]).status();
        }
    }
}

/// A process of a test, killed (SIGKILL) when dropped. Its stdout is read
/// line by line; its stderr is kept for failure messages.
pub(crate) struct Proc {
    label: String,
    child: Child,
    lines: mpsc::Receiver<String>,
    seen: Vec<String>,
    stderr: Arc<Mutex<String>>,
    exited: Option<ExitStatus>,
}

impl Proc {
    fn spawn(label: String, cmd: &mut Command) -> Self {
        let mut child = cmd
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap_or_else(|e| panic!("cannot start {label}: {e}"));
        let (tx, lines) = mpsc::channel();
        let stdout = child.stdout.take().expect("piped stdout");
        std::thread::spawn(move || {
            for line in BufReader::new(stdout).lines().map_while(Result::ok) {
                if tx.send(line).is_err() {
                    break;
                }
            }
        });
        let stderr = Arc::new(Mutex::new(String::new()));
        let (err_pipe, keep) = (child.stderr.take().expect("piped stderr"), stderr.clone());
        std::thread::spawn(move || {
            for line in BufReader::new(err_pipe).lines().map_while(Result::ok) {
                let mut s = keep.lock().unwrap_or_else(|e| e.into_inner());
                s.push_str(&line);
                s.push('\n');
            }
        });
        Self {
            label,
            child,
            lines,
            seen: Vec::new(),
            stderr,
            exited: None,
        }
    }

    pub(crate) fn label(&self) -> &str {
        &self.label
    }

    /// Everything it wrote to stderr so far.
    pub(crate) fn stderr(&self) -> String {
        self.stderr
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
    }

    /// Every stdout line read so far.
    pub(crate) fn seen(&self) -> &[String] {
        &self.seen
    }

    /// The next stdout line, if one comes within `timeout`.
    pub(crate) fn next_line(&mut self, timeout: Duration) -> Option<String> {
        let line = self.lines.recv_timeout(timeout).ok()?;
        self.seen.push(line.clone());
        Some(line)
    }

    /// Reads stdout until a line satisfies `pred`; panics (with what it
    /// printed) when none does within `timeout`.
    pub(crate) fn wait_line(
        &mut self,
        what: &str,
        timeout: Duration,
        mut pred: impl FnMut(&str) -> bool,
    ) -> String {
        let deadline = Instant::now() + timeout;
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            match self.lines.recv_timeout(left) {
                Ok(line) => {
                    self.seen.push(line.clone());
                    if pred(&line) {
                        return line;
                    }
                }
                Err(e) => panic!(
                    "{}: no {what} within {timeout:?} ({e}); exit status {:?}\nstdout:\n{}\nstderr:\n{}",
                    self.label,
                    self.child.try_wait().ok().flatten(),
                    self.seen.join("\n"),
                    self.stderr()
                ),
            }
        }
    }

    /// SIGKILL, then reap.
    pub(crate) fn kill(&mut self) {
        let _ = self.child.kill();
        if let Ok(s) = self.child.wait() {
            self.exited = Some(s);
        }
    }

    /// Waits for it to exit on its own (panics past `timeout`), reading the
    /// rest of its stdout.
    pub(crate) fn wait(&mut self, timeout: Duration) -> ExitStatus {
        let deadline = Instant::now() + timeout;
        let status = loop {
            if let Some(s) = self.exited {
                break s;
            }
            if let Some(s) = self.child.try_wait().expect("wait for a child") {
                break s;
            }
            assert!(
                Instant::now() < deadline,
                "{} still runs after {timeout:?}\nstdout:\n{}\nstderr:\n{}",
                self.label,
                self.seen.join("\n"),
                self.stderr()
            );
            while let Ok(line) = self.lines.try_recv() {
                self.seen.push(line);
            }
            std::thread::sleep(Duration::from_millis(20));
        };
        self.exited = Some(status);
        // The reader ends at EOF; whatever it still holds arrives now.
        while let Ok(line) = self.lines.recv_timeout(Duration::from_secs(2)) {
            self.seen.push(line);
        }
        status
    }
}

impl Drop for Proc {
    fn drop(&mut self) {
        if self.exited.is_none() {
            let _ = self.child.kill();
            let _ = self.child.wait();
        }
    }
}

/// A delaying TCP forwarder running inside a namespace; stops on drop.
pub(crate) struct DelayProxy {
    stop: Option<tokio::sync::oneshot::Sender<()>>,
    thread: Option<JoinHandle<()>>,
    /// Bytes forwarded (both directions).
    forwarded: Arc<AtomicU64>,
    /// Connections accepted.
    accepted: Arc<AtomicU64>,
}

impl DelayProxy {
    fn start(ns: &str, routes: Vec<(u16, SocketAddr)>, delay: Duration) -> Self {
        let path = format!("/run/netns/{ns}");
        let (ready_tx, ready) = mpsc::channel::<Result<(), String>>();
        let (stop, stop_rx) = tokio::sync::oneshot::channel::<()>();
        let forwarded = Arc::new(AtomicU64::new(0));
        let accepted = Arc::new(AtomicU64::new(0));
        let (fwd, acc) = (forwarded.clone(), accepted.clone());
        let thread = std::thread::spawn(move || {
            // This thread, and only it, moves into the router's namespace:
            // the sockets it opens live there.
            let entered = File::open(&path)
                .map_err(|e| format!("open {path}: {e}"))
                .and_then(|f| {
                    rustix::thread::move_into_link_name_space(
                        f.as_fd(),
                        Some(rustix::thread::LinkNameSpaceType::Network),
                    )
                    .map_err(|e| format!("setns {path}: {e}"))
                });
            let rt = entered.and_then(|()| {
                tokio::runtime::Builder::new_current_thread()
                    .enable_all()
                    .build()
                    .map_err(|e| format!("proxy runtime: {e}"))
            });
            let rt = match rt {
                Ok(rt) => rt,
                Err(e) => {
                    let _ = ready_tx.send(Err(e));
                    return;
                }
            };
            rt.block_on(async move {
                let mut listeners = Vec::new();
                for (port, to) in routes {
                    match tokio::net::TcpListener::bind(("0.0.0.0", port)).await {
                        Ok(l) => listeners.push((l, to)),
                        Err(e) => {
                            let _ = ready_tx.send(Err(format!("proxy bind :{port}: {e}")));
                            return;
                        }
                    }
                }
                for (l, to) in listeners {
                    tokio::spawn(accept_loop(l, to, delay, fwd.clone(), acc.clone()));
                }
                let _ = ready_tx.send(Ok(()));
                let _ = stop_rx.await;
            });
        });
        match ready.recv_timeout(Duration::from_secs(10)) {
            Ok(Ok(())) => {}
            Ok(Err(e)) => panic!("delay proxy in {ns}: {e}"),
            Err(e) => panic!("delay proxy in {ns} did not start: {e}"),
        }
        Self {
            stop: Some(stop),
            thread: Some(thread),
            forwarded,
            accepted,
        }
    }

    pub(crate) fn forwarded(&self) -> u64 {
        self.forwarded.load(Ordering::Relaxed)
    }

    pub(crate) fn accepted(&self) -> u64 {
        self.accepted.load(Ordering::Relaxed)
    }
}

impl Drop for DelayProxy {
    fn drop(&mut self) {
        if let Some(s) = self.stop.take() {
            let _ = s.send(());
        }
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

async fn accept_loop(
    l: tokio::net::TcpListener,
    to: SocketAddr,
    delay: Duration,
    forwarded: Arc<AtomicU64>,
    accepted: Arc<AtomicU64>,
) {
    while let Ok((inbound, _)) = l.accept().await {
        accepted.fetch_add(1, Ordering::Relaxed);
        let fwd = forwarded.clone();
        tokio::spawn(async move {
            let connect = tokio::net::TcpStream::connect(to);
            let Ok(Ok(outbound)) = tokio::time::timeout(Duration::from_secs(5), connect).await
            else {
                return; // dropping `inbound` closes it: the client sees the failure
            };
            let _ = inbound.set_nodelay(true);
            let _ = outbound.set_nodelay(true);
            let (ri, wi) = inbound.into_split();
            let (ro, wo) = outbound.into_split();
            tokio::join!(pump(ri, wo, delay, fwd.clone()), pump(ro, wi, delay, fwd));
        });
    }
}

/// Copies `r` to `w`, each chunk `delay` after it was read (reads go on
/// meanwhile, so the delay adds latency, not a throughput cap).
async fn pump(
    mut r: tokio::net::tcp::OwnedReadHalf,
    mut w: tokio::net::tcp::OwnedWriteHalf,
    delay: Duration,
    forwarded: Arc<AtomicU64>,
) {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let (tx, mut rx) = tokio::sync::mpsc::channel::<(tokio::time::Instant, Vec<u8>)>(1024);
    let reader = async move {
        let mut buf = vec![0u8; 64 << 10];
        while let Ok(n @ 1..) = r.read(&mut buf).await {
            let due = tokio::time::Instant::now() + delay;
            if tx.send((due, buf[..n].to_vec())).await.is_err() {
                break;
            }
        }
    };
    let writer = async move {
        while let Some((due, bytes)) = rx.recv().await {
            tokio::time::sleep_until(due).await;
            if w.write_all(&bytes).await.is_err() {
                return;
            }
            forwarded.fetch_add(bytes.len() as u64, Ordering::Relaxed);
        }
        let _ = w.shutdown().await;
    };
    tokio::join!(reader, writer);
}
