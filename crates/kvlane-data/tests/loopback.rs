//! The conformance suite on the loopback backend.

kvlane_data::conformance_tests!(kvlane_data::conformance::LoopbackFixture(|| None));

mod transport {
    use kvlane_data::{
        connect_pair, Access, Backend, DataError, Descriptor, LoopbackBackend, Op, Region,
        RemoteDescriptor, Transfer, Transport,
    };
    use std::time::{Duration, Instant};

    fn pair() -> (
        Transport,
        LoopbackBackend,
        Region,
        Region,
        kvlane_data::RemoteRegion,
        kvlane_data::PeerId,
    ) {
        let mut init = LoopbackBackend::default();
        let mut target = LoopbackBackend::default();
        let src =
            Region::from_vec((0..=255u8).cycle().take(1 << 16).collect(), Access::ALL).unwrap();
        let dst = Region::alloc(1 << 16, Access::ALL).unwrap();
        let a = init.register(&src).unwrap();
        let b = target.register(&dst).unwrap();
        let (peer, _) = connect_pair(&mut init, &[a], &mut target, &[b]).unwrap();
        (Transport::new(init).unwrap(), target, src, dst, b, peer)
    }

    fn write(
        peer: kvlane_data::PeerId,
        src: &Region,
        key: kvlane_data::RemoteKey,
        off: u64,
    ) -> Transfer {
        Transfer::new(
            peer,
            Op::Write,
            vec![Descriptor {
                region: src.id(),
                offset: off,
                len: 1024,
            }],
            vec![RemoteDescriptor {
                key,
                offset: off,
                len: 1024,
            }],
        )
    }

    #[test]
    fn handle_can_be_waited_polled_and_awaited() {
        let (t, _target, src, dst, ad, peer) = pair();
        // Blocking wait.
        t.submit(write(peer, &src, ad.key, 0))
            .unwrap()
            .wait()
            .unwrap();
        // Polling.
        let mut h = t.submit(write(peer, &src, ad.key, 1024)).unwrap();
        let end = Instant::now() + Duration::from_secs(10);
        let r = loop {
            if let Some(r) = h.try_result() {
                break r;
            }
            assert!(Instant::now() < end, "polled handle never completed");
            std::thread::sleep(Duration::from_micros(100));
        };
        r.unwrap();
        // Awaiting.
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        let h = t.submit(write(peer, &src, ad.key, 2048)).unwrap();
        rt.block_on(h).unwrap();
        assert_eq!(dst.to_vec().unwrap()[..3072], src.to_vec().unwrap()[..3072]);
    }

    #[test]
    fn notifications_reach_the_target_transport() {
        let (t, target, src, _dst, ad, peer) = pair();
        let target = Transport::new(target).unwrap();
        let mut rx = target.take_notifications().unwrap();
        assert!(target.take_notifications().is_none(), "one receiver only");
        t.submit(write(peer, &src, ad.key, 0).with_notify(&b"n1"[..]))
            .unwrap()
            .wait()
            .unwrap();
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        let note = rt
            .block_on(async { tokio::time::timeout(Duration::from_secs(10), rx.recv()).await })
            .expect("notification not delivered")
            .expect("channel closed");
        assert_eq!(&note.payload[..], b"n1");
    }

    #[test]
    fn shutdown_fails_in_flight_and_later_submits() {
        let (t, _target, src, _dst, ad, peer) = pair();
        t.shutdown();
        t.shutdown(); // idempotent
        match t.submit(write(peer, &src, ad.key, 0)) {
            Err(kvlane_data::SubmitError::Rejected(DataError::Shutdown(_))) => {}
            other => panic!("submit after shutdown: {other:?}"),
        }
    }

    #[test]
    fn shutdown_releases_the_backend_and_its_registrations() {
        let (t, _target, src, _dst, _ad, _peer) = pair();
        let tracker = std::sync::Arc::new(());
        let buf: &'static mut [u8] = Box::leak(vec![1u8; 64].into_boxed_slice());
        // SAFETY: the buffer is leaked, so it outlives every clone.
        let owned = unsafe {
            Region::from_raw(
                buf.as_mut_ptr(),
                buf.len(),
                kvlane_data::MemoryKind::Host,
                Access::ALL,
                Some(Box::new(tracker.clone())),
            )
        }
        .unwrap();
        t.with_backend(|b| b.register(&owned)).unwrap();
        drop(owned);
        assert_eq!(
            std::sync::Arc::strong_count(&tracker),
            2,
            "the backend holds the registration"
        );
        let before = format!("{:?}", t.with_backend(|b| b.kind()));
        t.shutdown();
        assert_eq!(format!("{:?}", t.with_backend(|b| b.kind())), before);
        assert!(
            t.with_backend(|b| b.register(&src)).is_err(),
            "a shut-down transport registers"
        );
        assert_eq!(
            std::sync::Arc::strong_count(&tracker),
            1,
            "shutdown kept the registration"
        );
    }

    /// Counts what an [`Observer`](kvlane_data::Observer) is told.
    #[derive(Default)]
    struct Seen {
        ended: std::sync::Mutex<Vec<(Op, u64, bool)>>,
    }

    impl kvlane_data::Observer for Seen {
        fn ended(&self, t: kvlane_data::Ended, result: &Result<(), DataError>) {
            self.ended
                .lock()
                .unwrap()
                .push((t.op, t.bytes, result.is_ok()));
        }
    }

    /// `submit_batch`: one handle per transfer, in order; a refused
    /// transfer (its id already in flight) gets its error and the rest
    /// land; each `on_done` is called once, and the shared observer is
    /// told of each transfer it observes once, with its operation and
    /// bytes, but not of the refused one.
    #[test]
    fn a_batch_gets_a_handle_per_transfer_and_refusals_in_place() {
        use kvlane_data::Then;
        use std::sync::atomic::{AtomicUsize, Ordering};
        use std::sync::Arc;
        let (t, _target, src, dst, ad, peer) = pair();
        let calls = Arc::new(AtomicUsize::new(0));
        let seen = Arc::new(Seen::default());
        let mut batch: Vec<(Transfer, Option<Then>)> = (0..8u64)
            .map(|i| {
                let c = calls.clone();
                let then = if i % 2 == 0 {
                    Then::Call(Box::new(move |r| {
                        assert!(r.is_ok(), "{r:?}");
                        c.fetch_add(1, Ordering::AcqRel);
                    }))
                } else {
                    Then::Observe(seen.clone())
                };
                (write(peer, &src, ad.key, i * 1024), Some(then))
            })
            .collect();
        // The same id twice: the second is refused, the first runs.
        let again = batch[3].0.clone();
        batch.insert(4, (again, Some(Then::Observe(seen.clone()))));
        let handles = t.submit_batch(batch);
        assert_eq!(handles.len(), 9);
        for (i, h) in handles.into_iter().enumerate() {
            match h {
                Err(kvlane_data::SubmitError::Rejected(DataError::DuplicateTransfer(_)))
                    if i == 4 => {}
                Ok(h) if i != 4 => h.wait().unwrap(),
                other => panic!("transfer {i} of the batch: {other:?}"),
            }
        }
        assert_eq!(calls.load(Ordering::Acquire), 4);
        assert_eq!(
            *seen.ended.lock().unwrap(),
            vec![(Op::Write, 1024, true); 4]
        );
        assert_eq!(dst.to_vec().unwrap()[..8192], src.to_vec().unwrap()[..8192]);
    }

    /// A panicking `on_done` does not keep its handle, or the others
    /// resolved with it, from their results.
    #[test]
    fn a_panicking_on_done_still_resolves_the_batch() {
        let (t, _target, src, _dst, ad, peer) = pair();
        let boom: kvlane_data::OnDone = Box::new(|_| panic!("test: on_done panics"));
        let batch = vec![
            (
                write(peer, &src, ad.key, 0),
                Some(kvlane_data::Then::Call(boom)),
            ),
            (write(peer, &src, ad.key, 1024), None),
        ];
        for h in t.submit_batch(batch) {
            let mut h = h.unwrap();
            let r = h
                .wait_timeout(Duration::from_secs(10))
                .expect("a handle of a panicking on_done's poll never resolved");
            r.unwrap();
        }
    }

    /// The handles one poll resolves are published together, after every
    /// `on_done` ran: a thread woken by the first finds the second done.
    /// (Resolved one by one, the waiter was woken once per transfer, each
    /// time preempting the resolving thread.) The second's `on_done`
    /// sleeps, so resolving them one by one fails this every time.
    #[test]
    fn a_waiter_woken_by_a_poll_finds_all_of_its_results() {
        let (t, _target, src, _dst, ad, peer) = pair();
        let slow: kvlane_data::OnDone =
            Box::new(|_| std::thread::sleep(Duration::from_millis(100)));
        let batch = vec![
            (write(peer, &src, ad.key, 0), None),
            (
                write(peer, &src, ad.key, 1024),
                Some(kvlane_data::Then::Call(slow)),
            ),
        ];
        let mut handles = t.submit_batch(batch).into_iter();
        let first = handles.next().unwrap().unwrap();
        let second = handles.next().unwrap().unwrap();
        first.wait().unwrap();
        assert!(
            second.is_done(),
            "woken by the first result before the second was published"
        );
        second.wait().unwrap();
    }

    #[test]
    fn duplicate_ids_are_rejected() {
        let (t, _target, src, _dst, ad, peer) = pair();
        let w = write(peer, &src, ad.key, 0).with_deadline(Instant::now() + Duration::from_secs(5));
        let h = t.submit(w.clone()).unwrap();
        // The first may already be done; either way the outcome is typed.
        match t.submit(w) {
            Err(kvlane_data::SubmitError::Rejected(DataError::DuplicateTransfer(_))) | Ok(_) => {}
            Err(e) => panic!("{e}"),
        }
        h.wait().unwrap();
    }
}

/// The suite again with verbs-like per-peer endpoints.
mod per_peer {
    use kvlane_data::conformance::Fixture;
    use kvlane_data::{Backend, DataError, LoopbackBackend, LoopbackConfig};

    struct PerPeer;

    fn backend() -> LoopbackBackend {
        LoopbackBackend::new(LoopbackConfig {
            queue_depth: 256,
            endpoint_per_peer: true,
            ..LoopbackConfig::default()
        })
    }

    impl Fixture for PerPeer {
        type Backend = LoopbackBackend;
        fn backends(&self) -> (LoopbackBackend, LoopbackBackend) {
            (backend(), backend())
        }
    }

    kvlane_data::conformance_tests!(PerPeer);

    #[test]
    fn a_per_peer_endpoint_connects_exactly_once() {
        let (mut a, mut b, mut c) = (backend(), backend(), backend());
        assert!(a.endpoint_per_peer());
        let (_, a_ep) = a.prepare_peer().unwrap();
        let (b_peer, _) = b.prepare_peer().unwrap();
        let (c_peer, _) = c.prepare_peer().unwrap();
        b.connect_peer(b_peer, &a_ep, &[]).unwrap();
        match c.connect_peer(c_peer, &a_ep, &[]) {
            Err(DataError::BadEndpoint { reason, .. }) => {
                assert!(reason.contains("already connected"), "{reason}")
            }
            other => panic!("a used endpoint connected again: {other:?}"),
        }
    }
}

/// A backend that panics in `poll` must not leave a handle waiting forever.
mod panicking {
    use kvlane_data::{
        Backend, BackendKind, Completion, DataError, Endpoint, Notification, Op, PeerId, Region,
        RegionId, RemoteRegion, SubmitError, Transfer, Transport,
    };
    use std::time::Duration;

    struct Boom(usize);

    impl Backend for Boom {
        fn kind(&self) -> BackendKind {
            BackendKind::Loopback
        }
        fn register(&mut self, _: &Region) -> Result<RemoteRegion, DataError> {
            unimplemented!("not used")
        }
        fn deregister(&mut self, _: RegionId) -> Result<(), DataError> {
            Ok(())
        }
        fn prepare_peer(&mut self) -> Result<(PeerId, Endpoint), DataError> {
            unimplemented!("not used")
        }
        fn connect_peer(
            &mut self,
            _: PeerId,
            _: &Endpoint,
            _: &[RemoteRegion],
        ) -> Result<(), DataError> {
            Ok(())
        }
        fn remove_peer(&mut self, _: PeerId) {}
        fn submit(&mut self, _: Transfer) -> Result<(), SubmitError> {
            self.0 += 1;
            Ok(())
        }
        fn poll(&mut self, _: &mut Vec<Completion>) -> usize {
            assert!(self.0 == 0, "backend bug");
            0
        }
        fn poll_notifications(&mut self, _: &mut Vec<Notification>) -> usize {
            0
        }
        fn in_flight(&self) -> usize {
            self.0
        }
    }

    #[test]
    fn a_panicking_backend_fails_handles_instead_of_hanging() {
        let t = Transport::new(Boom(0)).unwrap();
        let mut h = t
            .submit(Transfer::new(PeerId(1), Op::Write, vec![], vec![]))
            .unwrap();
        let r = h
            .wait_timeout(Duration::from_secs(10))
            .expect("handle hung after the backend panicked");
        assert!(matches!(r, Err(DataError::Shutdown(_))), "{r:?}");
        assert!(t
            .submit(Transfer::new(PeerId(1), Op::Write, vec![], vec![]))
            .is_err());
    }
}

/// `poll_budget` bounds the bytes one `poll` copies, and every `poll`
/// finishes one transfer at least, whatever the budget.
mod budget {
    use kvlane_data::{
        connect_pair, Access, Backend, DataError, Descriptor, LoopbackBackend, LoopbackConfig, Op,
        PeerId, Region, RemoteDescriptor, RemoteKey, Transfer,
    };

    const KIB: u64 = 1024;

    fn setup(poll_budget: u64) -> (LoopbackBackend, LoopbackBackend, Region, RemoteKey, PeerId) {
        let config = LoopbackConfig {
            poll_budget,
            ..LoopbackConfig::default()
        };
        let mut init = LoopbackBackend::new(config.clone());
        let mut target = LoopbackBackend::new(config);
        let src = Region::from_vec(vec![7u8; 8 * KIB as usize], Access::ALL).unwrap();
        let dst = Region::alloc(8 * KIB as usize, Access::ALL).unwrap();
        let a = init.register(&src).unwrap();
        let b = target.register(&dst).unwrap();
        let (peer, _) = connect_pair(&mut init, &[a], &mut target, &[b]).unwrap();
        (init, target, src, b.key, peer)
    }

    fn submit_writes(b: &mut LoopbackBackend, src: &Region, key: RemoteKey, peer: PeerId) {
        for i in 0..4 {
            let local = [Descriptor {
                region: src.id(),
                offset: i * KIB,
                len: KIB,
            }];
            let remote = [RemoteDescriptor {
                key,
                offset: i * KIB,
                len: KIB,
            }];
            b.submit(Transfer::new(peer, Op::Write, local, remote))
                .unwrap();
        }
    }

    fn polls(b: &mut LoopbackBackend) -> Vec<Vec<bool>> {
        let mut out = Vec::new();
        while b.in_flight() > 0 {
            let mut done = Vec::new();
            b.poll(&mut done);
            out.push(done.iter().map(|c| c.result.is_ok()).collect());
        }
        out
    }

    #[test]
    fn a_budget_of_two_blocks_finishes_two_transfers_per_poll() {
        let (mut init, _target, src, key, peer) = setup(2 * KIB);
        submit_writes(&mut init, &src, key, peer);
        assert_eq!(polls(&mut init), vec![vec![true, true], vec![true, true]]);
    }

    #[test]
    fn a_zero_budget_still_finishes_one_transfer_per_poll() {
        let (mut init, _target, src, key, peer) = setup(0);
        submit_writes(&mut init, &src, key, peer);
        assert_eq!(polls(&mut init), vec![vec![true]; 4]);
    }

    #[test]
    fn transfers_to_a_lost_peer_fail_one_budget_unit_each() {
        let (mut init, target, src, key, peer) = setup(0);
        submit_writes(&mut init, &src, key, peer);
        drop(target);
        assert_eq!(polls(&mut init), vec![vec![false]; 4]);
        let mut done = Vec::new();
        submit_writes(&mut init, &src, key, peer);
        init.poll(&mut done);
        assert!(
            matches!(done[0].result, Err(DataError::PeerLost { peer: p, .. }) if p == peer),
            "{:?}",
            done[0].result
        );
    }
}
