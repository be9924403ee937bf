//! Without a CUDA driver (the loader is pointed at a path that cannot
//! exist, so this holds on any machine): GPU memory is one clear
//! `Unsupported` error naming the device and the library, through the data
//! plane and the facade.

use kvlane::data::{gpu_devices, Access, DataError, GpuDevice, GpuRuntime, Region};
use kvlane::ErrorKind;

#[test]
fn no_cuda_driver_is_unsupported_naming_device_and_library() {
    // The only test of this binary: set before any GPU use in the process.
    std::env::set_var("KVLANE_CUDA_LIBRARY", "/nonexistent/libcuda.so.1");
    let check = |e: DataError| {
        let msg = e.to_string();
        assert!(
            msg.starts_with(
                "cuda:0: unsupported: no cuda driver: cannot load /nonexistent/libcuda.so.1"
            ),
            "{msg}"
        );
        let DataError::Gpu(g) = &e else {
            panic!("{e:?}")
        };
        assert!(g.is_unsupported() && g.device() == GpuDevice::cuda(0));
        assert_eq!(kvlane::Error::from(e).kind(), ErrorKind::Unsupported);
    };
    check(Region::alloc_device(GpuDevice::cuda(0), 1 << 20, Access::ALL).unwrap_err());
    let fake = 0x7f00_0000_0000u64;
    // SAFETY: refused before anything uses the pointer (no driver).
    check(
        unsafe { Region::from_device_ptr(GpuDevice::cuda(0), fake, 4096, Access::ALL, None) }
            .unwrap_err(),
    );
    check(DataError::Gpu(gpu_devices(GpuRuntime::Cuda).unwrap_err()));
}
