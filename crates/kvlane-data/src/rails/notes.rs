//! At most one delivery of each notification, whatever the rails.
//!
//! A part that fails on a rail (peer lost, I/O, part timeout) moves to
//! another rail whole, notification included, and its NOTIFY may already
//! have reached the target over the first rail. So between two rails
//! endpoints that both say they can ([`RailsWire`](super::RailsWire)
//! `tags`) and pair more than one rail, every notification travels as a
//! tagged note of the rails protocol:
//!
//! ```text
//! TAG_PREFIX (0xc1 "kvlane-note" 0x00) | sender: u64 LE | tag: u64 LE | payload
//! ```
//!
//! `sender` is random, per peer and connection: each side's rails endpoint
//! carries the one its notifications to that peer will name (`note`), so
//! the receiver finds the sender's memory by it even where the rail cannot
//! name the peer a notification came from (loopback), and checks it
//! against that peer where the rail can. The tag is the sender's sequence
//! number of notified transfers to that peer; a restarted or reconnected
//! peer is a new connection with a new `sender` and a fresh memory. Every
//! post of one transfer carries the same tag, on whatever rail. The
//! receiver hands a tag's payload to the application the first time only
//! ([`Seen`]). `0xc1` never starts msgpack; an application notification
//! that begins with the prefix is refused at submit, as the rejoin
//! messages' is.
//!
//! **Bounded memory.** [`Seen`] remembers the last [`WINDOW`] tags below
//! the highest one taken from that peer, one bit each (8 KiB per peer, made
//! on the first tagged note). A note whose tag is older than that is
//! dropped and counted as a duplicate ([`RailStats::dropped`](super::RailStats)):
//! at most once is the promise, and a first delivery that late (the
//! peer sent `WINDOW` newer notifications, which arrived, before it)
//! does not happen on rails that move a part within a part timeout.
//!
//! A tagged note whose `sender` names no peer of this side, or another
//! peer than the rail peer it arrived on belongs to, is dropped and
//! counted the same way: there is no memory to check it against.
//!
//! **Older peers.** A peer whose endpoint does not say `tags` gets plain
//! notifications; a part with a notification to it is never posted twice
//! (its failure fails the transfer: the NOTIFY may or may not have
//! arrived).

/// The first bytes of a tagged note (`0xc1` never starts msgpack).
pub(crate) const TAG_PREFIX: &[u8] = b"\xc1kvlane-note\x00";

/// Tags remembered per peer below the highest one taken (one bit each).
pub(super) const WINDOW: u64 = 1 << 16;

/// Bytes before the payload of a tagged note.
const HEADER: usize = TAG_PREFIX.len() + 16;

/// `payload` tagged with `tag`, from `sender`.
pub(super) fn tag(sender: u64, tag: u64, payload: &[u8]) -> bytes::Bytes {
    let mut out = Vec::with_capacity(HEADER + payload.len());
    out.extend_from_slice(TAG_PREFIX);
    out.extend_from_slice(&sender.to_le_bytes());
    out.extend_from_slice(&tag.to_le_bytes());
    out.extend_from_slice(payload);
    out.into()
}

/// The sender, the tag and where the payload starts, for a tagged note;
/// `None` for anything else (`Some(None)`: the prefix, too short).
pub(super) fn untag(note: &[u8]) -> Option<Option<(u64, u64, usize)>> {
    note.strip_prefix(TAG_PREFIX)?;
    let Some(h) = note.get(TAG_PREFIX.len()..HEADER) else {
        return Some(None);
    };
    let (s, t) = h.split_at(8);
    let word = |b: &[u8]| u64::from_le_bytes(b.try_into().expect("8 bytes"));
    Some(Some((word(s), word(t), HEADER)))
}

/// The tags taken from one peer: the highest, and the [`WINDOW`] below it.
#[derive(Debug, Default)]
pub(super) struct Seen {
    /// One past the highest tag taken (0: none yet).
    top: u64,
    /// Bit `t % WINDOW`: tag `t` taken, for `top - WINDOW <= t < top`.
    bits: Vec<u64>,
}

impl Seen {
    /// Whether `tag` is new (and from now on taken).
    pub(super) fn take(&mut self, tag: u64) -> bool {
        if self.bits.is_empty() {
            self.bits = vec![0; (WINDOW / 64) as usize];
        }
        let Some(next) = tag.checked_add(1) else {
            return false;
        };
        if next > self.top {
            // Tags from `top` up to `tag` leave the window's far end.
            let clear = (next - self.top).min(WINDOW);
            for t in self.top..self.top + clear {
                self.set(t, false);
            }
            self.top = next;
            self.set(tag, true);
            return true;
        }
        if self.top - tag > WINDOW || self.get(tag) {
            return false;
        }
        self.set(tag, true);
        true
    }

    fn get(&self, t: u64) -> bool {
        let i = t % WINDOW;
        self.bits[(i / 64) as usize] & (1 << (i % 64)) != 0
    }

    fn set(&mut self, t: u64, on: bool) {
        let i = t % WINDOW;
        let w = &mut self.bits[(i / 64) as usize];
        if on {
            *w |= 1 << (i % 64);
        } else {
            *w &= !(1 << (i % 64));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::{connect_pair, Backend};
    use crate::error::DataError;
    use crate::intercept::Intercept;
    use crate::loopback::LoopbackBackend;
    use crate::memory::{Access, Region};
    use crate::rails::{Rails, RailsConfig};
    use crate::transfer::{Completion, Descriptor, Notification, Op, RemoteDescriptor, Transfer};
    use std::sync::atomic::{AtomicBool, Ordering};
    use std::sync::Arc;

    /// Two loopback rails each side (they name no sender); the sender's
    /// first completion fails with the peer lost once `fail` is set,
    /// after its NOTIFY was delivered. With `tagged` false the sender
    /// treats the peer as one that takes plain notifications. The
    /// sender's outcome and the notifications the receiver handed on.
    fn notify_then_fail(tagged: bool) -> (Result<(), DataError>, Vec<Notification>) {
        let fail = Arc::new(AtomicBool::new(true));
        let rail = |fail: &Arc<AtomicBool>| -> Box<dyn Backend> {
            let fail = fail.clone();
            Box::new(
                Intercept::new(LoopbackBackend::default()).on_completions(move |cs| {
                    for c in cs {
                        if fail.swap(false, Ordering::SeqCst) {
                            c.result = Err(DataError::PeerLost {
                                peer: c.peer,
                                reason: "reset after the NOTIFY (test)",
                                source: None,
                            });
                        }
                    }
                }),
            )
        };
        let mut a = Rails::new(
            vec![("r0".into(), rail(&fail)), ("r1".into(), rail(&fail))],
            RailsConfig::default(),
        )
        .unwrap();
        let lo = || -> Box<dyn Backend> { Box::new(LoopbackBackend::default()) };
        let mut b = Rails::new(
            vec![("r0".into(), lo()), ("r1".into(), lo())],
            RailsConfig::default(),
        )
        .unwrap();
        let src = Region::from_vec(vec![7; 4096], Access::ALL).unwrap();
        let dst = Region::alloc(4096, Access::ALL).unwrap();
        let s = a.register(&src).unwrap();
        let d = b.register(&dst).unwrap();
        let (peer, _) = connect_pair(&mut a, &[s], &mut b, &[d]).unwrap();
        assert!(a.peers[&peer].tag_notes);
        a.peers.get_mut(&peer).unwrap().tag_notes = tagged;
        let t = Transfer::new(
            peer,
            Op::Write,
            vec![Descriptor {
                region: src.id(),
                offset: 0,
                len: 4096,
            }],
            vec![RemoteDescriptor {
                key: d.key,
                offset: 0,
                len: 4096,
            }],
        )
        .with_notify(&b"req-1 done"[..]);
        let id = t.id;
        a.submit(t).unwrap();
        let (mut out, mut notes) = (Vec::<Completion>::new(), Vec::new());
        for _ in 0..50 {
            a.poll(&mut out);
            b.poll(&mut Vec::new());
            b.poll_notifications(&mut notes);
        }
        assert!(!fail.load(Ordering::SeqCst), "nothing failed");
        let c = out.into_iter().find(|c| c.id == id).expect("completed");
        (c.result, notes)
    }

    #[test]
    fn a_part_moved_after_its_notify_left_is_notified_once() {
        let (r, notes) = notify_then_fail(true);
        r.unwrap();
        assert_eq!(notes.len(), 1, "{notes:?}");
        assert_eq!(&notes[0].payload[..], b"req-1 done");
    }

    #[test]
    fn to_a_peer_that_takes_plain_notifications_a_notified_part_is_never_posted_twice() {
        let (r, notes) = notify_then_fail(false);
        assert!(matches!(r, Err(DataError::PeerLost { .. })), "{r:?}");
        assert_eq!(notes.len(), 1, "{notes:?}");
        assert_eq!(&notes[0].payload[..], b"req-1 done");
    }

    #[test]
    fn a_tag_is_taken_once_in_any_order() {
        let mut s = Seen::default();
        for t in [5, 3, 4, 0, 9, 1] {
            assert!(s.take(t), "{t}");
        }
        for t in [5, 3, 4, 0, 9, 1] {
            assert!(!s.take(t), "{t} again");
        }
        assert!(s.take(2));
        assert!(s.take(WINDOW + 8));
        // 9 is still inside the window, 8 has left it: dropped, never
        // delivered a second time.
        assert!(!s.take(9));
        assert!(!s.take(8));
        assert!(s.take(WINDOW + 7));
        // A jump past the whole window forgets everything below it.
        assert!(s.take(10 * WINDOW));
        assert!(!s.take(10 * WINDOW));
        assert!(!s.take(WINDOW + 9));
        assert!(s.take(10 * WINDOW - 1));
        assert!(!s.take(u64::MAX));
    }

    #[test]
    fn a_note_round_trips() {
        let n = tag(99, 7, b"req-7 done");
        let (s, t, at) = untag(&n).unwrap().unwrap();
        assert_eq!((s, t, &n[at..]), (99, 7, &b"req-7 done"[..]));
        assert_eq!(untag(b"req-7 done"), None);
        assert_eq!(untag(&n[..TAG_PREFIX.len() + 11]), Some(None));
    }
}
