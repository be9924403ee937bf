//! Tests of the verbs backend against a real RDMA device (Soft-RoCE in CI:
//! `ci/softroce.sh -c 'KVLANE_TEST_VERBS_DEVICE=rxe0 <test binary> --ignored --test-threads=1'`).
//!
//! Every test is `#[ignore]`d and selects its device from
//! `KVLANE_TEST_VERBS_DEVICE`; run without it, a test panics with a clear
//! message instead of passing over zero devices.
#![cfg(feature = "verbs")]

use std::sync::Arc;
use std::time::{Duration, Instant};

use kvlane_data::verbs::{
    CompletionQueue, ConnectedQp, Context, DeviceConfig, MrAccess, ProtectionDomain, QpBuilder,
    SendWr, WorkCompletion, WrOp,
};

/// The device under test; panics loudly when unset.
fn device() -> String {
    match std::env::var("KVLANE_TEST_VERBS_DEVICE") {
        Ok(d) if !d.trim().is_empty() => d.trim().to_owned(),
        _ => panic!(
            "KVLANE_TEST_VERBS_DEVICE is not set: these tests need an RDMA device \
             (e.g. KVLANE_TEST_VERBS_DEVICE=rxe0 inside ci/softroce.sh)"
        ),
    }
}

fn open() -> Arc<Context> {
    let name = device();
    Context::open(&DeviceConfig::device(&name))
        .unwrap_or_else(|e| panic!("cannot open rdma device {name}: {e} ({e:?})"))
}

/// Two connected QPs on one device, sharing one CQ.
fn pair(
    ctx: &Arc<Context>,
) -> (
    Arc<ProtectionDomain>,
    ConnectedQp,
    ConnectedQp,
    Arc<CompletionQueue>,
) {
    let pd = ctx.alloc_pd().expect("alloc pd");
    let cq = ctx.create_cq(1024).expect("create cq");
    let a = QpBuilder::new(&pd, &cq, &cq).build().expect("build qp a");
    let b = QpBuilder::new(&pd, &cq, &cq).build().expect("build qp b");
    let (ea, eb) = (a.endpoint(), b.endpoint());
    let a = a.connect(&eb).expect("connect a");
    let b = b.connect(&ea).expect("connect b");
    (pd, a, b, cq)
}

fn wait(cq: &CompletionQueue, n: usize) -> Vec<WorkCompletion> {
    let mut out = Vec::new();
    let deadline = Instant::now() + Duration::from_secs(20);
    while out.len() < n {
        cq.poll(&mut out).expect("poll cq");
        assert!(
            Instant::now() < deadline,
            "timed out waiting for {n} completions, got {out:?}"
        );
    }
    out
}

#[test]
#[ignore = "needs an RDMA device: set KVLANE_TEST_VERBS_DEVICE"]
fn raw_qp_write_read_and_imm() {
    let ctx = open();
    let info = ctx.info().clone();
    eprintln!("{info}");
    assert!(ctx.limits().max_qp_wr > 0, "device reports max_qp_wr=0");
    let len = 1 << 16;
    let mut src = vec![0u8; len];
    let mut dst = vec![0u8; len];
    for (i, b) in src.iter_mut().enumerate() {
        *b = (i % 251) as u8;
    }
    let (pd, mut qa, mut qb, cq2) = pair(&ctx);
    assert_eq!(qa.mtu(), qb.mtu());

    // SAFETY: src/dst live until the end of the test, after all completions.
    let msrc = unsafe { pd.register_host(src.as_ptr() as usize, len, MrAccess::ALL) }.expect("reg");
    // SAFETY: as above.
    let mdst =
        unsafe { pd.register_host(dst.as_mut_ptr() as usize, len, MrAccess::ALL) }.expect("reg");

    qb.post_recv([77]).expect("post recv");
    let wr = SendWr {
        wr_id: 1,
        op: WrOp::Write(Some(0xabcd)),
        local_addr: msrc.addr(),
        len: len as u32,
        lkey: msrc.lkey(),
        remote_addr: mdst.addr(),
        rkey: mdst.rkey(),
        signaled: true,
    };
    // SAFETY: both buffers are registered and outlive the completions awaited below.
    unsafe { qa.post_send(&[wr]) }.expect("post write");
    let wcs = wait(&cq2, 2);
    assert!(wcs.iter().all(|w| w.status == 0), "{wcs:?}");
    let recv = wcs.iter().find(|w| w.wr_id == 77).expect("recv completion");
    assert_eq!(recv.imm, 0xabcd);
    assert_eq!(src, dst);

    let mut back = vec![0u8; len];
    // SAFETY: lives until after the completion below.
    let mback =
        unsafe { pd.register_host(back.as_mut_ptr() as usize, len, MrAccess::ALL) }.expect("reg");
    let rd = SendWr {
        wr_id: 2,
        op: WrOp::Read,
        local_addr: mback.addr(),
        len: len as u32,
        lkey: mback.lkey(),
        remote_addr: mdst.addr(),
        rkey: mdst.rkey(),
        signaled: true,
    };
    // SAFETY: as above.
    unsafe { qb.post_send(&[rd]) }.expect("post read");
    let wcs = wait(&cq2, 1);
    assert_eq!(wcs[0].status, 0, "{wcs:?}");
    assert_eq!(back, src);
}
