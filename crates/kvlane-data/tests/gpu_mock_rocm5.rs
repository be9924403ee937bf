//! ROCm 5 against a MOCK HIP runtime that reports 5.7 (`testdata/mock_hip.c`
//! built with `MOCK_HIP_VERSION=50700000`): before ROCm 6, `hipMemoryType`
//! numbered device memory 1 (host 0), and before 6.2 there is no
//! `hipMemGetHandleForAddressRange`. A process loads one runtime, hence this
//! file of its own (ROCm 6.2: `gpu_mock_hip.rs`).

use kvlane_data::conformance::{contents, region_in, run_one, use_mock_hip};
use kvlane_data::{
    connect_pair, gpu_device_of, Access, Backend, DataError, Descriptor, GpuError, GpuRuntime,
    LoopbackBackend, Op, Region, RemoteDescriptor, Transfer,
};

const ROCM_5_7: u32 = 50_700_000;

/// Device memory is recognised in ROCm 5's numbering (read as ROCm 6's, it
/// would be host memory and refused); pageable host memory is not.
#[test]
fn device_memory_is_recognised_in_rocm5_numbering() {
    let dev = use_mock_hip(ROCM_5_7);
    let r = Region::alloc_device(dev, 64 << 10, Access::ALL).unwrap();
    assert_eq!(
        gpu_device_of(GpuRuntime::Rocm, r.addr()).unwrap(),
        Some(dev)
    );
    // SAFETY: `r` owns the allocation and outlives `inner`.
    let inner =
        unsafe { Region::from_device_ptr(dev, r.addr() + 512, 4096, Access::ALL, None) }.unwrap();
    assert_eq!(inner.device(), Some(dev));
    let host = vec![0u8; 4096];
    assert_eq!(
        gpu_device_of(GpuRuntime::Rocm, host.as_ptr() as u64).unwrap(),
        None
    );
}

#[test]
fn dmabuf_export_is_unsupported_naming_the_call() {
    let dev = use_mock_hip(ROCM_5_7);
    let r = Region::alloc_device(dev, 4096, Access::ALL).unwrap();
    let err = r.export_dmabuf().unwrap_err();
    assert!(
        matches!(&err, DataError::Gpu(GpuError::Unsupported { device, .. }) if *device == dev),
        "{err:?}"
    );
    assert!(
        err.to_string().contains("hipMemGetHandleForAddressRange"),
        "{err}"
    );
}

/// A loopback WRITE and READ between two ROCm 5 regions, byte-checked.
#[test]
fn loopback_moves_device_memory() {
    let dev = use_mock_hip(ROCM_5_7);
    let len = (2 << 20) + 5;
    let data: Vec<u8> = (0..len).map(|i| (i % 239) as u8).collect();
    let src = region_in(Some(dev), len, Access::ALL, &data);
    let dst = region_in(Some(dev), len, Access::ALL, &[0]);
    let (mut init, mut target) = (LoopbackBackend::default(), LoopbackBackend::default());
    let src_ad = init.register(&src).unwrap();
    let dst_ad = target.register(&dst).unwrap();
    let (peer, _) = connect_pair(&mut init, &[src_ad], &mut target, &[dst_ad]).unwrap();
    let t = |op| {
        Transfer::new(
            peer,
            op,
            vec![Descriptor {
                region: src.id(),
                offset: 0,
                len: len as u64,
            }],
            vec![RemoteDescriptor {
                key: dst_ad.key,
                offset: 0,
                len: len as u64,
            }],
        )
    };
    run_one(&mut init, &mut target, t(Op::Write)).unwrap();
    assert!(contents(&dst) == data);
    src.copy_in(0, &vec![0; len]).unwrap();
    run_one(&mut init, &mut target, t(Op::Read)).unwrap();
    assert!(contents(&src) == data);
}
