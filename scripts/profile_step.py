"""Where a decode step's time goes: device time of the compiled step executables vs the engine's host work.
Prints one JSON object.

    python scripts/profile_step.py [CKPT] [--batch 1,8] [--num-drafts 1] [--iters 50] [--trace DIR]

For each batch size it times, on the same engine and inputs: the compiled decode step [B, 1] and verify
step [B, 1 + num_drafts] alone (inputs prepared once, `block_until_ready` each call: device time + the
executable's own call path), the host-side preparation of a step's inputs (segments, sampling columns,
MTP inputs), and a whole plain / MTP decode through `LLM.generate` per engine step. The gap between a
whole step and its executable is host work (scheduler, runner input building, output handling).
--trace DIR writes a jax profiler trace (TensorBoard / Perfetto) of a few steps of each executable.
"""
import argparse
import json
import time

import jax
import numpy as np

from atlas_jax import LLM, SamplingParams
from atlas_jax.engine.buckets import bucket
from atlas_jax.engine.row import RowInput


def best_ms(fn, iters: int) -> float:
    fn()
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return round(1e3 * float(np.median(times)), 3)


def step_inputs(runner, b: int, k: int, draft: bool, start: int = 64):
    """The arguments of a decode (k == 1) or verify step for b rows at position `start` (host arrays).
    Rows as a real batch has them: distinct tokens (so the MoE routes them to different experts) and
    pages of their own where the pool has room (else shared, as in a pool too small for b rows)."""
    per_row = runner.max_pages_per_seq
    own = (runner.num_pages - 1) // per_row >= b
    vocab = runner.cfg.vocab_size
    rows = [RowInput(tokens=[(7 + 7919 * i + 104729 * j) % vocab for j in range(k)], start=start,
                     block_table=list(range(1 + (i * per_row if own else 0), 1 + (i * per_row if own else 0) + per_row)),
                     slot=i, prompt_len=start, draft_ok=draft)
            for i in range(b)]
    segments, sampling, prompt_lens, mtp_in = runner.batch.pack((rows,), ((bucket(b), k),), rows)
    args = (segments, sampling, prompt_lens)
    if k > 1:
        args += (np.full((bucket(b), k), 7, np.int32), np.full((bucket(b),), k - 1, np.int32))   # drafts, room
    return ("verify" if k > 1 else "step"), args + (mtp_in,), rows


def time_executable(runner, kind, args, iters):
    exe = runner.exes.get(kind, args)

    def call():
        out, runner.state = exe(runner.params, runner.state, *args)
        jax.block_until_ready(out)
    return best_ms(call, iters)


def generate_ms_per_step(llm, prompts, new: int) -> float:
    full = SamplingParams(max_tokens=new, temperature=0.0, ignore_eos=True)
    first = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    counts = llm.runner.step_counts

    def run(p):
        before = dict(counts)
        t0 = time.perf_counter()
        llm.generate(prompts, p)
        return time.perf_counter() - t0, sum(counts.values()) - sum(before.values())
    run(full)
    t_full, n_full = min(run(full) for _ in range(2))
    t_first, n_first = min(run(first) for _ in range(2))
    return round(1e3 * (t_full - t_first) / max(1, n_full - n_first), 3), n_full - n_first


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("ckpt", nargs="?", default=None)
    ap.add_argument("--batch", default="1,8")
    ap.add_argument("--num-drafts", type=int, default=1)
    ap.add_argument("--iters", type=int, default=50)
    ap.add_argument("--new", type=int, default=64)
    ap.add_argument("--trace", default=None)
    args = ap.parse_args()
    batches = [int(b) for b in args.batch.split(",")]
    engine = dict(max_num_seqs=max(batches), max_model_len=256, progress=False)
    plain = LLM(args.ckpt, **engine)
    spec = LLM(args.ckpt, speculative={"method": "mtp", "num_drafts": args.num_drafts}, **engine)
    k = 1 + args.num_drafts
    result = {"checkpoint": plain.model_path, "num_drafts": args.num_drafts, "batches": {}}
    rng = np.random.default_rng(0)
    for b in batches:
        row = result["batches"][b] = {}
        kind, dargs, rows = step_inputs(plain.runner, b, 1, False)
        row["plain_decode_exe_ms"] = time_executable(plain.runner, kind, dargs, args.iters)
        kind, sargs, _ = step_inputs(spec.runner, b, 1, True)
        row["mtp_decode_exe_ms"] = time_executable(spec.runner, kind, sargs, args.iters)
        kind, vargs, _ = step_inputs(spec.runner, b, k, True)
        row["mtp_verify_exe_ms"] = time_executable(spec.runner, kind, vargs, args.iters)
        r = spec.runner
        row["host_inputs_ms"] = best_ms(lambda: step_inputs(r, b, k, True), args.iters)
        prompts = [[int(t) for t in rng.integers(1, plain.cfg.vocab_size, 64)] for _ in range(b)]
        row["plain_generate_ms_per_step"], _ = generate_ms_per_step(plain, prompts, args.new)
        row["mtp_generate_ms_per_step"], row["mtp_steps"] = generate_ms_per_step(spec, prompts, args.new)
        if args.trace:
            with jax.profiler.trace(f"{args.trace}/b{b}"):
                for _ in range(5):
                    time_executable(plain.runner, "step", dargs, 1)
                    time_executable(spec.runner, "verify", vargs, 1)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
