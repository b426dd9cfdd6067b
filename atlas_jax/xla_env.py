"""XLA flags the engine needs, set before jax creates its backends (imported first by atlas_jax).

--xla_cpu_enable_concurrency_optimized_scheduler=false: with it on (the default in jaxlib 0.10.2),
XLA:CPU intermittently deadlocks — every thread idle, the step never completes — when a compiled
step of a deep hybrid model (>= 8 GDN + MoE layers, scans in both) is executed a second time.
Reproduced on the 12-layer Qwen3-Next of scripts/bench.py; gone with the flag. CPU-only flag.
"""
import os

_FLAGS = ("--xla_cpu_enable_concurrency_optimized_scheduler=false",)


def apply() -> None:
    current = os.environ.get("XLA_FLAGS", "")
    missing = [f for f in _FLAGS if f.split("=")[0] not in current]
    if missing:
        os.environ["XLA_FLAGS"] = " ".join([current, *missing]).strip()
