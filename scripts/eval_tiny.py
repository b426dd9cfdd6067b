"""What the model card of a trained atlas-tiny reports, measured through the engine. Prints one JSON object.

    python scripts/eval_tiny.py [CKPT] [--prompts 16] [--prompt-len 128] [--new 64]

- greedy completions of three prompts (`def fibonacci(n):`, `class Stack:`, `import os\\n`);
- MTP draft acceptance on held-out standard-library code at num_drafts 1, 2, 3 (`llm.spec_stats()`:
  overall, by draft position, tokens per target step), and whether the greedy outputs equal plain decoding's.
Decode tokens/s with and without MTP side by side: scripts/bench.py --code-prompts --speculative mtp.
"""
import argparse
import json
import sys

from bench import code_prompts

from atlas_jax import LLM, SamplingParams

COMPLETION_PROMPTS = ["def fibonacci(n):", "class Stack:", "import os\n"]


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("ckpt", nargs="?")
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--new", type=int, default=64)
    ap.add_argument("--drafts", default="1,2,3")
    args = ap.parse_args()
    engine = dict(dtype="float32", max_num_seqs=args.prompts, max_model_len=args.prompt_len + args.new + 8,
                  max_prefill_chunk=args.prompt_len, progress=False, warmup=False)   # compiles only what runs
    plain = LLM(args.ckpt, **engine)
    greedy = SamplingParams(max_tokens=args.new, temperature=0.0)
    result = {"checkpoint": plain.model_path,
              "completions": {p: o.outputs[0].text for p, o in zip(COMPLETION_PROMPTS,
                                                                   plain.generate(COMPLETION_PROMPTS, greedy))}}
    prompts = code_prompts(plain.tokenizer, args.prompt_len, args.prompts)
    fixed = SamplingParams(max_tokens=args.new, temperature=0.0, ignore_eos=True)
    reference = [o.outputs[0].token_ids for o in plain.generate(prompts, fixed)]
    result["mtp"] = {}
    for k in (int(d) for d in args.drafts.split(",")):
        spec = LLM(args.ckpt, speculative={"method": "mtp", "num_drafts": k}, **engine)
        outs = [o.outputs[0].token_ids for o in spec.generate(prompts, fixed)]
        stats = spec.spec_stats()
        result["mtp"][k] = {"acceptance_rate": round(stats["acceptance_rate"], 4),
                            "acceptance_by_position": stats["acceptance_by_position"],
                            "mean_accepted_length": round(stats["mean_accepted_length"], 3),
                            "tokens_per_target_step": round(stats["tokens_per_target_step"], 3),
                            "outputs_identical": outs == reference}
        print(json.dumps(result), file=sys.stderr, flush=True)          # partial results survive a time limit
        del spec
    print(json.dumps(result))


if __name__ == "__main__":
    main()
