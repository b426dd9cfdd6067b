"""Convert an HF checkpoint's params to an orbax-checkpoint copy for fast restarts.

    python scripts/convert.py CKPT [--dtype bfloat16] [--out DIR] [--no-mtp]

Writes DIR/params.orbax (+ params.orbax.json) and copies config/tokenizer files to DIR
(default: DIR = CKPT). `LLM(DIR)` then restores from orbax instead of reading safetensors.
Prints one JSON line: the paths, tensor count, bytes and seconds.
"""
import argparse
import glob
import json
import os
import shutil
import time

import jax

from atlas_jax import ModelConfig
from atlas_jax.engine.llm import resolve_dtype
from atlas_jax.weights import load_params, save_params


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("ckpt")
    ap.add_argument("--out", default=None)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--no-mtp", action="store_true")
    args = ap.parse_args()
    out = args.out or args.ckpt
    os.makedirs(out, exist_ok=True)
    t0 = time.perf_counter()
    cfg = ModelConfig.from_pretrained(args.ckpt)
    params, mtp = load_params(args.ckpt, cfg, resolve_dtype(args.dtype), load_mtp=not args.no_mtp)
    t_load = time.perf_counter() - t0
    path = save_params(out, params, mtp)
    if os.path.abspath(out) != os.path.abspath(args.ckpt):
        for f in glob.glob(os.path.join(args.ckpt, "*.json")):
            if not os.path.basename(f).startswith("model.safetensors"):
                shutil.copy(f, out)
    leaves = jax.tree.leaves(params)
    print(json.dumps({"orbax": path, "tensors": len(leaves), "bytes": sum(x.nbytes for x in leaves),
                      "mtp_layers": mtp, "load_s": round(t_load, 3), "total_s": round(time.perf_counter() - t0, 3)}))


if __name__ == "__main__":
    main()
