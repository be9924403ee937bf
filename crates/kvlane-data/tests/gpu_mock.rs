//! GPU memory over loopback and tcp, against a MOCK CUDA driver
//! (`testdata/mock_cuda.c`, compiled with `cc` at test time): the driver
//! functions kvlane calls, implemented on host memory. These tests exercise
//! the loader, pointer checks, pinned staging and the backends' staged
//! paths on machines without a GPU; they say nothing about a real GPU
//! (`tests/gpu.rs`, run by `ci/gpu.sh`, does).

use kvlane_data::conformance::{contents, region_in, use_mock_cuda};
use std::ffi::c_int;

use kvlane_data::{gpu_devices, Access, DataError, GpuDevice, GpuError, GpuRuntime, Region};

/// The whole conformance suite with every region in (mock) GPU memory.
mod loopback_suite {
    use kvlane_data::conformance::LoopbackFixture;
    kvlane_data::conformance_tests!(LoopbackFixture(|| Some(super::use_mock_cuda())));
}

/// The whole conformance suite with every region in (mock) GPU memory.
mod tcp_suite {
    use kvlane_data::conformance::TcpFixture;
    kvlane_data::conformance_tests!(TcpFixture(|| Some(super::use_mock_cuda())));
}

#[test]
fn devices_have_pci_bus_ids() {
    use_mock_cuda();
    let devs = gpu_devices(GpuRuntime::Cuda).unwrap();
    assert_eq!(devs.len(), 2);
    assert_eq!(devs[0].device, GpuDevice::cuda(0));
    assert_eq!(devs[1].pci_bus_id, "0000:c1:00.0");
    assert!(
        devs[0].to_string().contains("pci 0000:c0:00.0"),
        "{}",
        devs[0]
    );
}

#[test]
fn missing_device_is_unsupported_naming_it() {
    use_mock_cuda();
    kvlane_data::conformance::missing_device_is_unsupported(GpuDevice::cuda(5), 2);
}

#[test]
fn missing_runtime_is_unsupported_naming_library() {
    use_mock_cuda();
    // No HIP on this machine is not assumed: a path that cannot exist.
    // HIP is loaded by no other test of this binary.
    std::env::set_var("KVLANE_HIP_LIBRARY", "/nonexistent/libamdhip64.so");
    let err = Region::alloc_device(GpuDevice::rocm(0), 4096, Access::ALL).unwrap_err();
    let DataError::Gpu(g) = &err else {
        panic!("unexpected: {err:?}")
    };
    assert!(g.is_unsupported(), "{g:?}");
    assert_eq!(g.device(), GpuDevice::rocm(0));
    let msg = err.to_string();
    assert!(
        msg.starts_with("rocm:0: unsupported: no rocm driver")
            && msg.contains("/nonexistent/libamdhip64.so")
            && msg.contains("KVLANE_HIP_LIBRARY"),
        "{msg}"
    );
}

#[test]
fn host_memory_is_not_registered_as_device_memory() {
    let dev = use_mock_cuda();
    let host = vec![0u8; 8192];
    // SAFETY: refused before anything uses the pointer.
    let err = unsafe {
        Region::from_device_ptr(dev, host.as_ptr() as u64, host.len(), Access::ALL, None)
    }
    .unwrap_err();
    assert!(
        matches!(&err, DataError::Gpu(GpuError::NotDeviceMemory { device, .. }) if *device == dev),
        "{err:?}"
    );
    assert!(err.to_string().contains("does not know"), "{err}");
}

#[test]
fn memory_of_another_device_or_past_the_end_is_refused() {
    let dev = use_mock_cuda();
    let other = Region::alloc_device(GpuDevice::cuda(1), 8192, Access::ALL).unwrap();
    // SAFETY: refused before anything uses the pointer.
    let err =
        unsafe { Region::from_device_ptr(dev, other.addr(), 8192, Access::ALL, None) }.unwrap_err();
    assert!(err.to_string().contains("memory of cuda:1"), "{err}");
    let mine = Region::alloc_device(dev, 8192, Access::ALL).unwrap();
    // SAFETY: refused before anything uses the pointer (too long).
    let err = unsafe { Region::from_device_ptr(dev, mine.addr(), 1 << 20, Access::ALL, None) }
        .unwrap_err();
    assert!(err.to_string().contains("at the last byte"), "{err}");
    // SAFETY: `mine` (which owns the allocation) outlives `inner`.
    let inner =
        unsafe { Region::from_device_ptr(dev, mine.addr() + 4096, 4096, Access::ALL, None) }
            .unwrap();
    inner.copy_in(0, &[9; 4096]).unwrap();
    assert_eq!(&contents(&mine)[4096..], &[9; 4096][..]);
    assert_eq!(inner.device(), Some(dev));
}

#[test]
fn device_regions_are_not_cpu_addressable() {
    let dev = use_mock_cuda();
    let r = Region::alloc_device(dev, 4096, Access::ALL).unwrap();
    assert!(matches!(
        r.write(0, &[1]),
        Err(DataError::Unsupported { .. })
    ));
    // SAFETY: nothing else touches `r`; the call is refused before any
    // slice exists.
    let sliced = unsafe { r.with_slice(0, 1, |_| ()) };
    assert!(matches!(sliced, Err(DataError::Unsupported { .. })));
    assert!(matches!(
        r.copy_in(4000, &[0; 100]),
        Err(DataError::OutOfBounds { .. })
    ));
}

#[test]
fn copies_span_many_staging_chunks() {
    let dev = use_mock_cuda();
    let len = (5 << 20) + 3;
    let data: Vec<u8> = (0..len).map(|i| (i % 251) as u8).collect();
    let r = region_in(Some(dev), len, Access::ALL, &data);
    assert!(contents(&r) == data);
    let mut mid = vec![0u8; 3 << 20];
    r.copy_out(1 << 20, &mut mid).unwrap();
    assert!(mid[..] == data[1 << 20..(1 << 20) + (3 << 20)]);
    // A consumer error stops the stream and comes back as is.
    let mut seen = 0;
    let r2 = r
        .read_chunks(0, len as u64, |c| {
            seen += c.len();
            Err::<(), _>("stop")
        })
        .unwrap();
    assert_eq!(r2, Err("stop"));
    assert!(
        (128 << 10..=2 << 20).contains(&seen),
        "stopped after the first chunk, not after {seen} bytes"
    );
}

/// The mock driver that `use_mock_cuda` loaded, for its test helpers
/// (testdata/mock_gpu.h).
fn mock_cuda() -> libloading::Library {
    let path = std::env::var_os("KVLANE_CUDA_LIBRARY").expect("use_mock_cuda() first");
    // SAFETY: the mock driver built by `use_mock_cuda` and already loaded
    // by this process (this takes one more reference); its initializers
    // have no preconditions.
    unsafe { libloading::Library::new(&path) }.expect("load the mock CUDA driver")
}

/// The most streams that held a copy queued by the calling thread at one
/// time since the last reset (`kvlane_mock_in_flight_peak`); `reset`
/// starts the count again.
fn mock_cuda_in_flight_peak(reset: bool) -> u32 {
    let lib = mock_cuda();
    // SAFETY: the symbol is `int kvlane_mock_in_flight_peak(int)`; the
    // function pointer is used only while `lib` lives.
    let peak = unsafe {
        let f: libloading::Symbol<unsafe extern "C" fn(c_int) -> c_int> = lib
            .get(b"kvlane_mock_in_flight_peak\0")
            .expect("the mock CUDA driver exports kvlane_mock_in_flight_peak");
        f(c_int::from(reset))
    };
    u32::try_from(peak).expect("a count")
}

/// Bytes the mock driver has copied out of the device allocation that
/// starts at `base` (`kvlane_mock_copied_out`).
fn mock_cuda_copied_out(base: u64) -> u64 {
    let lib = mock_cuda();
    // SAFETY: the symbol is `unsigned long long kvlane_mock_copied_out(uintptr_t)`;
    // the function pointer is used only while `lib` lives.
    unsafe {
        let f: libloading::Symbol<unsafe extern "C" fn(usize) -> u64> = lib
            .get(b"kvlane_mock_copied_out\0")
            .expect("the mock CUDA driver exports kvlane_mock_copied_out");
        f(usize::try_from(base).expect("an address"))
    }
}

/// A peer that asks for the largest READ of GPU memory the wire allows
/// and then reads nothing holds the target to about one staged piece:
/// GPU answers are staged as the socket takes them, not whole when
/// queued (64 MiB of host memory per connection before). The whole
/// answer still arrives intact when the peer reads it.
#[test]
fn a_large_gpu_read_is_staged_as_the_socket_takes_it() {
    use kvlane_data::tcp::wire::{Request, RequestKind, Response, Status, MAX_CHUNK, RESPONSE_LEN};
    use kvlane_data::{Backend, RemoteKey, TcpBackend, TcpConfig, TcpEndpoint};
    use std::io::{Read, Write};
    use std::time::{Duration, Instant};
    let dev = use_mock_cuda();
    let len = MAX_CHUNK as usize;
    let r = region_in(
        Some(dev),
        len,
        Access::ALL,
        &(0..=250u8).collect::<Vec<_>>(),
    );
    let mut backend = TcpBackend::new(TcpConfig::default()).unwrap();
    let ad = backend.register(&r).unwrap();
    let (_, endpoint) = backend.prepare_peer().unwrap();
    let ep = TcpEndpoint::from_endpoint(&endpoint).unwrap();
    let mut s = std::net::TcpStream::connect(ep.addr).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(20))).unwrap();
    kvlane_data::tcp::wire::authenticate(&s, &ep.token).unwrap();
    let before = mock_cuda_copied_out(r.addr());
    let req = Request {
        kind: RequestKind::Read,
        key: RemoteKey(ad.key.0),
        tag: 7,
        offset: 0,
        len: MAX_CHUNK,
    };
    s.write_all(&req.encode()).unwrap();
    let mut h = [0u8; RESPONSE_LEN];
    s.read_exact(&mut h).unwrap();
    assert_eq!(
        Response::decode(&h).unwrap(),
        Response {
            status: Status::Ok,
            tag: 7
        }
    );
    // Reading nothing more: staging stops once the socket buffers are
    // full. Wait until the count holds still for half a second.
    let (mut last, mut since, start) = (u64::MAX, Instant::now(), Instant::now());
    loop {
        let now = mock_cuda_copied_out(r.addr()) - before;
        if now != last {
            (last, since) = (now, Instant::now());
        } else if since.elapsed() > Duration::from_millis(500) {
            break;
        }
        assert!(
            start.elapsed() < Duration::from_secs(20),
            "staging never settled ({now} bytes)"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    assert!(
        last < MAX_CHUNK / 2,
        "{last} bytes of a {MAX_CHUNK}-byte answer staged for a peer that reads nothing"
    );
    let mut got = vec![0u8; len];
    s.read_exact(&mut got).unwrap();
    assert_eq!(
        mock_cuda_copied_out(r.addr()) - before,
        MAX_CHUNK,
        "each byte staged once"
    );
    let all = contents(&r);
    assert!(got == all, "the answer differs from the region");
    // An empty READ of GPU memory is answered and the connection lives on.
    for (tag, offset, n) in [(8u64, 100u64, 0usize), (9, 100, 5)] {
        let req = Request {
            kind: RequestKind::Read,
            key: RemoteKey(ad.key.0),
            tag,
            offset,
            len: n as u64,
        };
        s.write_all(&req.encode()).unwrap();
        s.read_exact(&mut h).unwrap();
        assert_eq!(
            Response::decode(&h).unwrap(),
            Response {
                status: Status::Ok,
                tag
            }
        );
        let mut got = vec![0u8; n];
        s.read_exact(&mut got).unwrap();
        assert_eq!(got[..], all[100..100 + n]);
    }
    drop(backend);
}

/// Staging is pipelined: each chunk's copy is issued while the copy of the
/// chunk before it is still in flight (the mock runs a copy only when its
/// stream is synchronized, the latest a GPU may). A stager that waited for
/// each copy before issuing the next would peak at one stream.
#[test]
fn staged_copies_keep_two_chunks_in_flight() {
    let dev = use_mock_cuda();
    // One tcp request's worth (512 KiB, four chunks) and a large range
    // (buffer-sized chunks).
    for len in [512usize << 10, (6 << 20) + 5] {
        let data: Vec<u8> = (0..len).map(|i| (i % 253) as u8).collect();
        let r = Region::alloc_device(dev, len, Access::ALL).unwrap();
        mock_cuda_in_flight_peak(true);
        r.copy_in(0, &data).unwrap();
        assert_eq!(
            mock_cuda_in_flight_peak(true),
            2,
            "write_chunks of {len} bytes: streams with a host-to-device copy in flight at once"
        );
        let mut back = vec![0u8; len];
        r.copy_out(0, &mut back).unwrap();
        assert_eq!(
            mock_cuda_in_flight_peak(true),
            2,
            "read_chunks of {len} bytes: streams with a device-to-host copy in flight at once"
        );
        assert!(back == data, "{len} bytes came back changed");
    }
}

#[test]
fn dmabuf_export_unsupported_by_driver_is_typed() {
    let dev = use_mock_cuda();
    let r = Region::alloc_device(dev, 4096, Access::ALL).unwrap();
    let err = r.export_dmabuf().unwrap_err();
    assert!(
        matches!(&err, DataError::Gpu(GpuError::Unsupported { device, .. }) if *device == dev),
        "{err:?}"
    );
    let host = Region::alloc(4096, Access::ALL).unwrap();
    assert!(matches!(
        host.export_dmabuf(),
        Err(DataError::Unsupported { .. })
    ));
}

/// Host to GPU and back over tcp, with a notification that arrives only
/// once the bytes are in the target's (mock) device memory.
#[test]
fn tcp_between_host_and_device_with_notification() {
    kvlane_data::conformance::host_and_device_over_tcp(use_mock_cuda());
}
