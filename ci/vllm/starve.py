"""Does a prefill engine that holds blocks for a remote decode starve a
decode engine on the same host? (issue 40; the reason pd.py gives prefill
and decode cores of their own.)

    python ci/vllm/starve.py [--connector kvlane|nixl|nixl-placed]
                             [--placement split|shared] [--calls 40]

Starts a prefill and a decode engine, runs one P/D round, then times
`--calls` decode calls (a 5-token prompt, 6 tokens, no transfer) twice:
with the prefill idle, and while the prefill holds one request's blocks
for a decode that never reads them (vLLM steps the prefill without pause
until its 30 s lease ends). Prints the CPU each engine thread used in 3 s
of each phase and the call times. On the 2-vCPU VM of 2026-12-06:

- `--placement shared` (the default here), worker thread pinned as vLLM
  pins it: NIXL's first call waited 29.6 s (the lease); kvlane's took
  3.7-4.1 s each for the lease's length, 1.46 s with the prefill idle;
- `--placement split` with kvlane.vllm's restored placement: 20 ms median
  with the prefill idle, 63 ms median (331 ms max) while it holds blocks.
"""

import argparse
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import pd  # noqa: E402


def cpu(label: str, engines: list, secs: float = 3.0) -> None:
    def ticks() -> dict:
        return {(pid, tid): (name, int(f[11]) + int(f[12]), int(f[36]))
                for e in engines for pid, tid, name, f in e.threads()}

    a = ticks()
    time.sleep(secs)
    b = ticks()
    tick = os.sysconf("SC_CLK_TCK")
    rows = sorted(((v[1] - a[k][1]) / tick / secs, k[0], v[0], v[2])
                  for k, v in b.items() if k in a)
    print(label, " ".join(f"{p}/{n}@cpu{c}:{d * 100:.0f}%" for d, p, n, c in reversed(rows)
                          if d > 0.02), flush=True)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--connector", choices=["kvlane", "nixl", "nixl-placed"], default="kvlane")
    ap.add_argument("--placement", choices=["split", "shared"], default="shared")
    ap.add_argument("--calls", type=int, default=40)
    ap.add_argument("--workdir", default=None)
    ap.add_argument("--side-port", type=int, default=25800)
    a = ap.parse_args()
    s = pd.Setup(a)
    c = a.connector
    env = s.connector_env(c)
    penv = dict(env, PD_KV_EXTRA=json.dumps({"kv_lease_duration": pd.LEASE_S}))
    pre = s.engine("prefill", c, penv, side_port=s.port)
    dec = s.engine("decode", c, env, side_port=s.port + 1)
    try:
        pre.ready()
        dec.ready()
        ps = pd.make_prompts([5] * a.calls, seed=3)
        kv = pre.run([pd.changed(ps[0])])["outputs"][0]["kv"]
        dec.run([ps[0]], [kv], max_tokens=6)
        for phase in ("prefill idle", "prefill holding blocks"):
            if phase != "prefill idle":
                pre.run([pd.changed(ps[1])])  # its blocks wait for a decode that never comes
            cpu(f"{phase}: CPU per thread:", [pre, dec])
            t = [dec.run([p], max_tokens=6)["secs"] for p in ps]
            print(f"{phase}: decode calls: median {statistics.median(t) * 1e3:.0f} ms, "
                  f"max {max(t) * 1e3:.0f} ms; all (ms): {[round(x * 1e3) for x in t]}",
                  flush=True)
    finally:
        pre.stop()
        dec.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
