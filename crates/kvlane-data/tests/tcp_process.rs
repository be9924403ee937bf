//! The tcp backend across processes: the target runs as
//! `examples/tcp_target.rs` in a child process.

/// The target in another process (`examples/tcp_target.rs`).
mod process {
    use kvlane_data::conformance::{collect, one_span};
    use kvlane_data::{
        Access, Backend, Completion, DataError, Endpoint, Op, Region, RemoteRegion, SubmitError,
        TcpBackend, TcpConfig, Transfer,
    };
    use std::io::{BufRead, BufReader, Write};
    use std::path::PathBuf;
    use std::process::{Child, ChildStdin, ChildStdout, Command, Stdio};
    use std::time::{Duration, Instant};

    fn target_binary() -> PathBuf {
        // tests run from target/<profile>/deps; examples live next door.
        let exe = std::env::current_exe().expect("test binary path");
        let dir = exe.parent().and_then(|d| d.parent()).expect("target dir");
        let bin = dir
            .join("examples")
            .join(format!("tcp_target{}", std::env::consts::EXE_SUFFIX));
        if !bin.exists() {
            // `cargo test` builds examples; a filtered run may not have.
            let status = Command::new(option_env!("CARGO").unwrap_or("cargo"))
                .args(["build", "-p", "kvlane-data", "--example", "tcp_target"])
                .current_dir(env!("CARGO_MANIFEST_DIR"))
                .status()
                .expect("run cargo build");
            assert!(status.success(), "building examples/tcp_target failed");
        }
        bin
    }

    struct Target {
        child: Child,
        stdin: ChildStdin,
        stdout: BufReader<ChildStdout>,
        endpoint: Endpoint,
        region: RemoteRegion,
    }

    impl Drop for Target {
        fn drop(&mut self) {
            let _ = self.child.kill();
            let _ = self.child.wait();
        }
    }

    fn unhex(s: &str) -> Vec<u8> {
        (0..s.len() / 2)
            .map(|i| u8::from_str_radix(&s[2 * i..2 * i + 2], 16).expect("hex"))
            .collect()
    }

    fn spawn_target(len: u64) -> Target {
        let mut child = Command::new(target_binary())
            .args(["--len", &len.to_string()])
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .spawn()
            .expect("spawn tcp_target");
        let stdin = child.stdin.take().expect("stdin");
        let mut stdout = BufReader::new(child.stdout.take().expect("stdout"));
        let mut line = String::new();
        stdout.read_line(&mut line).expect("endpoint line");
        let (endpoint, regions): (Endpoint, Vec<RemoteRegion>) =
            rmp_serde::from_slice(&unhex(line.trim())).expect("decode endpoint");
        Target {
            child,
            stdin,
            stdout,
            endpoint,
            region: regions[0],
        }
    }

    impl Target {
        fn command(&mut self, cmd: &str) -> String {
            writeln!(self.stdin, "{cmd}").expect("write command");
            let mut line = String::new();
            self.stdout.read_line(&mut line).expect("read answer");
            line.trim().to_owned()
        }
    }

    fn fnv1a(bytes: &[u8]) -> u64 {
        bytes.iter().fold(0xcbf2_9ce4_8422_2325, |h, &b| {
            (h ^ u64::from(b)).wrapping_mul(0x0000_0100_0000_01b3)
        })
    }

    fn initiator(t: &Target, local_len: u64) -> (TcpBackend, kvlane_data::PeerId, Region) {
        let mut b = TcpBackend::new(TcpConfig::default()).unwrap();
        let mut data = vec![0u8; local_len as usize];
        kvlane_data::conformance::Rng::new(99).fill(&mut data);
        let local = Region::from_vec(data, Access::ALL).unwrap();
        b.register(&local).unwrap();
        let (peer, _) = b.prepare_peer().unwrap();
        b.connect_peer(peer, &t.endpoint, &[t.region]).unwrap();
        (b, peer, local)
    }

    fn xfer(
        peer: kvlane_data::PeerId,
        op: Op,
        local: &Region,
        lo: u64,
        t: &Target,
        ro: u64,
        len: u64,
    ) -> Transfer {
        one_span(peer, op, (local, lo), (t.region.key, ro), len)
    }

    #[test]
    fn two_process_write_then_read_back() {
        const LEN: u64 = 8 << 20;
        let mut t = spawn_target(LEN);
        let (mut b, peer, local) = initiator(&t, LEN);
        // WRITE the whole region in pieces of assorted sizes.
        let mut ids = Vec::new();
        let mut off = 0;
        let mut size = 1u64;
        while off < LEN {
            let len = size.min(LEN - off);
            let x = xfer(peer, Op::Write, &local, off, &t, off, len);
            ids.push(x.id);
            b.submit(x).expect("submit WRITE");
            off += len;
            size = if size >= 2 << 20 { 3 } else { size * 5 + 1 };
        }
        let last = xfer(peer, Op::Write, &local, 0, &t, 0, 0).with_notify(&b"written"[..]);
        ids.push(last.id);
        b.submit(last).unwrap();
        for (id, (r, _)) in collect(&mut b, &ids, Duration::from_secs(60)) {
            assert!(r.is_ok(), "{id}: {r:?}");
        }
        let expect = local.to_vec().unwrap();
        assert_eq!(
            t.command("sum"),
            format!("{:016x}", fnv1a(&expect)),
            "target memory differs"
        );
        assert_eq!(t.command("notes"), "1");
        // READ it back into a second region, in 1 MiB + 1 pieces.
        let back = Region::alloc(LEN as usize, Access::ALL).unwrap();
        b.register(&back).unwrap();
        let mut ids = Vec::new();
        let mut off = 0;
        while off < LEN {
            let len = (1 << 20 | 1).min(LEN - off);
            let x = xfer(peer, Op::Read, &back, off, &t, off, len);
            ids.push(x.id);
            b.submit(x).expect("submit READ");
            off += len;
        }
        for (id, (r, _)) in collect(&mut b, &ids, Duration::from_secs(60)) {
            assert!(r.is_ok(), "{id}: {r:?}");
        }
        assert!(
            back.to_vec().unwrap() == expect,
            "READ back differs from what was written"
        );
    }

    #[test]
    fn killed_target_process_fails_in_flight_with_peer_lost() {
        const LEN: u64 = 64 << 20;
        const BLOCK: u64 = 1 << 20;
        let mut t = spawn_target(LEN);
        let (mut b, peer, local) = initiator(&t, LEN);
        let deadline = Instant::now() + Duration::from_secs(60);
        let start = Instant::now();
        let mut done: Vec<Completion> = Vec::new();
        let mut ok_before_kill = 0;
        let mut i = 0u64;
        // Keep 64 MiB in flight for a while, then kill the target.
        while start.elapsed() < Duration::from_millis(300) {
            while b.in_flight() < 64 {
                let off = (i % (LEN / BLOCK)) * BLOCK;
                let op = if i.is_multiple_of(2) {
                    Op::Write
                } else {
                    Op::Read
                };
                let x = xfer(peer, op, &local, off, &t, off, BLOCK).with_deadline(deadline);
                match b.submit(x) {
                    Ok(()) => i += 1,
                    Err(SubmitError::QueueFull { .. }) => break,
                    Err(e) => panic!("submit: {e}"),
                }
            }
            b.poll(&mut done);
            for c in done.drain(..) {
                c.result.expect("transfer failed before the kill");
                ok_before_kill += 1;
            }
            std::thread::sleep(Duration::from_millis(1));
        }
        assert!(ok_before_kill > 0, "no transfer finished before the kill");
        // Stopped first, so that some transfers are surely in flight when
        // it dies. Without the stop, one clean-clone CI run (2 cores) saw
        // no transfer fail: every transfer counted in flight had already
        // been answered by the kill (most likely the test thread was
        // descheduled for the ~30 ms the target needs for 64 MiB). A
        // stopped target answers nothing, so these two can only end by
        // the kill.
        let stopped = Command::new("kill")
            .args(["-STOP", &t.child.id().to_string()])
            .status()
            .expect("run kill -STOP");
        assert!(stopped.success(), "kill -STOP the target failed");
        let mut doomed = Vec::new();
        for (op, off) in [(Op::Write, 0), (Op::Read, BLOCK)] {
            let x = xfer(peer, op, &local, off, &t, off, BLOCK).with_deadline(deadline);
            doomed.push(x.id);
            // 66 in flight at most: far from the queue's depth.
            b.submit(x).expect("submit to the stopped target");
        }
        t.child.kill().expect("kill target");
        let killed = Instant::now();
        let end = killed + Duration::from_secs(10);
        let mut lost = Vec::new();
        while b.in_flight() > 0 {
            b.poll(&mut done);
            for c in done.drain(..) {
                match c.result {
                    Ok(()) => {}
                    Err(DataError::PeerLost { .. }) => lost.push(c.id),
                    Err(e) => panic!("{}: expected PeerLost, got {e}", c.id),
                }
            }
            assert!(
                Instant::now() < end,
                "{} transfers still in flight",
                b.in_flight()
            );
            std::thread::sleep(Duration::from_millis(1));
        }
        for id in &doomed {
            assert!(
                lost.contains(id),
                "{id}, posted to the stopped target, did not fail with PeerLost when it was killed"
            );
        }
        let took = killed.elapsed();
        assert!(
            took < Duration::from_secs(5),
            "PeerLost after {took:?}; deadline was 60 s"
        );
        // The peer stays failed.
        let x = xfer(peer, Op::Write, &local, 0, &t, 0, 8);
        let id = x.id;
        b.submit(x).unwrap();
        let r = collect(&mut b, &[id], Duration::from_secs(5));
        assert!(r[&id].0.as_ref().is_err_and(DataError::is_peer_lost));
    }
}
