"""vLLM's P2P ``DataTransport`` on kvlane's data plane
(``vllm/v1/kv_offload/tiering/p2p/data/base.py``)."""

from __future__ import annotations

import itertools
import time
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Dict, Iterable, List, Optional

import msgspec
import numpy as np

import kvlane
from vllm.v1.kv_offload.tiering.p2p.data.base import CancelMode, DataTransport, PollResult

from .link import REACH_TIMEOUT_S, WIRE_VERSION, Dialer, check_peer_id, dial_error, encoder, logger

_EMPTY_POLL = PollResult(done=(), failed=())


class _Meta(msgspec.Struct, frozen=True):
    """What ``get_agent_metadata`` says: the data plane's address (``None``:
    the peer id) and the agent's incarnation."""

    v: int
    inc: int
    addr: Optional[str] = None


@dataclass
class TransferCounts:
    """Transfers of blocks to or from peers, as they ended: ``done`` and
    ``failed`` transfers, their blocks, and the blocks done per peer id
    (``KvlaneDataTransport.written``, ``KvlaneP2PTier.loaded``)."""

    done: int = 0
    failed: int = 0
    blocks: int = 0
    blocks_failed: int = 0
    blocks_by_peer: Dict[str, int] = field(default_factory=dict)

    def count(self, peer_id: str, blocks: int, ok: bool) -> None:
        if ok:
            self.done += 1
            self.blocks += blocks
            self.blocks_by_peer[peer_id] = self.blocks_by_peer.get(peer_id, 0) + blocks
        else:
            self.failed += 1
            self.blocks_failed += blocks


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
                 dialer: Optional[Dialer] = None, advertise: Optional[str] = None,
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
        self._dialer = dialer if dialer is not None else Dialer(agent)
        self._advertise = advertise
        self._deadline_s = float(deadline_s)
        agent.register(view)
        self._remotes: Dict[str, _Remote] = {}
        self._xfers: Dict[int, _Xfer] = {}
        self._by_peer: Dict[str, Dict[int, _Xfer]] = {}
        self._ids = itertools.count()
        self._closed = False
        #: Writes to peers, as they ended.
        self.written = TransferCounts()

    def get_agent_metadata(self) -> bytes:
        return encoder.encode(_Meta(WIRE_VERSION, self._agent.incarnation, self._advertise))

    def add_remote_peer(self, peer_id: str, agent_metadata: bytes, base_addr: int,
                        num_blocks: int, block_len: int) -> None:
        self._live()
        check_peer_id(peer_id)
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
                    ok = False
                    logger.info("kvlane p2p: transfer %d to %s failed: %s", tid, x.peer_id, x.failed)
                elif x.transfer is not None and x.transfer.done():
                    ok = x.transfer.status == "done"
                    if not ok:
                        logger.info("kvlane p2p: transfer %d to %s failed: %s", tid, x.peer_id,
                                    x.transfer.error())
                else:
                    continue
                (done if ok else failed).append(tid)
                self.written.count(x.peer_id, len(x.local), ok)
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
            err = dial_error(r.dial)
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


