"""JAX's persistent compilation cache, made self-repairing.

A restart loads its compiled steps from `$ATLAS_JAX_HOME/xla_cache` instead of recompiling. JAX's file
cache never replaces an entry (`put` skips a key that exists) and writes in place, so one truncated or
corrupt entry (a crash mid-write, a full disk) would be recompiled, warned about and left as it is on
every start. Here:
- reading an entry that does not load drops it (logged once), so the fresh compile is written in its place;
- entries are written to a temporary file and renamed into place: a reader sees a whole entry or none.
The hooks wrap two functions of jax's compilation_cache module (pinned jax; if they are missing the
cache still works, unrepaired, and a warning says so).
"""
from __future__ import annotations

import logging
import os
import time
import uuid

import jax

log = logging.getLogger("atlas_jax.engine")
_installed = False


def enable_compile_cache(path: str | None) -> None:
    """JAX's persistent compilation cache at `path` ('' / None: off). ATLAS_JAX_DISABLE_COMPILE_CACHE=1
    keeps it off for the whole process."""
    if path and os.environ.get("ATLAS_JAX_DISABLE_COMPILE_CACHE", "") not in ("1", "true"):
        os.makedirs(path, exist_ok=True)
        install_repair()
        jax.config.update("jax_compilation_cache_dir", path)
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
        jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)


def default_compile_cache_dir() -> str:
    home = os.environ.get("ATLAS_JAX_HOME") or os.path.join(os.path.expanduser("~"), ".cache", "atlas_jax")
    return os.path.join(home, "xla_cache")


def _atomic_lru_cache(base: type) -> type:
    """jax's LRUCache with an atomic put (temporary file renamed into place) and drop(key)."""
    class AtomicLRUCache(base):
        def put(self, key: str, value: bytes) -> None:
            path = self.path / f"{key}-cache"
            tmp = self.path / f".{key}.{uuid.uuid4().hex}.tmp"
            if self.eviction_enabled:
                self.lock.acquire(timeout=self.lock_timeout_secs)
            try:
                if path.exists():
                    return
                if self.eviction_enabled:
                    self._evict_if_needed(additional_size=len(value))
                tmp.write_bytes(value)
                os.replace(tmp, path)
                if self.eviction_enabled:
                    (self.path / f"{key}-atime").write_bytes(time.time_ns().to_bytes(8, "little"))
            finally:
                tmp.unlink(missing_ok=True)
                if self.eviction_enabled:
                    self.lock.release()

        def drop(self, key: str) -> None:
            for suffix in ("-cache", "-atime"):
                (self.path / f"{key}{suffix}").unlink(missing_ok=True)

    return AtomicLRUCache


def _dropping_corrupt(read, cc, atomic: type):
    """cc.get_executable_and_time that treats an entry which does not load as a miss and deletes it."""
    def get_executable_and_time(cache_key, *args, **kwargs):
        try:
            return read(cache_key, *args, **kwargs)
        except Exception as e:                             # noqa: BLE001 — a corrupt entry: recompile, rewrite
            cache = cc._cache
            if not isinstance(cache, atomic):
                raise
            log.warning("compile cache entry %s does not load (%s: %s); dropped, the fresh compile replaces it",
                        cache_key, type(e).__name__, str(e)[:200])
            cache.drop(cache_key)
            return None, None
    return get_executable_and_time


def install_repair() -> bool:
    """Hook the repair into jax's cache (idempotent); False when this jax lacks the hooks."""
    global _installed
    if _installed:
        return True
    try:
        from jax._src import compilation_cache as cc
        from jax._src.lru_cache import LRUCache
        read, make = cc.get_executable_and_time, cc.get_file_cache
    except (ImportError, AttributeError) as e:
        log.warning("compile cache repair unavailable on jax %s (%r): corrupt entries stay", jax.__version__, e)
        return False
    atomic = _atomic_lru_cache(LRUCache)

    def get_file_cache(path: str):
        cache, where = make(path)
        if type(cache) is LRUCache:                        # (not the content-verifying wrapper)
            cache.__class__ = atomic
        return cache, where

    cc.get_file_cache, cc.get_executable_and_time = get_file_cache, _dropping_corrupt(read, cc, atomic)
    _installed = True
    return True
