"""atlas_jax.host_memory: an XLA:CPU executable's temp buffer is reused across runs, not faulted in anew.

Each case runs in a fresh interpreter (the glibc settings reach only threads that have not allocated
yet) an executable whose 90 MB temp buffer (a cumulative sum's) is larger
than any glibc thread-arena heap, and counts the page faults of five runs after a warm-up (the heap takes a few runs to reach its steady size)."""
import json
import os
import subprocess
import sys

import pytest

CODE = """
import json, resource
import atlas_jax, jax, jax.numpy as jnp
x = jnp.ones((20_000_000,), jnp.float32)
f = jax.jit(lambda x: jnp.cumsum(x.reshape(2000, 10000), axis=1).sum())
for _ in range(8):                       # the heap grows to its steady size
    f(x).block_until_ready()
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(5):
    f(x).block_until_ready()
print(json.dumps({"applied": atlas_jax.host_memory.APPLIED,
                  "faults": resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before}))
"""


def _faults(setting: str) -> dict:
    env = {**os.environ, "ATLAS_JAX_HOST_MALLOC": setting, "JAX_PLATFORMS": "cpu"}
    out = subprocess.run([sys.executable, "-c", CODE], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc malloc settings")
def test_temp_buffers_are_reused_not_faulted_in_every_run():
    kept, system = _faults("keep"), _faults("system")
    assert kept["applied"] and not system["applied"]
    pages = 5 * 80_000_000 // 4096     # the five runs' temp buffers (>= 80 MB each), in 4 KB pages
    assert system["faults"] > pages // 2                  # glibc's defaults: mapped and faulted in every run
    assert kept["faults"] < pages // 20
