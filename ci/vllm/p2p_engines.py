"""Two vLLM engines (CPU build) pull each other's prefixes over vLLM's P2P
KV-offload tier on kvlane (`kvlane.vllm.KvlaneP2PTier`), proven by a
crossed check: the engine test behind `ci/vllm.sh p2p-engines`.

    python p2p_engines.py [--workdir DIR] [--tier-port N] [--break-pull]

Engines A and B are real vLLM engines (ci/vllm/p2p_engine.py: the offline
`LLM`, engine core, scheduler, worker and tier in one process each), with
the OffloadingConnector, `kvlane.vllm.CpuTieringOffloadingSpec` (vLLM 0.32's
own worker refuses the CPU platform), the tier as its one secondary tier,
prefix caching on, the same `PYTHONHASHSEED`, on cores of their own.

The crossed check: A and B load the same model path, but the file holds
other weights when B starts (ci/vllm/make_model.py `--prefix-seed`): the two
models differ only in the embeddings of tokens below PREFIX_VOCAB, which
neither ever generates. A prompt is a 512-token prefix of such tokens and
a suffix of other tokens. Every token the consumer computes itself (the
suffix, the generated ones) is computed alike by both models; only the
prefix's KV differs. So the consumer's tokens equal the producer's own for
the prompt only if the prefix's KV is the producer's, and had the consumer
computed the prefix itself, its tokens would be its own model's: the test
first checks, per prompt, that the two engines' own tokens differ (the
consumer's own computed with a `cache_salt`, so that nothing of it is
reused later).

Each direction (A's prefix pulled by B, then B's by A): the producer
answers the prompts (its blocks go to its CPU tier); the consumer answers
them salted (its own tokens, which must differ); the consumer answers the
first prompt naming the producer as `remote_kv_source` (the pull), then
the other prompts plainly (from the pulled prefix, now in its cache). All
must equal the producer's tokens, and the tiers' counts must show the
pull: the consumer's tier loaded PREFIX/block_size blocks from the
producer's address, the producer's tier wrote as many to the consumer's,
none failed.

`--break-pull` names a tier port where nobody listens as the source: the
consumer computes the prefix itself, and the test must fail.
"""

from __future__ import annotations

import argparse
import os
import random
import subprocess
import sys
import tempfile
import time
from typing import Any, Dict, List, Optional

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from make_model import PREFIX_VOCAB, VOCAB  # noqa: E402
from pd import Failed, PipeEngine, log, placement  # noqa: E402

PREFIX = 512
SUFFIX = 8
#: Prompts per direction: the first pulls the prefix, the others reuse it.
PROMPTS = 3
MAX_TOKENS = 8
#: Seconds one request may take (a pull that hangs fails vLLM's own 30 s
#: load timeout first).
REQUEST_TIMEOUT_S = 120
ENGINE_START_TIMEOUT_S = 180
#: Both engines' block hashes must agree (the tier's handshake checks it).
HASH_SEED = "0"


class P2PEngine(PipeEngine):
    """One p2p_engine.py process."""

    def __init__(self, name: str, model: str, tier_port: int, logdir: str,
                 env: Dict[str, str]) -> None:
        self.engine_id = f"kvlane-p2p-{name}-{os.getpid()}"
        args = [sys.executable, os.path.join(HERE, "p2p_engine.py"), "--model", model,
                "--engine-id", self.engine_id, "--tier-port", str(tier_port)]
        super().__init__(name, args, logdir, {"PYTHONHASHSEED": HASH_SEED, **env})
        self.tier = f"127.0.0.1:{tier_port}"

    def generate(self, prompts: List[List[int]], kv: Optional[List[Any]] = None,
                 salt: Optional[str] = None) -> List[dict]:
        rid = self.request({"op": "generate", "prompts": prompts, "kv": kv, "salt": salt,
                            "max_tokens": MAX_TOKENS})
        out = self.answer(rid, REQUEST_TIMEOUT_S)["outputs"]
        bad = [o for o in out if o["finish"] != "length"]
        if bad:
            raise Failed(f"{self.name}: requests ended {[o['finish'] for o in bad]}")
        return [o["tokens"] for o in out]

    def stats(self) -> dict:
        return self.answer(self.request({"op": "stats"}), REQUEST_TIMEOUT_S)

    def close(self) -> None:
        self.stop()
        # The tier's region is unlinked by the engine on a clean exit only.
        try:
            os.unlink(f"/dev/shm/vllm_offload_{self.engine_id}.mmap")
        except FileNotFoundError:
            pass


def make_models(workdir: str) -> Dict[str, str]:
    """The crossed pair, and the one path both engines load (`model`)."""
    paths = {}
    for name, seed in (("a", 1), ("b", 2)):
        d = os.path.join(workdir, f"model-{name}")
        if not os.path.exists(os.path.join(d, "model.safetensors")):
            subprocess.run([sys.executable, os.path.join(HERE, "make_model.py"), d,
                            "--prefix-seed", str(seed)], check=True)
        paths[name] = d
    live = os.path.join(workdir, "model")
    os.makedirs(live, exist_ok=True)
    for f in ("config.json", "generation_config.json"):
        with open(os.path.join(paths["a"], f), "rb") as src, \
                open(os.path.join(live, f), "wb") as dst:
            dst.write(src.read())
    paths["live"] = live
    return paths


def load_weights(paths: Dict[str, str], name: str) -> None:
    """Puts model `name`'s weights at the live path (an atomic rename: an
    engine that already loaded the previous file keeps what it read)."""
    live = os.path.join(paths["live"], "model.safetensors")
    tmp = live + ".new"
    if os.path.exists(tmp):
        os.unlink(tmp)
    os.link(os.path.join(paths[name], "model.safetensors"), tmp)
    os.replace(tmp, live)


def make_prompts(seed: int) -> List[List[int]]:
    """PROMPTS prompts sharing one PREFIX-token prefix of tokens below
    PREFIX_VOCAB, each with its own SUFFIX tokens from the rest."""
    rng = random.Random(seed)
    prefix = [rng.randrange(3, PREFIX_VOCAB) for _ in range(PREFIX)]
    return [prefix + [rng.randrange(PREFIX_VOCAB, VOCAB) for _ in range(SUFFIX)]
            for _ in range(PROMPTS)]


def direction(producer: P2PEngine, consumer: P2PEngine, prompts: List[List[int]],
              source_port: int, kv_request_id: str) -> Dict[str, Any]:
    """The producer's prefix pulled by the consumer; returns the figures."""
    what = f"{producer.name} -> {consumer.name}"
    before_loaded = consumer.stats()["loaded"]
    before_written = producer.stats()["written"]
    want = producer.generate(prompts)
    own = consumer.generate(prompts, salt=f"own-{kv_request_id}")
    for i, (w, o) in enumerate(zip(want, own)):
        if w == o:
            raise Failed(f"{what}: prompt {i}: both engines give {w} computing it themselves; "
                         "the crossed check could not tell a pull from a recompute")
    source = {"remote_kv_source": {"kv_request_id": kv_request_id,
                                   "remote_host": "127.0.0.1", "remote_port": source_port}}
    t = time.monotonic()
    pulled = consumer.generate(prompts[:1], kv=[source])
    pull_s = time.monotonic() - t
    reused = consumer.generate(prompts[1:])
    got = pulled + reused
    failures = []
    for i, (g, w, o) in enumerate(zip(got, want, own)):
        how = "pulled" if i == 0 else "reused after the pull"
        if g != w:
            failures.append(f"prompt {i} ({how}): {consumer.name} gave {g}, {producer.name}'s "
                            f"tokens are {w}" + (" (its own: a recompute)" if g == o else ""))
    loaded = consumer.stats()["loaded"]
    written = producer.stats()["written"]
    block_size = consumer.ready_line["block_size"]
    blocks = PREFIX // block_size
    n_loaded = (loaded["blocks_by_peer"].get(producer.tier, 0)
                - before_loaded["blocks_by_peer"].get(producer.tier, 0))
    n_written = (written["blocks_by_peer"].get(consumer.tier, 0)
                 - before_written["blocks_by_peer"].get(consumer.tier, 0))
    failed = (loaded["blocks_failed"] - before_loaded["blocks_failed"]
              + written["blocks_failed"] - before_written["blocks_failed"])
    if n_loaded != blocks or n_written != blocks or failed:
        failures.append(f"the tiers' counts: {consumer.name} loaded {n_loaded} blocks from "
                        f"{producer.tier}, {producer.name} wrote {n_written} to {consumer.tier}, "
                        f"{failed} failed; a pull of the {PREFIX}-token prefix is {blocks} "
                        f"blocks of {block_size} tokens")
    if failures:
        raise Failed(f"{what}: " + "; ".join(failures))
    r = {"direction": what, "prompts": len(prompts), "tokens_checked": sum(map(len, got)),
         "blocks_loaded": n_loaded, "blocks_written": n_written, "pull_request_s": round(pull_s, 3)}
    log(f"PASS {what}: {r}")
    return r


def run(a: argparse.Namespace) -> int:
    t0 = time.monotonic()
    workdir = a.workdir or tempfile.mkdtemp(prefix="kvlane-p2p-engines-")
    logdir = os.path.join(workdir, "logs")
    os.makedirs(logdir, exist_ok=True)
    paths = make_models(workdir)
    port_a, port_b = a.tier_port, a.tier_port + 1
    engines: List[P2PEngine] = []
    try:
        load_weights(paths, "a")
        ea = P2PEngine("A", paths["live"], port_a, logdir, placement("split", "prefill"))
        engines.append(ea)
        ea.ready(ENGINE_START_TIMEOUT_S)
        # B loads the same path once it holds the other weights.
        load_weights(paths, "b")
        eb = P2PEngine("B", paths["live"], port_b, logdir, placement("split", "decode"))
        engines.append(eb)
        eb.ready(ENGINE_START_TIMEOUT_S)
        started = time.monotonic() - t0
        # --break-pull: the consumer names a port where no tier listens.
        nobody = a.tier_port + 2
        results = [
            direction(ea, eb, make_prompts(1), nobody if a.break_pull else port_a, "a-to-b"),
            direction(eb, ea, make_prompts(2), nobody if a.break_pull else port_b, "b-to-a"),
        ]
    except Failed as e:
        log(f"FAIL {e}")
        log(f"logs in {logdir}")
        return 1
    finally:
        for e in engines:
            e.close()
    log(f"PASS both directions: {sum(r['tokens_checked'] for r in results)} tokens checked, "
        f"{sum(r['blocks_loaded'] for r in results)} blocks pulled; engines up in "
        f"{started:.1f} s, {time.monotonic() - t0:.1f} s in all (logs in {logdir})")
    return 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--workdir", help="models and logs (default: a new temporary folder)")
    ap.add_argument("--tier-port", type=int, default=25700,
                    help="A's tier listens here, B's on the next port")
    ap.add_argument("--break-pull", action="store_true",
                    help="name a port where nobody listens as the source (the test must fail)")
    return run(ap.parse_args())


if __name__ == "__main__":
    sys.exit(main())
