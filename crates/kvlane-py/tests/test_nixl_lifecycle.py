"""kvlane.nixl across a remote agent's life, as vLLM's NixlConnector drives
it: check_remote_metadata after a failed transfer, memory registered after
the metadata went out, and the liveness settings of nixl_agent_config."""

import json
import os
import signal
import socket
import time

import numpy as np
import pytest

import kvlane
from kvlane.nixl import nixl_agent, nixl_agent_config
from conftest import LEN, pattern
from flow import wait as wait_done

BLOCK = 4096


def wait_stopped(pid: int, timeout: float = 10.0) -> None:
    """Waits until every thread of `pid` is stopped: `kill(SIGSTOP)`
    returns before the threads stop, and one still running could serve
    the request the test expects to go unanswered."""
    end = time.monotonic() + timeout
    while True:
        states = []
        for tid in os.listdir(f"/proc/{pid}/task"):
            try:
                with open(f"/proc/{pid}/task/{tid}/stat") as f:
                    states.append(f.read().rsplit(")", 1)[1].split()[0])
            except FileNotFoundError:
                pass
        if states and all(st in ("T", "t") for st in states):
            return
        assert time.monotonic() < end, f"process {pid} not stopped after {timeout} s: {states}"
        time.sleep(0.01)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def until(pred, timeout: float = 15, step: float = 0.02) -> bool:
    """Polls `pred` until it holds or `timeout` passed; its last answer."""
    end = time.monotonic() + timeout
    while not pred() and time.monotonic() < end:
        time.sleep(step)
    return bool(pred())


def vllm_pop_done(agent: nixl_agent, handles: list) -> tuple:
    """What vLLM's `_pop_done_transfers` does with one request's handles:
    DONE is released, PROC kept, "ERR" or an exception fails the request
    and releases its handle (a release that raises keeps it)."""
    kept, failed = [], False
    for h in handles:
        try:
            state = agent.check_xfer_state(h)
            if state == "DONE":
                agent.get_xfer_telemetry(h)
                agent.release_xfer_handle(h)
            elif state == "PROC":
                kept.append(h)
            else:
                failed = True
                agent.release_xfer_handle(h)
        except Exception:
            failed = True
            agent.release_xfer_handle(h)
    return kept, failed


def test_check_remote_metadata_false_once_the_remote_died_or_restarted(make_target):
    port = free_port()
    first = make_target("nixl", LEN, f"127.0.0.1:{port}", 7)
    mine = np.zeros(LEN, dtype=np.uint8)
    a = nixl_agent("decode", nixl_agent_config(backend="tcp", keepalive_interval="100ms",
                                               liveness_budget=3))
    try:
        a.register_memory(a.get_reg_descs([mine]))
        assert a.check_remote_metadata("target") is False  # never added
        name = a.add_remote_agent(bytes.fromhex(first.info["md"]))
        assert a.check_remote_metadata(name) is True
        assert a.check_remote_metadata("target") is True  # str or bytes
        buf = first.info["buf"]
        assert a.check_remote_metadata(name, [(buf, LEN, 0)]) is True
        assert a.check_remote_metadata(name, a.get_xfer_descs([(buf + LEN, 1, 0)], "DRAM")) is False
        local = a.prep_xfer_dlist("NIXL_INIT_AGENT", [(mine.ctypes.data, LEN, 0)], "DRAM")
        remote = a.prep_xfer_dlist(name, [(buf, LEN, 0)], "DRAM")

        # The remote dies with a READ in flight: the request fails the way
        # vLLM handles it (ERR or an exception, handle released), never
        # PROC for good; then check_remote_metadata says to drop it.
        first.proc.kill()
        first.proc.wait()
        h = a.make_prepped_xfer("READ", local, [0], remote, [0], b"req-1:1")
        a.transfer(h)
        pending, failed = [h], False
        end = time.monotonic() + 20
        while pending and time.monotonic() < end:
            pending, f = vllm_pop_done(a, pending)
            failed |= f
            time.sleep(0.01)
        assert not pending and failed
        assert until(lambda: a.check_remote_metadata(name) is False)
        assert a.check_remote_metadata(name, [(buf, LEN, 0)]) is False

        # Back on the same port (a new incarnation): the old metadata stays
        # invalid even once kvlane has followed the restart, until the
        # agent is removed and added again with the new metadata.
        second = make_target("nixl", LEN, f"127.0.0.1:{port}", 9)
        time.sleep(0.5)  # time for the peer to be followed (it must stay False)
        assert a.check_remote_metadata(name) is False
        a.remove_remote_agent(name)
        assert a.check_remote_metadata(name) is False
        assert a.add_remote_agent(bytes.fromhex(second.info["md"])) == name
        assert a.check_remote_metadata(name) is True
        remote2 = a.prep_xfer_dlist(name, [(second.info["buf"], LEN, 0)], "DRAM")
        h = a.make_prepped_xfer("READ", local, [0], remote2, [0])
        a.transfer(h)
        assert wait_done(a, h, 20) == "DONE"
        assert (mine == pattern(9)).all()
    finally:
        a.close()


def test_memory_registered_after_the_metadata_is_read_once_the_peer_adds_it_again():
    first, second = pattern(3, 8 * BLOCK), pattern(4, 8 * BLOCK)
    mine = np.zeros(8 * BLOCK, dtype=np.uint8)
    a = nixl_agent("prefill", nixl_agent_config(backend="tcp"))
    b = nixl_agent("decode", nixl_agent_config(backend="tcp"))
    try:
        a.register_memory(a.get_reg_descs([first]))
        md1 = a.get_agent_metadata()
        b.register_memory(b.get_reg_descs([mine]))
        name = b.add_remote_agent(md1)
        local = b.prep_xfer_dlist("NIXL_INIT_AGENT", [(mine.ctypes.data, 8 * BLOCK, 0)], "DRAM")
        r1 = b.prep_xfer_dlist(name, [(first.ctypes.data, 8 * BLOCK, 0)], "DRAM")
        h = b.make_prepped_xfer("READ", local, [0], r1, [0])
        b.transfer(h)
        assert wait_done(b, h, 20) == "DONE"
        assert (mine == first).all()

        # A registers more memory after its metadata went out (vLLM's host
        # staging buffer), and publishes its metadata again.
        a.register_memory(a.get_reg_descs([second]))
        md2 = a.get_agent_metadata()
        assert json.loads(md2)["regs"] == json.loads(md1)["regs"] + 1
        desc2 = [(second.ctypes.data, 8 * BLOCK, 0)]
        # Not advertised to B yet: refused by name, never read blindly.
        assert b.check_remote_metadata(name, desc2) is False
        with pytest.raises(kvlane.InvalidInputError, match="advertised"):
            b.prep_xfer_dlist(name, desc2, "DRAM")
        # B adds A again with the new metadata: the new region is usable.
        assert b.add_remote_agent(md2) == name
        assert b.check_remote_metadata(name, desc2) is True
        assert b.check_remote_metadata(name) is True
        r2 = b.prep_xfer_dlist(name, desc2, "DRAM")
        h = b.make_prepped_xfer("READ", local, [0], r2, [0], b"late")
        b.transfer(h)
        assert wait_done(b, h, 20) == "DONE"
        assert (mine == second).all()
        assert until(lambda: a.update_notifs().get("decode") == [b"late"])
        # The region registered first still works on the new connection.
        r1 = b.prep_xfer_dlist(name, [(first.ctypes.data, 8 * BLOCK, 0)], "DRAM")
        h = b.make_prepped_xfer("READ", local, [0], r1, [0])
        b.transfer(h)
        assert wait_done(b, h, 20) == "DONE"
        assert (mine == first).all()
        # And A uses its new memory locally: WRITE from it into B.
        a.add_remote_agent(b.get_agent_metadata())
        mine[:] = 0
        h = a.initialize_xfer("WRITE", desc2, [(mine.ctypes.data, 8 * BLOCK, 0)], "decode")
        a.transfer(h)
        assert wait_done(a, h, 20) == "DONE"
        assert (mine == second).all()
        # A third agent that adds A for the first time sees both regions.
        c_buf = np.zeros(8 * BLOCK, dtype=np.uint8)
        c = nixl_agent("other", nixl_agent_config(backend="tcp"))
        try:
            c.register_memory(c.get_reg_descs([c_buf]))
            c.add_remote_agent(md2)
            h = c.initialize_xfer("READ", [(c_buf.ctypes.data, 8 * BLOCK, 0)], desc2, "prefill")
            c.transfer(h)
            assert wait_done(c, h, 20) == "DONE"
            assert (c_buf == second).all()
        finally:
            c.close()
    finally:
        a.close()
        b.close()


def test_liveness_settings_from_arguments_and_the_environment(monkeypatch):
    for var in ("KVLANE_KEEPALIVE_INTERVAL", "KVLANE_LIVENESS_BUDGET", "KVLANE_HANDSHAKE_TIMEOUT",
                "KVLANE_TRANSFER_TIMEOUT", "KVLANE_BACKEND", "KVLANE_ADVERTISE",
                "KVLANE_NIXL_ADVERTISE", "KVLANE_PSK", "KVLANE_SHM_CROSS_MEMORY_ATTACH"):
        monkeypatch.delenv(var, raising=False)
    c = nixl_agent_config()
    assert (c.keepalive_interval, c.liveness_budget, c.handshake_timeout,
            c.transfer_deadline, c.cpus, c.backend) == (None, None, None, None, None, "auto")
    assert c._agent_kwargs() == {}  # kvlane's defaults

    monkeypatch.setenv("KVLANE_KEEPALIVE_INTERVAL", "250ms")
    monkeypatch.setenv("KVLANE_LIVENESS_BUDGET", "5")
    monkeypatch.setenv("KVLANE_HANDSHAKE_TIMEOUT", "2s")
    monkeypatch.setenv("KVLANE_TRANSFER_TIMEOUT", "1m")
    monkeypatch.setenv("KVLANE_BACKEND", "tcp")
    monkeypatch.setenv("KVLANE_ADVERTISE", "10.0.0.5")
    monkeypatch.setenv("KVLANE_PSK", "k")
    c = nixl_agent_config()
    assert c._agent_kwargs() == {"keepalive_interval": 0.25, "liveness_budget": 5,
                                 "handshake_timeout": 2.0, "transfer_deadline": 60.0}
    assert (c.backend, c.advertise_host, c.psk) == ("tcp", "10.0.0.5", b"k")
    # Explicit arguments win over the environment.
    c = nixl_agent_config(keepalive_interval=0.5, liveness_budget=2, handshake_timeout="3s",
                          transfer_deadline="1.5", backend="loopback", advertise_host="10.0.0.6",
                          cpus="0-1")
    assert c._agent_kwargs() == {"keepalive_interval": 0.5, "liveness_budget": 2,
                                 "handshake_timeout": 3.0, "transfer_deadline": 1.5, "cpus": "0-1"}
    assert (c.backend, c.advertise_host) == ("loopback", "10.0.0.6")

    # A bad value names its source and the value.
    for var, bad in (("KVLANE_KEEPALIVE_INTERVAL", "fast"), ("KVLANE_HANDSHAKE_TIMEOUT", "-2s"),
                     ("KVLANE_TRANSFER_TIMEOUT", "0"), ("KVLANE_LIVENESS_BUDGET", "0"),
                     ("KVLANE_LIVENESS_BUDGET", "3.5"), ("KVLANE_BACKEND", "rdma")):
        monkeypatch.setenv(var, bad)
        with pytest.raises(ValueError, match=f"{var} is .*not '{bad}'"):
            nixl_agent_config()
        monkeypatch.delenv(var)
    with pytest.raises(ValueError, match="keepalive_interval is .*not '1h'"):
        nixl_agent_config(keepalive_interval="1h")
    with pytest.raises(ValueError, match="liveness_budget is .*not -1"):
        nixl_agent_config(liveness_budget=-1)
    monkeypatch.setenv("KVLANE_NIXL_ADVERTISE", "10.0.0.7")
    with pytest.raises(ValueError, match="KVLANE_ADVERTISE='10.0.0.5' and .*'10.0.0.7' disagree"):
        nixl_agent_config()
    monkeypatch.delenv("KVLANE_ADVERTISE")
    assert nixl_agent_config().advertise_host == "10.0.0.7"  # the older name still works
    # The native agent takes the handshake timeout (and checks it).
    with pytest.raises(kvlane.InvalidInputError, match="handshake_timeout"):
        kvlane.Agent(backend="tcp", handshake_timeout=-1.0)


def test_transfer_deadline_from_the_config_ends_a_read_from_a_stopped_remote(make_target):
    # A remote that stops answering (SIGSTOP) but whose keep-alive budget
    # (a minute) outlasts the test: only the configured 300 ms transfer
    # deadline can end the READ before the 30 s default.
    target = make_target("nixl")
    mine = np.zeros(LEN, dtype=np.uint8)
    a = nixl_agent("decode", nixl_agent_config(backend="tcp", keepalive_interval="1m",
                                               transfer_deadline="300ms"))
    try:
        a.register_memory(a.get_reg_descs([mine]))
        name = a.add_remote_agent(bytes.fromhex(target.info["md"]))
        os.kill(target.proc.pid, signal.SIGSTOP)
        wait_stopped(target.proc.pid)
        try:
            h = a.initialize_xfer("READ", [(mine.ctypes.data, LEN, 0)],
                                  [(target.info["buf"], LEN, 0)], name)
            state = a.transfer(h)
            if state != "ERR":
                state = wait_done(a, h, 20)
            assert state == "ERR"
            # Timed out, not dead: vLLM keeps the engine.
            assert a.check_remote_metadata(name) is True
        finally:
            os.kill(target.proc.pid, signal.SIGCONT)
    finally:
        a.close()
