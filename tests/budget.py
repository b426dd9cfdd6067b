"""How much of each randomized (hypothesis) kernel test the default run does.

The default run draws a third of each test's examples (at least 2; a fresh random draw every run, so
runs accumulate coverage; the run's seed is printed at the end and ATLAS_JAX_TEST_SEED=N redraws the same
examples: tests/conftest.py); ATLAS_JAX_THOROUGH=1 draws them all (each example is a fresh compile of an
interpret-mode kernel or a layer, tens of seconds on 2 cores)."""
import os

THOROUGH = os.environ.get("ATLAS_JAX_THOROUGH", "") in ("1", "true")


def examples(n: int) -> int:
    return n if THOROUGH else max(2, -(-n // 3))
