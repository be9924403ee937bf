"""The native API's flow from one host to another (test_hosts.py runs it
on one network namespace and its target, target.py, on the other): the
target listens on a wildcard address; this side dials the target's host
(``TARGET_HOST``) at the port the target printed, WRITEs and READs
byte-checked with notifications after the data, then kills the target and
expects ``PeerLostError`` within the liveness budget. Prints the outcomes
as one ``FLOW`` JSON line.

    FLOW_TARGET_PREFIX="ip netns exec A" TARGET_HOST=10.0.0.1 python native_flow.py
"""

import json
import os
import shlex
import time

import kvlane
from conftest import Target
from target import LEN, pattern, sha


def main() -> None:
    prefix = shlex.split(os.environ.get("FLOW_TARGET_PREFIX", ""))
    target = Target("native", LEN, "0.0.0.0:0", prefix=prefix)
    ask, t = target.ask, target.info
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
        target.proc.kill()
        target.proc.wait()
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
