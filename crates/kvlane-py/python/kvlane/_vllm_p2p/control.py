"""vLLM's P2P ``ControlTransport`` on kvlane notifications
(``vllm/v1/kv_offload/tiering/p2p/control/base.py``)."""

from __future__ import annotations

import time
from collections import deque
from concurrent.futures import Future
from typing import Deque, Dict, List, Optional, Sequence

import msgspec

import kvlane
from vllm.v1.kv_offload.tiering.p2p.control.base import ControlConnection, ControlTransport

from . import link
from .link import (MAX_CONNECTIONS, WIRE_VERSION, Dialer, Envelope, check_peer_id, decoder,
                   dial_error, encoder, logger)

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
        if len(self._outbox) >= link.MAX_QUEUED_MESSAGES:
            raise BufferError(
                f"kvlane p2p: {link.MAX_QUEUED_MESSAGES} messages already wait for {self.peer_id}, "
                "which is not reachable yet"
            )
        self._outbox.append(encoder.encode(msg))
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
            env = encoder.encode(Envelope(WIRE_VERSION, my_inc, self._remote_inc,
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
        err = dial_error(f)
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

    def __init__(self, agent: kvlane.Agent, dialer: Optional[Dialer] = None,
                 reach_timeout_s: float = link.REACH_TIMEOUT_S) -> None:
        self._agent = agent
        self._own_dialer = dialer is None
        self._dialer = dialer if dialer is not None else Dialer(agent)
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
        check_peer_id(peer_id)
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
            env = decoder.decode(note.payload)
            if env.v != WIRE_VERSION:
                raise ValueError(f"wire version {env.v}")
            check_peer_id(note.sender)
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


