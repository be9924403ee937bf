//! The driver's I/O abstraction and its implementations.
//!
//! A channel never blocks the driver: `open`, `send` and `disconnect` queue
//! work and return at once; failures come back as [`ChannelEvent::Failed`]
//! from [`Channel::recv`], which the driver keeps in flight at all times.

use std::future::Future;

use bytes::Bytes;

use crate::ids::ConnectionId;
use crate::registry::Link;

mod inbound;
mod lane;
mod mem;
mod zmq;

pub use mem::{MemChannel, MemNetwork};
pub use zmq::ZmqChannel;

/// Something the channel observed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ChannelEvent {
    /// A frame arrived on a link.
    Frame {
        /// Where it came from.
        link: Link,
        /// The frame.
        bytes: Bytes,
    },
    /// A dialed connection failed (connect refused, send failed).
    Failed {
        /// The connection.
        id: ConnectionId,
        /// OS or transport reason.
        reason: String,
    },
}

/// Transport of frames between nodes.
pub trait Channel: Send + 'static {
    /// The address peers dial to reach this node (`host:port`, real port).
    fn local_addr(&self) -> String;
    /// Opens a fresh connection `id` to `addr`, dropping nothing else.
    fn open(&mut self, id: ConnectionId, addr: &str);
    /// Queues a frame on a link (frames to unknown links are dropped).
    fn send(&mut self, link: &Link, frame: Bytes);
    /// Flushes queued frames of `id`, then closes and releases it.
    fn disconnect(&mut self, id: ConnectionId);
    /// A connection of the registry started on accepted link `rid` (of a
    /// [`Link::Accepted`]). A channel may close accepted links that nothing
    /// adopts within the handshake timeout; the default keeps them open.
    fn adopt_accepted(&mut self, rid: &Bytes) {
        let _ = rid;
    }
    /// A connection on accepted link `rid` proved itself (reached `Ready`:
    /// authenticated, with a key). A channel that caps accepted
    /// connections evicts the oldest unproven one for a new connection at
    /// its cap, never this one. The default does nothing.
    fn protect_accepted(&mut self, rid: &Bytes) {
        let _ = rid;
    }
    /// Closes the accepted connection `rid` (of a [`Link::Accepted`]) once
    /// the frames queued for it are sent: no connection of the registry
    /// uses it any more. Unknown ids are ignored. The default keeps it
    /// open (a channel whose accepted links cost nothing).
    fn close_accepted(&mut self, rid: &Bytes) {
        let _ = rid;
    }
    /// The IP address an accepted connection (`Link::Accepted`) comes from,
    /// as the transport saw it; `None` when unknown. The driver reports it
    /// as [`RemoteInfo::peer_host`](crate::RemoteInfo::peer_host) of the
    /// peers that dialed us, instead of what their `hello` claims.
    fn peer_ip(&mut self, link: &Link) -> Option<std::net::IpAddr> {
        let _ = link;
        None
    }
    /// Next event; cancel-safe. `None` once the channel is closed.
    fn recv(&mut self) -> impl Future<Output = Option<ChannelEvent>> + Send;
    /// Releases every socket and task (bounded wait).
    fn close(&mut self) -> impl Future<Output = ()> + Send;
}
