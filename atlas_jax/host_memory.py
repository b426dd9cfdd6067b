"""Host allocator settings for XLA:CPU, applied when atlas_jax is imported.

Every run of an XLA:CPU executable allocates its temp buffer (114 MB for a batch-32 decode step of the
bench model) with posix_memalign on one of XLA's worker threads. glibc serves a block that large from a
fresh mmap in that thread's arena and unmaps it on free, so every step faults its whole temp buffer in
again: 28k page faults and ~80 ms of kernel time in a 200 ms step (measured, scripts/profile_ops.py).
One arena (the main heap, which grows without bound), no mmap and no trimming keep the freed block for
the next step: the same step then runs with no page faults. The cost: freed host memory stays with the
process (its peak RSS is what it keeps). ATLAS_JAX_HOST_MALLOC=system leaves glibc's defaults alone.
The settings only reach threads that have not allocated yet: import atlas_jax before running any jax
computation (or set the same through GLIBC_TUNABLES=glibc.malloc.arena_max=1:glibc.malloc.mmap_max=0:
glibc.malloc.trim_threshold=2147483647).
"""
from __future__ import annotations

import ctypes
import os
import sys

# mallopt parameters (glibc malloc.h)
M_TRIM_THRESHOLD = -1
M_MMAP_MAX = -4
M_ARENA_MAX = -8
_SETTINGS = ((M_ARENA_MAX, 1), (M_MMAP_MAX, 0), (M_TRIM_THRESHOLD, 2**31 - 1))


def keep_freed_blocks() -> bool:
    """Apply the settings above through glibc's mallopt. False where there is no glibc (macOS, musl) or
    ATLAS_JAX_HOST_MALLOC=system; True when glibc accepted every setting."""
    if not sys.platform.startswith("linux") or os.environ.get("ATLAS_JAX_HOST_MALLOC", "") == "system":
        return False
    try:
        libc = ctypes.CDLL("libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes = (ctypes.c_int, ctypes.c_int)
    return all(mallopt(param, value) == 1 for param, value in _SETTINGS)


APPLIED = keep_freed_blocks()


def memory_maps() -> tuple[int, int] | None:
    """(memory mappings this process holds, the kernel's vm.max_map_count), or None off Linux. Every
    live XLA:CPU executable holds a few hundred mappings (text / rodata / data of its JIT-compiled
    kernels: ~350 for an atlas-tiny step); past the limit XLA's next compile fails to allocate."""
    try:
        with open("/proc/self/maps", "rb") as f:
            held = sum(1 for _ in f)
        with open("/proc/sys/vm/max_map_count") as f:
            return held, int(f.read())
    except (OSError, ValueError):
        return None
