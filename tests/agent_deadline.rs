//! `AgentBuilder::transfer_deadline`: a transfer's deadline runs from its
//! post (a plan made ahead keeps the whole deadline), and a transfer that
//! outlives it fails with `ErrorKind::Timeout`.

use kvlane::data::{Access, Op, Region};
use kvlane::{Agent, BackendChoice, ErrorKind, MemSpan};
use std::time::{Duration, Instant};

async fn agent(name: &str, region: Region, deadline: Duration) -> Agent {
    Agent::builder()
        .engine_id(name)
        .backend(BackendChoice::Tcp)
        .transfer_deadline(deadline)
        .register_region(region)
        .build()
        .await
        .unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_plan_posted_after_the_deadline_has_passed_since_its_prepare_still_runs() {
    let deadline = Duration::from_millis(300);
    let src: Vec<u8> = (0..4096u32).map(|i| (i * 7) as u8).collect();
    let a_mem = Region::from_vec(src.clone(), Access::ALL).unwrap();
    let b_mem = Region::from_vec(vec![0; 4096], Access::ALL).unwrap();
    let a = agent("a", a_mem.clone(), deadline).await;
    let b = agent("b", b_mem.clone(), deadline).await;
    let peer = a.connect(b.local_addr()).await.unwrap();
    let local = [MemSpan::new(a_mem.addr(), 4096)];
    let remote = [MemSpan::new(b_mem.addr(), 4096)];
    let prepared = peer
        .prepare_spans(Op::Write, &local, &remote, None)
        .unwrap();
    let again = [prepared.again(), prepared.again()];
    let prepared_at = Instant::now();
    // Twice the deadline between the prepare and the posts.
    tokio::time::sleep(2 * deadline).await;
    let before = Instant::now();
    let handle = peer.post(prepared).unwrap();
    let after = Instant::now();
    // The deadline's clock read is the post's, and the handle reports it.
    let posted = handle.posted_at();
    assert!(
        before <= posted && posted <= after,
        "{before:?} {posted:?} {after:?}"
    );
    assert!(posted >= prepared_at + 2 * deadline);
    handle.await.unwrap();
    assert_eq!(b_mem.to_vec().unwrap(), src);
    let before = Instant::now();
    let handles: Vec<_> = peer
        .post_batch(again.into())
        .into_iter()
        .map(Result::unwrap)
        .collect();
    let after = Instant::now();
    // One clock read for the whole batch.
    let posted = handles[0].posted_at();
    assert!(before <= posted && posted <= after);
    assert!(handles.iter().all(|h| h.posted_at() == posted));
    for h in handles {
        h.await.unwrap();
    }
    a.close().await;
    b.close().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_transfer_longer_than_the_deadline_fails_with_timeout() {
    // 256 MiB over tcp takes tens of milliseconds at least; the deadline
    // is the 1 ms floor (a zero asks for it).
    const LEN: usize = 256 << 20;
    let a_mem = Region::alloc(LEN, Access::ALL).unwrap();
    let b_mem = Region::alloc(LEN, Access::ALL).unwrap();
    let a = agent("a", a_mem.clone(), Duration::ZERO).await;
    let b = agent("b", b_mem.clone(), Duration::from_secs(30)).await;
    let peer = a.connect(b.local_addr()).await.unwrap();
    let local = [MemSpan::new(a_mem.addr(), LEN as u64)];
    let remote = [MemSpan::new(b_mem.addr(), LEN as u64)];
    let started = Instant::now();
    let err = peer
        .post(
            peer.prepare_spans(Op::Write, &local, &remote, None)
                .unwrap(),
        )
        .unwrap()
        .await
        .unwrap_err();
    assert_eq!(err.kind(), ErrorKind::Timeout, "{err}");
    // Failed by its deadline, not by some later bound (generous slack for
    // a loaded machine; the default deadline is 30 s).
    assert!(
        started.elapsed() < Duration::from_secs(10),
        "{:?}",
        started.elapsed()
    );
    a.close().await;
    b.close().await;
}

/// A deadline past what the clock can hold is clamped
/// (`MAX_TRANSFER_DEADLINE`), not a panic at the post; and a READ whose
/// notification the control plane cannot carry is refused at its
/// prepare, before any byte moves.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_endless_deadline_is_clamped_and_an_oversized_read_notification_is_refused_up_front() {
    let src: Vec<u8> = (0..4096u32).map(|i| (i * 3) as u8).collect();
    let a_mem = Region::from_vec(vec![0; 4096], Access::ALL).unwrap();
    let b_mem = Region::from_vec(src.clone(), Access::ALL).unwrap();
    let a = agent("a", a_mem.clone(), Duration::MAX).await;
    let b = agent("b", b_mem.clone(), Duration::MAX).await;
    let peer = a.connect(b.local_addr()).await.unwrap();
    let local = [MemSpan::new(a_mem.addr(), 4096)];
    let remote = [MemSpan::new(b_mem.addr(), 4096)];
    let Err(err) = peer.prepare_spans(Op::Read, &local, &remote, Some(&[7u8; 70_000])) else {
        panic!("a READ with a 70,000-byte notification was prepared");
    };
    assert_eq!(err.kind(), ErrorKind::InvalidInput, "{err}");
    assert!(
        err.to_string().contains("notification") && err.to_string().contains(b.local_addr()),
        "{err}"
    );
    assert_eq!(a_mem.to_vec().unwrap(), vec![0; 4096], "nothing moved");
    let handle = peer
        .post(
            peer.prepare_spans(Op::Read, &local, &remote, Some(b"fits"))
                .unwrap(),
        )
        .unwrap();
    handle.await.unwrap();
    assert_eq!(a_mem.to_vec().unwrap(), src);
    a.close().await;
    b.close().await;
}
