"""Tensor parallel on every visible device (gpu_check.sh's tp stage; skipped with one device): greedy tokens of a
tiny fp32 Qwen3-Next at tp = the device count (and 2) against one device, and decode tokens/s of the bench model
(scripts/bench.py's qwen3-next-12l, bf16) at batch 8 with tp against one device, side by side. Prints one JSON
object.

    python scripts/tp_check.py [--new 32] [--batch 8]
Runs on CPU too (JAX_NUM_CPU_DEVICES=4 JAX_PLATFORMS=cpu python scripts/tp_check.py: a dry run).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(__file__))


def tiny_checkpoint(root: str, n: int) -> str:
    from atlas_jax.default_model import TINY_RANDOM_CONFIG, write_random_checkpoint
    path = os.path.join(root, "tiny")
    write_random_checkpoint(path, {**TINY_RANDOM_CONFIG, "vocab_size": 512 * n, "eos_token_id": 0,
                                   "num_attention_heads": 4 * n, "head_dim": 16, "linear_num_key_heads": 2 * n,
                                   "linear_num_value_heads": 4 * n, "linear_key_head_dim": 16,
                                   "linear_value_head_dim": 16, "num_experts": 4 * n})
    return path


def decode_tok_s(llm, batch: int, new: int) -> float:
    from atlas_jax import SamplingParams
    prompts = [[3 + i, 7, 11, 13] for i in range(batch)]
    llm.generate(prompts, SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))          # warm
    t0 = time.perf_counter()
    llm.generate(prompts, SamplingParams(max_tokens=new, temperature=0.0, ignore_eos=True))
    return batch * new / (time.perf_counter() - t0)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--new", type=int, default=32)
    ap.add_argument("--batch", type=int, default=8)
    a = ap.parse_args()
    import jax
    n = jax.device_count()
    if n < 2:
        print(json.dumps({"skipped": f"{n} device"}))
        return
    from atlas_jax import LLM, SamplingParams
    from bench import checkpoint_path
    kw = dict(kernels="auto", max_num_seqs=a.batch, max_model_len=256, progress=False, warmup=False)
    out = {"devices": n, "platform": jax.default_backend(), "tokens_equal": {}, "decode_tok_s": {}}
    greedy = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    prompts = [[1, 2, 3, 4, 5], [9, 8, 7]]
    with tempfile.TemporaryDirectory() as root:
        tiny = tiny_checkpoint(root, n)
        with jax.default_matmul_precision("highest"):
            ref = None
            for tp in sorted({1, 2, n}):
                llm = LLM(tiny, tensor_parallel_size=tp, dtype="float32", **kw)
                got = [o.outputs[0].token_ids for o in llm.generate(prompts, greedy)]
                ref = ref or got
                out["tokens_equal"][str(tp)] = got == ref
                del llm
    bench = checkpoint_path(None, "qwen3-next-12l")
    for tp in (1, n):
        try:
            llm = LLM(bench, tensor_parallel_size=tp, dtype="bfloat16", **kw)
            out["decode_tok_s"][str(tp)] = decode_tok_s(llm, a.batch, a.new)
            del llm
        except ValueError as e:                 # e.g. a head count the device count does not divide
            out["decode_tok_s"][str(tp)] = f"refused: {e}"
    rates = out["decode_tok_s"]
    if all(isinstance(v, float) for v in rates.values()):
        out["tp_over_one"] = rates[str(n)] / rates["1"]
    print(json.dumps(out))


if __name__ == "__main__":
    main()
