"""kvlane.nixl over shared memory between two processes of this host:
numpy memory (allocated by Python, never a shareable memory file) is
served by cross-memory attach when both sides opt in, and refused with a
clear error when they do not."""


import numpy as np
import pytest

import kvlane
from kvlane.nixl import nixl_agent, nixl_agent_config
from conftest import LEN, Target, expected_sha, pattern
from flow import wait as wait_done

BLOCK = 4096


def blocks(base: int, n: int) -> list:
    return [(base + i * BLOCK, BLOCK, 0) for i in range(n)]


def notes(target, n: int = 1) -> list:
    return target.ask({"op": "notes", "n": n})["notes"]


def test_numpy_memory_moves_between_two_processes_over_shm_with_the_opt_in(make_target):
    target = make_target("nixl-shm")
    t = target.info
    mine = pattern(1)
    a = nixl_agent("decode", nixl_agent_config(backend="shm", shm_cross_memory_attach=True))
    try:
        a.register_memory(a.get_reg_descs([mine]))
        name = a.add_remote_agent(bytes.fromhex(t["md"]))
        # Only shm is running here: the data cannot have gone another way.
        assert a._built().backend == "shm"
        n = LEN // BLOCK
        local = a.prep_xfer_dlist("NIXL_INIT_AGENT", blocks(mine.ctypes.data, n), "DRAM")
        remote = a.prep_xfer_dlist(name, blocks(t["buf"], n), "DRAM")
        # READ every remote block, reversed, with a notification.
        h = a.make_prepped_xfer("READ", local, list(range(n)), remote, list(reversed(range(n))),
                                notif_msg=b"read-done")
        a.transfer(h)
        assert wait_done(a, h) == "DONE"
        theirs = pattern(7)
        want = theirs.reshape(n, BLOCK)[::-1].reshape(-1)
        assert (mine == want).all()
        assert notes(target)[0][:2] == ["decode", "read-done"]
        a.release_xfer_handle(h)
        # WRITE local blocks 0..9 over remote blocks 100..109; the
        # notification comes after the data.
        mine[:] = pattern(3)
        h = a.make_prepped_xfer("WRITE", local, list(range(10)), remote, list(range(100, 110)),
                                b"write-done")
        a.transfer(h)
        assert wait_done(a, h) == "DONE"
        theirs[100 * BLOCK:110 * BLOCK] = mine[:10 * BLOCK]
        assert notes(target)[0] == ["decode", "write-done", expected_sha(theirs)]
        a.release_xfer_handle(h)
        # Outside the target's registration: refused, nothing moves.
        with pytest.raises(kvlane.InvalidInputError, match="advertised"):
            a.prep_xfer_dlist(name, [(t["buf"] + LEN, BLOCK, 0)], "DRAM")
        a.release_dlist_handle(local)
        a.release_dlist_handle(remote)
    finally:
        a.close()


def test_without_the_opt_in_shm_refuses_python_memory_naming_it(monkeypatch):
    monkeypatch.delenv("KVLANE_SHM_CROSS_MEMORY_ATTACH", raising=False)
    buf = np.zeros(BLOCK, dtype=np.uint8)
    a = nixl_agent("plain", nixl_agent_config(backend="shm"))
    try:
        a.register_memory(a.get_reg_descs([buf]))
        with pytest.raises(kvlane.UnsupportedError, match="cross_memory_attach"):
            a.get_agent_metadata()
    finally:
        a.close()
    # The native agent likewise; with the opt-in it is served.
    with pytest.raises(kvlane.UnsupportedError, match="cross_memory_attach"):
        kvlane.Agent(backend="shm", regions=[buf])
    ok = kvlane.Agent(backend="shm", regions=[buf], shm_cross_memory_attach=True)
    assert ok.backend == "shm"
    ok.close()
    # "same-host" without it serves the memory over tcp instead.
    ok = kvlane.Agent(backend="same-host", regions=[buf])
    ok.close()


def test_the_opt_in_from_the_environment(monkeypatch):
    monkeypatch.setenv("KVLANE_SHM_CROSS_MEMORY_ATTACH", "1")
    c = nixl_agent_config(backend="same-host")
    assert c._agent_kwargs() == {"shm_cross_memory_attach": True}
    monkeypatch.setenv("KVLANE_SHM_CROSS_MEMORY_ATTACH", "off")
    assert nixl_agent_config()._agent_kwargs() == {}
    monkeypatch.setenv("KVLANE_SHM_CROSS_MEMORY_ATTACH", "maybe")
    with pytest.raises(ValueError, match="KVLANE_SHM_CROSS_MEMORY_ATTACH is .*not 'maybe'"):
        nixl_agent_config()
    monkeypatch.delenv("KVLANE_SHM_CROSS_MEMORY_ATTACH")
    # Every backend name the native agent takes.
    for b in ("auto", "tcp", "verbs", "loopback", "shm", "same-host"):
        assert nixl_agent_config(backend=b).backend == b
    with pytest.raises(ValueError, match="backend is .*'same-host'.*not 'rdma'"):
        nixl_agent_config(backend="rdma")



def test_two_agents_on_this_host_get_shm_by_default_with_host_buffer_memory():
    """Two processes, no backend named, both sides' memory from
    ``kvlane.host_buffer``: the peer is on shm, and the data moves."""
    target = Target("auto")
    try:
        t = target.info
        mine = kvlane.host_buffer(LEN)
        with kvlane.Agent(engine_id="auto-init", regions=[mine]) as a:
            peer = a.connect(t["addr"])
            assert peer.backend == "shm"
            assert peer.read_spans([(mine.ctypes.data, LEN)], [(t["buf"], LEN)]).wait(10)
            assert (mine == pattern(7)).all()
            mine[:] = pattern(3)
            assert peer.write_spans([(mine.ctypes.data, LEN)], [(t["buf"], LEN)],
                                    notify=b"w").wait(10)
            assert notes(target)[0] == ["auto-init", "w", expected_sha(pattern(3))]
    finally:
        target.close()


def test_memory_python_allocated_keeps_auto_on_tcp_and_the_data_moves():
    """numpy's own memory (as an engine's torch tensors), a private
    ``host_buffer`` and a part of a shared one are not served by shm
    without cross-memory attach: the same target is reached over tcp."""
    target = Target("auto")
    try:
        t = target.info
        n = LEN // 2
        for mine in (np.zeros(n, dtype=np.uint8), kvlane.host_buffer(n, shared=False),
                     kvlane.host_buffer(LEN)[:n]):
            with kvlane.Agent(engine_id="plain-init", regions=[mine]) as a:
                peer = a.connect(t["addr"])
                assert peer.backend == "tcp"
                assert peer.read_spans([(mine.ctypes.data, n)], [(t["buf"], n)]).wait(10)
                assert (mine == pattern(7)[:n]).all()
    finally:
        target.close()
