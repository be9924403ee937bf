"""A target process that dies and comes back on the same address: the old
peer's transfers fail (never land in the new process's memory), and a new
connection to the new incarnation works, through both APIs."""

import socket
import time

import numpy as np
import pytest

import kvlane
import kvlane.nixl as nixl
from conftest import LEN, expected_sha, pattern


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_native_peer_restarted_on_the_same_address_is_followed_old_spans_never_land(make_target):
    addr = f"127.0.0.1:{free_port()}"
    first = make_target("native", LEN, addr, 7)
    mine = pattern(1)
    with kvlane.Agent(engine_id="init", backend="tcp", regions=[mine],
                      keepalive_interval=0.2, liveness_budget=3) as agent:
        events = agent.events()
        peer = agent.connect(addr)
        old_inc = peer.incarnation
        base, old_buf = mine.ctypes.data, first.info["buf"]
        assert peer.write_spans([(base, 4096)], [(old_buf, 4096)]).wait(10)
        stale_plan = peer.prepare_spans("WRITE", [(base, 4096)], [(old_buf, 4096)])
        assert peer.post(stale_plan).wait(10)

        first.proc.kill()
        first.proc.wait()
        second = make_target("native", LEN, addr, 9)
        # Until the restart is seen, transfers fail typed; spans of the old
        # process's memory never reach the new one.
        start, kinds, lost = time.monotonic(), [], 0
        while "restarted" not in kinds and time.monotonic() - start < 15:
            try:
                peer.write_spans([(base, 4096)], [(old_buf, 4096)]).wait(10)
            except kvlane.PeerLostError:
                lost += 1
            except kvlane.InvalidInputError as e:
                assert "outside every remote registration" in str(e)
            ev = events.recv(0.05)
            if ev is not None:
                kinds.append(ev.kind)
        assert "restarted" in kinds, kinds
        assert lost > 0, "no transfer failed while the peer was down"
        assert second.ask({"op": "sha"})["sha"] == expected_sha(pattern(9)), \
            "a transfer aimed at the old incarnation landed in the new one"

        # The same Peer follows the new incarnation once it is attached.
        while peer.incarnation == old_inc and time.monotonic() - start < 15:
            time.sleep(0.05)
        assert peer.incarnation not in (None, old_inc)
        new_buf = second.info["buf"]
        deadline = time.monotonic() + 10
        while True:  # the re-attach can trail the restart event
            try:
                assert peer.write_spans([(base, LEN)], [(new_buf, LEN)]).wait(10)
                break
            except kvlane.PeerLostError:
                assert time.monotonic() < deadline
                time.sleep(0.05)
        assert second.ask({"op": "sha"})["sha"] == expected_sha(mine)
        # A transfer prepared for the old incarnation and posted again is
        # planned again against the new one (checks included): its spans
        # of the old process's memory are refused by name, or, where the
        # new process's buffer happens to lie at the same address, land
        # there; never a StaleError, never through the old keys.
        try:
            h = peer.post(stale_plan)
            assert h.wait(10)
            assert old_buf == new_buf
        except kvlane.InvalidInputError as e:
            assert "outside every remote registration" in str(e)
        mine[:] = 0
        assert peer.read_spans([(base, LEN)], [(new_buf, LEN)]).wait(10)
        assert (mine == pattern(1)).all()
        # A fresh connect to the address finds the same, new incarnation.
        assert agent.connect(addr).incarnation == peer.incarnation


def test_nixl_remote_agent_restarted_old_handles_err_readding_it_works(make_target):
    port = free_port()
    first = make_target("nixl", LEN, f"127.0.0.1:{port}", 7)
    mine = pattern(1)
    agent = nixl.nixl_agent("init", nixl.nixl_agent_config(backend="tcp"))
    try:
        agent.register_memory(agent.get_reg_descs([mine]))
        name = agent.add_remote_agent(bytes.fromhex(first.info["md"]))
        local = agent.prep_xfer_dlist("NIXL_INIT_AGENT", [(mine.ctypes.data, 4096, 0)])
        remote = agent.prep_xfer_dlist(name, [(first.info["buf"], 4096, 0)])
        h = agent.make_prepped_xfer("WRITE", local, [0], remote, [0])
        assert agent.transfer(h) in ("DONE", "PROC")
        end = time.monotonic() + 10
        while agent.check_xfer_state(h) == "PROC" and time.monotonic() < end:
            time.sleep(0.001)
        assert agent.check_xfer_state(h) == "DONE"

        first.proc.kill()
        first.proc.wait()
        second = make_target("nixl", LEN, f"127.0.0.1:{port}", 9)
        # Handles made against the old incarnation end in ERR (or raise),
        # never PROC forever, and never land in the new process.
        state, end = "PROC", time.monotonic() + 20
        while state != "ERR" and time.monotonic() < end:
            try:
                h2 = agent.make_prepped_xfer("WRITE", local, [0], remote, [0])
                state = agent.transfer(h2)
                while state == "PROC" and time.monotonic() < end:
                    time.sleep(0.01)
                    state = agent.check_xfer_state(h2)
            except kvlane.Error:
                state = "ERR"
            if state != "ERR":
                time.sleep(0.1)
        assert state == "ERR"
        assert second.ask({"op": "sha"})["sha"] == expected_sha(pattern(9))

        agent.remove_remote_agent(name)
        name2 = agent.add_remote_agent(bytes.fromhex(second.info["md"]))
        assert name2 == name
        remote2 = agent.prep_xfer_dlist(name2, [(second.info["buf"], LEN, 0)])
        local2 = agent.prep_xfer_dlist("NIXL_INIT_AGENT", [(mine.ctypes.data, LEN, 0)])
        h3 = agent.make_prepped_xfer("WRITE", local2, [0], remote2, [0])
        agent.transfer(h3)
        end = time.monotonic() + 10
        while agent.check_xfer_state(h3) == "PROC" and time.monotonic() < end:
            time.sleep(0.001)
        assert agent.check_xfer_state(h3) == "DONE"
        assert second.ask({"op": "sha"})["sha"] == expected_sha(mine)
    finally:
        agent.close()


def test_nixl_remote_agent_back_on_another_port_is_followed_by_adding_it_again(make_target):
    # vLLM's connector adds a remote agent's metadata again after each
    # handshake; a restart on a new port must not leave the old address.
    first = make_target("nixl", LEN, f"127.0.0.1:{free_port()}", 7)
    mine = pattern(1)
    agent = nixl.nixl_agent("init", nixl.nixl_agent_config(backend="tcp"))
    try:
        agent.register_memory(agent.get_reg_descs([mine]))
        name = agent.add_remote_agent(bytes.fromhex(first.info["md"]))
        assert agent.add_remote_agent(bytes.fromhex(first.info["md"])) == name  # same: kept
        first.proc.kill()
        first.proc.wait()
        second = make_target("nixl", LEN, f"127.0.0.1:{free_port()}", 9)
        assert agent.add_remote_agent(bytes.fromhex(second.info["md"])) == name
        remote = agent.prep_xfer_dlist(name, [(second.info["buf"], LEN, 0)])
        local = agent.prep_xfer_dlist("NIXL_INIT_AGENT", [(mine.ctypes.data, LEN, 0)])
        h = agent.make_prepped_xfer("WRITE", local, [0], remote, [0])
        agent.transfer(h)
        end = time.monotonic() + 10
        while agent.check_xfer_state(h) == "PROC" and time.monotonic() < end:
            time.sleep(0.001)
        assert agent.check_xfer_state(h) == "DONE"
        assert second.ask({"op": "sha"})["sha"] == expected_sha(mine)
    finally:
        agent.close()
