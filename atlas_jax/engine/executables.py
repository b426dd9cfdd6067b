"""Compiled steps: built ahead of time per (kind, argument shapes), counted, warmed up in priority order.

`get` compiles on first use (`num_compiles` counts every compilation, so a recompile in serving shows).
`warmup` compiles the maximal shapes of each kind first (buckets.py: together they run any batch),
then the others from the cheapest up — in the caller's thread, or in a background thread while the
engine serves (`choose` then answers a shape still queued with the cheapest compiled shape covering
it). Lowering uses abstract params and state, so a background compile never touches donated arrays.
Each live XLA:CPU executable holds a few hundred memory mappings; warm-up keeps the process under
vm.max_map_count by leaving optional shapes uncompiled (served by covering ones) rather than failing.
"""
from __future__ import annotations

import gc
import logging
import threading
import time

import jax

from ..host_memory import memory_maps
from .buckets import Shape, cost, covers, maximal

log = logging.getLogger("atlas_jax.engine")
MAP_LIMIT_CORE = 0.95        # the maximal shapes may take the process up to this fraction of vm.max_map_count
MAP_LIMIT_OPTIONAL = 0.85    # the others only this far (room for on-demand compiles and other engines)
LOG_EVERY_S = 10.0


class MapBudgetError(RuntimeError):
    """The executables every batch needs would hold more memory mappings than the kernel allows."""


def _aval(x):
    return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=getattr(x, "sharding", None))


class Executables:
    def __init__(self, jitted: dict, params, state):
        """jitted: kind -> jax.jit(fn(params, state, *args)); params: their abstract form (from the param specs),
        state: the arrays (their shapes and shardings are taken)."""
        self.jitted = jitted
        self._abstract = (params, jax.tree.map(_aval, state))
        self._cache: dict[tuple, object] = {}
        self._lock = threading.Lock()
        self.num_compiles = 0
        self.ready: dict[str, list[Shape]] = {}   # kind -> shapes warm-up compiled
        self.deferred: set[tuple[str, Shape]] = set()   # queued for a background warm-up (or skipped for maps)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def get(self, kind: str, args):
        """The compiled `kind` step for these argument shapes (concrete or abstract), compiled on first use."""
        key = (kind,) + tuple((a.shape, a.dtype) for a in jax.tree.leaves(args))   # np / jnp dtypes hash alike
        exe = self._cache.get(key)
        if exe is None:
            exe = self.jitted[kind].lower(*self._abstract, *args).compile()
            with self._lock:
                exe = self._cache.setdefault(key, exe)
                self.num_compiles += 1
        return exe

    def compile(self, kind: str, shape: Shape, abstract_args) -> None:
        self.get(kind, abstract_args(kind, shape))
        self.ready.setdefault(kind, []).append(shape)
        self.deferred.discard((kind, shape))

    def choose(self, kind: str, want: Shape) -> Shape:
        """`want`, unless warm-up has yet to compile it: then the cheapest compiled shape covering it."""
        if (kind, want) not in self.deferred:
            return want
        return min((s for s in list(self.ready.get(kind, ())) if covers(s, want)), key=cost, default=want)

    @property
    def pending(self) -> int:
        """Shapes warm-up has not compiled (yet, or at all: skipped for the map budget)."""
        return len(self.deferred)

    # ---- warm-up ----------------------------------------------------------------------------
    def warmup(self, jobs: list[tuple[str, Shape]], abstract_args, *, background: bool = False,
               progress: bool = False) -> int:
        """Compile `jobs`: each kind's maximal shapes now, the rest now or (background) in a thread.
        abstract_args(kind, shape): the ShapeDtypeStructs of a kind's arguments after (params, state).
        Returns the compilations done before it returns."""
        core = [(k, s) for k, s in jobs if s in maximal([t for kk, t in jobs if kk == k])]
        rest = sorted((j for j in jobs if j not in core), key=lambda j: cost(j[1]))
        self.deferred.update(rest)
        before, maps = self.num_compiles, memory_maps()
        bar = _Progress(len(jobs), progress)
        for i, (kind, shape) in enumerate(core):
            _check_core_budget(maps, i, len(core))
            self.compile(kind, shape, abstract_args)
            bar.update(self.num_compiles - before)
        args = (rest, abstract_args, maps, bar, before)
        if background:
            self._thread = threading.Thread(target=self._compile_rest, args=args,
                                            name="atlas_jax-compile", daemon=True)
            self._thread.start()
        else:
            self._compile_rest(*args)
        return self.num_compiles - before

    def _compile_rest(self, jobs, abstract_args, maps, bar, before) -> None:
        try:
            for n, (kind, shape) in enumerate(jobs):
                if self._stop.is_set():
                    return
                if not _room_for_one(maps, self.num_compiles - before):
                    log.warning("warm-up stops with %d step shapes uncompiled: one more executable would take "
                                "the process past %d%% of vm.max_map_count. Batches of those shapes run "
                                "padded to larger compiled ones (slower); raise the limit (sysctl -w "
                                "vm.max_map_count=262144) to compile them all.", len(jobs) - n,
                                int(100 * MAP_LIMIT_OPTIONAL))
                    return
                self.compile(kind, shape, abstract_args)
                bar.update(self.num_compiles - before)
        except Exception:                # noqa: BLE001 — serving goes on with the shapes compiled so far
            log.exception("background warm-up failed; the remaining shapes run padded to compiled ones")
        finally:
            bar.close()

    def wait(self, timeout: float | None = None) -> bool:
        """Block until a background warm-up is done; False on timeout."""
        if self._thread is not None:
            self._thread.join(timeout)
            return not self._thread.is_alive()
        return True

    def close(self) -> None:
        """Stop a background warm-up after its current compile."""
        self._stop.set()
        self.wait()


def _maps_now():
    """Mappings held now; a collection first frees the executables of dropped engines held in cycles."""
    gc.collect()
    return memory_maps()


def _check_core_budget(before, done: int, total: int) -> None:
    """Raise MapBudgetError once the maximal shapes compiled so far, extrapolated to all `total`, would
    pass MAP_LIMIT_CORE of vm.max_map_count (XLA would otherwise fail, or abort, in a later compile)."""
    if before is None or done < 2:
        return
    held, limit = memory_maps()
    per_exe = max(0, held - before[0]) / done
    if held + per_exe * (total - done) <= MAP_LIMIT_CORE * limit:
        return
    held, limit = _maps_now()
    projected = held + per_exe * (total - done)
    if projected > MAP_LIMIT_CORE * limit:
        raise MapBudgetError(
            f"the {total} step executables every batch needs hold ~{per_exe:.0f} memory mappings each: ~"
            f"{projected:.0f} mappings with what this process already holds, over this machine's "
            f"vm.max_map_count ({limit}). Raise it (sysctl -w vm.max_map_count=262144), drop other engines, "
            f"or use fewer buckets (lower max_num_seqs, max_prefill_rows, max_prefill_chunk or num_drafts).")


def _room_for_one(before, done: int) -> bool:
    """Whether one more executable (of the mean size so far) keeps the process under MAP_LIMIT_OPTIONAL."""
    if before is None or done < 1:
        return True
    held, limit = memory_maps()
    per_exe = max(0, held - before[0]) / done
    if held + per_exe <= MAP_LIMIT_OPTIONAL * limit:
        return True
    held, limit = _maps_now()
    return held + per_exe <= MAP_LIMIT_OPTIONAL * limit


class _Progress:
    """Warm-up progress: a tqdm bar when asked, and a log line (compiled / total, ETA) every LOG_EVERY_S."""

    def __init__(self, total: int, bar: bool):
        from tqdm import tqdm
        self.total, self.t0, self.last = total, time.monotonic(), time.monotonic()
        self.bar = tqdm(total=total, desc="atlas_jax warm-up: compiling", unit="step", disable=not bar)
        self.done = 0

    def update(self, done: int) -> None:
        self.bar.update(done - self.done)
        self.done = done
        now = time.monotonic()
        if now - self.last >= LOG_EVERY_S or done == self.total:
            self.last = now
            eta = (now - self.t0) / max(done, 1) * (self.total - done)
            log.info("warm-up: compiled %d/%d step executables in %.0f s (about %.0f s left)", done, self.total,
                     now - self.t0, eta)

    def close(self) -> None:
        self.bar.close()
