"""One script of an engine connector's NIXL flow, run against an
implementation given by module path (``nixl_cu12._api`` — the real NIXL —
or ``kvlane.nixl``): register, metadata exchange, prep, READ with
notification, WRITE with notification, ``send_notif``, out-of-registration
refusal, peer death. Prints the outcomes as one JSON object, so the
differential test can compare implementations.

    python flow.py MODULE            # initiator (starts the target itself)
    python flow.py MODULE target     # the target process

``FLOW_TARGET_PREFIX`` (a command line, split like a shell's) goes before
the target's command: ``ip netns exec HOST env VAR=...`` runs it on another
host (test_hosts.py).
"""

import hashlib
import importlib
import json
import os
import shlex
import subprocess
import sys
import time

import numpy as np

BLOCK = 4096
BLOCKS = 64
LEN = BLOCK * BLOCKS


def pattern(seed: int) -> np.ndarray:
    return ((np.arange(LEN, dtype=np.uint64) * 31 + seed) % 251).astype(np.uint8)


def sha(buf: np.ndarray) -> str:
    return hashlib.sha256(memoryview(buf)).hexdigest()


def make_agent(api, name: str, buf: np.ndarray):
    agent = api.nixl_agent(name, api.nixl_agent_config(backends=["UCX"]))
    agent.register_memory(agent.get_reg_descs([(buf.ctypes.data, buf.nbytes, 0, "")], "DRAM"))
    return agent


def target(api) -> None:
    buf = pattern(7)
    agent = make_agent(api, "target", buf)
    say({"md": agent.get_agent_metadata().hex(), "buf": buf.ctypes.data})
    for line in sys.stdin:
        cmd = json.loads(line)
        if cmd["op"] == "notes":
            got, end = [], time.monotonic() + 15
            while len(got) < cmd["n"] and time.monotonic() < end:
                for name, msgs in agent.get_new_notifs().items():
                    # What the target's memory holds when the notification is seen.
                    got.extend([name, bytes(m).decode(), sha(buf)] for m in msgs)
                time.sleep(0.001)
            say(got)
        elif cmd["op"] == "quit":
            break


def say(obj) -> None:
    # NIXL logs to stdout too: protocol lines carry a prefix.
    print("FLOW " + json.dumps(obj), flush=True)


def hear(stream):
    for line in stream:
        if line.startswith("FLOW "):
            return json.loads(line[5:])
    raise EOFError("the other process exited")


def blocks(base: int, ids) -> list:
    return [(base + i * BLOCK, BLOCK, 0) for i in ids]


def outcome(fn) -> str:
    try:
        fn()
        return "ok"
    except Exception:  # each implementation raises its own exception types
        return "raised"


def wait(agent, h, timeout: float = 15) -> str:
    end = time.monotonic() + timeout
    state = agent.check_xfer_state(h)
    while state == "PROC" and time.monotonic() < end:
        time.sleep(0.001)
        state = agent.check_xfer_state(h)
    return state


def initiator(api, module: str) -> dict:
    here = os.path.abspath(__file__)
    prefix = shlex.split(os.environ.get("FLOW_TARGET_PREFIX", ""))
    proc = subprocess.Popen(prefix + [sys.executable, here, module, "target"],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    t = hear(proc.stdout)

    def notes(n: int) -> list:
        proc.stdin.write(json.dumps({"op": "notes", "n": n}) + "\n")
        proc.stdin.flush()
        return hear(proc.stdout)

    out = {}
    mine = pattern(1)
    agent = make_agent(api, "initiator", mine)
    name = agent.add_remote_agent(bytes.fromhex(t["md"]))
    out["remote_name"] = repr(name)
    local = agent.prep_xfer_dlist("NIXL_INIT_AGENT", agent.get_xfer_descs(blocks(mine.ctypes.data, range(BLOCKS)), "DRAM"))
    remote = agent.prep_xfer_dlist(name, np.array(blocks(t["buf"], range(BLOCKS)), dtype=np.uint64), "DRAM")

    # READ remote 0..7 into local 32..39, notifying.
    h = agent.make_prepped_xfer("READ", local, np.arange(32, 40, dtype=np.int32), remote,
                                np.arange(8, dtype=np.int32), b"read-1")
    out["read_post"] = agent.transfer(h) in ("PROC", "DONE")
    out["read_state"] = wait(agent, h)
    out["read_bytes_ok"] = bool((mine[32 * BLOCK:40 * BLOCK] == pattern(7)[:8 * BLOCK]).all())
    (n,) = notes(1)
    out["read_notif"] = n[:2]
    out["read_notif_target_unchanged"] = n[2] == sha(pattern(7))
    agent.release_xfer_handle(h)

    # WRITE local 0, 2, 4 into remote 60, 61, 62, notifying.
    h = agent.make_prepped_xfer("WRITE", local, [0, 2, 4], remote, [60, 61, 62], b"write-1")
    agent.transfer(h)
    out["write_state"] = wait(agent, h)
    expect = pattern(7)
    for i, j in zip([0, 2, 4], [60, 61, 62]):
        expect[j * BLOCK:(j + 1) * BLOCK] = mine[i * BLOCK:(i + 1) * BLOCK]
    (n,) = notes(1)
    out["write_notif"] = n[:2]
    out["write_notif_after_data"] = n[2] == sha(expect)
    agent.release_xfer_handle(h)

    agent.send_notif(name, b"hello")
    out["send_notif"] = [x[:2] for x in notes(1)]

    # Descriptors outside a registration: refused at prep time.
    out["local_outside"] = outcome(lambda: agent.prep_xfer_dlist(
        "NIXL_INIT_AGENT", blocks(mine.ctypes.data, [BLOCKS]), "DRAM"))
    out["remote_outside"] = outcome(lambda: agent.prep_xfer_dlist(
        name, blocks(t["buf"], [BLOCKS + 1]), "DRAM"))

    # Peer death: the target is killed; a transfer to it ends in ERR (or
    # raises), never PROC for good.
    proc.kill()
    proc.wait()
    time.sleep(0.5)
    start = time.monotonic()

    def post_after_death():
        hh = agent.make_prepped_xfer("READ", local, list(range(8)), remote, list(range(8)), b"")
        state = agent.transfer(hh)
        if state == "ERR":
            return "ERR"
        return wait(agent, hh, 30)

    try:
        out["after_death"] = post_after_death()
    except Exception:
        out["after_death"] = "ERR"
    out["after_death_bounded"] = time.monotonic() - start < 30
    agent.release_dlist_handle(local)
    agent.release_dlist_handle(remote)
    return out


def main() -> None:
    module = sys.argv[1]
    api = importlib.import_module(module)
    if sys.argv[2:] == ["target"]:
        target(api)
    else:
        say(initiator(api, module))
        os._exit(0)  # NIXL's agent teardown is not part of the flow


if __name__ == "__main__":
    main()
