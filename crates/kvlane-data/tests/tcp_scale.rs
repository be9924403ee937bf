//! The tcp target's resource model: threads stay O(cores) whatever the
//! number of connections. In its own test binary so the thread count is
//! this test's alone.

#[cfg(target_os = "linux")]
mod scale {
    use kvlane_data::tcp::wire::{
        Challenge, Hello, Request, RequestKind, Response, Status, CHALLENGE_LEN, HELLO_ACK,
        RESPONSE_LEN,
    };
    use kvlane_data::{Access, Backend, Region, TcpBackend, TcpConfig, TcpEndpoint};
    use std::io::{Read, Write};
    use std::net::TcpStream;
    use std::time::Duration;

    /// The tests of this binary count the process's threads: one at a time.
    static SERIAL: std::sync::Mutex<()> = std::sync::Mutex::new(());

    fn serial() -> std::sync::MutexGuard<'static, ()> {
        SERIAL.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Threads of this process, less the test harness's threads of the
    /// other tests here. The harness names each test's thread after the
    /// test (`scale::…`) and may start the next one while this one runs
    /// (it then waits on `SERIAL`): once it counted as "1 thread more"
    /// (2026-12-02). A thread this test's code starts unnamed inherits
    /// this test's own name and still counts.
    fn threads() -> usize {
        let own = std::fs::read_to_string("/proc/thread-self/comm")
            .expect("/proc/thread-self/comm: this test needs Linux procfs");
        let own = own.trim();
        names()
            .iter()
            .filter(|n| n.as_str() == own || !n.starts_with("scale::"))
            .count()
    }

    fn names() -> Vec<String> {
        std::fs::read_dir("/proc/self/task")
            .expect("/proc/self/task: this test needs Linux procfs")
            .filter_map(|t| std::fs::read_to_string(t.ok()?.path().join("comm")).ok())
            .map(|n| n.trim().to_owned())
            .collect()
    }

    /// Threads of this process whose name starts with `prefix`.
    fn named(prefix: &str) -> usize {
        std::fs::read_dir("/proc/self/task")
            .expect("/proc/self/task: this test needs Linux procfs")
            .filter_map(|t| std::fs::read_to_string(t.ok()?.path().join("comm")).ok())
            .filter(|name| name.starts_with(prefix))
            .count()
    }

    fn wait_for(what: &str, mut cond: impl FnMut() -> bool) {
        let end = std::time::Instant::now() + Duration::from_secs(10);
        while !cond() {
            assert!(
                std::time::Instant::now() < end,
                "timed out waiting for {what}"
            );
            std::thread::sleep(Duration::from_millis(10));
        }
    }

    /// Twenty backends in one process, each connected to the next and
    /// moving bytes through its own transport, run their initiator streams
    /// on one pool of `io_threads` threads, their listeners and served
    /// connections on another, and their progress on the process's few
    /// shared progress threads, not twenty of each; the pools stop with
    /// the last backend and a later backend starts new ones.
    #[test]
    fn backends_of_a_process_share_the_initiator_threads() {
        use kvlane_data::{Descriptor, Op, PeerId, RemoteDescriptor, Transfer, Transport};
        let _serial = serial();
        let config = || TcpConfig {
            io_threads: 3,
            ..TcpConfig::default()
        };
        let n = 20;
        let mut backends: Vec<TcpBackend> =
            (0..n).map(|_| TcpBackend::new(config()).unwrap()).collect();
        let regions: Vec<Region> = (0..n)
            .map(|i| {
                let r = Region::alloc(4096, Access::ALL).unwrap();
                r.fill(0, 4096, i as u8).unwrap();
                r
            })
            .collect();
        let dsts: Vec<Region> = (0..n)
            .map(|_| Region::alloc(4096, Access::ALL).unwrap())
            .collect();
        for (b, d) in backends.iter_mut().zip(&dsts) {
            b.register(d).unwrap();
        }
        let ads: Vec<_> = backends
            .iter_mut()
            .zip(&regions)
            .map(|(b, r)| b.register(r).unwrap())
            .collect();
        let mut peers: Vec<PeerId> = Vec::new();
        for i in 0..n {
            let j = (i + 1) % n;
            let (_, ep_j) = backends[j].prepare_peer().unwrap();
            let (peer, _) = backends[i].prepare_peer().unwrap();
            let c = backends[i]
                .start_connect(peer, &ep_j, std::slice::from_ref(&ads[j]))
                .unwrap()
                .run()
                .unwrap();
            backends[i].finish_connect(peer, c).unwrap();
            peers.push(peer);
        }
        // Every stream of every backend is up and on the shared threads,
        // and their listeners and served connections on the shared
        // target-side threads.
        assert_eq!(
            named("kvlane-tcp-init"),
            3,
            "initiator threads of {n} backends"
        );
        assert_eq!(named("kvlane-tcp-io"), 3, "target threads of {n} backends");
        // Each backend driven by a transport: they share the process's
        // progress threads too.
        let first_addr = backends[0].local_addr();
        let mut transports: Vec<Transport> = backends
            .drain(..)
            .map(|b| Transport::new(b).unwrap())
            .collect();
        let pool = std::thread::available_parallelism().map_or(2, |n| n.get().min(4));
        // Backend i READs backend i+1's bytes (4 KiB of value i+1).
        let read_next = |i: usize| {
            let j = (i + 1) % n;
            Transfer::new(
                peers[i],
                Op::Read,
                vec![Descriptor {
                    region: dsts[i].id(),
                    offset: 0,
                    len: 4096,
                }],
                vec![RemoteDescriptor {
                    key: ads[j].key,
                    offset: 0,
                    len: 4096,
                }],
            )
        };
        let handles: Vec<_> = transports
            .iter()
            .enumerate()
            .map(|(i, tr)| tr.submit(read_next(i)).unwrap())
            .collect();
        for (i, h) in handles.into_iter().enumerate() {
            h.wait().unwrap_or_else(|e| panic!("transport {i}: {e}"));
            let j = (i + 1) % n;
            assert!(
                dsts[i].to_vec().unwrap().iter().all(|&x| x == j as u8),
                "transport {i} read the wrong bytes"
            );
        }
        assert_eq!(
            named("kvlane-progress"),
            pool,
            "progress threads of {n} transports"
        );
        // One backend goes: its port closes and the one reading from it
        // fails, while the others, on the same threads, go on.
        let read = |tr: &Transport, i: usize| tr.submit(read_next(i)).unwrap().wait();
        drop(transports.remove(0));
        assert!(
            TcpStream::connect(first_addr).is_err(),
            "the dropped backend's port {first_addr} still accepts"
        );
        let last = transports.len() - 1;
        assert!(
            read(&transports[last], n - 1).is_err(),
            "a READ from the dropped backend"
        );
        for (k, tr) in transports.iter().enumerate().take(last) {
            read(tr, k + 1).unwrap_or_else(|e| panic!("transport {} after one went: {e}", k + 1));
        }
        drop(transports);
        wait_for("the progress threads to stop", || {
            named("kvlane-progress") == 0
        });
        wait_for("the shared pools to stop", || {
            named("kvlane-tcp-init") + named("kvlane-tcp-io") == 0
        });
        let again = TcpBackend::new(config()).unwrap();
        // A thread names itself as it starts.
        wait_for("new pools after the last backend", || {
            named("kvlane-tcp-init") == 3 && named("kvlane-tcp-io") == 3
        });
        drop(again);
    }

    /// 1,000 silent connections and 250 peers x 4 authenticated streams
    /// (1,000 connections) on a target with 2 I/O threads: every stream is
    /// admitted and served, and the process gains no thread.
    #[test]
    fn a_thousand_connections_cost_no_thread() {
        let _serial = serial();
        let mut target = TcpBackend::new(TcpConfig {
            io_threads: 2,
            ..TcpConfig::default()
        })
        .unwrap();
        let region = Region::alloc(4096, Access::ALL).unwrap();
        let ad = target.register(&region).unwrap();
        let before = threads();
        let eps: Vec<TcpEndpoint> = (0..250)
            .map(|_| TcpEndpoint::from_endpoint(&target.prepare_peer().unwrap().1).unwrap())
            .collect();
        let silent: Vec<TcpStream> = (0..1000)
            .map(|_| TcpStream::connect(eps[0].addr).unwrap())
            .collect();
        let mut authed = Vec::new();
        for ep in &eps {
            for _ in 0..4 {
                let mut s = TcpStream::connect(ep.addr).unwrap();
                s.set_read_timeout(Some(Duration::from_secs(20))).unwrap();
                let mut c = [0u8; CHALLENGE_LEN];
                s.read_exact(&mut c).unwrap();
                let c = Challenge::decode(&c).unwrap();
                s.write_all(&Hello::answer(&c, &ep.token).encode()).unwrap();
                authed.push(s);
            }
        }
        for (i, s) in authed.iter_mut().enumerate() {
            let mut ack = [0u8; HELLO_ACK.len()];
            s.read_exact(&mut ack)
                .unwrap_or_else(|e| panic!("stream {i} was not admitted: {e}"));
            assert_eq!(ack, HELLO_ACK);
        }
        // Every stream is served.
        for (i, s) in authed.iter_mut().enumerate() {
            let req = Request {
                kind: RequestKind::Read,
                key: ad.key,
                tag: i as u64,
                offset: 0,
                len: 64,
            };
            s.write_all(&req.encode()).unwrap();
        }
        for (i, s) in authed.iter_mut().enumerate() {
            let mut h = [0u8; RESPONSE_LEN];
            s.read_exact(&mut h).unwrap();
            let resp = Response::decode(&h).unwrap();
            assert_eq!((resp.status, resp.tag), (Status::Ok, i as u64));
            let mut payload = [0u8; 64];
            s.read_exact(&mut payload).unwrap();
        }
        let after = threads();
        assert!(
            after <= before,
            "{} connections took {} threads more ({before} before, {after} after: {:?})",
            silent.len() + authed.len(),
            after.saturating_sub(before),
            names()
        );
        let c = target.counters();
        assert_eq!(c.reads_served, 1000, "{c:?}");
        assert!(c.unauthenticated_evicted >= 1000 - 256, "{c:?}");
        eprintln!("threads: {before} before, {after} with 2,000 connections; {c:?}");
    }
}
