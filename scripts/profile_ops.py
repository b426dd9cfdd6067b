"""Where one compiled step's device time goes, op by op (XLA:CPU thunks). Prints one JSON object.

    python scripts/profile_ops.py [CKPT | --make qwen3-next-12l] [--batch 32] [--tokens 1] [--iters 20] [--top 25]

Builds an engine (no warm-up), compiles the step for `batch` rows of `tokens` new tokens each (decode: 1;
a prefill chunk: e.g. 128, compiled as the prefill-only step [batch, tokens]), runs it
under jax's profiler and sums the thunks' times: per top-level thunk, and per part of the model (the
HLO op_name of each thunk: `layer_i/...` folded into the layer's kind and the op). Times include the
profiler's own overhead (~1-2 us per thunk), so read them as shares, not as absolute speeds; `wall_ms`
is the same step timed without the profiler.
"""
import argparse
import collections
import glob
import gzip
import json
import os
import re
import sys
import tempfile
import time

import jax
import numpy as np

sys.path.insert(0, os.path.dirname(__file__))
from bench import MAKE, checkpoint_path  # noqa: E402
from profile_step import step_inputs  # noqa: E402

from atlas_jax import LLM  # noqa: E402
from atlas_jax.engine.row import RowInput  # noqa: E402

_HOST_EVENTS = ("ThunkExecutor", "Common", "Pjit", "$", "Slinky", "Threadpool", "Allocate", "Handle", "Parse",
                "Python", "Wait", "DevicePut", "end:")


def step_args(runner, batch: int, tokens: int):
    """The `step` arguments for `batch` rows of `tokens` new tokens at position 64 (host arrays): a decode
    step as profile_step.py builds it, or a prefill chunk alone (the prefill-only step: no row decodes)."""
    if tokens == 1:
        return step_inputs(runner, batch, 1, False)[1]
    per_row = runner.max_pages_per_seq
    rows = [RowInput(tokens=[int(t) for t in np.random.default_rng(i).integers(1, runner.cfg.vocab_size, tokens)],
                     start=64, block_table=list(range(1, 1 + per_row)), slot=i, prompt_len=64 + tokens)
            for i in range(batch)]
    return runner.batch.pack((rows,), (runner._prefill_shape(rows),), rows)


def op_kinds(hlo: str, cfg) -> dict[str, str]:
    """thunk (HLO instruction) name -> 'part/op': the part is the layer's kind (from `layer_i` in the op_name
    metadata, or from a `params__layers__i__...` operand for ops XLA left without metadata, such as dots),
    the op is the first jax primitive of the op_name, else the HLO opcode and the parameter it reads."""
    out = {}
    for line in hlo.splitlines():
        m = re.match(r"\s*(?:ROOT )?%(\S+) = (.*)", line)
        op_code = re.search(r"(?:^|\s)([a-z][\w-]*)\(", m.group(2)) if m else None
        if not op_code:
            continue
        name, opcode, rest = m.group(1), op_code.group(1), m.group(2)[op_code.end():]
        op_name = re.search(r'op_name="([^"]+)"', rest)
        param = re.search(r"%params__(\w+?)(?:__)?(?:\.\d+)?[,)]", rest)
        layer = re.search(r"layer_(\d+)/", op_name.group(1)) if op_name else None
        if layer is None and param:
            layer = re.match(r"layers___(\d+)___", param.group(1))
        part = f"{cfg.layer_types[int(layer.group(1))]}_layer" if layer else "model"
        if op_name and "/mtp/" in op_name.group(1):
            part = "mtp_head"
        op = ""
        if op_name:
            op = re.sub(r"^jit\(\w+\)/", "", op_name.group(1))
            op = re.sub(r"(layer_\d+|mtp)/", "", op)
            op = re.sub(r"(/|^)(while|cond|closed_call|body|branch_\d+_fun)(?=/|$)", "", op)
            op = re.sub(r"jit\((\w+)\)", r"\1", op).strip("/").split("/")[0]
        reads = re.sub(r"^layers___\d+___", "", param.group(1)).replace("____", ".").strip("_") if param else ""
        reads = re.sub(r"_+", ".", reads)
        if not op:
            op = f"{opcode}({reads})" if reads else opcode
        elif op == "ffi_call":                       # the CPU kernels: which weight
            op = f"ffi_call({reads})" if reads else op
        out[name] = f"{part}/{op}"
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("ckpt", nargs="?")
    ap.add_argument("--make", choices=sorted(MAKE))
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--tokens", type=int, default=1)
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--top", type=int, default=25)
    ap.add_argument("--num-drafts", type=int, default=0, help="an MTP engine with this many drafts: its verify step "
                    "[batch, 1 + num_drafts] (the head's ops as part mtp_head); with --tokens 1 --verify-off its "
                    "decode step + head")
    ap.add_argument("--verify-off", action="store_true")
    args = ap.parse_args()
    ckpt = checkpoint_path(args.ckpt, args.make)
    spec = {"speculative": {"method": "mtp", "num_drafts": args.num_drafts}} if args.num_drafts else {}
    llm = LLM(ckpt, max_num_seqs=args.batch if args.tokens == 1 else 1, max_model_len=max(256, 64 + args.tokens + 16),
              max_prefill_chunk=max(16, args.tokens), max_prefill_rows=max(1, args.batch if args.tokens > 1 else 1),
              warmup=False, progress=False, compile_cache_dir="", **spec)   # cached executables keep old op names
    runner = llm.runner
    kind = "step"
    if args.num_drafts and args.tokens == 1:
        kind, step, _ = step_inputs(runner, args.batch, 1 if args.verify_off else 1 + args.num_drafts, True)
    else:
        step = step_args(runner, args.batch, args.tokens)
    exe = runner.exes.get(kind, step)

    def call():
        out, runner.state = exe(runner.params, runner.state, *step)
        jax.block_until_ready(out)
    for _ in range(3):
        call()
    times = []
    for _ in range(args.iters):
        t0 = time.perf_counter()
        call()
        times.append(time.perf_counter() - t0)
    trace_dir = tempfile.mkdtemp(prefix="atlas_jax_ops_")
    jax.profiler.start_trace(trace_dir, create_perfetto_trace=True)
    for _ in range(args.iters):
        call()
    jax.profiler.stop_trace()
    path = sorted(glob.glob(f"{trace_dir}/**/*.trace.json.gz", recursive=True))[-1]
    events = [e for e in json.load(gzip.open(path))["traceEvents"]
              if e.get("ph") == "X" and not e["name"].startswith(_HOST_EVENTS)]
    kinds = op_kinds(exe.as_text(), llm.cfg)
    by_thunk, by_kind, count = collections.Counter(), collections.Counter(), collections.Counter()
    for e in _top_level(events):
        us = e["dur"] / args.iters
        by_thunk[e["name"]] += us
        by_kind[kinds.get(e["name"], "model/" + re.sub(r"\.\d+$", "", e["name"]))] += us
    for e in events:
        count[kinds.get(e["name"], "model/" + re.sub(r"\.\d+$", "", e["name"]))] += 1 / args.iters
    total = sum(by_thunk.values())
    print(json.dumps({
        "checkpoint": llm.model_path, "batch": args.batch, "tokens": args.tokens, "step": kind,
        "num_drafts": args.num_drafts,
        "wall_ms": round(1e3 * float(np.median(times)), 3), "wall_min_ms": round(1e3 * float(np.min(times)), 3),
        "traced_thunk_ms": round(total / 1e3, 3), "thunks_per_step": round(sum(count.values())),
        "by_part_ms": {k: [round(v / 1e3, 3), round(count[k])] for k, v in by_kind.most_common(args.top)},
        "top_thunks_ms": {k: round(v / 1e3, 3) for k, v in by_thunk.most_common(args.top)},
    }))


def _top_level(events):
    """Events not nested inside another device event of the same thread (a while's body runs inside it)."""
    out = []
    by_tid = collections.defaultdict(list)
    for e in events:
        by_tid[e["tid"]].append(e)
    for es in by_tid.values():
        es.sort(key=lambda e: (e["ts"], -e["dur"]))
        end = -1.0
        for e in es:
            if e["ts"] >= end:
                out.append(e)
                end = e["ts"] + e["dur"]
    return out


if __name__ == "__main__":
    main()
