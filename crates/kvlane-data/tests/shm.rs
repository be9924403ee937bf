//! The conformance suite on the shm backend (both backends in this
//! process: each still maps the other's memory through passed memfds, as
//! two processes do), again with cross-memory attach serving memory that
//! is not a file, the hostile-peer cases, and cross-memory attach across
//! two processes (the target is this test binary run again).
#![cfg(target_os = "linux")]

kvlane_data::conformance_tests!(kvlane_data::conformance::ShmFixture);

/// The suite with every region `Region::alloc` (not a memory file), served
/// by cross-memory attach.
mod attach {
    kvlane_data::conformance_tests!(kvlane_data::conformance::ShmAttachFixture);
}

mod hostile {
    use kvlane_data::conformance::{run_one, setup, Fixture, ShmAttachFixture, ShmFixture};
    use kvlane_data::{
        connect_pair, Access, Backend, DataError, Descriptor, Endpoint, Op, Region,
        RemoteDescriptor, RemoteKey, ShmBackend, ShmConfig, ShmEndpoint, Transfer, Transport,
    };
    use std::time::{Duration, Instant};

    fn span(region: &Region, key: RemoteKey, lo: u64, ro: u64, len: u64) -> Transfer {
        Transfer::new(
            kvlane_data::PeerId(1),
            Op::Write,
            vec![Descriptor {
                region: region.id(),
                offset: lo,
                len,
            }],
            vec![RemoteDescriptor {
                key,
                offset: ro,
                len,
            }],
        )
    }

    /// What a refused transfer's error must match.
    type Expect = fn(&DataError) -> bool;

    #[test]
    fn out_of_region_offsets_and_wrong_keys_are_typed_errors_and_move_nothing() {
        out_of_region_offsets_and_wrong_keys(&ShmFixture);
    }

    #[test]
    fn out_of_region_offsets_and_wrong_keys_over_cross_memory_attach() {
        out_of_region_offsets_and_wrong_keys(&ShmAttachFixture);
    }

    fn out_of_region_offsets_and_wrong_keys<F: Fixture<Backend = ShmBackend>>(f: &F) {
        let mut s = setup(f, 8192, 4096, Access::ALL, 7);
        let before = s.remote.to_vec().unwrap();
        let key = s.remote_ad.key;
        let cases: Vec<(Transfer, Expect)> = vec![
            // Past the end, straddling the end, an offset whose end wraps.
            (span(&s.local, key, 0, 4096, 1), |e| {
                matches!(e, DataError::RemoteOutOfBounds { offset: 4096, .. })
            }),
            (span(&s.local, key, 0, 4000, 200), |e| {
                matches!(e, DataError::RemoteOutOfBounds { .. })
            }),
            (span(&s.local, key, 0, u64::MAX - 10, 20), |e| {
                matches!(e, DataError::RemoteOutOfBounds { .. })
            }),
            // A key the target never granted.
            (span(&s.local, RemoteKey(key.0 ^ 0x5a5a), 0, 0, 16), |e| {
                matches!(e, DataError::UnknownKey { .. })
            }),
        ];
        for (i, (mut t, want)) in cases.into_iter().enumerate() {
            t.peer = s.peer;
            let err = run_one(&mut s.init, &mut s.target, t).unwrap_err();
            assert!(want(&err), "case {i}: {err}");
            assert!(err.is_refused(), "case {i}: {err}");
        }
        // A READ that writes past the local region is refused too.
        let mut t = span(&s.local, key, 8190, 0, 16);
        t.op = Op::Read;
        t.peer = s.peer;
        let err = run_one(&mut s.init, &mut s.target, t).unwrap_err();
        assert!(matches!(err, DataError::OutOfBounds { .. }), "{err}");
        assert_eq!(s.remote.to_vec().unwrap(), before, "target memory changed");
    }

    #[test]
    fn memory_the_engine_allocated_cannot_be_served_but_works_locally() {
        let mut target = ShmBackend::new(ShmConfig::default()).unwrap();
        let mut init = ShmBackend::new(ShmConfig::default()).unwrap();
        // Served memory must be shareable: a typed refusal that says what
        // to do.
        let plain = Region::alloc(4096, Access::REMOTE_WRITE).unwrap();
        let err = target.register(&plain).unwrap_err();
        assert!(
            matches!(err, DataError::Unsupported { backend: "shm", .. }),
            "{err}"
        );
        assert!(err.to_string().contains("alloc_shared"), "{err}");
        assert!(
            err.to_string().contains("cross_memory_attach"),
            "the refusal names the opt-in: {err}"
        );
        // As the local side of a transfer, any host memory works (here a
        // Vec the "engine" owns).
        let engine = Region::from_vec(vec![9u8; 4096], Access::LOCAL_WRITE).unwrap();
        let dst = Region::alloc_shared(4096, Access::REMOTE_WRITE).unwrap();
        let local_ad = init.register(&engine).unwrap();
        let dst_ad = target.register(&dst).unwrap();
        let (peer, _) = connect_pair(&mut init, &[local_ad], &mut target, &[dst_ad]).unwrap();
        let mut t = span(&engine, dst_ad.key, 0, 0, 4096);
        t.peer = peer;
        run_one(&mut init, &mut target, t).unwrap();
        assert_eq!(dst.to_vec().unwrap(), vec![9u8; 4096]);
    }

    #[test]
    fn read_only_regions_refuse_writes() {
        read_only_refuses_writes(&ShmFixture);
    }

    #[test]
    fn read_only_regions_refuse_writes_over_cross_memory_attach() {
        read_only_refuses_writes(&ShmAttachFixture);
    }

    fn read_only_refuses_writes<F: Fixture<Backend = ShmBackend>>(f: &F) {
        let mut s = setup(f, 4096, 4096, Access::REMOTE_READ, 3);
        let before = s.remote.to_vec().unwrap();
        let mut t = span(&s.local, s.remote_ad.key, 0, 0, 64);
        t.peer = s.peer;
        let err = run_one(&mut s.init, &mut s.target, t).unwrap_err();
        assert!(matches!(err, DataError::AccessDenied { .. }), "{err}");
        let mut t = span(&s.local, s.remote_ad.key, 0, 0, 64);
        t.op = Op::Read;
        t.peer = s.peer;
        run_one(&mut s.init, &mut s.target, t).unwrap();
        assert_eq!(s.remote.to_vec().unwrap(), before);
    }

    #[test]
    fn a_wrong_credential_learns_nothing_and_is_counted() {
        let mut init = ShmBackend::new(ShmConfig::default()).unwrap();
        let mut target = ShmBackend::new(ShmConfig::default()).unwrap();
        let dst = Region::alloc_shared(4096, Access::ALL).unwrap();
        target.register(&dst).unwrap();
        let (_, ep) = target.prepare_peer().unwrap();
        let mut forged = ShmEndpoint::from_endpoint(&ep).unwrap();
        forged.token[0] ^= 1;
        let (peer, _) = init.prepare_peer().unwrap();
        let err = init
            .connect_peer(peer, &forged.to_endpoint(), &[])
            .unwrap_err();
        assert!(
            matches!(err, DataError::PeerLost { .. } | DataError::Io { .. }),
            "{err}"
        );
        let end = Instant::now() + Duration::from_secs(10);
        while target.refused() == 0 {
            assert!(Instant::now() < end, "refusal not counted");
            std::thread::sleep(Duration::from_millis(5));
        }
    }

    #[test]
    fn an_endpoint_from_another_host_is_refused_naming_both_boot_ids() {
        let mut init = ShmBackend::new(ShmConfig::default()).unwrap();
        let mut target = ShmBackend::new(ShmConfig::default()).unwrap();
        let (_, ep) = target.prepare_peer().unwrap();
        let mut other = ShmEndpoint::from_endpoint(&ep).unwrap();
        other.boot_id = "00000000-0000-0000-0000-000000000000".into();
        let (peer, _) = init.prepare_peer().unwrap();
        let err = init
            .connect_peer(peer, &other.to_endpoint(), &[])
            .unwrap_err();
        let msg = err.to_string();
        assert!(
            matches!(err, DataError::BadEndpoint { backend: "shm", .. }),
            "{msg}"
        );
        assert!(
            msg.contains("00000000-0000") && msg.contains("another host"),
            "{msg}"
        );
        // Garbage is a typed error too, never a panic.
        let junk = Endpoint {
            backend: kvlane_data::BackendKind::Shm,
            data: vec![0xc1, 2, 3],
        };
        assert!(matches!(
            init.connect_peer(peer, &junk, &[]),
            Err(DataError::BadEndpoint { .. })
        ));
    }

    #[test]
    fn a_dropped_target_fails_transfers_with_peer_lost() {
        let mut s = setup(&ShmFixture, 4096, 4096, Access::ALL, 5);
        let mut t = span(&s.local, s.remote_ad.key, 0, 0, 64);
        t.peer = s.peer;
        run_one(&mut s.init, &mut s.target, t).unwrap();
        // The target's process "ends": its sockets close.
        let other = ShmBackend::new(ShmConfig::default()).unwrap();
        drop(std::mem::replace(&mut s.target, other));
        let mut t = span(&s.local, s.remote_ad.key, 0, 0, 64);
        t.peer = s.peer;
        let err = run_one(&mut s.init, &mut s.target, t).unwrap_err();
        assert!(err.is_peer_lost(), "{err}");
    }

    #[test]
    fn deregistered_regions_are_revoked_and_later_ones_granted() {
        let mut s = setup(&ShmFixture, 4096, 4096, Access::ALL, 9);
        // Registered after the peer connected: granted over the socket.
        let late = Region::alloc_shared(4096, Access::ALL).unwrap();
        let late_ad = s.target.register(&late).unwrap();
        let end = Instant::now() + Duration::from_secs(10);
        loop {
            let mut t = span(&s.local, late_ad.key, 0, 100, 8);
            t.peer = s.peer;
            match run_one(&mut s.init, &mut s.target, t) {
                Ok(()) => break,
                Err(DataError::UnknownKey { .. }) if Instant::now() < end => {
                    std::thread::sleep(Duration::from_millis(2))
                }
                Err(e) => panic!("late region: {e}"),
            }
        }
        assert_eq!(
            late.to_vec().unwrap()[100..108],
            s.local.to_vec().unwrap()[..8]
        );
        s.target.deregister(s.remote.id()).unwrap();
        loop {
            let mut t = span(&s.local, s.remote_ad.key, 0, 0, 8);
            t.peer = s.peer;
            match run_one(&mut s.init, &mut s.target, t) {
                Err(DataError::UnknownKey { .. }) => break,
                Ok(()) if Instant::now() < end => std::thread::sleep(Duration::from_millis(2)),
                other => panic!("revoked region: {other:?}"),
            }
        }
    }

    /// `submit_batch_now` finishes a batch's copies inside the call, each
    /// checked as a queued one is: good ones `Done(Ok)` with their bytes
    /// moved, a wrong key and an offset past the region `Done` with their
    /// typed errors and nothing moved, a notification `Queued` (its answer
    /// is the poll's). `poll` reports only the queued one; once the target
    /// is gone, a submission is `Done` with `PeerLost`.
    #[test]
    fn a_batch_is_finished_inside_its_submission_with_the_same_checks() {
        use kvlane_data::Submitted;
        let mut s = setup(&ShmFixture, 8192, 8192, Access::ALL, 11);
        let before = s.remote.to_vec().unwrap();
        let t = |lo, key, ro, len| {
            let mut t = span(&s.local, key, lo, ro, len);
            t.peer = s.peer;
            t
        };
        let key = s.remote_ad.key;
        let batch = vec![
            t(0, key, 0, 1024),
            t(0, RemoteKey(key.0 ^ 0x5a5a), 1024, 64),
            t(0, key, 8192 - 16, 32),
            t(1024, key, 1024, 1024).with_notify(&b"landed"[..]),
            t(2048, key, 2048, 1024),
        ];
        let ids: Vec<_> = batch.iter().map(|t| t.id).collect();
        let mut results = Vec::new();
        let due = s.init.submit_batch_now(batch, Instant::now(), &mut results);
        assert!(due, "a notification awaits its answer: a poll is due");
        assert_eq!(results.len(), 5);
        let outcome = |i: usize| match &results[i] {
            Ok(Submitted::Done(r)) => Some(r.as_ref().map_err(|e| e.to_string())),
            Ok(Submitted::Queued) => None,
            Err(e) => panic!("transfer {i} refused: {e}"),
        };
        assert_eq!(outcome(0), Some(Ok(&())));
        assert_eq!(outcome(4), Some(Ok(&())));
        assert!(matches!(
            &results[1],
            Ok(Submitted::Done(Err(DataError::UnknownKey { .. })))
        ));
        assert!(matches!(
            &results[2],
            Ok(Submitted::Done(Err(DataError::RemoteOutOfBounds { .. })))
        ));
        assert_eq!(outcome(3), None);
        let (local, remote) = (s.local.to_vec().unwrap(), s.remote.to_vec().unwrap());
        assert_eq!(remote[..3072], local[..3072]);
        // Nothing past the region's end, nor after the good spans, moved.
        assert_eq!(remote[3072..], before[3072..]);
        // The poll reports the notified one only, once the target answered.
        let end = Instant::now() + Duration::from_secs(10);
        let mut done = Vec::new();
        while done.is_empty() {
            s.init.poll(&mut done);
            s.target.poll(&mut Vec::new());
            assert!(
                Instant::now() < end,
                "the notified transfer never completed"
            );
            std::thread::yield_now();
        }
        assert_eq!(done.len(), 1);
        assert_eq!(done[0].id, ids[3]);
        assert!(done[0].result.is_ok(), "{:?}", done[0].result);
        let mut notes = Vec::new();
        s.target.poll_notifications(&mut notes);
        assert_eq!(notes.len(), 1);
        assert_eq!(s.init.in_flight(), 0);
        // The target's process "ends": the next submission finds out.
        let other = ShmBackend::new(ShmConfig::default()).unwrap();
        drop(std::mem::replace(&mut s.target, other));
        match s.init.submit_now(t(0, key, 0, 64), Instant::now()) {
            Ok(Submitted::Done(Err(e))) => assert!(e.is_peer_lost(), "{e}"),
            other => panic!("a submission to a gone target: {other:?}"),
        }
    }

    /// Through a `Transport`: handles of transfers finished inside
    /// `submit_batch` come back resolved, each `on_done` already run; a
    /// second use of an id in the batch is refused in its place.
    #[test]
    fn a_transport_batch_over_shm_comes_back_resolved() {
        use std::sync::atomic::{AtomicUsize, Ordering};
        use std::sync::Arc;
        let p = transport_pair(0x3c);
        let (transport, src, dst, peer, key) = (&p.transport, &p.src, &p.dst, p.peer, p.key);
        let calls = Arc::new(AtomicUsize::new(0));
        let mut batch: Vec<(Transfer, Option<kvlane_data::Then>)> = (0..16u64)
            .map(|i| {
                let mut t = span(src, key, i * 4096, i * 4096, 4096);
                t.peer = peer;
                let c = calls.clone();
                let then = kvlane_data::Then::Call(Box::new(move |r| {
                    assert!(r.is_ok(), "{r:?}");
                    c.fetch_add(1, Ordering::AcqRel);
                }));
                (t, Some(then))
            })
            .collect();
        let again = batch[5].0.clone();
        batch.push((again, None));
        let handles = transport.submit_batch(batch);
        assert_eq!(calls.load(Ordering::Acquire), 16);
        assert_eq!(transport.in_flight(), 0);
        for (i, h) in handles.into_iter().enumerate() {
            match h {
                Ok(mut h) if i < 16 => {
                    assert!(h.is_done(), "transfer {i} was not finished in the call");
                    h.try_result().unwrap().unwrap();
                    assert!(!h.is_done(), "a result is taken once");
                }
                Err(kvlane_data::SubmitError::Rejected(DataError::DuplicateTransfer(_)))
                    if i == 16 => {}
                other => panic!("transfer {i} of the batch: {other:?}"),
            }
        }
        assert!(dst.to_vec().unwrap()[..16 * 4096]
            .iter()
            .all(|&b| b == 0x3c));
    }

    /// A `Transport` over an shm initiator connected to `target`: 1 MiB
    /// of shared memory on each side, the source filled with `byte`.
    struct Pair {
        transport: Transport,
        target: ShmBackend,
        src: Region,
        dst: Region,
        peer: kvlane_data::PeerId,
        key: RemoteKey,
    }

    fn transport_pair(byte: u8) -> Pair {
        let mut init = ShmBackend::new(ShmConfig::default()).unwrap();
        let mut target = ShmBackend::new(ShmConfig::default()).unwrap();
        let src = Region::alloc_shared(1 << 20, Access::ALL).unwrap();
        src.fill(0, 1 << 20, byte).unwrap();
        let dst = Region::alloc_shared(1 << 20, Access::ALL).unwrap();
        let a = init.register(&src).unwrap();
        let b = target.register(&dst).unwrap();
        let (peer, _) = connect_pair(&mut init, &[a], &mut target, &[b]).unwrap();
        Pair {
            transport: Transport::new(init).unwrap(),
            target,
            src,
            dst,
            peer,
            key: b.key,
        }
    }

    #[test]
    fn notifications_through_a_transport_arrive_after_the_data() {
        let Pair {
            transport,
            mut target,
            src,
            dst,
            peer,
            key,
        } = transport_pair(0xab);
        let t = Transfer::new(
            peer,
            Op::Write,
            vec![Descriptor {
                region: src.id(),
                offset: 0,
                len: 1 << 20,
            }],
            vec![RemoteDescriptor {
                key,
                offset: 0,
                len: 1 << 20,
            }],
        )
        .with_notify(&b"done"[..]);
        transport.submit(t).unwrap().wait().unwrap();
        let mut notes = Vec::new();
        target.poll_notifications(&mut notes);
        assert_eq!(notes.len(), 1);
        assert_eq!(&notes[0].payload[..], b"done");
        assert!(notes[0].from.is_some());
        assert!(dst.to_vec().unwrap().iter().all(|&b| b == 0xab));
    }

    /// A transfer over shm is copied and resolved by the thread that
    /// submits it when the backend is free (`Backend::completes_inline`):
    /// no hand-off to the progress thread and back. Counted over 200
    /// transfers, as the progress thread may hold the backend now and then
    /// (then it does the work; the transfer still completes).
    #[test]
    fn shm_transfers_complete_on_the_submitting_thread() {
        use std::sync::{Arc, Mutex};
        let Pair {
            transport,
            src,
            dst,
            peer,
            key,
            target: _target,
        } = transport_pair(0x5a);
        let me = std::thread::current().id();
        let here = Arc::new(Mutex::new(0usize));
        let mut handles = Vec::new();
        for i in 0..200u64 {
            let mut t = span(&src, key, i * 4096, i * 4096, 4096);
            t.peer = peer;
            let here = here.clone();
            let h = transport
                .submit_then(
                    t,
                    Box::new(move |r| {
                        assert!(r.is_ok(), "{r:?}");
                        if std::thread::current().id() == me {
                            *here.lock().unwrap() += 1;
                        }
                    }),
                )
                .unwrap();
            handles.push(h);
        }
        for h in handles {
            h.wait().unwrap();
        }
        assert!(dst.to_vec().unwrap()[..200 * 4096]
            .iter()
            .all(|&b| b == 0x5a));
        let n = *here.lock().unwrap();
        assert!(
            n >= 150,
            "only {n} of 200 transfers completed on the submitting thread"
        );
    }
}

/// Cross-memory attach across two processes: the target is this test
/// binary run again as `process::attach_target` (which does nothing unless
/// `KVLANE_SHM_ATTACH_CHILD` is set), serving memory it allocated itself.
mod process {
    use kvlane_data::conformance::{collect, one_span};
    use kvlane_data::{
        Access, Backend, Completion, DataError, Endpoint, MemoryKind, Op, PeerId, Region,
        RemoteRegion, ShmBackend, ShmConfig, SubmitError, TransferId,
    };
    use std::io::{BufRead, BufReader, Write};
    use std::process::{Child, ChildStdin, Command, Stdio};
    use std::sync::mpsc;
    use std::time::{Duration, Instant};

    const LEN: usize = 8 << 20;
    const BLOCK: u64 = 64 << 10;

    fn pattern(seed: u8) -> Vec<u8> {
        (0..LEN)
            .map(|i| (i as u8).wrapping_mul(31).wrapping_add(seed) ^ ((i >> 8) as u8))
            .collect()
    }

    fn fnv1a(bytes: &[u8]) -> u64 {
        bytes.iter().fold(0xcbf2_9ce4_8422_2325, |h, &b| {
            (h ^ u64::from(b)).wrapping_mul(0x0000_0100_0000_01b3)
        })
    }

    fn hex(bytes: &[u8]) -> String {
        bytes.iter().map(|b| format!("{b:02x}")).collect()
    }

    fn unhex(s: &str) -> Vec<u8> {
        (0..s.len() / 2)
            .map(|i| u8::from_str_radix(&s[2 * i..2 * i + 2], 16).expect("hex"))
            .collect()
    }

    /// An anonymous private mapping the target can unmap under transfers.
    struct Mapped(*mut u8);
    // SAFETY: a plain address; only the target's main thread unmaps it.
    unsafe impl Send for Mapped {}

    /// The target process: a shm backend with cross-memory attach serving
    /// two regions its "engine" allocated: `Region::from_raw` over a `Vec`
    /// (filled with `pattern(1)`) and over an anonymous `mmap` (zeroed).
    /// Prints the hex of `(Endpoint, [RemoteRegion; 2])`, then answers
    /// commands from stdin: `sum0`/`sum1` (FNV-1a of a region), `notes`
    /// (notifications so far), `unmap` (munmaps the second region's
    /// memory, as a hostile or buggy engine would; prints `unmapped`).
    #[test]
    #[ignore = "the target process of the tests in this module; does nothing unless KVLANE_SHM_ATTACH_CHILD is set"]
    fn attach_target() {
        if std::env::var_os("KVLANE_SHM_ATTACH_CHILD").is_none() {
            return;
        }
        let mut b = ShmBackend::new(ShmConfig {
            cross_memory_attach: true,
            ..ShmConfig::default()
        })
        .unwrap();
        let mut vec = pattern(1);
        let ptr = vec.as_mut_ptr();
        // SAFETY: the Vec's buffer, kept alive by the region (keep_alive)
        // and touched by nothing else.
        let from_vec = unsafe {
            Region::from_raw(ptr, LEN, MemoryKind::Host, Access::ALL, Some(Box::new(vec)))
        }
        .unwrap();
        // SAFETY: a fresh anonymous mapping.
        let map = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                LEN,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
                -1,
                0,
            )
        };
        assert_ne!(map, libc::MAP_FAILED);
        let mapped = Mapped(map.cast());
        // SAFETY: valid until the `unmap` command, after which this
        // process never touches it (peers copying get EFAULT: the test).
        let from_mmap =
            unsafe { Region::from_raw(mapped.0, LEN, MemoryKind::Host, Access::ALL, None) }
                .unwrap();
        let ads = vec![
            b.register(&from_vec).unwrap(),
            b.register(&from_mmap).unwrap(),
        ];
        let (_, ep) = b.prepare_peer().unwrap();
        let mut out = std::io::stdout().lock();
        writeln!(
            out,
            "ENDPOINT {}",
            hex(&rmp_serde::to_vec_named(&(ep, ads)).unwrap())
        )
        .unwrap();
        out.flush().unwrap();
        let mut notes = Vec::new();
        for line in std::io::stdin().lock().lines() {
            let line = line.unwrap();
            b.poll_notifications(&mut notes);
            match line.trim() {
                "sum0" => writeln!(out, "SUM {:016x}", fnv1a(&from_vec.to_vec().unwrap())),
                "sum1" => writeln!(out, "SUM {:016x}", fnv1a(&from_mmap.to_vec().unwrap())),
                "notes" => writeln!(out, "NOTES {}", notes.len()),
                "unmap" => {
                    // SAFETY: the mapping made above; this process does not
                    // touch it again (no more sum1).
                    assert_eq!(unsafe { libc::munmap(mapped.0.cast(), LEN) }, 0);
                    writeln!(out, "UNMAPPED")
                }
                other => writeln!(out, "unknown command {other:?}"),
            }
            .unwrap();
            out.flush().unwrap();
        }
    }

    struct Target {
        child: Child,
        stdin: ChildStdin,
        lines: mpsc::Receiver<String>,
        endpoint: Endpoint,
        regions: Vec<RemoteRegion>,
    }

    impl Drop for Target {
        fn drop(&mut self) {
            let _ = self.child.kill();
            let _ = self.child.wait();
        }
    }

    impl Target {
        fn spawn() -> Self {
            let mut child = Command::new(std::env::current_exe().unwrap())
                .args([
                    "--exact",
                    "process::attach_target",
                    "--ignored",
                    "--nocapture",
                ])
                .args(["--test-threads=1"])
                .env("KVLANE_SHM_ATTACH_CHILD", "1")
                .stdin(Stdio::piped())
                .stdout(Stdio::piped())
                .spawn()
                .unwrap();
            let stdin = child.stdin.take().unwrap();
            let out = BufReader::new(child.stdout.take().unwrap());
            let (tx, lines) = mpsc::channel();
            std::thread::spawn(move || {
                for line in out.lines() {
                    let Ok(line) = line else { break };
                    if tx.send(line).is_err() {
                        break;
                    }
                }
            });
            let mut t = Self {
                child,
                stdin,
                lines,
                endpoint: Endpoint {
                    backend: kvlane_data::BackendKind::Shm,
                    data: Vec::new(),
                },
                regions: Vec::new(),
            };
            let blob = unhex(&t.expect("ENDPOINT "));
            (t.endpoint, t.regions) = rmp_serde::from_slice(&blob).expect("decode endpoint");
            t
        }

        /// The rest of the next line that contains `prefix` (the harness
        /// may print its own text before it on the same line).
        fn expect(&self, prefix: &str) -> String {
            let until = Instant::now() + Duration::from_secs(60);
            loop {
                let left = until.saturating_duration_since(Instant::now());
                let line = self
                    .lines
                    .recv_timeout(left)
                    .unwrap_or_else(|e| panic!("the target printed no {prefix:?}: {e}"));
                if let Some((_, rest)) = line.split_once(prefix) {
                    return rest.to_owned();
                }
            }
        }

        fn send(&mut self, cmd: &str) {
            writeln!(self.stdin, "{cmd}").unwrap();
            self.stdin.flush().unwrap();
        }

        fn command(&mut self, cmd: &str, answer: &str) -> String {
            self.send(cmd);
            self.expect(answer)
        }
    }

    /// An initiator with no opt-in of its own (only the target exposes
    /// anything), its 8 MiB local region filled with `pattern(7)`.
    fn initiator(t: &Target) -> (ShmBackend, PeerId, Region) {
        let mut b = ShmBackend::new(ShmConfig::default()).unwrap();
        // Local memory only (no remote rights): any host memory works.
        let local = Region::alloc(LEN, Access::LOCAL_WRITE).unwrap();
        local.write(0, &pattern(7)).unwrap();
        b.register(&local).unwrap();
        let (peer, _) = b.prepare_peer().unwrap();
        b.connect_peer(peer, &t.endpoint, &t.regions).unwrap();
        (b, peer, local)
    }

    /// Waits until every thread of process `pid` is stopped (a signal
    /// reaches a thread running on another CPU a little later: until then
    /// the target may still answer a notification).
    fn wait_stopped(pid: &str) {
        let until = Instant::now() + Duration::from_secs(10);
        let stopped = || {
            std::fs::read_dir(format!("/proc/{pid}/task"))
                .unwrap()
                .all(|task| {
                    let stat = std::fs::read_to_string(task.unwrap().path().join("stat"))
                        .unwrap_or_default();
                    // The state follows the parenthesised command name.
                    stat.rsplit_once(") ")
                        .is_some_and(|(_, rest)| rest.starts_with('T') || rest.starts_with('t'))
                })
        };
        while !stopped() {
            assert!(Instant::now() < until, "the target never stopped");
            std::thread::sleep(Duration::from_millis(5));
        }
    }

    /// Submits `x` and waits for its result.
    fn run(b: &mut ShmBackend, x: kvlane_data::Transfer) -> Result<(), DataError> {
        let id = x.id;
        b.submit(x).unwrap();
        collect(b, &[id], Duration::from_secs(10))
            .remove(&id)
            .unwrap()
            .0
    }

    fn run_all(b: &mut ShmBackend, ids: &[TransferId]) {
        for (id, (r, _)) in collect(b, ids, Duration::from_secs(60)) {
            assert!(r.is_ok(), "{id}: {r:?}");
        }
    }

    #[test]
    fn memory_the_engine_allocated_moves_both_ways_across_processes() {
        let mut t = Target::spawn();
        let (mut b, peer, local) = initiator(&t);
        for (i, region) in t.regions.clone().iter().enumerate() {
            // READ the whole region in blocks: the Vec holds pattern(1),
            // the mapping zeros.
            let back = Region::alloc(LEN, Access::LOCAL_WRITE).unwrap();
            b.register(&back).unwrap();
            let ids: Vec<_> = (0..LEN as u64 / BLOCK)
                .map(|k| {
                    let x = one_span(
                        peer,
                        Op::Read,
                        (&back, k * BLOCK),
                        (region.key, k * BLOCK),
                        BLOCK,
                    );
                    let id = x.id;
                    b.submit(x).unwrap();
                    id
                })
                .collect();
            run_all(&mut b, &ids);
            let want = if i == 0 { pattern(1) } else { vec![0; LEN] };
            assert!(back.to_vec().unwrap() == want, "READ of region {i}");
            // WRITE it all in one transfer, pieces of odd sizes in a
            // second; the notification of the last arrives after the data.
            let x = one_span(
                peer,
                Op::Write,
                (&local, 0),
                (region.key, 0),
                LEN as u64 - 4097,
            );
            let last = one_span(
                peer,
                Op::Write,
                (&local, LEN as u64 - 4097),
                (region.key, LEN as u64 - 4097),
                4097,
            )
            .with_notify(&b"written"[..]);
            let ids = [x.id, last.id];
            b.submit(x).unwrap();
            b.submit(last).unwrap();
            run_all(&mut b, &ids);
            let sum = t.command(&format!("sum{i}"), "SUM ");
            assert_eq!(
                sum,
                format!("{:016x}", fnv1a(&pattern(7))),
                "WRITE of region {i}"
            );
            assert_eq!(t.command("notes", "NOTES "), (i + 1).to_string());
        }
    }

    #[test]
    fn a_target_unmapping_its_memory_under_transfers_gives_typed_errors() {
        let mut t = Target::spawn();
        let (mut b, peer, local) = initiator(&t);
        let (kept, doomed) = (t.regions[0].key, t.regions[1].key);
        let deadline = Instant::now() + Duration::from_secs(60);
        let (mut ok, mut faults, mut after_unmap) = (0u64, 0u64, 0u64);
        let mut unmapped = false;
        let mut sent = false;
        let mut done: Vec<Completion> = Vec::new();
        let mut i = 0u64;
        let mut doomed_ids = std::collections::HashSet::new();
        while after_unmap < 64 {
            assert!(Instant::now() < deadline, "stuck: {ok} ok, {faults} faults");
            // Transfers to both regions, READ and WRITE, 32 in flight.
            while b.in_flight() < 32 {
                let key = if i % 4 == 3 { kept } else { doomed };
                let op = if i.is_multiple_of(2) {
                    Op::Write
                } else {
                    Op::Read
                };
                let off = (i * BLOCK) % LEN as u64;
                let x = one_span(peer, op, (&local, off), (key, off), BLOCK);
                if key == doomed {
                    doomed_ids.insert(x.id);
                }
                match b.submit(x) {
                    Ok(()) => i += 1,
                    Err(SubmitError::QueueFull { .. }) => break,
                    Err(e) => panic!("submit: {e}"),
                }
            }
            b.poll(&mut done);
            for c in done.drain(..) {
                match c.result {
                    Ok(()) => ok += 1,
                    Err(DataError::RemoteMemoryFault {
                        backend: "shm",
                        key,
                        ref reason,
                        ..
                    }) if key == doomed && doomed_ids.contains(&c.id) => {
                        assert!(reason.contains("EFAULT"), "{reason}");
                        faults += 1;
                    }
                    Err(e) => panic!("{}: unexpected error {e}", c.id),
                }
                if unmapped {
                    after_unmap += 1;
                }
            }
            if ok > 200 && !sent {
                // While transfers run.
                t.send("unmap");
                sent = true;
            }
            if sent && !unmapped {
                unmapped = t.lines.try_recv().is_ok_and(|l| l.contains("UNMAPPED"));
            }
        }
        assert!(faults > 0, "no transfer to the unmapped region failed");
        // The other region still works, and a fault is a typed refusal.
        run(
            &mut b,
            one_span(peer, Op::Read, (&local, 0), (kept, 0), BLOCK),
        )
        .unwrap();
        let err = run(
            &mut b,
            one_span(peer, Op::Write, (&local, 0), (doomed, 4096), 16),
        )
        .unwrap_err();
        assert!(err.is_refused(), "{err}");
        let msg = err.to_string();
        assert!(
            msg.contains("offset 4096") && msg.contains("unmapped"),
            "{msg}"
        );
    }

    #[test]
    fn a_killed_target_fails_in_flight_transfers_with_peer_lost() {
        let t = Target::spawn();
        let (mut b, peer, local) = initiator(&t);
        let key = t.regions[1].key;
        run(
            &mut b,
            one_span(peer, Op::Write, (&local, 0), (key, 0), BLOCK),
        )
        .unwrap();
        // A stopped target answers no notification: these WRITEs are
        // copied (its memory is still there) and stay in flight.
        let pid = t.child.id().to_string();
        assert!(Command::new("kill")
            .args(["-STOP", &pid])
            .status()
            .unwrap()
            .success());
        wait_stopped(&pid);
        let mut doomed = Vec::new();
        for k in 0..8u64 {
            let x = one_span(
                peer,
                Op::Write,
                (&local, k * BLOCK),
                (key, k * BLOCK),
                BLOCK,
            )
            .with_notify(&b"n"[..]);
            doomed.push(x.id);
            b.submit(x).unwrap();
        }
        let mut done = Vec::new();
        let settle = Instant::now() + Duration::from_millis(200);
        while Instant::now() < settle {
            b.poll(&mut done);
            std::thread::sleep(Duration::from_millis(5));
        }
        assert!(
            done.is_empty(),
            "completed without an answer: {:?}",
            done.len()
        );
        assert!(Command::new("kill")
            .args(["-KILL", &pid])
            .status()
            .unwrap()
            .success());
        for (id, (r, _)) in collect(&mut b, &doomed, Duration::from_secs(10)) {
            assert!(
                r.as_ref().is_err_and(DataError::is_peer_lost),
                "{id}: {r:?}"
            );
        }
        // The peer stays failed.
        let r = run(
            &mut b,
            one_span(peer, Op::Read, (&local, 0), (key, 0), BLOCK),
        );
        assert!(r.as_ref().is_err_and(DataError::is_peer_lost), "{r:?}");
    }
}
