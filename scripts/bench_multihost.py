"""The cost of multi-host serving's step broadcast (parallel/multihost.py), on one machine: the same greedy
generation with tensor parallel 4 as two processes of 2 CPU devices each (gloo, rank 0 publishing every
device call through the coordination service) and as one process of 4 devices, side by side. Prints one JSON
object: per process layout the decode tokens/s and ms per step, and for two processes the publish ms per call.

    python scripts/bench_multihost.py [--tokens 64] [--batch 1] [--model CKPT]
(default model: a tiny random Qwen3-Next whose heads divide 4, written to a temporary directory)
"""
from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
import time

ENGINE = dict(kernels="xla", max_model_len=256, max_prefill_chunk=32, page_size=16, progress=False,
              compile_cache_dir="", tensor_parallel_size=4)


def tiny_model(root: str) -> str:
    from atlas_jax.default_model import TINY_RANDOM_CONFIG, write_random_checkpoint
    path = os.path.join(root, "qwen3_next")
    write_random_checkpoint(path, {**TINY_RANDOM_CONFIG, "vocab_size": 512, "eos_token_id": 0,
                                   "linear_num_key_heads": 4, "linear_num_value_heads": 8,
                                   "linear_key_head_dim": 16, "linear_value_head_dim": 16})
    return path


def run(args) -> None:
    """One process of a layout: rank 0 (or the single process) times the generation and prints JSON."""
    import jax
    jax.config.update("jax_num_cpu_devices", 4 // args.nnodes)
    from atlas_jax import LLM, SamplingParams
    dist = dict(nnodes=args.nnodes, node_rank=args.rank, dist_init_addr=args.addr) if args.nnodes > 1 else {}
    llm = LLM(args.model, max_num_seqs=args.batch, **ENGINE, **dist)
    if args.rank:
        llm.follow()
        return
    greedy = SamplingParams(max_tokens=args.tokens, temperature=0.0, ignore_eos=True)
    prompts = [[1 + i, 2, 3, 4] for i in range(args.batch)]
    llm.generate(prompts, SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))     # warm
    channel = llm.runner.channel
    calls0, send0 = (channel.calls, channel.send_seconds) if channel else (0, 0.0)
    steps0 = sum(llm.runner.step_counts.values())
    t0 = time.perf_counter()
    llm.generate(prompts, greedy)
    wall = time.perf_counter() - t0
    steps = sum(llm.runner.step_counts.values()) - steps0
    out = {"tok_s": args.batch * args.tokens / wall, "ms_per_step": wall / steps * 1e3, "steps": steps}
    if channel:
        out["publish_ms_per_call"] = (channel.send_seconds - send0) / max(channel.calls - calls0, 1) * 1e3
        out["calls_per_step"] = (channel.calls - calls0) / steps
    llm.close()
    print(json.dumps(out), flush=True)


def layout(model: str, nnodes: int, a) -> dict:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        addr = f"127.0.0.1:{s.getsockname()[1]}"
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    base = [sys.executable, __file__, "--model", model, "--tokens", str(a.tokens), "--batch", str(a.batch),
            "--nnodes", str(nnodes), "--addr", addr]
    procs = [subprocess.Popen(base + ["--rank", str(r)], env=env, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                              text=True) for r in range(nnodes)]
    outs = [p.communicate(timeout=900)[0] for p in procs]
    lines = [ln for ln in outs[0].splitlines() if ln.startswith("{")]
    if not lines or any(p.returncode for p in procs):
        raise SystemExit(f"layout nnodes={nnodes} failed: {[p.returncode for p in procs]}")
    return json.loads(lines[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--rounds", type=int, default=2, help="alternated runs of each layout")
    ap.add_argument("--nnodes", type=int, default=0, help=argparse.SUPPRESS)    # set in the spawned processes
    ap.add_argument("--rank", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--addr", default=None, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.nnodes:
        return run(a)
    with tempfile.TemporaryDirectory() as root:
        model = a.model or tiny_model(root)
        runs = {"one_process_4_devices": [], "two_processes_2_devices": []}
        for _ in range(a.rounds):
            runs["one_process_4_devices"].append(layout(model, 1, a))
            runs["two_processes_2_devices"].append(layout(model, 2, a))
    best = {k: max(v, key=lambda r: r["tok_s"]) for k, v in runs.items()}
    print(json.dumps({"batch": a.batch, "tokens": a.tokens, "runs": runs,
                      "two_over_one_tok_s": best["two_processes_2_devices"]["tok_s"] / best["one_process_4_devices"]["tok_s"]}))


if __name__ == "__main__":
    main()
