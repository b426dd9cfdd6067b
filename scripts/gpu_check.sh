#!/usr/bin/env bash
# GPU check of the Pallas kernels (issue 5), for a machine with a CUDA GPU and JAX on it:
#   1. the kernel parity tests, compiled for the GPU (ATLAS_JAX_PALLAS_COMPILED=1, not interpreted), and
#      the whole model through the compiled kernels vs the XLA path (tests/test_pallas_model.py, fp32 at
#      HIGHEST matmul precision so TF32 does not flip greedy tokens);
#   2. scripts/bench_kernels.py: achieved bandwidth / throughput of each kernel next to the XLA
#      path and the device's copy bandwidth, as one JSON object (the last line of output).
# Installs what is missing: from wheels carried in .whl/ when there, else from the package index.
# Budget: under 8 minutes (each stage has its own timeout).   Usage: scripts/gpu_check.sh
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 JAX_PLATFORMS=${JAX_PLATFORMS:-cuda}
compiled=1; [ "$JAX_PLATFORMS" = cpu ] && compiled=0     # JAX_PLATFORMS=cpu: a dry run of this script, interpreted

need=$($PY - <<'PY'
import importlib.util
mods = {"jax": "jax", "pytest": "pytest", "hypothesis": "hypothesis", "numpy": "numpy", "torch": "torch",
        "safetensors": "safetensors", "tokenizers": "tokenizers", "jinja2": "jinja2", "tqdm": "tqdm"}
print(" ".join(pkg for mod, pkg in mods.items() if importlib.util.find_spec(mod) is None))
PY
)
if [ -n "$need" ]; then
  echo "installing: $need"
  if [ -d .whl ]; then
    $PY -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl && export PYTHONPATH="$PYTHONPATH:/tmp/site"
  else
    $PY -m pip install -q $need
  fi
fi
$PY -c "import jax; print('jax', jax.__version__, jax.devices())" || exit 1

echo "== compiled kernel parity tests"
ATLAS_JAX_PALLAS_COMPILED=$compiled JAX_DEFAULT_MATMUL_PRECISION=highest timeout 300 \
  $PY -m pytest -q --maxfail=10 -p no:cacheprovider --hypothesis-seed=0 \
  tests/test_pallas_attention.py tests/test_pallas_gdn.py tests/test_pallas_model.py 2>&1 | tail -40
tests_rc=${PIPESTATUS[0]}

echo "== microbenchmarks"
timeout 150 $PY scripts/bench_kernels.py
bench_rc=$?
echo "tests_rc=$tests_rc bench_rc=$bench_rc"
exit $(( tests_rc || bench_rc ))
