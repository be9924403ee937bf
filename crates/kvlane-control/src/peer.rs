//! The sans-IO peer machine: handshake, keep-alive, liveness, reconnect.

use std::collections::VecDeque;
use std::sync::Arc;
use std::time::Instant;

use tracing::{debug, info, warn};

use crate::auth;
use crate::config::{Config, LocalInfo, RemoteInfo, Route};
use crate::error::{PeerError, Refusal, WireError};
use crate::keepalive::{Backoff, KeepAlive};
use crate::timer::{Timer, TimerTable};
mod handshake;

use crate::wire::{Bye, ErrorMsg, Hello, Message, Notify, Ping, PROTOCOL_VERSION};

/// Lifecycle state. `Closed` is a separate fact ([`Peer::is_closed`]): a dead
/// peer still owns its resources until it is closed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum State {
    /// Waiting to open the channel (initial or backoff).
    Connecting,
    /// Handshake in flight.
    Handshaking,
    /// Handshake done, peer answering.
    Ready,
    /// At least one keep-alive unanswered.
    Suspect,
    /// Liveness budget or handshake deadline exhausted, or refused. An
    /// initiator keeps reconnecting in the background (with backoff).
    Dead,
}

/// Which side opened the connection.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Role {
    /// We dialed; we own reconnects.
    Initiator,
    /// The peer dialed us.
    Acceptor,
}

/// What the driver must do on the channel, in order.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Transmit {
    /// Open a fresh channel connection to the peer address (initiators only);
    /// any previous one is dropped first.
    Connect,
    /// Send one encoded frame.
    Frame(Vec<u8>),
    /// Flush the frames above, then close the channel connection.
    Disconnect,
}

/// What happened to the peer.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Event {
    /// Handshake done (first time or after a reconnect).
    Ready(RemoteInfo),
    /// A keep-alive went unanswered.
    Suspect,
    /// A suspect peer answered again.
    Recovered,
    /// The peer is dead.
    Dead {
        /// Peer address.
        peer: String,
        /// Connect attempts or unanswered pings.
        attempts: u32,
        /// Last error seen.
        last_error: PeerError,
    },
    /// The peer came back with a new incarnation (state from the old one is stale).
    Restarted {
        /// Old incarnation.
        old: u64,
        /// New incarnation.
        new: u64,
    },
    /// A notification arrived.
    Notification {
        /// Transfer id.
        transfer_id: u64,
        /// Payload.
        payload: Vec<u8>,
    },
    /// The handshake was refused (by us or by the peer).
    Refused {
        /// Peer address.
        peer: String,
        /// Why.
        refusal: Refusal,
    },
    /// Answer to an explicit [`Peer::ping`] probe.
    Pong {
        /// Probe sequence number.
        seq: u64,
        /// Round-trip time measured with the driver's clock.
        rtt: std::time::Duration,
    },
    /// All resources released.
    Closed,
}

/// Counters of frames that were dropped instead of ending anything.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Stats {
    /// Frames over the cap.
    pub oversized: u64,
    /// Undecodable frames.
    pub malformed: u64,
    /// Frames with an unknown `type`.
    pub unknown_type: u64,
    /// Valid frames that make no sense in the current state.
    pub unexpected: u64,
    /// Inbound peers refused before they were authenticated (peer cap,
    /// failed or incompatible handshake); logged as a rate-limited summary.
    pub refused_inbound: u64,
    /// Handshaking inbound connections dropped for a newer one because
    /// [`Config::handshake_cap`](crate::Config::handshake_cap) was reached.
    pub handshakes_evicted: u64,
    /// Remembered incarnations forgotten because the map was full.
    pub incarnations_evicted: u64,
    /// Hellos that arrived on the routing id of a live (handshaken, not
    /// closing) accepted connection: dropped, the live connection keeps its
    /// link and state (a kvlane dialer sends its hello on a fresh routing
    /// id; see [`Registry::handle_frame`](crate::Registry::handle_frame)).
    pub hellos_on_live_links: u64,
    /// Explicit pings ([`ControlNode::ping`](crate::ControlNode::ping))
    /// waiting for their pong now, all peers together: a gauge, not a
    /// counter. Each peer holds at most 64 (the oldest is answered with
    /// [`ControlError::PingDropped`](crate::ControlError::PingDropped) to
    /// make room); a peer's go when it is dead or closed. Zero from a bare
    /// [`Registry`](crate::Registry).
    pub pings_waiting: u64,
    /// Events dropped from the owner's event stream
    /// ([`ControlNode::take_events`](crate::ControlNode::take_events)):
    /// notifications past [`Config::event_capacity`](crate::Config::event_capacity)
    /// unread ones (lifecycle events are never dropped once it is taken).
    pub events_dropped: u64,
}

impl Stats {
    /// Sum of the counters of dropped frames.
    pub fn total(&self) -> u64 {
        self.oversized
            + self.malformed
            + self.unknown_type
            + self.unexpected
            + self.hellos_on_live_links
    }

    /// Adds the counters a peer keeps (the others are node-level).
    pub(crate) fn add_peer(&mut self, p: &Self) {
        self.oversized += p.oversized;
        self.malformed += p.malformed;
        self.unknown_type += p.unknown_type;
        self.unexpected += p.unexpected;
    }

    pub(crate) fn count(&mut self, e: &WireError) {
        match e {
            WireError::Oversized { .. } => self.oversized += 1,
            WireError::UnknownType { .. } => self.unknown_type += 1,
            _ => self.malformed += 1,
        }
    }
}

#[derive(Debug)]
enum Hs {
    /// Initiator sent hello.
    Hello { nonce_i: Vec<u8> },
    /// Initiator sent auth (key proven by the acceptor's first proof).
    Auth { nonce_i: Vec<u8>, nonce_a: Vec<u8> },
    /// Acceptor sent hello_ack with its first proof.
    HelloAck { nonce_i: Vec<u8>, nonce_a: Vec<u8> },
}

impl Hs {
    /// The frame this step waits for (for logs).
    fn awaits(&self) -> &'static str {
        match self {
            Self::Hello { .. } => "hello_ack",
            Self::Auth { .. } => "auth_ack",
            Self::HelloAck { .. } => "auth",
        }
    }
}

/// One peer connection as a pure state machine: no sockets, no clock.
///
/// Calling order for a driver, after every input:
/// 1. feed inputs: [`handle_frame`](Self::handle_frame) /
///    [`handle_message`](Self::handle_message),
///    [`handle_channel_error`](Self::handle_channel_error), and
///    [`handle_timeout`](Self::handle_timeout) once `now >=` the last
///    [`poll_timeout`](Self::poll_timeout);
/// 2. drain [`poll_transmit`](Self::poll_transmit) in order and perform it;
/// 3. drain [`poll_event`](Self::poll_event);
/// 4. re-read [`poll_timeout`](Self::poll_timeout) and sleep until it.
///
/// No input ever panics or returns an error that would end the driver loop:
/// keep-alive failures become `Suspect`/`Dead` events.
#[derive(Debug)]
pub struct Peer {
    role: Role,
    addr: String,
    /// How a dialed peer is reached (what the driver resolved).
    route: Route,
    config: Arc<Config>,
    local: Arc<LocalInfo>,
    /// What [`set_local`](Self::set_local) gave while a handshake was
    /// under way: taken up when the next one starts, so one handshake's
    /// MACs and blob all come from the same `local`.
    next_local: Option<Arc<LocalInfo>>,
    state: State,
    closing: bool,
    closed: bool,
    refused: bool,
    dead_reported: bool,
    hs: Option<Hs>,
    remote: Option<RemoteInfo>,
    known_incarnation: Option<u64>,
    attempts: u32,
    last_error: Option<PeerError>,
    timers: TimerTable,
    keepalive: KeepAlive,
    backoff: Backoff,
    transmits: VecDeque<Transmit>,
    events: VecDeque<Event>,
    stats: Stats,
    probes: VecDeque<(u64, Instant)>,
    next_probe: u64,
}

/// Probe sequence numbers live in the upper half so they never collide with
/// keep-alive pings.
const PROBE_BIT: u64 = 1 << 63;
/// Outstanding probes remembered per peer: the pong of an older one is
/// not recognized (the driver forgets its waiter at the same count).
pub(crate) const MAX_PROBES: usize = 64;

impl Peer {
    fn new(
        role: Role,
        now: Instant,
        addr: String,
        config: Arc<Config>,
        local: Arc<LocalInfo>,
    ) -> Self {
        let seed = config.rng_seed
            ^ addr
                .bytes()
                .fold(0u64, |h, b| h.rotate_left(5) ^ u64::from(b));
        Self {
            role,
            addr,
            route: Route::default(),
            backoff: Backoff::new(config.backoff_min, config.backoff_max, seed),
            config,
            local,
            next_local: None,
            state: State::Connecting,
            closing: false,
            closed: false,
            refused: false,
            dead_reported: false,
            hs: None,
            remote: None,
            known_incarnation: None,
            attempts: 0,
            last_error: None,
            timers: TimerTable::default(),
            keepalive: KeepAlive::new(now),
            transmits: VecDeque::new(),
            events: VecDeque::new(),
            stats: Stats::default(),
            probes: VecDeque::new(),
            next_probe: 0,
        }
    }

    /// A peer we dial at `addr`; immediately asks for `Connect` + `hello`.
    pub fn initiator(
        now: Instant,
        addr: String,
        config: Arc<Config>,
        local: Arc<LocalInfo>,
    ) -> Self {
        Self::initiator_via(now, addr, Route::default(), config, local)
    }

    /// [`initiator`](Self::initiator) with the route the driver resolved:
    /// the `hello` tells the peer `route.source`, and the peer's
    /// [`RemoteInfo::peer_host`] is `route.peer`.
    pub fn initiator_via(
        now: Instant,
        addr: String,
        route: Route,
        config: Arc<Config>,
        local: Arc<LocalInfo>,
    ) -> Self {
        let mut p = Self::new(Role::Initiator, now, addr, config, local);
        p.route = route;
        p.start_attempt(now);
        p
    }

    /// A peer that dialed us; `hello` is its first frame.
    pub fn acceptor(
        now: Instant,
        addr: String,
        config: Arc<Config>,
        local: Arc<LocalInfo>,
        hello: Hello,
        known_incarnation: Option<u64>,
    ) -> Self {
        let mut p = Self::new(Role::Acceptor, now, addr, config, local);
        p.known_incarnation = known_incarnation;
        p.state = State::Handshaking;
        p.on_hello(now, hello);
        p
    }

    /// Refusal frame for a peer we will not even track (peer cap).
    pub fn refusal_frame(refusal: &Refusal) -> Vec<u8> {
        error_frame(refusal)
    }

    /// Current state.
    pub fn state(&self) -> State {
        self.state
    }

    /// Our role.
    pub fn role(&self) -> Role {
        self.role
    }

    /// Peer address.
    pub fn addr(&self) -> &str {
        &self.addr
    }

    /// Whether all resources were released.
    pub fn is_closed(&self) -> bool {
        self.closed
    }

    /// Whether the handshake was refused.
    pub fn is_refused(&self) -> bool {
        self.refused
    }

    /// What the peer told us in the last successful handshake.
    pub fn remote(&self) -> Option<&RemoteInfo> {
        self.remote.as_ref()
    }

    /// Drop counters.
    pub fn stats(&self) -> Stats {
        self.stats
    }

    /// Next frame or channel action.
    #[must_use]
    pub fn poll_transmit(&mut self) -> Option<Transmit> {
        self.transmits.pop_front()
    }

    /// Next event.
    #[must_use]
    pub fn poll_event(&mut self) -> Option<Event> {
        self.events.pop_front()
    }

    /// Earliest armed timer.
    #[must_use]
    pub fn poll_timeout(&self) -> Option<Instant> {
        self.timers.next_timeout()
    }

    /// Decodes and handles one frame; malformed, oversized and unknown
    /// frames are dropped and counted.
    pub fn handle_frame(&mut self, now: Instant, bytes: &[u8]) {
        match Message::decode(bytes, self.config.frame_cap) {
            Ok(msg) => self.handle_message(now, msg),
            Err(e) => self.handle_decode_error(now, e),
        }
    }

    /// A frame for this peer failed to decode: dropped and counted, except a
    /// version mismatch during the handshake, which is a refusal.
    pub fn handle_decode_error(&mut self, now: Instant, e: WireError) {
        match e {
            WireError::VersionMismatch { local, remote } if self.hs.is_some() => {
                self.refuse(now, Refusal::Version { local, remote }, true);
            }
            e => {
                debug!(peer = %self.addr, error = %e, "dropped frame");
                self.stats.count(&e);
            }
        }
    }

    /// Handles one decoded message.
    pub fn handle_message(&mut self, now: Instant, msg: Message) {
        if self.closed {
            return;
        }
        if self.closing {
            if matches!(msg, Message::Bye(_)) {
                self.finish_close();
            }
            return;
        }
        match msg {
            Message::Hello(h)
                if self.role == Role::Acceptor && self.state == State::Handshaking =>
            {
                // A retransmitted hello on the same link: ignore.
                let _ = h;
                self.stats.unexpected += 1;
            }
            Message::HelloAck(ack) => self.on_hello_ack(now, ack),
            Message::Auth(a) => self.on_auth(now, a),
            Message::AuthAck(a) => self.on_auth_ack(now, a),
            Message::Error(e) if self.hs.is_some() => {
                self.refuse(
                    now,
                    Refusal::Remote {
                        code: e.code,
                        reason: e.reason,
                    },
                    false,
                );
            }
            Message::Bye(_) => {
                if self.is_up() {
                    self.transmits
                        .push_back(Transmit::Frame(encode(&Message::Bye(Bye {
                            version: PROTOCOL_VERSION,
                        }))));
                }
                self.last_error = Some(PeerError::RemoteClosed);
                self.die(now);
            }
            other if self.is_up() => self.on_up_message(now, other),
            _ => self.stats.unexpected += 1,
        }
    }

    /// The channel reported a failure (connect refused, send failed).
    pub fn handle_channel_error(&mut self, now: Instant, reason: String) {
        if self.closed || self.closing {
            return;
        }
        warn!(peer = %self.addr, %reason, "channel error");
        self.last_error = Some(PeerError::Channel(reason));
        match self.state {
            State::Handshaking if self.role == Role::Initiator => {
                self.hs = None;
                self.state = State::Connecting;
                self.transmits.push_back(Transmit::Disconnect);
                let at = now + self.backoff.next_delay();
                self.timers.set(Timer::Backoff, at);
            }
            State::Dead if self.hs.is_some() => {
                self.hs = None;
                self.transmits.push_back(Transmit::Disconnect);
                let at = now + self.backoff.next_delay();
                self.timers.set(Timer::Backoff, at);
            }
            State::Ready => {
                self.state = State::Suspect;
                self.events.push_back(Event::Suspect);
            }
            State::Handshaking => self.die(now),
            _ => {}
        }
    }

    /// Fires every expired timer.
    pub fn handle_timeout(&mut self, now: Instant) {
        // Each timer fires at most once per call: a timer re-armed at `now`
        // waits for the next call instead of spinning here.
        for _ in 0..Timer::ALL.len() {
            let Some(timer) = self.timers.expire(now) else {
                break;
            };
            self.on_timer(now, timer);
        }
    }

    /// Sends a notification; `Err` hands the payload back if the peer is not
    /// up or the payload is over `notify_cap`.
    pub fn notify(&mut self, transfer_id: u64, payload: Vec<u8>) -> Result<(), Vec<u8>> {
        if !self.is_up() || self.closing || self.closed || payload.len() > self.config.notify_cap {
            return Err(payload);
        }
        let msg = Message::Notify(Notify {
            version: PROTOCOL_VERSION,
            transfer_id,
            payload,
        });
        self.transmits.push_back(Transmit::Frame(encode(&msg)));
        Ok(())
    }

    /// Sends an explicit ping probe; its pong is reported as [`Event::Pong`]
    /// with the round-trip time. `None` if the peer is not up.
    pub fn ping(&mut self, now: Instant) -> Option<u64> {
        if !self.is_up() || self.closing || self.closed {
            return None;
        }
        self.next_probe += 1;
        let seq = PROBE_BIT | self.next_probe;
        if self.probes.len() == MAX_PROBES {
            self.probes.pop_front();
        }
        self.probes.push_back((seq, now));
        let ping = Ping {
            version: PROTOCOL_VERSION,
            seq,
            incarnation: self.local.identity.incarnation,
        };
        self.transmits
            .push_back(Transmit::Frame(encode(&Message::Ping(ping))));
        Some(seq)
    }

    /// Orderly close: says `bye` and waits (bounded by `close_linger`) for the
    /// remote `bye` that proves our earlier frames arrived. Idempotent; works
    /// in every state, including `Dead`.
    pub fn close(&mut self, now: Instant) {
        if self.closed || self.closing {
            return;
        }
        self.timers.stop_all();
        self.hs = None;
        if self.is_up() {
            self.closing = true;
            self.transmits
                .push_back(Transmit::Frame(encode(&Message::Bye(Bye {
                    version: PROTOCOL_VERSION,
                }))));
            self.timers
                .set(Timer::Linger, now + self.config.close_linger);
        } else {
            self.finish_close();
        }
    }

    /// Releases at once, without `bye` (used when a newer connection replaced this one).
    pub fn retire(&mut self) {
        if !self.closed {
            self.last_error = Some(PeerError::Replaced);
            self.finish_close();
        }
    }

    /// Whether the connection is up (`Ready` or `Suspect`).
    pub(crate) fn is_up(&self) -> bool {
        matches!(self.state, State::Ready | State::Suspect)
    }

    /// An orderly close is under way (`bye` sent, waiting for the remote's).
    pub(crate) fn is_closing(&self) -> bool {
        self.closing
    }

    fn finish_close(&mut self) {
        self.timers.stop_all();
        self.closing = false;
        self.closed = true;
        self.transmits.push_back(Transmit::Disconnect);
        self.events.push_back(Event::Closed);
    }

    /// What this side tells the peer in handshakes from now on (a new
    /// data-plane blob); a handshake under way ends with the old one.
    pub(crate) fn set_local(&mut self, local: Arc<LocalInfo>) {
        if self.hs.is_none() {
            self.local = local;
        } else {
            self.next_local = Some(local);
        }
    }

    /// Takes up a `local` that [`set_local`](Self::set_local) deferred
    /// (a handshake starts).
    pub(super) fn settle_local(&mut self) {
        if let Some(local) = self.next_local.take() {
            self.local = local;
        }
    }

    fn start_attempt(&mut self, now: Instant) {
        self.settle_local();
        self.attempts += 1;
        let nonce_i = match &self.config.psk {
            Some(key) => auth::own_nonce(key.as_bytes(), &self.local.identity.transcript_bytes()),
            None => auth::nonce(),
        };
        let keyed = self.config.psk.is_some();
        let hello = Hello::new(
            self.local.identity.clone(),
            keyed.then(|| nonce_i.clone()),
            self.local.data_plane.clone(),
            self.route.source.map(|ip| ip.to_string()),
        );
        self.transmits.push_back(Transmit::Connect);
        self.transmits
            .push_back(Transmit::Frame(encode(&Message::Hello(hello))));
        self.hs = Some(Hs::Hello { nonce_i });
        if self.state != State::Dead {
            self.state = State::Handshaking;
        }
        if self.timers.get(Timer::Handshake).is_none() {
            self.timers
                .set(Timer::Handshake, now + self.config.handshake_timeout);
        }
    }

    fn on_timer(&mut self, now: Instant, timer: Timer) {
        match timer {
            Timer::Handshake => {
                // Also without `hs`: a handshake that lost its state for
                // any reason still ends at its deadline.
                if self.hs.is_some() || matches!(self.state, State::Connecting | State::Handshaking)
                {
                    if self.last_error.is_none() {
                        self.last_error =
                            Some(PeerError::HandshakeTimeout(self.config.handshake_timeout));
                    }
                    self.hs = None;
                    self.timers.stop(Timer::Backoff);
                    self.die(now);
                }
            }
            Timer::Backoff => {
                if self.role == Role::Initiator && !self.refused {
                    self.start_attempt(now);
                }
            }
            Timer::KeepAlive => {
                if !self.is_up() {
                    return;
                }
                // The dialer pings every interval. An acceptor that heard
                // from it within the last interval answers those pings and
                // sends none of its own (half the keep-alive frames: 1,000
                // peers cost 6.8% of a core with both sides pinging); it
                // pings only once the dialer was quiet for 1.5 intervals
                // (its pings arrive up to a round trip after our tick); the
                // liveness bound (last heard + death bound) is unchanged.
                let quiet = now.saturating_duration_since(self.keepalive.last_heard);
                let interval = self.config.keepalive_interval;
                if self.role == Role::Acceptor
                    && self.keepalive.unanswered == 0
                    && quiet < interval + interval / 2
                {
                    self.timers
                        .set(Timer::KeepAlive, now + self.config.keepalive_interval);
                    return;
                }
                if self.keepalive.unanswered > 0 && self.state == State::Ready {
                    self.state = State::Suspect;
                    info!(peer = %self.addr, "suspect: keep-alive unanswered");
                    self.events.push_back(Event::Suspect);
                }
                let seq = self.keepalive.ping();
                tracing::trace!(peer = %self.addr, seq, unanswered = self.keepalive.unanswered, "keep-alive ping");
                let ping = Ping {
                    version: PROTOCOL_VERSION,
                    seq,
                    incarnation: self.local.identity.incarnation,
                };
                self.transmits
                    .push_back(Transmit::Frame(encode(&Message::Ping(ping))));
                self.timers
                    .set(Timer::KeepAlive, now + self.config.keepalive_interval);
            }
            Timer::Liveness => {
                // Dead means pings went unanswered, not only that the bound
                // passed on the clock: a node whose own thread was not
                // scheduled (a core shared with an engine's busy threads)
                // sent none meanwhile and must not blame the peer for a
                // silence it caused. On time, a dialer has `budget` pings
                // out and an acceptor (which starts after 1.5 quiet
                // intervals) `budget - 1`; fewer means this node stalled:
                // give the peer the pings it is owed, one interval each.
                let needed = self.config.liveness_budget.saturating_sub(1);
                if self.is_up() && self.keepalive.unanswered < needed {
                    let owed = needed - self.keepalive.unanswered;
                    self.timers.set(
                        Timer::Liveness,
                        now + self.config.keepalive_interval.saturating_mul(owed),
                    );
                    if self.timers.get(Timer::KeepAlive).is_none_or(|at| at > now) {
                        self.timers.set(Timer::KeepAlive, now);
                    }
                    return;
                }
                if self.is_up() {
                    self.last_error = Some(PeerError::KeepAliveTimeout {
                        missed: self.keepalive.unanswered,
                    });
                    self.attempts = self.keepalive.unanswered;
                    self.die(now);
                }
            }
            Timer::Linger => self.finish_close(),
        }
    }

    /// Marks dead (event once per life), releases the channel connection and,
    /// for an initiator, schedules a reconnect.
    fn die(&mut self, now: Instant) {
        let was_dead = self.state == State::Dead;
        self.state = State::Dead;
        self.hs = None;
        self.timers.stop(Timer::KeepAlive);
        self.timers.stop(Timer::Liveness);
        self.timers.stop(Timer::Handshake);
        self.transmits.push_back(Transmit::Disconnect);
        if !was_dead || !self.dead_reported {
            self.dead_reported = true;
            let last_error = self.last_error.clone().unwrap_or(PeerError::RemoteClosed);
            if self.unproven_inbound() {
                debug!(peer = %self.addr, error = %last_error, "inbound handshake ended");
            } else if last_error == PeerError::RemoteClosed {
                // A `bye`: the remote shut down on purpose.
                info!(peer = %self.addr, "peer closed the connection");
            } else {
                warn!(peer = %self.addr, attempts = self.attempts, error = %last_error, "peer dead");
            }
            self.events.push_back(Event::Dead {
                peer: self.addr.clone(),
                attempts: self.attempts,
                last_error,
            });
        }
        self.attempts = 0;
        if self.role == Role::Initiator && self.config.reconnect && !self.refused {
            let at = now + self.backoff.next_delay();
            self.timers.set(Timer::Backoff, at);
        }
    }

    /// An inbound peer that never finished a handshake: anybody can make
    /// one, so its refusal and death are debug lines (the registry counts
    /// them and writes a rate-limited summary).
    fn unproven_inbound(&self) -> bool {
        self.role == Role::Acceptor && self.remote.is_none()
    }

    fn refuse(&mut self, now: Instant, refusal: Refusal, tell_peer: bool) {
        if self.unproven_inbound() {
            debug!(peer = %self.addr, %refusal, "handshake refused");
        } else {
            warn!(peer = %self.addr, %refusal, "handshake refused");
        }
        if tell_peer {
            self.transmits
                .push_back(Transmit::Frame(error_frame(&refusal)));
        }
        self.refused = true;
        self.events.push_back(Event::Refused {
            peer: self.addr.clone(),
            refusal: refusal.clone(),
        });
        self.last_error = Some(PeerError::Refused(refusal));
        self.timers.stop(Timer::Backoff);
        self.die(now);
    }

    fn become_ready(&mut self, now: Instant, remote: RemoteInfo) {
        if let Some(old) = self.known_incarnation {
            if old != remote.identity.incarnation {
                info!(peer = %self.addr, old, new = remote.identity.incarnation, "peer restarted");
                self.events.push_back(Event::Restarted {
                    old,
                    new: remote.identity.incarnation,
                });
            }
        }
        self.known_incarnation = Some(remote.identity.incarnation);
        self.hs = None;
        self.state = State::Ready;
        self.attempts = 0;
        self.dead_reported = false;
        self.last_error = None;
        self.backoff.reset();
        self.timers.stop(Timer::Handshake);
        self.timers.stop(Timer::Backoff);
        self.keepalive = KeepAlive::new(now);
        self.timers
            .set(Timer::KeepAlive, now + self.config.keepalive_interval);
        self.timers
            .set(Timer::Liveness, now + self.config.death_bound());
        info!(peer = %self.addr, engine = %remote.identity.engine_id, "peer ready");
        self.remote = Some(remote.clone());
        self.events.push_back(Event::Ready(remote));
    }

    fn on_up_message(&mut self, now: Instant, msg: Message) {
        if tracing::enabled!(tracing::Level::TRACE) {
            let kind = match &msg {
                Message::Ping(p) => format!("ping {}", p.seq),
                Message::Pong(p) => format!("pong {}", p.seq),
                _ => "other".to_owned(),
            };
            tracing::trace!(peer = %self.addr, %kind, quiet_ms = now.saturating_duration_since(self.keepalive.last_heard).as_millis() as u64, "heard");
        }
        if self.keepalive.heard(now) && self.state == State::Suspect {
            self.state = State::Ready;
            self.events.push_back(Event::Recovered);
        }
        self.timers
            .set(Timer::Liveness, now + self.config.death_bound());
        match msg {
            Message::Ping(p) => {
                let pong = Ping {
                    version: PROTOCOL_VERSION,
                    seq: p.seq,
                    incarnation: self.local.identity.incarnation,
                };
                self.transmits
                    .push_back(Transmit::Frame(encode(&Message::Pong(pong))));
            }
            Message::Pong(p) if p.seq & PROBE_BIT != 0 => {
                if let Some(i) = self.probes.iter().position(|(s, _)| *s == p.seq) {
                    if let Some((seq, sent)) = self.probes.remove(i) {
                        self.events.push_back(Event::Pong {
                            seq,
                            rtt: now.saturating_duration_since(sent),
                        });
                    }
                }
            }
            Message::Pong(_) => {}
            Message::Notify(n) if n.payload.len() > self.config.notify_cap => {
                debug!(peer = %self.addr, len = n.payload.len(), "notification over the cap dropped");
                self.stats.oversized += 1;
            }
            Message::Notify(n) => self.events.push_back(Event::Notification {
                transfer_id: n.transfer_id,
                payload: n.payload,
            }),
            _ => self.stats.unexpected += 1,
        }
    }
}

fn error_frame(refusal: &Refusal) -> Vec<u8> {
    encode(&Message::Error(ErrorMsg {
        version: PROTOCOL_VERSION,
        code: refusal.code().to_owned(),
        reason: refusal.to_string(),
    }))
}

/// Encoding our own plain messages cannot fail; an empty frame (dropped by
/// the peer as malformed) is the harmless fallback.
fn encode(msg: &Message) -> Vec<u8> {
    msg.encode().unwrap_or_default()
}
