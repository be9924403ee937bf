//! The tcp initiator's resource model: threads stay O(io_threads) whatever
//! the number of peers, and every peer's transfers land byte for byte. In
//! its own test binary so the thread count is this test's alone.

#[cfg(target_os = "linux")]
mod scale {
    use kvlane_data::conformance::{collect, one_span, Rng};
    use kvlane_data::{connect_pair, Access, Backend, Op, Region, TcpBackend, TcpConfig, Transfer};
    use std::time::Duration;

    /// Peer pairs: each connects both ways (as the facade dials back from
    /// the target side), so each backend initiates 4 streams per peer.
    const PEERS: usize = 256;
    /// Per peer: 4 chunks of 16 KiB, one per stream.
    const BLOCK: u64 = 64 << 10;

    fn threads() -> usize {
        std::fs::read_dir("/proc/self/task")
            .expect("/proc/self/task: this test needs Linux procfs")
            .count()
    }

    fn transfer(
        peer: kvlane_data::PeerId,
        op: Op,
        local: &Region,
        key: kvlane_data::RemoteKey,
        at: u64,
    ) -> Transfer {
        one_span(peer, op, (local, at), (key, at), BLOCK)
            .with_deadline(std::time::Instant::now() + Duration::from_secs(60))
    }

    /// 256 peers x 4 streams, initiated from both backends (2,048
    /// streams): neither backend starts a thread after it was built, and
    /// a WRITE then a READ on every peer moves exactly the right bytes.
    /// The old initiator (two threads per stream) took 4,096 threads here.
    #[test]
    fn hundreds_of_peers_cost_no_thread_and_land_every_byte() {
        let config = TcpConfig {
            io_threads: 2,
            // Every peer its 4 streams: the stress is the stream count.
            stream_budget: usize::MAX,
            chunk_bytes: 16 << 10,
            ..TcpConfig::default()
        };
        let mut init = TcpBackend::new(config.clone()).unwrap();
        let mut target = TcpBackend::new(config).unwrap();
        let len = PEERS as u64 * BLOCK;
        let mut data = vec![0u8; len as usize];
        Rng::new(13).fill(&mut data);
        let src = Region::from_vec(data.clone(), Access::ALL).unwrap();
        let back = Region::alloc(len as usize, Access::ALL).unwrap();
        let remote = Region::alloc(len as usize, Access::ALL).unwrap();
        let src_ad = init.register(&src).unwrap();
        init.register(&back).unwrap();
        let remote_ad = target.register(&remote).unwrap();
        let before = threads();
        let peers: Vec<_> = (0..PEERS)
            .map(|i| {
                connect_pair(&mut init, &[src_ad], &mut target, &[remote_ad])
                    .unwrap_or_else(|e| panic!("peer {i}: {e}"))
                    .0
            })
            .collect();
        let connected = threads();
        // Every peer moves its own block; `during` is sampled with all of
        // them in flight.
        let mut run = |op: Op, local: &Region| {
            let ids: Vec<_> = peers
                .iter()
                .enumerate()
                .map(|(i, &p)| {
                    let t = transfer(p, op, local, remote_ad.key, i as u64 * BLOCK);
                    let id = t.id;
                    init.submit(t).unwrap();
                    id
                })
                .collect();
            let during = threads();
            for (id, (r, _)) in collect(&mut init, &ids, Duration::from_secs(120)) {
                r.unwrap_or_else(|e| panic!("{op} {id}: {e}"));
            }
            during
        };
        let writing = run(Op::Write, &src);
        assert!(remote.to_vec().unwrap() == data, "a WRITE landed wrong");
        let busy = run(Op::Read, &back).max(writing);
        assert!(back.to_vec().unwrap() == data, "a READ landed wrong");
        let after = threads();
        for (what, n) in [("connected", connected), ("busy", busy), ("after", after)] {
            assert!(
                n <= before,
                "{what}: {PEERS} peers took {} threads more ({before} before, {n} {what})",
                n.saturating_sub(before)
            );
        }
        eprintln!("threads: {before} before, {busy} with {PEERS} peers both ways");
    }
}
