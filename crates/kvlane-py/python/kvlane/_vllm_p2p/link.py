"""What the control and data transports share: the wire envelope, the
peer-id check, the limits, and the dialer (one kvlane link per address,
dialed off vLLM's scheduler thread)."""

from __future__ import annotations

import logging
from collections import OrderedDict, deque
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Deque, Dict, Optional

import msgspec

import kvlane

logger = logging.getLogger("kvlane.vllm.p2p")

#: Version of the envelope every control message travels in.
WIRE_VERSION = 1

#: Threads that run ``Agent.connect`` (a handshake, up to the agent's
#: handshake timeout when the peer is down) off vLLM's scheduler thread.
DIAL_THREADS = 4

#: Messages a connection holds while its peer is not reachable yet. vLLM's
#: session sends one ConnectMsg before the handshake and queues the rest
#: itself; past this a send raises (the session marks the connection dead).
MAX_QUEUED_MESSAGES = 4096

#: Connections one transport keeps; a message from a new peer past it is
#: dropped and counted (vLLM's own cap, ``VLLM_P2P_MAX_PEERS``, is lower).
MAX_CONNECTIONS = 1024

#: Seconds a connection waits for its peer to become reachable (dial,
#: attach, a stale link replaced) before it is dead. vLLM's handshake
#: timeout (30 s by default) usually ends it first.
REACH_TIMEOUT_S = 30.0

#: Earlier incarnations remembered per address, so their late messages are
#: dropped instead of opening a connection.
RETIRED_PER_PEER = 4

#: Seconds between sweeps of links that are down (closed after two sweeps).
SWEEP_INTERVAL_S = 1.0


def check_peer_id(peer_id: Any) -> str:
    if not isinstance(peer_id, str) or peer_id.count(":") < 1:
        raise ValueError(f"peer_id is a \"host:port\" string, not {peer_id!r}")
    host, _, port = peer_id.rpartition(":")
    if not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"peer_id is a \"host:port\" string, not {peer_id!r}")
    return peer_id


class Envelope(msgspec.Struct, frozen=True):
    """What one control message is on the wire: the message and the two
    incarnations it was sent between."""

    v: int
    from_inc: int
    to_inc: int
    msg: Dict[str, Any]


encoder = msgspec.msgpack.Encoder()
decoder = msgspec.msgpack.Decoder(Envelope)


class Dialer:
    """One kvlane connection per remote address, dialed off the caller's
    thread. ``peer(addr)`` returns the future of the address's ``Peer``,
    dialing afresh when the last dial failed or its connection is down."""

    def __init__(self, agent: kvlane.Agent, threads: int = DIAL_THREADS,
                 cap: int = MAX_CONNECTIONS) -> None:
        self._agent = agent
        self._pool = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="kvlane-p2p-dial")
        self._dials: "OrderedDict[str, Future]" = OrderedDict()
        self._cap = cap
        self._closed = False
        #: Incarnations known gone per address (the control transport
        #: records them when a newer process at the address has spoken).
        self.retired: "OrderedDict[str, Deque[int]]" = OrderedDict()
        self._next_sweep = 0.0
        self._down: set = set()  # addresses whose link was down at the last sweep

    def retire(self, addr: str, inc: int) -> None:
        seen = self.retired.setdefault(addr, deque(maxlen=RETIRED_PER_PEER))
        if inc not in seen:
            seen.append(inc)
        self.retired.move_to_end(addr)
        while len(self.retired) > self._cap:
            self.retired.popitem(last=False)

    def is_retired(self, addr: str, inc: Optional[int]) -> bool:
        return inc in self.retired.get(addr, ())

    def peer(self, addr: str, stale: Optional[int] = None) -> "Future[kvlane.Peer]":
        """The dial of ``addr``. ``stale``: an incarnation known to be gone
        (a newer process at ``addr`` has spoken); a link still up to it is
        closed and dialed again instead of waiting for kvlane's liveness
        budget to find it dead."""
        if self._closed:
            raise RuntimeError("kvlane p2p: the transport is closed")
        f = self._dials.get(addr)
        old = None
        if f is not None and f.done():
            if f.cancelled() or f.exception() is not None:
                f = None
            elif not f.result().attached or (stale is not None
                                             and f.result().incarnation == stale):
                old, f = f.result(), None
        if f is None:
            f = self._pool.submit(self._connect, addr, old)
            self._dials[addr] = f
            if len(self._dials) > self._cap:
                for a in [a for a, d in self._dials.items() if d.done() and a != addr]:
                    del self._dials[a]
                    if len(self._dials) <= self._cap:
                        break
        self._dials.move_to_end(addr)
        return f

    def sweep(self, now: float) -> None:
        """Closes links that stayed down for a sweep interval (a dead
        connection keeps its resources until closed) and forgets failed
        dials; at most once per ``SWEEP_INTERVAL_S``."""
        if now < self._next_sweep or self._closed:
            return
        self._next_sweep = now + SWEEP_INTERVAL_S
        down = set()
        for addr, f in list(self._dials.items()):
            if not f.done():
                continue
            if f.cancelled() or f.exception() is not None:
                del self._dials[addr]
            elif not f.result().attached:
                if addr in self._down:
                    del self._dials[addr]
                    self._pool.submit(disconnect, f.result(), addr)
                else:
                    down.add(addr)
        self._down = down

    def _connect(self, addr: str, old: Optional[kvlane.Peer]) -> kvlane.Peer:
        if old is not None:
            disconnect(old, addr)
        return self._agent.connect(addr)

    def close(self) -> None:
        self._closed = True
        self._pool.shutdown(wait=False, cancel_futures=True)
        self._dials.clear()


def disconnect(peer: kvlane.Peer, addr: str) -> None:
    """Closes a link that is down or to a process known gone (on the dial
    pool: its result is nobody's, so a failure is logged here)."""
    try:
        peer.disconnect()
    except kvlane.Error as e:
        logger.info("kvlane p2p: closing the link to %s: %s", addr, e)


def dial_error(f: Future) -> Optional[BaseException]:
    if f.cancelled():
        return RuntimeError("dial cancelled (transport closed)")
    return f.exception()


