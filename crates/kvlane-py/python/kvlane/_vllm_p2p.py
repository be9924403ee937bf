"""vLLM's P2P KV-offload tier on kvlane: ``kvlane.vllm.KvlaneP2PTier``.

vLLM's OffloadingConnector runs a peer-to-peer secondary tier
(``vllm/v1/kv_offload/tiering/p2p``) whose manager hard-codes a ZMQ control
transport and a NIXL data transport. This module gives that tier kvlane's
transports, selected with one entry of ``secondary_tiers``::

    {"type": "KvlaneP2PTier", "module_path": "kvlane.vllm",
     "host": "10.0.0.5", "port": 5710, "kvlane": {"psk": "..."}}

Everything else (sessions, protocol, timeouts, the manager's bookkeeping)
is vLLM's own code, unchanged. The pieces:

- :class:`KvlaneControlTransport` / :class:`KvlaneControlConnection`
  (``control/base.py``): control messages are kvlane notifications over the
  agent's control plane. A connection is named by the remote's listen
  address (its kvlane ``engine_id`` is that ``host:port``). Every message
  carries the sender's and the receiver's kvlane incarnations, so a peer
  that restarted is a new connection at once (its first message is never
  dropped, and never handed to the session of its previous process) and a
  message meant for an earlier process at this address is dropped.
- :class:`KvlaneDataTransport` (``data/base.py``): the tier's memoryview is
  registered with the agent; ``write_blocks`` is one kvlane WRITE of every
  block; ``poll(peer_id)`` reports that peer's transfers; a transfer is only
  ever posted to the incarnation the peer's session handshook with.
- :class:`KvlaneP2PTier`: vLLM's ``P2PSecondaryTierManager`` built with
  these transports (no ZMQ socket is bound, NIXL is not touched), one kvlane
  agent per tier listening on the tier's ``host:port``, and a restarted
  peer's new connection accepted in the poll that received it.

Threads: vLLM drives everything from ``poll()`` on its scheduler thread and
nothing here blocks it. kvlane's own runtime does the I/O; the one blocking
call, ``Agent.connect`` (the handshake), runs on a small pool
(``DIAL_THREADS``) whose results are collected by ``poll()``.
"""

from __future__ import annotations

import itertools
import logging
import os
import time
from collections import OrderedDict, deque
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Deque, Dict, Iterable, List, Optional, Sequence

import msgspec
import numpy as np

import kvlane
from vllm.v1.kv_offload.tiering.p2p.control.base import ControlConnection, ControlTransport
from vllm.v1.kv_offload.tiering.p2p.data.base import CancelMode, DataTransport, PollResult
from vllm.v1.kv_offload.tiering.p2p.manager import P2PSecondaryTierManager

__all__ = [
    "KvlaneControlConnection",
    "KvlaneControlTransport",
    "KvlaneDataTransport",
    "KvlaneP2PTier",
]

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

_EMPTY_POLL = PollResult(done=(), failed=())


def _check_peer_id(peer_id: Any) -> str:
    if not isinstance(peer_id, str) or peer_id.count(":") < 1:
        raise ValueError(f"peer_id is a \"host:port\" string, not {peer_id!r}")
    host, _, port = peer_id.rpartition(":")
    if not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"peer_id is a \"host:port\" string, not {peer_id!r}")
    return peer_id


class _Envelope(msgspec.Struct, frozen=True):
    """What one control message is on the wire: the message and the two
    incarnations it was sent between."""

    v: int
    from_inc: int
    to_inc: int
    msg: Dict[str, Any]


_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(_Envelope)


class _Dialer:
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
                    self._pool.submit(_disconnect, f.result(), addr)
                else:
                    down.add(addr)
        self._down = down

    def _connect(self, addr: str, old: Optional[kvlane.Peer]) -> kvlane.Peer:
        if old is not None:
            _disconnect(old, addr)
        return self._agent.connect(addr)

    def close(self) -> None:
        self._closed = True
        self._pool.shutdown(wait=False, cancel_futures=True)
        self._dials.clear()


def _disconnect(peer: kvlane.Peer, addr: str) -> None:
    """Closes a link that is down or to a process known gone (on the dial
    pool: its result is nobody's, so a failure is logged here)."""
    try:
        peer.disconnect()
    except kvlane.Error as e:
        logger.info("kvlane p2p: closing the link to %s: %s", addr, e)


def _dial_error(f: Future) -> Optional[BaseException]:
    if f.cancelled():
        return RuntimeError("dial cancelled (transport closed)")
    return f.exception()


# ----------------------------------------------------------------------
# Control plane
# ----------------------------------------------------------------------


class KvlaneControlConnection(ControlConnection):
    """vLLM's control connection to one peer over kvlane notifications.

    ``remote_incarnation`` is the peer process this connection talks to:
    known at once for an inbound connection (from its first message), once
    the dial completed for an outbound one. Messages are sent only to that
    incarnation; they wait (at most ``MAX_QUEUED_MESSAGES``) while the peer
    is not reachable, and the connection is dead when the peer's process is
    gone, restarted, or unreachable for ``REACH_TIMEOUT_S``."""

    def __init__(self, peer_id: str, transport: "KvlaneControlTransport",
                 remote_incarnation: Optional[int], now: float) -> None:
        super().__init__(peer_id)
        self._transport = transport
        self._remote_inc = remote_incarnation
        self._dial: "Future[kvlane.Peer]" = transport._dialer.peer(peer_id)
        self._peer: Optional[kvlane.Peer] = None
        self._outbox: Deque[bytes] = deque()
        self._inbox: List[dict] = []
        self._dead = False
        self._closed = False
        self._reach_deadline = now + transport._reach_timeout_s
        #: Why the connection died, for logs and tests.
        self.death_reason: Optional[str] = None

    @property
    def remote_incarnation(self) -> Optional[int]:
        return self._remote_inc

    @property
    def alive(self) -> bool:
        return not (self._dead or self._closed)

    def send(self, msg: dict) -> None:
        if not self.alive:
            raise RuntimeError(
                f"kvlane p2p: send on a {'closed' if self._closed else 'dead'} connection "
                f"to {self.peer_id}" + (f" ({self.death_reason})" if self.death_reason else "")
            )
        if not isinstance(msg, dict):
            raise TypeError(f"kvlane p2p: a control message is a dict, not {type(msg).__name__}")
        if len(self._outbox) >= MAX_QUEUED_MESSAGES:
            raise BufferError(
                f"kvlane p2p: {MAX_QUEUED_MESSAGES} messages already wait for {self.peer_id}, "
                "which is not reachable yet"
            )
        self._outbox.append(_encoder.encode(msg))
        self._pump(time.monotonic())

    def recv(self) -> Sequence[dict]:
        if not self._inbox:
            return ()
        msgs, self._inbox = self._inbox, []
        return msgs

    def mark_dead(self) -> None:
        self._dead = True
        if self.death_reason is None:
            self.death_reason = "marked dead by its owner"

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._dead = True
        self._outbox.clear()
        self._transport._forget(self)

    # -- driven by the transport -----------------------------------------

    def _die(self, reason: str) -> None:
        if self.alive:
            logger.info("kvlane p2p: connection to %s is dead: %s", self.peer_id, reason)
            self.death_reason = reason
        self._dead = True

    def _enqueue(self, msg: dict) -> None:
        self._inbox.append(msg)

    def _check(self, now: float) -> None:
        """Marks the connection dead when its peer's process is gone."""
        p = self._peer
        if p is None or not self.alive:
            return
        if p.incarnation != self._remote_inc:
            self._die(f"{self.peer_id} restarted (incarnation {self._remote_inc:#x} -> "
                      f"{p.incarnation:#x})" if p.incarnation is not None
                      else f"{self.peer_id} is gone")
        elif not p.attached:
            self._die(f"kvlane lost the connection to {self.peer_id}")

    def _pump(self, now: float) -> None:
        """Sends what waits, once the peer of ``remote_incarnation`` is
        reachable; never blocks."""
        if not self.alive:
            return
        if self._peer is None and not self._reach(now):
            return
        p = self._peer
        assert p is not None and self._remote_inc is not None
        my_inc = self._transport._incarnation
        while self._outbox:
            payload = self._outbox[0]
            env = _encoder.encode(_Envelope(WIRE_VERSION, my_inc, self._remote_inc,
                                            msgspec.Raw(payload)))  # type: ignore[arg-type]
            try:
                p.notify(env)
            except kvlane.Error as e:
                self._die(f"sending to {self.peer_id} failed: {e}")
                return
            self._outbox.popleft()

    def _reach(self, now: float) -> bool:
        """Takes the dialed peer once it is the incarnation this
        connection talks to; dials again when the link is down."""
        f = self._dial
        if not f.done():
            if now > self._reach_deadline:
                self._die(f"{self.peer_id} not reachable after {self._transport._reach_timeout_s:.0f} s")
            return False
        err = _dial_error(f)
        if err is None:
            p = f.result()
            inc = p.incarnation
            if self._remote_inc is None and p.attached:
                self._remote_inc = inc
            if inc == self._remote_inc and p.attached:
                self._peer = p
                return True
        if now > self._reach_deadline:
            self._die(f"{self.peer_id} not reachable after "
                      f"{self._transport._reach_timeout_s:.0f} s: "
                      + (str(err) if err is not None else "its link is to another incarnation"))
            return False
        if err is not None and self._remote_inc is None:
            # An outbound connection whose dial failed: the peer is not
            # there. vLLM's session fails the request; do not retry here.
            self._die(f"connecting to {self.peer_id} failed: {err}")
            return False
        # The link is down, or to another process at this address: dial
        # again once it is down, or at once if that process is known gone.
        if err is not None or not f.result().attached:
            self._dial = self._transport._dialer.peer(self.peer_id)
        elif self._transport._dialer.is_retired(self.peer_id, f.result().incarnation):
            self._dial = self._transport._dialer.peer(self.peer_id,
                                                      stale=f.result().incarnation)
        return False


class KvlaneControlTransport(ControlTransport):
    """vLLM's ``ControlTransport`` on a kvlane agent's control plane.

    The agent's ``engine_id`` must be this node's ``host:port`` (the peer id
    other nodes dial), as :class:`KvlaneP2PTier` sets it. The agent is the
    caller's: ``close()`` closes the connections, not the agent."""

    def __init__(self, agent: kvlane.Agent, dialer: Optional[_Dialer] = None,
                 reach_timeout_s: float = REACH_TIMEOUT_S) -> None:
        self._agent = agent
        self._own_dialer = dialer is None
        self._dialer = dialer if dialer is not None else _Dialer(agent)
        self._incarnation = agent.incarnation
        self._notes = agent.notifications()
        self._reach_timeout_s = float(reach_timeout_s)
        self._conns: Dict[str, KvlaneControlConnection] = {}
        self._closed = False
        #: Dropped messages by reason (``malformed``, ``stale``, ``cap``).
        self.dropped: Dict[str, int] = {"malformed": 0, "stale": 0, "cap": 0}

    @property
    def local_id(self) -> str:
        return self._agent.engine_id

    def connect(self, peer_id: str) -> KvlaneControlConnection:
        if self._closed:
            raise RuntimeError("kvlane p2p: connect on a closed transport")
        _check_peer_id(peer_id)
        existing = self._conns.get(peer_id)
        if existing is not None:
            if existing.alive:
                raise ValueError(f"kvlane p2p: a live connection to {peer_id} exists")
            self._retire(existing)
        conn = KvlaneControlConnection(peer_id, self, None, time.monotonic())
        self._conns[peer_id] = conn
        return conn

    def poll(self) -> Sequence[ControlConnection]:
        if self._closed:
            return ()
        now = time.monotonic()
        self._dialer.sweep(now)
        for conn in list(self._conns.values()):
            conn._check(now)
            if not conn.alive:
                self._retire(conn)
        new: List[ControlConnection] = []
        for note in self._notes.drain():
            conn = self._route(note, now)
            if conn is not None:
                new.append(conn)
        for conn in list(self._conns.values()):
            conn._pump(now)
        return new

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        for conn in list(self._conns.values()):
            conn.close()
        self._conns.clear()
        if self._own_dialer:
            self._dialer.close()

    # -- internal ----------------------------------------------------------

    def _route(self, note: kvlane.Notification, now: float) -> Optional[KvlaneControlConnection]:
        """Hands one notification to its connection; returns the connection
        if it is a new one."""
        try:
            env = _decoder.decode(note.payload)
            if env.v != WIRE_VERSION:
                raise ValueError(f"wire version {env.v}")
            _check_peer_id(note.sender)
        except (msgspec.DecodeError, msgspec.ValidationError, ValueError) as e:
            self.dropped["malformed"] += 1
            logger.warning("kvlane p2p: dropped a malformed message from %s: %s", note.sender, e)
            return None
        peer_id = note.sender
        if env.to_inc != self._incarnation:
            self.dropped["stale"] += 1  # meant for an earlier process at this address
            return None
        conn = self._conns.get(peer_id)
        if conn is not None and conn.alive:
            if conn.remote_incarnation is None:
                conn._remote_inc = env.from_inc
            if conn.remote_incarnation == env.from_inc:
                conn._enqueue(env.msg)
                return None
        if self._dialer.is_retired(peer_id, env.from_inc):
            self.dropped["stale"] += 1  # a late message of an earlier incarnation
            return None
        if conn is not None:
            # The peer restarted: its old connection dies now, and the new
            # process gets a new connection with this message in it.
            conn._die(f"{peer_id} restarted")
            self._retire(conn)
        elif len(self._conns) >= MAX_CONNECTIONS:
            self.dropped["cap"] += 1
            logger.warning("kvlane p2p: %d connections, dropping a message from %s",
                           MAX_CONNECTIONS, peer_id)
            return None
        conn = KvlaneControlConnection(peer_id, self, env.from_inc, now)
        conn._enqueue(env.msg)
        self._conns[peer_id] = conn
        return conn

    def _retire(self, conn: KvlaneControlConnection) -> None:
        """Unregisters a dead connection (its owner still closes it) and
        remembers its incarnation."""
        if self._conns.get(conn.peer_id) is conn:
            del self._conns[conn.peer_id]
        if conn.remote_incarnation is not None:
            self._dialer.retire(conn.peer_id, conn.remote_incarnation)

    def _forget(self, conn: KvlaneControlConnection) -> None:
        if self._conns.get(conn.peer_id) is conn:
            self._retire(conn)


# ----------------------------------------------------------------------
# Data plane
# ----------------------------------------------------------------------


class _Meta(msgspec.Struct, frozen=True):
    """What ``get_agent_metadata`` says: the data plane's address (``None``:
    the peer id) and the agent's incarnation."""

    v: int
    inc: int
    addr: Optional[str] = None


@dataclass
class _Remote:
    addr: str
    inc: int
    base: int
    num_blocks: int
    dial: "Future[kvlane.Peer]"


@dataclass
class _Xfer:
    peer_id: str
    remote: _Remote
    local: np.ndarray
    remote_spans: np.ndarray
    deadline: float
    transfer: Optional[kvlane.Transfer] = None
    failed: Optional[str] = None
    posted_at: Optional[float] = field(default=None)


class KvlaneDataTransport(DataTransport):
    """vLLM's ``DataTransport`` on a kvlane agent's data plane.

    The view (``num_blocks`` x ``block_len``, writable, C-contiguous) is
    registered with ``agent`` here, before any peer connects. A transfer is
    posted only to the incarnation named in the peer's metadata: while the
    link to it is not up it waits (``deadline_s``, then it fails); if the
    peer is another process now, it fails. The agent is the caller's."""

    def __init__(self, agent: kvlane.Agent, view: memoryview, config_fields: Optional[dict] = None,
                 dialer: Optional[_Dialer] = None, advertise: Optional[str] = None,
                 deadline_s: float = REACH_TIMEOUT_S) -> None:
        if not isinstance(view, memoryview) or view.ndim != 2 or view.readonly \
                or not view.c_contiguous:
            raise ValueError(
                "kvlane p2p: the tier's view is a writable, C-contiguous 2-D memoryview "
                f"(blocks x block bytes), not {view!r}"
            )
        super().__init__(view, config_fields=config_fields)
        self._agent = agent
        self._own_dialer = dialer is None
        self._dialer = dialer if dialer is not None else _Dialer(agent)
        self._advertise = advertise
        self._deadline_s = float(deadline_s)
        agent.register(view)
        self._remotes: Dict[str, _Remote] = {}
        self._xfers: Dict[int, _Xfer] = {}
        self._by_peer: Dict[str, Dict[int, _Xfer]] = {}
        self._ids = itertools.count()
        self._closed = False

    def get_agent_metadata(self) -> bytes:
        return _encoder.encode(_Meta(WIRE_VERSION, self._agent.incarnation, self._advertise))

    def add_remote_peer(self, peer_id: str, agent_metadata: bytes, base_addr: int,
                        num_blocks: int, block_len: int) -> None:
        self._live()
        _check_peer_id(peer_id)
        try:
            meta = msgspec.msgpack.decode(agent_metadata, type=_Meta)
        except (msgspec.DecodeError, msgspec.ValidationError, TypeError) as e:
            raise ValueError(f"kvlane p2p: bad agent metadata from {peer_id}: {e}") from e
        if block_len != self._block_len:
            raise ValueError(f"kvlane p2p: {peer_id} has blocks of {block_len} bytes, "
                             f"this node {self._block_len}")
        if not isinstance(num_blocks, int) or num_blocks <= 0 or not isinstance(base_addr, int):
            raise ValueError(f"kvlane p2p: {peer_id} advertised {num_blocks!r} blocks at "
                             f"{base_addr!r}")
        addr = meta.addr or peer_id
        old = self._remotes.get(peer_id)
        if old is not None and old.inc != meta.inc:
            self._fail_peer(peer_id, f"{peer_id} restarted")
        self._remotes[peer_id] = _Remote(addr, meta.inc, base_addr, num_blocks,
                                         self._dialer.peer(addr))

    def remove_remote_peer(self, peer_id: str) -> None:
        if self._closed:
            return
        self._remotes.pop(peer_id, None)
        for x in self._by_peer.pop(peer_id, {}).values():
            self._release(x)

    def write_blocks(self, peer_id: str, local_idxs: List[int],
                     remote_idxs: List[int]) -> Optional[int]:
        self._live()
        local = np.asarray(local_idxs, dtype=np.int64).reshape(-1)
        remote_idx = np.asarray(remote_idxs, dtype=np.int64).reshape(-1)
        if local.shape != remote_idx.shape:
            raise ValueError(f"kvlane p2p: write_blocks to {peer_id}: {local.size} local and "
                             f"{remote_idx.size} remote block indexes")
        r = self._remotes.get(peer_id)
        if r is None:
            logger.warning("kvlane p2p: write_blocks to %s, which is not registered", peer_id)
            return None
        _check_range("local", local, self._num_blocks, peer_id)
        _check_range("remote", remote_idx, r.num_blocks, peer_id)
        bl = self._block_len
        lens = np.full(local.size, bl, dtype=np.int64)
        x = _Xfer(peer_id, r, np.column_stack((self._base_addr + local * bl, lens)),
                  np.column_stack((r.base + remote_idx * bl, lens)),
                  time.monotonic() + self._deadline_s)
        tid = next(self._ids)
        self._xfers[tid] = x
        self._by_peer.setdefault(peer_id, {})[tid] = x
        self._post(x, time.monotonic())
        return tid

    def poll(self, peer_id: Optional[str] = None) -> PollResult:
        if self._closed:
            return _EMPTY_POLL
        if peer_id is None:
            groups = list(self._by_peer.values())
        else:
            g = self._by_peer.get(peer_id)
            groups = [g] if g else []
        now = time.monotonic()
        self._dialer.sweep(now)
        done: List[int] = []
        failed: List[int] = []
        for g in groups:
            for tid, x in list(g.items()):
                if x.transfer is None and x.failed is None:
                    self._post(x, now)
                if x.failed is not None:
                    logger.info("kvlane p2p: transfer %d to %s failed: %s", tid, x.peer_id, x.failed)
                    failed.append(tid)
                elif x.transfer is not None and x.transfer.done():
                    (done if x.transfer.status == "done" else failed).append(tid)
                    if x.transfer.status != "done":
                        logger.info("kvlane p2p: transfer %d to %s failed: %s", tid, x.peer_id,
                                    x.transfer.error())
                else:
                    continue
                self._pop(tid)
        if not done and not failed:
            return _EMPTY_POLL
        return PollResult(done=done, failed=failed)

    def cancel(self, transfer_ids: Iterable[int], mode: CancelMode = "immediate") -> List[int]:
        if mode not in ("immediate", "wait"):
            raise ValueError(f"kvlane p2p: cancel mode is \"immediate\" or \"wait\", not {mode!r}")
        if self._closed:
            return []
        still: List[int] = []
        for tid in transfer_ids:
            x = self._xfers.get(tid)
            if x is None:
                continue
            if mode == "wait" and x.transfer is not None and not x.transfer.done():
                still.append(tid)  # it ends by its deadline; poll() reports it
                continue
            self._pop(tid)
        return still

    def close(self) -> None:
        if self._closed:
            return
        for tid in list(self._xfers):
            self._pop(tid)
        self._remotes.clear()
        self._closed = True
        if self._own_dialer:
            self._dialer.close()

    # -- internal ----------------------------------------------------------

    def _live(self) -> None:
        if self._closed:
            raise RuntimeError("kvlane p2p: the data transport is closed")

    def _post(self, x: _Xfer, now: float) -> None:
        """Posts a waiting transfer if its peer's incarnation is reachable;
        fails it if that incarnation is gone or its deadline passed."""
        r = x.remote
        if self._remotes.get(x.peer_id) is not r:
            x.failed = f"{x.peer_id} was removed or restarted"
            return
        if r.dial.done():
            err = _dial_error(r.dial)
            if err is not None:
                x.failed = f"connecting to {x.peer_id} ({r.addr}) failed: {err}"
                return
            p = r.dial.result()
            if p.incarnation == r.inc:
                if not p.attached:
                    x.failed = f"{x.peer_id} (incarnation {r.inc:#x}) is gone"
                    return
                try:
                    x.transfer = p.write_spans(x.local, x.remote_spans)
                    x.posted_at = now
                except kvlane.Error as e:
                    x.failed = f"posting to {x.peer_id}: {e}"
                return
            if not self._dialer.is_retired(r.addr, p.incarnation):
                # A later process at this address: r.inc is gone.
                x.failed = f"{x.peer_id} restarted (incarnation {r.inc:#x} -> {p.incarnation})"
                return
            # The link is to an earlier process not found dead yet, whose
            # link the control connection replaces: take the current dial.
            r.dial = self._dialer.peer(r.addr)
        if now > x.deadline:
            x.failed = (f"{x.peer_id} (incarnation {r.inc:#x}) not reachable after "
                        f"{self._deadline_s:.0f} s")

    def _fail_peer(self, peer_id: str, why: str) -> None:
        for x in self._by_peer.get(peer_id, {}).values():
            if x.transfer is None and x.failed is None:
                x.failed = why

    def _pop(self, tid: int) -> None:
        x = self._xfers.pop(tid)
        g = self._by_peer.get(x.peer_id)
        if g is not None:
            g.pop(tid, None)
            if not g:
                del self._by_peer[x.peer_id]
        self._release(x)

    @staticmethod
    def _release(x: _Xfer) -> None:
        if x.transfer is not None:
            x.transfer.release()


def _check_range(which: str, idx: np.ndarray, n: int, peer_id: str) -> None:
    if idx.size and (idx.min() < 0 or idx.max() >= n):
        bad = int(idx[(idx < 0) | (idx >= n)][0])
        raise ValueError(f"kvlane p2p: write_blocks to {peer_id}: {which} block {bad} is "
                         f"outside 0..{n - 1}")


# ----------------------------------------------------------------------
# The tier
# ----------------------------------------------------------------------

#: Keys of the tier config's ``kvlane`` dict and what they become.
_AGENT_KEYS = ("backend", "listen", "advertise", "psk", "keepalive_interval",
               "liveness_budget", "handshake_timeout", "transfer_deadline", "cpus")


def _agent_settings(raw: Any) -> Dict[str, Any]:
    if raw is None:
        raw = {}
    if not isinstance(raw, dict):
        raise ValueError(f"kvlane.vllm.KvlaneP2PTier: the tier's 'kvlane' entry is a dict of "
                         f"{', '.join(_AGENT_KEYS)}, not {type(raw).__name__}")
    unknown = sorted(set(raw) - set(_AGENT_KEYS))
    if unknown:
        raise ValueError(f"kvlane.vllm.KvlaneP2PTier: unknown 'kvlane' settings {unknown}; "
                         f"known: {', '.join(_AGENT_KEYS)}")
    s = dict(raw)
    psk = s.get("psk") or os.environ.get("KVLANE_PSK")
    if isinstance(psk, str):
        psk = psk.encode()
    s["psk"] = psk or None
    s.setdefault("backend", os.environ.get("KVLANE_BACKEND", "auto"))
    return s


class KvlaneP2PTier(P2PSecondaryTierManager):
    """vLLM's P2P secondary tier with kvlane as its control and data
    transports (see the module's doc). Configuration: vLLM's P2P tier keys
    (``host``, ``port``, ``unbound_store_timeout_s``; NIXL's ``backends`` and
    ``num_threads`` are ignored) plus ``kvlane``, a dict of agent settings
    (``backend``, ``psk``, ``listen`` (default ``host:port``), ``advertise``,
    ``liveness_budget``, ``keepalive_interval``, ``handshake_timeout``,
    ``transfer_deadline``, ``cpus``); ``KVLANE_PSK`` and ``KVLANE_BACKEND``
    are read when the dict does not say."""

    def __init__(self, offloading_spec: Any, primary_kv_view: memoryview,
                 tier_type: str = "KvlaneP2PTier", host: Optional[str] = None,
                 port: Optional[int] = None, kvlane: Optional[dict] = None,
                 **kwargs: Any) -> None:
        from kvlane.vllm import _with_globals  # the module re-exports this one

        settings = _agent_settings(kvlane)
        self._kvlane_agent: Optional[Any] = None
        self._kvlane_dialer: Optional[_Dialer] = None

        def make_data(agent_name: str, view: memoryview, config_fields: Optional[dict] = None,
                      **_nixl: Any) -> DataTransport:
            # vLLM's constructor calls this first, after setting _local_id.
            agent = _make_agent(self._local_id, settings)
            self._kvlane_agent = agent
            self._kvlane_dialer = _Dialer(agent)
            # Peers reach the data plane at the peer id unless the agent
            # listens elsewhere.
            advertise = settings.get("advertise") or (agent.addr if settings.get("listen")
                                                      else None)
            return KvlaneDataTransport(agent, view, config_fields, self._kvlane_dialer,
                                       advertise=advertise)

        init = _with_globals(P2PSecondaryTierManager.__init__,
                             NixlTransport=make_data, ZmqTransport=self._make_control)
        try:
            init(self, offloading_spec, primary_kv_view, tier_type, host, port, **kwargs)
        except BaseException:
            self._close_agent()
            raise

    def _make_control(self, local_id: str, host: str, port: int) -> ControlTransport:
        """The control transport (vLLM's constructor calls it after the
        data transport's, in place of ``ZmqTransport(local_id, host, port)``)."""
        assert self._kvlane_agent is not None and self._kvlane_dialer is not None
        return KvlaneControlTransport(self._kvlane_agent, self._kvlane_dialer)

    @property
    def kvlane_agent(self) -> Any:
        """The tier's kvlane agent (engine id and listen address ``host:port``)."""
        return self._kvlane_agent

    def _accept_new_peers(self, new_connections: Sequence[ControlConnection]) -> None:
        # A restarted peer's new connection arrives in the poll that finds
        # its old one dead; vLLM reaps dead sessions only at the end of the
        # poll and would refuse the new one as a duplicate (the peer then
        # waits for its handshake timeout). Reap first.
        if new_connections:
            self._reap_dead_sessions()
        super()._accept_new_peers(new_connections)

    def shutdown(self) -> None:
        try:
            super().shutdown()
        finally:
            self._close_agent()

    def _close_agent(self) -> None:
        if self._kvlane_dialer is not None:
            self._kvlane_dialer.close()
        if self._kvlane_agent is not None:
            self._kvlane_agent.close()


def _make_agent(local_id: str, s: Dict[str, Any]) -> Any:
    kw = {k: s[k] for k in ("advertise", "keepalive_interval", "liveness_budget",
                            "handshake_timeout", "transfer_deadline", "cpus")
          if s.get(k) is not None}
    try:
        return kvlane.Agent(engine_id=local_id, listen=s.get("listen") or local_id,
                            backend=s["backend"], psk=s["psk"], **kw)
    except kvlane.Error as e:
        raise ValueError(f"kvlane.vllm.KvlaneP2PTier: cannot start a kvlane agent on "
                         f"{s.get('listen') or local_id}: {e}") from e
