"""Recurrent-state rollback experiments on one checkpoint. Prints one JSON object.

    python scripts/rollback_experiments.py [CKPT] [--cycles 40] [--num-drafts 3] [--quick]

(a) drift: a sequence goes through many verify / rollback cycles (feed 1 + K-1 random drafts,
    keep a random accepted prefix, roll back the rest by choosing a state position). Its final
    recurrent state and next-token logits are compared with a fresh sequence prefilled with
    exactly the kept tokens (recompute from scratch), in float32 and bfloat16.
(b) verify cost vs K: milliseconds of one verify step of K tokens (K = 1 .. 1 + num_drafts) at
    batch 1 and batch 8, next to a plain decode step.
(c) acceptance: the distribution of accepted drafts per verify row, per drafter (ngram, self
    for hybrid models, mtp when the checkpoint has an MTP head), on greedy generations.
Default checkpoint: the embedded tiny Qwen3-Next (random weights: its acceptance numbers only
show the machinery works; run it on a trained checkpoint for real ones).
"""
import argparse
import json
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from atlas_jax import LLM, SamplingParams  # noqa: E402
from atlas_jax.engine.row import RowInput  # noqa: E402
from atlas_jax.research import StateLab  # noqa: E402

ENGINE = dict(page_size=16, max_num_seqs=8, max_model_len=1024, max_prefill_chunk=256, warmup=False, progress=False)


def drift(path, dtype, cycles, num_drafts, seed=0):
    llm = LLM(path, dtype=dtype, speculative={"method": "ngram", "num_drafts": num_drafts}, **ENGINE)
    lab = StateLab(llm)
    rng = np.random.default_rng(seed)
    vocab = llm.cfg.vocab_size
    seq, _ = lab.start([int(t) for t in rng.integers(0, vocab, 64)])
    for _ in range(cycles):
        feed = [int(t) for t in rng.integers(0, vocab, 1 + num_drafts)]
        lab.feed(seq, feed)
        lab.rollback(seq, int(rng.integers(0, num_drafts + 1)))    # keep 1 .. K tokens
    kept = seq.tokens[:seq.num_cached]
    probe = [int(rng.integers(0, vocab))]
    rolled_state, rolled_logits = lab.state(seq), lab.feed(seq, probe)
    fresh, _ = lab.start(kept)
    fresh_state, fresh_logits = lab.state(fresh), lab.feed(fresh, probe)
    h_diff = max(float(np.max(np.abs(a[0] - b[0]))) for a, b in zip(rolled_state, fresh_state)) if rolled_state else 0.0
    h_scale = max(float(np.max(np.abs(b[0]))) for b in fresh_state) if fresh_state else 0.0
    return {"cycles": cycles, "tokens_kept": len(kept), "max_abs_h_diff": h_diff, "max_abs_h": h_scale,
            "max_abs_logit_diff": float(np.max(np.abs(rolled_logits - fresh_logits))),
            "same_argmax": bool(np.argmax(rolled_logits) == np.argmax(fresh_logits))}


def verify_cost(path, num_drafts, iters):
    llm = LLM(path, dtype="auto", speculative={"method": "ngram", "num_drafts": num_drafts}, **ENGINE)
    runner, out = llm.runner, {}
    for b in (1, 8):
        pages = [llm.engine.blocks.allocate(4) for _ in range(b)]
        slots = llm.engine.slots.allocate(b)
        rows = [RowInput(tokens=[1], start=32, block_table=p, slot=s) for p, s in zip(pages, slots)]
        for k in range(1, num_drafts + 2):
            drafts = [[2] * (k - 1) for _ in rows]
            fn = (lambda: runner.step(rows)) if k == 1 else (lambda: runner.verify(rows, drafts))
            fn()                                                    # compile
            t0 = time.perf_counter()
            for _ in range(iters):
                fn()
            out[f"b{b}_k{k}_ms"] = round(1e3 * (time.perf_counter() - t0) / iters, 3)
        for p in pages:
            llm.engine.blocks.free(p)
        llm.engine.slots.free(slots)
    return out


def acceptance(path, num_drafts, new_tokens):
    llm = LLM(path, **ENGINE)
    methods = ["ngram"]
    if llm.cfg.recurrent_layers:
        methods.append("self")
    if llm.num_mtp_layers:
        methods.append("mtp")
    rng = np.random.default_rng(1)
    base = [int(t) for t in rng.integers(0, llm.cfg.vocab_size, 24)]
    prompts = [base * 3, base[:8] * 6, [int(t) for t in rng.integers(0, llm.cfg.vocab_size, 64)]]
    params = SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=True)
    ref = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    out = {}
    for m in methods:
        spec = LLM(path, speculative={"method": m, "num_drafts": num_drafts}, **ENGINE)
        same = [o.outputs[0].token_ids for o in spec.generate(prompts, params)] == ref
        out[m] = dict(spec.spec_stats(), outputs_identical=same)
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("ckpt", nargs="?")
    ap.add_argument("--cycles", type=int, default=40)
    ap.add_argument("--num-drafts", type=int, default=3)
    ap.add_argument("--quick", action="store_true", help="fewer cycles / iterations / tokens")
    args = ap.parse_args()
    if args.ckpt is None:
        from atlas_jax.default_model import default_model_path
        args.ckpt = default_model_path()
    cycles = 8 if args.quick else args.cycles
    result = {"checkpoint": args.ckpt, "num_drafts": args.num_drafts,
              "drift": {dt: drift(args.ckpt, dt, cycles, args.num_drafts) for dt in ("float32", "bfloat16")},
              "verify_cost": verify_cost(args.ckpt, args.num_drafts, 3 if args.quick else 20),
              "acceptance": acceptance(args.ckpt, args.num_drafts, 16 if args.quick else 48)}
    print(json.dumps(result, default=str))


if __name__ == "__main__":
    main()
