#!/usr/bin/env bash
# One-shot GPU check, sized for a single 10-minute call on the lent machine (jax preinstalled, no
# network). Stages, each under its own timeout, each logged in full to $OUT/<stage>.log:
#   kernel_tests   the Pallas kernel parity tests compiled (ATLAS_JAX_PALLAS_COMPILED=1), not interpreted
#   model_tests    the whole model through the compiled kernels vs the XLA path (fp32, HIGHEST matmuls)
#   bench_kernels  scripts/bench_kernels.py: each kernel's GB/s or TFLOP/s beside XLA and the copy bandwidth
#   bench          scripts/bench.py on the Qwen3-Next-shaped bench model in bf16: decode tokens/s at batch
#                  1 / 8 / 32 / 128, prefill tokens/s, achieved GB/s against the measured copy bandwidth
#   tp             scripts/tp_check.py: with more than one device, tensor parallel over all of them (tokens
#                  against one device, bench-model decode tokens/s side by side); skipped on one device
# Then one JSON object (every stage's rc / seconds / pytest summary and both benchmarks' JSON) goes to
# $OUT/gpu_check.json and is printed as the last line.
# Never installs from a package index: missing modules are installed from wheels carried in .whl/
# (pip --no-index) or reported, and the script stops.
#   Usage: OUT=/some/dir scripts/gpu_check.sh          (JAX_PLATFORMS=cpu: a dry run, interpreted)
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
OUT=${OUT:-/tmp/atlas_jax_gpu_check}
mkdir -p "$OUT"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 JAX_PLATFORMS=${JAX_PLATFORMS:-cuda}
compiled=1; [ "$JAX_PLATFORMS" = cpu ] && compiled=0
quick=""; [ "$compiled" = 0 ] && quick="--quick"

missing=$($PY - <<'PY'
import importlib.util
mods = ["jax", "pytest", "hypothesis", "numpy", "torch", "transformers", "safetensors", "tokenizers", "jinja2",
        "tqdm", "orbax.checkpoint", "fastapi", "prometheus_client"]
print(" ".join(m for m in mods if importlib.util.find_spec(m.split(".")[0]) is None))
PY
)
if [ -n "$missing" ] && [ -d .whl ]; then
  $PY -m pip install -q --no-index --find-links .whl --target "$OUT/site" .whl/*.whl >"$OUT/install.log" 2>&1
  export PYTHONPATH="$PYTHONPATH:$OUT/site"
  missing=$($PY -c "import importlib.util,sys; print(' '.join(m for m in sys.argv[1:] if importlib.util.find_spec(m) is None))" $missing)
fi
if [ -n "$missing" ]; then
  echo "gpu_check: missing Python modules: $missing (no package index here: carry wheels in .whl/)" >&2
  echo "{\"error\": \"missing modules: $missing\"}" | tee "$OUT/gpu_check.json"
  exit 2
fi
$PY -c "import jax; print('jax', jax.__version__, jax.devices())" 2>&1 | tee "$OUT/device.log"

STAGES=()
stage() {   # stage NAME SECONDS CMD...: run, log, record rc and wall time
  local name=$1 limit=$2; shift 2
  local t0=$SECONDS
  echo "== $name (limit ${limit}s)"
  timeout "$limit" "$@" >"$OUT/$name.log" 2>&1
  local rc=$?
  echo "$name rc=$rc $((SECONDS - t0))s"; tail -3 "$OUT/$name.log"
  STAGES+=("$name:$rc:$((SECONDS - t0))")
}

PYTEST=($PY -m pytest -q -p no:cacheprovider --hypothesis-seed=0 --maxfail=20)
stage kernel_tests 140 env ATLAS_JAX_PALLAS_COMPILED=$compiled "${PYTEST[@]}" \
  tests/kernels/test_pallas_attention.py tests/kernels/test_pallas_gdn.py tests/kernels/test_moe.py
stage model_tests 130 env JAX_DEFAULT_MATMUL_PRECISION=highest "${PYTEST[@]}" tests/kernels/test_pallas_model.py
stage bench_kernels 100 $PY scripts/bench_kernels.py $quick
if [ "$compiled" = 1 ]; then
  stage bench 170 $PY scripts/bench.py --make qwen3-next-12l --dtype bfloat16 --batch 1,8,32,128 --prompt 512 --new 64
else
  stage bench 170 $PY scripts/bench.py --make qwen3-next-12l --batch 1,2 --prompt 32 --new 4
fi
stage tp 150 $PY scripts/tp_check.py $([ "$compiled" = 0 ] && echo "--new 4 --batch 2")

$PY - "$OUT" "${STAGES[@]}" <<'PY' | tee "$OUT/gpu_check.json"
import json, os, re, sys
out, stages = sys.argv[1], sys.argv[2:]
result = {"device": open(os.path.join(out, "device.log")).read().strip(), "stages": {}}
for item in stages:
    name, rc, seconds = item.split(":")
    log = open(os.path.join(out, name + ".log"), errors="replace").read()
    entry = {"rc": int(rc), "seconds": int(seconds)}
    summary = re.findall(r"^=*\s*(\d+ (?:passed|failed|error).*?)\s*=*$", log, re.M)
    if summary:
        entry["pytest"] = summary[-1]
        entry["failures"] = re.findall(r"^FAILED (\S+)", log, re.M)[:20]
    for line in reversed(log.strip().splitlines()):
        if line.startswith("{"):
            try:
                entry["json"] = json.loads(line)
            except ValueError:
                pass
            break
    result["stages"][name] = entry
print(json.dumps(result))
PY
