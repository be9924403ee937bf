"""One vLLM engine (CPU build) driven over a pipe, for ci/vllm.sh and
ci/vllm/pd.py.

    python engine.py --role single|prefill|decode --model DIR
                     [--connector none|kvlane|nixl|nixl-placed] [--side-port N]

It builds `vllm.LLM` (offline API, token-id prompts, greedy), prints
`{"ready": ...}`, then answers one JSON line per request line on its
stdout; everything vLLM itself prints goes to stderr. A request:

    {"id": 7, "prompts": [[1, 2, ...], ...], "max_tokens": 8,
     "kv": [kv_transfer_params or null, ...]}

and its answer:

    {"id": 7, "secs": 0.12, "outputs": [{"tokens": [...],
     "finish": "length", "kv": {...} or null}, ...]}

`PD_KV_EXTRA` (JSON) is the connector's `kv_connector_extra_config` and
`PD_ENGINE_ID` its engine id (default: a random one per start).

Roles: `single` (no connector), `prefill` (kv_producer: each request is
sent with `do_remote_decode` and its answer carries the
`kv_transfer_params` a decode engine needs) and `decode` (kv_consumer: the
request's `kv` entries are those params).
"""

import argparse
import json
import os
import sys
import time

# The protocol owns the real stdout; vLLM's own prints go to stderr.
_proto = os.fdopen(os.dup(1), "w", buffering=1)
os.dup2(2, 1)
sys.stdout = sys.stderr


def say(obj) -> None:
    _proto.write(json.dumps(obj) + "\n")
    _proto.flush()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--role", choices=["single", "prefill", "decode"], required=True)
    ap.add_argument("--model", required=True)
    ap.add_argument("--connector", choices=["none", "kvlane", "nixl", "nixl-placed", "null"],
                    default="none")
    ap.add_argument("--side-port", type=int, default=0)
    ap.add_argument("--kv-bytes", type=int, default=512 << 20)
    a = ap.parse_args()

    from vllm import LLM, SamplingParams
    from vllm.config import KVTransferConfig

    kv_cfg = None
    if a.role != "single":
        if a.side_port:
            os.environ["VLLM_NIXL_SIDE_CHANNEL_PORT"] = str(a.side_port)
        os.environ.setdefault("VLLM_NIXL_SIDE_CHANNEL_HOST", "127.0.0.1")
        role = "kv_producer" if a.role == "prefill" else "kv_consumer"
        common = dict(
            kv_role=role,
            kv_buffer_device="cpu",
            kv_connector_extra_config=json.loads(os.environ.get("PD_KV_EXTRA", "{}")),
        )
        if os.environ.get("PD_ENGINE_ID"):
            common["engine_id"] = os.environ["PD_ENGINE_ID"]
        if a.connector == "kvlane":
            kv_cfg = KVTransferConfig(
                kv_connector="KvlaneConnector", kv_connector_module_path="kvlane.vllm", **common
            )
        elif a.connector == "nixl":
            kv_cfg = KVTransferConfig(kv_connector="NixlConnector", **common)
        elif a.connector == "nixl-placed":
            # ci/vllm/nixl_placed.py: NIXL on kvlane.vllm's thread placement.
            kv_cfg = KVTransferConfig(
                kv_connector="NixlPlacedConnector", kv_connector_module_path="nixl_placed",
                **common
            )
        elif a.connector == "null" and a.role == "prefill":
            # ci/vllm/null_connector.py: vLLM's connector machinery, no transport.
            kv_cfg = KVTransferConfig(
                kv_connector="NullConnector", kv_connector_module_path="null_connector",
                **common
            )
        else:
            raise SystemExit("engine.py: prefill/decode roles need --connector "
                             "kvlane|nixl|nixl-placed (or null, prefill only)")

    t0 = time.monotonic()
    llm = LLM(
        model=a.model,
        skip_tokenizer_init=True,
        enforce_eager=True,
        kv_cache_memory_bytes=a.kv_bytes,
        enable_prefix_caching=False,
        max_model_len=4096,
        max_num_batched_tokens=8192,
        kv_transfer_config=kv_cfg,
        seed=0,
    )
    say({"ready": True, "pid": os.getpid(), "secs": round(time.monotonic() - t0, 2)})

    for line in sys.stdin:
        if not line.strip():
            continue
        req = json.loads(line)
        prompts = req["prompts"]
        kvs = req.get("kv") or [None] * len(prompts)
        max_tokens = req.get("max_tokens", 8)
        params = []
        for kv in kvs:
            extra = None
            if a.role == "prefill":
                extra = {"kv_transfer_params": {"do_remote_decode": True}}
            elif a.role == "decode" and kv is not None:
                extra = {"kv_transfer_params": kv}
            params.append(
                SamplingParams(
                    temperature=0.0,
                    max_tokens=1 if a.role == "prefill" else max_tokens,
                    ignore_eos=True,
                    extra_args=extra,
                )
            )
        t = time.monotonic()
        outs = llm.generate(
            [{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False
        )
        secs = time.monotonic() - t
        say({
            "id": req.get("id"),
            "secs": secs,
            "outputs": [
                {
                    "tokens": list(o.outputs[0].token_ids),
                    "finish": o.outputs[0].finish_reason,
                    "kv": o.kv_transfer_params,
                }
                for o in outs
            ],
        })


if __name__ == "__main__":
    main()
