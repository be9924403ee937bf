//! ROCm memory over loopback and tcp, against a MOCK HIP runtime
//! (`testdata/mock_hip.c`, reporting ROCm 6.2, compiled with `cc` at test
//! time): the HIP functions kvlane calls, implemented on host memory. These
//! tests run the ROCm loader, pointer checks, per-thread device binding,
//! pinned staging and dma-buf export on machines without an AMD GPU; they
//! say nothing about a real one. ROCm 5's encodings: `gpu_mock_rocm5.rs`.

use kvlane_data::conformance::{contents, use_mock_hip};
use kvlane_data::{
    gpu_device_of, gpu_devices, Access, DataError, GpuDevice, GpuError, GpuRuntime, Region,
};
use std::os::fd::AsRawFd;

/// ROCm 6.2: the first release with `hipMemGetHandleForAddressRange`.
const ROCM_6_2: u32 = 60_200_000;

fn mock() -> GpuDevice {
    use_mock_hip(ROCM_6_2)
}

/// The whole conformance suite with every region in (mock) ROCm memory.
mod loopback_suite {
    use kvlane_data::conformance::LoopbackFixture;
    kvlane_data::conformance_tests!(LoopbackFixture(|| Some(super::mock())));
}

/// The whole conformance suite with every region in (mock) ROCm memory.
mod tcp_suite {
    kvlane_data::conformance_tests!(kvlane_data::conformance::TcpFixture(|| Some(super::mock())));
}

#[test]
fn devices_have_lower_case_pci_bus_ids() {
    mock();
    let devs = gpu_devices(GpuRuntime::Rocm).unwrap();
    assert_eq!(devs.len(), 2);
    assert_eq!(devs[0].device, GpuDevice::rocm(0));
    assert_eq!(devs[1].device, GpuDevice::rocm(1));
    // The runtime spells the bus in upper case; sysfs, and kvlane, in lower.
    assert_eq!(devs[0].pci_bus_id, "0000:c3:00.0");
    assert_eq!(devs[1].pci_bus_id, "0000:c4:00.0");
    assert_eq!(devs[0].total_mem, 192 << 30);
    assert!(devs[1].name.contains("mock HIP device 1"), "{}", devs[1]);
}

#[test]
fn missing_device_is_unsupported_naming_it() {
    mock();
    kvlane_data::conformance::missing_device_is_unsupported(GpuDevice::rocm(7), 2);
}

/// HIP's current device is per thread and starts at 0: memory of `rocm:1`
/// lands on device 1, and is copied through device 1's streams, only if
/// kvlane binds the device on the thread that allocates and copies. Run on
/// fresh threads, where nothing bound anything yet.
#[test]
fn second_device_is_bound_on_every_thread() {
    mock();
    let one = GpuDevice::rocm(1);
    // Device 1's context exists before the fresh threads use it (making it
    // may bind it on the thread that does).
    drop(Region::alloc_device(one, 4096, Access::ALL).unwrap());
    let r = std::thread::spawn(move || Region::alloc_device(one, 3 << 20, Access::ALL).unwrap())
        .join()
        .unwrap();
    let addr = r.addr();
    assert_eq!(gpu_device_of(GpuRuntime::Rocm, addr).unwrap(), Some(one));
    let data: Vec<u8> = (0..3 << 20).map(|i| (i % 241) as u8).collect();
    let (r, back) = std::thread::spawn(move || {
        r.copy_in(0, &data).unwrap();
        let back = contents(&r);
        assert!(back == data, "bytes through device 1's staging differ");
        (r, back)
    })
    .join()
    .unwrap();
    assert_eq!(back.len(), 3 << 20);
    // SAFETY: refused before anything uses the pointer.
    let err = unsafe { Region::from_device_ptr(GpuDevice::rocm(0), addr, 4096, Access::ALL, None) }
        .unwrap_err();
    assert!(err.to_string().contains("memory of rocm:1"), "{err}");
    // SAFETY: `r` owns the allocation and outlives `inner`.
    let inner = unsafe { Region::from_device_ptr(one, addr + 4096, 4096, Access::ALL, None) }
        .expect("a range inside device 1's allocation");
    assert_eq!(inner.device(), Some(one));
    drop(inner);
    drop(r);
}

#[test]
fn host_memory_is_not_registered_as_device_memory() {
    let dev = mock();
    let host = vec![0u8; 8192];
    assert_eq!(
        gpu_device_of(GpuRuntime::Rocm, host.as_ptr() as u64).unwrap(),
        None
    );
    // SAFETY: refused before anything uses the pointer.
    let err = unsafe {
        Region::from_device_ptr(dev, host.as_ptr() as u64, host.len(), Access::ALL, None)
    }
    .unwrap_err();
    assert!(
        matches!(&err, DataError::Gpu(GpuError::NotDeviceMemory { device, .. }) if *device == dev),
        "{err:?}"
    );
}

/// ROCm 6.2 exports device memory as a dma-buf: a real descriptor for the
/// page-rounded range, with the region's offset inside it.
#[test]
fn dmabuf_export_covers_the_pages_around_the_region() {
    let dev = mock();
    let whole = Region::alloc_device(dev, 5 * 4096, Access::ALL).unwrap();
    // SAFETY: `whole` owns the allocation and outlives `part`.
    let part =
        unsafe { Region::from_device_ptr(dev, whole.addr() + 4096 + 100, 5000, Access::ALL, None) }
            .unwrap();
    let buf = part.export_dmabuf().unwrap();
    assert_eq!(buf.offset, 100);
    // 100 + 5000 bytes from a page boundary: two pages.
    assert_eq!(buf.len, 2 * 4096);
    let file = std::fs::File::from(buf.fd.try_clone().unwrap());
    assert_eq!(file.metadata().unwrap().len(), 2 * 4096);
    assert!(buf.fd.as_raw_fd() >= 0);
    let full = whole.export_dmabuf().unwrap();
    assert_eq!((full.offset, full.len), (0, 5 * 4096));
}

/// Host to GPU and back over tcp, with a notification that arrives only
/// once the bytes are in the target's (mock) ROCm memory.
#[test]
fn tcp_between_host_and_device_with_notification() {
    kvlane_data::conformance::host_and_device_over_tcp(mock());
}
