//! The blocking wrapper, used from plain threads.

use kvlane::data::{Access, KvLayout, KvParts, LayoutOrder, Region};
use kvlane::{Agent, BackendChoice, BlockingAgent};
use std::time::Duration;

#[test]
fn blocking_agents_transfer_and_notify_without_async_code() {
    let layout = KvLayout::new(2, 8, 512, KvParts::Fused, LayoutOrder::BlockMajor).unwrap();
    let len = layout.required_len().unwrap() as usize;
    let a_kv = Region::from_vec((0..len).map(|i| (i % 253) as u8).collect(), Access::ALL).unwrap();
    let b_kv = Region::alloc(len, Access::ALL).unwrap();
    let build = |name: &str, kv: Region| {
        BlockingAgent::build(
            Agent::builder()
                .engine_id(name)
                .backend(BackendChoice::Tcp)
                .register_kv(layout, kv),
            1,
        )
        .unwrap()
    };
    let a = build("a", a_kv.clone());
    let mut b = build("b", b_kv.clone());
    let peer = a.connect(b.agent().local_addr()).unwrap();
    peer.write_blocks(0..2, &[0, 1, 2], &[5, 6, 7], Some(b"w"))
        .unwrap()
        .wait()
        .unwrap();
    let note = b
        .recv_notification(Duration::from_secs(10))
        .expect("no notification");
    assert_eq!((note.from.as_str(), &note.payload[..]), ("a", &b"w"[..]));
    let off = |blk: u32| layout.offset(0, 0, blk).unwrap() as usize;
    let (a_all, b_all) = (a_kv.to_vec().unwrap(), b_kv.to_vec().unwrap());
    assert_eq!(a_all[off(0)..off(3)], b_all[off(5)..off(8)]);
    // READ with a notification goes through the agent's runtime.
    peer.read_blocks(0..2, &[7], &[0], Some(b"r"))
        .unwrap()
        .wait()
        .unwrap();
    let note = b
        .recv_notification(Duration::from_secs(10))
        .expect("no READ notification");
    assert_eq!(&note.payload[..], b"r");
    a.close();
    b.close();
}
