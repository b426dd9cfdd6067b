"""atlas_jax.host_memory: an XLA:CPU executable's temp buffer is reused across runs, not faulted in anew.

Each case runs in a fresh interpreter (the glibc settings reach only threads that have not allocated
yet) an executable whose 90 MB temp buffer (a cumulative sum's) is larger than any glibc thread-arena
heap, and counts the page faults of each of twelve runs after the first."""
import json
import os
import subprocess
import sys

import pytest

CODE = """
import json, resource, time
import atlas_jax, jax, jax.numpy as jnp
x = jnp.ones((20_000_000,), jnp.float32)
f = jax.jit(lambda x: jnp.cumsum(x.reshape(2000, 10000), axis=1).sum())
f(x).block_until_ready()
faults = []
for _ in range(12):
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    f(x).block_until_ready()
    faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
    time.sleep(0.05)                     # XLA frees the temp buffer on its worker thread after the result is ready
print(json.dumps({"applied": atlas_jax.host_memory.APPLIED, "faults": faults}))
"""
TEMP_PAGES = 90_000_000 // 4096       # one run's temp buffer in 4 KB pages


def _faults(setting: str) -> dict:
    env = {**os.environ, "ATLAS_JAX_HOST_MALLOC": setting, "JAX_PLATFORMS": "cpu"}
    out = subprocess.run([sys.executable, "-c", CODE], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc malloc settings")
def test_temp_buffers_are_reused_not_faulted_in_every_run():
    kept, system = _faults("keep"), _faults("system")
    assert kept["applied"] and not system["applied"]
    faulted = lambda runs: sum(n > TEMP_PAGES // 2 for n in runs)       # runs that faulted a whole temp buffer in
    assert faulted(system["faults"]) == 12, system                      # glibc's defaults: every run
    # kept: only while the heap grows to its steady size (a few early runs, varying from run to run), then never
    assert faulted(kept["faults"]) <= 6 and faulted(kept["faults"][8:]) == 0, kept
