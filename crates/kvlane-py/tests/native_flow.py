"""The native API's flow from one host to another (test_hosts.py runs it
on one network namespace and its target, target.py, on the other): the
target listens on a wildcard address; this side dials the target's host
(``TARGET_HOST``) at the port the target printed, WRITEs and READs
byte-checked with notifications after the data, then kills the target and
expects ``PeerLostError`` within the liveness budget. Prints the outcomes
as one ``FLOW`` JSON line.

    FLOW_TARGET_PREFIX="ip netns exec A" TARGET_HOST=10.0.0.1 python native_flow.py
"""

import hashlib
import json
import os
import shlex
import subprocess
import sys
import time

import kvlane
from target import LEN, pattern


def sha(buf) -> str:
    return hashlib.sha256(memoryview(buf)).hexdigest()


def main() -> None:
    here = os.path.dirname(os.path.abspath(__file__))
    prefix = shlex.split(os.environ.get("FLOW_TARGET_PREFIX", ""))
    proc = subprocess.Popen(prefix + [sys.executable, os.path.join(here, "target.py"), "native",
                                      str(LEN), "0.0.0.0:0"],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)

    def ask(cmd: dict) -> dict:
        proc.stdin.write(json.dumps(cmd) + "\n")
        proc.stdin.flush()
        return json.loads(proc.stdout.readline())

    t = json.loads(proc.stdout.readline())
    port = t["addr"].rsplit(":", 1)[1]
    out = {"target_listens": t["addr"].rsplit(":", 1)[0]}
    mine = pattern(1)
    with kvlane.Agent(engine_id="init", backend="tcp", regions=[mine],
                      keepalive_interval=0.5, liveness_budget=3) as agent:
        peer = agent.connect(f"{os.environ['TARGET_HOST']}:{port}")
        out["engine_id"] = peer.engine_id
        base, rbase, half = mine.ctypes.data, t["buf"], LEN // 2
        h = peer.write_spans([(base, half)], [(rbase + half, half)], notify=b"w1")
        out["write"] = h.wait(30) and h.status
        theirs = pattern(7)
        theirs[half:] = mine[:half]
        (note,) = ask({"op": "notes", "n": 1})["notes"]
        out["write_note"] = note[:2]
        out["write_note_after_data"] = note[2] == sha(theirs)
        h = peer.read_spans([(base + half, half)], [(rbase, half)], notify=b"r1")
        out["read"] = h.wait(30) and h.status
        out["read_bytes_ok"] = bool((mine[half:] == pattern(7)[:half]).all())
        (note,) = ask({"op": "notes", "n": 1})["notes"]
        out["read_note"] = note[:2]
        proc.kill()
        proc.wait()
        start = time.monotonic()
        try:
            while time.monotonic() - start < 30:
                peer.write_spans([(base, 4096)], [(rbase, 4096)]).wait(30)
                time.sleep(0.05)
            out["after_death"] = "still writing after 30 s"
        except kvlane.PeerLostError:
            out["after_death"] = "PeerLostError"
        except kvlane.Error as e:
            out["after_death"] = type(e).__name__
        out["after_death_s"] = round(time.monotonic() - start, 1)
    print("FLOW " + json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
