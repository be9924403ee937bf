#!/usr/bin/env python3
"""Interleaved A/B rounds of the two-process tcp bench, for comparing
kvlane binaries (or one binary against itself, to see the spread).

    ci/bench-ab.py --rounds 10 target/release/kvlane /tmp/kvlane.before

Each round runs, for every binary in turn, `kvlane bench --role target
--backend tcp --listen 127.0.0.1:0 --pool 1G`, waits for its `listening` line, then
`kvlane bench --role initiator --backend tcp` against it (with the raw-tcp baseline),
and prints tcp GB/s, raw-tcp GB/s and their ratio per op. At the end:
per binary and op, the median ratio over the rounds and its range.

On a small shared VM one run's ratio moves by 10-20% (and the machine
under one session is not always the host of the last), so compare
binaries in the same invocation, interleaved, over several rounds; a
single pair of runs says little. Exits non-zero when a run fails.
"""

import argparse
import json
import os
import statistics
import subprocess
import sys

# The target's start and its `listening` line, as the Python bench does it.
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "crates", "kvlane-py", "bench"))
import rust_target  # noqa: E402


def one_run(binary, args):
    """The initiator's rows of one run of `binary`."""
    with rust_target.running(binary, args.pool) as addr:
        out = subprocess.run(
            [binary, "bench", "--role", "initiator", "--backend", "tcp", "--connect", addr,
             "--block-sizes", args.block_sizes, "--op", args.ops, "--batch", str(args.batch),
             "--duration", args.duration, "--post", args.post, "--json"],
            capture_output=True, text=True, timeout=600)
    if out.returncode != 0:
        raise RuntimeError(f"{binary} bench --role initiator failed ({out.returncode}):\n{out.stderr[-2000:]}")
    return [json.loads(line) for line in out.stdout.splitlines() if line.startswith("{")]


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("binaries", nargs="+", help="kvlane binaries to compare")
    ap.add_argument("--rounds", type=int, default=10)
    ap.add_argument("--block-sizes", default="4K")
    ap.add_argument("--ops", default="read,write")
    ap.add_argument("--batch", type=int, default=128)
    ap.add_argument("--duration", default="2s", help="per point, as kvlane bench takes it")
    ap.add_argument("--post", default="each", choices=["each", "batch", "single"],
                    help="how the initiator posts a batch (kvlane bench --post)")
    ap.add_argument("--pool", default="1G", help="the target's pool")
    args = ap.parse_args()
    results = {}
    for r in range(args.rounds):
        for n, path in enumerate(args.binaries, 1):
            # Named by position too: one binary given twice measures the spread.
            b = f"#{n} {path}"
            rows = one_run(path, args)
            for row in rows:
                if row["backend"] == "raw-tcp":
                    continue
                raw = [x for x in rows if x["backend"] == "raw-tcp" and x["op"] == row["op"]
                       and x["block_size"] == row["block_size"]]
                if not raw:
                    raise RuntimeError(f"{b}: no raw-tcp row for {row['op']} {row['block_size']}")
                ratio = row["gbps"] / raw[0]["gbps"]
                key = (b, row["op"], row["block_size"])
                results.setdefault(key, []).append((ratio, row["gbps"], raw[0]["gbps"], row["post_avg_us"]))
                print(f"round {r + 1} {b} {row['op']} {row['block_size']}: tcp {row['gbps']:.2f} "
                      f"raw-tcp {raw[0]['gbps']:.2f} GB/s, ratio {ratio:.3f}, post {row['post_avg_us']:.2f} us",
                      flush=True)
    if not results:
        sys.exit("no rows")
    print()
    for (b, op, bs), v in sorted(results.items()):
        ratios = [x[0] for x in v]
        print(f"{b} {op} {bs}: median ratio {statistics.median(ratios):.3f} "
              f"(range {min(ratios):.3f}-{max(ratios):.3f}), tcp {statistics.median(x[1] for x in v):.2f}, "
              f"raw-tcp {statistics.median(x[2] for x in v):.2f} GB/s, "
              f"post {statistics.median(x[3] for x in v):.2f} us, {len(v)} rounds")


if __name__ == "__main__":
    main()
