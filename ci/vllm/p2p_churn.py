"""Peer churn through vLLM's own P2P tier (manager, sessions, protocol), in
processes without an engine: one node stays up (S); the other (R) is
restarted at the same ``host:port`` again and again, by SIGKILL or a clean
shutdown in turn. Every incarnation of R pulls blocks from S (its first
message to S is its handshake, while S may still hold the session of R's
previous process) and then S pulls blocks from it.

    python ci/vllm/p2p_churn.py --control kvlane --restarts 50
    python ci/vllm/p2p_churn.py --control zmq --restarts 50   # vLLM's ZmqTransport

``--control kvlane`` is ``kvlane.vllm.KvlaneP2PTier``; ``--control zmq`` is
the same tier with vLLM's ``ZmqTransport`` and vLLM's own handling of new
connections (the data plane stays kvlane's, NIXL is not used here). The
last line is ``CHURN {json}``: restarts, failed exchanges, seconds from a
restart to R's first successful exchange (each, and the largest), stale
blocks seen, S's open fds after the first exchange and at the end, S's
sessions at the end, and whether S crashed.

Processes are forked from this one after ``import vllm`` (a few seconds),
so a restart takes milliseconds, the race the churn is about.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import multiprocessing as mp
import os
import signal
import socket
import sys
import time
import traceback
from types import SimpleNamespace
from typing import Any, Dict, List, Optional

import numpy as np

from kvlane import _vllm_p2p
from vllm.v1.kv_offload.base import ReqContext, make_offload_key
from vllm.v1.kv_offload.tiering.base import TransferJob
from vllm.v1.kv_offload.tiering.p2p.control.zmq import ZmqTransport
from vllm.v1.kv_offload.tiering.p2p.manager import P2PSecondaryTierManager

BLOCKS = 64
BLOCK_LEN = 4096
PER_EXCHANGE = 4
#: How long one exchange may take before it counts as failed (vLLM's load
#: timeout is 30 s and its handshake timeout 30 s: a refused first message
#: shows as ~30 s here).
EXCHANGE_TIMEOUT_S = 45.0


def free_port() -> int:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return port


def offloading_spec() -> Any:
    """The parts of an OffloadingSpec the P2P tier reads."""
    parallel = SimpleNamespace(data_parallel_index=0, tp_size=1, pp_size=1, pcp_size=1,
                               dcp_size=1, rank=0, is_parallelism_agnostic=True)
    config = SimpleNamespace(
        groups=[], model=SimpleNamespace(name="churn-model", dtype="bfloat16"),
        cache=SimpleNamespace(tokens_per_hash=16), parallel=parallel,
        canonical_layout=False, kv_cache_layout=None, replicated_layout=False,
    )
    return SimpleNamespace(config=config, blocks_per_chunk=1)


class ZmqControlTier(_vllm_p2p.KvlaneP2PTier):
    """The comparison: vLLM's ZmqTransport for control and vLLM's own
    handling of new connections; kvlane's data plane on another port."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs["kvlane"] = {**kwargs.get("kvlane", {}), "listen": "127.0.0.1:0"}
        super().__init__(*args, **kwargs)

    def _make_control(self, local_id: str, host: str, port: int) -> Any:
        return ZmqTransport(local_id, host, port)

    _accept_new_peers = P2PSecondaryTierManager._accept_new_peers


def make_tier(control: str, port: int, liveness_budget: Optional[int] = None) -> Any:
    buf = np.zeros((BLOCKS, BLOCK_LEN), dtype=np.uint8)
    view = memoryview(buf)
    cls = ZmqControlTier if control == "zmq" else _vllm_p2p.KvlaneP2PTier
    settings = {"backend": "tcp", "liveness_budget": liveness_budget}
    tier = cls(offloading_spec(), view, tier_type="churn", host="127.0.0.1", port=port,
               kvlane={k: v for k, v in settings.items() if v is not None})
    return tier, buf


def keys_of(kvid: str) -> List[bytes]:
    return [make_offload_key(hashlib.sha256(f"{kvid}:{i}".encode()).digest(), 0)
            for i in range(PER_EXCHANGE)]


def stamp(kvid: str, i: int) -> bytes:
    s = f"{kvid}:{i}:".encode()
    return (s * (BLOCK_LEN // len(s) + 1))[:BLOCK_LEN]


class Node:
    """One tier and the jobs it runs."""

    def __init__(self, control: str, port: int, liveness_budget: Optional[int]) -> None:
        self.tier, self.buf = make_tier(control, port, liveness_budget)
        self.addr = f"127.0.0.1:{port}"
        self.job_ids = iter(range(1, 1 << 62))
        self.results: Dict[int, bool] = {}
        self.slot = 0

    def poll(self) -> None:
        for r in self.tier.get_finished_jobs():
            self.results[r.job_id] = r.success

    def store(self, kvid: str) -> None:
        """Produces ``kvid``'s blocks for a consumer that will fetch them."""
        ctx = ReqContext(req_id=f"store-{kvid}",
                         kv_transfer_params={"remote_decoder": {"kv_request_id": kvid}})
        self.tier.on_new_request(ctx)
        blocks = self._blocks()
        for i, b in enumerate(blocks):
            self.buf[b] = np.frombuffer(stamp(kvid, i), dtype=np.uint8)
        self.tier.submit_store(TransferJob(next(self.job_ids), keys_of(kvid), np.array(blocks),
                                           False, ctx))

    def pull(self, kvid: str, peer: str) -> tuple:
        """Starts loading ``kvid`` from ``peer``; returns (job, ctx, blocks)."""
        host, port = peer.rsplit(":", 1)
        ctx = ReqContext(req_id=f"load-{kvid}", kv_transfer_params={"remote_prefiller": {
            "kv_request_id": kvid, "remote_host": host, "remote_port": int(port)}})
        self.tier.on_new_request(ctx)
        blocks = self._blocks()
        self.buf[blocks] = 0
        job = next(self.job_ids)
        self.tier.submit_load(TransferJob(job, keys_of(kvid), np.array(blocks), True, ctx))
        return job, ctx, blocks

    def finish(self, job: int, ctx: Any, blocks: List[int], kvid: str) -> Optional[dict]:
        """None while running; else the outcome (ok, stale blocks)."""
        if job not in self.results:
            return None
        ok = self.results.pop(job)
        self.tier.on_request_finished(ctx)
        wrong = [b for i, b in enumerate(blocks) if bytes(self.buf[b]) != stamp(kvid, i)]
        return {"ok": ok, "wrong_blocks": len(wrong) if ok else 0}

    def _blocks(self) -> List[int]:
        out = [(self.slot + i) % BLOCKS for i in range(PER_EXCHANGE)]
        self.slot = (self.slot + PER_EXCHANGE) % BLOCKS
        return out


def fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def run_s(control: str, port: int, liveness_budget: Optional[int], step_s: float,
          conn: Any) -> None:
    """The node that stays up: answers the parent's commands, polling its
    tier about every millisecond, or every ``step_s`` (an engine whose
    steps take that long polls its tier once per step)."""
    try:
        node = Node(control, port, liveness_budget)
        conn.send(("up", node.addr))
        pulls: Dict[str, tuple] = {}
        while True:
            node.poll()
            for kvid, (job, ctx, blocks, t0) in list(pulls.items()):
                out = node.finish(job, ctx, blocks, kvid)
                if out is None and time.monotonic() - t0 > EXCHANGE_TIMEOUT_S:
                    out = {"ok": False, "wrong_blocks": 0, "timeout": True}
                if out is not None:
                    del pulls[kvid]
                    conn.send(("pulled", kvid, out, time.monotonic() - t0))
            if not conn.poll(step_s or 0.001):
                continue
            cmd = conn.recv()
            if cmd[0] == "store":
                node.store(cmd[1])
                conn.send(("stored",))
            elif cmd[0] == "pull":
                job, ctx, blocks = node.pull(cmd[1], cmd[2])
                pulls[cmd[1]] = (job, ctx, blocks, time.monotonic())
            elif cmd[0] == "fds":
                conn.send(("fds", fds(), len(node.tier._sessions)))
            elif cmd[0] == "quit":
                node.tier.shutdown()
                conn.send(("bye",))
                return
    except BaseException:
        conn.send(("crash", traceback.format_exc()))
        raise


def run_r(control: str, port: int, liveness_budget: Optional[int], s_addr: str, gen: int,
          conn: Any) -> None:
    """One incarnation of the restarted node: pulls ``s<gen>`` from S,
    serves ``r<gen>`` to S, then waits to be killed or told to exit."""
    try:
        node = Node(control, port, liveness_budget)
        t0 = time.monotonic()
        node.store(f"r{gen}")
        job, ctx, blocks = node.pull(f"s{gen}", s_addr)
        out = None
        while out is None and time.monotonic() - t0 < EXCHANGE_TIMEOUT_S:
            node.poll()
            out = node.finish(job, ctx, blocks, f"s{gen}")
            time.sleep(0.001)
        if out is None:
            out = {"ok": False, "wrong_blocks": 0, "timeout": True}
        # Nothing but what this process asked for may have landed.
        asked = set(blocks)
        out["foreign_blocks"] = sum(1 for b in range(BLOCKS)
                                    if b not in asked and b >= PER_EXCHANGE and node.buf[b].any())
        conn.send(("exchanged", out, time.monotonic() - t0))
        while True:
            node.poll()
            if conn.poll(0.001):
                if conn.recv()[0] == "exit":
                    node.tier.shutdown()
                    conn.send(("bye",))
                    return
    except BaseException:
        conn.send(("crash", traceback.format_exc()))
        raise


def expect(conn: Any, kind: str, timeout: float) -> tuple:
    if not conn.poll(timeout):
        raise RuntimeError(f"no {kind!r} within {timeout} s")
    msg = conn.recv()
    if msg[0] == "crash":
        raise RuntimeError(f"a node crashed:\n{msg[1]}")
    if msg[0] != kind:
        raise RuntimeError(f"expected {kind!r}, got {msg!r}")
    return msg


def churn(control: str, restarts: int, liveness_budget: Optional[int] = None,
          step_ms: float = 0.0, log: Any = sys.stderr) -> dict:
    """``liveness_budget``: kvlane's (missed pings before a silent peer is
    dead), for both nodes; a large one shows whether anything waits for it
    to find a killed process dead. ``step_ms``: S polls its tier once per
    that many milliseconds (an engine step), so a restarted R's first
    message and its previous process's death reach S in the same poll."""
    ctx = mp.get_context("fork")
    s_port, r_port = free_port(), free_port()
    r_addr = f"127.0.0.1:{r_port}"
    s_conn, s_child = ctx.Pipe()
    s_proc = ctx.Process(target=run_s, args=(control, s_port, liveness_budget, step_ms / 1000, s_child), daemon=True)
    s_proc.start()
    s_addr = expect(s_conn, "up", 60)[1]
    report: Dict[str, Any] = {"control": control, "step_ms": step_ms, "restarts": 0,
                              "failed_exchanges": 0,
                              "first_exchange_s": [], "stale_blocks": 0, "foreign_blocks": 0,
                              "s_crashed": False, "timeouts": 0}
    r_proc = None
    try:
        for gen in range(restarts + 1):
            s_conn.send(("store", f"s{gen}"))
            expect(s_conn, "stored", 30)
            r_conn, r_child = ctx.Pipe()
            r_proc = ctx.Process(target=run_r, args=(control, r_port, liveness_budget, s_addr, gen, r_child),
                                 daemon=True)
            r_proc.start()
            _, out, took = expect(r_conn, "exchanged", EXCHANGE_TIMEOUT_S + 30)
            if gen > 0:
                report["restarts"] += 1
                report["first_exchange_s"].append(round(took, 4))
            report["stale_blocks"] += out["wrong_blocks"]
            report["foreign_blocks"] += out["foreign_blocks"]
            report["timeouts"] += bool(out.get("timeout"))
            if not out["ok"]:
                report["failed_exchanges"] += 1
            s_conn.send(("pull", f"r{gen}", r_addr))
            _, kvid, sout, stook = expect(s_conn, "pulled", EXCHANGE_TIMEOUT_S + 30)
            report["stale_blocks"] += sout["wrong_blocks"]
            report["timeouts"] += bool(sout.get("timeout"))
            if not sout["ok"]:
                report["failed_exchanges"] += 1
            print(f"churn[{control}] gen {gen}: R pulled in {took:.3f} s ok={out['ok']}, "
                  f"S pulled in {stook:.3f} s ok={sout['ok']}", file=log, flush=True)
            if gen == 0:
                s_conn.send(("fds",))
                _, report["s_fds_warm"], _ = expect(s_conn, "fds", 30)
            # Restart R: SIGKILL on even generations, a clean shutdown on odd
            # and for the last.
            if gen % 2 == 0 and gen < restarts:
                os.kill(r_proc.pid, signal.SIGKILL)
            else:
                r_conn.send(("exit",))
                expect(r_conn, "bye", 30)
            r_proc.join(30)
            r_conn.close()
            r_proc = None
        # Let S find the last R gone and close what it used (a few
        # seconds), then count.
        start = time.monotonic()
        while True:
            time.sleep(0.5)
            s_conn.send(("fds",))
            _, report["s_fds_end"], report["s_sessions_end"] = expect(s_conn, "fds", 30)
            waited = time.monotonic() - start
            if (report["s_sessions_end"] == 0 and waited > 3) or waited > 20:
                break
        s_conn.send(("quit",))
        expect(s_conn, "bye", 30)
    except RuntimeError as e:
        report["error"] = str(e)
        report["s_crashed"] = "crashed" in str(e) or not s_proc.is_alive()
    finally:
        if r_proc is not None and r_proc.is_alive():
            r_proc.kill()
        s_proc.join(10)
        if s_proc.is_alive():
            s_proc.kill()
    firsts = report["first_exchange_s"]
    report["first_exchange_max_s"] = max(firsts) if firsts else None
    report["first_exchange_median_s"] = float(np.median(firsts)) if firsts else None
    return report


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--control", choices=("kvlane", "zmq"), default="kvlane")
    ap.add_argument("--restarts", type=int, default=50)
    ap.add_argument("--liveness-budget", type=int, default=None,
                    help="kvlane's missed pings before a silent peer is dead (default: kvlane's)")
    ap.add_argument("--step-ms", type=float, default=0.0,
                    help="the stable node polls its tier once per this many ms (default: ~1)")
    a = ap.parse_args()
    report = churn(a.control, a.restarts, a.liveness_budget, a.step_ms)
    print("CHURN " + json.dumps(report), flush=True)


if __name__ == "__main__":
    main()
