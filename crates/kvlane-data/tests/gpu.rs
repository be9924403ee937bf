//! GPU memory on a real GPU: ignored by default, run by `ci/gpu.sh` with
//! `KVLANE_TEST_GPU=cuda:0` (or `rocm:0`). Asked to run without a GPU they
//! fail with the reason; none of them passes quietly on a machine without
//! one. (`tests/gpu_mock.rs` runs the same paths against a mock driver.)

use kvlane_data::conformance::{contents, region_in, Fixture};
use kvlane_data::{
    gpu_devices, Access, DataError, GpuDevice, LoopbackBackend, Region, TcpBackend, TcpConfig,
};

/// The GPU under test, from `KVLANE_TEST_GPU`; panics (fails) when unset,
/// unparsable or absent.
fn gpu() -> GpuDevice {
    let spec = std::env::var("KVLANE_TEST_GPU")
        .expect("set KVLANE_TEST_GPU=cuda:0 (or rocm:0): GPU tests need a GPU");
    let dev: GpuDevice = spec.parse().expect("KVLANE_TEST_GPU");
    let devs = gpu_devices(dev.runtime).unwrap_or_else(|e| panic!("{dev}: {e}"));
    assert!(
        devs.iter().any(|d| d.device == dev),
        "{dev} is not among {devs:?}"
    );
    dev
}

struct GpuLoopback;

impl Fixture for GpuLoopback {
    type Backend = LoopbackBackend;
    fn backends(&self) -> (LoopbackBackend, LoopbackBackend) {
        (LoopbackBackend::default(), LoopbackBackend::default())
    }
    fn memory(&self) -> Option<GpuDevice> {
        Some(gpu())
    }
}

struct GpuTcp;

impl Fixture for GpuTcp {
    type Backend = TcpBackend;
    fn backends(&self) -> (TcpBackend, TcpBackend) {
        (
            TcpBackend::new(TcpConfig::default()).expect("start tcp backend"),
            TcpBackend::new(TcpConfig::default()).expect("start tcp backend"),
        )
    }
    fn memory(&self) -> Option<GpuDevice> {
        Some(gpu())
    }
}

mod loopback_suite {
    kvlane_data::conformance_tests!(
        #[ignore = "needs a GPU: KVLANE_TEST_GPU=cuda:0, run by ci/gpu.sh"]
        super::GpuLoopback
    );
}

mod tcp_suite {
    kvlane_data::conformance_tests!(
        #[ignore = "needs a GPU: KVLANE_TEST_GPU=cuda:0, run by ci/gpu.sh"]
        super::GpuTcp
    );
}

#[test]
#[ignore = "needs a GPU: KVLANE_TEST_GPU=cuda:0, run by ci/gpu.sh"]
fn gpu_devices_have_pci_addresses() {
    let dev = gpu();
    for d in gpu_devices(dev.runtime).unwrap() {
        println!("{d}");
        // domain:bus:device.function, as under /sys/bus/pci/devices.
        let parts: Vec<&str> = d.pci_bus_id.split([':', '.']).collect();
        assert_eq!(parts.len(), 4, "{}", d.pci_bus_id);
    }
}

#[test]
#[ignore = "needs a GPU: KVLANE_TEST_GPU=cuda:0, run by ci/gpu.sh"]
fn gpu_copies_round_trip() {
    let dev = gpu();
    let len = (37 << 20) + 5;
    let data: Vec<u8> = (0..len).map(|i| (i % 241) as u8).collect();
    let r = region_in(Some(dev), len, Access::ALL, &data);
    assert!(contents(&r) == data);
    // The same memory registered again by pointer (as an engine would).
    // SAFETY: `r` owns the allocation and outlives `view`.
    let view =
        unsafe { Region::from_device_ptr(dev, r.addr() + 4096, 4096, Access::ALL, None) }.unwrap();
    assert!(contents(&view)[..] == data[4096..8192]);
    // Host memory is refused by pointer, never taken as device memory.
    let host = vec![0u8; 4096];
    // SAFETY: refused before anything uses the pointer.
    let err =
        unsafe { Region::from_device_ptr(dev, host.as_ptr() as u64, 4096, Access::ALL, None) }
            .unwrap_err();
    assert!(matches!(err, DataError::Gpu(_)), "{err}");
}

/// dma-buf export: supported drivers (open kernel modules, CUDA 12.x on
/// Linux 5.12+) give a dma-buf covering the region; others give the typed
/// `Unsupported` error. Anything else fails. Prints which.
#[test]
#[ignore = "needs a GPU: KVLANE_TEST_GPU=cuda:0, run by ci/gpu.sh"]
fn gpu_dmabuf_export() {
    let dev = gpu();
    let r = Region::alloc_device(dev, 3 << 20, Access::ALL).unwrap();
    match r.export_dmabuf() {
        Ok(buf) => {
            println!(
                "{dev}: dma-buf export: ok ({} bytes, offset {})",
                buf.len, buf.offset
            );
            assert!(buf.offset < 4096 && buf.len as u64 >= r.len() + buf.offset);
            use std::os::fd::AsRawFd;
            assert!(buf.fd.as_raw_fd() >= 0);
        }
        Err(DataError::Gpu(e)) if e.is_unsupported() => {
            println!("{dev}: dma-buf export: unsupported here: {e}");
        }
        Err(e) => panic!("{dev}: dma-buf export failed: {e}"),
    }
}

/// What registering GPU memory with verbs does on this machine: with no
/// RDMA device the backend itself is `Unsupported`; with one, the region
/// registers by dma-buf or by address, or fails naming both.
#[cfg(feature = "verbs")]
#[test]
#[ignore = "needs a GPU: KVLANE_TEST_GPU=cuda:0, run by ci/gpu.sh"]
fn gpu_verbs_registration() {
    use kvlane_data::verbs::{VerbsBackend, VerbsConfig, VerbsError};
    use kvlane_data::Backend;
    let dev = gpu();
    let r = Region::alloc_device(dev, 1 << 20, Access::ALL).unwrap();
    match VerbsBackend::new(VerbsConfig::default()) {
        Err(VerbsError::Unsupported(e)) => println!("verbs: no RDMA device here: {e}"),
        Err(e) => panic!("verbs: {e}"),
        Ok(mut b) => match b.register(&r) {
            Ok(ad) => println!("verbs: registered {dev} memory: {ad:?}"),
            Err(DataError::Verbs(e @ VerbsError::RegisterGpu { .. })) => {
                println!("verbs: {e}")
            }
            Err(e) => panic!("verbs: unexpected registration error: {e}"),
        },
    }
}
