//! In-memory channel for tests: a shared switchboard of named endpoints.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, PoisonError};

use bytes::Bytes;
use tokio::sync::mpsc;

use super::{Channel, ChannelEvent};
use crate::ids::ConnectionId;
use crate::registry::Link;

type Inbox = mpsc::UnboundedSender<ChannelEvent>;

#[derive(Default, Debug)]
struct Board {
    endpoints: HashMap<String, Inbox>,
    /// routing id → (dialer inbox, dialer connection id)
    routes: HashMap<Bytes, (Inbox, ConnectionId)>,
    next: u64,
}

/// The in-memory "network" shared by [`MemChannel`]s.
#[derive(Clone, Default, Debug)]
pub struct MemNetwork {
    board: Arc<Mutex<Board>>,
}

impl MemNetwork {
    /// An empty network.
    pub fn new() -> Self {
        Self::default()
    }

    /// Binds a channel at `addr` (replacing a previous binding).
    pub fn bind(&self, addr: &str) -> MemChannel {
        let (tx, rx) = mpsc::unbounded_channel();
        let mut b = self.board.lock().unwrap_or_else(PoisonError::into_inner);
        b.endpoints.insert(addr.to_owned(), tx.clone());
        b.next += 1;
        MemChannel {
            net: self.clone(),
            addr: addr.to_owned(),
            me: tx,
            rx,
            dials: HashMap::new(),
            tag: b.next,
        }
    }
}

/// One node's endpoint on a [`MemNetwork`].
#[derive(Debug)]
pub struct MemChannel {
    net: MemNetwork,
    addr: String,
    me: Inbox,
    rx: mpsc::UnboundedReceiver<ChannelEvent>,
    dials: HashMap<ConnectionId, (String, Bytes)>,
    tag: u64,
}

impl Channel for MemChannel {
    fn local_addr(&self) -> String {
        self.addr.clone()
    }

    fn open(&mut self, id: ConnectionId, addr: &str) {
        // Routing id unique per connection: channel tag + connection id.
        let rid = Bytes::from(format!("mem-{}-{}", self.tag, id.0));
        let mut b = self
            .net
            .board
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        if !b.endpoints.contains_key(addr) {
            let _ = self.me.send(ChannelEvent::Failed {
                id,
                reason: format!("{addr}: connection refused"),
            });
            return;
        }
        b.routes.insert(rid.clone(), (self.me.clone(), id));
        self.dials.insert(id, (addr.to_owned(), rid));
    }

    fn send(&mut self, link: &Link, frame: Bytes) {
        let b = self
            .net
            .board
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        match link {
            Link::Dial(id) => {
                let Some((addr, rid)) = self.dials.get(id) else {
                    return;
                };
                let ok = b.endpoints.get(addr).is_some_and(|tx| {
                    tx.send(ChannelEvent::Frame {
                        link: Link::Accepted(rid.clone()),
                        bytes: frame,
                    })
                    .is_ok()
                });
                if !ok {
                    let _ = self.me.send(ChannelEvent::Failed {
                        id: *id,
                        reason: format!("{addr}: unreachable"),
                    });
                }
            }
            Link::Accepted(rid) => {
                if let Some((tx, id)) = b.routes.get(rid) {
                    let _ = tx.send(ChannelEvent::Frame {
                        link: Link::Dial(*id),
                        bytes: frame,
                    });
                }
            }
        }
    }

    fn disconnect(&mut self, id: ConnectionId) {
        if let Some((_, rid)) = self.dials.remove(&id) {
            self.net
                .board
                .lock()
                .unwrap_or_else(PoisonError::into_inner)
                .routes
                .remove(&rid);
        }
    }

    async fn recv(&mut self) -> Option<ChannelEvent> {
        self.rx.recv().await
    }

    async fn close(&mut self) {
        let ids: Vec<_> = self.dials.keys().copied().collect();
        for id in ids {
            self.disconnect(id);
        }
        let mut b = self
            .net
            .board
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        if b.endpoints
            .get(&self.addr)
            .is_some_and(|tx| tx.same_channel(&self.me))
        {
            b.endpoints.remove(&self.addr);
        }
    }
}
