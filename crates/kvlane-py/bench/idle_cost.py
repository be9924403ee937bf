"""Per-call cost of what vLLM's NixlConnector calls every engine step:
``get_new_notifs()`` with nothing pending and ``check_xfer_state()`` on a
finished and on a running transfer (the target is stopped with SIGSTOP so
the READ stays in progress), alone and with a second Python thread that
wants the GIL (vLLM's worker has such threads). Prints microseconds per
call; nothing is asserted.

    python crates/kvlane-py/bench/idle_cost.py [--calls N]
"""

import argparse
import os
import signal
import subprocess
import sys
import threading
import time

import numpy as np

from kvlane.nixl import nixl_agent, nixl_agent_config

TARGET = r"""
import sys, numpy as np
from kvlane.nixl import nixl_agent, nixl_agent_config
buf = np.zeros(1 << 20, dtype=np.uint8)
t = nixl_agent("target", nixl_agent_config(backend="tcp"))
t.register_memory(t.get_reg_descs([buf]))
print(t.get_agent_metadata().hex(), buf.ctypes.data, flush=True)
sys.stdin.read()
"""


def per_call(fn, calls: int) -> float:
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - start) / calls * 1e6


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--calls", type=int, default=20000)
    args = ap.parse_args()
    proc = subprocess.Popen([sys.executable, "-c", TARGET], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True)
    md, addr = proc.stdout.readline().split()
    mine = np.zeros(1 << 20, dtype=np.uint8)
    a = nixl_agent("bench", nixl_agent_config(backend="tcp"))
    a.register_memory(a.get_reg_descs([mine]))
    name = a.add_remote_agent(bytes.fromhex(md))
    done = a.initialize_xfer("READ", [(mine.ctypes.data, 4096, 0)], [(int(addr), 4096, 0)], name)
    a.transfer(done)
    while a.check_xfer_state(done) == "PROC":
        pass
    os.kill(proc.pid, signal.SIGSTOP)
    running = a.initialize_xfer("READ", [(mine.ctypes.data, 1 << 20, 0)],
                                [(int(addr), 1 << 20, 0)], name)
    a.transfer(running)
    rows = []

    def measure(label: str) -> None:
        rows.append((label, "get_new_notifs (none)", per_call(a.get_new_notifs, args.calls)))
        rows.append((label, "check_xfer_state DONE", per_call(lambda: a.check_xfer_state(done), args.calls)))
        state = a.check_xfer_state(running)
        rows.append((label, f"check_xfer_state {state}",
                     per_call(lambda: a.check_xfer_state(running), args.calls)))

    measure("alone")
    stop = threading.Event()

    def busy() -> None:  # a Python thread that always wants the GIL
        x = 0
        while not stop.is_set():
            x += 1

    th = threading.Thread(target=busy, daemon=True)
    th.start()
    measure("+busy thread")
    stop.set()
    th.join()
    for label, what, us in rows:
        print(f"{label:13s} {what:24s} {us:10.2f} us/call")
    os.kill(proc.pid, signal.SIGCONT)
    proc.stdin.close()
    proc.wait(10)
    a.close()


if __name__ == "__main__":
    main()
