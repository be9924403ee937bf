//! The driver loop: owns the [`Registry`] and the channel, and is the only
//! task that touches either; [`ControlNode`](super::ControlNode) (the handle,
//! `mod.rs`) talks to it through [`Command`]s.

use std::collections::{HashMap, VecDeque};
use std::time::{Duration, Instant};

use bytes::Bytes;
use futures::FutureExt;
use tokio::sync::{broadcast, mpsc, oneshot};
use tracing::{debug, error};

use crate::channel::{Channel, ChannelEvent};
use crate::error::{ControlError, PeerError};
use crate::ids::ConnectionId;
use crate::peer::{Event, Role, State, Transmit, MAX_PROBES};
use crate::registry::{ConnectRefused, Link, PeerEvent, Registry};

use super::{now, Command, ConnectReply, EventQueue, PeerSnapshot};

struct Waiter {
    addr: String,
    reply: ConnectReply,
}

type PingReply = oneshot::Sender<Result<Duration, ControlError>>;

struct Driver<C> {
    reg: Registry,
    chan: C,
    events: broadcast::Sender<PeerEvent>,
    owner: EventQueue,
    waiters: HashMap<ConnectionId, Vec<Waiter>>,
    /// Explicit pings waiting for their pong, per connection, oldest
    /// first: at most [`MAX_PROBES`] each (the peer machine recognizes no
    /// older pong), so a peer that stays up but never answers them holds
    /// a bounded number, however often it is pinged.
    pings: HashMap<ConnectionId, VecDeque<(u64, PingReply)>>,
}

pub(super) async fn run<C: Channel>(
    reg: Registry,
    chan: C,
    mut cmds: mpsc::Receiver<Command>,
    events: broadcast::Sender<PeerEvent>,
    owner: EventQueue,
) {
    let mut d = Driver {
        reg,
        chan,
        events,
        owner,
        waiters: HashMap::new(),
        pings: HashMap::new(),
    };
    let mut closing: Option<Vec<oneshot::Sender<()>>> = None;
    // One timer for the whole loop, re-armed only when the earliest deadline
    // changes (re-creating it per event costs a timer-wheel insert and
    // removal on every frame).
    let far = || tokio::time::Instant::now() + Duration::from_secs(86_400);
    let sleep = tokio::time::sleep_until(far());
    tokio::pin!(sleep);
    let mut armed: Option<Instant> = None;
    loop {
        let deadline = d.reg.poll_timeout();
        if deadline != armed {
            sleep.as_mut().reset(deadline.map_or_else(far, Into::into));
            armed = deadline;
        }
        tokio::select! {
            ev = d.chan.recv() => d.on_channel(ev, &mut closing),
            cmd = cmds.recv(), if closing.is_none() => match cmd {
                Some(Command::Close { reply }) => {
                    d.reg.close(now());
                    closing = Some(vec![reply]);
                }
                Some(cmd) => d.command(cmd),
                None => {
                    d.reg.close(now());
                    closing = Some(Vec::new());
                }
            },
            () = &mut sleep, if armed.is_some() => {
                armed = None;
                // What arrived while this task did not run (its thread
                // starved on a busy core, or the process stopped) is read
                // before any deadline is judged: a pong that sits unread
                // is not a missed pong. Bounded, so a flood cannot hold
                // the timers off.
                for _ in 0..DRAIN_BEFORE_TIMEOUT {
                    match d.chan.recv().now_or_never() {
                        Some(ev) => d.on_channel(ev, &mut closing),
                        None => break,
                    }
                    if closing.is_some() {
                        break;
                    }
                }
                d.reg.handle_timeout(now());
            }
        }
        d.flush();
        if closing.is_some() && d.reg.is_empty() {
            break;
        }
    }
    d.chan.close().await;
    for (_, ws) in d.waiters.drain() {
        for w in ws {
            let _ = w.reply.send(Err(ControlError::Closed));
        }
    }
    // Commands that raced with close get a `Closed` answer by dropping them.
    cmds.close();
    while let Ok(cmd) = cmds.try_recv() {
        if let Command::Close { reply } = cmd {
            let _ = reply.send(());
        }
    }
    for r in closing.unwrap_or_default() {
        let _ = r.send(());
    }
}

/// Inbound events read before a timeout is handled, at most (see the
/// timer branch of [`run`]).
const DRAIN_BEFORE_TIMEOUT: usize = 1024;

impl<C: Channel> Driver<C> {
    fn on_channel(
        &mut self,
        ev: Option<ChannelEvent>,
        closing: &mut Option<Vec<oneshot::Sender<()>>>,
    ) {
        match ev {
            Some(ChannelEvent::Frame { link, bytes }) => self.reg.handle_frame(now(), link, &bytes),
            Some(ChannelEvent::Failed { id, reason }) => {
                self.reg.handle_channel_error(now(), id, reason)
            }
            None => {
                error!("channel ended; closing the node");
                self.reg.close(now());
                closing.get_or_insert_with(Vec::new);
            }
        }
    }

    fn command(&mut self, cmd: Command) {
        let t = now();
        match cmd {
            Command::Connect { addr, route, reply } => {
                match self.reg.connect_via(t, &addr, route) {
                    Ok(id) => self
                        .waiters
                        .entry(id)
                        .or_default()
                        .push(Waiter { addr, reply }),
                    Err(ConnectRefused::Duplicate { existing, .. }) => {
                        let ready = self
                            .reg
                            .peer(existing)
                            .filter(|p| matches!(p.state(), State::Ready | State::Suspect))
                            .and_then(|p| p.remote().cloned());
                        match ready {
                            Some(info) => {
                                let _ = reply.send(Ok((existing, info)));
                            }
                            None => self
                                .waiters
                                .entry(existing)
                                .or_default()
                                .push(Waiter { addr, reply }),
                        }
                    }
                    Err(ConnectRefused::PeerCap { cap, addr }) => {
                        let _ = reply.send(Err(ControlError::PeerCap { addr, cap }));
                    }
                    Err(ConnectRefused::Closed { .. }) => {
                        let _ = reply.send(Err(ControlError::Closed));
                    }
                }
            }
            Command::Notify {
                id,
                transfer_id,
                payload,
                reply,
            } => {
                let r = match self.reg.notify(id, transfer_id, payload) {
                    Ok(()) => Ok(()),
                    Err(_) => Err(match self.reg.peer(id) {
                        None => ControlError::UnknownPeer(id),
                        Some(p) => ControlError::NotReady {
                            peer: id,
                            addr: p.addr().to_owned(),
                            state: p.state(),
                        },
                    }),
                };
                let _ = reply.send(r);
            }
            Command::Ping { id, reply } => match self.reg.ping(t, id) {
                Some(seq) => self.wait_pong(id, seq, reply),
                None => {
                    let err = match self.reg.peer(id) {
                        None => ControlError::UnknownPeer(id),
                        Some(p) => ControlError::NotReady {
                            peer: id,
                            addr: p.addr().to_owned(),
                            state: p.state(),
                        },
                    };
                    let _ = reply.send(Err(err));
                }
            },
            Command::Check {
                id,
                incarnation,
                reply,
            } => {
                let r = match self.reg.peer(id) {
                    None => Err(ControlError::UnknownPeer(id)),
                    Some(p) => match (p.state(), p.remote()) {
                        (State::Ready | State::Suspect, Some(info))
                            if info.identity.incarnation == incarnation =>
                        {
                            Ok(())
                        }
                        (State::Ready | State::Suspect, Some(info)) => {
                            Err(ControlError::StaleIncarnation {
                                peer: id,
                                addr: p.addr().to_owned(),
                                expected: incarnation,
                                current: info.identity.incarnation,
                            })
                        }
                        (state, _) => Err(ControlError::NotReady {
                            peer: id,
                            addr: p.addr().to_owned(),
                            state,
                        }),
                    },
                };
                let _ = reply.send(r);
            }
            Command::Disconnect { id, reply } => {
                self.reg.disconnect(t, id);
                let _ = reply.send(());
            }
            Command::Snapshot { reply } => {
                let mut peers: Vec<_> = self
                    .reg
                    .ids()
                    .into_iter()
                    .filter_map(|id| {
                        self.reg.peer(id).map(|p| PeerSnapshot {
                            id,
                            addr: p.addr().to_owned(),
                            state: p.state(),
                            remote: p.remote().cloned(),
                        })
                    })
                    .collect();
                peers.sort_by_key(|p| p.id);
                let _ = reply.send(peers);
            }
            Command::SetDataPlane { blob, reply } => {
                self.reg.set_data_plane(blob);
                let _ = reply.send(());
            }
            Command::Stats { reply } => {
                let mut stats = self.reg.stats();
                stats.events_dropped += self.owner.dropped();
                stats.pings_waiting = self.pings.values().map(|w| w.len() as u64).sum();
                let _ = reply.send(stats);
            }
            Command::Close { reply } => {
                let _ = reply.send(());
            }
        }
    }

    fn flush(&mut self) {
        while let Some((id, link, t)) = self.reg.poll_transmit() {
            match t {
                Transmit::Connect => {
                    if let Some(addr) = self.reg.peer(id).map(|p| p.addr().to_owned()) {
                        self.chan.open(id, &addr);
                    }
                }
                Transmit::Frame(f) => self.chan.send(&link, Bytes::from(f)),
                Transmit::Disconnect => {
                    if let Link::Dial(id) = link {
                        self.chan.disconnect(id);
                    }
                }
            }
        }
        while let Some(rid) = self.reg.poll_adopted_link() {
            self.chan.adopt_accepted(&rid);
        }
        while let Some(rid) = self.reg.poll_proven_link() {
            self.chan.protect_accepted(&rid);
        }
        // After the transmits: a refusal goes out before its link closes.
        while let Some(rid) = self.reg.poll_released_link() {
            self.chan.close_accepted(&rid);
        }
        while let Some(mut ev) = self.reg.poll_event() {
            // A peer that dialed us is where its connection comes from, as
            // the transport saw it, not where its hello says.
            if let (Event::Ready(info), Role::Acceptor) = (&mut ev.event, ev.role) {
                if let Some(link) = self.reg.link(ev.id).cloned() {
                    if let Some(ip) = self.chan.peer_ip(&link) {
                        info.peer_host = Some(ip);
                    }
                }
            }
            self.resolve(&ev);
            let observed = self.events.receiver_count() > 0;
            match (self.owner.wants(&ev), observed) {
                (true, true) => {
                    self.owner.push(ev.clone());
                    let _ = self.events.send(ev);
                }
                (true, false) => self.owner.push(ev),
                (false, true) => {
                    let _ = self.events.send(ev);
                }
                (false, false) => {}
            }
        }
        let reg = &self.reg;
        self.owner.prune(reg.len(), |id| reg.peer(id).is_some());
    }

    /// Remembers a ping until its pong. Callers that gave up (their
    /// `ping` timed out, past the death bound, or was dropped) are
    /// forgotten; past [`MAX_PROBES`] waiting, the oldest is answered with
    /// [`ControlError::PingDropped`] (the peer machine just forgot it too).
    fn wait_pong(&mut self, id: ConnectionId, seq: u64, reply: PingReply) {
        let waiting = self.pings.entry(id).or_default();
        waiting.retain(|(_, r)| !r.is_closed());
        while waiting.len() >= MAX_PROBES {
            let Some((_, oldest)) = waiting.pop_front() else {
                break;
            };
            let addr = self
                .reg
                .peer(id)
                .map(|p| p.addr().to_owned())
                .unwrap_or_default();
            let _ = oldest.send(Err(ControlError::PingDropped {
                peer: id,
                addr,
                waiting: MAX_PROBES,
            }));
        }
        waiting.push_back((seq, reply));
    }

    fn resolve(&mut self, ev: &PeerEvent) {
        let failure = match &ev.event {
            Event::Ready(info) => {
                let ws = self.waiters.remove(&ev.id).unwrap_or_default();
                let waited = !ws.is_empty();
                let mut taken = false;
                for w in ws {
                    taken |= w.reply.send(Ok((ev.id, info.clone()))).is_ok();
                }
                if waited && !taken {
                    // Every caller gave up (timed out, or a group past its
                    // deadline) before the handshake finished: nobody holds
                    // the id, so nobody would ever close the connection.
                    debug!(id = %ev.id, addr = %ev.addr, "connect given up before ready; closing");
                    self.reg.disconnect(now(), ev.id);
                }
                return;
            }
            Event::Pong { seq, rtt } => {
                if let Some(waiting) = self.pings.get_mut(&ev.id) {
                    if let Some(i) = waiting.iter().position(|(s, _)| s == seq) {
                        if let Some((_, reply)) = waiting.remove(i) {
                            let _ = reply.send(Ok(*rtt));
                        }
                    }
                    if waiting.is_empty() {
                        self.pings.remove(&ev.id);
                    }
                }
                return;
            }
            Event::Refused { refusal, .. } => (1, PeerError::Refused(refusal.clone())),
            Event::Dead {
                attempts,
                last_error,
                ..
            } => (*attempts, last_error.clone()),
            Event::Closed => (
                0,
                PeerError::Channel("closed before the handshake finished".into()),
            ),
            _ => return,
        };
        self.pings.remove(&ev.id);
        let Some(ws) = self.waiters.remove(&ev.id) else {
            return;
        };
        for w in ws {
            let _ = w.reply.send(Err(ControlError::Connect {
                addr: w.addr,
                attempts: failure.0,
                last_error: failure.1.clone(),
            }));
        }
        // A connect that failed does not keep dialing in the background.
        self.reg.disconnect(now(), ev.id);
    }
}
