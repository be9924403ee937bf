//! Every event that ends a wait on the tcp backend wakes the sleeping
//! progress thread (issue 40, item 1: a transfer whose bytes arrived
//! never waits for a timer).
//!
//! A [`Transport`] on tcp has no periodic poll: with nothing in flight its
//! progress thread sleeps until woken, and with work in flight until the
//! earliest deadline. Each test here lets the driver fall asleep, gives
//! its transfers a deadline of a minute, and expects the event under test
//! (an answer, a notification, a lost peer, an earlier deadline, room in
//! the notification channel) to be seen within a few seconds: only a
//! wake-up can do that, so a lost one fails the test instead of being
//! hidden by a re-poll. Nothing here measures how fast.

use kvlane_data::tcp::wire::{HELLO_ACK, HELLO_LEN};
use kvlane_data::{
    connect_pair, Access, Backend, DataError, Descriptor, Notification, Op, PeerId, Region,
    RemoteDescriptor, RemoteKey, RemoteRegion, TcpBackend, TcpConfig, TcpEndpoint, Transfer,
    Transport, NOTIFY_CHANNEL,
};
use std::io::Read;
use std::net::{Shutdown, TcpListener, TcpStream};
use std::sync::{Arc, Mutex};
use std::thread;
use std::time::{Duration, Instant};
use tokio::sync::mpsc::Receiver;

/// Far beyond `WITHIN`: a transfer that ends within `WITHIN` was not
/// ended by a timer of its own.
const FAR: Duration = Duration::from_secs(60);
/// How long a test waits for the event's effect (generous for a loaded
/// machine; a lost wake-up would take until `FAR`).
const WITHIN: Duration = Duration::from_secs(5);
/// Long enough for the progress thread to finish its turn and sleep.
const SETTLE: Duration = Duration::from_millis(100);
const LEN: usize = 1 << 20;

/// Two connected tcp transports.
struct Pair {
    init: Transport,
    target: Transport,
    /// The target, as the initiator knows it.
    peer: PeerId,
    src: Region,
    /// The target's region (registered for as long as the pair lives).
    _dst: Region,
    ad: RemoteRegion,
}

fn pair() -> Pair {
    let mut init = TcpBackend::new(TcpConfig::default()).unwrap();
    let mut target = TcpBackend::new(TcpConfig::default()).unwrap();
    let src = Region::from_vec(vec![7; LEN], Access::ALL).unwrap();
    let dst = Region::alloc(LEN, Access::ALL).unwrap();
    let src_ad = init.register(&src).unwrap();
    let ad = target.register(&dst).unwrap();
    let (peer, _) = connect_pair(&mut init, &[src_ad], &mut target, &[ad]).unwrap();
    Pair {
        init: Transport::new(init).unwrap(),
        target: Transport::new(target).unwrap(),
        peer,
        src,
        _dst: dst,
        ad,
    }
}

fn write(peer: PeerId, src: &Region, key: RemoteKey, offset: u64, len: u64) -> Transfer {
    one_sided(Op::Write, peer, src, key, offset, len)
}

fn one_sided(
    op: Op,
    peer: PeerId,
    src: &Region,
    key: RemoteKey,
    offset: u64,
    len: u64,
) -> Transfer {
    Transfer::new(
        peer,
        op,
        vec![Descriptor {
            region: src.id(),
            offset,
            len,
        }],
        vec![RemoteDescriptor { key, offset, len }],
    )
    .with_deadline(Instant::now() + FAR)
}

/// A target that authenticates every stream and then neither reads nor
/// answers; the streams it holds are closed through the returned list.
fn silent_target() -> (TcpEndpoint, RemoteRegion, Arc<Mutex<Vec<TcpStream>>>) {
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = listener.local_addr().unwrap();
    let held = Arc::new(Mutex::new(Vec::new()));
    let streams = held.clone();
    thread::spawn(move || {
        for s in listener.incoming() {
            let Ok(mut s) = s else { return };
            let mut hello = [0u8; HELLO_LEN];
            let challenge = kvlane_data::tcp::wire::Challenge::fresh().encode();
            if std::io::Write::write_all(&mut s, &challenge).is_ok()
                && s.read_exact(&mut hello).is_ok()
                && std::io::Write::write_all(&mut s, &HELLO_ACK).is_ok()
                && kvlane_data::tcp::wire::answer_fence(&mut s).is_ok()
            {
                streams.lock().unwrap().push(s);
            }
        }
    });
    let ep = TcpEndpoint {
        addr,
        listen: addr,
        token: [5; 16],
    };
    let ad = RemoteRegion {
        key: RemoteKey(1),
        addr: 0,
        len: LEN as u64,
        access: Access::ALL,
    };
    (ep, ad, held)
}

/// An initiator transport connected to `ep` (its streams authenticated).
fn initiator_to(ep: &TcpEndpoint, ad: RemoteRegion) -> (Transport, PeerId, Region) {
    let mut b = TcpBackend::new(TcpConfig::default()).unwrap();
    let src = Region::from_vec(vec![7; LEN], Access::ALL).unwrap();
    b.register(&src).unwrap();
    let (peer, _) = b.prepare_peer().unwrap();
    b.connect_peer(peer, &ep.to_endpoint(), &[ad]).unwrap();
    (Transport::new(b).unwrap(), peer, src)
}

/// The next `n` notifications, or panics naming how many came.
fn receive(notes: &mut Receiver<Notification>, n: usize) -> Vec<Notification> {
    let end = Instant::now() + WITHIN;
    let mut got = Vec::with_capacity(n);
    while got.len() < n {
        match notes.try_recv() {
            Ok(note) => got.push(note),
            Err(_) => {
                assert!(
                    Instant::now() < end,
                    "{} of {n} notifications within {WITHIN:?}",
                    got.len()
                );
                thread::sleep(Duration::from_millis(1));
            }
        }
    }
    got
}

#[test]
fn an_answer_wakes_a_sleeping_driver() {
    let p = pair();
    let (init, peer, src, ad) = (&p.init, p.peer, &p.src, p.ad);
    for round in 0..10u64 {
        thread::sleep(SETTLE);
        let mut h = init
            .submit(write(peer, src, ad.key, round * 4096, 4096))
            .unwrap();
        let r = h
            .wait_timeout(WITHIN)
            .unwrap_or_else(|| panic!("round {round}: no result (its deadline is {FAR:?} away)"));
        r.unwrap_or_else(|e| panic!("round {round}: {e}"));
    }
}

#[test]
fn a_notification_wakes_an_idle_target() {
    let p = pair();
    let (init, peer, src, ad) = (&p.init, p.peer, &p.src, p.ad);
    let mut notes = p.target.take_notifications().unwrap();
    for round in 0..10u8 {
        // The target has nothing in flight: only the arrival wakes it.
        thread::sleep(SETTLE);
        let t = write(peer, src, ad.key, 0, 64).with_notify(vec![round]);
        init.submit(t).unwrap().wait().unwrap();
        let note = &receive(&mut notes, 1)[0];
        assert_eq!(&note.payload[..], &[round]);
    }
}

#[test]
fn a_lost_peer_wakes_a_sleeping_driver() {
    let (ep, ad, streams) = silent_target();
    let (init, peer, src) = initiator_to(&ep, ad);
    let mut h = init.submit(write(peer, &src, ad.key, 0, 4096)).unwrap();
    thread::sleep(SETTLE);
    assert!(!h.is_done(), "a silent target answered");
    for s in streams.lock().unwrap().drain(..) {
        let _ = s.shutdown(Shutdown::Both);
    }
    let r = h
        .wait_timeout(WITHIN)
        .unwrap_or_else(|| panic!("no result after the peer closed (deadline {FAR:?} away)"));
    assert!(r.as_ref().is_err_and(DataError::is_peer_lost), "{r:?}");
}

/// A transfer with an earlier deadline than the one the driver sleeps
/// until is seen to time out at its own. (READs: a WRITE that times out
/// unanswered aborts and fences its connection, failing the other.)
#[test]
fn an_earlier_deadline_behind_a_later_one_fires() {
    let (ep, ad, _streams) = silent_target();
    let (init, peer, src) = initiator_to(&ep, ad);
    let mut far = init
        .submit(one_sided(Op::Read, peer, &src, ad.key, 0, 4096))
        .unwrap();
    thread::sleep(SETTLE);
    let deadline = Instant::now() + Duration::from_millis(300);
    let mut near = init
        .submit(one_sided(Op::Read, peer, &src, ad.key, 4096, 4096).with_deadline(deadline))
        .unwrap();
    let r = near
        .wait_timeout(WITHIN)
        .expect("a 300 ms deadline not seen while another's is a minute away");
    assert!(r.as_ref().is_err_and(DataError::is_timeout), "{r:?}");
    assert!(Instant::now() >= deadline, "timed out early");
    assert!(!far.is_done(), "the later transfer ended with the earlier");
    drop(init);
    assert!(matches!(
        far.wait_timeout(WITHIN),
        Some(Err(DataError::Shutdown(_)))
    ));
}

/// Notifications that did not fit in the channel are held back; once the
/// application makes room they reach it with nothing else arriving.
#[test]
fn held_notifications_move_once_the_application_reads() {
    let p = pair();
    let (init, peer, src, ad) = (&p.init, p.peer, &p.src, p.ad);
    let mut notes = p.target.take_notifications().unwrap();
    let n = NOTIFY_CHANNEL + 64;
    let handles: Vec<_> = (0..n as u32)
        .map(|i| {
            let t = write(peer, src, ad.key, 0, 64).with_notify(i.to_le_bytes().to_vec());
            init.submit(t).unwrap()
        })
        .collect();
    for h in handles {
        h.wait()
            .expect("the target's queue holds every notification");
    }
    thread::sleep(SETTLE);
    let got = receive(&mut notes, n);
    let mut ids: Vec<u32> = got
        .iter()
        .map(|note| u32::from_le_bytes(note.payload[..4].try_into().unwrap()))
        .collect();
    ids.sort_unstable();
    assert_eq!(ids, (0..n as u32).collect::<Vec<_>>());
}
