//! The initiator side of the shm backend: a connection to one target,
//! with the target's regions mapped into this process.

use super::sys::{map_peer, recv_msg, send_msg, MapRefusal};
use super::wire::{self, Granted, NotifyStatus, ToInitiator, ToTarget, MAX_MESSAGE};
use super::ShmEndpoint;
use crate::error::DataError;
use crate::ids::{FastMap, PeerId, RemoteKey};
use crate::memory::{Region, RemoteRegion};
use socket2::{Domain, SockAddr, Socket, Type};
use std::collections::VecDeque;
use std::io;
use std::os::fd::{AsFd, OwnedFd};
use std::sync::Arc;
use std::time::Duration;

/// A target's region mapped here, with what the target granted.
pub(crate) struct PeerRegion {
    /// The mapping (writable only when the grant allows WRITE).
    pub(crate) region: Region,
    /// The grant: key, length, remote rights.
    pub(crate) grant: Granted,
}

impl PeerRegion {
    /// The grant as the checks every backend makes see it.
    pub(crate) fn advert(&self) -> RemoteRegion {
        RemoteRegion {
            key: self.grant.key,
            addr: self.region.addr(),
            len: self.grant.len,
            access: self.grant.access,
        }
    }
}

/// What draining a connection found.
pub(crate) enum Event {
    /// The target answered notification `seq`.
    Notified(u64, NotifyStatus),
    /// The connection ended: the target is gone.
    Lost(&'static str, Option<io::Error>),
}

/// A connection to one target.
pub(crate) struct Conn {
    /// The socket (non-blocking once connected); shared with the I/O
    /// thread, which only watches it.
    pub(crate) sock: Arc<OwnedFd>,
    /// The target's regions, mapped.
    pub(crate) regions: FastMap<RemoteKey, PeerRegion>,
    /// Notifications the socket could not take yet.
    unsent: VecDeque<Vec<u8>>,
}

fn io_err(op: String, source: io::Error) -> DataError {
    DataError::Io { op, source }
}

/// Maps the regions of one grant message.
fn map_grants(
    peer: PeerId,
    regions: Vec<Granted>,
    fds: Vec<OwnedFd>,
    into: &mut FastMap<RemoteKey, PeerRegion>,
) -> Result<(), DataError> {
    if regions.len() != fds.len() {
        return Err(DataError::PeerRegionRefused {
            backend: "shm",
            peer,
            key: regions.first().map_or(RemoteKey(0), |g| g.key),
            reason: format!(
                "the grant names {} regions but carries {} descriptors",
                regions.len(),
                fds.len()
            ),
        });
    }
    for (grant, fd) in regions.into_iter().zip(fds) {
        let region = map_peer(&fd, grant.len, grant.access).map_err(|r| {
            let reason = match r {
                MapRefusal::Unsafe(why) => why.to_owned(),
                MapRefusal::Os(op, e) => format!("{op}: {e}"),
            };
            DataError::PeerRegionRefused {
                backend: "shm",
                peer,
                key: grant.key,
                reason,
            }
        })?;
        into.insert(grant.key, PeerRegion { region, grant });
    }
    Ok(())
}

impl Conn {
    /// Connects to `ep`, presents its credential and maps every region the
    /// target grants. Blocks up to `timeout` per step.
    pub(crate) fn connect(
        peer: PeerId,
        ep: &ShmEndpoint,
        timeout: Duration,
    ) -> Result<Self, DataError> {
        let what = || format!("shm target {} (peer {peer})", ep.display_name());
        let sock = Socket::new(Domain::UNIX, Type::SEQPACKET.cloexec(), None)
            .map_err(|e| io_err(format!("create a socket for {}", what()), e))?;
        let addr = SockAddr::unix(ep.socket_name())
            .map_err(|e| io_err(format!("address of {}", what()), e))?;
        sock.set_read_timeout(Some(timeout))
            .and_then(|()| sock.set_write_timeout(Some(timeout)))
            .map_err(|e| io_err(format!("set timeouts for {}", what()), e))?;
        sock.connect(&addr)
            .map_err(|e| io_err(format!("connect to {}", what()), e))?;
        let hello = wire::encode(&ToTarget::Hello {
            version: wire::VERSION,
            token: ep.token.to_vec(),
        });
        send_msg(sock.as_fd(), &hello, &[])
            .map_err(|e| io_err(format!("send the credential to {}", what()), e))?;
        let mut regions = FastMap::default();
        let mut buf = vec![0u8; MAX_MESSAGE];
        loop {
            let mut fds = Vec::new();
            let n = recv_msg(sock.as_fd(), &mut buf, &mut fds).map_err(|e| {
                io_err(
                    format!("receive the regions of {} (credential refused?)", what()),
                    e,
                )
            })?;
            if n == 0 {
                return Err(DataError::PeerLost {
                    peer,
                    reason: "the shm target closed the connection before granting its regions (credential refused, or the target is gone)",
                    source: None,
                });
            }
            match wire::decode::<ToInitiator>(&buf[..n]) {
                Some(ToInitiator::Grant { regions: g, last }) => {
                    map_grants(peer, g, fds, &mut regions)?;
                    if last {
                        break;
                    }
                }
                _ => {
                    return Err(DataError::BadEndpoint {
                        backend: "shm",
                        reason: format!("{} answered the hello with something else", what()),
                    })
                }
            }
        }
        sock.set_nonblocking(true)
            .map_err(|e| io_err(format!("make the socket to {} non-blocking", what()), e))?;
        Ok(Self {
            sock: Arc::new(sock.into()),
            regions,
            unsent: VecDeque::new(),
        })
    }

    /// Reads every message waiting; appends answers to `out`. Grants map
    /// new regions, revocations forget them. Returns after the socket is
    /// empty or the connection ended (`Event::Lost`, last).
    pub(crate) fn drain(&mut self, peer: PeerId, buf: &mut [u8], out: &mut Vec<Event>) {
        loop {
            let mut fds = Vec::new();
            let n = match recv_msg(self.sock.as_fd(), buf, &mut fds) {
                Ok(0) => return out.push(Event::Lost(
                    "the target closed the connection (its process ended or it removed this peer)",
                    None,
                )),
                Ok(n) => n,
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => return,
                Err(e) if e.kind() == io::ErrorKind::InvalidData => {
                    return out.push(Event::Lost("the target sent an oversized message", Some(e)))
                }
                Err(e) => return out.push(Event::Lost("receive from the target failed", Some(e))),
            };
            match wire::decode::<ToInitiator>(&buf[..n]) {
                Some(ToInitiator::Notified { seq, status }) => {
                    out.push(Event::Notified(seq, status))
                }
                Some(ToInitiator::Revoke { key }) => {
                    self.regions.remove(&key);
                }
                Some(ToInitiator::Grant { regions, .. }) => {
                    let keys: Vec<_> = regions.iter().map(|g| g.key).collect();
                    if let Err(e) = map_grants(peer, regions, fds, &mut self.regions) {
                        // The keys stay unknown: transfers naming them fail
                        // with UnknownKey.
                        tracing::warn!(%peer, ?keys, error = %e, "shm: a late grant was refused");
                    }
                }
                None => return out.push(Event::Lost("the target sent a malformed message", None)),
            }
        }
    }

    /// Sends (or queues) a notification; an error means the connection is
    /// broken.
    pub(crate) fn notify(&mut self, msg: Vec<u8>) -> io::Result<()> {
        self.unsent.push_back(msg);
        self.flush()
    }

    /// Sends queued notifications until the socket is full.
    pub(crate) fn flush(&mut self) -> io::Result<()> {
        while let Some(msg) = self.unsent.front() {
            match send_msg(self.sock.as_fd(), msg, &[]) {
                Ok(_) => {
                    self.unsent.pop_front();
                }
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => return Ok(()),
                Err(e) => return Err(e),
            }
        }
        Ok(())
    }

    /// Whether notifications wait for room in the socket.
    pub(crate) fn has_unsent(&self) -> bool {
        !self.unsent.is_empty()
    }
}
