//! A store-and-forward proxy for tests of late bytes (issue 41, item 6):
//! it forwards every connection both ways, but once told to hold, keeps
//! what the clients of the connections made before that send (optionally resetting that
//! client) and delivers it to the target only when told to release,
//! seconds later, over the connection the target still serves.

use std::io::{Read, Write};
use std::net::{Shutdown, SocketAddr, TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

/// What the proxy does to the connections made before `hold` was set
/// (the initiator's data streams) once it is set.
#[derive(Clone, Copy, PartialEq, Eq)]
pub(crate) enum Then {
    /// Keeps what the initiator sends; the initiator times out.
    Hold,
    /// Keeps what the initiator sends and resets the initiator's side
    /// as soon as some arrived; the initiator sees a lost connection.
    HoldAndReset,
}

pub(crate) struct Proxy {
    pub(crate) addr: SocketAddr,
    pub(crate) hold: Arc<AtomicBool>,
    pub(crate) release: Arc<AtomicBool>,
    /// Bytes held, then bytes delivered late.
    pub(crate) held: Arc<AtomicUsize>,
    pub(crate) delivered: Arc<AtomicUsize>,
    /// Set: the proxy's listener is closed (new connections are refused,
    /// as by a host whose network is down); the connections it made keep
    /// holding and delivering.
    pub(crate) unreachable: Arc<AtomicBool>,
}

impl Proxy {
    /// Closes the listener: the target is unreachable at this address
    /// from now on (connects are refused).
    #[allow(dead_code)] // not every test binary that includes this uses it
    pub(crate) fn stop_accepting(&self) {
        self.unreachable.store(true, Ordering::SeqCst);
        // Wake the accept loop so that it sees the flag and closes.
        let _ = TcpStream::connect(self.addr);
        let end = std::time::Instant::now() + Duration::from_secs(5);
        while TcpStream::connect(self.addr).is_ok() {
            assert!(
                std::time::Instant::now() < end,
                "the proxy's listener did not close"
            );
            std::thread::sleep(Duration::from_millis(5));
        }
    }
}

/// A proxy in front of `target`. Every connection is forwarded both
/// ways; once `hold` is set, the bytes the clients of those made before send
/// are kept (and with `HoldAndReset` the client is reset) until
/// `release` is set, and then sent on to the target over the
/// proxy's still open connection to it (whether or not the client
/// is still connected).
pub(crate) fn proxy(target: SocketAddr, then: Then) -> Proxy {
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let p = Proxy {
        addr: listener.local_addr().unwrap(),
        hold: Arc::default(),
        release: Arc::default(),
        held: Arc::default(),
        delivered: Arc::default(),
        unreachable: Arc::default(),
    };
    let (hold, release, held, delivered, unreachable) = (
        p.hold.clone(),
        p.release.clone(),
        p.held.clone(),
        p.delivered.clone(),
        p.unreachable.clone(),
    );
    std::thread::spawn(move || {
        for client in listener.incoming() {
            if unreachable.load(Ordering::SeqCst) {
                // Dropping the listener closes the port.
                return;
            }
            let Ok(client) = client else { return };
            // Held: the connections made before `hold` was set (the
            // initiator's own), not the ones made since (its fence).
            let early = !hold.load(Ordering::SeqCst);
            let Ok(server) = TcpStream::connect(target) else {
                continue;
            };
            let (c2, s2) = (client.try_clone().unwrap(), server.try_clone().unwrap());
            std::thread::spawn(move || {
                let mut buf = [0u8; 16 << 10];
                let (mut from, mut to) = (s2, c2);
                while let Ok(k) = from.read(&mut buf) {
                    if k == 0 || to.write_all(&buf[..k]).is_err() {
                        break;
                    }
                }
            });
            let (hold, release, held, delivered) = (
                hold.clone(),
                release.clone(),
                held.clone(),
                delivered.clone(),
            );
            std::thread::spawn(move || {
                let (mut from, mut to) = (client, server);
                let _ = from.set_read_timeout(Some(Duration::from_millis(10)));
                let mut kept = Vec::new();
                let mut buf = [0u8; 16 << 10];
                let mut open = true;
                loop {
                    if !kept.is_empty() && release.load(Ordering::SeqCst) {
                        if to.write_all(&kept).is_err() {
                            return;
                        }
                        delivered.fetch_add(kept.len(), Ordering::SeqCst);
                        kept.clear();
                    }
                    if !open {
                        if kept.is_empty() {
                            // Keep the target's side open a while: it
                            // reads at its own pace.
                            std::thread::sleep(Duration::from_secs(2));
                            return;
                        }
                        std::thread::sleep(Duration::from_millis(10));
                        continue;
                    }
                    let k = match from.read(&mut buf) {
                        Ok(0) => {
                            open = false;
                            continue;
                        }
                        Ok(k) => k,
                        Err(e)
                            if matches!(
                                e.kind(),
                                std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
                            ) =>
                        {
                            continue
                        }
                        Err(_) => {
                            open = false;
                            continue;
                        }
                    };
                    if early && hold.load(Ordering::SeqCst) && !release.load(Ordering::SeqCst) {
                        kept.extend_from_slice(&buf[..k]);
                        held.fetch_add(k, Ordering::SeqCst);
                        if then == Then::HoldAndReset {
                            let _ = socket2::SockRef::from(&from).set_linger(Some(Duration::ZERO));
                            let _ = from.shutdown(Shutdown::Both);
                            open = false;
                        }
                    } else if to.write_all(&buf[..k]).is_err() {
                        return;
                    }
                }
            });
        }
    });
    p
}
