//! The conformance suite on the shm backend (both backends in this
//! process: each still maps the other's memory through passed memfds, as
//! two processes do), and the hostile-peer cases.
#![cfg(target_os = "linux")]

kvlane_data::conformance_tests!(kvlane_data::conformance::ShmFixture);

mod hostile {
    use kvlane_data::conformance::{run_one, setup, ShmFixture};
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
        let mut s = setup(&ShmFixture, 8192, 4096, Access::ALL, 7);
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
        let mut s = setup(&ShmFixture, 4096, 4096, Access::REMOTE_READ, 3);
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
