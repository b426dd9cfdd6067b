"""Decode / prefill throughput of atlas_jax on one checkpoint. Prints one JSON object.

    python scripts/bench.py CKPT [--batch 1,8] [--prompt 128] [--new 64] [--dtype auto]
    python scripts/bench.py --make qwen3-next-12l [...]   # writes a random 12-layer, hidden-1024,
                                                          # 16-expert Qwen3-Next first (under /tmp)
Reports tokens/s, the weight bytes one decode step must read (dense weights + the top-k
experts' share), the achieved GB/s, and the machine's memory read bandwidth measured in the
same run (numpy sum over 256 MB) for scale. Compile time is excluded: each shape is run
once to warm up before it is timed.
"""
import argparse
import json
import os
import time

import jax
import numpy as np

from atlas_jax import LLM, SamplingParams
from atlas_jax.default_model import DEFAULT_CONFIG

# The default model's architecture, scaled up: 12 layers (9 GDN + 3 attention), hidden 1024, 16 experts.
QWEN3_NEXT_12L = {
    **DEFAULT_CONFIG, "vocab_size": 32000, "hidden_size": 1024, "intermediate_size": 2816, "num_hidden_layers": 12,
    "num_attention_heads": 8, "head_dim": 128, "linear_num_key_heads": 8,
    "linear_num_value_heads": 16, "linear_key_head_dim": 64, "linear_value_head_dim": 64, "num_experts": 16,
    "num_experts_per_tok": 4, "moe_intermediate_size": 512, "shared_expert_intermediate_size": 512,
    "num_nextn_predict_layers": 0, "eos_token_id": 0,
}


def memory_bandwidth_gbs() -> float:
    a = np.ones(256 * 2**20 // 8)
    a.sum()
    best = min(_timed(a.sum) for _ in range(5))
    return a.nbytes / best / 1e9


def _timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def decode_bytes(llm) -> int:
    """Weight bytes one decode step reads: everything except unused experts and the embedding
    table (one row is gathered)."""
    cfg, total = llm.cfg, 0
    for path, leaf in jax.tree_util.tree_leaves_with_path(llm.params):
        keys = [getattr(k, "key", getattr(k, "idx", None)) for k in path]
        if keys[0] == "mtp" or keys[0] == "embed":
            continue
        total += leaf.nbytes * (cfg.num_experts_per_tok / cfg.num_experts if "experts" in keys else 1)
    return int(total)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("ckpt", nargs="?")
    ap.add_argument("--make", choices=["qwen3-next-12l"])
    ap.add_argument("--batch", default="1,8")
    ap.add_argument("--prompt", type=int, default=128)
    ap.add_argument("--new", type=int, default=64)
    ap.add_argument("--dtype", default="auto")
    args = ap.parse_args()
    ckpt = args.ckpt
    if args.make:
        from atlas_jax.default_model import write_random_checkpoint
        ckpt = f"/tmp/atlas_jax_bench_{args.make}"
        if not os.path.exists(os.path.join(ckpt, "model.safetensors")):
            write_random_checkpoint(ckpt, QWEN3_NEXT_12L)
    batches = [int(b) for b in args.batch.split(",")]
    t0 = time.perf_counter()
    llm = LLM(ckpt, dtype=args.dtype, max_num_seqs=max(batches), max_model_len=args.prompt + args.new + 16,
              max_prefill_chunk=args.prompt)
    load_s = time.perf_counter() - t0
    rng = np.random.default_rng(0)
    step_bytes = decode_bytes(llm)
    result = {"checkpoint": ckpt, "dtype": str(llm.dtype), "backend": jax.default_backend(),
              "prompt": args.prompt, "new": args.new, "load_s": round(load_s, 2),
              "weight_bytes_per_decode_step": step_bytes, "memory_read_gbs": round(memory_bandwidth_gbs(), 2),
              "batches": {}}
    for b in batches:
        prompts = [[int(t) for t in rng.integers(1, llm.cfg.vocab_size, args.prompt)] for _ in range(b)]
        full = SamplingParams(max_tokens=args.new, temperature=0.0, ignore_eos=True)
        first = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
        llm.generate(prompts, full)                       # warm-up: compiles every shape used below
        compiles = llm.num_compiles
        t_prefill = min(_timed(lambda: llm.generate(prompts, first)) for _ in range(2))
        t_total = min(_timed(lambda: llm.generate(prompts, full)) for _ in range(2))
        t_decode = t_total - t_prefill
        steps = args.new - 1
        result["batches"][b] = {
            "prefill_tokens_per_s": round(b * args.prompt / t_prefill, 1),
            "decode_tokens_per_s": round(b * steps / t_decode, 1),
            "decode_step_ms": round(1e3 * t_decode / steps, 3),
            "decode_achieved_gbs": round(step_bytes * steps / t_decode / 1e9, 2),
            "compiles_after_warmup": llm.num_compiles - compiles,
        }
    result["roofline_fraction_b1"] = (round(result["batches"][1]["decode_achieved_gbs"] / result["memory_read_gbs"], 3)
                                      if 1 in result["batches"] else None)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
