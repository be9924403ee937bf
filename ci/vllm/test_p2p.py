"""kvlane.vllm's P2P tier transports against vLLM's contracts
(``vllm/v1/kv_offload/tiering/p2p/control/base.py``, ``data/base.py``), and
peer churn through vLLM's own P2P manager and sessions (p2p_churn.py).

Run by ci/vllm.sh with the vLLM venv::

    $VENV/bin/python -m pytest -q ci/vllm/test_p2p.py
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from typing import Any, Callable, List

import msgspec
import numpy as np
import pytest

import kvlane
from kvlane._vllm_p2p import link
import kvlane.vllm
from kvlane.vllm import KvlaneControlTransport, KvlaneDataTransport, KvlaneP2PTier

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import p2p_churn  # noqa: E402

BLOCKS, BLOCK_LEN = 8, 256


def free_addr() -> str:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return f"127.0.0.1:{port}"


class Node:
    """An agent with both transports, as KvlaneP2PTier builds them."""

    def __init__(self, addr: str = "", psk: bytes = None) -> None:
        self.addr = addr or free_addr()
        self.agent = kvlane.Agent(engine_id=self.addr, listen=self.addr, backend="tcp", psk=psk)
        self.dialer = link.Dialer(self.agent)
        self.buf = np.zeros((BLOCKS, BLOCK_LEN), dtype=np.uint8)
        self.control = KvlaneControlTransport(self.agent, self.dialer)
        self.data = KvlaneDataTransport(self.agent, memoryview(self.buf), None, self.dialer)

    def close(self) -> None:
        self.control.close()
        self.data.close()
        self.dialer.close()
        self.agent.close()


@pytest.fixture
def nodes():
    made: List[Node] = []

    def make(**kw: Any) -> Node:
        n = Node(**kw)
        made.append(n)
        return n

    yield make
    for n in made:
        n.close()


def until(what: Callable[[], Any], *polled: Node, timeout: float = 10.0) -> Any:
    """Polls the nodes' control transports until ``what()`` is truthy;
    returns it (fails after ``timeout``)."""
    end = time.monotonic() + timeout
    while True:
        for n in polled:
            n.control.poll()
        got = what()
        if got:
            return got
        assert time.monotonic() < end, f"nothing after {timeout} s"
        time.sleep(0.001)


def accept(node: Node, *others: Node, timeout: float = 10.0) -> list:
    """The next new connections ``node.control.poll()`` returns."""
    box: list = []

    def step() -> list:
        for o in others:
            o.control.poll()
        box.extend(node.control.poll())
        return box

    end = time.monotonic() + timeout
    while not step():
        assert time.monotonic() < end, f"no new connection at {node.addr} after {timeout} s"
        time.sleep(0.001)
    return box


# ---------------------------------------------------------------- control


def test_inbound_connection_is_named_by_the_listen_address_with_its_first_message(nodes):
    a, b = nodes(), nodes()
    out = a.control.connect(b.addr)
    out.send({"type": "hello", "blob": b"\x00\x01"})
    out.send({"type": "second"})  # queued before anything is reachable
    [inbound] = accept(b, a)
    assert inbound.peer_id == a.addr and inbound.alive
    got = list(inbound.recv())
    assert got[0] == {"type": "hello", "blob": b"\x00\x01"}
    if len(got) == 1:
        got += until(lambda: list(inbound.recv()), a, b)
    assert got == [{"type": "hello", "blob": b"\x00\x01"}, {"type": "second"}]
    assert inbound.recv() == ()
    # Each connection is returned once.
    until(lambda: True, a)
    assert list(b.control.poll()) == []
    inbound.send({"type": "ack"})
    assert until(lambda: list(out.recv()), a, b) == [{"type": "ack"}]


def test_connect_refuses_a_live_duplicate_and_replaces_a_dead_one(nodes):
    a, b = nodes(), nodes()
    first = a.control.connect(b.addr)
    with pytest.raises(ValueError, match=b.addr):
        a.control.connect(b.addr)
    first.mark_dead()
    assert not first.alive
    second = a.control.connect(b.addr)
    assert second is not first and second.alive
    with pytest.raises(RuntimeError, match="dead"):
        first.send({"type": "x"})
    first.close()
    first.close()  # idempotent
    with pytest.raises(ValueError, match="host:port"):
        a.control.connect("nonsense")


def test_connecting_to_nobody_ends_in_a_dead_connection(nodes):
    a = nodes()
    conn = a.control.connect(free_addr())
    conn.send({"type": "hello"})
    until(lambda: not conn.alive, a, timeout=20)
    assert "failed" in conn.death_reason


def test_a_restarted_peer_is_a_new_connection_and_its_first_message_is_kept(nodes):
    a = nodes()
    b1 = nodes()
    addr = b1.addr
    c1 = b1.control.connect(a.addr)
    c1.send({"type": "from-b1"})
    [old] = accept(a, b1)
    assert list(old.recv()) == [{"type": "from-b1"}]
    b1.close()
    b2 = nodes(addr=addr)  # a new process at the same address, at once
    c2 = b2.control.connect(a.addr)
    c2.send({"type": "from-b2"})
    [new] = accept(a, b2)
    assert new is not old and new.peer_id == addr
    assert list(new.recv()) == [{"type": "from-b2"}]
    assert not old.alive and "restarted" in old.death_reason
    # Replies reach the new process, not the old one.
    new.send({"type": "to-b2"})
    assert until(lambda: list(c2.recv()), a, b2) == [{"type": "to-b2"}]
    assert a.control.connect.__self__ is a.control  # (the transport is still usable)


def test_messages_of_another_incarnation_are_dropped_and_counted(nodes):
    a, b = nodes(), nodes()
    c = b.control.connect(a.addr)
    c.send({"type": "hello"})
    [conn] = accept(a, b)
    conn.recv()
    peer = b.agent.connect(a.addr)
    # Meant for an earlier process at a's address.
    stale = link.Envelope(link.WIRE_VERSION, b.agent.incarnation, a.agent.incarnation ^ 1,
                          {"type": "late"})
    peer.notify(msgspec.msgpack.encode(stale))
    peer.notify(b"\xc1 not msgpack")
    until(lambda: a.control.dropped["stale"] == 1 and a.control.dropped["malformed"] == 1, a, b)
    assert conn.alive and conn.recv() == ()
    c.send({"type": "still-fine"})
    assert until(lambda: list(conn.recv()), a, b) == [{"type": "still-fine"}]


def test_without_the_psk_nothing_is_exchanged(nodes):
    a = nodes(psk=b"right key")
    b = nodes(psk=b"wrong key")
    c = b.control.connect(a.addr)
    c.send({"type": "hello"})
    until(lambda: not c.alive, a, b, timeout=20)
    assert list(a.control.poll()) == []


def test_send_queue_is_bounded(nodes, monkeypatch):
    a = nodes()
    monkeypatch.setattr(link, "MAX_QUEUED_MESSAGES", 3)
    conn = a.control.connect(free_addr())  # nobody there: nothing is sent
    for i in range(3):
        conn.send({"i": i})
    with pytest.raises(BufferError, match="3 messages"):
        conn.send({"i": 3})
    with pytest.raises(TypeError, match="dict"):
        conn.send(["not", "a", "dict"])


# ------------------------------------------------------------------- data


def register(src: Node, dst: Node) -> None:
    src.data.add_remote_peer(dst.addr, dst.data.get_agent_metadata(), dst.data.base_addr,
                             dst.data.num_blocks, dst.data.block_len)


def poll_until_settled(node: Node, peer: str, ids: set, timeout: float = 20.0):
    done, failed = set(), set()
    end = time.monotonic() + timeout
    while (done | failed) != ids:
        r = node.data.poll(peer)
        done |= set(r.done)
        failed |= set(r.failed)
        assert (done | failed) <= ids, f"unknown ids {(done | failed) - ids}"
        assert time.monotonic() < end, f"unsettled after {timeout} s: {ids - done - failed}"
        time.sleep(0.001)
    return done, failed


def test_write_blocks_lands_by_block_index(nodes):
    a, b = nodes(), nodes()
    a.buf[:] = np.arange(BLOCKS, dtype=np.uint8)[:, None] + 1
    register(a, b)
    tid = a.data.write_blocks(b.addr, [0, 1, 5], [7, 2, 3])
    assert tid is not None
    assert poll_until_settled(a, b.addr, {tid}) == ({tid}, set())
    assert list(b.buf[:, 0]) == [0, 0, 2, 6, 0, 0, 0, 1]
    assert a.data.write_blocks("127.0.0.1:9", [0], [0]) is None  # not registered


def test_write_blocks_names_bad_input(nodes):
    a, b = nodes(), nodes()
    register(a, b)
    with pytest.raises(ValueError, match="remote block 8 is outside 0..7"):
        a.data.write_blocks(b.addr, [0], [8])
    with pytest.raises(ValueError, match="local block -1"):
        a.data.write_blocks(b.addr, [-1], [0])
    with pytest.raises(ValueError, match="2 local and 1 remote"):
        a.data.write_blocks(b.addr, [0, 1], [0])
    with pytest.raises(ValueError, match="blocks of 512 bytes"):
        a.data.add_remote_peer(b.addr, b.data.get_agent_metadata(), 0, 8, 512)
    with pytest.raises(ValueError, match="bad agent metadata"):
        a.data.add_remote_peer(b.addr, b"junk", 0, 8, BLOCK_LEN)
    with pytest.raises(ValueError, match="cancel mode"):
        a.data.cancel([], mode="later")
    with pytest.raises(ValueError, match="2-D memoryview"):
        KvlaneDataTransport(a.agent, memoryview(bytearray(16)))


def test_written_counts_blocks_per_peer(nodes):
    a, b = nodes(), nodes()
    register(a, b)
    tid = a.data.write_blocks(b.addr, [0, 1, 2], [0, 1, 2])
    poll_until_settled(a, b.addr, {tid})
    nobody = free_addr()
    a.data.add_remote_peer(nobody, b.data.get_agent_metadata(), b.data.base_addr, BLOCKS,
                           BLOCK_LEN)
    bad = a.data.write_blocks(nobody, [3], [3])
    assert poll_until_settled(a, nobody, {bad}, timeout=40) == (set(), {bad})
    w = a.data.written
    assert (w.done, w.blocks, w.failed, w.blocks_failed) == (1, 3, 1, 1), w
    assert w.blocks_by_peer == {b.addr: 3}, w


def test_poll_is_scoped_to_its_peer(nodes):
    a, b, c = nodes(), nodes(), nodes()
    register(a, b)
    register(a, c)
    tb = a.data.write_blocks(b.addr, [0], [0])
    tc = a.data.write_blocks(c.addr, [1], [1])
    assert poll_until_settled(a, b.addr, {tb}) == ({tb}, set())
    # c's completion was not consumed by b's polls.
    assert poll_until_settled(a, c.addr, {tc}) == ({tc}, set())
    assert a.data.poll() == ((), ())


def test_a_dead_peer_fails_its_transfers(nodes):
    a, b = nodes(), nodes()
    register(a, b)
    assert poll_until_settled(a, b.addr, {a.data.write_blocks(b.addr, [0], [0])})[1] == set()
    b.close()
    tid = a.data.write_blocks(b.addr, [1], [1])
    assert poll_until_settled(a, b.addr, {tid}, timeout=40) == (set(), {tid})


def test_never_a_block_into_another_incarnation(nodes):
    a, b1 = nodes(), nodes()
    addr = b1.addr
    register(a, b1)  # the session handshook with b1
    b1.close()
    b2 = nodes(addr=addr)
    a.buf[:] = 0xAB
    tid = a.data.write_blocks(addr, [0, 1, 2], [0, 1, 2])
    assert poll_until_settled(a, addr, {tid}, timeout=40) == (set(), {tid})
    assert not b2.buf.any(), "a block meant for the previous process landed in the new one"
    # Once registered again (a new session's handshake), writes go through.
    register(a, b2)
    tid = a.data.write_blocks(addr, [0], [5])
    assert poll_until_settled(a, addr, {tid}) == ({tid}, set())
    assert (b2.buf[5] == 0xAB).all()


def test_cancel(nodes):
    a, b = nodes(), nodes()
    register(a, b)
    # immediate: released, never reported.
    t1 = a.data.write_blocks(b.addr, [0], [0])
    assert a.data.cancel([t1, 12345], mode="immediate") == []
    # wait: what it returns is still tracked and surfaces in poll; the rest
    # never does.
    ids = [a.data.write_blocks(b.addr, [i], [i]) for i in range(1, 6)]
    still = a.data.cancel(ids, mode="wait")
    assert set(still) <= set(ids)
    assert poll_until_settled(a, b.addr, set(still))[0] | set() <= set(still)
    end = time.monotonic() + 1
    while time.monotonic() < end:
        r = a.data.poll()
        assert not set(r.done) | set(r.failed), "a cancelled transfer was reported"
    # A queued transfer (its peer not reachable) is cancelled without a post.
    nobody = free_addr()
    a.data.add_remote_peer(nobody, b.data.get_agent_metadata(), b.data.base_addr, BLOCKS,
                           BLOCK_LEN)
    t3 = a.data.write_blocks(nobody, [0], [0])
    assert a.data.cancel([t3], mode="wait") == []
    assert a.data.poll(nobody) == ((), ())


# ------------------------------------------------------------------- tier


def test_the_tier_builds_kvlane_transports_and_binds_no_zmq(monkeypatch):
    import vllm.v1.kv_offload.tiering.p2p.manager as manager

    def refuse(*a: Any, **k: Any) -> None:
        raise AssertionError("the kvlane tier built a vLLM transport")

    monkeypatch.setattr(manager, "ZmqTransport", refuse)
    monkeypatch.setattr(manager, "NixlTransport", refuse)
    addr = free_addr()
    host, port = addr.rsplit(":", 1)
    buf = np.zeros((4, 1024), dtype=np.uint8)
    tier = KvlaneP2PTier(p2p_churn.offloading_spec(), memoryview(buf), host=host,
                         port=int(port), kvlane={"backend": "tcp"})
    try:
        assert isinstance(tier._control, KvlaneControlTransport)
        assert isinstance(tier._data, KvlaneDataTransport)
        assert tier.kvlane_agent.engine_id == addr == tier.kvlane_agent.addr
        tier.get_finished_jobs()
    finally:
        tier.shutdown()
    assert tier.kvlane_agent.closed
    with pytest.raises(ValueError, match="unknown 'kvlane' settings \\['bogus'\\]"):
        KvlaneP2PTier(p2p_churn.offloading_spec(), memoryview(buf), host=host,
                      port=int(port), kvlane={"bogus": 1})


def test_the_tier_loads_from_vllms_factory():
    from vllm.v1.kv_offload.tiering.factory import SecondaryTierFactory

    cls = SecondaryTierFactory.get_tier_class(
        {"type": "KvlaneP2PTier", "module_path": "kvlane.vllm"})
    assert cls is KvlaneP2PTier


# ------------------------------------------------------------ CPU worker


def test_the_cpu_spec_loads_from_vllms_factory():
    from vllm.v1.kv_offload.factory import OffloadingSpecFactory

    cls = OffloadingSpecFactory.get_spec_cls(
        {"spec_name": "CpuTieringOffloadingSpec", "spec_module_path": "kvlane.vllm"})
    assert cls is kvlane.vllm.CpuTieringOffloadingSpec


def test_cpu_worker_copies_each_block_and_layer_by_chunk_and_sub_block():
    """Two layers (pages of 64 bytes, and 32 with 24 used), two KV blocks
    per chunk, a group that starts at the request's block 1: its blocks go
    to sub-block 1 of the first chunk, then 0 and 1 of the next. The unused
    bytes of a padded page are not copied."""
    import torch
    from vllm.v1.kv_offload.base import (CanonicalKVCacheRef, CanonicalKVCaches,
                                         CanonicalKVCacheTensor, GPULoadStoreSpec)
    from vllm.v1.kv_offload.cpu.common import CPULoadStoreSpec
    from vllm.v1.kv_offload.cpu.shared_offload_region import SharedOffloadRegion

    from kvlane._vllm_p2p.cpu import CpuOffloadingWorker

    pages, used, per_chunk = (64, 32), (64, 24), 2
    kv = [torch.zeros((8, p), dtype=torch.int8) for p in pages]
    for t, x in enumerate(kv):
        for b in range(8):
            x[b] = 16 * t + b + 1
    caches = CanonicalKVCaches(
        [CanonicalKVCacheTensor(x, p) for x, p in zip(kv, pages)],
        [[CanonicalKVCacheRef(t, u) for t, u in enumerate(used)]])
    engine_id = f"kvlane-test-{os.getpid()}"
    region = SharedOffloadRegion(engine_id=engine_id, num_chunks=4, rank=0,
                                 kv_bytes_per_chunk=4096,
                                 cpu_page_size=sum(pages) * per_chunk)
    w = CpuOffloadingWorker(caches, per_chunk, region)
    try:
        # KV blocks 5, 2, 7 are the request's blocks 1, 2, 3: chunk 3's
        # sub-block 1, chunk 0's sub-blocks 0 and 1.
        assert w.submit_store(1, GPULoadStoreSpec([5, 2, 7], [3], [1]), CPULoadStoreSpec([3, 0]))
        [r] = w.get_finished()
        assert (r.job_id, r.success, r.transfer_size) == (1, True, 3 * sum(used))
        assert w.get_finished() == []
        tier = [region.base_tensor.as_strided((4, p * per_chunk), (4096, 1), off)
                for p, off in zip(pages, (0, pages[0] * per_chunk))]
        for t, (p, u) in enumerate(zip(pages, used)):
            for chunk, sub, block in ((3, 1, 5), (0, 0, 2), (0, 1, 7)):
                piece = tier[t][chunk, sub * p:(sub + 1) * p]
                assert (piece[:u] == 16 * t + block + 1).all(), (t, chunk, sub)
                assert (piece[u:] == 0).all(), "padding was copied"
            assert (tier[t][3, :p] == 0).all() and (tier[t][1:3] == 0).all()
        # And back, into other KV blocks.
        for x in kv:
            x.zero_()
        assert w.submit_load(2, CPULoadStoreSpec([3, 0]), GPULoadStoreSpec([1, 4, 6], [3], [1]))
        assert [r.job_id for r in w.get_finished()] == [2]
        for t, u in enumerate(used):
            for dst, src in ((1, 5), (4, 2), (6, 7)):
                assert (kv[t][dst, :u] == 16 * t + src + 1).all(), (t, dst)
            assert kv[t][[0, 2, 3, 5, 7]].eq(0).all()
        w.wait({1, 2})
    finally:
        w.shutdown()
    assert not os.path.exists(f"/dev/shm/vllm_offload_{engine_id}.mmap")


# ------------------------------------------------------------------ churn

CHURN_RESTARTS = int(os.environ.get("KVLANE_P2P_CHURN_RESTARTS", "50"))


def test_churn_through_vllms_manager_and_sessions(capsys):
    """One node restarted CHURN_RESTARTS times (SIGKILL and clean exits in
    turn) against one that stays up; both pull from each other every time.
    In a fresh interpreter: its nodes are forked, which a process already
    running kvlane's threads (this one) cannot do."""
    # kvlane's liveness budget (60 pings, a minute) is longer than an
    # exchange may take (p2p_churn.EXCHANGE_TIMEOUT_S): nothing may wait for
    # it to find a killed process dead. A restarted peer's first message
    # refused (vLLM's duplicate-connection path) would wait for vLLM's 30 s
    # handshake timeout and fail the exchange.
    p = subprocess.run(
        [sys.executable, p2p_churn.__file__, "--control", "kvlane", "--restarts",
         str(CHURN_RESTARTS), "--liveness-budget", "60"],
        capture_output=True, text=True, timeout=60 + 60 * CHURN_RESTARTS)
    lines = [ln for ln in p.stdout.splitlines() if ln.startswith("CHURN ")]
    assert lines, f"p2p_churn.py failed (rc {p.returncode}):\n{p.stdout[-3000:]}\n{p.stderr[-5000:]}"
    r = json.loads(lines[-1][len("CHURN "):])
    with capsys.disabled():
        print("\n" + lines[-1])
    assert "error" not in r and not r["s_crashed"], r
    assert r["restarts"] == CHURN_RESTARTS
    assert r["failed_exchanges"] == 0 and r["timeouts"] == 0, r
    assert r["stale_blocks"] == 0 and r["foreign_blocks"] == 0, r
    # Nothing leaked: S holds no session and no more fds than when warm.
    assert r["s_sessions_end"] == 0, r
    assert r["s_fds_end"] <= r["s_fds_warm"], r
