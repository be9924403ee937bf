"""Writes a tiny Llama (hidden 256, 4 layers, 4 heads, vocab 1024, bf16) with
seeded random weights as safetensors, for the engine tests.

vLLM's `load_format="dummy"` is no good for P/D tests: at this scale its
output depends on the last prompt token only, so a garbage KV cache would
still give the "right" tokens. With random weights of this scale, changing
the first prompt token changes the output, which is what proves that the KV
cache came over the wire. `--seed` picks other weights.

`--prefix-seed M` makes one of a crossed pair (ci/vllm/p2p_engines.py): the
embeddings of tokens below PREFIX_VOCAB are drawn from seed M, everything
else from `--seed`, and those tokens are never generated (their lm_head rows
are zero). Two such models with different M give different KV for a prompt
of those tokens, and the same computation for every token of PREFIX_VOCAB
and above: a prompt whose prefix is of the first kind and whose rest is of
the second gives, over the prefix's KV of one model, the other model's
tokens only if that KV was not computed locally.

Usage: python make_model.py DIR [--seed N] [--prefix-seed M]
"""

import argparse
import json
import os

import torch
from safetensors.torch import save_file

HIDDEN, INTER, LAYERS, HEADS, VOCAB, CTX = 256, 512, 4, 4, 1024, 4096
#: Tokens below this are the prefix alphabet of `--prefix-seed` models.
PREFIX_VOCAB = 512


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("dir")
    ap.add_argument("--seed", type=int, default=1234)
    ap.add_argument("--prefix-seed", type=int,
                    help="embeddings of tokens below PREFIX_VOCAB from this seed, and those "
                         "tokens never generated (one of a crossed pair)")
    a = ap.parse_args()
    os.makedirs(a.dir, exist_ok=True)
    cfg = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": HIDDEN,
        "intermediate_size": INTER,
        "num_hidden_layers": LAYERS,
        "num_attention_heads": HEADS,
        "num_key_value_heads": HEADS,
        "vocab_size": VOCAB,
        "max_position_embeddings": CTX,
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "hidden_act": "silu",
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
        "bos_token_id": 1,
        "eos_token_id": 2,
    }
    with open(os.path.join(a.dir, "config.json"), "w") as f:
        json.dump(cfg, f, indent=1)
    g = torch.Generator().manual_seed(a.seed)

    def rnd(*shape: int, std: float = 0.08) -> torch.Tensor:
        return (torch.randn(*shape, generator=g) * std).to(torch.bfloat16)

    t = {
        "model.embed_tokens.weight": rnd(VOCAB, HIDDEN, std=1.0),
        "model.norm.weight": torch.ones(HIDDEN, dtype=torch.bfloat16),
        "lm_head.weight": rnd(VOCAB, HIDDEN),
    }
    if a.prefix_seed is not None:
        gp = torch.Generator().manual_seed(a.prefix_seed)
        emb = t["model.embed_tokens.weight"]
        emb[:PREFIX_VOCAB] = (torch.randn(PREFIX_VOCAB, HIDDEN, generator=gp)).to(torch.bfloat16)
        t["lm_head.weight"][:PREFIX_VOCAB] = 0
    for i in range(LAYERS):
        p = f"model.layers.{i}."
        t[p + "input_layernorm.weight"] = torch.ones(HIDDEN, dtype=torch.bfloat16)
        t[p + "post_attention_layernorm.weight"] = torch.ones(HIDDEN, dtype=torch.bfloat16)
        for n in ("q_proj", "k_proj", "v_proj", "o_proj"):
            t[p + f"self_attn.{n}.weight"] = rnd(HIDDEN, HIDDEN)
        t[p + "mlp.gate_proj.weight"] = rnd(INTER, HIDDEN)
        t[p + "mlp.up_proj.weight"] = rnd(INTER, HIDDEN)
        t[p + "mlp.down_proj.weight"] = rnd(HIDDEN, INTER)
    save_file(t, os.path.join(a.dir, "model.safetensors"), metadata={"format": "pt"})
    with open(os.path.join(a.dir, "generation_config.json"), "w") as f:
        json.dump({"bos_token_id": 1, "eos_token_id": 2}, f)


if __name__ == "__main__":
    main()
