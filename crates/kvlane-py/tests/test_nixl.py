"""kvlane.nixl: the connector's flow between two processes over tcp, and
NIXL's error semantics."""

import json
import time
import warnings

import numpy as np
import pytest

import kvlane
from kvlane.nixl import nixl_agent, nixl_agent_config
from conftest import LEN, expected_sha, pattern
from flow import wait as wait_done

BLOCK = 4096


def agent(name: str, buf: np.ndarray) -> nixl_agent:
    a = nixl_agent(name, nixl_agent_config(backends=["UCX"], num_threads=4,
                                           capture_telemetry=True, backend="tcp"))
    descs = a.get_reg_descs([(buf.ctypes.data, buf.nbytes, 0, "")], "DRAM")
    assert a.register_memory(descs) is descs
    return a


def blocks(base: int, n: int) -> list:
    return [(base + i * BLOCK, BLOCK, 0) for i in range(n)]


def test_connector_flow_read_write_notifications_between_two_processes(nixl_target):
    t = nixl_target.info
    mine = pattern(1)
    a = agent("decode", mine)
    name = a.add_remote_agent(bytes.fromhex(t["md"]))
    assert name == b"target" and a.name == "decode"
    n = LEN // BLOCK
    local = a.prep_xfer_dlist("NIXL_INIT_AGENT", a.get_xfer_descs(blocks(mine.ctypes.data, n), "DRAM"))
    # The remote list as an Nx3 uint64 array (zero-copy).
    rarr = np.array(blocks(t["buf"], n), dtype=np.uint64)
    remote = a.prep_xfer_dlist(name, a.get_xfer_descs(rarr, "DRAM"))

    # READ remote blocks 0..9 into local blocks 100..109, with a notification.
    h = a.make_prepped_xfer("READ", local, np.arange(100, 110, dtype=np.int32), remote,
                            np.arange(10, dtype=np.int32), notif_msg=b"read-done")
    assert a.transfer(h) in ("PROC", "DONE")
    assert wait_done(a, h) == "DONE"
    assert (mine[100 * BLOCK:110 * BLOCK] == pattern(7)[:10 * BLOCK]).all()
    tel = a.get_xfer_telemetry(h)
    assert (tel.totalBytes, tel.descCount) == (10 * BLOCK, 1) and tel.xferDuration > 0
    (note,) = nixl_target.ask({"op": "notes", "n": 1})["notes"]
    assert note[:2] == ["decode", "read-done"]
    a.release_xfer_handle(h)

    # WRITE local blocks 0, 2, 4 into remote blocks 200, 201, 202.
    h = a.make_prepped_xfer("WRITE", local, [0, 2, 4], remote, [200, 201, 202], b"write-done")
    a.transfer(h)
    assert wait_done(a, h) == "DONE"
    theirs = pattern(7)
    for i, j in zip([0, 2, 4], [200, 201, 202]):
        theirs[j * BLOCK:(j + 1) * BLOCK] = mine[i * BLOCK:(i + 1) * BLOCK]
    (note,) = nixl_target.ask({"op": "notes", "n": 1})["notes"]
    assert note == ["decode", "write-done", expected_sha(theirs)]  # after the data
    # A handle can be posted again once done.
    assert a.transfer(h) in ("PROC", "DONE") and wait_done(a, h) == "DONE"
    nixl_target.ask({"op": "notes", "n": 1})
    a.release_xfer_handle(h)

    # initialize_xfer with full lists, and send_notif both ways.
    h = a.initialize_xfer("READ", blocks(mine.ctypes.data, 2), blocks(t["buf"] + 8 * BLOCK, 2),
                          name, b"")
    a.transfer(h)
    assert wait_done(a, h) == "DONE"
    assert (mine[:2 * BLOCK] == pattern(7)[8 * BLOCK:10 * BLOCK]).all()
    a.release_xfer_handle(h)
    a.send_notif(name, b"ping")
    (note,) = nixl_target.ask({"op": "notes", "n": 1})["notes"]
    assert note[:2] == ["decode", "ping"]
    assert nixl_target.ask({"op": "add", "md": a.get_agent_metadata().hex()})["name"] == "decode"
    nixl_target.ask({"op": "send", "to": "decode", "msg": "pong"})
    got, end = {}, time.monotonic() + 10
    while not got and time.monotonic() < end:
        got = a.get_new_notifs()
    assert got == {"target": [b"pong"]}

    a.release_dlist_handle(local)
    a.release_dlist_handle(remote)
    a.remove_remote_agent(name)
    a.close()


def test_nixl_bad_input_and_unsupported_calls_raise_clearly(nixl_target):
    t = nixl_target.info
    mine = pattern(1, 8 * BLOCK)
    a = agent("decode", mine)
    name = a.add_remote_agent(bytes.fromhex(t["md"]))
    with pytest.raises(kvlane.InvalidInputError, match="outside every local registration"):
        a.prep_xfer_dlist("NIXL_INIT_AGENT", [(mine.ctypes.data + 7 * BLOCK, 2 * BLOCK, 0)], "DRAM")
    with pytest.raises(kvlane.InvalidInputError, match="advertised"):
        a.prep_xfer_dlist(name, [(t["buf"] + LEN, BLOCK, 0)], "DRAM")
    with pytest.raises(kvlane.InvalidInputError, match="no remote agent"):
        a.prep_xfer_dlist("nobody", [(t["buf"], BLOCK, 0)], "DRAM")
    local = a.prep_xfer_dlist("NIXL_INIT_AGENT", blocks(mine.ctypes.data, 8), "DRAM")
    remote = a.prep_xfer_dlist(name, [(t["buf"], 2 * BLOCK, 0)], "DRAM")
    with pytest.raises(kvlane.InvalidInputError, match="span pair 0"):
        a.make_prepped_xfer("WRITE", local, [0], remote, [0])
    with pytest.raises(kvlane.InvalidInputError, match="index out of range"):
        a.make_prepped_xfer("WRITE", local, [8], remote, [0])
    with pytest.raises(kvlane.InvalidInputError, match="local indices"):
        a.make_prepped_xfer("WRITE", local, [0, 1], remote, [0])
    with pytest.raises(kvlane.UnsupportedError, match="BLK"):
        a.get_xfer_descs([(1, 2, 0)], "BLK")
    with pytest.raises(NotImplementedError, match="nixl_agent.make_connection"):
        a.make_connection(name)
    h = a.initialize_xfer("WRITE", [(mine.ctypes.data, BLOCK, 0)], [(t["buf"], BLOCK, 0)], name)
    with pytest.raises(kvlane.InvalidInputError, match="not posted"):
        a.check_xfer_state(h)
    a.transfer(h)
    assert wait_done(a, h) == "DONE"
    a.release_xfer_handle(h)
    with pytest.raises(kvlane.InvalidInputError, match="released"):
        a.check_xfer_state(h)
    with pytest.raises(kvlane.InvalidInputError, match="released"):
        a.transfer(h)
    a.release_dlist_handle(local)
    with pytest.raises(kvlane.InvalidInputError, match="released"):
        a.make_prepped_xfer("WRITE", local, [0], remote, [0])
    a.close()


def test_nixl_peer_killed_mid_transfer_gives_err_never_proc_forever(make_target):
    size = 64 << 20
    target = make_target("nixl", size)
    t = target.info
    mine = np.zeros(size, dtype=np.uint8)
    a = agent("decode", mine)
    name = a.add_remote_agent(bytes.fromhex(t["md"]))
    handles = []
    for _ in range(8):
        h = a.initialize_xfer("READ", [(mine.ctypes.data, size, 0)], [(t["buf"], size, 0)], name)
        a.transfer(h)
        handles.append(h)
    target.proc.kill()
    target.proc.wait()
    start = time.monotonic()
    states = [wait_done(a, h, 20) for h in handles]
    assert "PROC" not in states and "ERR" in states, states
    assert time.monotonic() - start < 5
    a.close()


def test_hundred_thousand_indices_and_deregistration_in_one_process():
    n, size = 100_000, 64
    a_buf = pattern(1, n * size)
    b_buf = np.zeros(n * size, dtype=np.uint8)
    a, b = agent("a", a_buf), agent("b", b_buf)
    name = a.add_remote_agent(b.get_agent_metadata())
    base = np.arange(n, dtype=np.uint64) * size
    descs = lambda addr: np.stack([addr + base, np.full(n, size, np.uint64), np.zeros(n, np.uint64)], 1)
    local = a.prep_xfer_dlist("NIXL_INIT_AGENT", descs(a_buf.ctypes.data), "DRAM")
    remote = a.prep_xfer_dlist(name, descs(b_buf.ctypes.data), "DRAM")
    idx = np.arange(n, dtype=np.int32)
    start = time.monotonic()
    h = a.make_prepped_xfer("WRITE", local, idx, remote, idx[::-1].copy(), b"all")
    a.transfer(h)
    assert wait_done(a, h, 30) == "DONE"
    elapsed = time.monotonic() - start
    assert a.get_xfer_telemetry(h).descCount == n  # reversed: nothing merges
    got = b_buf.reshape(n, size)
    assert (got[::-1] == a_buf.reshape(n, size)).all()
    end = time.monotonic() + 10
    notes = {}
    while not notes and time.monotonic() < end:
        notes = b.get_new_notifs()
    assert notes == {"a": [b"all"]}
    print(f"1e5 descriptors: {elapsed:.3f} s")

    # Deregistered memory cannot be used in a local list any more.
    with pytest.raises(kvlane.InvalidInputError, match="not registered"):
        a.deregister_memory(a.get_reg_descs([(a_buf.ctypes.data, 64, 0, "")], "DRAM"))
    a.deregister_memory(a.get_reg_descs([(a_buf.ctypes.data, a_buf.nbytes, 0, "")], "DRAM"))
    with pytest.raises(kvlane.InvalidInputError, match="deregistered"):
        a.prep_xfer_dlist("NIXL_INIT_AGENT", [(a_buf.ctypes.data, 16, 0)], "DRAM")
    a.close()
    b.close()


def test_wildcard_listen_needs_an_advertised_host_for_its_metadata():
    buf = pattern(3, 4 * BLOCK)
    # A wildcard without advertise_host: the metadata would say 0.0.0.0.
    bare = nixl_agent("bare", nixl_agent_config(backend="tcp", listen_host="0.0.0.0", psk=b"k"))
    bare.register_memory(bare.get_reg_descs([buf]))
    with pytest.raises(kvlane.InvalidInputError, match=r"'bare' listens on the wildcard 0\.0\.0\.0:\d+.*advertise_host"):
        bare.get_agent_metadata()
    bare.close()
    # Metadata naming a wildcard (another implementation's, a stale one)
    # is refused before anything is dialed.
    a = nixl_agent("a", nixl_agent_config(backend="tcp", psk=b"k"))
    md = json.dumps({"kvlane_nixl": 1, "name": "w", "addr": "0.0.0.0:4000"}).encode()
    with pytest.raises(kvlane.InvalidInputError, match=r"agent 'w' names the wildcard address 0\.0\.0\.0:4000"):
        a.add_remote_agent(md)
    # With advertise_host, the metadata names that host and works.
    b = nixl_agent("b", nixl_agent_config(backend="tcp", listen_host="0.0.0.0",
                                          advertise_host="127.0.0.1", psk=b"k"))
    b.register_memory(b.get_reg_descs([buf]))
    md = b.get_agent_metadata()
    assert json.loads(md)["addr"].startswith("127.0.0.1:")
    mine = pattern(4, 4 * BLOCK)
    a.register_memory(a.get_reg_descs([mine]))
    name = a.add_remote_agent(md)
    assert name == b"b"
    h = a.initialize_xfer("WRITE", a.get_xfer_descs(blocks(mine.ctypes.data, 4), "DRAM"),
                          a.get_xfer_descs(blocks(buf.ctypes.data, 4), "DRAM"), name, b"adv")
    a.transfer(h)
    assert wait_done(a, h, 30) == "DONE"
    assert (buf == mine).all()
    a.close()
    b.close()


def test_kvlane_psk_from_the_environment_and_a_warning_without_one(monkeypatch):
    buf = pattern(5, 4 * BLOCK)
    monkeypatch.setenv("KVLANE_PSK", "k1")
    t = nixl_agent("t", nixl_agent_config(backend="tcp"))
    t.register_memory(t.get_reg_descs([buf]))
    ok = nixl_agent("ok", nixl_agent_config(backend="tcp"))
    assert ok.add_remote_agent(t.get_agent_metadata()) == b"t"
    monkeypatch.setenv("KVLANE_PSK", "k2")
    wrong = nixl_agent("wrong", nixl_agent_config(backend="tcp"))
    with pytest.raises(kvlane.RefusedError, match="pre-shared key"):
        wrong.add_remote_agent(t.get_agent_metadata())
    for x in (t, ok, wrong):
        x.close()
    # A non-loopback bind without a key warns, naming the agent; with one
    # (or on loopback) it does not.
    monkeypatch.delenv("KVLANE_PSK")
    open_ = nixl_agent("open", nixl_agent_config(backend="tcp", listen_host="0.0.0.0",
                                                 advertise_host="127.0.0.1"))
    with pytest.warns(RuntimeWarning, match="'open' listens on 0.0.0.0 without a pre-shared key"):
        open_.get_agent_metadata()
    open_.close()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for cfg in (nixl_agent_config(backend="tcp"),
                    nixl_agent_config(backend="tcp", listen_host="0.0.0.0",
                                      advertise_host="127.0.0.1", psk=b"k")):
            quiet = nixl_agent("quiet", cfg)
            quiet.get_agent_metadata()
            quiet.close()


class _FailingPeer:
    """Stands in for a handle's kvlane.Peer: raises `error` from `method`
    (once), forwards everything else to the real peer."""

    def __init__(self, peer, method: str, error: Exception):
        self._peer, self._method, self._error = peer, method, error

    def __getattr__(self, name):
        if name == self._method and self._error is not None:
            def fail(*args, **kwargs):
                e, self._error = self._error, None
                raise e
            return fail
        return getattr(self._peer, name)


def test_a_failed_post_leaves_no_stale_result_and_no_stale_notification():
    size = 4 * BLOCK
    a_buf, b_buf = pattern(3, size), np.zeros(size, dtype=np.uint8)
    a, b = agent("a", a_buf), agent("b", b_buf)
    name = a.add_remote_agent(b.get_agent_metadata())
    local = a.prep_xfer_dlist("NIXL_INIT_AGENT", blocks(a_buf.ctypes.data, 4), "DRAM")
    remote = a.prep_xfer_dlist(name, blocks(b_buf.ctypes.data, 4), "DRAM")
    h = a.make_prepped_xfer("WRITE", local, [0, 1, 2, 3], remote, [0, 1, 2, 3], b"A")
    assert a.transfer(h) in ("DONE", "PROC")
    assert wait_done(a, h, 30) == "DONE"

    def notes(want: int) -> list:
        got, end = [], time.monotonic() + 10
        while len(got) < want and time.monotonic() < end:
            got += b.get_new_notifs().get("a", [])
        return got

    assert notes(1) == [b"A"]
    x = a._xfers[h._handle]
    real = x.peer
    # A repost that raises (not a peer failure): the handle must not keep
    # reporting the previous post's DONE.
    x.peer = _FailingPeer(real, "post", kvlane.BusyError("injected"))
    with pytest.raises(kvlane.BusyError, match="injected"):
        a.transfer(h)
    with pytest.raises(kvlane.InvalidInputError, match="not posted"):
        a.check_xfer_state(h)
    # A new message whose plan fails (peer lost): ERR, and the next repost
    # with that message carries it, not the old one.
    x.peer = _FailingPeer(real, "prepare_spans", kvlane.PeerLostError("injected"))
    assert a.transfer(h, b"B") == "ERR"
    assert a.check_xfer_state(h) == "ERR"
    x.peer = real
    assert a.transfer(h, b"B") in ("DONE", "PROC")
    assert wait_done(a, h, 30) == "DONE"
    assert notes(1) == [b"B"]
    assert (b_buf == a_buf).all()
    a.close()
    b.close()
