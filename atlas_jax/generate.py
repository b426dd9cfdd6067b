"""`python -m atlas_jax.generate --prompt "def add(a, b):"`: complete a prompt and print it."""
from __future__ import annotations

import argparse
import time

from . import LLM, SamplingParams
from .engine.args import EngineArgs


SAMPLING_FLAGS = ("seed",)          # this CLI's --seed seeds sampling, not the engine


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__)
    EngineArgs.add_cli_args(ap, skip=SAMPLING_FLAGS)
    ap.add_argument("--prompt", action="append", help="prompt text; repeat for a batch")
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--top-k", type=int, default=0)
    ap.add_argument("--top-p", type=float, default=1.0)
    ap.add_argument("--seed", type=int, default=None, help="sampling seed")
    return ap.parse_args(argv)


def main(argv=None) -> None:
    args = parse_args(argv)
    prompts = args.prompt or ["def add(a, b):"]
    try:
        engine_args = EngineArgs.from_cli(args, skip=SAMPLING_FLAGS)
    except ValueError as e:
        raise SystemExit(str(e)) from None
    llm = LLM.from_engine_args(engine_args, warmup=False)      # one-shot: compile what is used
    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_k=args.top_k,
                            top_p=args.top_p, seed=args.seed)
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params)
    dt = time.perf_counter() - t0
    for out in outs:
        c = out.outputs[0]
        print(f"--- prompt: {out.prompt!r}\n{out.prompt}{c.text}\n--- {len(c.token_ids)} tokens, finish_reason={c.finish_reason}")
    print(f"--- {sum(len(o.outputs[0].token_ids) for o in outs)} tokens in {dt:.2f}s (incl. compilation; "
          f"{llm.num_compiles} compiled steps)")
    if engine_args.speculative:
        print(f"--- speculative: {llm.spec_stats()}")


if __name__ == "__main__":
    main()
