//! Simulated-time cluster harness (style of quinn-proto's `tests/util.rs`):
//! a virtual clock, per-link latency, deterministic loss, partitions and
//! restarts, driving real [`Registry`] machines with no sockets.
#![allow(dead_code)] // each test uses a subset

use std::cmp::Reverse;
use std::collections::{BinaryHeap, HashMap, HashSet};
use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use kvlane_control::{
    Config, ConnectionId, Event, Link, LocalInfo, PeerEvent, Ranks, Registry, Transmit,
};

pub(crate) struct SimNode {
    pub(crate) reg: Registry,
    pub(crate) addr: String,
    pub(crate) local: LocalInfo,
    pub(crate) config: Config,
    pub(crate) up: bool,
    pub(crate) events: Vec<(Instant, PeerEvent)>,
    /// Events before this index were consumed by `drive_until_event`.
    pub(crate) cursor: usize,
}

#[derive(PartialEq, Eq, PartialOrd, Ord)]
struct InFlight {
    at: Reverse<Instant>,
    seq: Reverse<u64>,
    to: usize,
    link: LinkKey,
    bytes: Vec<u8>,
}

#[derive(PartialEq, Eq, PartialOrd, Ord, Clone)]
enum LinkKey {
    Dial(u64),
    Accepted(Vec<u8>),
    Failed(u64, String),
}

/// A frame put on the simulated wire (for leak inspection).
#[derive(Debug, Clone)]
pub(crate) struct Sent {
    pub(crate) from: usize,
    pub(crate) to: usize,
    pub(crate) bytes: Vec<u8>,
}

pub(crate) struct Cluster {
    pub(crate) now: Instant,
    pub(crate) nodes: Vec<SimNode>,
    pub(crate) latency: Duration,
    /// Probability in [0, 1] that a frame is lost.
    pub(crate) loss: f64,
    partitions: HashSet<(usize, usize)>,
    wire: BinaryHeap<InFlight>,
    seq: u64,
    rng: u64,
    /// (origin node, conn id) -> (target node, routing id)
    dials: HashMap<(usize, u64), (usize, Vec<u8>)>,
    /// (target node, routing id) -> (origin node, conn id)
    routes: HashMap<(usize, Vec<u8>), (usize, u64)>,
    /// Dials so far: every dial gets a fresh routing id, as with the ZMQ
    /// channel (a node restarted, or a connection dialing again, never
    /// reuses one; a hello on a live connection's routing id is refused).
    opened: u64,
    pub(crate) sent: Vec<Sent>,
}

pub(crate) fn local(engine: &str, dp: u32, tp: u32, tp_size: u32) -> LocalInfo {
    LocalInfo::new(
        engine,
        Ranks {
            dp_rank: dp,
            tp_rank: tp,
            tp_size,
        },
        "fp",
    )
    .with_data_plane(format!("SECRET-BLOB-{engine}-{dp}-{tp}").into_bytes())
}

pub(crate) fn config() -> Config {
    Config {
        rng_seed: 7,
        ..Config::default()
    }
}

impl Cluster {
    pub(crate) fn new() -> Self {
        Self {
            now: Instant::now(),
            nodes: Vec::new(),
            latency: Duration::from_millis(1),
            loss: 0.0,
            partitions: HashSet::new(),
            wire: BinaryHeap::new(),
            seq: 0,
            opened: 0,
            rng: 0x1234_5678,
            dials: HashMap::new(),
            routes: HashMap::new(),
            sent: Vec::new(),
        }
    }

    /// Adds a node at `addr`; returns its index.
    pub(crate) fn add(&mut self, addr: &str, config: Config, local: LocalInfo) -> usize {
        let reg = Registry::new(Arc::new(config.clone()), Arc::new(local.clone()));
        self.nodes.push(SimNode {
            reg,
            addr: addr.into(),
            local,
            config,
            up: true,
            events: Vec::new(),
            cursor: 0,
        });
        self.nodes.len() - 1
    }

    /// A pair: node 0 (`a:1`) and node 1 (`b:1`).
    pub(crate) fn pair(config: Config) -> Self {
        let mut c = Self::new();
        c.add("a:1", config.clone(), local("a", 0, 0, 1));
        c.add("b:1", config, local("b", 0, 0, 1));
        c
    }

    pub(crate) fn connect(&mut self, from: usize, addr: &str) -> ConnectionId {
        let now = self.now;
        self.nodes[from].reg.connect(now, addr).expect("connect")
    }

    pub(crate) fn partition(&mut self, a: usize, b: usize) {
        self.partitions.insert((a, b));
        self.partitions.insert((b, a));
    }

    pub(crate) fn heal(&mut self) {
        self.partitions.clear();
    }

    /// Kills node `i`: it stops processing and its frames are lost.
    pub(crate) fn kill(&mut self, i: usize) {
        self.nodes[i].up = false;
        self.routes.retain(|(t, _), _| *t != i);
    }

    /// Restarts node `i` with a fresh registry and a new incarnation.
    pub(crate) fn restart(&mut self, i: usize) {
        let n = &mut self.nodes[i];
        n.local.identity.incarnation = n.local.identity.incarnation.wrapping_add(1);
        n.reg = Registry::new(Arc::new(n.config.clone()), Arc::new(n.local.clone()));
        n.up = true;
        self.routes.retain(|(t, _), _| *t != i);
        self.dials.retain(|(o, _), _| *o != i);
    }

    fn rand(&mut self) -> f64 {
        self.rng = self
            .rng
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        (self.rng >> 11) as f64 / (1u64 << 53) as f64
    }

    fn find(&self, addr: &str) -> Option<usize> {
        self.nodes.iter().position(|n| n.addr == addr)
    }

    fn put(&mut self, from: usize, to: usize, link: LinkKey, bytes: Vec<u8>) {
        self.sent.push(Sent {
            from,
            to,
            bytes: bytes.clone(),
        });
        if self.partitions.contains(&(from, to)) || !self.nodes[to].up {
            return;
        }
        if self.loss > 0.0 && self.rand() < self.loss {
            return;
        }
        self.seq += 1;
        self.wire.push(InFlight {
            at: Reverse(self.now + self.latency),
            seq: Reverse(self.seq),
            to,
            link,
            bytes,
        });
    }

    /// Moves every node's outputs onto the wire. Returns whether anything happened.
    pub(crate) fn pump(&mut self) -> bool {
        let mut any = false;
        for i in 0..self.nodes.len() {
            if !self.nodes[i].up {
                continue;
            }
            while let Some((id, link, t)) = self.nodes[i].reg.poll_transmit() {
                any = true;
                match (t, link) {
                    (Transmit::Connect, _) => {
                        let addr = self.nodes[i].reg.peer(id).map(|p| p.addr().to_owned());
                        let target = addr.as_deref().and_then(|a| self.find(a));
                        match target.filter(|&t| self.nodes[t].up) {
                            Some(t) => {
                                self.opened += 1;
                                let rid = format!("sim-{i}-{}-{}", id.0, self.opened).into_bytes();
                                self.dials.insert((i, id.0), (t, rid.clone()));
                                self.routes.insert((t, rid), (i, id.0));
                            }
                            None => {
                                let now = self.now;
                                self.seq += 1;
                                self.wire.push(InFlight {
                                    at: Reverse(now + self.latency),
                                    seq: Reverse(self.seq),
                                    to: i,
                                    link: LinkKey::Failed(id.0, "connection refused".into()),
                                    bytes: Vec::new(),
                                });
                            }
                        }
                    }
                    (Transmit::Frame(f), Link::Dial(id)) => {
                        if let Some((t, rid)) = self.dials.get(&(i, id.0)).cloned() {
                            self.put(i, t, LinkKey::Accepted(rid), f);
                        }
                    }
                    (Transmit::Frame(f), Link::Accepted(rid)) => {
                        if let Some(&(o, cid)) = self.routes.get(&(i, rid.to_vec())) {
                            self.put(i, o, LinkKey::Dial(cid), f);
                        }
                    }
                    (Transmit::Disconnect, Link::Dial(id)) => {
                        if let Some((t, rid)) = self.dials.remove(&(i, id.0)) {
                            // Like ZMQ: frames already in flight still arrive.
                            let _ = (t, rid);
                        }
                    }
                    (Transmit::Disconnect, Link::Accepted(_)) => {}
                }
            }
            let now = self.now;
            while let Some(ev) = self.nodes[i].reg.poll_event() {
                any = true;
                self.nodes[i].events.push((now, ev));
            }
        }
        any
    }

    fn next_time(&self) -> Option<Instant> {
        let wire = self.wire.peek().map(|f| f.at.0);
        let timers = self
            .nodes
            .iter()
            .filter(|n| n.up)
            .filter_map(|n| n.reg.poll_timeout())
            .min();
        [wire, timers].into_iter().flatten().min()
    }

    /// One step: deliver what is due at the next instant and fire timers.
    /// Returns false when nothing is left to do.
    pub(crate) fn step(&mut self) -> bool {
        self.pump();
        let Some(t) = self.next_time() else {
            return false;
        };
        if t > self.now {
            self.now = t;
        }
        let now = self.now;
        while self.wire.peek().is_some_and(|f| f.at.0 <= now) {
            let Some(f) = self.wire.pop() else { break };
            if !self.nodes[f.to].up {
                continue;
            }
            let reg = &mut self.nodes[f.to].reg;
            match f.link {
                LinkKey::Dial(id) => reg.handle_frame(now, Link::Dial(ConnectionId(id)), &f.bytes),
                LinkKey::Accepted(rid) => {
                    reg.handle_frame(now, Link::Accepted(Bytes::from(rid)), &f.bytes)
                }
                LinkKey::Failed(id, reason) => {
                    reg.handle_channel_error(now, ConnectionId(id), reason)
                }
            }
        }
        for n in self.nodes.iter_mut().filter(|n| n.up) {
            n.reg.handle_timeout(now);
        }
        self.pump();
        true
    }

    /// Drives until nothing is in flight (every frame delivered and its
    /// answers too); fails on livelock.
    pub(crate) fn drive(&mut self) {
        self.drive_bounded(100_000, |c| c.wire.is_empty());
    }

    /// Drives until `until` (virtual time).
    pub(crate) fn drive_for(&mut self, d: Duration) {
        let end = self.now + d;
        self.drive_bounded(1_000_000, |c| {
            c.now >= end || c.next_time().is_none_or(|t| t > end)
        });
        if self.now < end {
            self.now = end;
        }
    }

    /// Drives until `done` holds, failing on livelock (more than `max_steps`
    /// steps) or when nothing is left to do.
    pub(crate) fn drive_bounded(&mut self, max_steps: usize, mut done: impl FnMut(&Self) -> bool) {
        for _ in 0..max_steps {
            self.pump();
            if done(self) {
                return;
            }
            if !self.step() {
                assert!(done(self), "cluster went idle before the condition held");
                return;
            }
        }
        panic!("livelock: condition not reached within {max_steps} steps");
    }

    /// Drives until node `i` has emitted an event matching `f`; returns its time.
    pub(crate) fn drive_until_event(
        &mut self,
        i: usize,
        within: Duration,
        f: impl Fn(&PeerEvent) -> bool,
    ) -> (Instant, PeerEvent) {
        let start_len = self.nodes[i].cursor;
        let deadline = self.now + within;
        self.drive_bounded(1_000_000, |c| {
            c.nodes[i].events[start_len..].iter().any(|(_, e)| f(e))
                || c.next_time().is_none_or(|t| t > deadline)
        });
        let pos = self.nodes[i].events[start_len..]
            .iter()
            .position(|(_, e)| f(e));
        if let Some(p) = pos {
            self.nodes[i].cursor = start_len + p + 1;
        }
        pos.map(|p| self.nodes[i].events[start_len + p].clone())
            .unwrap_or_else(|| {
                panic!(
                    "node {i}: expected event not seen within {within:?}: {:#?}",
                    self.nodes[i].events
                )
            })
    }

    pub(crate) fn events(&self, i: usize) -> Vec<Event> {
        self.nodes[i]
            .events
            .iter()
            .map(|(_, e)| e.event.clone())
            .collect()
    }

    pub(crate) fn clear_events(&mut self) {
        for n in &mut self.nodes {
            n.events.clear();
            n.cursor = 0;
        }
    }
}
