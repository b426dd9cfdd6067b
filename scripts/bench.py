"""Decode / prefill throughput of atlas_jax on one checkpoint. Prints one JSON object.

    python scripts/bench.py CKPT [--batch 1,8,32] [--prompt 128] [--new 64] [--dtype auto] [--vs-hf]
    python scripts/bench.py ... --speculative ngram [--num-drafts 2]   # + speculative decoding side by side
    python scripts/bench.py --make qwen3-next-12l | nemotron-h-12l [...]   # writes a random 12-layer, hidden-1024,
                                                          # 16-expert Qwen3-Next first (under /tmp)
    python scripts/bench.py --code-prompts --speculative mtp --batch 1,8 --b1-prompts 8 --rounds 3 --new 128
                                                          # the shipped atlas-tiny on real code (issue 14)
    python scripts/bench.py --make qwen3-next-12l --batch 8 --lora 16   # + decode with 0, 1, 4 LoRA adapters
    python scripts/bench.py --make qwen3-next-12l --batch 1,8,32,64 --prefill-prompts 512,2048 --vs-hf
                                                          # + prefill rows at longer prompts (batch 1)
With no checkpoint it measures the shipped default model. Prompts are random token ids, or with
--code-prompts windows of the standard library's held-out files (a trained model's drafts only get
accepted on text like its training data).
Reports tokens/s per batch size, the weight bytes one decode step must read (dense weights +
the top-k experts' share), the achieved GB/s, the device's memory bandwidth measured in the same
run for scale (CPU: a jitted sum over 512 MB, on XLA's own thread pool like the engine, median
of 5 rounds; GPU: a device-to-device copy of 2 GB, read + write bytes), and the compile count
after warm-up (the engine compiles every bucket up front; serving must add none). Each
measurement is the best of two runs (of 2 x --rounds: the batch sweep repeated, interleaved).
Decode is timed directly: our engine's steps once every row of the batch has its first token, HF's
forwards from its first token's logits to its last's (not total minus prefill time: at batch 32 that is a
small difference of two noisy numbers).
With --vs-hf, HF transformers (torch, CPU) runs the same prompts on the same checkpoint in the
same process, and the JSON carries the ratios atlas_jax / HF.
"""
import argparse
import json
import os
import sys
import time

import jax
import numpy as np

from atlas_jax import LLM, SamplingParams
from atlas_jax.default_model import TINY_RANDOM_CONFIG

# The tiny random model's architecture, scaled up: 12 layers (9 GDN + 3 attention), hidden 1024, 16 experts.
QWEN3_NEXT_12L = {
    **TINY_RANDOM_CONFIG, "vocab_size": 32000, "hidden_size": 1024, "intermediate_size": 2816, "num_hidden_layers": 12,
    "num_attention_heads": 8, "head_dim": 128, "linear_num_key_heads": 8,
    "linear_num_value_heads": 16, "linear_key_head_dim": 64, "linear_value_head_dim": 64, "num_experts": 16,
    "num_experts_per_tok": 4, "moe_intermediate_size": 512, "shared_expert_intermediate_size": 512,
    "num_nextn_predict_layers": 0, "eos_token_id": 0,
}
# Nemotron-H-shaped at the same width: 12 (mixer, MoE) block pairs, the mixers 9 Mamba2 + 3 attention
NEMOTRON_H_12L = {
    "model_type": "nemotron_h", "vocab_size": 32000, "hidden_size": 1024, "hybrid_override_pattern": "MEMEME*E" * 3,
    "num_attention_heads": 8, "num_key_value_heads": 2, "head_dim": 128, "mamba_num_heads": 32, "mamba_head_dim": 64,
    "ssm_state_size": 128, "n_groups": 8, "conv_kernel": 4, "chunk_size": 128, "n_routed_experts": 16,
    "num_experts_per_tok": 4, "moe_intermediate_size": 512, "moe_shared_expert_intermediate_size": 512,
    "n_group": 1, "topk_group": 1, "routed_scaling_factor": 1.0, "layer_norm_epsilon": 1e-5, "eos_token_id": 0,
    "max_position_embeddings": 4096,
}
MAKE = {"qwen3-next-12l": QWEN3_NEXT_12L, "nemotron-h-12l": NEMOTRON_H_12L}


def checkpoint_path(ckpt: str | None, make: str | None) -> str | None:
    """The checkpoint to measure: `ckpt`, or with `make` a random one of that MAKE config (written once
    under /tmp); None = the shipped default model."""
    if not make:
        return ckpt
    from atlas_jax.default_model import write_random_checkpoint
    path = f"/tmp/atlas_jax_bench_{make}"
    if not os.path.exists(os.path.join(path, "model.safetensors")):
        write_random_checkpoint(path, MAKE[make])
    return path


def memory_bandwidth_gbs(rounds: int = 5) -> list[float]:
    """Read bandwidth on CPU (jitted reduction), read + write bandwidth of a copy elsewhere: one figure per
    round (the median is the roofline; a shared VM's rounds differ by up to 2x)."""
    import jax.numpy as jnp
    cpu = jax.default_backend() == "cpu"
    x = jnp.ones(((512 if cpu else 2048) * 2**20 // 4,), jnp.float32)
    fn = jax.jit(jnp.sum) if cpu else jax.jit(lambda a: a * 1.0001)
    jax.block_until_ready(fn(x))
    iters = 3 if cpu else 20
    out = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        jax.block_until_ready([fn(x) for _ in range(iters)])
        out.append(round((1 if cpu else 2) * x.nbytes * iters / (time.perf_counter() - t0) / 1e9, 2))
    return out


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
    ap.add_argument("--make", choices=sorted(MAKE))
    ap.add_argument("--batch", default="1,8")
    ap.add_argument("--prompt", type=int, default=128)
    ap.add_argument("--new", type=int, default=64)
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--rounds", type=int, default=1, help="repeat the batch sweep (atlas_jax and HF) this many times, "
                    "interleaved, and keep each batch's best: a phase of a shared machine then cannot favour one "
                    "batch size of a ratio")
    ap.add_argument("--vs-hf", action="store_true", help="also measure HF transformers (torch CPU) side by side")
    ap.add_argument("--speculative", default=None, help="also measure speculative decoding with this drafter "
                    "(ngram, self, mtp; or oracle: drafts copied from the plain run's greedy output, every draft "
                    "accepted, the ceiling of the verify machinery) side by side: tokens/s, acceptance, and "
                    "whether greedy outputs are identical")
    ap.add_argument("--num-drafts", type=int, default=2)
    ap.add_argument("--token-map", default="auto", help="mtp: the head's draft vocabulary (a JSON list of token "
                    "ids; auto: the checkpoint's draft_token_map.json if any; none: the whole vocabulary)")
    ap.add_argument("--code-prompts", action="store_true", help="prompts cut from the standard library's "
                    "held-out files (scripts/train_tiny.py's split) instead of random token ids")
    ap.add_argument("--b1-prompts", type=int, default=1, help="batch 1 runs this many prompts one after another "
                    "(a trained model's acceptance varies by prompt: one prompt is a poor sample)")
    ap.add_argument("--async-ab", action="store_true", help="also decode with async scheduling on and off side by "
                    "side: tokens/s and host / device-wait ms per decode step")
    ap.add_argument("--kernels", default="auto", help="auto (Pallas on GPU), xla, pallas")
    ap.add_argument("--prefill-prompts", default="", metavar="N,N", help="also measure prefill alone at these "
                    "prompt lengths (batch 1, chunks of up to 512 tokens, one engine of its own; HF beside it with "
                    "--vs-hf)")
    ap.add_argument("--lora", type=int, default=0, metavar="RANK", help="also measure an engine serving LoRA "
                    "(4 slots of this rank, random adapters on every adaptable projection): decode tokens/s with "
                    "0, 1 and 4 distinct adapters in the batch, beside the engine without LoRA")
    args = ap.parse_args()
    ckpt = checkpoint_path(args.ckpt, args.make)
    batches = [int(b) for b in args.batch.split(",")]
    t0 = time.perf_counter()
    engine = dict(dtype=args.dtype, max_num_seqs=max(batches), max_model_len=args.prompt + args.new + 16,
                  max_prefill_chunk=min(args.prompt, 512), preemption_mode="recompute", progress=False,
                  kernels=args.kernels)
    llm = LLM(ckpt, **engine)
    load_s = time.perf_counter() - t0
    rng = np.random.default_rng(0)
    step_bytes = decode_bytes(llm)
    probes = memory_bandwidth_gbs()
    bandwidth = float(np.median(probes))
    result = {"checkpoint": ckpt, "dtype": str(llm.dtype), "backend": jax.default_backend(),
              "kernels": llm.kernels.name, "jax": jax.__version__,
              "prompt": args.prompt, "new": args.new, "rounds": args.rounds, "load_and_warmup_s": round(load_s, 2),
              "warmup_compiles": llm.num_warmup_compiles,
              "weight_bytes_per_decode_step": step_bytes, "memory_gbs": round(bandwidth, 2),
              "memory_gbs_rounds": probes, "batches": {}}
    hf = _load_hf(ckpt, llm.dtype) if args.vs_hf else None
    truth = {}                                   # oracle drafts: prompt -> the plain run's greedy output

    def oracle(seq, k):
        out = truth[tuple(seq.prompt_ids)]
        return out[len(seq.output_ids):len(seq.output_ids) + k]
    method = {"method": "scripted", "propose": oracle} if args.speculative == "oracle" else {"method": args.speculative}
    if args.speculative == "mtp":
        method["token_map"] = None if args.token_map == "none" else args.token_map
    spec = LLM(ckpt, speculative={**method, "num_drafts": args.num_drafts}, **engine) if args.speculative else None
    lora = LLM(ckpt, enable_lora=True, max_loras=4, max_lora_rank=args.lora, **engine) if args.lora else None
    adapters = random_adapters(lora, args.lora, 4) if lora else None
    count = {b: args.b1_prompts if b == 1 else b for b in batches}     # prompts per round, `b` at a time
    code = code_prompts(llm.tokenizer, args.prompt, max(count.values())) if args.code_prompts else None
    prompts_of = {b: code[:n] if code else [[int(t) for t in rng.integers(1, llm.cfg.vocab_size, args.prompt)]
                                            for _ in range(n)] for b, n in count.items()}
    full = SamplingParams(max_tokens=args.new, temperature=0.0, ignore_eos=True)
    first = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    steps = args.new - 1
    # per batch: best t_prefill, best t_decode (t_total - t_prefill of one round), compiles, HF rates
    best = {b: (float("inf"), float("inf"), 0, 0.0, 0.0) for b in batches}
    # per batch: _spec_throughput's record over the rounds (same = None until the outputs are compared)
    spec_best = {b: {"t": float("inf"), "rounds": [], "drafted": 0, "accepted": 0, "compiles": 0, "same": None}
                 for b in batches}
    for rnd in range(args.rounds):
        for b in batches:
            prompts, (t_prefill, t_decode, compiles, hf_prefill, hf_decode) = prompts_of[b], best[b]
            before = llm.num_compiles
            round_prefill = min(_timed(lambda: generate(llm, prompts, first, b)) for _ in range(2))
            round_total = min(_timed(lambda: generate(llm, prompts, full, b)) for _ in range(2))
            round_decode = min(decode_seconds_per_token(llm, prompts, full, b) for _ in range(2))
            t_prefill, t_decode = min(t_prefill, round_prefill), min(t_decode, round_decode * len(prompts) * steps)
            compiles += llm.num_compiles - before
            row = result["batches"].setdefault(b, {})
            row.update({
                "prefill_tokens_per_s": round(len(prompts) * args.prompt / t_prefill, 1),
                "decode_tokens_per_s": round(len(prompts) * steps / t_decode, 1),
                "decode_step_ms": round(1e3 * t_decode / (steps * len(prompts) / b), 3),
                "decode_achieved_gbs": round(step_bytes * steps * len(prompts) / b / t_decode / 1e9, 2),
                "compiles_after_warmup": compiles,
            })
            if rnd == 0 and args.async_ab:
                row["scheduling"] = _sync_vs_async(llm, prompts, full, b)
                if spec is not None:
                    row["spec_scheduling"] = _sync_vs_async(spec, prompts, full, b)
            if spec is not None:
                if rnd == 0:
                    truth.update({tuple(p): o.outputs[0].token_ids
                                  for p, o in zip(prompts, generate(llm, prompts, full, b))})
                row.update(_spec_throughput(spec, prompts, b, full, first, steps, round_total - round_prefill,
                                            spec_best[b], row["decode_tokens_per_s"],
                                            [truth[tuple(p)] for p in prompts]))
            if rnd == 0 and lora is not None:
                row.update(_lora_throughput(lora, adapters, prompts[:b], full, first, steps, row["decode_tokens_per_s"]))
            if hf is not None:
                hf_rates = _hf_throughput(hf, prompts[:b], args.new)
                hf_prefill, hf_decode = max(hf_prefill, hf_rates[0]), max(hf_decode, hf_rates[1])
                row.update(hf_prefill_tokens_per_s=round(hf_prefill, 1), hf_decode_tokens_per_s=round(hf_decode, 1),
                           prefill_vs_hf=round(row["prefill_tokens_per_s"] / hf_prefill, 2),
                           decode_vs_hf=round(row["decode_tokens_per_s"] / hf_decode, 2))
            best[b] = (t_prefill, t_decode, compiles, hf_prefill, hf_decode)
            print(json.dumps(result), file=sys.stderr, flush=True)     # partial results survive a time limit
    lengths = [int(n) for n in args.prefill_prompts.split(",") if n]
    if lengths:
        result["prefill"] = _prefill_rows(ckpt, {**engine, "max_num_seqs": 1}, lengths, hf, rng)
    if 1 in result["batches"]:
        b1 = result["batches"][1]
        result["roofline_fraction_b1"] = round(b1["decode_achieved_gbs"] / result["memory_gbs"], 3)
        result["roofline_decode_step_ms_b1"] = round(1e3 * step_bytes / (bandwidth * 1e9), 2)
        top = max(batches)
        if top != 1:
            result[f"decode_b{top}_over_b1"] = round(result["batches"][top]["decode_tokens_per_s"]
                                                     / b1["decode_tokens_per_s"], 2)
    print(json.dumps(result))


def _prefill_rows(ckpt, engine: dict, lengths: list[int], hf, rng) -> dict:
    """Prefill tokens/s at batch 1 for each prompt length (one engine sized for the longest), HF beside it."""
    llm = LLM(ckpt, **{**engine, "max_model_len": max(lengths) + 16, "max_prefill_chunk": min(max(lengths), 512)})
    first = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    rows = {}
    for n in lengths:
        prompt = [[int(t) for t in rng.integers(1, llm.cfg.vocab_size, n)]]
        compiles = llm.num_compiles
        t = min(_timed(lambda: llm.generate(prompt, first)) for _ in range(2))
        row = rows[n] = {"prefill_tokens_per_s": round(n / t, 1), "compiles_after_warmup": llm.num_compiles - compiles}
        if hf is not None:
            hf_rate, _ = _hf_throughput(hf, prompt, 2)
            row.update(hf_prefill_tokens_per_s=round(hf_rate, 1), prefill_vs_hf=round(n / t / hf_rate, 2))
    return rows


def code_prompts(tokenizer, length: int, count: int) -> list[list[int]]:
    """`count` prompts of `length` tokens: the openings of held-out standard-library files long enough."""
    from train_tiny import corpus_splits
    _, held = corpus_splits()
    prompts = [ids[:length] for ids in (tokenizer.encode(t) for t in held) if len(ids) >= length]
    if len(prompts) < count:
        raise SystemExit(f"only {len(prompts)} held-out files have {length} tokens")
    return prompts[:count]


def generate(llm, prompts, params, batch: int) -> list:
    """llm.generate over `prompts`, `batch` at a time."""
    return [o for i in range(0, len(prompts), batch) for o in llm.generate(prompts[i:i + batch], params)]


def decode_seconds_per_token(llm, prompts, params, batch: int, timings: dict | None = None) -> float:
    """llm.generate's loop over `prompts`, `batch` at a time, timing only the steps that run once every row of the
    batch has its first token (nothing left to prefill: pure decode steps). Returns their seconds per token
    emitted. Total minus prefill-only time would make decode a small difference of two noisy numbers at large
    batches (at batch 32 the prompts' prefill is ~3x the decode time). timings: filled with those steps'
    count, seconds in EngineCore.step and seconds of it blocked on the device (the rest is host work)."""
    seconds, tokens, core = 0.0, 0, llm.engine
    steps, step_s, wait_s = 0, 0.0, 0.0
    for i in range(0, len(prompts), batch):
        seqs = [s for p in prompts[i:i + batch] for s in core.add_request(p, params).seqs]
        while core.has_unfinished():
            before = sum(len(s.output_ids) for s in seqs)
            decoding = all(s.output_ids for s in seqs)
            s0, w0 = core.step_seconds, core.runner.wait_seconds
            t0 = time.perf_counter()
            core.step()
            if decoding:
                seconds += time.perf_counter() - t0
                tokens += sum(len(s.output_ids) for s in seqs) - before
                steps, step_s, wait_s = steps + 1, step_s + core.step_seconds - s0, wait_s + core.runner.wait_seconds - w0
    if timings is not None:
        timings.update(steps=steps, step_s=step_s, wait_s=wait_s)
    return seconds / tokens


def _sync_vs_async(llm, prompts, params, batch: int) -> dict:
    """Decode with async scheduling on and off, interleaved (best of 2 each): tokens/s, and per decode step the
    host's own time and the time blocked on the device (async: the host prepares step t+1 while step t runs).
    An engine whose ngram drafts are made on the device also runs the host's NgramProposer, synchronous (what
    it does with the prefix cache): host_sync, and device_async_vs_host_sync."""
    from atlas_jax.engine.speculative import NgramProposer
    core, out = llm.engine, {}
    modes = [("async", True, core.proposer), ("sync", False, core.proposer)]
    if core.config.ngram_on_device:
        spec = core.config.speculative
        modes.append(("host_sync", False, NgramProposer(spec.ngram_min, spec.ngram_max)))
    device_proposer = core.proposer
    for rep in range(2):
        for key, on, proposer in modes:
            core.async_scheduling, core.proposer, t = on, proposer, {}
            rate = 1 / decode_seconds_per_token(llm, prompts, params, batch, t)
            if rate > out.get(key, {}).get("decode_tokens_per_s", 0):
                out[key] = {"decode_tokens_per_s": round(rate, 1),
                            "step_ms": round(1e3 * t["step_s"] / t["steps"], 3),
                            "host_ms_per_step": round(1e3 * (t["step_s"] - t["wait_s"]) / t["steps"], 3),
                            "device_wait_ms_per_step": round(1e3 * t["wait_s"] / t["steps"], 3)}
    core.async_scheduling, core.proposer = True, device_proposer
    out["async_vs_sync"] = round(out["async"]["decode_tokens_per_s"] / out["sync"]["decode_tokens_per_s"], 3)
    if "host_sync" in out:
        out["device_async_vs_host_sync"] = round(out["async"]["decode_tokens_per_s"]
                                                 / out["host_sync"]["decode_tokens_per_s"], 3)
    return out


def _spec_throughput(spec, prompts, batch: int, full, first, steps, t_plain: float, best: dict, plain_rate: float,
                     plain_out: list) -> dict:
    """Decode tokens/s with speculation, measured right after the plain engine's round on the same prompts
    (t_plain: that round's plain decode time; plain_out: the plain greedy outputs). Over rounds it keeps the
    best spec decode time (its rate over plain_rate, the best plain rate, is spec_vs_plain_decode) and each
    round's own ratio (a phase of a shared machine hits both sides of one round alike)."""
    compiles = spec.num_compiles
    before = spec.engine.spec_stats.summary()
    t_prefill = min(_timed(lambda: generate(spec, prompts, first, batch)) for _ in range(2))
    t_total = min(_timed(lambda: generate(spec, prompts, full, batch)) for _ in range(2))
    stats = spec.engine.spec_stats.summary()
    for key in ("drafted", "accepted"):
        best[key] += stats[key] - before[key]
    best["t"] = min(best["t"], t_total - t_prefill)
    best["rounds"].append(round(t_plain / (t_total - t_prefill), 3))
    if best["same"] is None:                     # greedy outputs are deterministic: compared once
        best["same"] = [o.outputs[0].token_ids for o in generate(spec, prompts, full, batch)] == plain_out
    best["compiles"] += spec.num_compiles - compiles
    rate = len(prompts) * steps / best["t"]
    return {"spec_decode_tokens_per_s": round(rate, 1),
            "spec_vs_plain_decode": round(rate / plain_rate, 2),
            "spec_vs_plain_decode_rounds": best["rounds"],
            "spec_acceptance_rate": round(best["accepted"] / best["drafted"], 3) if best["drafted"] else None,
            "spec_tokens_per_target_step": round(stats["tokens_per_target_step"] or 0, 3),
            "spec_outputs_identical": best["same"], "spec_compiles_after_warmup": best["compiles"]}


def random_adapters(llm, rank: int, count: int) -> list:
    """`count` random PEFT adapters (every adaptable projection, rank `rank`) written under /tmp."""
    from safetensors.numpy import save_file

    from atlas_jax import LoRARequest
    from atlas_jax.layers.lora import param_at
    from atlas_jax.weights.lora import adaptable
    rng, out = np.random.default_rng(1), []
    for i in range(count):
        path = f"/tmp/atlas_jax_bench_lora_{i}"
        os.makedirs(path, exist_ok=True)
        tensors = {}
        for module, key in adaptable(llm.cfg).items():
            d_in, d_out = param_at(llm.params, key).shape
            tensors[f"base_model.model.{module}.lora_A.weight"] = rng.standard_normal((rank, d_in), np.float32) * 0.01
            tensors[f"base_model.model.{module}.lora_B.weight"] = rng.standard_normal((d_out, rank), np.float32) * 0.01
        save_file(tensors, os.path.join(path, "adapter_model.safetensors"))
        with open(os.path.join(path, "adapter_config.json"), "w") as f:
            json.dump({"peft_type": "LORA", "r": rank, "lora_alpha": rank, "target_modules": "all-linear"}, f)
        out.append(LoRARequest(f"bench-{i}", i + 1, path))
    return out


def _lora_throughput(lora, adapters, prompts, full, first, steps, plain_rate) -> dict:
    """Decode tokens/s of the LoRA engine with 0, 1 and 4 distinct adapters over the batch's rows."""
    compiles, row = lora.num_compiles, {}
    for k in (0, 1, 4):
        reqs = [adapters[i % k] if k else None for i in range(len(prompts))]
        t_prefill = min(_timed(lambda: lora.generate(prompts, first, lora_request=reqs)) for _ in range(2))
        t_total = min(_timed(lambda: lora.generate(prompts, full, lora_request=reqs)) for _ in range(2))
        rate = len(prompts) * steps / (t_total - t_prefill)
        row[f"lora_{k}_adapters_decode_tokens_per_s"] = round(rate, 1)
        row[f"lora_{k}_adapters_vs_no_lora_engine"] = round(rate / plain_rate, 3)
    row["lora_compiles_after_warmup"] = lora.num_compiles - compiles
    return row


def _load_hf(ckpt: str, dtype):
    import torch
    from transformers import AutoModelForCausalLM
    torch.set_num_threads(os.cpu_count())
    model = AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32 if str(dtype) == "float32" else torch.bfloat16)
    return model.eval()


def _hf_throughput(model, prompts, new: int) -> tuple[float, float]:
    """HF transformers on the same prompts: (prefill tokens/s, decode tokens/s), best of two."""
    import torch
    ids = torch.tensor(prompts)
    mask = torch.ones_like(ids)

    def gen(n):
        with torch.no_grad():
            model.generate(ids, attention_mask=mask, max_new_tokens=n, min_new_tokens=n, do_sample=False)
    gen(2)                                                    # warm-up
    t_prefill = min(_timed(lambda: gen(1)) for _ in range(2))
    t_decode = min(_hf_decode_seconds(model, ids, mask, new) for _ in range(2)) if new > 1 else float("inf")
    return ids.numel() / t_prefill, len(prompts) * (new - 1) / t_decode


def _hf_decode_seconds(model, ids, mask, new: int) -> float:
    """Seconds of HF generate's new - 1 decode forwards: from the first token's logits (after the prefill) to the
    last's, stamped by a logits processor (called once per forward, after it)."""
    import torch
    from transformers import LogitsProcessor, LogitsProcessorList
    stamps = []

    class Stamp(LogitsProcessor):
        def __call__(self, input_ids, scores):
            stamps.append(time.perf_counter())
            return scores
    with torch.no_grad():
        model.generate(ids, attention_mask=mask, max_new_tokens=new, min_new_tokens=new, do_sample=False,
                       logits_processor=LogitsProcessorList([Stamp()]))
    return stamps[-1] - stamps[0]


if __name__ == "__main__":
    main()
