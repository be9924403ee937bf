"""The other process of the two-process tests: a target agent that
registers a patterned buffer, prints what the initiator needs as one JSON
line, then answers commands on stdin (one JSON line each)."""

import hashlib
import json
import sys
import time

import numpy as np

import kvlane
import kvlane.nixl as nixl

LEN = 1 << 20


def pattern(seed: int, n: int = LEN) -> np.ndarray:
    return ((np.arange(n, dtype=np.uint64) * 31 + seed) % 251).astype(np.uint8)


def out(obj) -> None:
    sys.stdout.write(json.dumps(obj) + "\n")
    sys.stdout.flush()


def sha(buf) -> str:
    return hashlib.sha256(memoryview(buf)).hexdigest()


def main() -> None:
    mode, size = sys.argv[1], int(sys.argv[2]) if len(sys.argv) > 2 else LEN
    listen = sys.argv[3] if len(sys.argv) > 3 else "127.0.0.1:0"
    seed = int(sys.argv[4]) if len(sys.argv) > 4 else 7
    buf = pattern(seed, size)
    if mode in ("native", "auto"):
        if mode == "auto":
            # kvlane's shareable memory and the default backend: a peer on
            # this host reaches it over shm.
            buf, data = kvlane.host_buffer(size), buf
            buf[:] = data
            agent = kvlane.Agent(engine_id="target", listen=listen, regions=[buf])
        else:
            agent = kvlane.Agent(engine_id="target", listen=listen, backend="tcp",
                                 regions=[buf])
        out({"addr": agent.addr, "buf": buf.ctypes.data, "len": size})
        notes = agent.notifications()

        def next_notes(n, timeout):
            got, end = [], time.monotonic() + timeout
            while len(got) < n and time.monotonic() < end:
                note = notes.recv(0.05)
                if note is not None:
                    # The data must be there when the notification is.
                    got.append([note.sender, note.payload.decode(), sha(buf)])
            return got
    else:
        # "nixl-shm": numpy memory served to peers on this host by
        # cross-memory attach (opt-in).
        shm = mode == "nixl-shm"
        agent = nixl.nixl_agent("target", nixl.nixl_agent_config(
            backend="shm" if shm else "tcp", listen_port=int(listen.rsplit(":", 1)[1]),
            shm_cross_memory_attach=True if shm else None))
        agent.register_memory(agent.get_reg_descs([buf]))
        out({"md": agent.get_agent_metadata().hex(), "buf": buf.ctypes.data, "len": size})

        def next_notes(n, timeout):
            got, end = [], time.monotonic() + timeout
            while len(got) < n and time.monotonic() < end:
                for name, msgs in agent.get_new_notifs().items():
                    got.extend([name, m.decode(), sha(buf)] for m in msgs)
                time.sleep(0.002)
            return got

    for line in sys.stdin:
        cmd = json.loads(line)
        if cmd["op"] == "sha":
            out({"sha": sha(buf)})
        elif cmd["op"] == "notes":
            out({"notes": next_notes(cmd["n"], cmd.get("timeout", 10))})
        elif cmd["op"] == "add":  # nixl: know the initiator, to notify it
            out({"name": agent.add_remote_agent(bytes.fromhex(cmd["md"])).decode()})
        elif cmd["op"] == "send":
            agent.send_notif(cmd["to"], cmd["msg"].encode())
            out({"sent": True})
        elif cmd["op"] == "quit":
            break
    agent.close()


if __name__ == "__main__":
    main()
