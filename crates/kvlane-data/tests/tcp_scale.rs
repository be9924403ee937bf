//! The tcp target's resource model: threads stay O(cores) whatever the
//! number of connections. In its own test binary so the thread count is
//! this test's alone.

#[cfg(target_os = "linux")]
mod scale {
    use kvlane_data::tcp::wire::{
        Hello, Request, RequestKind, Response, Status, HELLO_ACK, RESPONSE_LEN,
    };
    use kvlane_data::{Access, Backend, Region, TcpBackend, TcpConfig, TcpEndpoint};
    use std::io::{Read, Write};
    use std::net::TcpStream;
    use std::time::Duration;

    fn threads() -> usize {
        std::fs::read_dir("/proc/self/task")
            .expect("/proc/self/task: this test needs Linux procfs")
            .count()
    }

    /// 1,000 silent connections and 250 peers x 4 authenticated streams
    /// (1,000 connections) on a target with 2 I/O threads: every stream is
    /// admitted and served, and the process gains no thread.
    #[test]
    fn a_thousand_connections_cost_no_thread() {
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
                s.write_all(&Hello { token: ep.token }.encode()).unwrap();
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
            "{} connections took {} threads more ({before} before, {after} after)",
            silent.len() + authed.len(),
            after.saturating_sub(before)
        );
        let c = target.counters();
        assert_eq!(c.reads_served, 1000, "{c:?}");
        assert!(c.unauthenticated_evicted >= 1000 - 256, "{c:?}");
        eprintln!("threads: {before} before, {after} with 2,000 connections; {c:?}");
    }
}
