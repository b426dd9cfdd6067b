"""Prefix caching on multi-turn chat: cache on vs off on one compiled engine, in the same run. Prints one JSON object.

    python scripts/bench_prefix.py --make qwen3-next-12l [--conversations 8] [--turns 6]
                                   [--speculative none,mtp,ngram]

Workload: `conversations` chats share a `system`-token system prompt; each turn sends the whole
history (the last prompt + its answer + a new `user`-token message) for every conversation at once,
and the model answers `new` tokens (greedy). Per mode (no speculation, or a drafter) and per cache
setting: token hit rate, mean and p95 time to first token on turns 2+ (arrival to first token,
queueing included), total time; outputs with caching on must equal those with it off.
`--make qwen3-next-12l` writes the bench model of scripts/bench.py (with an MTP head, random weights:
drafts are rarely accepted, so speculation shows its cost here, not its gain).
"""
import argparse
import json
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(__file__))
from bench import QWEN3_NEXT_12L  # noqa: E402

from atlas_jax import LLM, SamplingParams  # noqa: E402


def run_chats(llm, args, seed: int) -> dict:
    rng = np.random.default_rng(seed)
    vocab = llm.cfg.vocab_size
    ints = lambda n: [int(t) for t in rng.integers(1, vocab, n)]
    system = ints(args.system)
    prompts = [system + ints(args.user) for _ in range(args.conversations)]
    params = SamplingParams(temperature=0.0, max_tokens=args.new, ignore_eos=True)
    before = llm.prefix_cache_stats()
    ttft, outputs, t0 = [], [], time.perf_counter()
    for turn in range(args.turns):
        outs = llm.generate(prompts, params)
        outputs += [o.outputs[0].token_ids for o in outs]
        if turn:
            ttft += [o.metrics.time_to_first_token for o in outs]
        prompts = [p + o.outputs[0].token_ids + ints(args.user) for p, o in zip(prompts, outs)]
    total = time.perf_counter() - t0
    after = llm.prefix_cache_stats()
    query = after["query_tokens"] - before["query_tokens"]
    hits = after["hit_tokens"] - before["hit_tokens"]
    return {"total_s": round(total, 2), "ttft_turn2plus_mean_s": round(float(np.mean(ttft)), 4),
            "ttft_turn2plus_p95_s": round(float(np.percentile(ttft, 95)), 4),
            "hit_rate_tokens": round(hits / query, 4) if query else 0.0, "hit_tokens": hits,
            "evicted_pages": after["evicted_pages"] - before["evicted_pages"],
            "snapshots_taken": after["snapshots_taken"] - before["snapshots_taken"], "outputs": outputs}


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("ckpt", nargs="?")
    ap.add_argument("--make", choices=["qwen3-next-12l"])
    ap.add_argument("--conversations", type=int, default=8)
    ap.add_argument("--turns", type=int, default=6)
    ap.add_argument("--system", type=int, default=256, help="system prompt tokens (shared)")
    ap.add_argument("--user", type=int, default=32, help="tokens per user message")
    ap.add_argument("--new", type=int, default=32, help="tokens per answer")
    ap.add_argument("--speculative", default="none", help="comma list of none, mtp, ngram, self")
    ap.add_argument("--num-drafts", type=int, default=2)
    ap.add_argument("--dtype", default="auto")
    args = ap.parse_args()
    ckpt = args.ckpt
    if args.make:
        from atlas_jax.default_model import write_random_checkpoint
        ckpt = f"/tmp/atlas_jax_bench_{args.make}_mtp"
        if not os.path.exists(os.path.join(ckpt, "model.safetensors")):
            write_random_checkpoint(ckpt, {**QWEN3_NEXT_12L, "num_nextn_predict_layers": 1})
    max_len = args.system + args.turns * (args.user + args.new) + 8
    result = {"checkpoint": ckpt, "conversations": args.conversations, "turns": args.turns, "system": args.system,
              "user": args.user, "new": args.new, "modes": {}}
    for mode in args.speculative.split(","):
        spec = None if mode == "none" else {"method": mode, "num_drafts": args.num_drafts}
        t0 = time.perf_counter()
        llm = LLM(ckpt, dtype=args.dtype, max_num_seqs=args.conversations, max_model_len=max_len,
                  max_prefill_chunk=512, max_num_batched_tokens=1024, enable_prefix_caching=True, speculative=spec,
                  progress=False, warmup=False)
        for on in (True, False):                  # warm-up pass: compiles the shapes this workload uses
            llm.engine.set_prefix_caching(on)
            run_chats(llm, args, seed=1)
        row = {"load_and_warmup_s": round(time.perf_counter() - t0, 1)}
        compiles = llm.num_compiles
        for on in (True, False):
            llm.engine.set_prefix_caching(on)
            row["on" if on else "off"] = run_chats(llm, args, seed=1)
        on, off = row["on"], row["off"]
        row["outputs_identical"] = on.pop("outputs") == off.pop("outputs")
        row["ttft_speedup_mean"] = round(off["ttft_turn2plus_mean_s"] / on["ttft_turn2plus_mean_s"], 2)
        row["ttft_speedup_p95"] = round(off["ttft_turn2plus_p95_s"] / on["ttft_turn2plus_p95_s"], 2)
        row["total_speedup"] = round(off["total_s"] / on["total_s"], 2)
        row["compiles_after_warmup"] = llm.num_compiles - compiles
        if spec:
            row["spec"] = llm.spec_stats()
        result["modes"][mode] = row
        print(json.dumps({mode: row}), file=sys.stderr, flush=True)      # partial results as they come
        del llm
    print(json.dumps(result))


if __name__ == "__main__":
    main()
