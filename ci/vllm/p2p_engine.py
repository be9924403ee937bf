"""One vLLM engine (CPU build) with the OffloadingConnector and kvlane's P2P
tier, in this one process, driven over a pipe: for ci/vllm/p2p_engines.py.

    python p2p_engine.py --model DIR --engine-id ID --tier-port N [--pump-ms 10]

The engine is vLLM's offline `LLM` with multiprocessing off
(`VLLM_ENABLE_V1_MULTIPROCESSING=0`): engine core, scheduler, worker and
the tier all run in this process and step only when this script steps
them. vLLM's P2P tier keeps an engine stepping for as long as it lives
(`has_pending_work()` is always true; in vLLM's own processes an idle
engine's core and worker spin a core each), so here, between requests,
the engine is stepped once per `--pump-ms` (its tier polls then: it
answers a peer's lookups and writes the blocks a peer fetches). The
OffloadingConnector's spec is `kvlane.vllm.CpuTieringOffloadingSpec`
(vLLM 0.32's own worker refuses the CPU platform), its one secondary tier
`kvlane.vllm.KvlaneP2PTier` on `127.0.0.1:<tier port>`.

It prints `{"ready": ..., "tier": "host:port", "block_size": N}` once
built, then answers one JSON line per request line; vLLM's own output goes
to stderr. Requests:

    {"id": 1, "op": "generate", "prompts": [[...], ...], "max_tokens": 8,
     "salt": "x" or null, "kv": [kv_transfer_params or null, ...]}
      -> {"id": 1, "secs": s, "settle_secs": s,
          "outputs": [{"tokens": [...], "finish": "length"}, ...]}
    {"id": 2, "op": "stats"}
      -> {"id": 2, "loaded": {...}, "written": {...}}   (the tier's counts)

After a generate the engine is stepped until the connector has no store
job left (its blocks are in its CPU tier, where a peer's lookup finds
them) before the answer is sent.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import queue
import sys
import threading
import time
from typing import Any, Dict, List, Optional

# The protocol owns the real stdout; vLLM's own prints go to stderr.
_proto = os.fdopen(os.dup(1), "w", buffering=1)
os.dup2(2, 1)
sys.stdout = sys.stderr

#: Seconds a generate's stores may take to finish before the engine gives up.
SETTLE_TIMEOUT_S = 60.0


def say(obj: Dict[str, Any]) -> None:
    _proto.write(json.dumps(obj) + "\n")
    _proto.flush()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--engine-id", required=True,
                    help="vLLM's engine id (names the tier's /dev/shm region)")
    ap.add_argument("--tier-port", type=int, required=True)
    ap.add_argument("--pump-ms", type=float, default=10.0,
                    help="step the idle engine once per this many ms (its tier polls then)")
    ap.add_argument("--kv-bytes", type=int, default=256 << 20)
    ap.add_argument("--cpu-bytes", type=int, default=256 << 20,
                    help="the CPU tier's size (cpu_bytes_to_use)")
    a = ap.parse_args()

    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    from vllm import LLM, SamplingParams
    from vllm.config import KVTransferConfig

    from kvlane.vllm import KvlaneP2PTier

    t0 = time.monotonic()
    kv_cfg = KVTransferConfig(
        kv_connector="OffloadingConnector",
        kv_role="kv_both",
        engine_id=a.engine_id,
        kv_connector_extra_config={
            "spec_name": "CpuTieringOffloadingSpec",
            "spec_module_path": "kvlane.vllm",
            "cpu_bytes_to_use": a.cpu_bytes,
            "secondary_tiers": [{
                "type": "KvlaneP2PTier", "module_path": "kvlane.vllm",
                "host": "127.0.0.1", "port": a.tier_port,
            }],
        },
    )
    llm = LLM(
        model=a.model,
        skip_tokenizer_init=True,
        enforce_eager=True,
        kv_cache_memory_bytes=a.kv_bytes,
        enable_prefix_caching=True,
        max_model_len=4096,
        kv_transfer_config=kv_cfg,
        seed=0,
    )
    engine = llm.llm_engine
    offloading = engine.engine_core.engine_core.scheduler.connector.connector_scheduler
    tiers = [t for t in offloading.manager.secondary_tiers if isinstance(t, KvlaneP2PTier)]
    if len(tiers) != 1:
        raise SystemExit(f"p2p_engine.py: expected one KvlaneP2PTier, found "
                         f"{offloading.manager.secondary_tiers}")
    tier = tiers[0]
    say({"ready": True, "pid": os.getpid(), "secs": round(time.monotonic() - t0, 2),
         "tier": tier.kvlane_agent.engine_id,
         "block_size": engine.vllm_config.cache_config.block_size})

    def settle() -> float:
        """Steps the engine until the connector has no job in flight."""
        t = time.monotonic()
        while offloading._jobs:
            if time.monotonic() - t > SETTLE_TIMEOUT_S:
                raise SystemExit(f"p2p_engine.py: {len(offloading._jobs)} offloading jobs "
                                 f"still in flight {SETTLE_TIMEOUT_S:.0f} s after a generate")
            engine.step()
            time.sleep(0.001)
        return time.monotonic() - t

    lines: "queue.Queue[Optional[str]]" = queue.Queue()

    def read() -> None:
        for line in sys.stdin:
            lines.put(line)
        lines.put(None)

    threading.Thread(target=read, daemon=True).start()
    pump_s = a.pump_ms / 1000
    while True:
        try:
            line = lines.get(timeout=pump_s)
        except queue.Empty:
            engine.step()
            continue
        if line is None:
            break
        if not line.strip():
            continue
        req = json.loads(line)
        if req["op"] == "stats":
            say({"id": req["id"], "loaded": dataclasses.asdict(tier.loaded),
                 "written": dataclasses.asdict(tier.written)})
            continue
        prompts: List[List[int]] = req["prompts"]
        kvs = req.get("kv") or [None] * len(prompts)
        params = [
            SamplingParams(temperature=0.0, max_tokens=req.get("max_tokens", 8), ignore_eos=True,
                           extra_args={"kv_transfer_params": kv} if kv else None)
            for kv in kvs
        ]
        inputs: List[Dict[str, Any]] = []
        for p in prompts:
            inputs.append({"prompt_token_ids": p, **({"cache_salt": req["salt"]}
                                                     if req.get("salt") else {})})
        t = time.monotonic()
        outs = llm.generate(inputs, params, use_tqdm=False)
        secs = time.monotonic() - t
        say({"id": req["id"], "secs": secs, "settle_secs": settle(),
             "outputs": [{"tokens": list(o.outputs[0].token_ids),
                          "finish": o.outputs[0].finish_reason} for o in outs]})
    llm.llm_engine.engine_core.shutdown()


if __name__ == "__main__":
    main()
